"""Per-sequence reduction of per-token values (GSPO's sum or mean log-ratio over response tokens).

Two layouts: padded values [B, S] with a mask [B, S], or packed values [T] with cu_seqlens [B + 1] (and an
optional token mask [T] for the response tokens). Differentiable; sequences with no masked token give 0.
"""
from __future__ import annotations

import torch

REDUCTIONS = ("sum", "mean")


def segment_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] int64 index of the sequence each packed token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=T)


def sequence_reduce(values, *, mask=None, cu_seqlens=None, reduction="sum"):
    """[B] fp32 sum or mean of `values` over each sequence's masked tokens.

    padded: values [B, S], mask [B, S] (bool or 0/1), cu_seqlens None.
    packed: values [T], cu_seqlens [B + 1] int (cu_seqlens[-1] == T), mask [T] or None (all tokens count)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"sequence_reduce: unknown reduction={reduction!r}; valid: {', '.join(REDUCTIONS)}")
    v = values.float()
    if cu_seqlens is None:
        if v.dim() != 2:
            raise ValueError(f"sequence_reduce: padded layout wants values [B, S], got {tuple(values.shape)}")
        m = torch.ones_like(v) if mask is None else mask.to(v.dtype)
        if m.shape != v.shape:
            raise ValueError(f"sequence_reduce: mask {tuple(mask.shape)} != values {tuple(values.shape)}")
        total, count = (v * m).sum(1), m.sum(1)
    else:
        T = v.shape[0]
        if v.dim() != 1 or int(cu_seqlens[-1]) != T or int(cu_seqlens[0]) != 0:
            raise ValueError(f"sequence_reduce: packed layout wants values [T] and cu_seqlens from 0 to T={T}; got "
                             f"values {tuple(values.shape)}, cu_seqlens ends {int(cu_seqlens[0])}..{int(cu_seqlens[-1])}")
        B = cu_seqlens.numel() - 1
        m = torch.ones_like(v) if mask is None else mask.to(v.dtype)
        seg = segment_ids(cu_seqlens, T)
        total = torch.zeros(B, device=v.device).index_add(0, seg, v * m)
        count = torch.zeros(B, device=v.device).index_add(0, seg, m)
    if reduction == "sum":
        return total
    return total / count.clamp(min=1.0)
