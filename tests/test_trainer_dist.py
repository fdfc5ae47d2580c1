"""The trainer under torchrun (2 CPU ranks, gloo): a rank SIGKILLed mid-run resumes from its newest checkpoint and
every metric equals an uninterrupted run; a checkpoint written at one TP x EP x DP layout resumes at another (1 rank
-> EP=2 on 2 ranks, TP=2 on 2 ranks -> 1 rank, bf16 TP=2 x EP=2 on 4 ranks -> 1 rank) with every tensor
bit-identical and the schedule continuing. Two of them also change model.experts between the save and the resume
(torch -> grouped, grouped -> megatron): the implementations share one checkpoint format."""

from __future__ import annotations

import json

import pytest

from helpers import ROOT, run_torchrun
from helpers import TINY, strip_timing


@pytest.mark.slow
def test_sigkill_mid_run_resumes_and_matches_uninterrupted(tmp_path):
    # a reward that spreads over a random policy's responses (gradients from step 1, no cold start), and a learning
    # rate at which Adam's bias correction shows: a resume that restored Adam's per-parameter step wrongly (megatron's
    # distributed optimizer shares one) trains differently
    overrides = TINY + ["parallel.ep=2", "train.steps=5", "train.checkpoint_every=2", "train.cold_start_steps=0",
                         "rollout.reward=tests/data/spread_reward.py:compute_score", "train.lr=0.003",
                         "train.keep_checkpoints=1", "train.eval_every=2", "rollout.eval_prompts=6"]
    run_torchrun(ROOT / "tests/dist/trainer_fault.py", "--out", tmp_path, "--kill-after", "3", *overrides,
                 torchrun_args=["--max-restarts=1"])
    assert (tmp_path / "run" / "attempts.txt").read_text() == "2"  # it really was killed and restarted
    said = (tmp_path / "run_said.txt").read_text()
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step_00000002'}" in said, said
    ref = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    run = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in run] == [1, 2, 3, 4, 5]
    assert all(x["grad_norm"] > 0 for x in ref)  # every resumed step had a gradient for Adam to apply
    assert [strip_timing(x) for x in run] == [strip_timing(x) for x in ref]
    # evaluation after steps 2, 4 and the last: the 6 held-out prompts dealt over the 2 data-parallel ranks, once each
    assert [x["step"] for x in run if "eval/accuracy" in x] == [2, 4, 5]
    assert {x["eval/prompts"] for x in run if "eval/prompts" in x} == {6.0}
    # keep 1; the last step is always checkpointed
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000005"]


@pytest.mark.slow
def test_tp2_fused_logprobs_match_eager_and_an_rl_step_runs(tmp_path):
    # a reward that spreads over a random policy's responses: every group has variance, so the step has a gradient
    overrides = TINY + ["model.num_key_value_heads=2", "parallel.tp=2", "train.steps=1", "train.cold_start_steps=1",
                        "train.eval_every=1", "rollout.eval_prompts=5", "rollout.eval_samples=2",
                        "rollout.reward=tests/data/spread_reward.py:compute_score"]
    run_torchrun(ROOT / "tests/dist/trainer_tp.py", "--out", tmp_path, *overrides)
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert float((tmp_path / "ok").read_text()) == rec["reward/mean"]  # the worker's train() returned this step
    assert rec["groups/with_variance"] > 0 and rec["grad_norm"] > 0
    assert rec["rollout_probs_diff_max"] < 1e-4  # engine (full weights) == TP=2 trainer
    # the two TP ranks hold the same held-out responses: counted once
    assert rec["eval/prompts"] == 5 and 0 <= rec["eval/accuracy"] <= rec["eval/pass@2"] <= 1


# the cold start learns the task enough for reward variance, so the RL steps have gradients and Adam moments to check
RESHARD = TINY + ["train.checkpoint_every=2", "train.cold_start_steps=40", "train.cold_start_lr=0.01",
                  "rollout.task_args=max_digits=1,num_operands=2", "train.lr_warmup_steps=8",
                  "model.num_key_value_heads=2"]


