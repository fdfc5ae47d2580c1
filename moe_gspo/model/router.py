"""The MoE router the layer spec plugs into megatron-core, for every family's routing rule, and the per-forward
context through which it exposes and replays its routing.

Routing rules (the checkpoint's, exactly; ModelConfig picks them):
    softmax   softmax over the experts in float32, top k; weights renormalized over the k (norm_topk_prob: Qwen3,
              Mixtral) or not (OLMoE, Qwen2-MoE)
    sigmoid   sigmoid scores s; the experts are chosen by s + b (b: the load-balancing expert bias, not trained by
              gradient), first the topk_group best of n_group groups, each scored by the sum of its two best
              s + b, then the top k within them; weights are s of the chosen experts, renormalized over the k when
              norm_topk_prob, times routed_scaling_factor (DeepSeek-V3, as transformers and vLLM compute it)

megatron-core's TopKRouter has the sigmoid scores and the expert bias, but scores a group by the sum of its top
(k / topk_group) experts, which differs from the checkpoints' rule unless k = 2 * topk_group; the rule here is
the checkpoints'. The expert bias is megatron's buffer (`expert_bias`, saved with the router), its token counts
megatron's (`local_tokens_per_expert`), and its update megatron's finalize_model_grads at each optimizer step
(moe_router_bias_update_rate; 0 keeps the checkpoint's bias).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter


_LIVE: ContextVar[RoutingContext | None] = ContextVar("moe_gspo_routing", default=None)
_RECOMPUTING: list[RoutingContext] = []  # forwards whose layers the backward is recomputing, innermost last


@contextmanager
def routing_scope(ctx: RoutingContext | None):
    """The routing context the routers of one forward read (a context variable, not a router attribute: nested
    forwards each see their own, and a forward run again in the backward finds its context on RecomputeBoundary)."""
    token = _LIVE.set(ctx)
    try:
        yield
    finally:
        _LIVE.reset(token)


def active_routing() -> tuple[RoutingContext | None, bool]:
    """(the routing context of the forward being computed, whether it is a recompute in the backward)."""
    if _RECOMPUTING:
        return _RECOMPUTING[-1], True
    return _LIVE.get(), False


class RecomputeBoundary:
    """Autograd markers around a decoder whose layers megatron recomputes in the backward (train.recompute='full').
    `enter` wraps the decoder's output: its backward, which runs before any layer's recompute, makes the forward's
    context the recomputing one; `leave` wraps the decoder's input: its backward, after every layer's, ends it. In
    between, each router finds the experts it used in the first forward (RoutingContext.used) and uses them again,
    replayed, noised or live alike, without recording twice."""

    class _Marker(torch.autograd.Function):
        """Identity whose backward opens (enter) or closes (leave) the recompute of `routing`'s forward."""

        @staticmethod
        def forward(ctx, x, routing, opens):
            ctx.routing, ctx.opens = routing, opens
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            if ctx.opens:
                _RECOMPUTING.append(ctx.routing)
            elif _RECOMPUTING and _RECOMPUTING[-1] is ctx.routing:
                _RECOMPUTING.pop()
            return g, None, None

    @staticmethod
    def enter(x: torch.Tensor, routing: RoutingContext) -> torch.Tensor:
        return RecomputeBoundary._Marker.apply(x, routing, True)

    @staticmethod
    def leave(x: torch.Tensor, routing: RoutingContext) -> torch.Tensor:
        return RecomputeBoundary._Marker.apply(x, routing, False)

    @staticmethod
    def reset() -> None:
        """Forget recomputations a failed backward left open (called at every new forward)."""
        _RECOMPUTING.clear()


