"""The compute of one RL step, after the rollout: old log-probs, then one optimizer step per minibatch.

    old, ref = old_logprob_pass(ctx, pb, sample_ids)       # no grad; records R2 routing and the flip reference
    for idx in minibatches: metrics += update_minibatch(ctx, pb, old, adv, sample_ids, idx, ref)

With the router shift (algorithm.loss=rspo or algorithm.router_shift), the old pass also keeps the old policy's
experts and router scores in ctx.old_router, and each update forward scores the same experts under the current
router; their shift gives every response token the weight that rescales its importance ratio (docs/losses.md).

With the rollout correction (algorithm.rollout_is / rollout_rs), every loss call gets the importance weights of
the rollout ratio rho = pi_trainer / pi_engine as a detached per-token gradient multiplier, and loses the tokens the
rejection mode rejects from its mask. pi_trainer is the old-log-prob pass (decoupled mode) or, with
algorithm.use_engine_logprobs (the engine as pi_old, "bypass"), the detached current log-probs of the update.

Global denominators (docs/losses.md): the count D of a minibatch is summed over data-parallel ranks once, and
every micro-batch's loss is divided by D / dp and summed, so gradient accumulation over micro-batches and the
data-parallel mean equal one step on the whole minibatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_gspo.config import Config
from moe_gspo.losses import (ROUTER_SHIFT_LOSSES, get_policy_loss, loss_denominator, rollout_is_weights,
                             rollout_log_ratio, rollout_rejection_mask, router_shift_metrics, router_shift_ratio,
                             router_shift_weight)
from moe_gspo.model.policy import MoEPolicy
from moe_gspo.model.routing_capture import ReplaySource, RoutingCapture
from moe_gspo.parallel.state import comm_device, max_over_ranks
from moe_gspo.rollout.batch import PaddedRollout
from moe_gspo.routing import SCORE_DTYPES, ExpertFlipTracker, OldRouterScores, RoutingReplayCache
from moe_gspo.train.logprob import batch_logprobs, hidden_loss
from moe_gspo.train.metrics import MetricMean
from moe_gspo.train.optim import Optimizer


@dataclass
class StepContext:
    """What the per-step functions need (built once by the trainer)."""

    policy: MoEPolicy
    optim: Optimizer | None  # None until the RL optimizer is built (after the cold start)
    cfg: Config
    replay: RoutingReplayCache
    tracker: ExpertFlipTracker | None
    dp_group: dist.ProcessGroup | None = None
    dp: int = 1
    reference: MoEPolicy | None = None  # frozen pi_ref for the KL penalty (algorithm.kl_beta > 0)
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = field(default=None)
    old_router: OldRouterScores | None = None  # the old policy's experts and router scores of this step's batch

    def __post_init__(self):
        self.loss_fn = get_policy_loss(self.cfg.algorithm.loss)

    @property
    def router_shift(self) -> bool:
        """Whether importance ratios get the router-shift weight (rspo, or algorithm.router_shift)."""
        a = self.cfg.algorithm
        return a.loss in ROUTER_SHIFT_LOSSES or a.router_shift


def routing_mask(response_mask_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: positions whose routing produced a response token (position j predicts token j + 1)."""
    return torch.nn.functional.pad(response_mask_BT[:, 1:], (0, 1), value=False)


def _micro(n: int, size: int):
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.no_grad()
def record_engine_routing(ctx: StepContext, pb: PaddedRollout, sample_ids: torch.Tensor) -> None:
    """R3: the engine's routing of every position whose routing shapes a response log-prob (rows 0 .. P+R-2) goes
    into the replay cache; a no-op in the other replay modes."""
    if ctx.replay.mode != "r3":
        return
    lengths = pb.attention_mask.sum(-1).tolist()
    ctx.replay.record_rollouts(sample_ids, [pb.routing[b, :n - 1] for b, n in enumerate(lengths)])


