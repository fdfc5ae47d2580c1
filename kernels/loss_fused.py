"""Loss-fused policy-gradient path: GSPO / GRPO loss value and its gradient from one pass over the logits.

A plain chunked token_logprobs costs 8THV (forward 2, recomputed logits 2, two gradient GEMMs 4). Here each
token chunk's fp32 logits stay in the workspace, as one vocab-major block [V, tc], until its loss gradient
d L / d logp_t is known. For GSPO the chunks are aligned to whole sequences (a sequence's ratio needs all its
tokens); GRPO's gradient is per token once each sequence's response length is counted, so its chunks are any
max_rows tokens:
    zT = W h_c^T  ->  lse, logp  ->  coef_t = dL/dlogp_t  ->  G^T = coef (onehot - softmax) / temp in place
    ->  d hidden_c = G W,  d weight += G^T h_c                                                  (6THV)
The gradients are stored in the forward and handed out by backward (scaled by its incoming gradient).
A GSPO sequence longer than the workspace allows takes two passes (8THV) for itself alone.

Two entry points share that machinery:
  fused_logprob_loss(hidden, weight, targets, loss_fn, cu_seqlens=...): any loss that is a sum of parts over
    groups of whole sequences, given as loss_fn(logp_c, b0, b1) -> scalar on the per-token log-probs of
    sequences b0..b1. Its d loss / d logp comes from autograd on those [rows] values, inside the forward,
    before the gradient GEMMs; so the caller's own loss code is the only copy of the math (the trainer passes
    moe_gspo.losses' functions, KL and router-shift weight included). Kernels never import a loss.
  fused_policy_loss(..., loss="gspo" | "gspo_token" | "grpo"): standalone formulas with analytic gradients, for
    benchmarks and users without moe_gspo.losses; tests pin them to moe_gspo.losses in value and gradient.
    gspo: s_i = exp(mean_t(logp - old_logp) over response tokens), L = -1/N sum_i min(s_i A_i, clip(s_i) A_i)
    gspo_token: s_{i,t} = sg[s_i] pi_t / sg[pi_t]: the value and gradient of gspo, except that the clamp acts on
      the detached s_i (a clamped sequence still has a gradient)
    grpo: w_t = exp(logp_t - old_logp_t), L = -1/N sum_i 1/|y_i| sum_t min(w_t A_i, clip(w_t) A_i)
  clip(x) = clamp(x, 1 - clip_low, 1 + clip_high); N = num_sequences, the global denominator (default: this
  call's sequences with at least one response token); log-ratios are clamped to +-20 before exp.
Both can also return each token's entropy (a metric, no gradient): one more [V, rows] buffer and pass per block.
"""
from __future__ import annotations

import math

import torch

from . import chunked
from . import vocab_parallel as vp
from .api import check_inputs, default_chunk_bytes, token_logprobs
from .reduce import segment_ids

DEFAULT_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
LOG_RATIO_CLAMP = 20.0  # |log-ratio| clamped before exp, as moe_gspo.losses does (no gradient beyond it)


def _clip_terms(ratio, adv, clip_low, clip_high):
    """(-min(surr1, surr2), active, clipped).

    active: where d loss / d ratio = -adv under torch.minimum/clamp autograd (inside the clip range, or the
    unclipped branch strictly smaller); clipped: the clipped branch is taken (surr2 < surr1)."""
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    inside = (ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)
    return -torch.minimum(surr1, surr2), inside | (surr1 < surr2), surr2 < surr1


def gspo_coef(logp_T, old_T, mask_T, seg_T, adv_B, denom, clip_low, clip_high, log_ratio_clamp=LOG_RATIO_CLAMP,
              token_level=False):
    """GSPO over whole sequences: (loss sum / denom, d loss / d logp [T], clipped tokens, ratio sum over seqs).

    token_level=True is GSPO-token with A_{i,t} = A_i: same value and gradient, but the clamp of the log-ratio
    acts on the detached s_i, so it never removes the gradient."""
    B = adv_B.shape[0]
    m = mask_T.to(logp_T.dtype)  # the log-probs' precision throughout (fp32 in the kernel, fp64 in tests)
    count = m.new_zeros(B).index_add(0, seg_T, m)
    r = m.new_zeros(B).index_add(0, seg_T, (logp_T - old_T) * m) / count.clamp(min=1.0)
    s = torch.exp(r.clamp(-log_ratio_clamp, log_ratio_clamp))
    loss_B, active, clipped = _clip_terms(s, adv_B, clip_low, clip_high)
    has = count > 0
    dL_ds = torch.where(active & has & (token_level | (r.abs() <= log_ratio_clamp)), -adv_B / denom, 0.0)
    coef_T = (dL_ds * s / count.clamp(min=1.0))[seg_T] * m
    clipped_tokens = (count * (clipped & has)).sum()
    return (loss_B * has).sum() / denom, coef_T, clipped_tokens, (s * has).sum()


