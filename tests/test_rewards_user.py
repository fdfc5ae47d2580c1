"""Rewards from a user's file (load_reward): verl's, TRL's and this package's conventions, and their errors."""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import pytest

import moe_gspo
from moe_gspo.config import ConfigError, UserError
from moe_gspo.rewards import (REWARD_FNS, RewardFunctionError, UserReward, gsm8k_reward, load_reward,
                              score_responses)
from moe_gspo.tasks import Example

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = os.path.dirname(os.path.abspath(moe_gspo.__file__))

VERL = """
CALLS = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                  "extra_info": extra_info})
    if solution_str == "half":
        return {"score": 0.5, "note": "kept out of the reward"}
    if solution_str == "bool":
        return True
    return 1 if solution_str.strip() == ground_truth else 0
"""

TRL = """
CALLS = []

def reward(prompts, completions, answer=None, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, **kwargs})
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [None if t == "skip" else float(t == a) for t, a in zip(texts, answer)]

def only_level(prompts, completions, level):
    CALLS.append({"level": level})
    return [float(x) for x in level]

def fails_on_boom(prompts, completions, **kwargs):
    return [_check(c) for c in completions]

def _check(text):
    if text == "boom":
        raise ValueError("cannot score 'boom'")
    return 1.0

def wrong_length(prompts, completions, **kwargs):
    return [1.0]

def returns_text(prompts, completions, **kwargs):
    return ["good"] * len(completions)
"""

NATIVE = """
def score(response, example):
    return float(response == example.answer) + example.meta.get("bonus", 0)

def nan_or_none(response, example):
    return {"nan": float("nan"), "none": None, "inf": float("inf")}.get(response, 1.0)
"""

RAISES = """
def score(response, example):
    return _parse(response)

def _parse(text):
    return _ratio(len(text))

def _ratio(n):
    return 1 / (n - 3)
"""

BAD_RETURNS = """
def says_yes(data_source, solution_str, ground_truth, extra_info=None):
    return "yes, this one is correct and I am quite sure about it, really"

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
"""

SIGNATURES = """
def two_args(x, y):
    return 1.0

def both(solution_str, completions):
    return 1.0

def extra_required(data_source, solution_str, ground_truth, extra_info, tokenizer):
    return 1.0

def verl_positional_only(data_source, solution_str, /, ground_truth):
    return 1.0

threshold = 0.5
"""

