"""DeepSeek-V3, and Moonlight and Kimi K2, which share its architecture: multi-head latent attention, a sigmoid
router with a load-balancing expert bias, grouped top-k and a scaling factor, shared experts, dense first layers,
optionally YaRN rotary scaling (megatron's YarnRotaryEmbedding)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_gspo.model.families._sigmoid import SigmoidRouterFamily, positive
from moe_gspo.model.families.base import FamilyError, check_yarn, yarn_fields


@dataclass
class DeepseekV3Fields:
    q_lora_rank: int = 0
    """Multi-head latent attention (kv_lora_rank > 0): rank of the query's low-rank projection (q_a_proj, its RMSNorm,
    q_b_proj); 0: the query is one projection (q_proj), as in Moonlight."""
    kv_lora_rank: int = 0
    """Rank of multi-head latent attention's compressed key/value (kv_a_proj_with_mqa, its RMSNorm, kv_b_proj); 0:
    grouped-query attention with head_dim-wide heads."""
    qk_nope_head_dim: int = 0
    """Multi-head latent attention: per-head width of the query and key part without rotary embedding."""
    qk_rope_head_dim: int = 0
    """Multi-head latent attention: per-head width of the rotary part (the key's is shared by all heads)."""
    v_head_dim: int = 0
    """Multi-head latent attention: per-head width of the values."""


class DeepseekV3(SigmoidRouterFamily):
    name = "deepseek_v3"
    title = "DeepSeek-V3"
    hf_architecture = "DeepseekV3ForCausalLM"
    fields = DeepseekV3Fields
    uses = SigmoidRouterFamily.uses | {"rope_scaling"}

    def check(self, mc) -> None:
        positive(mc, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if mc.attention == "megatron":
            raise FamilyError("model.attention='megatron' with model.family='deepseek_v3': megatron's local core "
                              "attention takes no separate query/key and value widths, which latent attention "
                              "needs; use model.attention=sdpa")
        if mc.num_key_value_heads != mc.num_attention_heads:
            raise FamilyError(f"model.num_key_value_heads={mc.num_key_value_heads} with model.family="
                              "'deepseek_v3': latent attention expands one key and value per query head; set "
                              f"it to model.num_attention_heads={mc.num_attention_heads}")
        if mc.q_lora_rank < 0:
            raise FamilyError("model.q_lora_rank must be >= 0")
        if mc.qk_rope_head_dim % 2:
            raise FamilyError(f"model.qk_rope_head_dim={mc.qk_rope_head_dim} must be even (rotary pairs)")
        if mc.rope_scaling is not None:
            check_yarn(mc, self)
        super().check(mc)

    def from_hf(self, c: dict, where) -> dict:
        yarn = yarn_fields(c, where, self.title, truncate_key=False)
        self.check_file(c, where, {**self.refused_in_config, "rope_interleave": (True, None),
                                   "attention_bias": (False, None)}, yarn=bool(yarn))
        return {**super().from_hf(c, where), "rope_scaling": yarn, "q_lora_rank": int(c.get("q_lora_rank") or 0),
                "kv_lora_rank": c["kv_lora_rank"], "qk_nope_head_dim": c["qk_nope_head_dim"],
                "qk_rope_head_dim": c["qk_rope_head_dim"], "v_head_dim": c["v_head_dim"]}

    def to_hf(self, mc, common: dict) -> dict:
        # topk_method and scoring_func: what vLLM reads (transformers implies them); head_dim is the rotary part's
        # width, as transformers' DeepseekV3Config sets it
        yarn = {"rope_scaling": {"type": "yarn", **mc.rope_scaling}} if mc.rope_scaling else {}
        return {**super().to_hf(mc, common), **yarn, "head_dim": mc.qk_rope_head_dim,
                "q_lora_rank": mc.q_lora_rank or None, "kv_lora_rank": mc.kv_lora_rank,
                "qk_nope_head_dim": mc.qk_nope_head_dim, "qk_rope_head_dim": mc.qk_rope_head_dim,
                "v_head_dim": mc.v_head_dim, "rope_interleave": True, "attention_bias": False,
                "topk_method": "noaux_tc", "scoring_func": "sigmoid"}

    def attention_tensors(self, mc) -> list[tuple[str, str]]:
        if not mc.mla:
            return super().attention_tensors(mc)
        out = [("self_attn.o_proj.weight", "self_attention.linear_proj.weight")]
        out += [("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight"),
                ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight"),
                ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight")] if mc.q_lora_rank else [
            ("self_attn.q_proj.weight", "self_attention.linear_q_proj.weight")]
        out += [("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight"),
                ("self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight"),
                ("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight")]
        return out


FAMILY = DeepseekV3()
