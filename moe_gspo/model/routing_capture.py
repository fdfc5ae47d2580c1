"""The explicit object through which a policy forward exposes (and optionally replays) its MoE routing.

Usage:
    capture = RoutingCapture()                       # record only
    logits = policy(input_ids, routing=capture)      # (B, T, V)
    capture.layers[i].topk_idx                       # (B*T, k) int64, batch-major token order (b * T + t)

    capture = RoutingCapture(replay=source)          # replay: source.indices(layer) -> (B*T, k) int64
    policy(input_ids, routing=capture)               # the router uses those experts, weights from live scores

    capture = RoutingCapture(scores=True)            # also record router scores of the routed experts
    capture.scores_stacked()                         # (B*T, L, k) float32, same order as capture.stacked()
    capture = RoutingCapture(score_at=old)           # scores of the experts old.indices(layer) names instead
    capture.scores_stacked()                         # (B*T, L, k) float32, in old's order (RSPO's current scores)

Token order is always batch-major over the whole local batch [B, T] (prompt, response and padding positions),
whatever megatron does inside ([s, b] sequence-major, sequence-parallel shards): the policy converts at the
boundary. Layer numbers are 0-based over the decoder's MoE layers.

A replay source (`ReplaySource`, below) gives `indices(layer) -> Tensor (B*T, k)`; a row of -1 means "route live" for
that token (padding), and None means the whole layer routes live. The router then computes its live scores, takes
the given indices and renormalizes the live scores over them exactly as its live top-k would, so router weights
keep receiving gradients.

Router scores (RSPO): the log-probability of an expert under the router's softmax over all experts, computed in
float32 from the router logits and detached (a measurement, never a path for gradients). With `scores=True` the
router records them for the experts it routes to; with `score_at` (a source like a replay source, naming the old
policy's experts per token) for those experts instead, whatever it routes to. Both come back batch-major like the
routing, under TP/SP (gathered over the TP group) and EP alike. Mapping a batch-major table onto this rank's router
rows is what the policy does for replay sources, so a capture with `score_at` and no replay source replays
nothing (ROUTE_LIVE) to get that map.

Expert bias (sigmoid routers): with `bias_split=True`, each router that has an expert bias and a reference bias
(`MoERouter.bias_reference`, the bias when the step's reference routing was recorded) also records the experts
that reference bias would choose from the same live logits; `bias_ref_stacked()` returns them like
live_stacked(). Live vs these is what the bias update alone changed; these vs the reference routing, what the
weights' update changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class ReplaySource:
    """Expert ids per token and MoE layer to route by: `indices(layer)` -> (B*T, k) int64, batch-major, -1 rows
    route live (padding); a source without a table routes every layer live. The one replay type: the replay cache
    (R2/R3), a rollout's engine routing and the old policy's experts for router scores all hand one to a capture.

    table: (B*T, L, k) integer, batch-major (any view); scores: optional (B*T, L, k) router scores of those experts.
    strict=True counts consumption: each layer is read once per forward (`new_forward()` before an
    activation-recompute pass or the next forward over the same batch), and `check_complete()` raises unless every
    layer was read exactly once since the last `new_forward()`."""

    def __init__(self, table: torch.Tensor | None, scores: torch.Tensor | None = None, strict: bool = False):
        self.table, self.scores, self.strict = table, scores, strict
        self.num_layers = 0 if table is None else table.shape[1]
        self.forwards = 0
        self._uses = [0] * self.num_layers

    def indices(self, layer: int) -> torch.Tensor | None:
        if self.table is None:
            return None
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"replay: layer {layer} out of range, the source holds {self.num_layers} MoE layers")
        if self.strict:
            if self._uses[layer]:
                raise RuntimeError(f"replay: layer {layer} consumed twice in one forward; call new_forward() "
                                   f"before activation recompute or the next forward")
            if not any(self._uses):
                self.forwards += 1
            self._uses[layer] += 1
        return self.table[:, layer].long()

    def new_forward(self) -> None:
        """Allow every layer to be consumed again (next forward, or the recompute pass of this one)."""
        self._uses = [0] * self.num_layers

    def check_complete(self) -> None:
        """Raise RuntimeError unless every layer was consumed exactly once since the last new_forward()."""
        missing = [i for i, u in enumerate(self._uses) if u != 1]
        if missing:
            raise RuntimeError(f"replay: layers {missing} were not consumed by the forward "
                               f"(model has fewer MoE layers than the source, or the forward did not use it)")

    def bias_ref_stacked(self) -> torch.Tensor | None:
        """(N, L, k): the experts the live logits choose under the reference expert bias (`bias_split`), or None
        when the routers recorded none (no expert bias, or no reference bias set)."""
        if not self._raw or any(r.bias_ref is None for r in self._raw.values()):
            return None
        return self._stack(live=True, bias_ref=True)

    def stacked(self) -> torch.Tensor:
        """(B*T, L, k) int64 of all layers (does not count as consumption), -1 rows where nothing is given."""
        return self.table.long()


ROUTE_LIVE = ReplaySource(None)  # replays nothing: every layer routes live


@dataclass
class LayerRouting:
    """What one MoE layer routed in one forward (batch-major token order)."""

    topk_idx: torch.Tensor  # (N, k) int64 expert ids, sorted ascending per token
    topk_weights: torch.Tensor  # (N, k) float32 combine weights (renormalized top-k probabilities), detached
    live_idx: torch.Tensor | None = None  # (N, k) what the live router would have chosen, when replay overrode it


def flat_positions(lengths: Sequence[int], starts: Sequence[int], seq_len: int) -> torch.Tensor:
    """(sum(lengths),) int64 batch-major positions b * seq_len + starts[b] + i, for i < lengths[b], row by row, on
    the host (from the lists alone: no tensor value is read back). seq_len 0 gives each row's own positions."""
    total = sum(int(n) for n in lengths)
    lens = torch.tensor(list(lengths), dtype=torch.int64)
    row_first = torch.tensor([b * seq_len + s for b, s in enumerate(starts)], dtype=torch.int64)
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
    return torch.repeat_interleave(row_first, lens, output_size=total) + within


