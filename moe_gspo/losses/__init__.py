"""moe_gspo.losses: GRPO / GSPO / GSPO-token / GMPO / RSPO / SAPO / CISPO policy losses and group advantages,
registered by name, and the rollout-mismatch correction (truncated IS, IcePop, rejection).

    from moe_gspo.losses import build_policy_loss, get_advantage_estimator, policy_loss_class
    adv = get_advantage_estimator("grpo")(rewards, group_ids)                  # (N,)
    gspo = build_policy_loss("gspo")                                            # clip defaults (3e-4, 4e-4)
    loss, metrics = gspo(logp, old_logp, adv, mask)
    policy_loss_class("cispo").default_agg_mode                                 # a loss's defaults: 'token-mean'
    w = router_shift_weight(router_shift_ratio(cur_scores, old_scores), floor=0.8)   # RSPO's per-token weight
    loss, metrics = build_policy_loss("rspo")(logp, old_logp, adv, mask, router_shift_weight=w)
    w, m = rollout_is_weights(trainer_logp - engine_logp, mask, level="token", threshold=2.0)      # TIS
    keep, m = rollout_rejection_mask(trainer_logp - engine_logp, mask, mode="token_k3", threshold=0.01)
    loss, metrics = build_policy_loss("grpo")(logp, old_logp, adv, mask & keep, rollout_is_weight=w)
    corr = rollout_correction_from_config(cfg.algorithm, gspo)   # both, as the trainer applies them
    out = corr(trainer_logp, engine_logp, mask)                   # Correction(mask, weight, metrics)

A new loss is a PolicyLoss subclass (its defaults, an Options dataclass, its math) under @register_policy_loss; the
config then reads it by name (algorithm.loss) with its options (algorithm.loss_options).

Formulas, defaults and aggregation pitfalls: docs/guide/losses.md.
"""

from moe_gspo.losses import policy as _policy  # noqa: F401  (registers grpo, gspo, gspo_token)
from moe_gspo.losses import gmpo as _gmpo  # noqa: F401  (registers gmpo, rspo)
from moe_gspo.losses import sapo_cispo as _sapo_cispo  # noqa: F401  (registers sapo, cispo)
from moe_gspo.losses.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    group_stats,
    register_advantage_estimator,
)
from moe_gspo.losses.aggregation import AGG_MODES, agg_loss, agg_seq_loss, loss_denominator
from moe_gspo.losses.gmpo import gmpo_loss
from moe_gspo.losses.packed import pad_packed, unpad_to_packed
from moe_gspo.losses.policy import gspo_loss, gspo_token_loss, grpo_loss, sequence_log_ratio
from moe_gspo.losses.registry import (
    DEFAULT_AGG_MODE,
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    LossConfigError,
    NoOptions,
    PolicyLoss,
    build_policy_loss,
    get_policy_loss,
    kl_k3,
    kl_penalty,
    policy_loss_class,
    policy_loss_from_config,
    register_policy_loss,
)
from moe_gspo.losses.rollout_correction import (
    IS_LEVELS,
    RS_MODES,
    Correction,
    RolloutCorrection,
    rollout_correction_from_config,
    rollout_is_weights,
    rollout_log_ratio,
    rollout_rejection_mask,
)
from moe_gspo.losses.router_shift import router_shift_metrics, router_shift_ratio, router_shift_weight
from moe_gspo.losses.sapo_cispo import cispo_loss, sapo_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGG_MODES", "DEFAULT_AGG_MODE", "LossConfigError", "NoOptions", "PolicyLoss",
    "build_policy_loss", "policy_loss_class", "policy_loss_from_config", "IS_LEVELS", "RS_MODES", "cispo_loss",
    "Correction", "RolloutCorrection", "rollout_correction_from_config",
    "rollout_is_weights", "rollout_log_ratio", "rollout_rejection_mask", "sapo_loss", "LOG_RATIO_CLAMP", "POLICY_LOSSES",
    "agg_loss", "agg_seq_loss", "get_advantage_estimator", "get_policy_loss", "gmpo_loss",
    "group_stats", "grpo_loss", "gspo_loss", "gspo_token_loss", "KL_ESTIMATORS", "kl_k3", "kl_penalty",
    "loss_denominator", "pad_packed", "register_advantage_estimator", "register_policy_loss", "router_shift_metrics",
    "router_shift_ratio", "router_shift_weight", "sequence_log_ratio", "unpad_to_packed",
]
