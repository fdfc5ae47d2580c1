"""Set-wise comparison of two top-k routings: which experts a token gained or lost.

    flip_rate(old_idx_TK, new_idx_TK)  # fraction of top-k slots whose expert is not in the other set

Order inside a token's top-k is ignored: {3, 5} and {5, 3} are the same routing. Both sets have k distinct
experts, so "slots of new not in old" and "slots of old not in new" count the same number of flips per token.
"""

from __future__ import annotations

import torch


def _check_pair(old_idx: torch.Tensor, new_idx: torch.Tensor) -> None:
    for name, t in (("old_idx", old_idx), ("new_idx", new_idx)):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"flip_rate: {name} must be an integer tensor of expert ids, "
                             f"got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() < 2:
            raise ValueError(f"flip_rate: {name} must be (tokens, k) or (..., k), got shape {tuple(t.shape)}")
    if old_idx.shape != new_idx.shape:
        raise ValueError(f"flip_rate: shape mismatch, old_idx {tuple(old_idx.shape)} vs new_idx {tuple(new_idx.shape)}")


def slots_not_in(a_idx: torch.Tensor, b_idx: torch.Tensor) -> torch.Tensor:
    """(..., k) bool: True where a's expert in that slot is absent from b's top-k set of the same token.

    a_idx, b_idx: (..., k) integer tensors of the same shape (any integer dtype; compared as int64).
    """
    a, b = a_idx.long(), b_idx.long()
    return ~(a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)  # (..., k, k) -> (..., k)


def flip_rate(old_idx: torch.Tensor, new_idx: torch.Tensor) -> float:
    """Fraction of top-k slots whose expert changed between two routings of the same tokens, set-wise.

    old_idx, new_idx: (tokens, k) integer expert ids (any leading shape works: (..., k)).
    Returns a float in [0, 1]; nan when there are no tokens. A shape or dtype mismatch raises ValueError.
    """
    _check_pair(old_idx, new_idx)
    if new_idx.numel() == 0:
        return float("nan")
    return slots_not_in(new_idx, old_idx.to(new_idx.device)).float().mean().item()
