"""Fault tolerance under torchrun (2 CPU ranks, gloo, EP=2): a rank SIGKILLed mid-run, torchrun restarts the job,
the trainer resumes from its newest complete checkpoint, and every metric from then on equals an uninterrupted run."""

from __future__ import annotations

import json

import pytest

from helpers import ROOT, run_torchrun
from test_trainer import TINY, strip_timing


@pytest.mark.slow
def test_sigkill_mid_run_resumes_and_matches_uninterrupted(tmp_path):
    overrides = TINY + ["parallel.ep=2", "train.steps=5", "train.checkpoint_every=2", "train.cold_start_steps=2",
                         "train.keep_checkpoints=1"]
    r = run_torchrun(ROOT / "tests/dist/trainer_fault.py", "--out", tmp_path, "--kill-after", "3", *overrides,
                     torchrun_args=["--max-restarts=1"])
    assert (tmp_path / "run" / "attempts.txt").read_text() == "2"  # it really was killed and restarted
    assert "resumed from" in r.stderr and "step_00000002" in r.stderr
    ref = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    run = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in run] == [1, 2, 3, 4, 5]
    assert [strip_timing(x) for x in run] == [strip_timing(x) for x in ref]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000004"]  # keep 1


@pytest.mark.slow
def test_tp2_fused_logprobs_match_eager_and_an_rl_step_runs(tmp_path):
    overrides = TINY + ["model.num_key_value_heads=2", "parallel.tp=2", "train.steps=1", "train.cold_start_steps=1"]
    run_torchrun(ROOT / "tests/dist/trainer_tp.py", "--out", tmp_path, *overrides)
    assert (tmp_path / "ok").exists()
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["grad_norm"] >= 0 and rec["rollout_probs_diff_max"] < 1e-4  # engine (full weights) == TP=2 trainer
