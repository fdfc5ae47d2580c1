"""The policy-optimization algorithm (algorithm:): loss, advantages, replay, router shift, rollout correction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from moe_gspo.config.checks import ConfigError, choice


@dataclass
class AlgorithmConfig:
    """The policy-optimization algorithm."""

    SECTION: ClassVar[str] = "algorithm"

    loss: str = "gspo"
    """Policy loss by registered name: 'gspo', 'gspo_token', 'grpo', 'gmpo' (geometric mean of token ratios),
    'rspo' (gmpo with the router-shift weight), 'sapo' (soft gate instead of a clip) or 'cispo' (REINFORCE with a
    clipped, detached importance weight)."""
    advantage: str = "grpo"
    """Advantage estimator by registered name (group-relative by default)."""
    clip_low: float | None = None
    """Lower clip epsilon; None takes the loss's paper default (grpo 0.2, gspo 3e-4; gmpo and rspo clip the
    log-ratio, default 0.4; cispo 1.0, no lower bound; sapo does not clip and only reports the band)."""
    clip_high: float | None = None
    """Upper clip epsilon; None takes the loss's paper default (grpo 0.27, gspo 4e-4; gmpo and rspo: 0.4 on the
    log-ratio; cispo 0.28; sapo 0.28 for its band diagnostic)."""
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
    loss_agg_mode: str | None = None
    """How per-token terms become one loss: 'seq-mean-token-mean' (the paper's), 'token-mean' or 'seq-mean-token-sum'
    (not for gmpo/rspo, whose per-response terms are length-normalized already). None (the default) takes the
    loss's own: 'token-mean' for cispo, 'seq-mean-token-mean' for every other loss."""
    router_shift: bool = False
    """Multiply every token's importance ratio by RSPO's router-shift weight (arXiv:2510.23027) before the loss clips
    it, with any loss ('rspo' always does): needs the old-log-prob pass, which records the old router scores."""
    router_shift_floor: float = 0.8
    """Lower bound gamma_min of the router-shift weight, in (0, 1] (1 makes the weight 1 everywhere)."""
    router_score_dtype: str = "float16"
    """Dtype the old router scores are kept in between the old-log-prob pass and the updates: 'float16' (2 bytes
    per score), 'bfloat16' (2) or 'float32' (4)."""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for positive advantages (> 0; arXiv:2511.20347's default)."""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for negative advantages (> 0; larger decays the gradient of off-policy tokens faster)."""
    rollout_is: str = "off"
    """Importance weights by the rollout ratio rho = pi_trainer / pi_engine on every response token's gradient:
    'off', 'token' (rho per token) or 'sequence' (the product of a response's rho). Not with use_engine_logprobs,
    where the loss's own ratio already is pi_theta / pi_engine."""
    rollout_is_threshold: float | list[float] = 2.0
    """A number C > 0: truncated IS, weights min(rho, C). A pair [lower, upper] with 0 < lower <= upper: IcePop,
    weights outside the band set to 0."""
    rollout_rs: str = "off"
    """Rejection by the rollout ratio: 'off' or one of verl's modes token_k1/k2/k3, seq_sum_k1/k2/k3,
    seq_mean_k1/k2/k3, seq_max_k2/k3 (docs/losses.md). Rejected tokens leave the loss and its mask."""
    rollout_rs_threshold: float | list[float] | None = None
    """Bound of the rejection statistic, needed with rollout_rs: one upper bound > 0 for k2/k3; for k1 a pair of
    ratio bounds [lower, upper] (0 < lower <= upper) or one number u meaning [1/u, u]."""

    def __post_init__(self):
        choice(self, "routing_replay", ("off", "r2", "r3"))
        if self.loss_agg_mode is None:
            self.loss_agg_mode = "token-mean" if self.loss == "cispo" else "seq-mean-token-mean"
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
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ConfigError(f"algorithm.sapo_tau_pos={self.sapo_tau_pos}, algorithm.sapo_tau_neg="
                              f"{self.sapo_tau_neg}: both must be > 0")
        self._check_rollout_correction()
        if (self.loss == "rspo" or self.router_shift) and self.use_engine_logprobs:
            raise ConfigError(f"algorithm.use_engine_logprobs=true cannot go with the router shift (algorithm.loss="
                              f"{self.loss!r}, algorithm.router_shift={self.router_shift}): it needs the old router "
                              "scores that the training engine's old-log-prob pass records")

    def _check_rollout_correction(self):
        choice(self, "rollout_is", ("off", "token", "sequence"))
        choice(self, "rollout_rs", ("off",) + ROLLOUT_RS_MODES)
        _check_bounds("rollout_is_threshold", self.rollout_is_threshold, pair_ok=True)
        if self.rollout_rs != "off":
            if self.rollout_rs_threshold is None:
                raise ConfigError(f"algorithm.rollout_rs_threshold is required with algorithm.rollout_rs="
                                  f"{self.rollout_rs!r}")
            _check_bounds("rollout_rs_threshold", self.rollout_rs_threshold, pair_ok=self.rollout_rs.endswith("k1"))
        elif self.rollout_rs_threshold is not None:
            _check_bounds("rollout_rs_threshold", self.rollout_rs_threshold, pair_ok=True)
        if self.rollout_is != "off" and self.use_engine_logprobs:
            raise ConfigError(f"algorithm.rollout_is={self.rollout_is!r} cannot go with algorithm.use_engine_logprobs="
                              "true: the loss's ratio pi_theta / pi_engine already corrects for the engine (bypass "
                              "mode takes algorithm.rollout_rs only)")


ROLLOUT_RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _check_bounds(name: str, value, pair_ok: bool) -> None:
    """A finite number > 0, or (where pair_ok) a pair [lower, upper] with 0 < lower <= upper."""
    where = f"algorithm.{name}={value!r}"
    if isinstance(value, (list, tuple)):
        if not pair_ok:
            raise ConfigError(f"{where}: this mode takes one upper bound, not a pair")
        if len(value) != 2:
            raise ConfigError(f"{where}: give one number or a pair [lower, upper]")
        lower, upper = value
        if not (0 < lower <= upper < math.inf):
            raise ConfigError(f"{where}: need 0 < lower <= upper (finite)")
    elif not 0 < value < math.inf:
        raise ConfigError(f"{where} must be a finite number > 0")
