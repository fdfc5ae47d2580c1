"""A run stopped after a checkpoint and resumed logs exactly what the uninterrupted run logs, at every layout: one
process, TP 2, EP 2, DP 2 and TP 2 x EP 2, with megatron's distributed optimizer on and off where data parallelism
gives it something to shard (TP 2 x EP 2 x DP 2 on 4 ranks, bf16: tests/test_trainer_dist.py). Adam's step count travels with the checkpoint and is checked on both sides.

The runs have no cold start and a reward that spreads over a random policy's responses (tests/data/spread_reward.py),
so every RL step has a gradient; lr 0.003 makes Adam's bias correction show in the logged metrics. A resume that
restored the per-parameter step wrongly (megatron's distributed optimizer shares one step tensor between
parameters, see sharded_state.own_steps) differs from the first resumed step on."""

from __future__ import annotations

import types

import pytest
import torch

from helpers import ROOT, TINY, records, run_torchrun, strip_timing, tiny_cfg

RUN = ["rollout.reward=tests/data/spread_reward.py:compute_score", "train.cold_start_steps=0", "train.lr=0.003",
       "train.checkpoint_every=1"]
STOP, STEPS = 1, 2  # two optimizer updates a step: the resumed step's second one runs on the restored Adam state


def _same_after_resume(ref_dir, run_dir):
    ref, run = records(ref_dir), records(run_dir)
    assert [r["step"] for r in run] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > 0 for r in ref)  # every step gave Adam something to apply
    for a, b in zip(ref, run):
        assert strip_timing(b) == strip_timing(a), f"step {a['step']}: " + ", ".join(
            f"{k} {a[k]} vs {b.get(k)}" for k in a if not k.startswith(("time/", "perf/")) and a[k] != b.get(k))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_one_process(tmp_path, tied):
    from moe_gspo.train.loop import train

    run = [*RUN, f"model.tie_word_embeddings={str(tied).lower()}"]
    train(tiny_cfg(*run, f"train.steps={STEPS}"), run_dir=tmp_path / "ref")
    train(tiny_cfg(*run, f"train.steps={STOP}"), run_dir=tmp_path / "run")
    train(tiny_cfg(*run, f"train.steps={STEPS}"), run_dir=tmp_path / "run", resume=True)
    _same_after_resume(tmp_path / "ref", tmp_path / "run")


@pytest.mark.slow
def test_under_torchrun(tmp_path):
    """2 ranks. TP 2 x EP 2 with the distributed optimizer on needs DP 2 beside it, so 4 ranks: that layout is
    tests/test_trainer_dist.py's bf16 4-rank test, which runs the same comparison before resharding to one rank."""
    layouts = ["tp2", "ep2", "dp", "dp_nodist", "tp2_ep2"]  # the optimizer off: DP 2 here, and the layouts without DP
    run_torchrun(ROOT / "tests/dist/resume_worker.py", "--out", tmp_path, "--layouts", ",".join(layouts),
                 "--stop", STOP, "--steps", STEPS, *TINY, *RUN)
    for name in layouts:
        _same_after_resume(tmp_path / name / "ref", tmp_path / name / "run")


def test_a_wrong_adam_step_is_caught():
    """torch's Adam advances each parameter's step tensor in place: two parameters sharing one (what megatron's
    DistributedOptimizer.load_state_dict leaves) count two steps per optimizer step."""
    from moe_gspo.checkpoint.sharded_state import check_steps, own_steps

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    adam = torch.optim.Adam(params, lr=0.1)
    wrapped = types.SimpleNamespace(optimizer=adam)  # the attribute megatron's optimizer wrappers hold it in
    check_steps(wrapped, 0)  # nothing allocated yet
    for _ in range(2):
        sum(p.sum() for p in params).backward()
        adam.step()
    check_steps(wrapped, 2)
    shared = torch.tensor(2.0)
    for state in adam.state.values():
        state["step"] = shared
    check_steps(wrapped, 2)
    adam.step()
    with pytest.raises(RuntimeError, match=r"step counts are \[4\], but the run took 3"):
        check_steps(wrapped, 3)
    shared = torch.tensor(3.0)
    for state in adam.state.values():
        state["step"] = shared
    own_steps(wrapped)  # each parameter its own copy again
    adam.step()
    check_steps(wrapped, 4)