IMPORT_FAILS = """
import os

def _setting():
    return os.environ["MOE_GSPO_TEST_SURELY_UNSET_VARIABLE"]

THRESHOLD = float(_setting())

def score(response, example):
    return 1.0
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_builtin_names_give_the_builtin_functions():
    for name, fn in REWARD_FNS.items():
        assert load_reward(name) is fn
    assert load_reward("gsm8k") is gsm8k_reward


def test_verl_reward_gets_data_source_ground_truth_extra_info_per_response(tmp_path):
    fn = load_reward(write(tmp_path, "verl_rm.py", VERL) + ":compute_score")
    assert isinstance(fn, UserReward) and fn.batched
    exs = [Example("What is 6*7?", "42", {"data_source": "openai/gsm8k", "extra_info": {"split": "train", "i": 3}}),
           Example("What is 1+1?", "2", {"data_source": "math"}),
           Example("q", "x"), Example("q", "x")]
    res = score_responses(fn, ["42", "3", "half", "bool"], exs)
    assert res.rewards.tolist() == [1.0, 0.0, 0.5, 1.0] and res.num_errors == 0
    calls = fn.fn.__globals__["CALLS"]
    assert calls[0] == {"data_source": "openai/gsm8k", "solution_str": "42", "ground_truth": "42",
                        "extra_info": {"split": "train", "i": 3}}
    assert calls[1] == {"data_source": "math", "solution_str": "3", "ground_truth": "2", "extra_info": None}
    assert calls[2]["data_source"] is None and len(calls) == 4
    assert fn("42", exs[0]) == 1.0  # one response, as Task.reward calls it


def test_trl_reward_gets_prompts_completions_and_columns_once_per_batch(tmp_path):
    path = write(tmp_path, "trl_rm.py", TRL)
    fn = load_reward(path + ":reward")
    exs = [Example("plain prompt", "a", {"level": 1, "topic": "algebra"}),
           Example("user: chat prompt", "b", {"level": 2}, messages=chat("chat prompt")),
           Example("plain prompt", "a", {"topic": "geometry", "level": 3})]
    res = score_responses(fn, ["a", "b", "wrong"], exs)
    assert res.rewards.tolist() == [1.0, 1.0, 0.0]
    (call,) = fn.fn.__globals__["CALLS"]  # one call for the whole batch
    assert call["prompts"] == ["plain prompt", chat("chat prompt"), "plain prompt"]
    assert call["completions"] == ["a", [{"role": "assistant", "content": "b"}], "wrong"]
    assert call["answer"] == ["a", "b", "a"]
    assert call["level"] == [1, 2, 3] and call["topic"] == ["algebra", None, "geometry"]
    assert list(call) == ["prompts", "completions", "answer", "level", "topic"]

    # without **kwargs it gets only the columns it names
    only = load_reward(path + ":only_level")
    assert score_responses(only, ["x", "y", "z"], exs).rewards.tolist() == [1.0, 2.0, 3.0]
    assert only.fn.__globals__["CALLS"][-1] == {"level": [1, 2, 3]}
    with pytest.raises(RewardFunctionError, match="cannot be called with the batch's columns"):
        score_responses(only, ["x"], [Example("q", "a", {"topic": "t"})])


def test_an_installed_modules_function_trls_own_accuracy_reward():
    """`package.module:function`: TRL's accuracy_reward, whose file uses relative imports, on chat prompts with a
    `solution` column, scored by math-verify inside TRL; a module or name that is not there is one line."""
    pytest.importorskip("trl", reason="trl is not installed (the bench extra)")
    fn = load_reward("trl.rewards:accuracy_reward")
    exs = [Example("user: 2+2?", "4", {"solution": "$4$"}, messages=chat("2+2?")),
           Example("user: 3+3?", "6", {"solution": "$6$"}, messages=chat("3+3?"))]
    res = score_responses(fn, ["So it is $\\boxed{4}$.", "So it is $\\boxed{5}$."], exs)
    assert res.rewards.tolist() == [1.0, 0.0]
    with pytest.raises(ConfigError, match="cannot import module 'trl.nosuch'"):
        load_reward("trl.nosuch:accuracy_reward")
    with pytest.raises(ConfigError, match="module trl.rewards has no 'nosuch'"):
        load_reward("trl.rewards:nosuch")


VERL_SCORER = """
    def compute_score(model_output: str, ground_truth: str, timeout_score: float = 0) -> float:
        return 1.0 if model_output.strip().endswith(ground_truth) else timeout_score
