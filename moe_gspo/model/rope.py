"""YaRN rotary embeddings as GPT-OSS's checkpoints define them, for megatron's plain RotaryEmbedding.

megatron-core's YarnRotaryEmbedding always rounds the correction range to whole dimensions (transformers'
truncate=true); GPT-OSS's checkpoints set truncate=false, so its policy keeps megatron's RotaryEmbedding and
replaces its inverse frequencies with these. The YaRN attention factor, which transformers multiplies into cos and
sin (so into both queries and keys), becomes its square on the softmax scale instead.

    rotary.inv_freq = yarn_inv_freq(mc)                  # (head_dim / 2,) float32
    scale = yarn_attention_factor(mc) ** 2 / sqrt(head_dim)
"""

from __future__ import annotations

import math

import torch

from moe_gspo.config import ModelConfig


def yarn_attention_factor(mc: ModelConfig) -> float:
    """YaRN's factor on cos and sin: 0.1 ln(factor) + 1, or with mscale and mscale_all_dim the ratio of that
    formula at each; 1 without YaRN."""
    y = mc.rope_scaling
    if not y or y["factor"] <= 1:
        return 1.0

    def m(scale):
        return 0.1 * scale * math.log(y["factor"]) + 1.0

    if y.get("mscale") and y.get("mscale_all_dim"):
        return m(y["mscale"]) / m(y["mscale_all_dim"])
    return m(1.0)


def yarn_inv_freq(mc: ModelConfig) -> torch.Tensor:
    """(head_dim / 2,) inverse frequencies: dimensions rotating more than beta_fast times over the original context
    keep theta^(-2i/d), those rotating fewer than beta_slow times are divided by `factor`, and a linear ramp blends
    the two between them; the ramp's ends are rounded to whole dimensions only with truncate."""
    y, d, base = mc.rope_scaling, mc.head_dim, mc.rope_theta
    factor, original = y["factor"], y["original_max_position_embeddings"]

    def dim_of(rotations):  # the dimension whose wavelength fits `rotations` times in the original context
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(y.get("beta_fast", 32.0)), dim_of(y.get("beta_slow", 1.0))
    if y.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, d, 2).float() / d)
    keep = 1 - ramp  # the share of the original frequency
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep
