"""Loss-fused log-prob path: a loss of the per-token log-probs, its value and the LM head's gradient from one pass
over the logits.

A plain chunked token_logprobs costs 8THV (forward 2, recomputed logits 2, two gradient GEMMs 4). Here each
chunk's fp32 logits stay in the workspace, as one vocab-major block [V, tc], until its loss gradient
d L / d logp_t is known. Chunks are aligned to whole sequences (a sequence-level loss such as GSPO's ratio needs
all of a sequence's tokens):
    zT = W h_c^T  ->  lse, logp  ->  coef_t = dL/dlogp_t  ->  G^T = coef (onehot - softmax) / temp in place
    ->  d hidden_c = G W,  d weight += G^T h_c                                                  (6THV)
The gradients are stored in the forward and handed out by backward (scaled by its incoming gradient).
A sequence longer than the workspace allows takes two passes (8THV) for itself alone.

    fused_logprob_loss(hidden, weight, targets, loss_fn, cu_seqlens=...): any loss that is a sum of parts over
    groups of whole sequences, given as loss_fn(logp_c, b0, b1) -> scalar on the per-token log-probs of
    sequences b0..b1. Its d loss / d logp comes from autograd on those [rows] values, inside the forward,
    before the gradient GEMMs; so the caller's own loss code is the only copy of the math (the trainer passes
    moe_gspo.losses' functions, KL and router-shift weight included). Kernels never import a loss.
It can also return each token's entropy: one more [V, rows] buffer and pass per block. With entropy_in_loss the loss
is a function of the entropies too, loss_fn(logp_c, ent_c, b0, b1) (an entropy bonus), and its d loss / d entropy
enters the same gradient: d entropy / dz = -p (log p + entropy), with p log p read from the (z - m) e block the
entropy's statistics leave behind, so no log is taken of an underflowed probability.
"""
from __future__ import annotations

import math

import torch

from . import chunked
from . import vocab_parallel as vp
from .api import check_inputs, default_chunk_bytes

def _groups(lengths: list[int], max_rows: int):
    """Consecutive sequences packed into token chunks of at most max_rows (a longer sequence stands alone)."""
    out, b0, t0, rows = [], 0, 0, 0
    for b, n in enumerate(lengths):
        if rows and rows + n > max_rows:
            out.append((b0, b, t0, t0 + rows))
            b0, t0, rows = b, t0 + rows, 0
        rows += n
    out.append((b0, len(lengths), t0, t0 + rows))
    return out


def _stats_keeping_exp(zT_VT, local_tgt_T, scratch_VT):
    """chunked.block_stats with the entropy term, leaving exp(z - m) in scratch (the block the gradient is built
    in); zT is overwritten. Returns ((m, s, sd, zt), exp block)."""
    inside, rows, cols = chunked.target_coords(local_tgt_T, zT_VT.shape[0])
    zt = torch.where(inside, zT_VT[rows, cols], 0.0)
    m = zT_VT.amax(0)
    d = zT_VT.sub_(m)
    e = torch.exp(d, out=scratch_VT)
    s = e.sum(0)
    sd = d.mul_(e).sum(0)
    return (m, s, sd, zt), e


