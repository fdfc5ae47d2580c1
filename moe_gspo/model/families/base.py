"""What a model family is to the package: a `Family` subclass in a file of its own in this folder, which declares
everything that differs between families, so that no code outside this folder names one.

A family declares
- its names: transformers' model_type (`name`), its architecture class in config.json, a human title;
- its own ModelConfig fields (`fields`, a dataclass whose fields ModelConfig takes on) and the generic optional
  fields it accepts (`uses`); every other family's own fields, and generic ones outside `uses`, are refused;
- its architecture: the router's rule, query/key norms, shared experts, biases and sinks, which expert
  implementations run it;
- its checks (`check`), run when a ModelConfig is made, raising FamilyError (config turns it into ConfigError);
- config.json read (`from_hf`) and written (`to_hf`) in transformers' names for it;
- megatron's TransformerConfig fields it sets (`transformer_config`);
- its parameter mapping: the tensors held whole and alike on both sides (`attention_tensors`, `router_tensors`)
  beside the generic q/k/v, MLP and expert views (moe_gspo.model.hf_io);
- its file-name renames (`file_keys`, `package_keys`, `file_items`): the package names every family's tensors as
  Qwen3-MoE's checkpoints do, and a family whose files name them otherwise renames at the file boundary only;
- what vLLM needs or refuses (`vllm`, `vllm_mismatch`), and the other engines' support;
- how a dense checkpoint upcycles into it (`upcycles_from`, `upcycle_fields`).

This module sits below the config layer: it imports neither the config nor the model, only the standard library
(torch and megatron inside the functions that need them)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

PER_EXPERT_KEY = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                            r"\.(?P<kind>weight|bias)$")
"""A routed expert's projection (or its bias) under the package's per-expert names."""

GENERIC_OPTIONAL = ("attention_bias", "shared_expert_intermediate_size", "rope_scaling", "first_k_dense_replace",
                    "intermediate_size", "n_group", "topk_group", "routed_scaling_factor")
"""ModelConfig's generic fields that only some families use; their ModelConfig default means 'not used'."""

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


class FamilyError(ValueError):
    """A value a family refuses (the message names the field); config turns it into its one-line ConfigError."""


