"""The comparison report's run-settings tables: what each variant ran, read from its first run's config.yaml.

    shared, header, rows = settings_tables(variants)   # [setting, value] for all; [variant, *differing] per variant

A setting with one value across the variants goes in the shared table, the others get a column each. The rows name
the model (family, shape, shared experts, grouped routing where set, the attention), the task, the batch, the
optimizer and schedule, the loss with the clip range it actually used, routing replay, the router's bias update
rate and the cold start.
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_gspo.config import ConfigError, ModelConfig

NONE = "none"
"""The cell of a setting that a variant does not use (no grouped routing, for one)."""


def clip_used(algorithm: dict) -> tuple[float, float] | None:
    """(clip_low, clip_high) the loss ran with: the config's values, else the loss's registered default."""
    from moe_gspo.losses import POLICY_LOSSES

    cls = POLICY_LOSSES.get(algorithm.get("loss"))
    default = None if cls is None else cls.default_clip
    lo, hi = algorithm.get("clip_low"), algorithm.get("clip_high")
    if default is None and (lo is None or hi is None):
        return None
    return (default[0] if lo is None else float(lo), default[1] if hi is None else float(hi))


def _layers(m: dict) -> str:
    """'L MoE layers', or 'L layers (the first k dense)'."""
    L, k = m.get("num_hidden_layers", "?"), m.get("first_k_dense_replace") or 0
    return f"{L} MoE layers" if not k else f"{L} layers (the first {k} dense)"


def _model_config(m: dict) -> ModelConfig | None:
    """The run's ModelConfig rebuilt from config.yaml's model section, for what its family declares (whether the
    shared expert is gated); None when the section no longer builds one."""
    known = {k: v for k, v in m.items() if k in ModelConfig.__dataclass_fields__}
    try:
        return ModelConfig(**known)
    except (ConfigError, TypeError, ValueError):
        return None


def _shared_experts(m: dict) -> str:
    """'none', or how many shared experts every token passes through besides its routed ones, with their width:
    one gated shared expert (its own width), else width / the routed experts' width of them."""
    if "shared_expert_intermediate_size" not in m:
        return "?"
    width, expert = m["shared_expert_intermediate_size"] or 0, m.get("moe_intermediate_size") or 0
    if not width:
        return NONE
    mc = _model_config(m)
    if mc is None or not expert:
        return f"FFN width {width} in all, not routed"
    n = 1 if mc.shared_expert_gate else width // expert
    return f"{n} (FFN width {width} in all{', sigmoid-gated' if mc.shared_expert_gate else ''}), not routed"


def _attention(m: dict) -> str:
    """Latent attention with its ranks and widths, or grouped-query attention with its heads."""
    g = lambda k: m.get(k, "?")  # noqa: E731
    if (m.get("kv_lora_rank") or 0) > 0:
        q = m.get("q_lora_rank") or 0
        return (f"multi-head latent attention (MLA): {g('num_attention_heads')} heads, key/value rank "
                f"{g('kv_lora_rank')}, " + (f"query rank {q}" if q else "full-rank query") + f", head widths "
                f"{g('qk_nope_head_dim')} + {g('qk_rope_head_dim')} rotary (query/key), {g('v_head_dim')} (value)")
    return (f"grouped-query attention: {g('num_attention_heads')} query heads, {g('num_key_value_heads')} key/value "
            f"heads of {g('head_dim')}")


def _grouped_routing(m: dict) -> str | None:
    """Grouped top-k (n_group > 1) in words, None without it."""
    n, k = m.get("n_group") or 1, m.get("topk_group") or 1
    if n <= 1:
        return None
    return (f"n_group {n}, topk_group {k}: the experts in {n} groups, a token's top-"
            f"{m.get('num_experts_per_tok', '?')} chosen within its {k} best groups")


def _bias_rate(t: dict) -> str:
    rate = t.get("router_bias_update_rate")
    if rate is None:
        return "?"
    return f"{rate:g} per optimizer step" if rate else "0 (no expert-bias update)"