class RoutingContext:
    """Per-forward bridge between megatron's token order and the caller's RoutingCapture.

    Built by the policy for one forward. `local_pos` (N_local,), needed only to map batch-major tables onto this
    rank's rows (replay, and scoring given experts), gives, for each token this rank's router sees (megatron's
    sequence-major order, this rank's sequence-parallel shard), its batch-major position b*T + t; positions
    >= num_tokens are sequence-parallel padding: they route live. `layout` = (Tp, B, T) describes
    the whole TP group's rows in the order `gather` concatenates them: sequence-major (s, b) over the padded
    length Tp; the capture turns them batch-major and drops s >= T when (and if) it is read.
    `gather` (TP > 1) collects (N_local, k) tensors from the TP group.
    """

    def __init__(self, capture, local_pos: torch.Tensor | None, num_tokens: int, layout: tuple[int, int, int],
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None, keep_used: bool = False):
        self.capture = capture
        # layer -> the (N_local, k) experts this forward used, kept for its recompute in the backward (keep_used)
        self.used: dict[int, torch.Tensor] | None = {} if keep_used else None
        self.local_pos = local_pos
        self.num_tokens = num_tokens
        self.layout = layout
        self.gather = gather

    def _local_rows(self, table: torch.Tensor, what: str, layer: int) -> torch.Tensor:
        """A batch-major (B*T, k) expert table -> this rank's router rows (N_local, k) int64; -1 on padding."""
        if table.dim() != 2 or table.shape[0] != self.num_tokens:
            raise ValueError(f"{what} for MoE layer {layer}: expected indices of shape "
                             f"(B*T={self.num_tokens}, k), got {tuple(table.shape)}")
        table = table.to(self.local_pos.device, torch.long)
        padded = torch.cat([table, table.new_full((self.local_pos.numel(), table.shape[1]), -1)])
        return padded[self.local_pos]

    def replay(self, layer: int) -> torch.Tensor | None:
        if self.capture is None:
            return None
        idx = self.capture.replay_indices(layer)
        return None if idx is None else self._local_rows(idx, "routing replay", layer)

    def score_experts(self, layer: int, idx_NK: torch.Tensor) -> torch.Tensor | None:
        """(N_local, k) experts whose router scores the capture records for this layer (the given ones, the routed
        idx_NK where none is given), or None when it records no scores."""
        if self.capture is None or not self.capture.record_scores:
            return None
        given = self.capture.score_indices(layer)
        if given is None:
            return idx_NK
        given = self._local_rows(given, "router-score experts", layer)
        return torch.where(given < 0, idx_NK, given)

    def record(self, layer: int, idx: torch.Tensor, weights: torch.Tensor, live: torch.Tensor | None,
               scores: torch.Tensor | None = None, bias_ref: torch.Tensor | None = None):
        """Hand this layer's (unsorted, sequence-major) routing to the capture; under TP gather the group's rows
        first (a collective, so every rank records in step)."""
        if self.capture is None or not self.capture.record:
            return
        if self.gather is not None:
            idx, weights = self.gather(idx), self.gather(weights)
            live = None if live is None else self.gather(live)
            scores = None if scores is None else self.gather(scores)
            bias_ref = None if bias_ref is None else self.gather(bias_ref)
        self.capture.put(layer, idx, weights, live, layout=self.layout, scores=scores, bias_ref=bias_ref)


class RoutingNoise:
    """Noise in the routing of one forward (train.routing_noise): each routed slot, independently with probability
    q, moves to the next expert in the router's own ranking that its token does not use yet (the (k+1)-th best for
    its first moved slot, the (k+2)-th for a second, ...; within the allowed groups of a grouped router, and never
    past the last expert), drawn from `generator` (on the router's device). The weights follow the moved experts
    under the family's rule, so the forward's log-probs and gradient see the noise; the recorded `live` routing stays
    the router's own choice."""

    def __init__(self, q: float, generator: torch.Generator):
        self.q, self.generator = q, generator

    def apply(self, choice_NE: torch.Tensor, k: int) -> torch.Tensor:
        """(N, k) experts from the rule's ranking scores choice_NE (-inf: not allowed), top k with slots moved."""
        r = min(2 * k, choice_NE.shape[1])
        vals_NR, ranked_NR = torch.topk(choice_NE, k=r, dim=1)
        moved_NK = torch.rand(ranked_NR.shape[0], k, generator=self.generator, device=self.generator.device)
        moved_NK = moved_NK.to(choice_NE.device) < self.q
        order_NK = moved_NK.long().cumsum(1)  # the moved slot's rank among its token's moved slots, from 1
        pick_NK = (k + order_NK - 1).clamp(max=r - 1)
        moved_NK &= (order_NK <= r - k) & torch.isfinite(vals_NR.gather(1, pick_NK))
        slot_NK = torch.arange(k, device=choice_NE.device).expand_as(pick_NK)
        return ranked_NR.gather(1, torch.where(moved_NK, pick_NK, slot_NK))


