"""DAPO's dynamic sampling: groups without reward variance are dropped and refilled from extra rounds."""

from __future__ import annotations

import pytest
import torch

from moe_gspo.rewards.score import RewardResult
from moe_gspo.rollout.batch import RolloutBatch
from moe_gspo.tasks import Example
from moe_gspo.train.dynamic_sampling import Scored, fill_groups

from helpers import tiny_cfg

G = 2


def scored(name: str, rewards: list[float]) -> Scored:
    """A batch of len(rewards) / G groups named name:g; response i is the token 100 + i, routed to expert i."""
    n = len(rewards)
    batch = RolloutBatch([torch.tensor([1, 2])] * n, [torch.tensor([100 + i]) for i in range(n)],
                         [torch.zeros(1)] * n, ["stop"] * n, torch.arange(n), torch.arange(n // G).repeat_interleave(G),
                         routed_experts=[torch.full((1, 1, 1), i, dtype=torch.uint8) for i in range(n)])
    r = torch.tensor(rewards)
    return Scored(batch, [Example(f"{name}:{i // G}", "") for i in range(n)], [f"{name}{i}" for i in range(n)],
                  RewardResult(r, torch.isfinite(r), [None] * n), torch.isfinite(r), torch.zeros(n))


def test_groups_without_variance_are_refilled_in_order_then_completed_by_dropped_ones():
    """Round 0 keeps its groups 0 and 2 (1 and 3 are all 0 or all 1); round 1 gives its groups 1 and 2 with
    variance; 4 prompts are then full. With one round only, the dropped groups 1 and 3 complete the batch."""
    first = scored("a", [0, 1, 0, 0, 1, 0, 1, 1])
    rounds = {1: scored("b", [1, 1, 0, 1, 1, 0, 0, 0]), 2: scored("c", [0, 1] * 4)}
    asked = []

    def more(r):
        asked.append(r)
        return rounds[r]

    out, m = fill_groups(first, more, prompts=4, group_size=G, max_rounds=10, group=None)
    assert asked == [1]
    assert [ex.prompt for ex in out.examples[::G]] == ["a:0", "a:2", "b:1", "b:2"]
    assert out.texts == ["a0", "a1", "a4", "a5", "b2", "b3", "b4", "b5"]
    assert out.rewards.rewards.tolist() == [0, 1, 1, 0, 0, 1, 1, 0] == out.shaped.tolist()
    assert out.batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [int(r.flatten()) for r in out.batch.routed_experts] == [0, 1, 4, 5, 2, 3, 4, 5]
    assert [int(r) - 100 for r in out.batch.response_ids] == [0, 1, 4, 5, 2, 3, 4, 5]
    assert m == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/kept_fraction": 4 / 8,
                 "dynamic_sampling/filler_groups": 0.0}
    short, m = fill_groups(first, more, prompts=4, group_size=G, max_rounds=1, group=None)
    assert asked == [1]  # no second round was asked for
    assert [ex.prompt for ex in short.examples[::G]] == ["a:0", "a:2", "a:1", "a:3"]
    assert m["dynamic_sampling/filler_groups"] == 2.0 and m["dynamic_sampling/rounds"] == 1.0


def test_a_group_with_one_valid_response_or_a_skipped_reward_has_no_variance():
    s = scored("a", [0, float("nan"), 0, 1])
    assert s.with_variance(G) == [False, True]


class _HalfConstant:
    """Wraps a task: prompts whose answer is even score 0 whatever the response (no variance); the others score
    the parity of the response's length."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward_fn(self, response, ex):
        return 0.0 if int(ex.answer) % 2 == 0 else float(len(response) % 2)


def test_a_run_with_dynamic_sampling_trains_on_groups_with_variance_only(tmp_path):
    """rollout.dynamic_sampling=true: every group the step trains on has reward variance, found over extra
    rounds; the rounds and the kept fraction are logged, and the run is deterministic."""
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.loop import train

    cfg = tiny_cfg("rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_rounds=20", "train.steps=2",
                   "rollout.max_new_tokens=4")
    runs = [train(cfg, run_dir=tmp_path / f"r{i}", task=_HalfConstant(task_from_config(cfg.rollout)))
            for i in range(2)]
    m = runs[0]
    assert m["groups/with_variance"] == 1.0 and m["dynamic_sampling/filler_groups"] == 0
    assert m["dynamic_sampling/rounds"] >= 2 and 0 < m["dynamic_sampling/kept_fraction"] < 1
    assert {k: v for k, v in runs[1].items() if not k.startswith(("time/", "perf/"))} == \
        {k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))}
    off = train(tiny_cfg("train.steps=2", "rollout.max_new_tokens=4"), run_dir=tmp_path / "off",
                task=_HalfConstant(task_from_config(cfg.rollout)))
    assert off["groups/with_variance"] < 1.0 and "dynamic_sampling/rounds" not in off


def test_dynamic_sampling_needs_colocated_engines():
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.dynamic_sampling=true needs rollout.placement=colocated"):
        tiny_cfg("rollout.dynamic_sampling=true", "rollout.placement=separate", "rollout.engine_ranks=1")


HALF_CONSTANT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0 if int(ground_truth) % 2 == 0 else float(len(solution_str) % 2)
"""


@pytest.mark.slow
def test_data_parallel_ranks_take_the_same_rounds(tmp_path):
    """Two data-parallel ranks, each with its own prompts and so its own count of groups to refill, run the same
    number of rounds (their engines' calls stay paired) and each trains on groups with variance only."""
    import json

    from helpers import ROOT, TINY, run_torchrun

    rm = tmp_path / "half_constant.py"
    rm.write_text(HALF_CONSTANT)
    run_torchrun(ROOT / "moe_gspo/cli.py", "train", "--config", "configs/train_tiny_cpu.yaml", "--out",
                 tmp_path / "run", *TINY, "train.steps=2", "rollout.max_new_tokens=4", "rollout.dynamic_sampling=true",
                 "rollout.dynamic_sampling_max_rounds=20", f"rollout.reward={rm}:compute_score")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["groups/with_variance"] == 1.0 and r["dynamic_sampling/filler_groups"] == 0
        assert r["dynamic_sampling/rounds"] >= 2


def test_each_reward_functions_figures_are_those_of_the_groups_trained_on():
    """With several reward functions, the per-function means and Nones a step logs are over the samples of the
    batch it trains on, gathered from every round, not those of one round."""
    def with_parts(s: Scored, a: list[float]) -> Scored:
        n = len(a)
        part = RewardResult(torch.tensor(a), torch.tensor([x == x for x in a]), [None] * n,
                            torch.tensor([x != x for x in a]))  # NaN: the function returned None
        s.rewards = RewardResult(s.rewards.rewards, s.rewards.valid, s.rewards.errors, torch.zeros(n, dtype=torch.bool),
                                 {"a": part})
        return s

    nan = float("nan")
    first = with_parts(scored("a", [0, 1, 1, 1]), [5, nan, 7, 7])  # group 0 kept, group 1 dropped
    more = with_parts(scored("b", [0, 1, 0, 0]), [1, 3, 9, 9])  # group 0 kept
    out, _ = fill_groups(first, lambda r: more, prompts=2, group_size=G, max_rounds=5, group=None)
    assert out.rewards.components == {"reward/a/mean": pytest.approx((5 + 1 + 3) / 3), "reward/a/none": 1.0}
    assert first.rewards.components == {"reward/a/mean": pytest.approx(19 / 3), "reward/a/none": 1.0}
