"""Rewards: the math verifier's table of equivalent and wrong forms, exact task rewards, failure reporting."""

from __future__ import annotations

import math

import pytest
import torch

from moe_gspo.rewards import countdown, exact_match, get_reward_fn, math_verify_reward, score_responses
from moe_gspo.tasks import Example

# (gold, response, expected reward)
MATH_TABLE = [
    ("\\frac{1}{2}", "The answer is \\boxed{\\frac12}", 1.0),
    ("\\frac{1}{2}", "$\\boxed{0.5}$", 1.0),
    ("0.5", "so we get \\boxed{1/2}.", 1.0),
    ("42", "The answer is 42.", 1.0),
    ("42", "\\boxed{42.0}", 1.0),
    ("\\sqrt{2}", "\\boxed{\\sqrt 2}", 1.0),
    ("x^2+1", "$1 + x^2$", 1.0),
    ("2\\pi", "\\boxed{2\\pi}", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
    ("42", "\\boxed{41}", 0.0),
    ("\\sqrt{2}", "\\boxed{2}", 0.0),
    ("x^2+1", "$x^2-1$", 0.0),
    ("42", "I do not know", 0.0),
]


@pytest.mark.parametrize("gold,response,expected", MATH_TABLE)
def test_math_verifier_table(gold, response, expected):
    assert math_verify_reward(response, Example("q", gold)) == expected


def test_unparseable_gold_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="cannot be parsed"):
        math_verify_reward("\\boxed{1}", Example("q", "@@@"))
    res = score_responses(math_verify_reward, ["\\boxed{1}", "\\boxed{1}"], [Example("q", "@@@"), Example("q", "1")],
                          warn=False)
    assert math.isnan(res.rewards[0]) and res.rewards[1] == 1.0
    assert res.errors[0].startswith("ValueError") and res.num_errors == 1


def test_exact_and_countdown_rewards():
    ex = Example("12+30=", "42")
    assert exact_match("42", ex) == 1.0 and exact_match(" 42\n", ex) == 1.0
    assert exact_match("420", ex) == 0.0 and exact_match("", ex) == 0.0
    cd = Example("3 5 7->56:", "56", {"numbers": [3, 5, 7], "target": 56})
    assert countdown("(3+5)*7", cd) == 1.0
    assert countdown("7*(5+3)", cd) == 1.0
    assert countdown("56", cd) == 0.0  # numbers not used
    assert countdown("(3+5)*7*1", cd) == 0.0  # extra number
    assert countdown("(3+5)*7+3-3", cd) == 0.0  # number reused
    assert countdown("__import__('os')", cd) == 0.0  # not arithmetic
    assert countdown("7/(5-5)+3", Example("", "", {"numbers": [7, 5, 5, 3], "target": 1})) == 0.0  # div by 0
    assert countdown("(7-5)/4*6", Example("", "3", {"numbers": [7, 5, 4, 6], "target": 3})) == 1.0  # exact fraction


def test_raising_reward_fn_is_caught_counted_and_reported_per_sample():
    def flaky(response, example):
        if response == "boom":
            raise ZeroDivisionError("division by zero in my reward")
        return 1.0 if response == example.answer else 0.0

    exs = [Example("p", "a")] * 4
    with pytest.warns(UserWarning, match="failed on 1/4 samples"):
        res = score_responses(flaky, ["a", "boom", "b", "a"], exs)
    assert res.num_errors == 1
    assert res.valid.tolist() == [True, False, True, True]
    assert math.isnan(res.rewards[1]) and res.rewards[[0, 2, 3]].tolist() == [1.0, 0.0, 1.0]
    assert res.errors[1] == "ZeroDivisionError: division by zero in my reward"
    m = res.metrics()
    assert m["reward/errors"] == 1.0 and m["reward/mean"] == pytest.approx(2 / 3)
    # non-numbers are failures too, never coerced to 0
    res = score_responses(lambda r, e: None if r == "x" else float("nan"), ["x", "y"], exs[:2], warn=False)
    assert res.num_errors == 2 and not res.valid.any() and torch.isnan(res.rewards).all()
    with pytest.raises(ValueError, match="2 responses but 1 examples"):
        score_responses(exact_match, ["a", "b"], exs[:1])


def test_registry_lists_valid_names():
    assert get_reward_fn("math") is math_verify_reward
    with pytest.raises(KeyError, match="valid"):
        get_reward_fn("fuzzy")
