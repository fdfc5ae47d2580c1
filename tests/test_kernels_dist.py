"""Vocab-parallel token_logprobs and fused_policy_loss (fused_logprob_loss with a registered loss) at TP=2 (torchrun, gloo, CPU) equal one process."""
from __future__ import annotations

import pytest
from helpers import ROOT, run_torchrun

from tests.kernel_refs import fresh_seed


@pytest.mark.slow
def test_vocab_parallel_tp2_equals_one_process(tmp_path):
    seed = fresh_seed()
    run_torchrun(ROOT / "tests" / "dist_kernels_worker.py", seed, tmp_path / "ok")
    assert (tmp_path / "ok").read_text() == "dist kernels OK at world size 2", f"seed {seed}"