def grpo_coef(logp_T, old_T, mask_T, seg_T, adv_B, denom, clip_low, clip_high, log_ratio_clamp=LOG_RATIO_CLAMP,
              count_B=None):
    """GRPO (seq-mean-token-mean): (loss sum / denom, d loss / d logp [T], clipped tokens, ratio sum over tokens).

    Every term is per token once the response length of each sequence is known: pass count_B (response tokens
    per sequence) and the tokens may be any slice of the batch, not whole sequences."""
    B = adv_B.shape[0]
    m = mask_T.to(logp_T.dtype)  # the log-probs' precision throughout (fp32 in the kernel, fp64 in tests)
    if count_B is None:
        count_B = m.new_zeros(B).index_add(0, seg_T, m)
    count = count_B.to(m.dtype).clamp(min=1.0)
    lr = logp_T - old_T
    w = torch.exp(lr.clamp(-log_ratio_clamp, log_ratio_clamp))
    tok_loss, active, clipped = _clip_terms(w, adv_B[seg_T], clip_low, clip_high)
    per_tok = m / (count[seg_T] * denom)
    coef_T = torch.where(active & (lr.abs() <= log_ratio_clamp), -adv_B[seg_T] * w, 0.0) * per_tok
    return (tok_loss * per_tok).sum(), coef_T, (m * clipped).sum(), (w * m).sum()


def gspo_token_coef(logp_T, old_T, mask_T, seg_T, adv_B, denom, clip_low, clip_high,
                    log_ratio_clamp=LOG_RATIO_CLAMP):
    """GSPO-token with one advantage per sequence (see gspo_coef)."""
    return gspo_coef(logp_T, old_T, mask_T, seg_T, adv_B, denom, clip_low, clip_high, log_ratio_clamp,
                     token_level=True)


