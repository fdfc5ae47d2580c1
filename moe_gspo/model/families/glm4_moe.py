"""GLM-4.5: DeepSeek-V3's router, shared experts and dense first layers, with grouped-query attention carrying
q/k/v biases, rotary embeddings on part of each head (partial_rotary_factor) and an optional per-head query/key
norm (use_qk_norm)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_gspo.model.families._sigmoid import SigmoidRouterFamily
from moe_gspo.model.families.base import FamilyError


@dataclass
class Glm4MoeFields:
    use_qk_norm: bool = False
    """GLM-4.5: RMSNorm on each query and key head (Qwen3-MoE always has it; the other families never)."""
    partial_rotary_factor: float = 1.0
    """GLM-4.5: the fraction of each head's dimensions that rotary embeddings rotate (the first ones; 0.5 in
    GLM-4.5); 1 for every other family."""


class Glm4Moe(SigmoidRouterFamily):
    name = "glm4_moe"
    title = "GLM-4.5"
    hf_architecture = "Glm4MoeForCausalLM"
    fields = Glm4MoeFields
    uses = SigmoidRouterFamily.uses | {"attention_bias"}

    def check(self, mc) -> None:
        if not 0 < mc.partial_rotary_factor <= 1 or int(mc.head_dim * mc.partial_rotary_factor) % 2:
            raise FamilyError(f"model.partial_rotary_factor={mc.partial_rotary_factor} must be in (0, 1] and "
                              f"rotate an even number of model.head_dim={mc.head_dim}'s dimensions")
        super().check(mc)

    def qk_norm_of(self, mc) -> bool:
        return mc.use_qk_norm

    def from_hf(self, c: dict, where) -> dict:
        self.check_file(c, where, {**self.refused_in_config, "rope_scaling": (None,)}, yarn=False)
        params = c.get("rope_parameters") or {}
        return {**super().from_hf(c, where), "attention_bias": bool(c.get("attention_bias", False)),
                "use_qk_norm": bool(c.get("use_qk_norm", False)),
                "partial_rotary_factor": float(c.get("partial_rotary_factor") or
                                               params.get("partial_rotary_factor", 1.0))}

    def to_hf(self, mc, common: dict) -> dict:
        return {**super().to_hf(mc, common), "attention_bias": mc.attention_bias, "use_qk_norm": mc.use_qk_norm,
                "partial_rotary_factor": mc.partial_rotary_factor}


FAMILY = Glm4Moe()
