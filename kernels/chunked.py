"""Exact chunked token_logprobs for any device: the [T, V] logits never exist at once.

Forward: for each (token chunk, vocab chunk) block, logits = hidden_c @ weight_v^T in the input dtype, upcast to
fp32, folded into running (max, sum-exp, entropy term, target logit) per token (online softmax, max starts at -inf).
Nothing of size T x V is saved: only lse and entropy [T] fp32.
Backward: recompute each block's logits (2THV), form d loss / d logits in fp32, then two GEMMs (4THV):
8THV in all against the eager 6THV, the price of not storing logits. Workspace: about `chunk_bytes`, fixed
whatever T is (see `plan_chunks`). The Triton engine (triton_kernels.py) swaps in fused kernels for the
block work and keeps this loop.
"""
from __future__ import annotations

import torch

from . import vocab_parallel as vp

# fp32 [tc, vc] buffers alive at once in the worst block step (logits, exp, a product; +1 for the low-precision
# GEMM output); chunk sizes are chosen so that these fit in chunk_bytes.
_BUFFERS = 3


def plan_chunks(T: int, V: int, chunk_bytes: int, max_rows: int = 4096) -> tuple[int, int]:
    """(tokens per chunk, vocab per chunk) so that _BUFFERS fp32 [tc, vc] blocks fit in chunk_bytes.

    Many tokens per block are preferred (up to max_rows, keeping at least 1024 vocab columns when the budget
    allows): d weight = G^T h then has a long reduction and each d weight row is written once per token chunk,
    instead of the weight-sized read-modify-write per small token chunk that whole-vocab rows would cost."""
    elems = max(1, chunk_bytes // (4 * _BUFFERS))
    tc = max(1, min(T, max_rows, elems // min(V, 1024)))
    return tc, max(1, min(V, elems // tc))


def block_stats(z_TV: torch.Tensor, local_tgt_T: torch.Tensor, want_entropy: bool):
    """Stats (m, s, sd, zt) of one fp32 logits block; z_TV is overwritten. local_tgt outside [0, vc) -> zt 0."""
    vc = z_TV.shape[1]
    inside = (local_tgt_T >= 0) & (local_tgt_T < vc)
    zt = z_TV.gather(1, torch.where(inside, local_tgt_T, 0)[:, None]).squeeze(1)
    zt = torch.where(inside, zt, 0.0)
    m = z_TV.amax(1)
    d_TV = z_TV.sub_(m[:, None])  # z - m, in place
    e_TV = torch.exp(d_TV)
    s = e_TV.sum(1)
    sd = e_TV.mul_(d_TV).sum(1) if want_entropy else torch.zeros_like(s)
    return m, s, sd, zt


def block_grad_logits(z_TV, local_tgt_T, lse_T, ent_T, gl_T, ge_T, inv_temp: float):
    """d loss / d (h W^T) for one block, fp32, computed in place of z_TV (fp32 logits already / temperature).

    With p = softmax(z): d logp/dz = onehot - p, d entropy/dz = -p (z - E_p[z]) and z - E_p[z] = log p + entropy,
    so G = (gl * onehot - p * (gl + ge * (log p + entropy))) / temperature."""
    vc = z_TV.shape[1]
    d_TV = z_TV.sub_(lse_T[:, None])  # log p
    if ge_T is not None:
        a_T = (gl_T + ge_T * ent_T) * inv_temp
        coef_TV = d_TV.mul(ge_T[:, None] * inv_temp).add_(a_T[:, None])
        G_TV = d_TV.exp_().mul_(coef_TV).neg_()
    else:
        G_TV = d_TV.exp_().mul_((-gl_T * inv_temp)[:, None])
    inside = (local_tgt_T >= 0) & (local_tgt_T < vc)
    idx = torch.where(inside, local_tgt_T, 0)[:, None]
    G_TV.scatter_add_(1, idx, torch.where(inside, gl_T * inv_temp, 0.0)[:, None])
    return G_TV


def logits_block(h_TH, w_VH, inv_temp: float) -> torch.Tensor:
    z = torch.mm(h_TH, w_VH.t())
    z = z.float() if z.dtype != torch.float32 else z
    return z.mul_(inv_temp) if inv_temp != 1.0 else z


def forward_stats(hidden_TH, weight_VH, local_tgt_T, inv_temp, want_entropy, chunk_bytes):
    """Local-shard (m, s, sd, zt), each fp32 [T], computed block by block."""
    T, V = hidden_TH.shape[0], weight_VH.shape[0]
    dev = hidden_TH.device
    m = torch.full((T,), float("-inf"), device=dev)
    s, sd, zt = (torch.zeros(T, device=dev) for _ in range(3))
    tc, vc = plan_chunks(T, V, chunk_bytes)
    for t0 in range(0, T, tc):
        t1 = min(T, t0 + tc)
        for v0 in range(0, V, vc):
            v1 = min(V, v0 + vc)
            z = logits_block(hidden_TH[t0:t1], weight_VH[v0:v1], inv_temp)
            bm, bs, bsd, bzt = block_stats(z, local_tgt_T[t0:t1] - v0, want_entropy)
            m[t0:t1], s[t0:t1], sd[t0:t1] = vp.merge_stats(m[t0:t1], s[t0:t1], sd[t0:t1], bm, bs, bsd)
            zt[t0:t1] += bzt
    return m, s, sd, zt


def backward_grads(hidden_TH, weight_VH, local_tgt_T, lse_T, ent_T, gl_T, ge_T, inv_temp, chunk_bytes,
                   need_h=True, need_w=True, grad_logits_fn=None):
    """(d hidden [T, H] local partial, d weight [V, H]) by recomputing each block's logits.

    d hidden accumulates over vocab chunks in fp32 per token chunk; d weight accumulates over token chunks in the
    weight's dtype (addmm rounds once per token chunk)."""
    T, V = hidden_TH.shape[0], weight_VH.shape[0]
    grad_h = torch.zeros_like(hidden_TH) if need_h else None
    grad_w = torch.zeros_like(weight_VH) if need_w else None
    tc, vc = plan_chunks(T, V, chunk_bytes)
    for t0 in range(0, T, tc):
        t1 = min(T, t0 + tc)
        h_c = hidden_TH[t0:t1]
        acc_h = torch.zeros(t1 - t0, hidden_TH.shape[1], device=hidden_TH.device) if need_h else None
        ent_c = ent_T[t0:t1] if ge_T is not None else None
        ge_c = ge_T[t0:t1] if ge_T is not None else None
        for v0 in range(0, V, vc):
            v1 = min(V, v0 + vc)
            w_v = weight_VH[v0:v1]
            if grad_logits_fn is None:
                z = logits_block(h_c, w_v, inv_temp)
                G = block_grad_logits(z, local_tgt_T[t0:t1] - v0, lse_T[t0:t1], ent_c, gl_T[t0:t1], ge_c,
                                      inv_temp)
            else:
                G = grad_logits_fn(h_c, w_v, local_tgt_T[t0:t1] - v0, lse_T[t0:t1], ent_c, gl_T[t0:t1], ge_c,
                                   inv_temp)
            G = G.to(hidden_TH.dtype)
            if need_h:
                acc_h += torch.mm(G, w_v).float() if G.dtype != torch.float32 else torch.mm(G, w_v)
            if need_w:
                grad_w[v0:v1].addmm_(G.t(), h_c)
            del G
        if need_h:
            grad_h[t0:t1] = acc_h
    return grad_h, grad_w


class ChunkedLogprob(torch.autograd.Function):
    """autograd wrapper: (hidden, weight) -> (logp, entropy); engine = "torch" or "triton"."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, targets_T, temperature, ignore_index, process_group, chunk_bytes,
                want_entropy, engine):
        _, world = vp.group_rank_size(process_group)
        V_local = weight_VH.shape[0]
        valid_T = vp.check_targets(targets_T, V_local * world, ignore_index)
        local_tgt_T = torch.where(valid_T, targets_T - vp.vocab_start(V_local, process_group), -1)
        inv_temp = 1.0 / float(temperature)
        if engine == "triton":
            from . import triton_kernels
            stats = triton_kernels.forward_stats(hidden_TH, weight_VH, local_tgt_T, inv_temp, want_entropy)
        else:
            stats = forward_stats(hidden_TH, weight_VH, local_tgt_T, inv_temp, want_entropy, chunk_bytes)
        m, s, sd, zt = vp.allreduce_stats(*stats, process_group)
        logp, ent, lse = vp.finish_stats(m, s, sd, zt, valid_T)
        ctx.save_for_backward(hidden_TH, weight_VH, local_tgt_T, lse, ent, valid_T)
        ctx.cfg = (inv_temp, process_group, chunk_bytes, want_entropy, engine)
        ctx.mark_non_differentiable(ent) if not want_entropy else None
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden_TH, weight_VH, local_tgt_T, lse, ent, valid_T = ctx.saved_tensors
        inv_temp, process_group, chunk_bytes, want_entropy, engine = ctx.cfg
        zero = torch.zeros_like(lse)
        gl = torch.where(valid_T, grad_logp.float(), zero) if grad_logp is not None else zero
        ge = torch.where(valid_T, grad_ent.float(), zero) if (want_entropy and grad_ent is not None) else None
        fn = None
        if engine == "triton":
            from . import triton_kernels
            fn = triton_kernels.grad_logits_block
        grad_h, grad_w = backward_grads(hidden_TH, weight_VH, local_tgt_T, lse, ent, gl, ge, inv_temp, chunk_bytes,
                                        need_h=ctx.needs_input_grad[0], need_w=ctx.needs_input_grad[1],
                                        grad_logits_fn=fn)
        if grad_h is not None:
            grad_h = vp.allreduce_sum_(grad_h, process_group)
        return grad_h, grad_w, None, None, None, None, None, None, None