class Family:
    """The generic MoE decoder (Qwen3-MoE's layout); each family overrides what differs."""

    name: str = ""
    """transformers' model_type, and model.family's value."""
    title: str = ""
    """The family's name in messages ("GPT-OSS")."""
    hf_architecture: str = ""
    """config.json's architectures entry."""
    fields: type | None = None
    """A dataclass of the family's own ModelConfig fields (names and docstrings as ModelConfig's)."""
    uses: frozenset[str] = frozenset()
    """The GENERIC_OPTIONAL fields the family accepts."""

    router_sigmoid: bool = False
    """Sigmoid scores, a load-balancing expert bias, grouped top-k and a scaling factor (DeepSeek-V3's router),
    rather than a softmax."""
    topk_always_normalized: bool = False
    """Its router takes the softmax over the top-k logits, so norm_topk_prob=false is refused."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(gate . x)."""
    shared_expert_prefix: str = "mlp.shared_expert."
    """The HF module of the shared expert(s) under a layer's prefix."""
    qk_norm: bool = False
    """RMSNorm on each query and key head (besides the use_qk_norm field, for a family whose field it is)."""
    qk_norm_all_heads: bool = False
    """The query/key norms span all heads at once (num_attention_heads x head_dim wide for queries)."""
    linear_biases: bool = False
    """Biases on o_proj, the router and every expert projection, as on q/k/v (megatron's add_bias_linear)."""
    sinks: bool = False
    """A learned sink logit per attention head (megatron's learnable softmax offset)."""
    experts_interleaved: bool = False
    """Its checkpoint files and transformers model keep the experts fused as (E, H, 2I) with gate and up columns
    interleaved, and (E, I, H), rather than the per-expert layout."""
    experts_only: str | None = None
    """The one model.experts implementation its experts run as (None: any), and the default."""
    experts_only_why: str = ""
    hf_attn_implementation: str | None = None
    """The transformers attention implementation the hf engines must use (None: the configured one)."""
    default_rope_theta: float = 1_000_000.0
    """rope_theta when config.json gives none."""
    drops_trailing_layers: bool = False
    """Its checkpoints append layers past num_hidden_layers (multi-token prediction), which are dropped on load."""
    yarn_truncate_key: bool = False
    """rope_scaling may carry 'truncate' (whether YaRN's correction range is rounded to whole dimensions)."""

    hf_moe_module: str = "mlp"
    """The attribute of transformers' decoder layer that holds its MoE block."""
    hf_router_module: str = "gate"
    """The attribute of that block that is its router (its forward's output gives the chosen experts)."""

    vllm: bool = True
    """vLLM's engine serves it: vLLM has a model of it, and the weight sync knows its layout."""
    vllm_rms_norm_eps: float | None = None
    """The RMSNorm epsilon vLLM's model of it uses whatever config.json says (None: config.json's)."""
    vllm_head_dim_from_hidden: bool = False
    """vLLM's attention takes head_dim = hidden_size / num_attention_heads, ignoring config.json's head_dim."""
    vllm_maps_file_names: bool = False
    """vLLM's model renames the checkpoint files' names (its hf_to_vllm_mapper) before its parameters see them."""
    sglang: bool = False
    """SGLang's weight update knows its names."""

    upcycles_from: tuple[str, ...] = ()
    """Dense model_types `moe-gspo upcycle` turns into this family."""
    upcycle_preferred: bool = False
    """The default target for its upcycles_from sources when several families take one."""
    upcycle_shared_expert: bool = False
    """Upcycling makes the dense MLP the shared expert and halves each routed expert's output."""

    # ------------------------------------------------------------------------------------------ config
    def own_field_names(self) -> tuple[str, ...]:
        import dataclasses

        return tuple(f.name for f in dataclasses.fields(self.fields)) if self.fields else ()

    def own_field_defaults(self) -> dict[str, Any]:
        import dataclasses

        return {f.name: f.default for f in dataclasses.fields(self.fields)} if self.fields else {}

    def check(self, mc) -> None:
        """Refuse (FamilyError) what this family's layers cannot compute with `mc`'s fields; fill the family's
        defaults that depend on other fields."""

    def qk_norm_of(self, mc) -> bool:
        """Whether attention normalizes queries and keys with `mc`'s fields."""
        return self.qk_norm

    def from_hf(self, c: dict, where) -> dict:
        """ModelConfig fields of this family read from config.json `c` (`where` names the file in errors):
        the experts' count and width, norm_topk_prob and the family's own. KeyError for a missing field."""
        return dict(num_experts=c.get("num_experts") or c["num_local_experts"],
                    moe_intermediate_size=c["moe_intermediate_size"],
                    norm_topk_prob=bool(c.get("norm_topk_prob", False)))

    def to_hf(self, mc, common: dict) -> dict:
        """config.json for `mc` in this family's transformers config: `common` (every family's fields) plus its
        own."""
        return {**common, "num_experts": mc.num_experts, "moe_intermediate_size": mc.moe_intermediate_size,
                "intermediate_size": mc.moe_intermediate_size, "norm_topk_prob": mc.norm_topk_prob,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                "shared_expert_intermediate_size": mc.shared_expert_intermediate_size, "attention_bias": False}

    def transformer_config(self, mc) -> dict:
        """megatron-core TransformerConfig fields this family sets beyond the generic ones."""
        if self.router_sigmoid:  # the expert bias is megatron's buffer; the rule itself is MoERouter's
            return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_bias_update_rate=0.0)
        return {}

    def install(self, gpt, mc) -> None:
        """Changes the family makes to megatron's GPTModel once it is built (forward hooks on its modules for what
        megatron's config cannot say); none by default."""

    # ------------------------------------------------------------------------------------------ tensors
    def module_key(self, key: str) -> str:
        """A package tensor name as this family's transformers model names the parameter in memory (the same
        for every family whose in-memory names are Qwen3-MoE's)."""
        return key

    def attention_tensors(self, mc) -> list[tuple[str, str]]:
        """(HF name, megatron name) under a layer's prefixes of the attention tensors both sides hold whole and
        alike (q/k/v, interleaved per query group in megatron, are not among them)."""
        out = [("self_attn.o_proj.weight", "self_attention.linear_proj.weight")]
        if mc.qk_norm:
            out += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")]
        return out

    def router_tensors(self, mc) -> list[tuple[str, str]]:
        """(HF name, megatron name) of an MoE layer's router tensors."""
        out = [("mlp.gate.weight", "mlp.router.weight")]
        if self.router_sigmoid:
            out.append(("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias"))
        return out

    def file_keys(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The package's HF-named tensors under the names this family's checkpoint files use."""
        return dict(tensors)

    def package_keys(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """This family's checkpoint tensors under the package's names (file_keys' inverse)."""
        return dict(tensors)

    def file_items(self, state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        """(file name, tensor) of every tensor of `state` in its key order, reading each value once (a streamed
        state gathers on reading)."""
        for key, name in zip(state, self.file_keys(dict.fromkeys(state))):
            yield name, state[key]

    # ------------------------------------------------------------------------------------------ engines
    def vllm_mismatch(self, mc) -> str | None:
        """Why vLLM's model of this family would compute another function than `mc`'s fields say (one line), or
        None."""
        fix = "or use rollout.engine=hf"
        if self.vllm_rms_norm_eps is not None and mc.rms_norm_eps != self.vllm_rms_norm_eps:
            return (f"model.rms_norm_eps={mc.rms_norm_eps} with rollout.engine=vllm: vLLM's model.family="
                    f"'{self.name}' normalizes with eps {self.vllm_rms_norm_eps} whatever the config says; set "
                    f"model.rms_norm_eps={self.vllm_rms_norm_eps} {fix}")
        if self.vllm_head_dim_from_hidden and mc.head_dim * mc.num_attention_heads != mc.hidden_size:
            return (f"model.head_dim={mc.head_dim} with rollout.engine=vllm: vLLM's model.family='{self.name}' takes "
                    f"head_dim = hidden_size / num_attention_heads = {mc.hidden_size // mc.num_attention_heads}; set "
                    "model.head_dim to that or use rollout.engine=hf")
        return None

    # ------------------------------------------------------------------------------------------ upcycling
    def upcycle_fields(self, num_experts: int, top_k: int, inter: int) -> dict:
        """This family's transformers config fields for an upcycled dense model whose MLP is `inter` wide."""
        raise NotImplementedError(f"{self.name} is no upcycling target")


def yarn_fields(c: dict, where, title: str, truncate_key: bool) -> dict | None:
    """YaRN settings from config.json (rope_scaling, or transformers 5's rope_parameters), or None for plain
    rotary embeddings. Without truncate_key the correction range must be rounded (truncate=true), as megatron's
    YaRN does."""
    given = c.get("rope_scaling") or {}
    params = c.get("rope_parameters") or {}
    if not given and params.get("rope_type", "default") != "default":
        given = params  # YaRN, or a type refused below by name
    if not given:
        return None
    kind = given.get("type", given.get("rope_type"))
    if kind != "yarn":
        raise FamilyError(f"{where}: rope_scaling type {kind!r}: moe-gspo's {title} implements YaRN only")
    if given.get("attention_factor") is not None:
        raise FamilyError(f"{where}: rope_scaling.attention_factor: moe-gspo's YaRN derives the attention factor "
                          "from factor (and mscale)")
    if not truncate_key and given.get("truncate", True) is not True:
        raise FamilyError(f"{where}: rope_scaling.truncate=false: moe-gspo's {title} rounds the correction range "
                          "(truncate=true)")
    out = {k: float(given[k]) for k in YARN_KEYS if given.get(k) is not None}
    if truncate_key:
        out["truncate"] = bool(given.get("truncate", True))
    return out


def check_yarn(mc, family: Family) -> None:
    """model.rope_scaling's keys and values for a family that takes YaRN."""
    keys = set(YARN_KEYS) | ({"truncate"} if family.yarn_truncate_key else set())
    unknown = sorted(set(mc.rope_scaling) - keys)
    if unknown:
        raise FamilyError(f"model.rope_scaling: unknown key {unknown[0]!r}; YaRN reads {sorted(keys)}")
    for k in ("factor", "original_max_position_embeddings"):
        if k not in mc.rope_scaling:
            raise FamilyError(f"model.rope_scaling needs {k!r}")
    if bool(mc.rope_scaling.get("mscale")) != bool(mc.rope_scaling.get("mscale_all_dim")):
        raise FamilyError("model.rope_scaling: give both mscale and mscale_all_dim, or neither (with one alone "
                          "transformers' and megatron's YaRN attention factors differ)")
    if not mc.rope_scaling["factor"] > 1:
        raise FamilyError(f"model.rope_scaling.factor={mc.rope_scaling['factor']} must be > 1")


def fused_expert_view(fused, e: int, proj: str, interleaved: bool):
    """Expert e's gate_proj, up_proj or down_proj weight (or bias) as a view of a fused expert tensor, in the
    per-expert layout: weights (out, in), biases (out,). Fused (transformers 5's in-memory layout): (E, 2I, H) gate
    rows over up rows and (E, H, I); interleaved (Family.experts_interleaved): (E, H, 2I) / (E, 2I) with gate and
    up alternating, and (E, I, H) / (E, H)."""
    if not interleaved:
        inter = fused.shape[1] // 2
        return {"down_proj": fused[e], "gate_proj": fused[e, :inter], "up_proj": fused[e, inter:]}[proj]
    x = fused[e]
    if proj != "down_proj":
        x = x[..., 0::2] if proj == "gate_proj" else x[..., 1::2]
    return x.t() if x.dim() == 2 else x


def fused_file_items(state: Mapping[str, Any], fuse: Callable[[Mapping[str, Any]], dict]):
    """(file name, tensor) of every tensor of `state` in its key order, for a family whose files fuse each layer's
    experts: `fuse` (package names -> file names) takes each layer's per-expert tensors together, as the layer's last
    one arrives, so one layer's experts are held at a time, and every other tensor alone."""
    expected = Counter(m["pre"] for m in map(PER_EXPERT_KEY.match, state) if m)
    pending: dict[str, dict[str, Any]] = {}
    for key in state:
        m = PER_EXPERT_KEY.match(key)
        if m is None:
            yield from fuse({key: state[key]}).items()
            continue
        layer = pending.setdefault(m["pre"], {})
        layer[key] = state[key]
        if len(layer) == expected[m["pre"]]:
            yield from fuse(pending.pop(m["pre"])).items()
