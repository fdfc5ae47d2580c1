"""Which part of each HF-named tensor a trainer rank holds, and that part as a view of the rank's own parameters.

    shards = TrainerShards(mc, tp=2, ep=2)
    shards.region("model.layers.0.self_attn.q_proj.weight", tp_rank=1, ep_rank=0)   # Region(dim=0, 64, 128)
    views = shards.local_views(policy.megatron_state(), tp_rank=1, ep_rank=0)      # HF key -> view of the part held

The trainer's layout (megatron-core, expert tensor parallelism 1):
- q/k/v_proj: megatron splits linear_qkv by whole query groups, so TP rank i holds the q heads, k heads and v heads
  of its groups: a contiguous block of rows of each of q_proj, k_proj and v_proj;
- o_proj (linear_proj): the columns of those q heads;
- embed_tokens / lm_head (word_embeddings / output_layer): a contiguous block of vocabulary rows;
- q/k/v biases: the same rows as their weights;
- experts: whole, on the expert-parallel rank that owns them (expert e on EP rank e // (E / ep));
- a shared expert (megatron's SharedExpertMLP, tensor-parallel like a dense MLP) and a dense first layer's MLP:
  rows of gate_proj and up_proj, the same columns of down_proj;
- latent attention: q_b_proj (or q_proj) and kv_b_proj the rows of the rank's heads, o_proj their columns; the
  down projections (q_a_proj, kv_a_proj_with_mqa) and their norms whole;
- GPT-OSS's sinks: those of the rank's q heads; o_proj's bias, the router's weight and bias whole on every rank;
  the experts' biases whole with their expert;
- norms, the router and the shared expert's gate: whole, on every rank.

A rollout engine with its own tensor-parallel layout asks for regions of the same HF tensors, so the sync can move
each piece from a rank that holds it to the engine rank that keeps it without either side building a full tensor
(moe_gspo.rollout.sync.plan).
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moe_gspo.config import ModelConfig
from moe_gspo.model.hf_io import hf_sources

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..*)$")
_DENSE_MLP = re.compile(r"^model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight$")  # a dense first layer's MLP


@dataclass(frozen=True)
class Region:
    """Rows (dim 0) or columns (dim 1) [start, stop) of an HF tensor; dim None is the whole tensor."""

    dim: int | None
    start: int = 0
    stop: int = 0

    @property
    def length(self) -> int:
        return self.stop - self.start


WHOLE = Region(None)


def expert_of(key: str) -> int | None:
    """The expert index of a per-expert HF key, None for every other key."""
    m = _EXPERT.match(key)
    return None if m is None else int(m[2])


def hf_shapes(mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF key -> full shape, in hf_sources order (the order save_pretrained writes)."""
    H, V, d, inter = mc.hidden_size, mc.vocab_size, mc.head_dim, mc.moe_intermediate_size
    nq, ng = mc.num_attention_heads, mc.num_key_value_heads
    qk = mc.qk_nope_head_dim + mc.qk_rope_head_dim  # latent attention: a query (and key) head's width
    by_tail = {  # latent attention's projections and norms, the sigmoid router's expert bias
        "q_a_proj.weight": (mc.q_lora_rank, H), "q_a_layernorm.weight": (mc.q_lora_rank,),
        "q_b_proj.weight": (nq * qk, mc.q_lora_rank), "kv_a_layernorm.weight": (mc.kv_lora_rank,),
        "kv_a_proj_with_mqa.weight": (mc.kv_lora_rank + mc.qk_rope_head_dim, H),
        "kv_b_proj.weight": (nq * (mc.qk_nope_head_dim + mc.v_head_dim), mc.kv_lora_rank),
        "gate.e_score_correction_bias": (mc.num_experts,),
        # GPT-OSS's sinks (a logit per query head), router with a bias
        "self_attn.sinks": (nq,), "router.weight": (mc.num_experts, H), "router.bias": (mc.num_experts,)}
    out = {}
    for key, _, _ in hf_sources(mc):
        tail = ".".join(key.split(".")[-2:])
        if tail in by_tail:
            out[key] = by_tail[tail]
        elif key.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[key] = (V, H)
        elif key.endswith("q_proj.weight"):
            out[key] = (nq * (qk if mc.mla else d), H)
        elif key.endswith(("k_proj.weight", "v_proj.weight")):
            out[key] = (ng * d, H)
        elif key.endswith("o_proj.weight"):
            out[key] = (H, nq * (mc.v_head_dim if mc.mla else d))
        elif key.endswith(("q_norm.weight", "k_norm.weight")):  # per head, or all heads at once (OLMoE)
            out[key] = (((nq if key.endswith("q_norm.weight") else ng) * d,) if mc.qk_norm_all_heads else (d,))
        elif key.endswith("q_proj.bias"):
            out[key] = (nq * d,)
        elif key.endswith(("k_proj.bias", "v_proj.bias")):
            out[key] = (ng * d,)
        elif _DENSE_MLP.match(key) or ".mlp.shared_expert." in key or ".mlp.shared_experts." in key:
            width = mc.intermediate_size if _DENSE_MLP.match(key) else mc.shared_expert_intermediate_size
            out[key] = (H, width) if key.endswith("down_proj.weight") else (width, H)
        elif key.endswith("mlp.shared_expert_gate.weight"):
            out[key] = (1, H)
        elif key.endswith("mlp.gate.weight"):
            out[key] = (mc.num_experts, H)
        elif key.endswith(("gate_proj.weight", "up_proj.weight")):
            out[key] = (inter, H)
        elif key.endswith(("gate_proj.bias", "up_proj.bias")):  # GPT-OSS's experts
            out[key] = (inter,)
        elif key.endswith("down_proj.weight"):
            out[key] = (H, inter)
        else:
            out[key] = (H,)
    return out


