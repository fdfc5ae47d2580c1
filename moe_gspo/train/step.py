"""The compute of one RL step, after the rollout: old log-probs, then one optimizer step per minibatch.

    ctx = StepContext(policy, optim, cfg, replay, tracker)  # picks the micro-batching and the loss path once
    old = old_logprob_pass(ctx, pb, sample_ids)              # no grad: OldPass (pi_old, pi_ref, old router scores)
    for idx in minibatches: metrics += update_minibatch(ctx, pb, old, adv, sample_ids, idx)

Micro-batches (moe_gspo.train.micro): train.micro_batch_size rows run padded, or, with
train.max_tokens_per_micro_batch, whole rows packed back to back up to that many tokens per forward; both passes
use the strategy the context chose, and the LM head never computes the padding either way.

With the router shift (algorithm.loss=rspo or algorithm.router_shift), the old pass also keeps the old policy's
experts and router scores (OldPass.router), and each update forward scores the same experts under the current
router; their shift gives every response token the weight that rescales its importance ratio (docs/losses.md).

With the rollout correction (algorithm.rollout_is / rollout_rs), every loss call gets the importance weights of
the rollout ratio rho = pi_trainer / pi_engine as a detached per-token gradient multiplier, and loses the tokens the
rejection mode rejects from its mask. pi_trainer is the old-log-prob pass (decoupled mode) or, with
algorithm.use_engine_logprobs (the engine as pi_old, "bypass"), the detached current log-probs of the update.

Global denominators (docs/losses.md): the count D of a minibatch is summed over data-parallel ranks once, and
every micro-batch's loss is divided by D / dp and summed, so gradient accumulation over micro-batches and the
data-parallel mean equal one step on the whole minibatch, whatever the micro-batches are.
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
from moe_gspo.train.micro import MicroBatch, micro_batches
from moe_gspo.train.optim import Optimizer


@dataclass
class OldPass:
    """What the no-grad pass over the rollout batch computes for the updates that follow."""

    logp: torch.Tensor  # (B, T) pi_old log-probs, token-aligned (the engine's in bypass mode)
    ref: torch.Tensor | None = None  # (B, T) pi_ref log-probs (algorithm.kl_beta > 0)
    router: OldRouterScores | None = None  # the old policy's experts and router scores (router shift)


@dataclass
class StepContext:
    """What the per-step functions need (built once by the trainer), and the strategies chosen from the config
    once: the micro-batching of each pass and the update's path from hidden states to the loss."""

    policy: MoEPolicy
    optim: Optimizer | None  # None until the RL optimizer is built (after the cold start)
    cfg: Config
    replay: RoutingReplayCache
    tracker: ExpertFlipTracker | None
    dp_group: dist.ProcessGroup | None = None
    dp: int = 1
    reference: MoEPolicy | None = None  # frozen pi_ref for the KL penalty (algorithm.kl_beta > 0)
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = field(default=None)

    def __post_init__(self):
        tc = self.cfg.train
        self.loss_fn = get_policy_loss(self.cfg.algorithm.loss)
        self.update_batches = micro_batches(tc)
        self.logprob_batches = micro_batches(tc, logprob_pass=True)
        self.micro_loss = _fused_micro_loss if tc.loss_impl == "fused" else _eager_micro_loss

    @property
    def router_shift(self) -> bool:
        """Whether importance ratios get the router-shift weight (rspo, or algorithm.router_shift)."""
        a = self.cfg.algorithm
        return a.loss in ROUTER_SHIFT_LOSSES or a.router_shift


def routing_mask(response_mask_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: positions whose routing produced a response token (position j predicts token j + 1)."""
    return torch.nn.functional.pad(response_mask_BT[:, 1:], (0, 1), value=False)


def _lengths(attention_mask_BT: torch.Tensor) -> list[int]:
    return attention_mask_BT.sum(-1).tolist()


@torch.no_grad()
def record_engine_routing(ctx: StepContext, pb: PaddedRollout, sample_ids: torch.Tensor) -> None:
    """R3: the engine's routing of every position whose routing shapes a response log-prob (rows 0 .. P+R-2) goes
    into the replay cache; a no-op in the other replay modes."""
    if ctx.replay.mode != "r3":
        return
    lengths = _lengths(pb.attention_mask)
    ctx.replay.record_rollouts(sample_ids, [pb.routing[b, :n - 1] for b, n in enumerate(lengths)])


@torch.no_grad()  # pi_old and pi_ref are constants of the loss: no graph, no saved activations
def old_logprob_pass(ctx: StepContext, pb: PaddedRollout, sample_ids: torch.Tensor) -> OldPass:
    """pi_old log-probs (B, T) of the local rollout batch (with pi_ref's under a KL term, and the old router
    scores under the router shift), in the micro-batches of ctx.logprob_batches.

    Records what R2 and the flip tracker need, and has the tracker compare the engine's routing (when the rollout
    carries it) with the old policy's. Under R3 the engine's routing is replayed in this pass too (as in
    arXiv:2510.11370). The reference policy routes live (its own router): it is a different model, not a replay
    target."""
    cfg, policy = ctx.cfg, ctx.policy
    B, T = pb.input_ids.shape
    table = None if pb.routing is None else pb.routing.reshape(-1, *pb.routing.shape[2:])  # (B*T, L, k)
    r3_source = table if ctx.replay.mode == "r3" else None
    lengths = _lengths(pb.attention_mask)
    logp = torch.zeros(B, T, device=pb.input_ids.device)
    ref = torch.zeros_like(logp) if ctx.reference is not None else None
    live = []
    router = None
    if ctx.router_shift:
        router = OldRouterScores(B, T, cfg.model.num_experts, SCORE_DTYPES[cfg.algorithm.router_score_dtype])
    for mb in ctx.logprob_batches.plan(lengths):
        sl = mb.rows
        replay = None
        if r3_source is not None:
            replay = ReplaySource(r3_source[sl.start * T:sl.stop * T])
        cap = RoutingCapture(replay=replay, scores=ctx.router_shift)
        lp, _ = batch_logprobs(policy, pb.input_ids[sl], cap, cfg.train.logprob_impl, cfg.rollout.temperature,
                               want_entropy=False, lengths=lengths[sl], pack_to=mb.pack_to)
        if ctx.reference is not None:
            ref_lp = batch_logprobs(ctx.reference, pb.input_ids[sl], None, cfg.train.logprob_impl,
                                    cfg.rollout.temperature, want_entropy=False, lengths=lengths[sl],
                                    pack_to=mb.pack_to)[0]
        logp[sl] = lp
        if ref is not None:
            ref[sl] = ref_lp
        live.append(cap.live_stacked())  # (b*T, L, k) what the old policy's router chose
        if router is not None:  # the experts pi_old activated (replayed ones under R3) and their router scores
            router.record(sl, cap.stacked(), cap.scores_stacked())
        if ctx.replay.mode == "r2":
            ctx.replay.record_capture(sample_ids[sl], lengths[sl], cap)
    if ctx.tracker is not None:
        mask = routing_mask(pb.response_mask).reshape(-1)
        ctx.tracker.set_reference(sample_ids, torch.cat(live), mask)
        if table is not None:
            ctx.tracker.observe_rollout(sample_ids, table, mask)
    return OldPass(logp, ref, router)


def global_count(mask_BT: torch.Tensor, mode: str, ctx: StepContext) -> torch.Tensor:
    """loss_denominator summed over data-parallel ranks, divided by dp (DDP averages gradients)."""
    d = loss_denominator(mask_BT, mode).double().to(comm_device())
    if ctx.dp > 1:
        dist.all_reduce(d, group=ctx.dp_group)
    return d / ctx.dp


def update_minibatch(ctx: StepContext, pb, old: OldPass, adv_B, sample_ids, idx: torch.Tensor) -> dict[str, float]:
    """One optimizer step on the responses `idx` of the local batch; returns this minibatch's metrics.

    With algorithm.kl_beta > 0, `old.ref` (the reference policy's log-probs) adds kl_beta * KL to the loss.
    train.loss_impl="fused" goes from the policy's hidden states to the loss and the LM head's gradient in one
    kernel (6THV); "eager" computes the log-probs (train.logprob_impl), then the loss under autograd."""
    cfg, policy = ctx.cfg, ctx.policy
    a = cfg.algorithm
    ids, mask = pb.input_ids[idx], pb.response_mask[idx]
    lengths = _lengths(pb.attention_mask[idx])
    # trim the padding the whole minibatch shares, to the same length on every rank (see max_over_ranks)
    T = max_over_ranks(max(lengths))
    ids, mask = ids[:, :T], mask[:, :T]
    old_logp, adv, sids = old.logp[idx][:, :T], adv_B[idx], sample_ids[idx]
    ref = old.ref[idx][:, :T] if a.kl_beta > 0 and old.ref is not None else None
    if a.kl_beta > 0 and ref is None:
        raise RuntimeError("algorithm.kl_beta > 0 but the step has no reference log-probs")
    engine = pb.old_logprobs[idx][:, :T] if _corrects(a) else None
    kept = mask
    if engine is not None and not a.use_engine_logprobs:  # decoupled: rejected tokens leave the denominator too
        kept = rollout_correction(a, old_logp, engine, mask)[0]
    denom = global_count(kept, a.loss_agg_mode, ctx)
    if ctx.router_shift and old.router is None:
        raise RuntimeError("the router shift needs the old router scores, which old_logprob_pass records")
    ctx.optim.zero_grad()
    acc = MetricMean()
    ent_sum = torch.zeros((), dtype=torch.float64, device=mask.device)
    gammas = []
    for mb in ctx.update_batches.plan(lengths):
        sl = mb.rows
        src = ctx.replay.replay_source(sids[sl], seq_len=T, device=ids.device)  # None when off
        old_src = old.router.source(idx[sl], T, ids.device) if ctx.router_shift else None
        cap = RoutingCapture(replay=src, score_at=old_src)
        shift = {}

        def loss_rows_of(logp_cap):  # the shift needs this forward's router scores, known after the forward
            if old_src is not None:
                gamma = _router_shift_ratio(old.router, cap, old_src, mask[sl].shape)
                gammas.append(gamma[mask[sl]])
                shift["router_shift_weight"] = router_shift_weight(gamma, a.router_shift_floor)
            return _loss_rows(ctx, old_logp[sl], adv[sl], mask[sl], None if ref is None else ref[sl], shift, denom,
                              None if engine is None else engine[sl])

        loss, m, ent = ctx.micro_loss(ctx, ids[sl], cap, lengths[sl], mb, loss_rows_of)
        if src is not None:
            src.check_complete()
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


def _eager_micro_loss(ctx: StepContext, ids_bT, cap, lengths, mb: MicroBatch, loss_rows_of):
    """(loss, metrics, entropy (b, T)): log-probs by train.logprob_impl, then the loss under autograd."""
    logp, ent = batch_logprobs(ctx.policy, ids_bT, cap, ctx.cfg.train.logprob_impl, ctx.cfg.rollout.temperature,
                               lengths=lengths, pack_to=mb.pack_to)
    loss, m = loss_rows_of(cap)(logp, 0, len(logp))
    return loss, m, ent


def _fused_micro_loss(ctx: StepContext, ids_bT, cap, lengths, mb: MicroBatch, loss_rows_of):
    """(loss, metrics, entropy (b, T)) through the loss-fused kernel (hidden_loss). The kernel calls the loss on
    groups of whole rows and takes d loss / d logp from it before its gradient GEMMs, so the math is
    moe_gspo.losses' own. The metrics are those of the call that covered every row, or, when the workspace split
    the rows, of one more evaluation on the finished log-probs."""
    packed = {} if mb.lengths is None else {"lengths": mb.lengths, "pack_to": mb.pack_to}
    hidden = ctx.policy(ids_bT, routing=cap, return_hidden=True, **packed)  # (b, T, H)
    loss_rows = loss_rows_of(cap)
    b = ids_bT.shape[0]
    whole = {}

    def part(logp_bT, b0, b1):
        loss, m = loss_rows(logp_bT, b0, b1)
        if b0 == 0 and b1 == b:
            whole.update(m)
        return loss

    loss, logp, ent = hidden_loss(ctx.policy, hidden, ids_bT, part, ctx.cfg.rollout.temperature, lengths=lengths)
    if not whole:
        with torch.no_grad():
            whole.update(loss_rows(logp, 0, b)[1])
    return loss, whole, ent


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


def _router_shift_ratio(old_router: OldRouterScores, cap: RoutingCapture, old_src, shape_BT) -> torch.Tensor:
    """(b, T) router-shift ratio gamma per token, aligned with the log-probs: token j's is that of the routing at
    position j - 1, which produced it (column 0, a prompt token, gets 1)."""
    cur = old_router.round(cap.scores_stacked())  # (b*T, L, k) rounded like the stored old scores
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
