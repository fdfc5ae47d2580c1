"""The policy-optimization algorithm (algorithm:): loss, advantages, replay, router shift."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_gspo.config.checks import ConfigError, choice


@dataclass
class AlgorithmConfig:
    """The policy-optimization algorithm."""

    SECTION: ClassVar[str] = "algorithm"

    loss: str = "gspo"
    """Policy loss by registered name: 'gspo', 'gspo_token', 'grpo', 'gmpo' (geometric mean of token ratios) or
    'rspo' (gmpo with the router-shift weight)."""
    advantage: str = "grpo"
    """Advantage estimator by registered name (group-relative by default)."""
    clip_low: float | None = None
    """Lower clip epsilon; None takes the loss's paper default (grpo 0.2, gspo 3e-4; gmpo and rspo clip the
    log-ratio, default 0.4)."""
    clip_high: float | None = None
    """Upper clip epsilon; None takes the loss's paper default (grpo 0.27, gspo 4e-4; gmpo and rspo: 0.4 on the
    log-ratio)."""
    kl_beta: float = 0.0
    """Coefficient of the KL penalty to the frozen reference policy (the weights RL starts from) added to the
    loss; 0 (the paper's setting) builds no reference policy."""
    kl_estimator: str = "low_var_kl"
    """Per-token KL(pi || pi_ref) estimator: 'k1' (log ratio), 'k3' (exp(-d) + d - 1, d = log pi - log pi_ref) or
    'low_var_kl' (k3 clamped to [-10, 10], as verl names it)."""
    routing_replay: str = "off"
    """Routing Replay mode: 'off', 'r2' (old policy's training routing) or 'r3' (rollout engine's routing)."""
    use_engine_logprobs: bool = False
    """Use the rollout engine's log-probs as pi_old instead of recomputing them (sound for GSPO only)."""
    track_flips: bool = True
    """Measure the expert-flip rate after each gradient step."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """How per-token terms become one loss: 'seq-mean-token-mean' (the paper's), 'token-mean' or 'seq-mean-token-sum'
    (not for gmpo/rspo, whose per-response terms are length-normalized already)."""
    router_shift: bool = False
    """Multiply every token's importance ratio by RSPO's router-shift weight (arXiv:2510.23027) before the loss clips
    it, with any loss ('rspo' always does): needs the old-log-prob pass, which records the old router scores."""
    router_shift_floor: float = 0.8
    """Lower bound gamma_min of the router-shift weight, in (0, 1] (1 makes the weight 1 everywhere)."""
    router_score_dtype: str = "float16"
    """Dtype the old router scores are kept in between the old-log-prob pass and the updates: 'float16' (2 bytes
    per score), 'bfloat16' (2) or 'float32' (4)."""

    def __post_init__(self):
        choice(self, "routing_replay", ("off", "r2", "r3"))
        choice(self, "loss_agg_mode", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
        if self.kl_beta < 0:
            raise ConfigError(f"algorithm.kl_beta={self.kl_beta} must be >= 0")
        choice(self, "kl_estimator", ("k1", "k3", "low_var_kl"))
        choice(self, "router_score_dtype", ("float16", "bfloat16", "float32"))
        if not 0 < self.router_shift_floor <= 1:
            raise ConfigError(f"algorithm.router_shift_floor={self.router_shift_floor} must be in (0, 1]")
        if self.loss in ("gmpo", "rspo") and self.loss_agg_mode == "seq-mean-token-sum":
            raise ConfigError(f"algorithm.loss_agg_mode='seq-mean-token-sum' does not apply to algorithm.loss="
                              f"{self.loss!r}; use 'seq-mean-token-mean' (the paper's) or 'token-mean'")
        if (self.loss == "rspo" or self.router_shift) and self.use_engine_logprobs:
            raise ConfigError(f"algorithm.use_engine_logprobs=true cannot go with the router shift (algorithm.loss="
                              f"{self.loss!r}, algorithm.router_shift={self.router_shift}): it needs the old router "
                              "scores that the training engine's old-log-prob pass records")
