"""GPT-OSS: Mixtral's router with a bias on its logits; experts with biases and a clamped SwiGLU (swiglu_limit);
biases on q/k/v/o; a learned sink logit per attention head; a sliding window on some layers; YaRN rotary scaling
whose correction range is not rounded (truncate=false), on megatron's plain rotary embedding (model.rope).

Its checkpoint files (and transformers' model) keep each layer's experts fused: `mlp.experts.gate_up_proj`
(E, H, 2I) with gate and up columns interleaved, `gate_up_proj_bias` (E, 2I), `down_proj` (E, I, H),
`down_proj_bias` (E, H); the package holds them per expert and fuses at the file boundary. Its router
(`mlp.router`, with a bias) and sinks (`self_attn.sinks`) keep their own names in the package.

vLLM 0.32's GPT-OSS clamps its experts' SwiGLU at 7 whatever config.json says (its CPU fused-MoE kernel: measured,
the output equals the clamp at 7 and differs by O(10) from the clamp at 5, at 10 and from none); slides its window
on the even layers (0, 2, ...) whatever layer_types says; always runs YaRN, built from factor,
original_max_position_embeddings, beta_fast, beta_slow and truncate (no mscale); normalizes with eps 1e-5."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from moe_gspo.model.families.base import (PER_EXPERT_KEY, Family, FamilyError, check_yarn, fused_expert_view,
                                          fused_file_items, yarn_fields)

VLLM_SWIGLU_LIMIT = 7.0


@dataclass
class GptOssFields:
    sliding_window: int = 0
    """GPT-OSS: how many tokens (the query's own included) a query attends to in the layers layer_types marks
    'sliding_attention'; the other layers attend to every earlier token. 0: no sliding window."""
    layer_types: list[str] | None = None
    """GPT-OSS: 'sliding_attention' or 'full_attention' for each decoder layer (transformers' field); None with a
    sliding_window: every other layer from the first slides, GPT-OSS's own pattern."""
    swiglu_limit: float = 0.0
    """GPT-OSS: its experts compute clamp(gate, max=limit) * sigmoid(1.702 clamp(gate, max=limit)) *
    (clamp(up, -limit, limit) + 1) instead of silu(gate) * up, and add each expert's output bias before the routing
    weight scales it; 0 for every other family (GPT-OSS's checkpoints: 7)."""


class GptOss(Family):
    name = "gpt_oss"
    title = "GPT-OSS"
    hf_architecture = "GptOssForCausalLM"
    fields = GptOssFields
    uses = frozenset({"attention_bias", "rope_scaling"})
    topk_always_normalized = True
    linear_biases = True
    sinks = True
    experts_interleaved = True
    experts_only = "torch"
    experts_only_why = ("GPT-OSS's experts (biases, clamped SwiGLU) run as model.experts=torch only (megatron's "
                        "SequentialMLP fails in the backward with expert biases, and the grouped module has none)")
    hf_router_module = "router"
    hf_attn_implementation = "eager"  # transformers' GPT-OSS has no SDPA path (its sinks); the trainer's equals it
    default_rope_theta = 150_000.0
    yarn_truncate_key = True
    vllm_rms_norm_eps = 1e-5
    vllm_maps_file_names = True

    def check(self, mc) -> None:
        if mc.spec == "te" or mc.attention == "megatron":
            raise FamilyError(f"model.spec='{mc.spec}' / model.attention='{mc.attention}' with model.family="
                              "'gpt_oss': its sinks and sliding window run on the local spec with model.attention=sdpa")
        if not mc.attention_bias:
            raise FamilyError("model.attention_bias=false with model.family='gpt_oss': its q/k/v/o projections, "
                              "router and experts all carry biases here (megatron's add_bias_linear)")
        if mc.sliding_window < 0 or not 0 <= mc.swiglu_limit < float("inf"):
            raise FamilyError("model.sliding_window and model.swiglu_limit must be >= 0")
        if mc.layer_types is None:
            mc.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(mc.num_hidden_layers)]
        if len(mc.layer_types) != mc.num_hidden_layers or \
                set(mc.layer_types) - {"sliding_attention", "full_attention"}:
            raise FamilyError(f"model.layer_types={mc.layer_types}: one of 'sliding_attention' or 'full_attention' "
                              f"per layer (model.num_hidden_layers={mc.num_hidden_layers})")
        if mc.rope_scaling is not None:
            check_yarn(mc, self)

    def from_hf(self, c: dict, where) -> dict:
        """Without any rope settings transformers gives GPT-OSS its own YaRN (factor 32 over 4096 positions, not
        truncated), and so does this."""
        if c.get("quantization_config") is not None:
            raise FamilyError(f"{where}: quantization_config: moe-gspo's GPT-OSS loads unquantized weights only "
                              "(dequantize the MXFP4 experts to bfloat16 first)")
        if float(c.get("swiglu_alpha", 1.702)) != 1.702:
            raise FamilyError(f"{where}: swiglu_alpha={c['swiglu_alpha']}: moe-gspo's GPT-OSS implements 1.702 only "
                              "(megatron's quick_gelu)")
        given = c.get("rope_scaling") or c.get("rope_parameters")
        yarn = yarn_fields(c, where, self.title, truncate_key=True) if given else {
            "factor": 32.0, "original_max_position_embeddings": 4096.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False}
        return dict(num_experts=c["num_local_experts"], moe_intermediate_size=c["intermediate_size"],
                    norm_topk_prob=True, attention_bias=bool(c.get("attention_bias", True)),
                    sliding_window=int(c.get("sliding_window") or 0), layer_types=c.get("layer_types"),
                    swiglu_limit=float(c.get("swiglu_limit", 7.0)), rope_scaling=yarn)

    def to_hf(self, mc, common: dict) -> dict:
        y = mc.rope_scaling
        rope = {"rope_parameters": {"rope_type": "yarn", "rope_theta": mc.rope_theta, **y,
                                    "original_max_position_embeddings": int(y["original_max_position_embeddings"])}
                if y else {"rope_type": "default", "rope_theta": mc.rope_theta}}
        common = {k: v for k, v in common.items() if k not in ("rope_theta", "rope_scaling")}
        return {**common, **rope, "num_local_experts": mc.num_experts, "intermediate_size": mc.moe_intermediate_size,
                "attention_bias": True, "sliding_window": mc.sliding_window or None, "layer_types": mc.layer_types,
                "swiglu_limit": mc.swiglu_limit, "swiglu_alpha": 1.702}

    def transformer_config(self, mc) -> dict:
        """Biases on every linear and the router; the experts' GLU quick_gelu(clamp(gate)) * (clamp(up) + 1),
        quick_gelu being x * sigmoid(1.702 x); a learned softmax offset (the sink) per head; the sliding window on
        the layers layer_types marks (megatron's window covers the query and the window - 1 tokens before it)."""
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return dict(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                    activation_func_clamp_value=mc.swiglu_limit or None, softmax_type="learnable",
                    window_size=(mc.sliding_window - 1, 0) if mc.sliding_window else None,
                    window_attn_skip_freq=[int(t == "sliding_attention") for t in mc.layer_types])

    def attention_tensors(self, mc) -> list[tuple[str, str]]:
        return [("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                ("self_attn.o_proj.bias", "self_attention.linear_proj.bias"),
                ("self_attn.sinks", "self_attention.core_attention.softmax_offset")]

    def router_tensors(self, mc) -> list[tuple[str, str]]:
        return [("mlp.router.weight", "mlp.router.weight"), ("mlp.router.bias", "mlp.router.bias")]

    def file_keys(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return fused_experts(tensors)

    def package_keys(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return per_expert(tensors)

    def file_items(self, state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        return fused_file_items(state, fused_experts)

    def vllm_mismatch(self, mc) -> str | None:
        generic = super().vllm_mismatch(mc)
        if generic:
            return generic
        fix = "or use rollout.engine=hf"
        if mc.swiglu_limit != VLLM_SWIGLU_LIMIT:
            return (f"model.swiglu_limit={mc.swiglu_limit} with rollout.engine=vllm: vLLM's model.family='gpt_oss' "
                    f"clamps its experts' SwiGLU at {VLLM_SWIGLU_LIMIT} whatever the config says; set "
                    f"model.swiglu_limit={VLLM_SWIGLU_LIMIT} {fix}")
        layer_types = list(mc.layer_types or [])
        even = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(layer_types))]
        if mc.sliding_window and layer_types != even:
            return (f"model.layer_types={layer_types} with rollout.engine=vllm: vLLM's model.family='gpt_oss' slides "
                    f"its window on the even layers whatever layer_types says; use that pattern {fix}")
        yarn = mc.rope_scaling
        if not yarn or {"mscale", "mscale_all_dim"} & set(yarn):
            return (f"model.rope_scaling={yarn} with rollout.engine=vllm: vLLM's model.family='gpt_oss' always runs "
                    "YaRN from factor, original_max_position_embeddings, beta_fast, beta_slow and truncate (no "
                    f"mscale); give those {fix}")
        return None


def fused_experts(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Per-expert gate/up/down weights and biases -> each layer's fused, interleaved tensors (module docstring);
    every expert of a layer must be there."""
    import torch

    out, layers = {}, {}
    for k, v in tensors.items():
        m = PER_EXPERT_KEY.match(k)
        if m is None:
            out[k] = v
        else:
            layers.setdefault(m["pre"], {})[(int(m["e"]), m["proj"][:-len("_proj")], m["kind"])] = v
    for pre, parts in layers.items():
        E = 1 + max(e for e, _, _ in parts)
        if len(parts) != 6 * E:
            raise ValueError(f"{pre}: GPT-OSS's fused experts need every expert's six tensors, got {len(parts)}")
        gate, up = [parts[e, "gate", "weight"] for e in range(E)], [parts[e, "up", "weight"] for e in range(E)]
        out[pre + ".gate_up_proj"] = torch.stack([torch.stack([g, u], dim=1).reshape(-1, g.shape[1]).t()
                                                  for g, u in zip(gate, up)])  # (E, H, 2I): gate, up, gate, ...
        out[pre + ".gate_up_proj_bias"] = torch.stack([torch.stack([parts[e, "gate", "bias"], parts[e, "up", "bias"]],
                                                                   dim=1).reshape(-1) for e in range(E)])
        out[pre + ".down_proj"] = torch.stack([parts[e, "down", "weight"].t() for e in range(E)])
        out[pre + ".down_proj_bias"] = torch.stack([parts[e, "down", "bias"] for e in range(E)])
    return out


_FUSED_REST = (".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj", ".mlp.experts.down_proj_bias")


def per_expert(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Each layer's fused expert tensors -> per-expert gate/up/down weights and biases (views)."""
    out = {}
    for k, v in tensors.items():
        if not k.endswith(".mlp.experts.gate_up_proj"):
            if not k.endswith(_FUSED_REST):
                out[k] = v
            continue
        pre = k[:-len(".gate_up_proj")]
        fused = {("gate_proj", "weight"): v, ("up_proj", "weight"): v,
                 ("gate_proj", "bias"): tensors[pre + ".gate_up_proj_bias"],
                 ("up_proj", "bias"): tensors[pre + ".gate_up_proj_bias"],
                 ("down_proj", "weight"): tensors[pre + ".down_proj"],
                 ("down_proj", "bias"): tensors[pre + ".down_proj_bias"]}
        for e in range(v.shape[0]):
            for (proj, kind), f in fused.items():
                out[f"{pre}.{e}.{proj}.{kind}"] = fused_expert_view(f, e, proj, interleaved=True)
    return out


FAMILY = GptOss()