def _lrs(run_dir):
    return [json.loads(x)["lr"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _gradients_by_step_2(run_dir) -> bool:
    """Whether a step up to the step-2 checkpoint had a gradient (else its Adam moments are all zero)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return any(r["grad_norm"] > 0 for r in recs if r["step"] <= 2)


@pytest.mark.slow
def test_checkpoint_of_one_rank_resumes_on_two_ranks_with_ep2(tmp_path):
    from moe_gspo.train.loop import train
    from helpers import tiny_cfg

    # 1 rank with the plain-torch expert loop writes step 2; 2 ranks with grouped-GEMM experts resume it
    train(tiny_cfg(*RESHARD[len(TINY):], "train.steps=2", "model.experts=torch"), run_dir=tmp_path / "run")
    run_torchrun(ROOT / "tests/dist/reshard_worker.py", "--run-dir", tmp_path / "run", *RESHARD, "parallel.ep=2",
                 "model.experts=grouped", "train.steps=4")  # checks every tensor after resharding, then trains 3-4
    train(tiny_cfg(*RESHARD[len(TINY):], "train.steps=4"), run_dir=tmp_path / "ref")
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == \
        [1, 2, 3, 4]
    assert _gradients_by_step_2(tmp_path / "run")
    assert _lrs(tmp_path / "run") == _lrs(tmp_path / "ref")  # the warmup went on where it stopped
    m = json.loads((tmp_path / "run" / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert m["world_size"] == 2 and m["layout"]["ep"] == 2


@pytest.mark.slow
def test_checkpoint_of_tp2_resumes_on_one_rank(tmp_path):
    import sys

    from moe_gspo.train.loop import train
    from helpers import tiny_cfg

    run_torchrun(ROOT / "tests/dist/reshard_worker.py", "--run-dir", tmp_path / "run", "--fresh", *RESHARD,
                 "parallel.tp=2", "train.steps=2")
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    from reshard_worker import check_load  # noqa: E402

    cfg = tiny_cfg(*RESHARD[len(TINY):], "train.steps=4")
    assert _gradients_by_step_2(tmp_path / "run")
    assert check_load(cfg, tmp_path / "run") == 2  # bit-identical weights, main params and moments at TP=1
    train(cfg, run_dir=tmp_path / "run", resume=True)
    train(cfg, run_dir=tmp_path / "ref")
    assert _lrs(tmp_path / "run") == _lrs(tmp_path / "ref")
    m = json.loads((tmp_path / "run" / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert m["world_size"] == 1


@pytest.mark.slow
def test_bf16_checkpoint_of_tp2_ep2_on_four_ranks_resumes_on_one_rank(tmp_path):
    """bf16 weights with fp32 main parameters, the distributed optimizer over DP=2, TP=2 x EP=2 on 4 ranks. A run
    stopped after step 1 and resumed there logs exactly what the uninterrupted run logs (the 4-rank layout of
    tests/test_resume_layouts.py). Read back whole at 1 rank, its step-2 checkpoint's every weight, main parameter
    and Adam moment is bit-identical, and the run goes on."""
    import sys

    from moe_gspo.train.loop import train
    from helpers import records, tiny_cfg

    # no warmup, and an lr at which the fp32 main parameters leave the bf16 grid: a load that lost them would go
    # unseen; a reward that spreads over a random policy's responses gives every step a gradient without a cold start
    bf16 = ["model.params_dtype=bfloat16", "train.lr_warmup_steps=0", "train.lr=0.01", "train.cold_start_steps=0",
            "rollout.reward=tests/data/spread_reward.py:compute_score", "train.checkpoint_every=1"]
    run_torchrun(ROOT / "tests/dist/reshard_worker.py", "--run-dir", tmp_path / "run", "--fresh", "--stop", 1,
                 *RESHARD, *bf16, "parallel.tp=2", "parallel.ep=2", "train.steps=2", nproc=4)
    assert [strip_timing(r) for r in records(tmp_path / "run")] == [strip_timing(r) for r in records(tmp_path / "ref")]
    m = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    assert m["world_size"] == 4 and m["layout"]["tp"] == 2 and m["layout"]["ep"] == 2
    assert all(r["grad_norm"] > 0 for r in records(tmp_path / "run"))
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    from reshard_worker import check_load  # noqa: E402

    # written by grouped-GEMM experts (the default), read back by megatron's SequentialMLP
    cfg = tiny_cfg(*RESHARD[len(TINY):], *bf16, "train.steps=4", "model.experts=megatron")
    assert check_load(cfg, tmp_path / "run") == 2
    train(cfg, run_dir=tmp_path / "run", resume=True)
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