@torch.no_grad()  # pi_old and pi_ref are constants of the loss: no graph, no saved activations
def old_logprob_pass(ctx: StepContext, pb: PaddedRollout,
                     sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pi_old log-probs (B, T), pi_ref log-probs (B, T) or None) of the local rollout batch, in micro-batches of
    train.logprob_micro_batch_size rows (train.micro_batch_size when unset).

    Records what R2 and the flip tracker need, and has the tracker compare the engine's routing (when the rollout
    carries it) with the old policy's. Under R3 the engine's routing is replayed in this pass too (as in
    arXiv:2510.11370). The reference policy routes live (its own router): it is a different model, not a replay
    target."""
    cfg, policy = ctx.cfg, ctx.policy
    B, T = pb.input_ids.shape
    table = None if pb.routing is None else pb.routing.reshape(-1, *pb.routing.shape[2:])  # (B*T, L, k)
    r3_source = table if ctx.replay.mode == "r3" else None
    out, live, ref = [], [], []
    if ctx.router_shift:
        ctx.old_router = OldRouterScores(B, T, cfg.model.num_experts, SCORE_DTYPES[cfg.algorithm.router_score_dtype])
    rows = cfg.train.logprob_micro_batch_size or cfg.train.micro_batch_size
    for sl in _micro(B, rows):
        replay = None
        if r3_source is not None:
            replay = ReplaySource(r3_source[sl.start * T:sl.stop * T])
        cap = RoutingCapture(replay=replay, scores=ctx.router_shift)
        logp, _ = batch_logprobs(policy, pb.input_ids[sl], cap, cfg.train.logprob_impl, cfg.rollout.temperature,
                                 want_entropy=False)
        out.append(logp)
        if ctx.reference is not None:
            ref.append(batch_logprobs(ctx.reference, pb.input_ids[sl], None, cfg.train.logprob_impl,
                                      cfg.rollout.temperature, want_entropy=False)[0])
        live.append(cap.live_stacked())  # (b*T, L, k) what the old policy's router chose
        if ctx.router_shift:  # the experts pi_old activated (replayed ones under R3) and their router scores
            ctx.old_router.record(sl, cap.stacked(), cap.scores_stacked())
        if ctx.replay.mode == "r2":
            lengths = pb.attention_mask[sl].sum(-1)
            ctx.replay.record_capture(sample_ids[sl], lengths, cap)
    if ctx.tracker is not None:
        mask = routing_mask(pb.response_mask).reshape(-1)
        ctx.tracker.set_reference(sample_ids, torch.cat(live), mask)
        if table is not None:
            ctx.tracker.observe_rollout(sample_ids, table, mask)
    return torch.cat(out), (torch.cat(ref) if ref else None)


def global_count(mask_BT: torch.Tensor, mode: str, ctx: StepContext) -> torch.Tensor:
    """loss_denominator summed over data-parallel ranks, divided by dp (DDP averages gradients)."""
    d = loss_denominator(mask_BT, mode).double().to(comm_device())
    if ctx.dp > 1:
        dist.all_reduce(d, group=ctx.dp_group)
    return d / ctx.dp


def update_minibatch(ctx: StepContext, pb, old_logp_BT, adv_B, sample_ids, idx: torch.Tensor,
                     ref_logp_BT: torch.Tensor | None = None) -> dict[str, float]:
    """One optimizer step on the responses `idx` of the local batch; returns this minibatch's metrics.

    With algorithm.kl_beta > 0, `ref_logp_BT` (the reference policy's log-probs) adds kl_beta * KL to the loss.
    train.loss_impl="fused" goes from the policy's hidden states to the loss and the LM head's gradient in one
    kernel (6THV); "eager" computes the log-probs (train.logprob_impl), then the loss under autograd."""
    cfg, policy = ctx.cfg, ctx.policy
    a = cfg.algorithm
    ids, mask = pb.input_ids[idx], pb.response_mask[idx]
    # trim the padding the whole minibatch shares, to the same length on every rank (see max_over_ranks)
    T = max_over_ranks(int(pb.attention_mask[idx].sum(-1).max()))
    ids, mask = ids[:, :T], mask[:, :T]
    old, adv, sids = old_logp_BT[idx][:, :T], adv_B[idx], sample_ids[idx]
    ref = ref_logp_BT[idx][:, :T] if a.kl_beta > 0 and ref_logp_BT is not None else None
    if a.kl_beta > 0 and ref is None:
        raise RuntimeError("algorithm.kl_beta > 0 but the step has no reference log-probs")
    engine = pb.old_logprobs[idx][:, :T] if _corrects(a) else None
    kept = mask
    if engine is not None and not a.use_engine_logprobs:  # decoupled: rejected tokens leave the denominator too
        kept = rollout_correction(a, old, engine, mask)[0]
    denom = global_count(kept, a.loss_agg_mode, ctx)
    if ctx.router_shift and ctx.old_router is None:
        raise RuntimeError("the router shift needs the old router scores, which old_logprob_pass records")
    ctx.optim.zero_grad()
    acc = MetricMean()
    ent_sum = torch.zeros((), dtype=torch.float64, device=mask.device)
    gammas = []
    fused = cfg.train.loss_impl == "fused"
    for sl in _micro(len(idx), cfg.train.micro_batch_size):
        src = ctx.replay.replay_source(sids[sl], seq_len=T, device=ids.device)  # None when off
        old_src = ctx.old_router.source(idx[sl], T, ids.device) if ctx.router_shift else None
        cap = RoutingCapture(replay=src, score_at=old_src)
        if fused:  # the LM head and the loss run together below
            hidden = policy(ids[sl], routing=cap, return_hidden=True)  # (b, T, H)
        else:
            logp, ent = batch_logprobs(policy, ids[sl], cap, cfg.train.logprob_impl, cfg.rollout.temperature)
        if src is not None:
            src.check_complete()
        shift = {}
        if old_src is not None:
            gamma = _router_shift_ratio(ctx, cap, old_src, mask[sl].shape)
            gammas.append(gamma[mask[sl]])
            shift["router_shift_weight"] = router_shift_weight(gamma, a.router_shift_floor)
        loss_rows = _loss_rows(ctx, old[sl], adv[sl], mask[sl], None if ref is None else ref[sl], shift, denom,
                               None if engine is None else engine[sl])
        if fused:
            loss, m, logp, ent = _fused_loss(ctx, hidden, ids[sl], loss_rows)
        else:
            loss, m = loss_rows(logp, 0, len(logp))
        loss.backward()
        if ctx.tracker is not None:
            ctx.tracker.observe(sids[sl], cap.live_stacked(), routing_mask(mask[sl]).reshape(-1))
        ent_sum += torch.where(mask[sl], ent.detach(), 0).sum().double()
        acc.add({k: float(v) for k, v in m.items()})
    gnorm = ctx.optim.step()  # DP reduction, megatron's clipping, Adam on fp32 main params, LR schedule
    out = acc.result()
    out["entropy"] = float(ent_sum) / max(int(mask.sum()), 1)
    out["grad_norm"] = gnorm
    if gammas:  # over this minibatch's response tokens (the loop averages minibatches, then ranks)
        out.update({k: float(v) for k, v in router_shift_metrics(torch.cat(gammas), a.router_shift_floor).items()})
    return out


def _corrects(a) -> bool:
    return a.rollout_is != "off" or a.rollout_rs != "off"


def rollout_correction(a, trainer_bT, engine_bT, mask_bT) -> tuple[torch.Tensor, dict, dict]:
    """(mask without the rejected tokens, loss kwargs with the importance weight, metrics) of algorithm.rollout_is /
    rollout_rs for rows whose trainer-side log-probs are trainer_bT (detached here) and engine log-probs engine_bT.
    The weights' metrics describe the tokens that stay."""
    log_ratio = rollout_log_ratio(trainer_bT, engine_bT, mask_bT)
    metrics, kwargs = {}, {}
    if a.rollout_rs != "off":
        mask_bT, m = rollout_rejection_mask(log_ratio, mask_bT, a.rollout_rs, a.rollout_rs_threshold)
        metrics.update(m)
    if a.rollout_is != "off":
        kwargs["rollout_is_weight"], m = rollout_is_weights(log_ratio, mask_bT, a.rollout_is, a.rollout_is_threshold)
        metrics.update(m)
    return mask_bT, kwargs, metrics


def loss_options(a) -> dict:
    """The configured options of the loss beyond the shared ones (sapo's temperatures)."""
    return {"tau_pos": a.sapo_tau_pos, "tau_neg": a.sapo_tau_neg} if a.loss == "sapo" else {}


def _loss_rows(ctx: StepContext, old_bT, adv_b, mask_bT, ref_bT, shift: dict, denom, engine_bT=None):
    """loss_rows(logp_bT, b0, b1) -> (loss, metrics): the configured policy loss (with its KL term, router-shift
    weight and rollout correction against the engine's log-probs engine_bT) of rows b0..b1-1 of a micro-batch. With
    the global denominator the parts of any split of the rows add up to the loss of the whole micro-batch."""
    a = ctx.cfg.algorithm

    def loss_rows(logp_bT, b0, b1):
        r = slice(b0, b1)
        mask, corr, corr_m = mask_bT[r], {}, {}
        if engine_bT is not None:  # bypass: pi_old is the engine, rho compares the current policy with it
            trainer = logp_bT if a.use_engine_logprobs else old_bT[r]
            mask, corr, corr_m = rollout_correction(a, trainer, engine_bT[r], mask)
        loss, m = ctx.loss_fn(logp_bT, old_bT[r], adv_b[r], mask, clip_low=a.clip_low, clip_high=a.clip_high,
                              loss_agg_mode=a.loss_agg_mode, loss_denominator=denom,
                              ref_logp=None if ref_bT is None else ref_bT[r], beta=a.kl_beta,
                              kl_estimator=a.kl_estimator, **{k: v[r] for k, v in shift.items()}, **corr,
                              **loss_options(a))
        return loss, {**m, **corr_m}
    return loss_rows


def _fused_loss(ctx: StepContext, hidden_bTH, ids_bT, loss_rows):
    """(loss, metrics, logp (b, T), entropy (b, T)) through the loss-fused kernel (hidden_loss). The kernel calls
    the loss on groups of whole rows and takes d loss / d logp from it before its gradient GEMMs, so the math is
    moe_gspo.losses' own. The metrics are those of the call that covered every row, or, when the workspace split
    the rows, of one more evaluation on the finished log-probs."""
    b = ids_bT.shape[0]
    whole = {}

    def part(logp_bT, b0, b1):
        loss, m = loss_rows(logp_bT, b0, b1)
        if b0 == 0 and b1 == b:
            whole.update(m)
        return loss

    loss, logp, ent = hidden_loss(ctx.policy, hidden_bTH, ids_bT, part, ctx.cfg.rollout.temperature)
    if not whole:
        with torch.no_grad():
            whole.update(loss_rows(logp, 0, b)[1])
    return loss, whole, logp, ent


def _router_shift_ratio(ctx: StepContext, cap: RoutingCapture, old_src, shape_BT) -> torch.Tensor:
    """(b, T) router-shift ratio gamma per token, aligned with the log-probs: token j's is that of the routing at
    position j - 1, which produced it (column 0, a prompt token, gets 1)."""
    cur = ctx.old_router.round(cap.scores_stacked())  # (b*T, L, k) rounded like the stored old scores
    gamma = router_shift_ratio(cur, old_src.scores).view(shape_BT)  # by routing position
    return torch.nn.functional.pad(gamma[:, :-1], (1, 0), value=1.0)


def cold_start(policy, ddp, tc, task, tok, dp: int, dp_rank: int, log=None) -> list[float]:
    """Supervised fine-tuning on demonstrations (train.cold_start_steps batches of train.cold_start_batch_size,
    split over data-parallel ranks) with its own megatron optimizer at the constant train.cold_start_lr."""
    import random

    from moe_gspo.tasks.sft import demonstration_batch, sft_loss
    from moe_gspo.train.data import hash_seed

    steps, batch_size = tc.cold_start_steps, tc.cold_start_batch_size
    opt = Optimizer.from_config(ddp, policy, tc, total_steps=steps, lr=tc.cold_start_lr)
    rng = random.Random(hash_seed(tc.seed, 7919, dp_rank))
    per_rank = max(1, batch_size // dp)
    losses = []
    for s in range(steps):
        ids, m = demonstration_batch([task.sample(rng, "train") for _ in range(per_rank)], tok)
        opt.zero_grad()
        loss = sft_loss(policy, ids, m)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if log is not None:
            log(s, losses[-1])
    opt.zero_grad()
    return losses
