"""Vocab-parallel token_logprobs and fused_policy_loss at TP=2 (torchrun, gloo, CPU) equal one process."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.kernel_refs import fresh_seed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_vocab_parallel_tp2_equals_one_process():
    seed = fresh_seed()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), os.path.join(root, "tests", "dist_kernels_worker.py"), str(seed)]
    r = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "dist kernels OK" in r.stdout, (
        f"seed {seed}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
