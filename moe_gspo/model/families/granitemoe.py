"""GraniteMoE (IBM's granite-3.0 MoE models): Mixtral's router (the top k of its logits, then their softmax) and
SwiGLU experts, grouped-query attention without query/key norms, and four multipliers:
- the embedding's output times embedding_multiplier;
- the attention's softmax scale is attention_multiplier (not 1/sqrt(head_dim));
- each attention and MoE output times residual_multiplier before it joins the residual stream;
- the logits divided by logits_scaling.

On megatron's GPTModel the softmax scale is its softmax_scale; the other three are forward hooks on the embedding,
on each layer's attention and MoE block, and on the final norm (the logits are linear in the normed hidden state, so
dividing it by logits_scaling divides the logits, also in the fused log-prob path that never builds them).

Its checkpoint files keep each layer's experts fused: `block_sparse_moe.input_linear.weight` (E, 2I, H), gate rows
over up rows, and `block_sparse_moe.output_linear.weight` (E, H, I); the router is
`block_sparse_moe.router.layer.weight`. transformers 5 names them `block_sparse_moe.experts.gate_up_proj`,
`.experts.down_proj` and `block_sparse_moe.router.weight` in memory. The package holds the experts per expert under
Qwen3-MoE's names and renames at both boundaries.

vLLM 0.32's GraniteMoE computes the same function (it reads the multipliers from config.json); its mapper takes the
files' router name to its `gate`, and its experts are vLLM's fused ones, which the weight sync finds by their
parameters. Its attention takes head_dim = hidden_size / num_attention_heads, as transformers' does."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from moe_gspo.model.families.base import PER_EXPERT_KEY, Family, FamilyError, fused_expert_view, fused_file_items


@dataclass
class GraniteMoeFields:
    embedding_multiplier: float = 1.0
    """GraniteMoE: the token embeddings are multiplied by this before the first layer (granite-3.0: 12)."""
    attention_multiplier: float = 1.0
    """GraniteMoE: the attention's softmax scale, in place of 1/sqrt(head_dim) (granite-3.0: 0.015625)."""
    residual_multiplier: float = 1.0
    """GraniteMoE: each layer's attention and MoE outputs are multiplied by this before they join the residual
    stream (granite-3.0: 0.22)."""
    logits_scaling: float = 1.0
    """GraniteMoE: the logits are divided by this (granite-3.0: 6)."""


_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
# package name -> the name in files and in transformers' model, matched at the key's end
_ROUTER = {"file": ".block_sparse_moe.router.layer.weight", "module": ".block_sparse_moe.router.weight"}
_PACKAGE_ROUTER = ".mlp.gate.weight"