class PackedLayout:
    """Router rows of a packed forward (sequences back to back in one row, megatron's THD format), as the TP group
    gathers them: row i < len(pos) is the token at batch-major position pos[i] of the caller's (B, T) batch; rows
    past len(pos) are TP padding. Batch-major views put each row at its position; positions no packed token holds
    (the caller's right padding) read -1 as expert ids (route live, as a replay source reads it) and 0 as
    weights and scores."""

    def __init__(self, pos: torch.Tensor, num_tokens: int):
        self.pos, self.num_tokens = pos, num_tokens

    def batch_major(self, x: torch.Tensor) -> torch.Tensor:
        fill = -1 if not x.is_floating_point() else 0
        out = x.new_full((self.num_tokens, *x.shape[1:]), fill)
        return out.index_copy_(0, self.pos.to(x.device), x[:self.pos.numel()])


@dataclass
class _Raw:
    """One layer's routing as the router produced it: megatron's sequence-major order, unsorted top-k."""

    idx: torch.Tensor  # (Tp*B, k) int64
    weights: torch.Tensor  # (Tp*B, k) float32
    live: torch.Tensor | None  # (Tp*B, k) int64 or None
    layout: tuple[int, int, int] | PackedLayout | None  # (Tp, B, T): rows are (s, b) for s < Tp; PackedLayout:
    # packed rows; None: already (B*T) batch-major
    scores: torch.Tensor | None = None  # (Tp*B, k) float32 router scores (of idx, or of the score_at experts)
    bias_ref: torch.Tensor | None = None  # (Tp*B, k) int64: the live choice under the reference expert bias


