"""Triton kernels of token_logprobs at tiny sizes under TRITON_INTERPRET=1 on CPU (full sizes need a GPU).

Skipped cleanly when triton is not installed. triton decides at import (triton.language) and at jit
decoration whether it interprets, so without CUDA this module sets TRITON_INTERPRET=1 before triton is first
imported; if something imported triton earlier in this process, the tests rerun in a fresh process instead.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moe_gspo.kernels import token_logprobs
from tests.kernel_refs import close, fresh_seed, logprobs_f64

_CPU = not torch.cuda.is_available()
_LATE = _CPU and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if _CPU and not _LATE:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
late = pytest.mark.skipif(_LATE, reason="triton was imported uninterpreted; see test_in_fresh_process")


@pytest.mark.skipif(not _LATE, reason="this process interprets triton already")
def test_in_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
                       env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@late
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 3e-5), (torch.bfloat16, 3e-2)])
def test_triton_matches_float64(dtype, tol):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, H, V = 37, 24, 101  # none a multiple of the 16 x 32 x 16 blocks
    h = (torch.randn(T, H, generator=g) * 0.5).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    t = torch.randint(0, V, (T,), generator=g)
    t[[2, 30]] = -100
    gl, ge = torch.randn(T, generator=g), torch.randn(T, generator=g)
    hg = h.to(_device(), copy=True).requires_grad_()
    wg = w.to(_device(), copy=True).requires_grad_()
    lp, ent = token_logprobs(hg, wg, t.to(_device()), temperature=0.8, return_entropy=True, impl="triton",
                             chunk_bytes=12 * 16 * 64)  # several (token, vocab) blocks in the backward
    (lp * gl.to(lp.device) + ent * ge.to(lp.device)).sum().backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp64, ent64 = logprobs_f64(hd, wd, t, 0.8)
    (lp64 * gl.double() + ent64 * ge.double()).sum().backward()
    close(lp.cpu(), lp64, tol, "triton logp", seed)
    close(ent.cpu(), ent64, tol, "triton entropy", seed)
    close(hg.grad.cpu(), hd.grad, tol, "triton d hidden", seed)
    close(wg.grad.cpu(), wd.grad, tol, "triton d weight", seed)
    assert float(lp[2].detach()) == 0.0 and bool((hg.grad[2] == 0).all())


@late
def test_triton_all_negative_logits_and_no_entropy():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, H, V = 17, 16, 70
    h, w = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    h[:, 0], w[:, 0] = 1.0, -150.0
    t = torch.randint(0, V, (T,), generator=g)
    lp, ent = token_logprobs(h.to(_device()), w.to(_device()), t.to(_device()), impl="triton")
    assert ent is None
    close(lp.cpu(), logprobs_f64(h, w, t)[0], 3e-5, "triton logp at logits ~ -150", seed)


@late
def test_triton_refuses_cpu_without_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA"):
        token_logprobs(torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1]), impl="triton")