class GraniteMoe(Family):
    name = "granitemoe"
    title = "GraniteMoE"
    hf_architecture = "GraniteMoeForCausalLM"
    fields = GraniteMoeFields
    topk_always_normalized = True
    hf_moe_module = "block_sparse_moe"
    hf_router_module = "router"
    default_rope_theta = 10_000.0
    vllm_head_dim_from_hidden = True
    vllm_maps_file_names = True  # its mapper takes the router's file name to vLLM's `gate`

    def check(self, mc) -> None:
        if mc.num_attention_heads * mc.head_dim != mc.hidden_size:
            raise FamilyError(f"model.head_dim={mc.head_dim} with model.family='granitemoe': transformers' GraniteMoE "
                              f"takes head_dim = hidden_size / num_attention_heads = "
                              f"{mc.hidden_size // mc.num_attention_heads}")
        for k in _MULTIPLIERS:
            if not 0 < getattr(mc, k) < float("inf"):
                raise FamilyError(f"model.{k}={getattr(mc, k)} must be a finite number > 0")

    def from_hf(self, c: dict, where) -> dict:
        if c.get("attention_bias"):
            raise FamilyError(f"{where}: attention_bias=true: moe-gspo's GraniteMoE has no attention biases")
        params = c.get("rope_parameters") or {}
        if c.get("rope_scaling") or params.get("rope_type", "default") != "default":
            raise FamilyError(f"{where}: rope scaling: moe-gspo's GraniteMoE implements plain rotary embeddings only")
        return dict(num_experts=c["num_local_experts"], moe_intermediate_size=c["intermediate_size"],
                    norm_topk_prob=True, **{k: float(c.get(k, 1.0)) for k in _MULTIPLIERS})

    def to_hf(self, mc, common: dict) -> dict:
        return {**common, "num_local_experts": mc.num_experts, "intermediate_size": mc.moe_intermediate_size,
                "attention_bias": False, **{k: getattr(mc, k) for k in _MULTIPLIERS}}

    def transformer_config(self, mc) -> dict:
        return dict(softmax_scale=mc.attention_multiplier)

    def install(self, gpt, mc) -> None:
        def times(m):
            def hook(_module, _inputs, out):
                if isinstance(out, tuple):  # megatron's (output, bias) of attention and MoE blocks
                    return (out[0] * m, *(None if b is None else b * m for b in out[1:]))
                return out * m
            return hook

        gpt.embedding.register_forward_hook(times(mc.embedding_multiplier))
        for layer in gpt.decoder.layers:
            layer.self_attention.register_forward_hook(times(mc.residual_multiplier))
            layer.mlp.register_forward_hook(times(mc.residual_multiplier))
        gpt.decoder.final_layernorm.register_forward_hook(times(1.0 / mc.logits_scaling))

    def module_key(self, key: str) -> str:
        if key.endswith(_PACKAGE_ROUTER):
            return key[:-len(_PACKAGE_ROUTER)] + _ROUTER["module"]
        return key.replace(".mlp.experts.", ".block_sparse_moe.experts.")

    def file_keys(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return _fused(tensors)

    def package_keys(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for k, v in tensors.items():
            if k.endswith(_ROUTER["file"]):
                out[k[:-len(_ROUTER["file"])] + _PACKAGE_ROUTER] = v
            elif k.endswith(".block_sparse_moe.input_linear.weight"):
                pre = k[:-len(".block_sparse_moe.input_linear.weight")] + ".mlp.experts"
                for e in range(v.shape[0]):
                    for proj in ("gate_proj", "up_proj"):
                        out[f"{pre}.{e}.{proj}.weight"] = fused_expert_view(v, e, proj, interleaved=False)
            elif k.endswith(".block_sparse_moe.output_linear.weight"):
                pre = k[:-len(".block_sparse_moe.output_linear.weight")] + ".mlp.experts"
                for e in range(v.shape[0]):
                    out[f"{pre}.{e}.down_proj.weight"] = v[e]
            else:
                out[k] = v
        return out

    def file_items(self, state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        return fused_file_items(state, _fused)


def _fused(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Package names -> file names: the router renamed, each layer's per-expert weights stacked into its fused
    input_linear (gate rows over up rows) and output_linear; every expert of a layer must be there."""
    import torch

    out, layers = {}, {}
    for k, v in tensors.items():
        m = PER_EXPERT_KEY.match(k)
        if m is not None:
            layers.setdefault(m["pre"], {})[(int(m["e"]), m["proj"])] = v
        elif k.endswith(_PACKAGE_ROUTER):
            out[k[:-len(_PACKAGE_ROUTER)] + _ROUTER["file"]] = v
        else:
            out[k] = v
    for pre, parts in layers.items():
        E = 1 + max(e for e, _ in parts)
        if len(parts) != 3 * E:
            raise ValueError(f"{pre}: GraniteMoE's fused experts need every expert's three weights, got {len(parts)}")
        block = pre[:-len(".mlp.experts")] + ".block_sparse_moe"
        out[block + ".input_linear.weight"] = torch.stack([torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]])
                                                           for e in range(E)])
        out[block + ".output_linear.weight"] = torch.stack([parts[e, "down_proj"] for e in range(E)])
    return out


FAMILY = GraniteMoe()