"""


def test_a_verl_scorer_is_called_as_verls_dispatcher_calls_it(tmp_path):
    """verl's per-source scorers (math_verify.py's compute_score(model_output, ground_truth), ...) take the response
    and the ground truth positionally, whatever their names."""
    fn = load_reward(write(tmp_path, "math_verify.py", VERL_SCORER) + ":compute_score")
    res = score_responses(fn, ["so 42", "so 41"], [Example("q", "42"), Example("q", "42")])
    assert res.rewards.tolist() == [1.0, 0.0]


def test_none_nan_and_inf_are_nan_rewards_left_to_bad_reward(tmp_path):
    trl = load_reward(write(tmp_path, "trl_rm.py", TRL) + ":reward")
    res = score_responses(trl, ["a", "skip"], [Example("q", "a")] * 2, warn=False)
    assert res.rewards[0] == 1.0 and math.isnan(res.rewards[1]) and res.valid.tolist() == [True, False]
    assert res.errors == [None, "reward function reward returned None"]
    native = load_reward(write(tmp_path, "native_rm.py", NATIVE) + ":nan_or_none")
    with pytest.warns(UserWarning, match="failed on 3/4 samples"):
        res = score_responses(native, ["ok", "nan", "none", "inf"], [Example("q", "a")] * 4)
    assert res.valid.tolist() == [True, False, False, False] and res.rewards[0] == 1.0
    assert res.errors[1:] == ["reward function nan_or_none returned nan", "reward function nan_or_none returned None",
                              "reward function nan_or_none returned inf"]


def test_native_reward_and_a_path_relative_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "rewards").mkdir()
    write(tmp_path, "rewards/native_rm.py", NATIVE)
    monkeypatch.chdir(tmp_path)
    fn = load_reward("rewards/native_rm.py:score")
    assert fn.file == "rewards/native_rm.py"
    res = score_responses(fn, ["a", "b", "a"], [Example("q", "a"), Example("q", "a"), Example("q", "a", {"bonus": 1})])
    assert res.rewards.tolist() == [1.0, 0.0, 2.0]


def test_a_raising_function_stops_the_run_naming_file_function_sample_with_the_users_frames(tmp_path):
    path = write(tmp_path, "raises_rm.py", RAISES)
    fn = load_reward(path + ":score")
    exs = [Example(f"Problem {i}: what is the ratio of the two lengths given in the figure below?", "1")
           for i in range(4)]
    with pytest.raises(RewardFunctionError) as info:
        score_responses(fn, ["a", "bb", "ccc", "dddd"], exs)
    err = info.value
    assert isinstance(err, UserError)
    msg = str(err)
    assert "\n" not in msg
    assert msg == (f"reward function score in {path} raised on sample 3 of 4 (prompt 'Problem 2: what is the ratio "
                   f"of the two lengths given in the...', response 'ccc'): ZeroDivisionError: division by zero")
    detail = err.detail
    assert detail.startswith("Traceback (most recent call last):\n")
    assert detail.rstrip().endswith("ZeroDivisionError: division by zero")
    for frame in ("in score", "in _parse", "in _ratio", "return 1 / (n - 3)"):
        assert frame in detail
    assert detail.count(f'File "{path}"') == 3
    assert PACKAGE_DIR not in detail and "moe_gspo" not in detail


def test_a_batched_function_that_raises_names_the_sample_it_fails_on(tmp_path):
    path = write(tmp_path, "trl_rm.py", TRL)
    fn = load_reward(path + ":fails_on_boom")
    exs = [Example(f"prompt {i}", "a") for i in range(4)]
    with pytest.raises(RewardFunctionError) as info:
        score_responses(fn, ["fine", "fine", "boom", "fine"], exs)
    msg = str(info.value)
    assert msg == (f"reward function fails_on_boom in {path} raised on sample 3 of 4 (prompt 'prompt 2', response "
                   f"'boom'): ValueError: cannot score 'boom'")
    assert "in _check" in info.value.detail and "moe_gspo" not in info.value.detail


@pytest.mark.parametrize("name,returned", [
    ("says_yes", "str 'yes, this one is correct and I am quite sure about it, real..."),  # repr, cut
    ("no_score", "dict without a 'score' key {'acc': 1.0}"),
])
def test_a_return_value_that_is_no_reward_stops_the_run(tmp_path, name, returned):
    path = write(tmp_path, "bad_rm.py", BAD_RETURNS)
    fn = load_reward(f"{path}:{name}")
    with pytest.raises(RewardFunctionError) as info:
        score_responses(fn, ["first", "second"], [Example("What is 2+2?", "4")] * 2)
    assert str(info.value) == (f"reward function {name} in {path} returned {returned} on sample 1 of 2 (prompt "
                               f"'What is 2+2?', response 'first'); expected a number (or None for no reward)")
    assert info.value.detail is None


def test_a_batched_return_of_the_wrong_length_or_type_stops_the_run(tmp_path):
    path = write(tmp_path, "trl_rm.py", TRL)
    exs = [Example("q", "a")] * 3
    with pytest.raises(RewardFunctionError, match=r"wrong_length in .*trl_rm.py returned list \[1.0\] \(1 values\) "
                                                  r"for a batch of 3 responses; expected a list of 3 numbers"):
        score_responses(load_reward(path + ":wrong_length"), ["a", "b", "c"], exs)
    with pytest.raises(RewardFunctionError, match=r"returns_text in .*returned str 'good' on sample 1 of 3"):
        score_responses(load_reward(path + ":returns_text"), ["a", "b", "c"], exs)


def test_a_builtin_reward_that_raises_is_still_a_failed_sample_but_a_user_error_propagates():
    def strict(response, example):
        raise UserError("the data row is broken")

    with pytest.raises(UserError, match="the data row is broken"):
        score_responses(strict, ["a"], [Example("q", "a")])
    res = score_responses(gsm8k_reward, ["#### 1"], [Example("q", "not a number")], warn=False)
    assert res.num_errors == 1 and res.errors[0].startswith("ValueError")


@pytest.mark.parametrize("spec,message", [
    ("nosuch", r"rollout.reward='nosuch' is neither a built-in reward \['boxed', 'countdown', 'exact', 'gsm8k', "
               r"'last_number', 'math'\] nor path/to/file.py:function"),
    ("{tmp}/sig_rm.py", r"rollout.reward='.*/sig_rm.py' names no function: "
                        r"write rollout.reward=.*sig_rm.py:<function>"),
    ("{tmp}/sig_rm.txt:score", r"'.*/sig_rm.txt' is not a Python file \(.py\)"),
    ("{tmp}/sig_rm.py:not-a-name", r"'not-a-name' is not a function name"),
    ("{tmp}/missing.py:score", r"rollout.reward: reward file .*/missing.py not found \(looked for .*/missing.py\)"),
    ("{tmp}/sig_rm.py:nosuch", r"rollout.reward: reward file .*/sig_rm.py has no function 'nosuch'; it defines both, "
                               r"extra_required, two_args, verl_positional_only$"),
    ("{tmp}/sig_rm.py:threshold", r"threshold in reward file .*/sig_rm.py is float 0.5, not a function"),
    ("{tmp}/sig_rm.py:two_args", r"two_args in reward file .*/sig_rm.py: signature two_args\(x, y\) matches none of "
                                 r"the reward conventions: fn\(data_source, solution_str, ground_truth, "
                                 r"extra_info=None\); fn\(prompts, completions, \*\*kwargs\); fn\(response, example\); "
                                 r"fn\(solution, ground_truth\) \(verl's scorers\)"),
    ("{tmp}/sig_rm.py:both", r"signature both\(solution_str, completions\) matches several \(verl, trl\)"),
    ("{tmp}/sig_rm.py:extra_required", r"signature extra_required\(.*tokenizer\) cannot be called as "
                                       r"fn\(data_source, solution_str, ground_truth, extra_info=None\): missing a "
                                       r"required argument: 'tokenizer'"),
    ("{tmp}/sig_rm.py:verl_positional_only", r"verl_positional_only.* cannot be called as fn\(data_source"),
])
def test_config_errors_are_one_line_naming_the_field_and_the_file(tmp_path, spec, message):
    write(tmp_path, "sig_rm.py", SIGNATURES)
    write(tmp_path, "sig_rm.txt", SIGNATURES)
    with pytest.raises(ConfigError, match=message) as info:
        load_reward(spec.format(tmp=tmp_path))
    assert "\n" not in str(info.value) and info.value.detail is None


def test_an_import_that_raises_is_a_config_error_with_the_users_frames(tmp_path, monkeypatch):
    monkeypatch.delenv("MOE_GSPO_TEST_SURELY_UNSET_VARIABLE", raising=False)
    path = write(tmp_path, "import_rm.py", IMPORT_FAILS)
    with pytest.raises(ConfigError) as info:
        load_reward(path + ":score", field="eval.reward")
    assert str(info.value) == (f"eval.reward: importing reward file {path} raised KeyError: "
                               f"'MOE_GSPO_TEST_SURELY_UNSET_VARIABLE'")
    detail = info.value.detail
    assert detail.startswith("Traceback (most recent call last):\n") and "in _setting" in detail
    assert "<module>" in detail and "moe_gspo" not in detail.replace("MOE_GSPO", "") and "frozen" not in detail
    write(tmp_path, "syntax_rm.py", "def score(response, example):\n    return (1.0\n")
    with pytest.raises(ConfigError, match=r"importing reward file .*syntax_rm.py raised SyntaxError: .* \(line 2\)$"):
        load_reward(f"{tmp_path}/syntax_rm.py:score")


def test_the_example_reward_files_load_and_score():
    verl = load_reward(str(REPO / "examples/rewards/verl_gsm8k_reward.py") + ":compute_score")
    exs = [Example("Natalia sold clips ...", "72"), Example("q", "1,234", messages=chat("q"))]
    cot = "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n#### 72"
    assert score_responses(verl, [cot, "#### 1,234."], exs).rewards.tolist() == [1.0, 1.0]
    assert score_responses(verl, ["72", "#### 1,235"], exs).rewards.tolist() == [0.0, 0.0]
    trl = load_reward(str(REPO / "examples/rewards/trl_length_reward.py") + ":reward")
    r = score_responses(trl, ["so 72", "it is 1,234"], exs).rewards.tolist()
    assert r == pytest.approx([1.0 - 5e-4, 1.0 - 11e-4])
    r = score_responses(trl, ["so 172", "x" * 5000], exs).rewards.tolist()
    assert r == pytest.approx([-6e-4, -0.1])



MIXED = """
import math