class MoERouter(TopKRouter):
    """Top-k routing by the family's rule (module docstring), in float32.

    With a RoutingContext active (`routing_scope`, entered by the policy for each forward), it replays given expert
    indices (the live scores still give the weights, so the router keeps its gradient) and records what it used,
    and, when the capture asks, the router scores of the routed or of given experts: log softmax(logits)[e]
    (softmax rule) or log sigmoid(logits[e]) (sigmoid rule), detached. With an expert bias and a capture that asks
    (`bias_split`), it also records the experts the bias of the capture's reference (`bias_reference`) would have
    chosen from the same logits, which separates the bias update's flips from the gradient's.

    The policy sets the rule's settings after megatron builds the module: norm_topk_prob, n_group, topk_group,
    scaling, and moe_layer (this router's index among the MoE layers).
    """

    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    moe_layer: int = 0
    bias_reference: torch.Tensor | None = None

    @property
    def sigmoid(self) -> bool:
        return self.score_function == "sigmoid"

    def choose(self, logits_NE: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(N, k) experts the rule picks from float32 logits (with `bias` for the expert bias when given)."""
        return torch.topk(self.choice_scores(logits_NE, bias), k=self.topk, dim=1).indices

    def choice_scores(self, logits_NE: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """(N, E) what the rule ranks experts by: the logits, or the biased sigmoid scores with the experts outside
        a token's best groups at -inf."""
        if not self.sigmoid:
            return logits_NE
        choice = torch.sigmoid(logits_NE) + (self.expert_bias if bias is None else bias)
        if self.n_group > 1:
            N, E = choice.shape
            group_NG = choice.view(N, self.n_group, E // self.n_group).topk(2, dim=-1).values.sum(-1)
            best = group_NG.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        return choice

    def weights(self, logits_NE: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
        """(N, k) combine weights of experts idx_NK under the rule, differentiable in the logits."""
        if self.sigmoid:
            w_NK = torch.sigmoid(logits_NE.gather(1, idx_NK))
            if self.norm_topk_prob:
                w_NK = w_NK / (w_NK.sum(-1, keepdim=True) + 1e-20)
            return w_NK * self.scaling
        if self.norm_topk_prob:
            return torch.softmax(logits_NE.gather(1, idx_NK), dim=-1)
        return torch.softmax(logits_NE, dim=-1).gather(1, idx_NK)

    def log_scores(self, logits_NE: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
        """(N, k) detached router scores of experts idx_NK (see the class docstring)."""
        logits_NE = logits_NE.detach()
        if self.sigmoid:
            return torch.nn.functional.logsigmoid(logits_NE.gather(1, idx_NK))
        return torch.log_softmax(logits_NE, dim=-1).gather(1, idx_NK)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        logits_NE = logits.reshape(-1, self.config.num_moe_experts).float()
        ctx, recomputing = active_routing()
        layer = self.moe_layer
        if recomputing:  # the backward's recompute: the experts of the first forward, recorded there already
            return self._routed(logits, logits_NE, ctx.used[layer].to(logits_NE.device), padding_mask)[:2]
        capture = None if ctx is None else ctx.capture
        noise = getattr(capture, "noise", None)
        with torch.no_grad():
            choice_NE = self.choice_scores(logits_NE)
            live_idx_NK = torch.topk(choice_NE, k=self.topk, dim=1).indices
        idx_NK = live_idx_NK
        replayed = ctx.replay(layer) if ctx is not None else None
        if replayed is not None:
            idx_NK = torch.where(replayed < 0, live_idx_NK, replayed)
        elif noise is not None:
            with torch.no_grad():
                idx_NK = noise.apply(choice_NE, self.topk)
        probs_NE, routing_map_NE, w_NK = self._routed(logits, logits_NE, idx_NK, padding_mask)
        if ctx is not None and ctx.used is not None:
            ctx.used[layer] = idx_NK
        if capture is not None:
            score_idx_NK = ctx.score_experts(layer, idx_NK)
            scores_NK = None if score_idx_NK is None else self.log_scores(logits_NE, score_idx_NK)
            under_ref_bias = None
            if self.enable_expert_bias and capture.bias_split and self.bias_reference is not None:
                with torch.no_grad():
                    under_ref_bias = self.choose(logits_NE, self.bias_reference)
            differs = replayed is not None or noise is not None
            ctx.record(layer, idx_NK, w_NK, live_idx_NK if differs else None, scores_NK, under_ref_bias)
        return probs_NE, routing_map_NE

    def _routed(self, logits, logits_NE, idx_NK, padding_mask):
        """(probs (N, E), routing map (N, E), weights (N, k)) of experts idx_NK: the weights from the live logits
        (the router's gradient flows through them), megatron's load-balancing loss and expert-bias token counts in
        forwards with gradient (so once per step's forward: a checkpointed first forward runs without gradient, its
        recompute with it)."""
        w_NK = self.weights(logits_NE, idx_NK)
        probs_NE = torch.zeros_like(logits_NE).scatter(1, idx_NK, w_NK)
        routing_map_NE = torch.zeros_like(logits_NE, dtype=torch.bool).scatter(1, idx_NK, True)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            probs_NE = self.load_balancing_loss(logits, logits_NE, probs_NE, padding_mask)
        if self.enable_expert_bias:  # megatron's token counts for the bias update (forwards with gradient only)
            self._apply_expert_bias(routing_map_NE, padding_mask=padding_mask)
        return probs_NE, routing_map_NE, w_NK

    def load_balancing_loss(self, logits, logits_NE, probs_NE, padding_mask):
        """megatron's load-balancing losses (model.moe_router_load_balancing_type) on the live router scores,
        attached to the probabilities the way TopKRouter.routing attaches them: their gradient joins the backward
        of whatever loss the probabilities feed."""
        s, b = logits.shape[:2]  # (s, b, E) sequence-major
        mask_N = None if padding_mask is None else padding_mask.reshape(-1)
        rmap, scores = compute_routing_scores_for_aux_loss(logits_NE, self.topk, self.score_function,
                                                           padding_mask=mask_N)
        probs_NE = self._apply_aux_loss(probs_NE, scores, rmap, with_padding_mask=mask_N is not None)
        return self._apply_seq_aux_loss(probs_NE, scores, rmap, s, b, with_padding_mask=mask_N is not None)
