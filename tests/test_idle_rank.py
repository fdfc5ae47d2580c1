"""The trainer in a job that holds a rank it does not train on (the placement of rollout engines on ranks of their
own): torchrun with 3 ranks, the trainer on ranks 0-1 (EP 2, packed micro-batches), rank 2 idle.

The trainer's groups hold its 2 ranks only, it never waits on the idle rank, no trainer collective runs on the
default group (tests/dist/idle_rank_worker.py refuses one at once), and its metrics equal those of the same trainer
as a 2-rank job of its own. A run that went wrong fails within the worker's 60 s collective timeout, not a hang.
"""

from __future__ import annotations

import json

from helpers import ROOT, free_port, records, strip_timing, run_torchrun

WORKER = ROOT / "tests" / "dist" / "idle_rank_worker.py"
# EP 2 exchanges tokens between the trainer ranks in every MoE layer; a 16-token budget packs one or two rows per
# forward, so the ranks balance their forward counts and pad to each other's token counts (train/micro.py)
OVERRIDES = ["parallel.ep=2", "train.max_tokens_per_micro_batch=16", "train.steps=2"]


def test_the_trainer_beside_an_idle_rank_trains_on_its_own_groups(tmp_path):
    run_torchrun(WORKER, "--store-port", free_port(), "--out", tmp_path / "beside", *OVERRIDES, nproc=3,
                 timeout=300)
    run_torchrun(WORKER, "--out", tmp_path / "alone", *OVERRIDES, nproc=2, timeout=300)
    sizes = json.loads((tmp_path / "beside" / "groups.json").read_text())
    assert sizes == {"world": 2, "dp": 2, "ep": 2, "expert_dp": 1}
    beside, alone = records(tmp_path / "beside"), records(tmp_path / "alone")
    assert [r["step"] for r in beside] == [1, 2] and all(r["grad_norm"] > 0 for r in beside)
    assert [strip_timing(r) for r in beside] == [strip_timing(r) for r in alone]
