"""Rewards: the math verifier's table of equivalent and wrong forms, exact task rewards, GSM8K's `####` and
`\\boxed{}` answers, failure reporting."""

from __future__ import annotations

import math

import pytest
import torch

from moe_gspo.rewards import (boxed_reward, countdown, exact_match, get_reward_fn, gsm8k_reward, math_verify_reward,
                              score_responses)
from moe_gspo.rewards.text import last_boxed, last_number_reward
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


GSM8K_COT = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
             "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n")

# (gold, response, expected reward)
GSM8K_TABLE = [
    ("72", GSM8K_COT + "#### 72", 1.0),
    ("72", GSM8K_COT + "#### 72.", 1.0),  # trailing period
    ("72", GSM8K_COT + "####72", 1.0),
    ("72", "#### 72.00", 1.0),  # compared as numbers
    ("1,234", "The total is 1,234 dollars.\n#### 1,234", 1.0),
    ("1234", "#### $1,234", 1.0),  # commas and dollar sign dropped
    ("1,234", "#### 1234", 1.0),
    ("-3", "The temperature fell to -3.\n#### -3", 1.0),
    ("18", "First guess:\n#### 20\nWait, I double counted.\n#### 18", 1.0),  # the last #### counts
    ("20", "First guess:\n#### 20\nWait, I double counted.\n#### 18", 0.0),
    ("72", GSM8K_COT + "The answer is 72.", 0.0),  # no ####: strict
    ("72", GSM8K_COT + "#### seventy-two", 0.0),
    ("72", GSM8K_COT + "#### 27", 0.0),
    ("72", "#### 172", 0.0),
    ("72", "", 0.0),
]


@pytest.mark.parametrize("gold,response,expected", GSM8K_TABLE)
def test_gsm8k_table(gold, response, expected):
    assert gsm8k_reward(response, Example("q", gold)) == expected
    assert get_reward_fn("gsm8k") is gsm8k_reward


# (text, content of its last box)
BOXED_EXTRACT = [
    ("so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}} is the answer", "\\frac{\\sqrt{3}}{2}"),
    ("first \\boxed{3}, then corrected: \\boxed{4}", "4"),
    ("$\\boxed 5$", "5"),
    ("\\boxed {7}", "{7}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{\\frac{1}{2}", None),  # unclosed
    ("the answer is 5", None),
    ("\\boxed", None),
]


@pytest.mark.parametrize("text,content", BOXED_EXTRACT)
def test_last_boxed(text, content):
    assert last_boxed(text) == content


LATEX_COT = ("We have $2x + 1 = 2$, so $2x = 1$.\n"
             "Dividing both sides by $2$ gives\n\\[\n  x = \\frac{1}{2}.\n\\]\n")

# (gold, response, expected reward)
BOXED_TABLE = [
    ("\\frac{1}{2}", LATEX_COT + "Therefore the answer is $\\boxed{\\frac{1}{2}}$.", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}", 1.0),
    ("\\frac12", "\\boxed{\\frac{1}{2}}", 0.0),  # no LaTeX parsing: a different string
    ("0.5", "\\boxed{0.50}", 1.0),  # numbers compare as numbers
    ("1234", "\\boxed{1,234}", 1.0),
    ("0.5", "\\boxed{1/2}", 0.0),  # no symbolic equivalence
    ("(1,2)", "\\boxed{\\left( 1, 2 \\right)}", 1.0),
    ("x^2+1", "\\boxed{x^2 + 1.}", 1.0),
    ("3\\sqrt{2}", "\\boxed{3\\!\\sqrt{2}}", 1.0),
    ("5", "$\\boxed 5$.", 1.0),
    ("\\boxed{4}", "so \\boxed{4}", 1.0),  # a boxed gold answer
    ("4", "first \\boxed{4}, no wait: \\boxed{5}", 0.0),
    ("\\frac{1}{2}", LATEX_COT + "so x = 1/2", 0.0),  # no box
]


@pytest.mark.parametrize("gold,response,expected", BOXED_TABLE)
def test_boxed_table(gold, response, expected):
    assert boxed_reward(response, Example("q", gold)) == expected
    assert get_reward_fn("boxed") is boxed_reward


# (gold, response, expected reward): the last number standing alone decides
LAST_NUMBER_TABLE = [
    ("-4", "To calculate -8 / 2, we divide: -8 / 2 = -4.", 1.0),
    ("-4", "-4", 1.0),
    ("2.5", "It is 2.50", 1.0),  # compared as numbers
    ("1234", "The total is 1,234", 1.0),
    ("+5", "answer: 5", 1.0),
    ("32", "4 * -8 = 32", 1.0),  # a wrong answer is still the answer read
    ("-32", "4 * -8 = 32", 0.0),
    ("-4", "To calculate -8 / 2, we need to perform the division", 0.0),  # stopped before answering: 2 is last
    ("7", "7 is what 3 + 4 gives.", 0.0),  # talked on past the answer
    ("3", "the 3rd step", 0.0),  # glued to a word
    ("2", "x2", 0.0),
    ("5", "", 0.0),
]


@pytest.mark.parametrize("gold,response,expected", LAST_NUMBER_TABLE)
def test_last_number_table(gold, response, expected):
    assert last_number_reward(response, Example("q", gold)) == expected
    assert get_reward_fn("last_number") is last_number_reward


def test_text_rewards_report_a_gold_answer_they_cannot_use():
    res = score_responses(gsm8k_reward, ["#### 3", "#### 3"], [Example("q", "three"), Example("q", "3")], warn=False)
    assert res.errors[0] == "ValueError: gold answer 'three' is not a number" and res.rewards[1] == 1.0
    with pytest.raises(ValueError, match="empty"):
        boxed_reward("\\boxed{1}", Example("q", " $ "))


def test_dapos_soft_overlong_penalty_by_hand():
    """max 16 tokens, buffer 4, factor 1: nothing up to 12 tokens, then -1/4 per token to -1 at 16 (DAPO eq. 13)."""
    from moe_gspo.rewards.text import overlong_penalty

    got = overlong_penalty(torch.tensor([3.0, 12.0, 13.0, 14.0, 16.0]), 16, 4, 1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(torch.tensor([16.0]), 16, 4, 0.5).tolist() == [-0.5]
    assert overlong_penalty(torch.tensor([16.0]), 16, 0, 1.0).tolist() == [0.0]


def test_a_run_with_the_overlong_penalty_and_truncated_responses_masked(tmp_path):
    """The penalty is added to every reward (its mean logged; the accuracy counts the unpenalized reward) and with
    rollout.mask_truncated every response cut at max_new_tokens leaves the loss: at 2 new tokens from a random policy
    that is every response, so nothing is trained."""
    from helpers import records, tiny_cfg

    from moe_gspo.train.loop import train

    run = ["train.cold_start_steps=0", "rollout.reward=tests/data/spread_reward.py:compute_score",
           "rollout.max_new_tokens=2", "train.steps=1", "train.minibatches=1"]
    train(tiny_cfg(*run, "rollout.overlong_buffer=2", "rollout.overlong_penalty=0.5"), run_dir=tmp_path / "a")
    (m,) = records(tmp_path / "a")
    # the buffer is the whole budget: the penalty is -0.5 * L / 2 for a response of L tokens
    assert m["reward/overlong_penalty"] == pytest.approx(-0.25 * m["response_length/mean"], rel=1e-6)
    train(tiny_cfg(*run, "rollout.mask_truncated=true"), run_dir=tmp_path / "b")
    (m,) = records(tmp_path / "b")
    assert m["response/truncated"] == 1.0 and m["grad_norm"] == 0.0