def parity(prompts, completions, **kwargs):
    return [None if len(c) % 2 else 1.0 for c in completions]

def nan_on_x(response, example):
    return math.nan if response == "x" else 0.25
"""


def test_several_rewards_sum_with_weights_over_the_functions_that_scored_each_sample(tmp_path):
    """TRL's reward_funcs/reward_weights: each sample's reward is sum_i w_i r_i over the functions that returned a
    number for it; None skips that function for that sample; no function scoring it, or one failing on it (NaN),
    leaves the sample without a reward (rollout.bad_reward decides); each function's mean and Nones are logged."""
    from moe_gspo.rewards import WeightedRewards, load_rewards

    path = write(tmp_path, "mixed_rm.py", MIXED)
    fn = load_rewards(["exact", path + ":parity", path + ":nan_on_x"], [2.0, 0.5, -1.0])
    assert isinstance(fn, WeightedRewards) and fn.names == ["exact", "parity", "nan_on_x"]
    exs = [Example("q", "42"), Example("q", "8"), Example("q", "x")]
    res = score_responses(fn, ["42", "7", "x"], exs, warn=False)
    # "42": 2*1 + 0.5*1 - 0.25 = 2.25; "7": 2*0 + (parity: None, odd length) - 0.25 = -0.25; "x": nan_on_x failed
    assert res.rewards[:2].tolist() == [2.25, -0.25] and math.isnan(res.rewards[2])
    assert res.valid.tolist() == [True, True, False]
    assert res.errors[:2] == [None, None] and res.errors[2] == "nan_on_x: reward function nan_on_x returned nan"
    assert res.components == {"reward/exact/mean": pytest.approx(2 / 3), "reward/exact/none": 0.0,
                              "reward/parity/mean": 1.0, "reward/parity/none": 2.0,
                              "reward/nan_on_x/mean": 0.25, "reward/nan_on_x/none": 0.0}
    only = score_responses(load_rewards([path + ":parity", path + ":parity"]), ["ab", "abc"], exs[:2], warn=False)
    assert only.rewards[0] == 2.0 and only.valid.tolist() == [True, False]
    assert only.errors[1] == "none of the reward functions parity_0, parity_1 scored it (each returned None)"
    assert load_rewards("exact") is load_reward("exact")  # one function: itself, with no weights to apply


def test_an_exception_is_a_failure_whatever_its_message_says():
    """A function that raises fails its sample even when the message reads like a None ("... returned None"):
    only a returned None leaves a sample unscored, so with several functions the raising one still voids it."""
    from moe_gspo.rewards import WeightedRewards, get_reward_fn

    def parser(response, example):
        raise ValueError("the parser returned None")

    res = score_responses(WeightedRewards([get_reward_fn("exact"), parser], [1.0, 1.0], ["exact", "parser"]),
                          ["42"], [Example("q", "42")], warn=False)
    assert not bool(res.valid[0]) and res.errors[0] == "parser: ValueError: the parser returned None"
    assert res.components["reward/parser/none"] == 0.0
