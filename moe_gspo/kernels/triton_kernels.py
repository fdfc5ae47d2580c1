"""Triton kernels for token_logprobs on CUDA (and on CPU under TRITON_INTERPRET=1, for tests).

forward_stats: one fused kernel; program (token block, vocab split) walks its vocab range in BV columns,
  computes each logits tile with tl.dot over H, and folds it into fp32 (max, sum-exp, entropy term, target
  logit): the logits never reach memory. The splits' stats are merged with the same formula as the
  vocab-parallel ranks (vocab_parallel.merge_stats).
grad_logits_block: for one (token chunk, vocab chunk) block of chunked.backward_grads, recompute the logits
  tile and write d loss / d logits in the input dtype; the two GEMMs stay with cuBLAS.
Triton is imported lazily and the kernels are built on first use, because `triton.jit` decides at
decoration time whether it interprets.
"""
from __future__ import annotations

import functools
import os

import torch

from . import vocab_parallel as vp


def available() -> bool:
    """True when triton imports."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken triton install raises more than ImportError
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _kernels(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def stats_kernel(h_ptr, w_ptr, tgt_ptr, out_ptr, T, V, H, stride_h, stride_w, v_per_split, inv_temp,
                     BT: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, ENTROPY: tl.constexpr,
                     PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_t * BT + tl.arange(0, BT)
        rmask = rows < T
        tgt = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
        m = tl.full([BT], float("-inf"), tl.float32)
        s = tl.zeros([BT], tl.float32)
        sd = tl.zeros([BT], tl.float32)
        zt = tl.zeros([BT], tl.float32)
        v_lo = pid_s * v_per_split
        v_hi = tl.minimum(V, v_lo + v_per_split)
        for v0 in range(v_lo, v_hi, BV):
            cols = v0 + tl.arange(0, BV)
            cmask = cols < v_hi
            acc = tl.zeros([BT, BV], tl.float32)
            for k0 in range(0, H, BH):
                ks = k0 + tl.arange(0, BH)
                kmask = ks < H
                a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0)
                b = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=cmask[None, :] & kmask[:, None],
                            other=0.0)
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            z = tl.where(cmask[None, :], acc * inv_temp, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 1))
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new[:, None])
            if ENTROPY:
                d = tl.where(cmask[None, :], z - m_new[:, None], 0.0)
                shift = (tl.where(s > 0, m, m_new) - m_new) * s  # 0 before any column, never -inf * 0
                sd = (sd + shift) * alpha + tl.sum(e * d, 1)
            s = s * alpha + tl.sum(e, 1)
            m = m_new
            zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), 1)
        base = out_ptr + pid_s * 4 * T + rows
        tl.store(base, m, mask=rmask)
        tl.store(base + T, s, mask=rmask)
        tl.store(base + 2 * T, sd, mask=rmask)
        tl.store(base + 3 * T, zt, mask=rmask)

    @triton.jit
    def grad_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, a_ptr, b_ptr, g_ptr, T, V, H, stride_h, stride_w, stride_g,
                    inv_temp, BT: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, ENTROPY: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        # G = gl*onehot/temp - p * (a + b * log p), a = (gl + ge*ent)/temp, b = ge/temp
        pid_t = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = pid_t * BT + tl.arange(0, BT)
        cols = pid_v * BV + tl.arange(0, BV)
        rmask = rows < T
        cmask = cols < V
        acc = tl.zeros([BT, BV], tl.float32)
        for k0 in range(0, H, BH):
            ks = k0 + tl.arange(0, BH)
            kmask = ks < H
            a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0)
            b = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=cmask[None, :] & kmask[:, None],
                        other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
        ca = tl.load(a_ptr + rows, mask=rmask, other=0.0)
        logp = acc * inv_temp - lse[:, None]
        p = tl.exp(logp)
        if ENTROPY:
            cb = tl.load(b_ptr + rows, mask=rmask, other=0.0)
            g = -p * (ca[:, None] + cb[:, None] * logp)
        else:
            g = -p * ca[:, None]
        tgt = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
        gl = tl.load(b_ptr + T + rows, mask=rmask, other=0.0)  # gl / temp
        g += tl.where(cols[None, :] == tgt[:, None], gl[:, None], 0.0)
        tl.store(g_ptr + rows[:, None] * stride_g + cols[None, :], g.to(g_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])

    return stats_kernel, grad_kernel


def _check(*ts):
    if not available():
        raise RuntimeError("token_logprobs(impl='triton'): triton is not installed (pip install 'moe-gspo[triton]')")
    if not all(t.is_cuda for t in ts) and not interpreting():
        raise RuntimeError("token_logprobs(impl='triton') needs CUDA tensors, or TRITON_INTERPRET=1 on CPU")


def _blocks(H: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BT, BV, BH, num_warps, num_stages). MOE_GSPO_TRITON_BLOCKS="BT,BV,BH,warps,stages" overrides them (for
    scripts/bench_logprob.py sweeps on a new GPU)."""
    if interpreting():
        return 16, 32, 16, 4, 1
    env = os.environ.get("MOE_GSPO_TRITON_BLOCKS")
    if env:
        bt, bv, bh, nw, ns = (int(x) for x in env.split(","))
        return bt, bv, bh, nw, ns
    if dtype == torch.float32:
        return 64, 128, 64, 4, 3
    return 128, 256, 64, 8, 3  # the fastest of six tried on an H100 at T=16384, H=4096, V=151936 (docs/gpu.md)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact IEEE products, to match the chunked path; bf16/fp16 run on tensor cores anyway
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    # triton 3.7's interpreter computes tl.dot wrongly on bf16/fp16 operands: feed it fp32 copies (same values)
    return interpreting() and dtype != torch.float32


