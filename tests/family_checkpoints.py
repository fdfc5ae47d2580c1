"""Tiny random transformers checkpoints of the model families beside Qwen3-MoE, saved by transformers: what the family
tests load (tests/test_families.py, tests/test_deepseek.py, tests/test_vllm_families.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def config_with(checkpoint, dest, field: str, value) -> Path:
    """`dest` holding `checkpoint`'s config.json with `field` set to `value` (no weights: what a config-load refusal
    reads). Returns dest."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, field: value}))
    return dest


def _redrawn_and_saved(model, path, expert_bias: bool = False, biases: bool = False, norms: tuple[str, ...] = ()):
    """Draw what a fresh transformers model leaves at a default a loader could drop unnoticed, then save it: the
    sigmoid router's expert bias N(0, 0.1) (buffers first), every linear bias N(0, 0.2), and the norm weights whose
    names end with `norms` U(0.5, 1.5). Returns the model."""
    with torch.no_grad():
        if expert_bias:
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.1)
        for name, w in model.named_parameters():
            if biases and name.endswith("bias"):
                w.normal_(0, 0.2)
            elif norms and name.endswith(norms):
                w.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return model


def mixtral_checkpoint(path, seed: int = 0):
    """A tiny random Mixtral (no query/key norm, experts named w1/w3/w2 in its files) with tied embeddings (the head
    is the embedding, and the files hold no lm_head.weight), as an upcycled SmolLM2 is, saved by transformers."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    c = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                      num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=256,
                      initializer_range=0.2, router_jitter_noise=0.0, tie_word_embeddings=True)
    return _redrawn_and_saved(MixtralForCausalLM(c).eval(), path)


def qwen2_moe_checkpoint(path, seed: int = 0):
    """A tiny random Qwen2-MoE: q/k/v biases (drawn nonzero, so a loader dropping them shows), a shared expert of
    another width than the routed ones behind its sigmoid gate, top-k probabilities not renormalized, and tied
    embeddings (as Qwen2's small models have)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    c = Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=32, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
                       max_position_embeddings=256, initializer_range=0.2, norm_topk_prob=False,
                       tie_word_embeddings=True)
    return _redrawn_and_saved(Qwen2MoeForCausalLM(c).eval(), path, biases=True)


def olmoe_checkpoint(path, seed: int = 0):
    """A tiny random OLMoE: one RMSNorm over all query heads and one over all key heads (weights drawn away from
    1, so that a per-head norm shows), top-k probabilities not renormalized; bos/eos/pad inside its vocabulary
    (transformers' OlmoeConfig defaults eos to 50279)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(seed)
    c = OlmoeConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
                    max_position_embeddings=256, initializer_range=0.2, norm_topk_prob=False, bos_token_id=1,
                    eos_token_id=2, pad_token_id=0)
    return _redrawn_and_saved(OlmoeForCausalLM(c).eval(), path, norms=("q_norm.weight", "k_norm.weight"))


def deepseek_v3_checkpoint(path, seed: int = 0, **over):
    """A tiny random DeepSeek-V3: multi-head latent attention with a compressed query, a dense first layer, a shared
    expert, a sigmoid router whose expert bias is drawn nonzero (so that a loader dropping it shows), 4 groups of 2
    experts of which a token may use 2, and top-2 with a scaling factor. topk = topk_group here, where megatron's
    group score (the sum of a group's top topk/topk_group = 1 experts) differs from the checkpoint's (its top 2).
    Norm weights drawn away from 1."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
                  qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                  norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256, initializer_range=0.2,
                  rope_scaling=None, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**fields, **over})).eval()
    return _redrawn_and_saved(model, path, expert_bias=True, norms=("norm.weight",))


def glm4_moe_checkpoint(path, seed: int = 0):
    """A tiny random GLM-4.5: grouped-query attention with q/k/v biases (drawn nonzero) and per-head query/key norms,
    rotary embeddings on the first half of each head, a dense first layer, a shared expert, and DeepSeek-V3's
    sigmoid router with its expert bias drawn nonzero, in one group as GLM-4.5 has it."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    c = Glm4MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_shared_experts=1,
                      n_routed_experts=8, routed_scaling_factor=2.5, n_group=1, topk_group=1, num_experts_per_tok=2,
                      first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _redrawn_and_saved(Glm4MoeForCausalLM(c).eval(), path, expert_bias=True, biases=True, norms=("norm.weight",))




def gpt_oss_checkpoint(path, seed: int = 0, **over):
    """A tiny random GPT-OSS: grouped-query attention with biases on q/k/v/o and a learned sink logit per head, a
    sliding window of 6 tokens on every other layer (the first included), YaRN rotary embeddings without rounding
    (truncate=false, as its checkpoints have them) over an original 32 positions, a router with a bias (top-k of the
    logits, then their softmax), and experts whose fused gate/up projection interleaves gate and up columns, with
    biases and a clamped SwiGLU. Every bias and sink drawn nonzero, norm weights away from 1."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
                  rms_norm_eps=1e-5, max_position_embeddings=256, initializer_range=0.2, rope_theta=150000.0,
                  rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 32},
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = GptOssForCausalLM(GptOssConfig(**{**fields, **over})).eval()
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("sinks"):
                w.normal_(0, 1.0)
    return _redrawn_and_saved(model, path, biases=True, norms=("norm.weight", "layernorm.weight"))


CHECKPOINTS = {"mixtral": mixtral_checkpoint, "qwen2_moe": qwen2_moe_checkpoint, "olmoe": olmoe_checkpoint,
               "deepseek_v3": deepseek_v3_checkpoint, "glm4_moe": glm4_moe_checkpoint, "gpt_oss": gpt_oss_checkpoint}