class _FusedLoss(torch.autograd.Function):
    """loss = sum over token groups of coef_fn's parts; d hidden and d weight are computed in the forward.

    coef_fn(values_c, b0, b1) -> (loss part, [d loss / d value for each value]) for the tokens of sequences
    b0..b1-1, values_c being (lp_c,), or (lp_c, entropy_c) with entropy_in_loss."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, targets_T, cfg):
        coef_fn, temperature, ignore_index, group, chunk_bytes, want_ent, bounds, ent_in_loss = cfg
        T, V = hidden_TH.shape[0], weight_VH.shape[0]
        dev = hidden_TH.device
        _, world = vp.group_rank_size(group)
        valid = vp.check_targets(targets_T, V * world, ignore_index)
        local_tgt = torch.where(valid, targets_T - vp.vocab_start(V, group), -1)
        inv_temp = 1.0 / temperature
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(T, hidden_TH.shape[1], device=dev) if need_h else None  # fp32
        grad_w = torch.empty_like(weight_VH) if need_w else None  # first group writes it
        logp_T = torch.zeros(T, device=dev)
        ent_T = torch.zeros(T if want_ent else 0, device=dev)
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        # one fp32 [V, rows] block transformed in place (+ the low-precision GEMM output and G copy, + the
        # entropy's second block), and [H, rows]
        nbuf = (1 if hidden_TH.dtype == torch.float32 else 2) + int(want_ent)
        max_rows = chunked.align_down(max(1, chunk_bytes // (4 * (V * nbuf + hidden_TH.shape[1]))))
        groups = [g for g in _groups(lengths, max_rows) if g[3] > g[2]]  # chunks of whole sequences
        # one workspace for the whole call, shared with the two-pass fallback of over-long sequences
        blocks = 2 if want_ent else 1
        need = [blocks * V * (t1 - t0) if t1 - t0 <= max_rows else
                blocks * math.prod(chunked.plan_chunks(t1 - t0, V, chunk_bytes, H=hidden_TH.shape[1]))
                for _, _, t0, t1 in groups]
        ws = chunked.Workspace(max(need, default=0), dev)
        loss = torch.zeros((), device=dev)
        w_written = False
        for b0, b1, t0, t1 in groups:
            h_c, tgt_c, ok_c = hidden_TH[t0:t1], local_tgt[t0:t1], valid[t0:t1]
            rows = t1 - t0
            one_pass = rows <= max_rows
            if one_pass:  # keep the fp32 logits block [V, rows]: 6THV
                e = zblock = chunked.logits_block(weight_VH, h_c.t().contiguous(), inv_temp, out=ws.block(V, rows))
                if want_ent:
                    stats_c, e = _stats_keeping_exp(e, tgt_c, ws.block(V, rows, offset=V * rows))
                else:
                    stats_c = chunked.block_stats(e, tgt_c, False)  # e now holds exp(z - m_local)
                m_local = stats_c[0]
            else:  # a sequence too long for the workspace: two passes, 8THV
                stats_c = chunked.forward_stats(h_c, weight_VH, tgt_c, inv_temp, want_ent, chunk_bytes, ws=ws)
            m, s, sd, zt = vp.allreduce_stats(*stats_c, group)
            lp, ent, lse = vp.finish_stats(m, s, sd, zt, ok_c)
            logp_T[t0:t1] = lp
            if want_ent:
                ent_T[t0:t1] = ent
            part, coefs = coef_fn((lp, ent) if ent_in_loss else (lp,), b0, b1)
            coef, *coef_ent = [torch.where(ok_c, c.float(), 0.0) for c in coefs]
            coef_ent = coef_ent[0] if coef_ent else None
            loss += part
            if not (need_h or need_w):
                continue
            if one_pass:  # G^T = (onehot - p) * coef / temp with p = exp(z - m_local) * exp(m_local - lse)
                gl = coef * inv_temp
                scale = torch.exp(m_local - lse)
                if coef_ent is None:
                    GT = e.mul_(-gl * scale)
                else:  # - p (gl + ge (log p + H)), with p log p = scale ((z - m) e - e (lse - m)) from the stats
                    ge = coef_ent * inv_temp  # zblock holds (z - m) e once the entropy's statistics are taken
                    GT = e.mul_(gl + ge * (ent - (lse - m_local))).addcmul_(zblock, ge).mul_(-scale)
                inside, r_idx, c_idx = chunked.target_coords(tgt_c, V)
                GT.index_put_((r_idx, c_idx), torch.where(inside, gl, 0.0), accumulate=True)
                chunked.apply_block_grad(GT, h_c, weight_VH, grad_h[t0:t1] if need_h else None,
                                         grad_w if need_w else None, first_h=True, first_w=not w_written)
                w_written = True
                del GT, e
            else:
                chunked.backward_grads(h_c, weight_VH, tgt_c, lse, ent if coef_ent is not None else None, coef,
                                       coef_ent, inv_temp, chunk_bytes,
                                       need_h=need_h, need_w=need_w, ws=ws,
                                       out_h=grad_h[t0:t1] if need_h else None, out_w=grad_w,
                                       out_w_written=w_written)
                w_written = w_written or need_w
        if need_w and not w_written:
            grad_w.zero_()
        if need_h:
            grad_h = vp.allreduce_sum_(grad_h, group).to(hidden_TH.dtype)
        ctx.grads = (grad_h, grad_w)  # not save_for_backward: backward scales them in place (no weight-sized copy)
        for t in (logp_T, ent_T):
            ctx.mark_non_differentiable(t)
        return loss, logp_T, ent_T

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.grads is None:
            raise RuntimeError("fused loss: backward can run once per forward (retain_graph is not supported)")
        gh, gw = ctx.grads
        ctx.grads = None
        gh = gh.mul_(grad_loss.to(gh.dtype)) if gh is not None else None
        gw = gw.mul_(grad_loss.to(gw.dtype)) if gw is not None else None
        return gh, gw, None, None


def _check_cu_seqlens(T, cu_seqlens) -> list[int]:
    """The sequence bounds as a host list, checked to rise from 0 to T. A list or a CPU tensor is read on the host;
    a device tensor is read back once (a host sync: pass the bounds as a list where the caller has them)."""
    if cu_seqlens is None:
        raise ValueError("fused_logprob_loss: pass cu_seqlens [B + 1] (padded [B, S] batches: arange(0, B*S+1, S))")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"fused_logprob_loss: cu_seqlens must be 1-D; got shape {tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.tolist()
    bounds = [int(b) for b in cu_seqlens]
    if not bounds or bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"fused_logprob_loss: cu_seqlens must rise from 0 to T={T}; got {bounds}")
    return bounds


def _autograd_coef(loss_fn):
    """coef_fn for _FusedLoss from a scalar loss_fn(*values_c, b0, b1) of per-token [rows] values (the log-probs,
    and the entropies with entropy_in_loss): (the part, its gradient in each value) by autograd."""
    def coef_fn(values, b0, b1):
        with torch.enable_grad():
            leaves = [v.detach().requires_grad_() for v in values]
            part = loss_fn(*leaves, b0, b1)
            grads = (torch.autograd.grad(part, leaves, allow_unused=True) if part.requires_grad
                     else [None] * len(leaves))
        return part.detach().float().reshape(()), [torch.zeros_like(v) if g is None else g
                                                   for v, g in zip(values, grads)]
    return coef_fn


def fused_logprob_loss(hidden, weight, targets, loss_fn, *, cu_seqlens, temperature=1.0, ignore_index=-100,
                       process_group=None, chunk_bytes=None, return_entropy=False, entropy_in_loss=False):
    """Any loss of the per-token log-probs, with the LM head's gradient computed in the forward (6THV).

    hidden [T, H], weight [V_local, H] (vocab shard as in token_logprobs), targets [T] global ids, packed with
    sequence b at tokens cu_seqlens[b]:cu_seqlens[b+1] (a list of ints, or a tensor: on a device, read back once).
    loss_fn(logp_c, b0, b1) -> 0-dim tensor: the part of the loss carried by sequences b0..b1-1, from logp_c, their
    tokens' log-probs (fp32, 0 at ignore_index targets, requires grad). The call splits the sequences into
    consecutive groups that fit the workspace and sums the parts, so the loss must be additive over sequences (a
    denominator fixed in advance, not counted from the tokens it is given). Returns (loss 0-dim fp32, logp [T]
    fp32, entropy [T] fp32 or None), logp and entropy detached. entropy_in_loss: loss_fn(logp_c, ent_c, b0, b1)
    also reads the tokens' entropies (fp32, requires grad), and its gradient in them reaches hidden and weight too
    (the entropy is then returned)."""
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(hidden.device)
    check_inputs(hidden, weight, targets, temperature, chunk_bytes)
    bounds = _check_cu_seqlens(hidden.shape[0], cu_seqlens)
    return_entropy = return_entropy or entropy_in_loss
    cfg = (_autograd_coef(loss_fn), float(temperature), ignore_index, process_group, int(chunk_bytes),
           bool(return_entropy), bounds, bool(entropy_in_loss))
    value, logp, ent = _FusedLoss.apply(hidden, weight, targets, cfg)
    return value, logp.detach(), (ent.detach() if return_entropy else None)