def forward_stats(hidden_TH, weight_VH, local_tgt_T, inv_temp, want_entropy):
    """Local-shard (m, s, sd, zt), fp32 [T] each, from one fused kernel launch."""
    _check(hidden_TH, weight_VH)
    stats_kernel, _ = _kernels(interpreting())
    import triton

    h = hidden_TH.contiguous()
    w = weight_VH.contiguous()
    T, H = h.shape
    V = w.shape[0]
    BT, BV, BH, nw, ns = _blocks(H, h.dtype)
    n_tblocks = triton.cdiv(T, BT)
    # enough programs to fill the GPU when T is small: split the vocab, merge the splits afterwards
    target_programs = 4 if interpreting() else 4 * 132
    splits = max(1, min(triton.cdiv(V, BV), target_programs // n_tblocks))
    v_per_split = triton.cdiv(triton.cdiv(V, splits), BV) * BV
    splits = triton.cdiv(V, v_per_split)
    out = torch.empty(splits, 4, T, device=h.device, dtype=torch.float32)
    tgt = local_tgt_T.to(torch.int32).contiguous()
    stats_kernel[(n_tblocks, splits)](h, w, tgt, out, T, V, H, h.stride(0), w.stride(0), v_per_split, inv_temp,
                                      BT=BT, BV=BV, BH=BH, ENTROPY=bool(want_entropy),
                                      PRECISION=_precision(h.dtype), UPCAST=_upcast(h.dtype),
                                      num_warps=nw, num_stages=ns)
    m, s, sd, zt = out[0].unbind(0)
    for k in range(1, splits):
        m, s, sd = vp.merge_stats(m, s, sd, out[k, 0], out[k, 1], out[k, 2])
        zt = zt + out[k, 3]
    return m, s, sd, zt


def grad_logits_block(h_TH, w_VH, local_tgt_T, lse_T, ent_T, gl_T, ge_T, inv_temp):
    """d loss / d (h W^T) for one block, in the input dtype; same contract as chunked.block_grad_logits."""
    _check(h_TH, w_VH)
    _, grad_kernel = _kernels(interpreting())
    import triton

    h = h_TH.contiguous()
    w = w_VH.contiguous()
    T, H = h.shape
    V = w.shape[0]
    BT, BV, BH, nw, ns = _blocks(H, h.dtype)
    if ge_T is not None:
        a = ((gl_T + ge_T * ent_T) * inv_temp).contiguous()
        b = torch.stack([ge_T * inv_temp, gl_T * inv_temp]).contiguous()
    else:
        a = (gl_T * inv_temp).contiguous()
        b = torch.stack([torch.zeros_like(gl_T), gl_T * inv_temp]).contiguous()
    G = torch.empty(T, V, device=h.device, dtype=h.dtype)
    tgt = local_tgt_T.to(torch.int32).contiguous()
    grad_kernel[(triton.cdiv(T, BT), triton.cdiv(V, BV))](
        h, w, tgt, lse_T.contiguous(), a, b, G, T, V, H, h.stride(0), w.stride(0), G.stride(0), inv_temp,
        BT=BT, BV=BV, BH=BH, ENTROPY=ge_T is not None, PRECISION=_precision(h.dtype), UPCAST=_upcast(h.dtype),
        num_warps=nw, num_stages=ns)
    return G
