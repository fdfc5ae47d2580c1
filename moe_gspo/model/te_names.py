"""Parameter names of megatron's Transformer Engine layer spec <-> the local spec's: the one table that everything
naming parameters outside megatron goes through (MoEPolicy's state helpers, hence HF import/export, weight sync
and the optimizer-state gather), and the checkpoint-key map that gives both specs the same checkpoint keys.

    local = to_local(state)                   # TE-spec (or local-spec) names -> local-spec names, same tensors
    te = to_te(local, grouped=True)           # local-spec names -> the TE spec's (TEGroupedMLP or SequentialMLP)

What differs (megatron-core 0.16.1, get_gpt_layer_with_transformer_engine_spec(num_experts, qk_layernorm=True),
per decoder layer `decoder.layers.<i>.`):

| TE spec | local spec | why |
| --- | --- | --- |
| self_attention.linear_qkv.layer_norm_weight | input_layernorm.weight | the input norm is fused into TE's LayerNormLinear (TELayerNormColumnParallelLinear); the layer's input_layernorm is an IdentityOp |
| mlp.experts.linear_fc1.weight<e> | mlp.experts.local_experts.<e>.linear_fc1.weight | TEGroupedMLP (moe_grouped_gemm): one TE GroupedLinear per projection, one (2F, H) parameter per local expert |
| mlp.experts.linear_fc2.weight<e> | mlp.experts.local_experts.<e>.linear_fc2.weight | the same, (H, F) |
| <module>._extra_state | (none) | TE's FP8 metadata, not a parameter: left out |

The same in both: q_layernorm / k_layernorm (TENorm, a TE RMSNorm's `weight`), pre_mlp_layernorm (TENorm: MoE layers
keep it unfused), linear_qkv.weight, linear_proj.weight, the router, SequentialMLP's experts with TE linears
(`local_experts.<e>.linear_fc1.weight`), the embedding, the final norm and the output layer. No tensor changes
shape or layout: each TE parameter is the local one under another name (fc1 stacks gate over up in both), so the
renames return the tensors themselves and loading writes through them. The one fused layout is megatron's
GroupedMLP's (`mlp.experts.weight1` / `weight2`: our grouped experts on the local spec, and the TE spec's experts
with grouped GEMM where TE is older than 1.9); experts.per_expert_state splits it into per-expert views first.

Checkpoint keys: megatron's local spec saves input_layernorm under `self_attention.linear_qkv.layer_norm_weight`
and pre_mlp_layernorm under `mlp.linear_fc1.layer_norm_weight` (its TransformerLayer sharded_state_dict_keys_map),
and TEGroupedMLP saves its experts under SequentialMLP's keys; the TE spec keeps `pre_mlp_layernorm.weight`.
CHECKPOINT_KEYS maps that one prefix in the TE spec, so a checkpoint written under either spec loads under the other.
"""

from __future__ import annotations

import re

import torch

# sharded-checkpoint key prefixes of the TE spec's layer -> the local spec's (applied by megatron's TransformerLayer)
CHECKPOINT_KEYS = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}

_LAYER = r"decoder\.layers\.\d+\."
# names both specs use as they are (local-spec names)
_SHARED = re.compile(
    r"^(?:embedding\.word_embeddings\.weight|decoder\.final_layernorm\.weight|output_layer\.weight"
    rf"|{_LAYER}(?:input_layernorm\.weight|pre_mlp_layernorm\.weight|mlp\.router\.weight"
    r"|self_attention\.(?:linear_qkv|linear_proj|q_layernorm|k_layernorm)\.weight|self_attention\.linear_qkv\.bias"
    r"|mlp\.shared_experts\.(?:linear_fc[12]\.weight|gate_weight)"
    r"|mlp\.experts\.local_experts\.\d+\.linear_fc[12]\.weight|mlp\.experts\.weight[12]))$")
# local-spec names of the families the TE spec does not run (ModelConfig refuses model.spec='te' for them): multi-head
# latent attention, dense MLPs, the sigmoid router's expert bias; GPT-OSS's biases and sinks
_LOCAL_ONLY = re.compile(
    rf"^{_LAYER}(?:self_attention\.(?:linear_q_proj|linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj"
    r"|linear_kv_up_proj|kv_layernorm)\.weight|mlp\.linear_fc[12]\.weight|mlp\.router\.expert_bias"
    r"|self_attention\.linear_proj\.bias|self_attention\.core_attention\.softmax_offset|mlp\.router\.bias"
    r"|mlp\.experts\.local_experts\.\d+\.linear_fc[12]\.bias)$")
_TE_INPUT_NORM = re.compile(rf"^(?P<layer>{_LAYER})self_attention\.linear_qkv\.layer_norm_weight$")
_TE_GROUPED = re.compile(rf"^(?P<head>{_LAYER}mlp\.experts\.)(?P<fc>linear_fc[12])\.weight(?P<e>\d+)$")
_LOCAL_INPUT_NORM = re.compile(rf"^(?P<layer>{_LAYER})input_layernorm\.weight$")
_LOCAL_EXPERT = re.compile(rf"^(?P<head>{_LAYER}mlp\.experts\.)local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])"
                           r"\.weight$")


class UnknownName(ValueError):
    """A parameter name the TE <-> local table does not know."""


def local_name(name: str) -> str | None:
    """The local spec's name of a TE-spec (or local-spec) parameter name; None for `_extra_state` entries."""
    if name.endswith("._extra_state") or re.search(r"\._extra_state\d+$", name):
        return None
    if _SHARED.match(name) or _LOCAL_ONLY.match(name):
        return name
    if m := _TE_INPUT_NORM.match(name):
        return f"{m['layer']}input_layernorm.weight"
    if m := _TE_GROUPED.match(name):
        return f"{m['head']}local_experts.{m['e']}.{m['fc']}.weight"
    raise UnknownName(f"parameter {name!r} is in neither the local nor the Transformer Engine spec's name table "
                      f"(moe_gspo/model/te_names.py)")


def te_name(name: str, grouped: bool) -> str:
    """The TE spec's name of a local-spec parameter name: experts as TEGroupedMLP's (grouped) or SequentialMLP's."""
    if m := _LOCAL_INPUT_NORM.match(name):
        return f"{m['layer']}self_attention.linear_qkv.layer_norm_weight"
    if grouped and (m := _LOCAL_EXPERT.match(name)):
        return f"{m['head']}{m['fc']}.weight{m['e']}"
    if _SHARED.match(name) and not re.search(r"\.mlp\.experts\.weight[12]$", name):
        return name
    raise UnknownName(f"parameter {name!r} has no Transformer Engine spec name: not a per-expert local-spec name "
                      f"in the table (moe_gspo/model/te_names.py)")


def to_local(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict under TE-spec or local-spec names -> the same tensors under local-spec names, `_extra_state`
    entries left out. UnknownName (one line) for a name the table does not know; ValueError if two names meet."""
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for name, t in state.items():
        new = local_name(name)
        if new is None:
            continue
        if new in source:
            raise ValueError(f"parameters {source[new]!r} and {name!r} both map to the local name {new!r}")
        out[new], source[new] = t, name
    return out


def to_te(state: dict[str, torch.Tensor], grouped: bool) -> dict[str, torch.Tensor]:
    """Inverse of to_local on per-expert local-spec names: the same tensors under the TE spec's names."""
    return {te_name(name, grouped): t for name, t in state.items()}
