"""Token log-probs of a right-padded batch under the policy, token-aligned like PaddedRollout.

    logp_BT, ent_BT = batch_logprobs(policy, input_ids_BT, capture, impl="fused", temperature=1.0)
    # logp_BT[b, j] = log pi(input_ids[b, j] | input_ids[b, :j]) at softmax(logits / temperature); column 0 is 0

"fused" runs the policy to its final hidden states and calls moe_gspo.kernels.token_logprobs on this rank's
vocab shard of the LM head (vocab-parallel over the TP group): no [B, T, V] logits. "eager" is the obvious
reference: full logits -> log_softmax -> gather. Both return float32.

    loss, logp_BT, ent_BT = hidden_loss(policy, hidden_BTH, input_ids_BT, loss_rows, temperature)

goes from the final hidden states straight to a loss of the token log-probs (moe_gspo.kernels.fused_logprob_loss,
6THV instead of token_logprobs' 8THV): loss_rows(logp_bT, entropy_bT, b0, b1) is the loss part of rows b0..b1-1,
given their token-aligned log-probs (and entropies, None unless the loss reads them); the LM head's gradient is
computed inside the call.

    loss, metrics = fused_policy_loss(hidden_TH, weight_VH, targets_T, old_logp_T, adv_B, cu_seqlens=cu, loss="gspo")

is the same on a packed batch of raw tensors with a registered loss by name (benchmarks, users of the kernel).
"""

from __future__ import annotations

import itertools

import torch

from moe_gspo.kernels import fused_logprob_loss, token_logprobs, token_logprobs_from_logits
from moe_gspo.losses import loss_denominator
from moe_gspo.losses.registry import loss_with_call_kwargs
from moe_gspo.model.layers import to_device
from moe_gspo.model.routing_capture import flat_positions


def _tp_group(policy):
    """The policy's TP group for the vocab-parallel kernels (None without TP)."""
    return policy.groups.tp if getattr(policy, "tp", 1) > 1 else None


class Targets:
    """The next-token targets of a right-padded (B, T) batch, without its padding: target i is token
    input_ids[b, j] for 1 <= j < lengths[b], predicted from position j - 1. `cu` delimits each row's targets."""

    def __init__(self, input_ids_BT: torch.Tensor, lengths: list[int] | None = None):
        B, T = input_ids_BT.shape
        self.B, self.T = B, T
        lengths = [T] * B if lengths is None else [int(n) for n in lengths]
        counts = [max(n - 1, 0) for n in lengths]
        dev = input_ids_BT.device
        self.bounds = list(itertools.accumulate([0, *counts]))  # on the host: no device sync to slice by row
        # flat (B*T) position of each target token; its prediction comes from the position before it (built on the
        # host from the lengths and moved in one copy)
        self.pos = to_device(flat_positions(counts, [1] * B, T), dev)
        self.ids = input_ids_BT.reshape(-1)[self.pos]

    def hidden(self, hidden_BTH: torch.Tensor, dtype) -> torch.Tensor:
        """(targets, H): the hidden state that predicts each target."""
        return hidden_BTH.reshape(self.B * self.T, -1)[self.pos - 1].to(dtype)

    def frame(self, x: torch.Tensor, b0: int = 0, b1: int | None = None) -> torch.Tensor:
        """Per-target values of rows b0..b1-1 -> (b1 - b0, T) token-aligned, 0 at column 0 and the padding."""
        b1 = self.B if b1 is None else b1
        pos = self.pos[self.bounds[b0]:self.bounds[b1]] - b0 * self.T
        return x.float().new_zeros((b1 - b0) * self.T).index_copy(0, pos, x.float()).view(b1 - b0, self.T)


