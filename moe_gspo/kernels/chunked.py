"""Exact chunked token_logprobs for any device: the [T, V] logits never exist at once.

Blocks are vocab-major: zT = weight_v @ hidden_c^T is [vc, tc]. On CPU this "NN" GEMM runs about 1.5x faster
than the token-major h @ W^T ("NT", what F.linear does) at LM-head shapes, and the two gradient GEMMs read it
as they are: d weight_v = G^T h_c (NN), d hidden_c += (G^T)^T W_v. One workspace holds the block for the
whole loop (no allocation, hence no page faults, per block).
Forward: each block's fp32 logits are folded into running (max, sum-exp, entropy term, target logit) per token
(online softmax, max starts at -inf). Nothing of size T x V is saved: only lse and entropy [T] fp32.
Backward: recompute each block's logits (2THV), form d loss / d logits in fp32 in place, then two GEMMs
(4THV): 8THV in all against the eager 6THV, the price of not storing logits. Workspace: at most
`chunk_bytes`, whatever T is (see `plan_chunks`). The Triton engine (triton_kernels.py) swaps in fused
kernels for the block work and keeps this loop.
"""
from __future__ import annotations

import torch

from . import vocab_parallel as vp

# fp32 [vc, tc] buffers alive at once in the worst block step (the logits block, a second one for the entropy
# term, and the low-precision GEMM output / gradient copies counted as one more).
_BUFFERS = 3
# Block sides above this are rounded down to a multiple of it: a bf16 block whose row length is not a multiple of
# 8 elements sends cuBLAS to its unaligned fallback kernels, which ran the gradient GEMMs about 4x slower on an H100.
ALIGN = 64


def align_down(n: int, align: int = ALIGN) -> int:
    """n rounded down to a multiple of align when n > align, else n."""
    return n - n % align if n > align else n


