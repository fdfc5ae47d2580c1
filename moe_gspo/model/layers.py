"""The modules the layer spec plugs into megatron-core: SDPA core attention, an RMSNorm that allows sequence
parallelism, query/key norms over all heads, and plain-torch expert loops (the router is in model.router).

Single-device code: tensor/expert parallel sizes come in through megatron's process groups, never from here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide, get_pg_size

from moe_gspo.model.routing_capture import flat_positions


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
    (sq, b, heads, head_dim); the weight spans this rank's heads in order. Under tensor parallelism each rank holds
    its heads' part of the weight (split like the heads, saved as a TP-sharded tensor), and the mean of squares
    sums each rank's part over the TP group (an all-reduce whose backward all-reduces too: every rank's output
    depends on every rank's heads)."""

    HEADS = ""  # the TransformerConfig field giving the head count

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused):
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.tp = config.tensor_model_parallel_size
        heads = getattr(config, self.HEADS)
        self.heads, self.width = divide(heads, self.tp), heads * hidden_size
        super().__init__(self.heads * hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        self.tp_group = None
        if self.tp > 1:
            from megatron.core import parallel_state

            set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
            self.tp_group = parallel_state.get_tensor_model_parallel_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2)
        if self.tp == 1:
            return super().forward(flat).view(x.shape)
        from torch.distributed.nn.functional import all_reduce

        h = flat.float()
        squares = all_reduce(h.pow(2).sum(-1, keepdim=True), group=self.tp_group)
        return (self.weight * (h * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)).view(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight as a tensor split over TP along its heads (megatron treats a module without this method as
        replicated)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=self.tp_group or parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group"))


class QueryNormAllHeads(_AllHeadsRMSNorm):
    HEADS = "num_attention_heads"


class KeyNormAllHeads(_AllHeadsRMSNorm):
    HEADS = "num_query_groups"


class SDPAttention(MegatronModule):
    """Causal core attention through torch's scaled_dot_product_attention (GQA without repeating k/v).

    Replaces megatron's local DotProductAttention (unfused baddbmm + masked softmax + bmm), which spends about
    half of a CPU step in copies. Inputs/outputs use megatron's layout: q (sq, b, np, hn), k/v (sk, b, ng, hn)
    -> context (sq, b, np * hn_v) (hn_v: the values' width, v_channels under multi-head latent attention), causal over right-padded or full sequences (the explicit mask megatron passes is
    ignored in favour of is_causal). Packed sequences come in megatron's THD format (packed_seq_params with
    qkv_format='thd': q (t, np, hn) holding the sequences back to back); attention alone runs them as right-padded
    rows in one causal call (the rest of the layer stays packed), so no token sees another sequence and no [t, t]
    mask is built.

    GPT-OSS's attention runs here too, explicitly (scores, mask, softmax, values; O(T^2) memory per head): a learned
    sink logit per head (megatron's softmax_type='learnable', its `softmax_offset` parameter, split over TP with the
    heads) joins each query's softmax denominator and takes no value, and the layers config.window_attn_skip_freq
    marks attend to their window of config.window_size[0] + 1 tokens only. megatron's own local core attention has
    both but allocates the sink on CUDA, so it does not build on the CPU.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None):
        super().__init__(config=config)
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        # multi-head latent attention passes its query/key and value widths (they differ); megatron's local
        # DotProductAttention takes neither, so MLA without Transformer Engine needs this module
        self.head_dim = v_channels or config.kv_channels
        self.scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        window = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.window = config.window_size[0] + 1 if window else None  # keys a query sees, its own included
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        self.softmax_offset = None
        if config.softmax_type == "learnable":
            device = None if config.use_cpu_initialization else torch.cuda.current_device()
            self.softmax_offset = torch.nn.Parameter(torch.zeros(self.heads, dtype=config.params_dtype,
                                                                 device=device))
            set_tensor_model_parallel_attributes(self.softmax_offset, is_parallel=True, dim=0, stride=1)
            if config.perform_initialization:
                with torch.no_grad():
                    config.init_method(self.softmax_offset)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type={config.softmax_type!r} is not implemented")

    def _sdpa(self, q, k, v):
        if self.softmax_offset is not None or self.window is not None:
            return self._explicit(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              dropout_p=self.dropout if self.training else 0.0,
                                              enable_gqa=self.groups != self.heads)

    def _explicit(self, q, k, v):
        """Causal attention of q (b, np, s, hn) over k/v (b, ng, s, hn) with the window and the sinks, softmax in
        float32 -> (b, np, s, hn_v)."""
        rep = self.heads // self.groups
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        s = q.shape[2]
        logits = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # (b, np, s, s)
        pos = torch.arange(s, device=q.device)
        back = pos[:, None] - pos[None, :]  # how far each key lies before each query
        allowed = back >= 0 if self.window is None else (back >= 0) & (back < self.window)
        logits = logits.masked_fill(~allowed, float("-inf"))
        if self.softmax_offset is not None:
            sink = self.softmax_offset.float().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :s]
        else:
            probs = torch.softmax(logits, dim=-1)
        probs = F.dropout(probs, p=self.dropout, training=self.training)
        return torch.matmul(probs.to(v.dtype), v)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The sinks as a tensor split over TP with the heads (none without them)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True) if self.softmax_offset is not None else {}
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=self.tp_group or parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group"))

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
    if cached is None:  # built on the host from the bounds, then moved in one copy each
        bounds = seq_bounds(psp)
        lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        t, width = bounds[-1], max(lens)
        j = torch.arange(width)
        start, n = torch.tensor(bounds[:-1])[:, None], torch.tensor(lens)[:, None]
        rows = torch.where(j < n, start + j, t)  # (b, Lmax)
        keep = flat_positions(lens, [0] * len(lens), width)  # the packed order
        cached = psp.row_layout = (to_device(rows, device), to_device(keep, device))
    return cached


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A tensor built on the host, on `device`: through pinned memory and a non-blocking copy on a GPU, so that the
    host does not wait for the device's queue to drain first (a copy from pageable memory would)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class TorchLoopExperts(SequentialMLP):
    """megatron's SequentialMLP (same parameters, names and sharded state) whose per-expert loop runs in plain torch
    ops: x W1^T, SwiGLU, times the routing probability, W2^T. megatron's path wraps each of those GEMMs in its
    ColumnParallelLinear / RowParallelLinear autograd functions, whose per-call Python dominates at small widths;
    with an expert-TP group of size 1 their collectives are identities, so the plain ops compute the same values
    and gradients. GPT-OSS's experts take this path too: biases on both linears (the output's scaled by the routing
    probability, as megatron's MLP scales it), and the GLU act(clamp(gate)) * (clamp(up) + offset) of megatron's
    activation_func_clamp_value and glu_linear_offset. Any other case (expert TP > 1, FP8/FP4, another activation)
    goes to megatron's forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        for expert in self.local_experts:
            # megatron-core 0.16.1 marks a RowParallelLinear's bias `sequence_parallel`, expert or not, so that
            # finalize_model_grads sums its gradient over the TP group; an expert with expert-TP 1 computes every
            # token dispatched to it, so its output bias's gradient is whole on each rank already (and under EP the
            # TP peers hold other experts): summing would add unrelated gradients
            if expert.linear_fc2.bias is not None:
                setattr(expert.linear_fc2.bias, "sequence_parallel", False)
        self._plain = (not (c.fp8 or c.fp4) and c.gated_linear_unit and not c.moe_apply_probs_on_input
                       and not c.use_te_activation_func and not c.bias_activation_fusion
                       and all(get_pg_size(e.linear_fc1.tp_group) == 1 and get_pg_size(e.linear_fc2.tp_group) == 1
                               for e in self.local_experts))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self._plain:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = tokens_per_expert.tolist()
        c = self.config
        clamp, offset = c.activation_func_clamp_value, c.glu_linear_offset
        out = []
        for expert, x, p in zip(self.local_experts, torch.split(permuted_local_hidden_states, counts),
                                torch.split(permuted_probs, counts), strict=True):
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            h = F.linear(x, fc1.weight, fc1.bias)  # (n, 2I): gate over up, as megatron's fc1
            gate, up = torch.chunk(h, 2, dim=-1)
            if clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
            p = p.unsqueeze(-1)
            # megatron's MLP scales by the probability after the GLU
            act = (c.activation_func(gate) * (up + offset if offset else up)) * p
            y = torch.matmul(act.to(h.dtype), fc2.weight.t())
            out.append(y if fc2.bias is None else y + fc2.bias * p)  # and the output bias by it too
        return torch.cat(out, dim=0), None
