"""Mixtral: no query/key norm; the router takes the top k of its logits, then their softmax (the softmax
renormalized over the top k). Its checkpoint files name the router `block_sparse_moe.gate` and the experts
`block_sparse_moe.experts.e.w1 / w3 / w2` (gate, up, down); the package renames them at the file boundary."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_gspo.model.families.base import Family, FamilyError

# package name -> file name, matched at the key's end (an expert's projection: its module path as well)
_RENAMES = {".mlp.gate.weight": ".block_sparse_moe.gate.weight", ".gate_proj.weight": ".w1.weight",
            ".up_proj.weight": ".w3.weight", ".down_proj.weight": ".w2.weight"}


class Mixtral(Family):
    name = "mixtral"
    title = "Mixtral"
    hf_architecture = "MixtralForCausalLM"
    topk_always_normalized = True
    upcycles_from = ("llama", "mistral")
    upcycle_preferred = True

    def from_hf(self, c: dict, where) -> dict:
        if c.get("sliding_window") is not None:
            raise FamilyError(f"{where}: sliding_window={c['sliding_window']}: sliding-window attention is not "
                              "implemented (every token attends to all before it)")
        return dict(num_experts=c["num_local_experts"], moe_intermediate_size=c["intermediate_size"],
                    norm_topk_prob=True)

    def to_hf(self, mc, common: dict) -> dict:
        return {**common, "num_local_experts": mc.num_experts, "intermediate_size": mc.moe_intermediate_size,
                "sliding_window": None, "router_jitter_noise": 0.0}

    def file_keys(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for key, v in tensors.items():
            for ours, theirs in _RENAMES.items():
                if key.endswith(ours):
                    key = key[:-len(ours)] + theirs
                    if ours != ".mlp.gate.weight":
                        key = key.replace(".mlp.experts.", ".block_sparse_moe.experts.")
                    break
            out[key] = v
        return out

    def package_keys(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for key, v in tensors.items():
            for ours, theirs in _RENAMES.items():
                if key.endswith(theirs):
                    key = key[:-len(theirs)] + ours
                    key = key.replace(".block_sparse_moe.experts.", ".mlp.experts.")
                    break
            out[key] = v
        return out

    def upcycle_fields(self, num_experts: int, top_k: int, inter: int) -> dict:
        return dict(num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=inter,
                    router_jitter_noise=0.0, sliding_window=None, output_router_logits=False)


FAMILY = Mixtral()
