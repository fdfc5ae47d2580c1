"""Rotary embeddings: YaRN as GPT-OSS's checkpoints define it, for megatron's plain RotaryEmbedding; and the rotary
table applied to packed sequences at each token's position (`install_packed_rope`).

megatron-core's YarnRotaryEmbedding always rounds the correction range to whole dimensions (transformers'
truncate=true); GPT-OSS's checkpoints set truncate=false, so its policy keeps megatron's RotaryEmbedding and
replaces its inverse frequencies with these. The YaRN attention factor, which transformers multiplies into cos and
sin (so into both queries and keys), becomes its square on the softmax scale instead.

    rotary.inv_freq = yarn_inv_freq(mc)                  # (head_dim / 2,) float32
    scale = yarn_attention_factor(mc) ** 2 / sqrt(head_dim)

Packed sequences (megatron's THD format): megatron-core 0.16.1's unfused `_apply_rotary_pos_emb_thd` reads the
sequence bounds back from the device (`cu_seqlens.tolist()`, and `cu_seqlens[-1]` in a branch: two host syncs on a
GPU) and slices the rotary table once per sequence in Python, for the query and the key of every layer. The policy
attaches each packed token's position within its sequence to the bounds tensor it hands megatron
(`cu_seqlens.positions`); `install_packed_rope` replaces that function, in megatron's module, with one that gathers
the table at those positions once per forward (kept on the bounds tensor for the other layers) and applies it as
megatron's bshd path does. It computes what megatron's does on the policy's packed inputs (the table covers the
longest sequence, so megatron takes its branch of a table per sequence from position 0), and passes any call
without the positions, or under context parallelism, to megatron's own function.
"""

from __future__ import annotations

import math

import torch
from megatron.core.models.common.embeddings import rope_utils

from moe_gspo.config import ModelConfig

_MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd


def _thd_at_positions(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
                      cp_group=None):
    """megatron's `_apply_rotary_pos_emb_thd` (same signature) for bounds that carry their tokens' positions:
    t (tokens, heads, dim), freqs (longest, 1, 1, dim) -> t rotated at each token's position in its sequence."""
    positions = getattr(cu_seqlens, "positions", None)
    if positions is None or cp_group is None or cp_group.size() != 1:
        return _MEGATRON_THD(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                             multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
    cached = getattr(cu_seqlens, "freqs_at_positions", None)
    if cached is None or cached[0] is not freqs:  # one table per forward, shared by the layers' queries and keys
        cached = cu_seqlens.freqs_at_positions = (freqs, freqs[positions])
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), cached[1], rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)


def install_packed_rope() -> None:
    """Route megatron's THD rotary through `_thd_at_positions` (idempotent)."""
    rope_utils._apply_rotary_pos_emb_thd = _thd_at_positions


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
