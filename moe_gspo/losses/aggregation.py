"""Aggregating per-token (or per-sequence) loss terms into one scalar.

Modes (the names verl uses):
    token-mean            sum_{i,t} l_{i,t} / D          D = number of response tokens
    seq-mean-token-mean   sum_i (1/|y_i|) sum_t l_{i,t} / D   D = number of sequences with >= 1 response token
    seq-mean-token-sum    sum_i sum_t l_{i,t} / D        D = number of sequences with >= 1 response token

Every mode is a plain sum divided by a denominator D. By default D is counted in this call's tensors. To make
gradient accumulation over micro-batches equal one step on the whole minibatch, compute D once over the whole
minibatch with `loss_denominator(mask_full, mode)`, pass it as `denominator` to every micro-batch, and SUM (do
not average) the micro-batch losses. With data parallelism whose all-reduce averages gradients, pass
D_global / world_size so the averaged gradient equals the full-batch one.

Pitfall (do not do this): broadcast a per-sequence quantity (GSPO's ratio s_i) to every token and take a
token-mean; each sequence then weighs |y_i| times instead of once. `agg_seq_loss` states the sequence weights
explicitly, so this can only happen when token-mean is asked for on purpose.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def check_agg_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")


def loss_denominator(mask: Tensor, mode: str, cu_seqlens: Tensor | None = None) -> Tensor:
    """The count D that `mode` divides by, as a 0-dim int64 tensor (exact; not clamped).

    mask: bool or 0/1 [B, T] response-token mask, or packed [total] / [1, total] with `cu_seqlens` [B + 1].
    Returns the number of response tokens (token-mean) or of sequences with at least one response token.
    """
    check_agg_mode(mode)
    if cu_seqlens is not None:
        from moe_gspo.losses.packed import pad_packed

        mask = pad_packed(mask.bool(), cu_seqlens, name="mask")
    mask = mask.bool()
    if mode == "token-mean":
        return mask.sum()
    return mask.any(-1).sum()


def _divide(total: Tensor, denominator: Tensor | float | None, local_count: Tensor) -> Tensor:
    if denominator is None:
        return total / local_count.clamp(min=1).to(total.dtype)
    if not isinstance(denominator, Tensor):
        if denominator < 0:
            raise ValueError(f"loss_denominator must be >= 0, got {denominator}")
        denominator = torch.tensor(float(denominator), dtype=total.dtype, device=total.device)
    # a zero count means no response tokens anywhere, so total == 0: divide by 1 instead of 0 (never NaN)
    return total / torch.where(denominator > 0, denominator, 1).to(total.dtype)


def agg_loss(loss_BT: Tensor, mask_BT: Tensor, mode: str, denominator: Tensor | float | None = None) -> Tensor:
    """Aggregate per-token terms loss_BT [B, T] over the bool response mask mask_BT [B, T] -> scalar.

    Off-mask entries of loss_BT are ignored (selected out with torch.where, so NaN there cannot leak).
    """
    check_agg_mode(mode)
    loss_BT = torch.where(mask_BT, loss_BT, torch.zeros_like(loss_BT))
    if mode == "token-mean":
        return _divide(loss_BT.sum(), denominator, mask_BT.sum())
    seq_B = loss_BT.sum(-1)  # (B,)
    lengths_B = mask_BT.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_B = seq_B / lengths_B.clamp(min=1).to(seq_B.dtype)
    return _divide(seq_B.sum(), denominator, (lengths_B > 0).sum())


def agg_seq_loss(loss_B: Tensor, lengths_B: Tensor, mode: str, denominator: Tensor | float | None = None) -> Tensor:
    """Aggregate one term per sequence loss_B [B] (lengths_B [B] response tokens each) -> scalar.

    Gives the same value as broadcasting loss_B[i] to the |y_i| tokens of sequence i and calling `agg_loss`,
    without materializing [B, T]: seq-mean-token-mean weighs each non-empty sequence 1, the other modes |y_i|.
    """
    check_agg_mode(mode)
    lengths = lengths_B.to(loss_B.dtype)
    weight_B = (lengths_B > 0).to(loss_B.dtype) if mode == "seq-mean-token-mean" else lengths
    total = torch.where(lengths_B > 0, loss_B * weight_B, torch.zeros_like(loss_B)).sum()
    local = lengths_B.sum() if mode == "token-mean" else (lengths_B > 0).sum()
    return _divide(total, denominator, local)