def run_settings(cfg: dict) -> dict[str, str | None]:
    """The settings an RL reader needs to place a run, as table cells in table order; None for a setting the run
    does not use (grouped routing without expert groups)."""
    m, r, t, a = (cfg.get(k) or {} for k in ("model", "rollout", "train", "algorithm"))
    g = lambda d, k: d.get(k, "?")  # noqa: E731
    out = {
        "model family": str(g(m, "family")),
        "model": f"{_layers(m)}, hidden {g(m, 'hidden_size')}, {g(m, 'num_experts')} routed experts (top-"
                 f"{g(m, 'num_experts_per_tok')}), expert FFN {g(m, 'moe_intermediate_size')}",
        "shared experts": _shared_experts(m),
        "grouped routing": _grouped_routing(m),
        "attention": _attention(m),
        "task": f"{g(r, 'task')}" + (f" ({r['task_args']})" if r.get("task_args") else ""),
        "max response tokens": str(g(r, "max_new_tokens")),
        "RL steps": str(g(t, "steps")),
        "rollout batch": f"{g(r, 'prompts_per_step')} prompts x {g(r, 'group_size')} responses (group size "
                         f"{g(r, 'group_size')}), temperature {g(r, 'temperature')}",
        "learning rate": f"{g(t, 'lr')} ({g(t, 'lr_decay')}, {g(t, 'lr_warmup_steps')} warmup steps)",
        "minibatches per rollout batch": f"{g(t, 'minibatches')} optimizer steps per rollout batch (micro-batch "
                                         f"{g(t, 'micro_batch_size')})",
        "optimizer": f"Adam ({g(t, 'adam_beta1')}, {g(t, 'adam_beta2')}), weight decay {g(t, 'weight_decay')}, "
                     f"gradient-norm clip {g(t, 'grad_clip')}",
        "router bias update rate": _bias_rate(t),
        "precision": f"trainer {g(m, 'params_dtype')}, rollout engine {g(r, 'engine')} in {g(r, 'engine_dtype')}",
        "loss": f"{g(a, 'loss')}, {g(a, 'loss_agg_mode')}, KL beta {g(a, 'kl_beta')}",
        "clip range used (low, high)": (f"({c[0]:g}, {c[1]:g})" + ("" if a.get("clip_low") is not None and
                                                                 a.get("clip_high") is not None else
                                                                 " loss default")
                                        if (c := clip_used(a)) else "?"),
        "routing replay": str(g(a, "routing_replay")),
        "pi_old log-probs": "rollout engine" if a.get("use_engine_logprobs") else "training engine (recomputed)",
        "cold start": f"{g(t, 'cold_start_steps')} supervised steps, lr {g(t, 'cold_start_lr')}, batch "
                      f"{g(t, 'cold_start_batch_size')}",
    }
    return out


def settings_tables(variants: Sequence) -> tuple[list[list], list[str], list[list]]:
    """(shared rows [setting, value], per-variant header, per-variant rows) from each variant's first run's
    config.yaml: a setting with one value across variants goes in the shared table, the others get a column. A
    setting no variant uses has no row; one that only some use reads 'none' for the others."""
    cells = {v.name: run_settings(v.runs[0].config()) for v in variants if v.runs}
    if not cells:
        return [], [], []
    keys = [k for k in next(iter(cells.values())) if any(c[k] is not None for c in cells.values())]
    cells = {name: {k: NONE if c[k] is None else c[k] for k in keys} for name, c in cells.items()}
    differ = [k for k in keys if len({c[k] for c in cells.values()}) > 1]
    seeds = sorted({s for v in variants for s in v.seeds if s is not None})
    shared = [[k, next(iter(cells.values()))[k]] for k in keys if k not in differ]
    shared.append(["seeds", f"{len(seeds)} paired seeds ({', '.join(map(str, seeds))})" if seeds else "one run"])
    return shared, ["variant", *differ], [[name, *(c[k] for k in differ)] for name, c in cells.items()]