class TrainerShards:
    """The trainer's TP x EP layout in HF coordinates (see the module docstring)."""

    def __init__(self, mc: ModelConfig, tp: int, ep: int):
        self.mc, self.tp, self.ep = mc, tp, ep
        self.e_local = mc.num_experts // ep
        self.shapes = hf_shapes(mc)
        self.keys = list(self.shapes)

    def split_dim(self, key: str) -> int | None:
        """The dimension TP splits this HF tensor along in the trainer, None if no rank holds a part of it only."""
        if self.tp == 1:
            return None
        # (region() has taken the routed experts: every gate/up/down projection here is a shared expert's or a dense
        # first layer's MLP, tensor-parallel like any megatron MLP)
        if key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias",
                         "v_proj.bias", "embed_tokens.weight", "lm_head.weight", "gate_proj.weight",
                         "up_proj.weight", "q_b_proj.weight", "kv_b_proj.weight")):
            return 0  # latent attention's up projections by heads; its down projections are replicated
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            return 1
        if self.mc.qk_norm_all_heads and key.endswith(("q_norm.weight", "k_norm.weight")):
            return 0  # OLMoE's norm over all heads, split like the heads
        if key.endswith("self_attn.sinks"):
            return 0  # GPT-OSS: a sink per query head, split like the heads (o_proj's bias stays whole)
        return None

    def region(self, key: str, tp_rank: int, ep_rank: int) -> Region | None:
        """What the rank at (tp_rank, ep_rank) holds of `key`, or None if it holds none of it."""
        e = expert_of(key)
        if e is not None:
            return WHOLE if e // self.e_local == ep_rank else None
        dim = self.split_dim(key)
        if dim is None:
            return WHOLE
        per = self.shapes[key][dim] // self.tp
        return Region(dim, tp_rank * per, (tp_rank + 1) * per)

    def local_views(self, local: dict[str, torch.Tensor], tp_rank: int, ep_rank: int) -> dict[str, torch.Tensor]:
        """HF key -> the part of it this rank holds (`region`), as a view of the rank's megatron parameters
        (`local`: MoEPolicy.megatron_state(), per-expert names with local expert indices). Keys the rank holds
        none of are absent."""
        mc = self.mc
        # one rank's names and shapes: not a model of its own, so not validated as one (OLMoE's heads x head_dim
        # would no longer equal hidden_size); top-k plays no part
        local_mc = copy.copy(mc)
        local_mc.num_attention_heads = mc.num_attention_heads // self.tp
        local_mc.num_key_value_heads = mc.num_key_value_heads // self.tp
        local_mc.num_experts = self.e_local
        local_mc.shared_expert_intermediate_size = mc.shared_expert_intermediate_size // self.tp
        local_mc.intermediate_size = mc.intermediate_size // self.tp
        out = {}
        for key, src, f in hf_sources(local_mc):
            m = _EXPERT.match(key)
            if m is not None:
                key = f"{m[1]}{ep_rank * self.e_local + int(m[2])}{m[3]}"
            out[key] = f(local[src].detach())
        return out


# ---------------------------------------------------------------- sharding (tp, ep)
def _expert_of(name: str) -> tuple[str, int, str] | None:
    key = ".mlp.experts.local_experts."
    if key not in name:
        return None
    head, tail = name.split(key)
    e, rest = tail.split(".", 1)
    return head + key, int(e), rest


def tp_dim(name: str, mc: ModelConfig | None = None) -> int | None:
    """The dimension megatron splits over TP for a (non-expert) parameter of `mc`'s architecture, or None if
    replicated."""
    if name.endswith(_TP_ROWS):
        return 0
    if mc is not None and mc.qk_norm_all_heads and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return 0  # a norm over all heads: each rank holds its heads' part
    if name.endswith(("linear_proj.weight", "shared_experts.linear_fc2.weight", "mlp.linear_fc2.weight")):
        return 1
    return None


# column-parallel: split over TP by output rows (multi-head latent attention's up projections by whole heads; its
# down projections are replicated)
_TP_ROWS = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight",
            "shared_experts.linear_fc1.weight", "mlp.linear_fc1.weight", "linear_q_proj.weight",
            "linear_q_up_proj.weight", "linear_kv_up_proj.weight", "core_attention.softmax_offset")
