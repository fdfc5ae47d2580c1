"""The explicit object through which a policy forward exposes (and optionally replays) its MoE routing.

Usage:
    capture = RoutingCapture()                       # record only
    logits = policy(input_ids, routing=capture)      # (B, T, V)
    capture.layers[i].topk_idx                       # (B*T, k) int64, batch-major token order (b * T + t)

    capture = RoutingCapture(replay=source)          # replay: source.indices(layer) -> (B*T, k) int64
    policy(input_ids, routing=capture)               # the router uses those experts, weights from live scores

Token order is always batch-major over the whole local batch [B, T] (prompt, response and padding positions),
whatever megatron does inside ([s, b] sequence-major, sequence-parallel shards): the policy converts at the
boundary. Layer numbers are 0-based over the decoder's MoE layers.

A replay source is anything with `indices(layer: int) -> Tensor (B*T, k)`; a row of -1 means "route live" for
that token (padding). The router then computes its live scores, takes the given indices and renormalizes the
live scores over them exactly as its live top-k would, so router weights keep receiving gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class ReplaySource(Protocol):
    def indices(self, layer: int) -> torch.Tensor:  # (B*T, k) integer, batch-major; -1 rows route live
        ...


@dataclass
class LayerRouting:
    """What one MoE layer routed in one forward (batch-major token order)."""

    topk_idx: torch.Tensor  # (N, k) int64 expert ids, sorted ascending per token
    topk_weights: torch.Tensor  # (N, k) float32 combine weights (renormalized top-k probabilities), detached
    live_idx: torch.Tensor | None = None  # (N, k) what the live router would have chosen, when replay overrode it


@dataclass
class RoutingCapture:
    """Collects each MoE layer's routing during a forward; optionally feeds recorded routing back in."""

    replay: ReplaySource | None = None
    record: bool = True
    layers: dict[int, LayerRouting] = field(default_factory=dict)

    def replay_indices(self, layer: int) -> torch.Tensor | None:
        return None if self.replay is None else self.replay.indices(layer)

    def put(self, layer: int, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            live_idx: torch.Tensor | None = None) -> None:
        if self.record:
            live = None if live_idx is None else live_idx.detach()
            self.layers[layer] = LayerRouting(topk_idx.detach(), topk_weights.detach().float(), live)

    def live_stacked(self) -> torch.Tensor:
        """(N, L, k): the experts the live router chose (equal to stacked() unless replay overrode them)."""
        return torch.stack([(r.live_idx if r.live_idx is not None else r.topk_idx)
                            for _, r in sorted(self.layers.items())], dim=1)

    def stacked(self) -> torch.Tensor:
        """All layers' indices as (N, L, k) int64, layers in increasing order."""
        if not self.layers:
            raise RuntimeError("RoutingCapture holds no routing: was it passed to a forward with record=True?")
        return torch.stack([self.layers[i].topk_idx for i in sorted(self.layers)], dim=1)