LOSSES = {"gspo": gspo_coef, "gspo_token": gspo_token_coef, "grpo": grpo_coef}


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

    coef_fn(lp_c, ok_c, seg_c, b0, b1, t0, t1) -> (loss part, d loss / d lp_c, stats [n]) for the tokens t0:t1,
    which hold sequences b0..b1-1 (seg_c: each token's sequence, counted from b0); the stats are summed."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, targets_T, cu_seqlens, mask_T, cfg):
        coef_fn, per_token, temperature, ignore_index, group, chunk_bytes, want_ent, n_stats = cfg
        T, V = hidden_TH.shape[0], weight_VH.shape[0]
        dev = hidden_TH.device
        _, world = vp.group_rank_size(group)
        valid = vp.check_targets(targets_T, V * world, ignore_index)
        valid = valid & mask_T
        local_tgt = torch.where(valid, targets_T - vp.vocab_start(V, group), -1)
        inv_temp = 1.0 / temperature
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(T, hidden_TH.shape[1], device=dev) if need_h else None  # fp32
        grad_w = torch.empty_like(weight_VH) if need_w else None  # first group writes it
        logp_T = torch.zeros(T, device=dev)
        ent_T = torch.zeros(T if want_ent else 0, device=dev)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        # one fp32 [V, rows] block transformed in place (+ the low-precision GEMM output and G copy, + the
        # entropy's second block), and [H, rows]
        nbuf = (1 if hidden_TH.dtype == torch.float32 else 2) + int(want_ent)
        max_rows = chunked.align_down(max(1, chunk_bytes // (4 * (V * nbuf + hidden_TH.shape[1]))))
        B = len(lengths)
        if per_token:  # a per-token gradient: any token chunk will do, no alignment
            seg_all = segment_ids(cu_seqlens, T)
            groups = [(0, B, t0, min(T, t0 + max_rows)) for t0 in range(0, T, max_rows)]
        else:  # a sequence's terms need all its tokens, so chunks hold whole sequences
            groups = [g for g in _groups(lengths, max_rows) if g[3] > g[2]]
        # one workspace for the whole call, shared with the two-pass fallback of over-long sequences
        blocks = 2 if want_ent else 1
        need = [blocks * V * (t1 - t0) if t1 - t0 <= max_rows else
                blocks * math.prod(chunked.plan_chunks(t1 - t0, V, chunk_bytes, H=hidden_TH.shape[1]))
                for _, _, t0, t1 in groups]
        ws = chunked.Workspace(max(need, default=0), dev)
        loss = torch.zeros((), device=dev)
        stats = torch.zeros(n_stats, device=dev)
        w_written = False
        for b0, b1, t0, t1 in groups:
            h_c, tgt_c, ok_c = hidden_TH[t0:t1], local_tgt[t0:t1], valid[t0:t1]
            seg = seg_all[t0:t1] if per_token else segment_ids(cu_seqlens[b0:b1 + 1] - t0, t1 - t0)
            rows = t1 - t0
            one_pass = rows <= max_rows
            if one_pass:  # keep the fp32 logits block [V, rows]: 6THV
                e = chunked.logits_block(weight_VH, h_c.t().contiguous(), inv_temp, out=ws.block(V, rows))
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
            part, coef, st = coef_fn(lp, ok_c, seg, b0, b1, t0, t1)
            coef = torch.where(ok_c, coef.float(), 0.0)
            loss += part
            stats += st
            if not (need_h or need_w):
                continue
            if one_pass:  # G^T = (onehot - p) * coef / temp with p = exp(z - m_local) * exp(m_local - lse)
                gl = coef * inv_temp
                GT = e.mul_(-gl * torch.exp(m_local - lse))
                inside, r_idx, c_idx = chunked.target_coords(tgt_c, V)
                GT.index_put_((r_idx, c_idx), torch.where(inside, gl, 0.0), accumulate=True)
                chunked.apply_block_grad(GT, h_c, weight_VH, grad_h[t0:t1] if need_h else None,
                                         grad_w if need_w else None, first_h=True, first_w=not w_written)
                w_written = True
                del GT, e
            else:
                chunked.backward_grads(h_c, weight_VH, tgt_c, lse, None, coef, None, inv_temp, chunk_bytes,
                                       need_h=need_h, need_w=need_w, ws=ws,
                                       out_h=grad_h[t0:t1] if need_h else None, out_w=grad_w,
                                       out_w_written=w_written)
                w_written = w_written or need_w
        if need_w and not w_written:
            grad_w.zero_()
        if need_h:
            grad_h = vp.allreduce_sum_(grad_h, group).to(hidden_TH.dtype)
        ctx.grads = (grad_h, grad_w)  # not save_for_backward: backward scales them in place (no weight-sized copy)
        for t in (logp_T, ent_T, stats):
            ctx.mark_non_differentiable(t)
        return loss, logp_T, ent_T, stats

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.grads is None:
            raise RuntimeError("fused loss: backward can run once per forward (retain_graph is not supported)")
        gh, gw = ctx.grads
        ctx.grads = None
        gh = gh.mul_(grad_loss.to(gh.dtype)) if gh is not None else None
        gw = gw.mul_(grad_loss.to(gw.dtype)) if gw is not None else None
        return gh, gw, None, None, None, None


def _layout(T, cu_seqlens, loss_mask, device, who="fused_policy_loss"):
    if cu_seqlens is None:
        raise ValueError(f"{who}: pass cu_seqlens [B + 1] (padded [B, S] batches: arange(0, B*S+1, S))")
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{who}: cu_seqlens must rise from 0 to T={T}; got {cu_seqlens.tolist()}")
    mask = torch.ones(T, dtype=torch.bool, device=device) if loss_mask is None else loss_mask.reshape(-1).bool()
    if mask.shape[0] != T:
        raise ValueError(f"{who}: loss_mask has {mask.shape[0]} tokens, hidden has T={T}")
    return cu, mask


def _autograd_coef(loss_fn):
    """coef_fn for _FusedLoss from a scalar loss_fn(logp_c, b0, b1): its gradient by autograd on [rows] values."""
    def coef_fn(lp, ok, seg, b0, b1, t0, t1):
        with torch.enable_grad():
            x = lp.detach().requires_grad_()
            part = loss_fn(x, b0, b1)
            g = torch.autograd.grad(part, x, allow_unused=True)[0] if part.requires_grad else None
        return part.detach().float().reshape(()), (torch.zeros_like(lp) if g is None else g), lp.new_zeros(0)
    return coef_fn


def fused_logprob_loss(hidden, weight, targets, loss_fn, *, cu_seqlens, temperature=1.0, ignore_index=-100,
                       process_group=None, chunk_bytes=None, return_entropy=False):
    """Any loss of the per-token log-probs, with the LM head's gradient computed in the forward (6THV).

    hidden [T, H], weight [V_local, H] (vocab shard as in token_logprobs), targets [T] global ids, packed with
    sequence b at tokens cu_seqlens[b]:cu_seqlens[b+1]. loss_fn(logp_c, b0, b1) -> 0-dim tensor: the part of the
    loss carried by sequences b0..b1-1, from logp_c, their tokens' log-probs (fp32, 0 at ignore_index targets,
    requires grad). The call splits the sequences into consecutive groups that fit the workspace and sums the
    parts, so the loss must be additive over sequences (a denominator fixed in advance, not counted from the
    tokens it is given). Returns (loss 0-dim fp32, logp [T] fp32, entropy [T] fp32 or None), logp and entropy
    detached; the entropy carries no gradient."""
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(hidden.device)
    check_inputs(hidden, weight, targets, temperature, chunk_bytes)
    cu, mask = _layout(hidden.shape[0], cu_seqlens, None, hidden.device, "fused_logprob_loss")
    cfg = (_autograd_coef(loss_fn), False, float(temperature), ignore_index, process_group, int(chunk_bytes),
           bool(return_entropy), 0)
    value, logp, ent, _ = _FusedLoss.apply(hidden, weight, targets, cu, mask, cfg)
    return value, logp.detach(), (ent.detach() if return_entropy else None)


def fused_policy_loss(hidden, weight, targets, old_logp, advantages, *, cu_seqlens, loss_mask=None, loss="gspo",
                      clip_low=None, clip_high=None, num_sequences=None, temperature=1.0, ignore_index=-100,
                      process_group=None, chunk_bytes=None, impl="fused"):
    """Policy loss (0-dim fp32) and metrics {logp [T], pg_clipfrac, ratio_mean}, tensors only.

    hidden [T, H], weight [V_local, H] (vocab shard as in token_logprobs), targets/old_logp/loss_mask [T] in packed
    order with sequence b at tokens cu_seqlens[b]:cu_seqlens[b+1]; advantages [B], one per sequence.
    loss: "gspo" | "gspo_token" | "grpo"; clip defaults DEFAULT_CLIP[loss]. num_sequences: the global denominator N
    (default: the sequences here with a response token; pass the rollout batch's count for gradient accumulation).
    impl="fused" computes the gradient inside this call (6THV); impl="unfused" is token_logprobs (auto) followed by
    the same formulas under autograd (the slow obvious path, for debugging)."""
    if loss not in LOSSES:
        raise ValueError(f"fused_policy_loss: unknown loss={loss!r}; valid: {', '.join(LOSSES)}")
    if impl not in ("fused", "unfused"):
        raise ValueError(f"fused_policy_loss: unknown impl={impl!r}; valid: fused, unfused")
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(hidden.device)
    check_inputs(hidden, weight, targets, temperature, chunk_bytes)
    T = hidden.shape[0]
    cu, mask = _layout(T, cu_seqlens, loss_mask, hidden.device)
    B = cu.numel() - 1
    if advantages.shape != (B,):
        raise ValueError(f"fused_policy_loss: advantages must be [B] = [{B}], got {tuple(advantages.shape)}")
    lo, hi = DEFAULT_CLIP[loss]
    clip_low = lo if clip_low is None else float(clip_low)
    clip_high = hi if clip_high is None else float(clip_high)
    valid = mask & (targets != ignore_index)
    seg = segment_ids(cu, T)
    count_B = torch.zeros(B, device=cu.device).index_add(0, seg, valid.float())
    if num_sequences is None:
        num_sequences = int((count_B > 0).sum())
    denom = float(max(num_sequences, 1))
    fn, old, adv = LOSSES[loss], old_logp.float(), advantages.float()
    n_resp = valid.sum().clamp(min=1)
    n_ratio = n_resp if loss == "grpo" else (count_B > 0).sum().clamp(min=1)
    if impl == "unfused":
        logp, _ = token_logprobs(hidden, weight, torch.where(mask, targets, ignore_index), temperature=temperature,
                                 ignore_index=ignore_index, process_group=process_group, chunk_bytes=chunk_bytes)
        value, _, clipped, rsum = fn(logp, old, valid, seg, adv, denom, clip_low, clip_high)
        return value, {"logp": logp.detach(), "pg_clipfrac": clipped / n_resp, "ratio_mean": rsum / n_ratio}
    extra = {"count_B": count_B} if fn is grpo_coef else {}  # grpo: per-token chunks need each response length

    def coef_fn(lp, ok, seg_c, b0, b1, t0, t1):
        part, coef, clip_n, rsum = fn(lp, old[t0:t1], ok, seg_c, adv[b0:b1], denom, clip_low, clip_high, **extra)
        return part, coef, torch.stack([clip_n, rsum])

    cfg = (coef_fn, fn is grpo_coef, float(temperature), ignore_index, process_group, int(chunk_bytes), False, 2)
    value, logp, _, stats = _FusedLoss.apply(hidden, weight, targets, cu, mask, cfg)
    return value, {"logp": logp.detach(), "pg_clipfrac": stats[0] / n_resp, "ratio_mean": stats[1] / n_ratio}
