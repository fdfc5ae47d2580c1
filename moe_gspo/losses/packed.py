"""Packed (varlen) layout <-> padded [B, T] layout for the policy losses.

Packed tensors hold several sequences end to end, as flash-attention's varlen kernels use them:
a tensor of shape [total] or [1, total] and an int tensor `cu_seqlens` [B + 1] of cumulative sequence
lengths (cu_seqlens[0] == 0, cu_seqlens[-1] == total). The losses compute on the padded layout; a
packed input is scattered into [B, T_max] by a differentiable index_put, so gradients flow back to
the packed tensor and packed == padded holds by construction (tests/test_losses_layouts.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_cu_seqlens(cu_seqlens: Tensor, total: int | None = None) -> list[int]:
    """Validate `cu_seqlens` [B + 1] and return the per-sequence lengths as a Python list (one host sync)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int tensor [B + 1] with B >= 1, got {cu_seqlens!r}")
    if cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be an integer tensor, got dtype {cu_seqlens.dtype}")
    cu = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if cu[0] != 0 or min(lengths) < 0:
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"cu_seqlens[-1] = {cu[-1]} but the packed tensors hold {total} tokens")
    return lengths


def _flat(x: Tensor, name: str) -> Tensor:
    """[total] or [1, total] -> [total]."""
    if x.dim() == 2 and x.shape[0] == 1:
        return x[0]
    if x.dim() != 1:
        raise ValueError(f"packed {name} must be [total] or [1, total], got shape {tuple(x.shape)}")
    return x


def packed_index(cu_seqlens: Tensor, lengths: list[int]) -> tuple[Tensor, Tensor]:
    """(row, col) int64 index tensors [total]: where each packed token lands in the padded [B, T_max]."""
    device = cu_seqlens.device
    lengths_B = torch.tensor(lengths, device=device)
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_B)  # (total,)
    col = torch.arange(row.numel(), device=device) - cu_seqlens.to(device=device, dtype=torch.long)[row]
    return row, col


def pad_packed(x: Tensor, cu_seqlens: Tensor, max_seqlen: int | None = None, *, name: str = "x") -> Tensor:
    """Packed [total] or [1, total] -> padded [B, T_max] (zeros / False at padding); differentiable."""
    x = _flat(x, name)
    lengths = check_cu_seqlens(cu_seqlens, total=x.shape[0])
    t_max = max(lengths) if max_seqlen is None else int(max_seqlen)
    if t_max < max(lengths):
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest packed sequence ({max(lengths)})")
    row, col = packed_index(cu_seqlens, lengths)
    out = x.new_zeros(len(lengths), max(t_max, 1))
    return out.index_put((row, col), x)


def unpad_to_packed(x_BT: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Padded [B, T_max] -> packed [total]; the inverse of `pad_packed`."""
    lengths = check_cu_seqlens(cu_seqlens)
    row, col = packed_index(cu_seqlens, lengths)
    return x_BT[row, col]
