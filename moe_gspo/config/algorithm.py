"""The policy-optimization algorithm (algorithm:): loss, advantages, replay, router shift, rollout correction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from moe_gspo.config.checks import ConfigError, choice


@dataclass
class AlgorithmConfig:
    """The policy-optimization algorithm."""

    SECTION: ClassVar[str] = "algorithm"

    loss: str = "gspo"
    """Policy loss by registered name: 'gspo', 'gspo_token', 'grpo', 'gmpo' (geometric mean of token ratios),
    'rspo' (gmpo with the router-shift weight), 'sapo' (soft gate instead of a clip), 'cispo' (REINFORCE with a
    clipped, detached importance weight), or any loss registered with moe_gspo.losses.register_policy_loss."""
    loss_options: dict[str, Any] = field(default_factory=dict)
    """The loss's own options by name, checked by the loss at config load: sapo's tau_pos (1.0) and tau_neg
    (1.05), grpo's dual-clip bound clip_ratio_c (None); the other built-in losses take none."""
    advantage: str = "grpo"
    """Advantage estimator by registered name (group-relative by default)."""
    clip_low: float | None = None
    """Lower clip epsilon; None takes the loss's paper default (grpo 0.2, gspo 3e-4; gmpo and rspo clip the
    log-ratio, default 0.4; cispo 1.0, no lower bound; sapo does not clip and only reports the band)."""
    clip_high: float | None = None
    """Upper clip epsilon; None takes the loss's paper default (grpo 0.27, gspo 4e-4; gmpo and rspo: 0.4 on the
    log-ratio; cispo 0.28; sapo 0.28 for its band diagnostic)."""
    entropy_coeff: float = 0.0
    """Entropy bonus (verl's actor.entropy_coeff): the loss subtracts entropy_coeff times the policy's token
    entropy on the response tokens, aggregated like the policy loss (its loss_agg_mode and denominator); 0: none.
    The fused loss kernel carries the entropy's gradient (train.loss_impl=fused, 6THV)."""
    kl_beta: float = 0.0
    """Coefficient of the KL penalty to the frozen reference policy (the weights RL starts from) added to the
    loss; 0 (the paper's setting) builds no reference policy."""
    kl_estimator: str = "low_var_kl"
    """Per-token KL(pi || pi_ref) estimator: 'k1' (log ratio), 'k3' (exp(-d) + d - 1, d = log pi - log pi_ref) or
    'low_var_kl' (k3 clamped to [-10, 10], as verl names it)."""
    routing_replay: str = "off"
    """Routing Replay mode: 'off', 'r2' (old policy's training routing) or 'r3' (rollout engine's routing)."""
    use_engine_logprobs: bool = False
    """Use the rollout engine's log-probs as pi_old instead of recomputing them ("bypass" mode): sound for a loss
    whose importance ratio covers a whole response (gspo, gspo_token); refused at load for a per-token ratio
    unless algorithm.bypass_token_ratios is set."""
    bypass_token_ratios: bool = False
    """Accept algorithm.use_engine_logprobs with a loss whose importance ratio is per token (grpo, gmpo, sapo,
    cispo). Every token's ratio pi_theta / pi_engine then carries the engine-vs-trainer numeric mismatch (bf16
    kernels, other experts), which the clip treats as policy change; a sequence ratio averages it over the
    response. Set it to take that knowingly (verl's bypass mode with a token-level loss), e.g. with an fp32 engine
    whose mismatch is round-off, or with algorithm.rollout_rs rejecting the tokens that stray."""
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
    rollout_is: str = "off"
    """Importance weights by the rollout ratio rho = pi_trainer / pi_engine on every response token's gradient:
    'off', 'token' (rho per token) or 'sequence' (the product of a response's rho). Not with use_engine_logprobs,
    where the loss's own ratio already is pi_theta / pi_engine."""
    rollout_is_threshold: float | list[float] = 2.0
    """A number C > 0: truncated IS, weights min(rho, C). A pair [lower, upper] with 0 < lower <= upper: IcePop,
    weights outside the band set to 0."""
    rollout_rs: str = "off"
    """Rejection by the rollout ratio: 'off' or one of verl's modes token_k1/k2/k3, seq_sum_k1/k2/k3,
    seq_mean_k1/k2/k3, seq_max_k2/k3 (docs/guide/losses.md). Rejected tokens leave the loss and its mask."""
    rollout_rs_threshold: float | list[float] | None = None
    """Bound of the rejection statistic, needed with rollout_rs: one upper bound > 0 for k2/k3; for k1 a pair of
    ratio bounds [lower, upper] (0 < lower <= upper) or one number u meaning [1/u, u]."""

    def __post_init__(self):
        choice(self, "routing_replay", ("off", "r2", "r3"))
        choice(self, "router_score_dtype", ("float16", "bfloat16", "float32"))
        if not math.isfinite(self.entropy_coeff):
            raise ConfigError(f"algorithm.entropy_coeff={self.entropy_coeff} must be a finite number")
        if not 0 < self.router_shift_floor <= 1:
            raise ConfigError(f"algorithm.router_shift_floor={self.router_shift_floor} must be in (0, 1]")
        loss = self.policy_loss()  # the loss checks its own clip range, aggregation, KL and options
        self.loss_agg_mode = loss.loss_agg_mode  # None takes the loss's own default
        if (loss.needs_router_shift or self.router_shift) and self.use_engine_logprobs:
            raise ConfigError(f"algorithm.use_engine_logprobs=true cannot go with the router shift (algorithm.loss="
                              f"{self.loss!r}, algorithm.router_shift={self.router_shift}): it needs the old router "
                              "scores that the training engine's old-log-prob pass records")
        self.rollout_correction(loss)  # checks the correction's fields and bypass against the loss's ratio

    def policy_loss(self):
        """The configured loss (moe_gspo.losses.PolicyLoss); its hyperparameter errors as ConfigError naming the
        algorithm field."""
        from moe_gspo.losses import LossConfigError, policy_loss_from_config

        try:
            return policy_loss_from_config(self)
        except LossConfigError as e:
            raise ConfigError(f"algorithm.{e.field}={e.value!r}: {e.why}") from None

    def rollout_correction(self, loss=None):
        """The configured rollout correction (moe_gspo.losses.RolloutCorrection; `loss`, the configured loss when
        given, checks bypass mode against its ratio level); its errors as ConfigError naming the algorithm field."""
        from moe_gspo.losses import rollout_correction_from_config

        loss = loss if loss is not None else self.policy_loss()
        try:
            return rollout_correction_from_config(self, loss)
        except ValueError as e:
            raise ConfigError(f"algorithm.{e}") from None