def batch_logprobs(policy, input_ids_BT: torch.Tensor, routing=None, impl: str = "fused",
                   temperature: float = 1.0, want_entropy: bool = True, lengths: list[int] | None = None,
                   pack_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp (B, T) float32, entropy (B, T) float32 or None), token-aligned, column 0 = 0.

    lengths (B ints, the tokens of each row before its right padding): the fused path computes the LM head on
    those tokens only (0 at the padding); pack_to (an int) also runs the decoder on them packed, in one sequence
    of at least pack_to tokens (MoEPolicy's lengths and pack_to); None runs the padded rows."""
    packed = {} if pack_to is None else {"lengths": lengths, "pack_to": pack_to}
    if impl == "eager":  # already token-aligned with column 0 = 0
        logits = policy(input_ids_BT, routing=routing, **packed)
        out = token_logprobs_from_logits(logits, input_ids_BT, temperature, return_entropy=want_entropy)
        return out if want_entropy else (out, None)
    if impl != "fused":
        raise ValueError(f"train.logprob_impl={impl!r} is not one of ['fused', 'eager']")
    hidden = policy(input_ids_BT, routing=routing, return_hidden=True, **packed)
    tg = Targets(input_ids_BT.to(hidden.device), lengths)
    w = policy.lm_head_weight()
    logp, ent = token_logprobs(tg.hidden(hidden, w.dtype), w, tg.ids, temperature=temperature,
                               return_entropy=want_entropy, process_group=_tp_group(policy))
    return tg.frame(logp), (None if ent is None else tg.frame(ent))


def hidden_loss(policy, hidden_BTH: torch.Tensor, input_ids_BT: torch.Tensor, loss_rows, temperature: float = 1.0,
                lengths: list[int] | None = None, entropy_in_loss: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss 0-dim float32, logp (B, T) float32, entropy (B, T) float32) from the policy's final hidden states.

    loss_rows(logp_bT, entropy_bT, b0, b1) -> 0-dim tensor: the part of the loss carried by rows b0..b1-1, from
    their token-aligned log-probs (b1 - b0, T) (column 0 = 0, requires grad); the loss is the sum of the parts over
    consecutive row groups (as many rows as fit the kernel's workspace), so it must use a denominator fixed in
    advance. logp and entropy come back detached, token-aligned, column 0 = 0. entropy_in_loss: entropy_bT holds
    the rows' entropies (requires grad), whose gradient reaches the policy (an entropy bonus); otherwise it is None
    and the entropy is a metric only.
    lengths: as in batch_logprobs (the LM head skips the padding, whose log-probs read 0)."""
    w = policy.lm_head_weight()
    tg = Targets(input_ids_BT.to(hidden_BTH.device), lengths)

    def part(lp, b0, b1):
        return loss_rows(tg.frame(lp, b0, b1), None, b0, b1)

    def part_with_entropy(lp, ent, b0, b1):
        return loss_rows(tg.frame(lp, b0, b1), tg.frame(ent, b0, b1), b0, b1)

    loss, logp, ent = fused_logprob_loss(tg.hidden(hidden_BTH, w.dtype), w, tg.ids,
                                         part_with_entropy if entropy_in_loss else part, cu_seqlens=tg.bounds,
                                         temperature=temperature, process_group=_tp_group(policy),
                                         return_entropy=True, entropy_in_loss=entropy_in_loss)
    return loss, tg.frame(logp), tg.frame(ent)


def fused_policy_loss(hidden, weight, targets, old_logp, advantages, *, cu_seqlens, loss="gspo", loss_mask=None,
                      denominator=None, temperature=1.0, ignore_index=-100, process_group=None, chunk_bytes=None,
                      impl="fused", **loss_options):
    """A registered policy loss (moe_gspo.losses, by name) of a packed batch, from hidden states: (loss 0-dim fp32,
    metrics {logp [T], and the loss's own metrics}), tensors only.

    hidden [T, H], weight [V_local, H] (vocab shard as in token_logprobs), targets / old_logp / loss_mask [T] with
    sequence b at tokens cu_seqlens[b]:cu_seqlens[b+1]; advantages [B], one per sequence. loss_options go to the
    loss (clip_low, clip_high, loss_agg_mode, ...). denominator: the count the loss's aggregation mode divides by
    (default: moe_gspo.losses.loss_denominator of this call's tokens, i.e. its sequences with a response token, or
    its response tokens for token-mean; pass the rollout batch's count for gradient accumulation). impl="fused"
    computes the LM head's gradient inside the kernel (fused_logprob_loss, 6THV); "unfused" is token_logprobs
    followed by the loss under autograd."""
    loss_fn, call_kw = loss_with_call_kwargs(loss, loss_options)  # built and checked once, called per row group
    if impl not in ("fused", "unfused"):
        raise ValueError(f"fused_policy_loss: unknown impl={impl!r}; valid: fused, unfused")
    T = hidden.shape[0]
    mask = torch.ones(T, dtype=torch.bool, device=hidden.device) if loss_mask is None else loss_mask.reshape(-1)
    if mask.shape[0] != T:
        raise ValueError(f"fused_policy_loss: loss_mask has {mask.shape[0]} tokens, hidden has T={T}")
    valid = mask.bool().to(hidden.device) & (targets != ignore_index)
    cu = cu_seqlens.to(device=hidden.device, dtype=torch.long)
    if advantages.shape != (cu.numel() - 1,):
        raise ValueError(f"fused_policy_loss: advantages must be [B] = [{cu.numel() - 1}], got "
                         f"{tuple(advantages.shape)}")
    if denominator is None:  # the loss's own count, fixed for the whole call: the kernel hands it parts of the batch
        denominator = int(loss_denominator(valid, loss_fn.loss_agg_mode, cu_seqlens=cu))
    kw = {"loss_denominator": float(max(denominator, 1)), **call_kw}
    old, adv = old_logp.float(), advantages.float()
    bounds = cu.tolist()

    def part(lp, b0, b1):
        t0, t1 = bounds[b0], bounds[b1]
        return loss_fn(lp, old[t0:t1], adv[b0:b1], valid[t0:t1], cu_seqlens=cu[b0:b1 + 1] - t0, **kw)

    targets = torch.where(valid, targets, ignore_index)
    if impl == "fused":
        value, logp, _ = fused_logprob_loss(hidden, weight, targets, lambda lp, b0, b1: part(lp, b0, b1)[0],
                                            cu_seqlens=cu, temperature=temperature, ignore_index=ignore_index,
                                            process_group=process_group, chunk_bytes=chunk_bytes)
        with torch.no_grad():  # the metrics of the whole batch, from the finished log-probs
            metrics = part(logp, 0, len(bounds) - 1)[1]
    else:
        logp, _ = token_logprobs(hidden, weight, targets, temperature=temperature, ignore_index=ignore_index,
                                 process_group=process_group, chunk_bytes=chunk_bytes)
        value, metrics = part(logp, 0, len(bounds) - 1)
        logp = logp.detach()
    return value, {"logp": logp, **metrics}