_GATE_UP = ("shared_experts.linear_fc1.weight", "mlp.linear_fc1.weight")  # gate over up, each split over TP


def _tp_slice(name: str, t: torch.Tensor, mc: ModelConfig, tp: int, r: int) -> torch.Tensor:
    """TP rank r's slice of the full parameter `name` (tp_dim says it is split)."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):  # whole query groups
        return t.view(mc.num_key_value_heads, -1, *t.shape[1:]).chunk(tp, dim=0)[r].reshape(-1, *t.shape[1:])
    if name.endswith(_GATE_UP):  # gate over up, each split: [gate_r; up_r]
        return t.view(2, -1, t.shape[-1]).chunk(tp, dim=1)[r].reshape(-1, t.shape[-1])
    return t.chunk(tp, dim=tp_dim(name, mc))[r]


def _tp_join(name: str, parts: list[torch.Tensor], mc: ModelConfig, tp: int) -> torch.Tensor:
    """The inverse of _tp_slice over the TP ranks' parts."""
    t = parts[0]
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return torch.cat([p.view(mc.num_key_value_heads // tp, -1, *t.shape[1:]) for p in parts]).reshape(
            -1, *t.shape[1:])
    if name.endswith(_GATE_UP):
        return torch.cat([p.view(2, -1, t.shape[-1]) for p in parts], dim=1).reshape(-1, t.shape[-1])
    return torch.cat(parts, dim=tp_dim(name, mc))


def shard_state(full: dict[str, torch.Tensor], mc: ModelConfig, tp: int, tp_rank: int, ep: int,
                ep_rank: int) -> dict[str, torch.Tensor]:
    """This rank's slice of a full megatron state dict (experts renumbered locally; ETP = 1)."""
    e_local = mc.num_experts // ep
    out = {}
    for name, t in full.items():
        ex = _expert_of(name)
        if ex is not None:
            head, e, rest = ex
            if e // e_local == ep_rank:
                out[f"{head}{e % e_local}.{rest}"] = t
            continue
        if tp_dim(name, mc) is not None and tp > 1:
            t = _tp_slice(name, t, mc, tp, tp_rank)
        out[name] = t
    return out


def gather_state(local: dict[str, torch.Tensor], mc: ModelConfig, tp_group, ep_group) -> dict[str, torch.Tensor]:
    """Inverse of shard_state: every rank returns the full megatron state dict (collective over TP and EP)."""
    import torch.distributed as dist

    tp, ep = dist.get_world_size(tp_group), dist.get_world_size(ep_group)
    e_local = mc.num_experts // ep
    full = {}
    for name, t in local.items():
        t = t.detach()
        ex = _expert_of(name)
        if ex is not None:
            head, e, rest = ex
            parts = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(parts, t.contiguous(), group=ep_group)
            for r, p in enumerate(parts):
                full[f"{head}{r * e_local + e}.{rest}"] = p
            continue
        if tp_dim(name, mc) is not None and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = _tp_join(name, parts, mc, tp)
        full[name] = t
    return full


class StreamedHFState(Mapping):
    """A rank's view of the full HF-named state while its parameters stay sharded over TP and EP: reading a key
    gathers the megatron parameter behind it (one collective), and a gathered parameter is dropped once every HF
    tensor cut from it has been read. Reading the keys in order therefore holds at most one layer's experts
    beyond what the reader keeps (an expert gather brings that local expert of every EP rank). Every rank of the
    TP and EP groups must read every key once, in this mapping's order (the collectives must match)."""

    def __init__(self, local: dict[str, torch.Tensor], mc: ModelConfig, tp_group, ep_group):
        import torch.distributed as dist

        self._local, self._mc, self._tp_group, self._ep_group = local, mc, tp_group, ep_group
        self._e_local = mc.num_experts // dist.get_world_size(ep_group)
        self._sources = {k: (src, f) for k, src, f in hf_sources(mc)}
        self._uses = Counter(src for src, _ in self._sources.values())  # HF tensors left to cut from each
        self._cache: dict[str, torch.Tensor] = {}
        self.peak_bytes = 0  # the most gathered bytes held at once (for tests and logs)

    def __iter__(self):
        return iter(self._sources)

    def __len__(self):
        return len(self._sources)

    def _local_name(self, full_name: str) -> str:
        ex = _expert_of(full_name)
        return full_name if ex is None else f"{ex[0]}{ex[1] % self._e_local}.{ex[2]}"

    def __getitem__(self, key: str) -> torch.Tensor:
        src, f = self._sources[key]
        if src not in self._cache:
            name = self._local_name(src)
            self._cache.update(gather_state({name: self._local[name]}, self._mc, self._tp_group, self._ep_group))
            self.peak_bytes = max(self.peak_bytes, sum(t.numel() * t.element_size() for t in self._cache.values()))
        t = f(self._cache[src])
        self._uses[src] -= 1
        if self._uses[src] == 0:
            del self._cache[src]
        return t
