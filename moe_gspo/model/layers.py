"""The modules the Qwen3-MoE layer spec plugs into megatron-core: SDPA core attention, an RMSNorm that allows
sequence parallelism, and a softmax top-k router that exposes and can replay its routing.

Single-device code: tensor/expert parallel sizes come in through megatron's process groups, never from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide, get_pg_size


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with megatron's norm constructor signature; marks its weight `sequence_parallel` so that
    megatron's finalize_model_grads all-reduces its gradient over the TP group when SP is on (megatron's
    WrappedTorchNorm refuses SP)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused):
        # on the current GPU unless megatron builds on the CPU, like megatron's own modules
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


class _AllHeadsRMSNorm(torch.nn.RMSNorm):
    """RMSNorm over all heads of a query or key at once (OLMoE normalizes q_proj's and k_proj's whole output,
    nq x head_dim and nkv x head_dim wide), where megatron's q_layernorm / k_layernorm normalize each head over
    head_dim. Built by megatron as a q/k layernorm (its constructor gets head_dim as hidden_size) and applied to
    (sq, b, heads, head_dim); the weight spans the heads in order. At tensor parallelism 1 only: split over ranks the
    norm would need the other ranks' heads (ModelConfig refuses it)."""

    HEADS = ""  # the TransformerConfig field giving the head count

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused):
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.heads = getattr(config, self.HEADS)
        super().__init__(self.heads * hidden_size, eps=eps, dtype=config.params_dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view(x.shape)


class QueryNormAllHeads(_AllHeadsRMSNorm):
    HEADS = "num_attention_heads"


class KeyNormAllHeads(_AllHeadsRMSNorm):
    HEADS = "num_query_groups"


class SDPAttention(MegatronModule):
    """Causal core attention through torch's scaled_dot_product_attention (GQA without repeating k/v).

    Replaces megatron's local DotProductAttention (unfused baddbmm + masked softmax + bmm), which spends about
    half of a CPU step in copies. Inputs/outputs use megatron's layout: q (sq, b, np, hn), k/v (sk, b, ng, hn)
    -> context (sq, b, np * hn), causal over right-padded or full sequences (the explicit mask megatron passes is
    ignored in favour of is_causal). Packed sequences come in megatron's THD format (packed_seq_params with
    qkv_format='thd': q (t, np, hn) holding the sequences back to back); attention alone runs them as right-padded
    rows in one causal call (the rest of the layer stays packed), so no token sees another sequence and no [t, t]
    mask is built.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              dropout_p=self.dropout if self.training else 0.0,
                                              enable_gqa=self.groups != self.heads)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_bias is None, "SDPAttention: no attention bias"
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        q = query.permute(1, 2, 0, 3)  # (b, np, sq, hn)
        k = key.permute(1, 2, 0, 3)  # (b, ng, sk, hn)
        v = value.permute(1, 2, 0, 3)
        ctx = self._sdpa(q, k, v)
        sq, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)  # (sq, b, np*hn)

    def _packed(self, query, key, value, psp):
        """THD: q (t, np, hn), k/v (t, ng, hn) -> (t, np * hn). The sequences of psp.cu_seqlens_q are laid out as
        right-padded rows for one causal SDPA call (padding after a row's tokens is never attended by them), and
        their outputs gathered back into the packed order; no token attends across sequences."""
        assert psp.qkv_format == "thd", f"SDPAttention: packed format {psp.qkv_format!r} is not 'thd'"
        rows, keep = packed_rows(psp, query.device)  # (b, Lmax) into t (t = padding), (t,) into b * Lmax

        def as_rows(x):  # (t, h, hn) -> (b, h, Lmax, hn)
            padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
            return padded[rows].permute(0, 2, 1, 3)

        ctx = self._sdpa(as_rows(query), as_rows(key), as_rows(value))  # (b, np, Lmax, hn)
        b, _, L, _ = ctx.shape
        return ctx.permute(0, 2, 1, 3).reshape(b * L, self.heads * self.head_dim)[keep]


def seq_bounds(psp) -> list[int]:
    """Host copy of a PackedSeqParams' cu_seqlens_q: the policy attaches it when it packs (`bounds`), so that no
    layer waits on the device for it."""
    bounds = getattr(psp, "bounds", None)
    return bounds if bounds is not None else psp.cu_seqlens_q.tolist()


def packed_rows(psp, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (b, Lmax): packed position of each sequence's j-th token, t past its end; keep (t,): where each packed
    token sits in the flattened rows) of a THD PackedSeqParams, built on its first use in a forward and kept on it
    for the other layers."""
    cached = getattr(psp, "row_layout", None)
    if cached is None:
        bounds = seq_bounds(psp)
        lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        t, width = bounds[-1], max(lens)
        j = torch.arange(width)
        start, n = torch.tensor(bounds[:-1])[:, None], torch.tensor(lens)[:, None]
        rows = torch.where(j < n, start + j, t)  # (b, Lmax)
        keep = (rows.reshape(-1) < t).nonzero().squeeze(1)  # row-major: the packed order
        cached = psp.row_layout = (rows.to(device), keep.to(device))
    return cached


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
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.capture = capture
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
        idx = self.capture.replay_indices(layer)
        return None if idx is None else self._local_rows(idx, "routing replay", layer)

    def score_experts(self, layer: int, idx_NK: torch.Tensor) -> torch.Tensor | None:
        """(N_local, k) experts whose router scores the capture records for this layer (the given ones, the routed
        idx_NK where none is given), or None when it records no scores."""
        if not self.capture.record_scores:
            return None
        given = self.capture.score_indices(layer)
        if given is None:
            return idx_NK
        given = self._local_rows(given, "router-score experts", layer)
        return torch.where(given < 0, idx_NK, given)

    def record(self, layer: int, idx: torch.Tensor, weights: torch.Tensor, live: torch.Tensor | None,
               scores: torch.Tensor | None = None):
        """Hand this layer's (unsorted, sequence-major) routing to the capture; under TP gather the group's rows
        first (a collective, so every rank records in step)."""
        if not self.capture.record:
            return
        if self.gather is not None:
            idx, weights = self.gather(idx), self.gather(weights)
            live = None if live is None else self.gather(live)
            scores = None if scores is None else self.gather(scores)
        self.capture.put(layer, idx, weights, live, layout=self.layout, scores=scores)


class Qwen3Router(TopKRouter):
    """Qwen3-MoE routing: softmax over experts, top-k, renormalize the k weights (norm_topk_prob), fp32.

    Softmax over the top-k logits equals Qwen's softmax -> top-k -> renormalize. With a RoutingContext set
    (`self.routing_context`, managed by the policy per forward), it replays given expert indices (the live scores
    still give the weights, so the router keeps its gradient) and records what it used, and, when the capture asks,
    the router scores log softmax(logits)[e] (detached) of the routed or of given experts.
    """

    norm_topk_prob: bool = True
    routing_context: RoutingContext | None = None

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        logits_NE = logits.reshape(-1, self.config.num_moe_experts).float()
        live_idx_NK = torch.topk(logits_NE, k=self.topk, dim=1).indices
        idx_NK, ctx = live_idx_NK, self.routing_context
        layer = self.layer_number - 1
        replayed = ctx.replay(layer) if ctx is not None else None
        if replayed is not None:
            idx_NK = torch.where(replayed < 0, live_idx_NK, replayed)
        if self.norm_topk_prob:
            w_NK = torch.softmax(logits_NE.gather(1, idx_NK), dim=-1)
        else:
            w_NK = torch.softmax(logits_NE, dim=-1).gather(1, idx_NK)
        probs_NE = torch.zeros_like(logits_NE).scatter(1, idx_NK, w_NK)
        routing_map_NE = torch.zeros_like(logits_NE, dtype=torch.bool).scatter(1, idx_NK, True)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            probs_NE = self.load_balancing_loss(logits, logits_NE, probs_NE, padding_mask)
        if ctx is not None:
            score_idx_NK = ctx.score_experts(layer, idx_NK)
            scores_NK = None
            if score_idx_NK is not None:
                scores_NK = torch.log_softmax(logits_NE.detach(), dim=-1).gather(1, score_idx_NK)
            ctx.record(layer, idx_NK, w_NK, None if replayed is None else live_idx_NK, scores_NK)
        return probs_NE, routing_map_NE

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


class TorchLoopExperts(SequentialMLP):
    """megatron's SequentialMLP (same parameters, names and sharded state) whose per-expert loop runs in plain torch
    ops: x W1^T, SwiGLU, times the routing probability, W2^T. megatron's path wraps each of those GEMMs in its
    ColumnParallelLinear / RowParallelLinear autograd functions, whose per-call Python dominates at small widths;
    with an expert-TP group of size 1 their collectives are identities, so the plain ops compute the same values
    and gradients. Any other case (expert TP > 1, FP8/FP4, biases, another activation) goes to megatron's forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        self._plain = (not (c.fp8 or c.fp4) and not c.add_bias_linear and c.gated_linear_unit
                       and c.activation_func is F.silu and c.activation_func_clamp_value is None
                       and not c.glu_linear_offset and not c.moe_apply_probs_on_input
                       and not c.use_te_activation_func and not c.bias_activation_fusion
                       and all(get_pg_size(e.linear_fc1.tp_group) == 1 and get_pg_size(e.linear_fc2.tp_group) == 1
                               for e in self.local_experts))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self._plain:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = tokens_per_expert.tolist()
        out = []
        for expert, x, p in zip(self.local_experts, torch.split(permuted_local_hidden_states, counts),
                                torch.split(permuted_probs, counts), strict=True):
            h = torch.matmul(x, expert.linear_fc1.weight.t())  # (n, 2I): gate over up, as megatron's fc1
            gate, up = torch.chunk(h, 2, dim=-1)
            act = (F.silu(gate) * up) * p.unsqueeze(-1)  # megatron's MLP scales by the probability after the GLU
            out.append(torch.matmul(act.to(h.dtype), expert.linear_fc2.weight.t()))
        return torch.cat(out, dim=0), None
