"""A Hugging Face checkpoint's config.json read as the policy's ModelConfig (model.init_from): the fields every
family names alike here, each family's own in its file (moe_gspo.model.families), and what this policy does not
implement refused in one line naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

from moe_gspo.config.checks import ConfigError
from moe_gspo.config.model import ModelConfig
from moe_gspo.model.families import FamilyError, family, names


def model_config_from_hf(path: str | Path, overrides: ModelConfig | None = None) -> ModelConfig:
    """Read config.json; refuse other architectures and MoE features this policy does not implement. The
    architecture comes from config.json; how to run it (params_dtype, spec, attention, experts, compile) and
    how to train it (the load-balancing loss) from `overrides`."""
    path = Path(path)
    f = path / "config.json"
    if not f.is_file():
        raise ConfigError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        c = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: invalid JSON ({e})") from None
    base = overrides or ModelConfig()
    return ModelConfig(**architecture_from_hf(c, f), params_dtype=base.params_dtype, spec=base.spec,
                       attention=base.attention, compile=base.compile,
                       experts=base.experts if getattr(base, "experts_chosen", True) else None,
                       moe_router_load_balancing_type=base.moe_router_load_balancing_type,
                       moe_aux_loss_coeff=base.moe_aux_loss_coeff, init_from=str(path))


def architecture_from_hf(c: dict, where) -> dict:
    """The architecture's ModelConfig fields from a config.json dict `c` (`where` names it in errors): the fields
    every family names alike, then the family's own reading (moe_gspo.model.families)."""
    mt = c.get("model_type")
    if mt not in names():
        raise ConfigError(f"{where}: model_type={mt!r}, architectures={c.get('architectures')}; moe-gspo loads "
                          f"{', '.join(names())} checkpoints")
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{where}: dense layers (mlp_only_layers / decoder_sparse_step) are not supported")
    if c.get("sliding_window") is not None and c.get("use_sliding_window"):
        raise ConfigError(f"{where}: sliding_window={c['sliding_window']}: sliding-window attention is not "
                          "implemented (every token attends to all before it)")
    if c.get("clip_qkv") is not None:
        raise ConfigError(f"{where}: clip_qkv={c['clip_qkv']}: clamping q/k/v is not implemented")
    if c.get("router_jitter_noise"):
        raise ConfigError(f"{where}: router_jitter_noise={c['router_jitter_noise']}: the router's training-time "
                          "jitter is not implemented (set it to 0 to train without it)")
    fam = family(mt)
    rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", fam.default_rope_theta)
    try:
        return dict(
            family=mt, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c.get("qk_rope_head_dim") or c["hidden_size"] // c["num_attention_heads"],
            num_experts_per_tok=c["num_experts_per_tok"], rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope), max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            initializer_range=c.get("initializer_range", 0.02), **fam.from_hf(c, where))
    except KeyError as e:
        raise ConfigError(f"{where}: missing field {e.args[0]!r}") from None
    except FamilyError as e:
        raise ConfigError(str(e)) from None