def plan_chunks(T: int, V: int, chunk_bytes: int, max_rows: int = 4096, H: int = 0) -> tuple[int, int]:
    """(tokens per chunk, vocab per chunk) so that _BUFFERS fp32 [vc, tc] blocks and an fp32 [H, tc] copy of
    the token chunk fit in chunk_bytes. Sides above ALIGN are multiples of ALIGN.

    Many tokens per block are preferred (up to max_rows, keeping at least 1024 vocab columns when the budget
    allows): d weight = G^T h then has a long reduction and each d weight row is written once per token chunk,
    instead of the weight-sized read-modify-write per small token chunk that whole-vocab rows would cost."""
    elems = max(1, chunk_bytes // 4)
    tc = align_down(max(1, min(T, max_rows, elems // (_BUFFERS * min(V, 1024) + H))))
    return tc, align_down(max(1, min(V, (elems - tc * H) // (_BUFFERS * tc))))


class Workspace:
    """One flat fp32 buffer handed out as [rows, cols] blocks (views), reused across blocks."""

    def __init__(self, numel: int, device):
        self.buf = torch.empty(max(1, numel), device=device)

    @staticmethod
    def reuse(ws: Workspace | None, numel: int, device) -> Workspace:
        """`ws` when it holds at least numel elements (a caller's workspace, shared), else a new one."""
        return ws if ws is not None and ws.buf.numel() >= numel else Workspace(numel, device)

    def block(self, rows: int, cols: int, offset: int = 0) -> torch.Tensor:
        return self.buf[offset:offset + rows * cols].view(rows, cols)


def logits_block(w_VH, hT_HT, inv_temp: float, out=None) -> torch.Tensor:
    """fp32 zT = (w_v @ h_c^T) / temperature, [vc, tc]; written into `out` when given (fp32 inputs)."""
    if w_VH.dtype == torch.float32 and out is not None:
        z = torch.mm(w_VH, hT_HT, out=out)
    else:
        z = torch.mm(w_VH, hT_HT)
        if z.dtype != torch.float32:
            z = out.copy_(z) if out is not None else z.float()
    return z.mul_(inv_temp) if inv_temp != 1.0 else z


def target_coords(local_tgt_T: torch.Tensor, vc: int):
    """(inside mask, row index, column index) of each token's target inside a [vc, tc] block."""
    inside = (local_tgt_T >= 0) & (local_tgt_T < vc)
    return inside, torch.where(inside, local_tgt_T, 0), torch.arange(local_tgt_T.shape[0], device=local_tgt_T.device)


def block_stats(zT_VT: torch.Tensor, local_tgt_T: torch.Tensor, want_entropy: bool, scratch=None):
    """Stats (m, s, sd, zt) over the vocab rows of one fp32 logits block [vc, tc]; zT is overwritten with
    z - m (and, without entropy, exp(z - m)). local_tgt outside [0, vc) -> zt 0. scratch: a [vc, tc] buffer
    for the entropy term."""
    inside, rows, cols = target_coords(local_tgt_T, zT_VT.shape[0])
    zt = torch.where(inside, zT_VT[rows, cols], 0.0)
    m = zT_VT.amax(0)
    d = zT_VT.sub_(m)  # z - m, in place
    if want_entropy:
        e = torch.exp(d, out=scratch) if scratch is not None else torch.exp(d)
        s = e.sum(0)
        sd = e.mul_(d).sum(0)
    else:
        s = d.exp_().sum(0)
        sd = torch.zeros_like(s)
    return m, s, sd, zt


def block_grad_logits(zT_VT, local_tgt_T, lse_T, ent_T, gl_T, ge_T, inv_temp: float, scratch=None):
    """d loss / d (W h^T) for one vocab-major block, fp32, computed in place of zT (fp32 logits / temperature).

    With p = softmax(z): d logp/dz = onehot - p, d entropy/dz = -p (z - E_p[z]) and z - E_p[z] = log p + entropy,
    so G = (gl * onehot - p * (gl + ge * (log p + entropy))) / temperature."""
    d = zT_VT.sub_(lse_T)  # log p
    if ge_T is not None:
        a_T = (gl_T + ge_T * ent_T) * inv_temp
        coef = torch.mul(d, ge_T * inv_temp, out=scratch) if scratch is not None else d.mul(ge_T * inv_temp)
        G = d.exp_().mul_(coef.add_(a_T)).neg_()
    else:
        G = d.exp_().mul_(-gl_T * inv_temp)
    inside, rows, cols = target_coords(local_tgt_T, G.shape[0])
    G.index_put_((rows, cols), torch.where(inside, gl_T * inv_temp, 0.0), accumulate=True)
    return G


def forward_stats(hidden_TH, weight_VH, local_tgt_T, inv_temp, want_entropy, chunk_bytes, ws=None):
    """Local-shard (m, s, sd, zt), each fp32 [T], computed block by block (in `ws` when it is large enough)."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    dev = hidden_TH.device
    m = torch.full((T,), float("-inf"), device=dev)
    s, sd, zt = (torch.zeros(T, device=dev) for _ in range(3))
    tc, vc = plan_chunks(T, V, chunk_bytes, H=H)
    ws = Workspace.reuse(ws, 2 * tc * vc if want_entropy else tc * vc, dev)
    for t0 in range(0, T, tc):
        t1 = min(T, t0 + tc)
        hT = hidden_TH[t0:t1].t().contiguous()
        for v0 in range(0, V, vc):
            v1 = min(V, v0 + vc)
            z = logits_block(weight_VH[v0:v1], hT, inv_temp, out=ws.block(v1 - v0, t1 - t0))
            scratch = ws.block(v1 - v0, t1 - t0, offset=tc * vc) if want_entropy else None
            bm, bs, bsd, bzt = block_stats(z, local_tgt_T[t0:t1] - v0, want_entropy, scratch)
            m[t0:t1], s[t0:t1], sd[t0:t1] = vp.merge_stats(m[t0:t1], s[t0:t1], sd[t0:t1], bm, bs, bsd)
            zt[t0:t1] += bzt
    return m, s, sd, zt


def apply_block_grad(GT_VT, h_TH, w_VH, acc_h_TH, grad_w_VH, first_h: bool, first_w: bool):
    """The two gradient GEMMs of one block: acc_h (fp32 [tc, H]) (+)= G w_v and d weight_v (+)= G^T h_c.

    GT [vc, tc] is fp32 (cast to the input dtype here when that is lower precision); first_h / first_w: those
    rows have not been written yet (mm into them instead of adding). d hidden adds a separate product rather
    than addmm_ into the accumulator: at small shapes torch's CPU addmm_ with a transposed operand sums
    sequentially (1e-5 relative error over 48 vocab chunks of a 262k vocab, against 1e-6 this way)."""
    G = GT_VT if GT_VT.dtype == h_TH.dtype else GT_VT.to(h_TH.dtype)
    if acc_h_TH is not None:
        if first_h and G.dtype == torch.float32:
            torch.mm(G.t(), w_VH, out=acc_h_TH)
        elif first_h:
            acc_h_TH.copy_(torch.mm(G.t(), w_VH))
        else:
            acc_h_TH += torch.mm(G.t(), w_VH)
    if grad_w_VH is not None:
        if first_w:
            torch.mm(G, h_TH, out=grad_w_VH)
        else:
            grad_w_VH.addmm_(G, h_TH)


def backward_grads(hidden_TH, weight_VH, local_tgt_T, lse_T, ent_T, gl_T, ge_T, inv_temp, chunk_bytes,
                   need_h=True, need_w=True, grad_logits_fn=None, ws=None, out_h=None, out_w=None,
                   out_w_written=False):
    """(d hidden [T, H] local partial, d weight [V, H]) by recomputing each block's logits.

    d hidden accumulates over vocab chunks in fp32 per token chunk; d weight accumulates over token chunks in the
    weight's dtype (one rounding per token chunk). grad_logits_fn (the Triton engine) returns G token-major
    [tc, vc] in the input dtype; it is used through its transpose. out_h / out_w: write into these (any dtype
    for out_h) instead of new tensors; out_w_written: add to out_w rather than overwrite it. ws: a workspace to
    reuse when it is large enough."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    dev = hidden_TH.device
    alloc = torch.empty_like if T else torch.zeros_like  # T = 0: no block ever writes them
    grad_h = (out_h if out_h is not None else alloc(hidden_TH)) if need_h else None
    grad_w = (out_w if out_w is not None else alloc(weight_VH)) if need_w else None
    if T == 0 and out_w is not None and not out_w_written:
        grad_w.zero_()
    tc, vc = plan_chunks(T, V, chunk_bytes, H=H)
    if grad_logits_fn is None:
        ws = Workspace.reuse(ws, 2 * tc * vc if ge_T is not None else tc * vc, dev)
    for t0 in range(0, T, tc):
        t1 = min(T, t0 + tc)
        h_c = hidden_TH[t0:t1]
        hT = h_c.t().contiguous() if grad_logits_fn is None else None
        acc_h = torch.empty(t1 - t0, H, device=dev) if need_h else None
        ent_c = ent_T[t0:t1] if ge_T is not None else None
        ge_c = ge_T[t0:t1] if ge_T is not None else None
        for v0 in range(0, V, vc):
            v1 = min(V, v0 + vc)
            w_v = weight_VH[v0:v1]
            if grad_logits_fn is None:
                z = logits_block(w_v, hT, inv_temp, out=ws.block(v1 - v0, t1 - t0))
                scratch = ws.block(v1 - v0, t1 - t0, offset=tc * vc) if ge_T is not None else None
                GT = block_grad_logits(z, local_tgt_T[t0:t1] - v0, lse_T[t0:t1], ent_c, gl_T[t0:t1], ge_c,
                                       inv_temp, scratch)
            else:
                GT = grad_logits_fn(h_c, w_v, local_tgt_T[t0:t1] - v0, lse_T[t0:t1], ent_c, gl_T[t0:t1], ge_c,
                                    inv_temp).t()
            apply_block_grad(GT, h_c, w_v, acc_h, grad_w[v0:v1] if need_w else None, first_h=v0 == 0,
                             first_w=t0 == 0 and not out_w_written)
            del GT
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
