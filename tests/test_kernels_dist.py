"""Vocab-parallel token_logprobs and fused_policy_loss at TP=2 (torchrun, gloo, CPU) equal one process."""
from __future__ import annotations

import pytest
from helpers import ROOT, run_torchrun

from tests.kernel_refs import fresh_seed


@pytest.mark.slow
def test_vocab_parallel_tp2_equals_one_process():
    seed = fresh_seed()
    r = run_torchrun(ROOT / "tests" / "dist_kernels_worker.py", seed, timeout=240)
    assert "dist kernels OK" in r.stdout, f"seed {seed}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