class RoutingCapture:
    """Collects each MoE layer's routing during a forward; optionally feeds recorded routing back in.

    Recording is lazy: the router hands over its tensors as they are (one reference per layer, no work in the
    forward), and the batch-major, per-token-sorted view is built on first access: for all layers at once by
    stacked() / live_stacked(), or per layer through `layers`."""

    def __init__(self, replay: ReplaySource | None = None, record: bool = True, scores: bool = False,
                 score_at: ReplaySource | None = None, bias_split: bool = False, noise=None):
        if score_at is not None and not record:
            raise ValueError("RoutingCapture(score_at=...) records scores: it needs record=True")
        self.replay = ROUTE_LIVE if replay is None and score_at is not None else replay
        self.record = record
        self.score_at = score_at
        self.record_scores = record and (scores or score_at is not None)
        self.bias_split = record and bias_split
        self.noise = noise  # a model.router.RoutingNoise for the live-routed slots of this forward, or None
        self._raw: dict[int, _Raw] = {}
        self._layers: dict[int, LayerRouting] | None = None

    def replay_indices(self, layer: int) -> torch.Tensor | None:
        return None if self.replay is None else self.replay.indices(layer)

    def score_indices(self, layer: int) -> torch.Tensor | None:
        """(B*T, k) experts to score in this layer (batch-major), or None: score the routed experts."""
        return None if self.score_at is None else self.score_at.indices(layer)

    def put(self, layer: int, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            live_idx: torch.Tensor | None = None, layout: tuple[int, int, int] | PackedLayout | None = None,
            scores: torch.Tensor | None = None, bias_ref: torch.Tensor | None = None) -> None:
        """Record one layer: (N, k) indices and weights, batch-major (layout None) or the router's (Tp*B, k)
        sequence-major rows with layout (Tp, B, T) (positions t >= T are padding and are dropped) or a packed
        forward's rows with its PackedLayout; optionally the
        (N, k) router scores and the (N, k) choice under the reference expert bias in the same row order."""
        if self.record:
            live = None if live_idx is None else live_idx.detach()
            sc = None if scores is None else scores.detach()
            self._raw[layer] = _Raw(topk_idx.detach(), topk_weights.detach(), live, layout, sc, bias_ref)
            self._layers = None

    @staticmethod
    def _batch_major(x: torch.Tensor, layout) -> torch.Tensor:
        """(Tp*B, ...) sequence-major rows -> (B*T, ...) batch-major, padding positions dropped."""
        if layout is None:
            return x
        if isinstance(layout, PackedLayout):
            return layout.batch_major(x)
        Tp, B, T = layout
        return x.view(Tp, B, *x.shape[1:])[:T].transpose(0, 1).reshape(B * T, *x.shape[1:])

    @property
    def layers(self) -> dict[int, LayerRouting]:
        """layer -> LayerRouting (batch-major, indices sorted ascending per token, weights in the same order)."""
        if self._layers is None:
            out = {}
            for i, r in sorted(self._raw.items()):
                idx, perm = torch.sort(self._batch_major(r.idx, r.layout), dim=1)
                w = self._batch_major(r.weights, r.layout).float().gather(1, perm)
                live = None if r.live is None else torch.sort(self._batch_major(r.live, r.layout), dim=1).values
                out[i] = LayerRouting(idx, w, live)
            self._layers = out
        return self._layers

    def _stack(self, live: bool, bias_ref: bool = False) -> torch.Tensor:
        if not self._raw:
            raise RuntimeError("RoutingCapture holds no routing: was it passed to a forward with record=True?")
        raws = [r for _, r in sorted(self._raw.items())]
        layouts = {r.layout for r in raws}
        if bias_ref:
            parts = [r.bias_ref for r in raws]
        else:
            parts = [(r.live if live and r.live is not None else r.idx) for r in raws]
        if len(layouts) == 1:  # one transpose and one sort for all layers
            return torch.sort(self._batch_major(torch.stack(parts, dim=1), layouts.pop()), dim=-1).values
        return torch.stack([torch.sort(self._batch_major(p, r.layout), dim=-1).values
                            for p, r in zip(parts, raws)], dim=1)

    def live_stacked(self) -> torch.Tensor:
        """(N, L, k): the experts the live router chose (equal to stacked() unless replay overrode them)."""
        return self._stack(live=True)

    def bias_ref_stacked(self) -> torch.Tensor | None:
        """(N, L, k): the experts the live logits choose under the reference expert bias (`bias_split`), or None
        when the routers recorded none (no expert bias, or no reference bias set)."""
        if not self._raw or any(r.bias_ref is None for r in self._raw.values()):
            return None
        return self._stack(live=True, bias_ref=True)

    def stacked(self) -> torch.Tensor:
        """All layers' indices as (N, L, k) int64, layers in increasing order, sorted ascending per token."""
        return self._stack(live=False)

    def scores_stacked(self) -> torch.Tensor:
        """All layers' router scores as (N, L, k) float32, batch-major: with `score_at`, for its experts in its
        order; otherwise for the routed experts, in the order of stacked() (ascending expert id)."""
        raws = [r for _, r in sorted(self._raw.items())]
        if not raws or any(r.scores is None for r in raws):
            raise RuntimeError("RoutingCapture holds no router scores: build it with scores=True or score_at=...")
        layouts = {r.layout for r in raws}
        if len(layouts) == 1:  # one transpose for all layers
            layout = layouts.pop()
            sc = self._batch_major(torch.stack([r.scores for r in raws], dim=1), layout)  # (N, L, k)
            if self.score_at is None:
                order = torch.argsort(self._batch_major(torch.stack([r.idx for r in raws], dim=1), layout), dim=-1)
                sc = sc.gather(-1, order)
            return sc.float()
        out = []
        for r in raws:
            sc = self._batch_major(r.scores, r.layout)
            if self.score_at is None:
                sc = sc.gather(-1, torch.argsort(self._batch_major(r.idx, r.layout), dim=-1))
            out.append(sc)
        return torch.stack(out, dim=1).float()
