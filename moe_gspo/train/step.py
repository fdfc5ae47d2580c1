"""The compute of one RL step, after the rollout: old log-probs, then one optimizer step per minibatch.

    ctx = StepContext(policy, optim, cfg, replay, tracker, groups)  # loss, correction, micro-batching, built once
    old, diff = pi_old_pass(ctx, pb)                         # no grad: OldPass (pi_old, pi_ref, old router scores)
    for idx in minibatches: metrics += update_minibatch(ctx, pb, old, adv, idx)

An update is a plain sequence: the minibatch's loss inputs (LossRows: pi_old, pi_ref, the engine's log-probs, the
response mask, the rollout-correction weight) are gathered once; each micro-batch runs its forward, adds the
router-shift weight its router scores give, and back-propagates its share of the loss; after the optimizer step the
loss is evaluated once more, without gradient, on the whole minibatch's log-probs for the metrics, so they do not
depend on how the minibatch was cut into forwards.

Micro-batches (moe_gspo.train.micro): train.micro_batch_size rows run padded, or, with
train.max_tokens_per_micro_batch, whole rows packed back to back up to that many tokens per forward; both passes
use the strategy the context chose, and the LM head never computes the padding either way.

With the router shift (a loss that needs it, or algorithm.router_shift), the old pass also keeps the old policy's
experts and router scores (OldPass.router), and each update forward scores the same experts under the current
router; their shift gives every response token the weight that rescales its importance ratio (docs/guide/losses.md).

With the rollout correction (algorithm.rollout_is / rollout_rs; ctx.correction, a RolloutCorrection built once
from the config), the loss gets the importance weights of the rollout ratio rho = pi_trainer / pi_engine as a
detached per-token gradient multiplier, and loses the tokens the rejection mode rejects from its mask. pi_trainer
is the old-log-prob pass (decoupled mode: computed once per minibatch) or, with algorithm.use_engine_logprobs (the
engine as pi_old, "bypass"), the detached current log-probs of the update (computed in the loss call, once per
token). The correction also says where pi_old comes from (pi_old_pass).

Global denominators (docs/guide/losses.md): the count D of a minibatch is summed over data-parallel ranks once, and
every micro-batch's loss is divided by D / dp and summed, so gradient accumulation over micro-batches and the
data-parallel mean equal one step on the whole minibatch, whatever the micro-batches are.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_gspo.config import Config
from moe_gspo.losses import (PolicyLoss, RolloutCorrection, agg_loss, loss_denominator, router_shift_metrics,
                             router_shift_ratio, router_shift_weight)
from moe_gspo.model.policy import MoEPolicy
from moe_gspo.model.router import RoutingNoise
from moe_gspo.model.routing_capture import RoutingCapture
from moe_gspo.parallel.state import comm_device, max_over_ranks, trainer_group
from moe_gspo.rollout.batch import PaddedRollout, rollout_probs_diff
from moe_gspo.routing import SCORE_DTYPES, ExpertFlipTracker, OldRouterScores, RoutingReplayCache
from moe_gspo.train.logprob import batch_logprobs, hidden_loss
from moe_gspo.train.metrics import host_floats
from moe_gspo.train.micro import MicroBatch, micro_batches
from moe_gspo.train.optim import Optimizer


@dataclass
class OldPass:
    """What the no-grad pass over the rollout batch computes for the updates that follow."""

    old_logp: torch.Tensor | None  # (B, T) pi_old log-probs, token-aligned (the engine's in bypass mode); None:
    # the update's forward computes pi_old itself (StepContext.forward_is_pi_old)
    ref_logp: torch.Tensor | None = None  # (B, T) pi_ref log-probs (algorithm.kl_beta > 0)
    router: OldRouterScores | None = None  # the old policy's experts and router scores (router shift)


def forward_gives_pi_old(cfg: Config) -> bool:
    """Whether a step's update forward computes pi_old itself, so the old-log-prob pass is skipped
    (train.old_logprob_pass='auto'): one update per step, on the weights the rollout's pi_old is defined by, and
    nothing the pass alone records (R2's routing, the flip tracker's reference, pi_ref, the router shift's scores)
    or fixes before the forwards (a decoupled rollout correction's rejection, in the loss's denominator); no
    routing noise, which only the update's forward gets. In bypass mode the engine's log-probs are pi_old."""
    a, tc = cfg.algorithm, cfg.train
    loss = a.policy_loss()
    corr = a.rollout_correction(loss)
    return (tc.old_logprob_pass == "auto" and tc.minibatches == 1 and not corr.active and not corr.bypass
            and not a.track_flips and a.routing_replay != "r2" and a.kl_beta == 0
            and not (loss.needs_router_shift or a.router_shift) and tc.routing_noise == 0)


@dataclass
class StepContext:
    """What the per-step functions need, built once by the trainer, and what it derives from the config once: the
    loss object, the micro-batching of each pass, the update's path from hidden states to the loss."""

    policy: MoEPolicy
    optim: Optimizer | None  # None for a context that only runs the old-log-prob pass
    cfg: Config
    replay: RoutingReplayCache
    tracker: ExpertFlipTracker | None
    groups: object | None = None  # megatron's ProcessGroupCollection (its .dp averages gradients); None: one rank
    reference: MoEPolicy | None = None  # frozen pi_ref for the KL penalty (algorithm.kl_beta > 0)
    loss: PolicyLoss = field(init=False)
    correction: RolloutCorrection = field(init=False)  # rollout correction, and where pi_old comes from
    router_shift: bool = field(init=False)  # importance ratios get the router-shift weight
    update_batches: object = field(init=False)
    logprob_batches: object = field(init=False)
    fused: bool = field(init=False)  # train.loss_impl == "fused": hidden states -> loss in one kernel
    forward_is_pi_old: bool = field(init=False)  # the step's one update forward gives pi_old (no pass needed)
    _noise_at: tuple[int, int] = field(init=False, default=(-1, 0))  # (optimizer step, forwards noised in it)

    def __post_init__(self):
        tc, a = self.cfg.train, self.cfg.algorithm
        self.loss = a.policy_loss()
        self.correction = a.rollout_correction(self.loss)
        self.router_shift = self.loss.needs_router_shift or a.router_shift
        self.update_batches = micro_batches(tc, self.trainer_group)
        self.logprob_batches = micro_batches(tc, self.trainer_group, logprob_pass=True)
        self.fused = tc.loss_impl == "fused"
        self.forward_is_pi_old = forward_gives_pi_old(self.cfg)

    def routing_noise(self) -> RoutingNoise | None:
        """The routing noise of the next pi_theta forward (train.routing_noise), or None when off. Its draws come
        from a generator seeded by (train.seed, global rank, optimizer step, forward within the step), so a run and
        its resume from a checkpoint draw alike."""
        q = self.cfg.train.routing_noise
        if q == 0:
            return None
        step = self.optim.adam_step if self.optim is not None else 0
        n = self._noise_at[1] + 1 if self._noise_at[0] == step else 1
        self._noise_at = (step, n)
        rank = dist.get_rank() if dist.is_initialized() else 0
        key = hashlib.sha256(f"{self.cfg.train.seed},{rank},{step},{n}".encode()).digest()
        g = torch.Generator(device=self.policy.device)
        g.manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
        return RoutingNoise(q, g)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None if self.groups is None else self.groups.dp

    @property
    def trainer_group(self) -> dist.ProcessGroup | None:
        """Every rank that trains (moe_gspo.parallel.state.trainer_group); None for one process."""
        return trainer_group(self.groups)

    @property
    def dp(self) -> int:
        return 1 if self.groups is None else dist.get_world_size(self.groups.dp)


def routing_mask(response_mask_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: positions whose routing produced a response token (position j predicts token j + 1)."""
    return torch.nn.functional.pad(response_mask_BT[:, 1:], (0, 1), value=False)


def _lengths(attention_mask_BT: torch.Tensor) -> list[int]:
    return attention_mask_BT.sum(-1).tolist()


@torch.no_grad()
def record_engine_routing(ctx: StepContext, pb: PaddedRollout) -> None:
    """R3: the engine's routing of every position whose routing shapes a response log-prob (rows 0 .. P+R-2) goes
    into the replay cache, the one source both passes replay from; a no-op in the other replay modes."""
    if ctx.replay.mode != "r3":
        return
    lengths = _lengths(pb.attention_mask)
    ctx.replay.record_rollouts(pb.sample_ids, [pb.routing[b, :n - 1] for b, n in enumerate(lengths)])


@torch.no_grad()  # pi_old and pi_ref are constants of the loss: no graph, no saved activations
def old_logprob_pass(ctx: StepContext, pb: PaddedRollout) -> OldPass:
    """pi_old log-probs (B, T) of the local rollout batch (with pi_ref's under a KL term, and the old router
    scores under the router shift), in the micro-batches of ctx.logprob_batches.

    Records what R2 and the flip tracker need, and has the tracker compare the engine's routing (when the rollout
    carries it) with the old policy's. Under R3 the engine's routing is replayed in this pass too (as in
    arXiv:2510.11370), from the replay cache. The reference policy routes live (its own router): it is a different
    model, not a replay target."""
    cfg, policy, sample_ids = ctx.cfg, ctx.policy, pb.sample_ids
    B, T = pb.input_ids.shape
    lengths = _lengths(pb.attention_mask)
    old_logp = torch.zeros(B, T, device=pb.input_ids.device)
    ref_logp = torch.zeros_like(old_logp) if ctx.reference is not None else None
    live = []
    router = None
    if ctx.router_shift:
        router = OldRouterScores(B, T, cfg.model.num_experts, SCORE_DTYPES[cfg.algorithm.router_score_dtype])
    for mb in ctx.logprob_batches.plan(lengths):
        sl = mb.rows
        replay = None
        if ctx.replay.mode == "r3":
            replay = ctx.replay.replay_source(sample_ids[sl], seq_len=T, device=pb.input_ids.device)
        cap = RoutingCapture(replay=replay, scores=ctx.router_shift)
        old_logp[sl] = batch_logprobs(policy, pb.input_ids[sl], cap, cfg.train.logprob_impl, cfg.rollout.temperature,
                                      want_entropy=False, lengths=lengths[sl], pack_to=mb.pack_to)[0]
        if ref_logp is not None:
            ref_logp[sl] = batch_logprobs(ctx.reference, pb.input_ids[sl], None, cfg.train.logprob_impl,
                                          cfg.rollout.temperature, want_entropy=False, lengths=lengths[sl],
                                          pack_to=mb.pack_to)[0]
        live.append(cap.live_stacked())  # (b*T, L, k) what the old policy's router chose
        if router is not None:  # the experts pi_old activated (replayed ones under R3) and their router scores
            router.record(sl, cap.stacked(), cap.scores_stacked())
        if ctx.replay.mode == "r2":
            ctx.replay.record_capture(sample_ids[sl], lengths[sl], cap)
    if ctx.tracker is not None:
        mask = routing_mask(pb.response_mask).reshape(-1)
        ctx.tracker.set_reference(sample_ids, torch.cat(live), mask)
        if pb.turn_ids is not None:  # multi-turn episodes: flips and engine mismatch by turn too
            ctx.tracker.set_turns(sample_ids, torch.nn.functional.pad(pb.turn_ids[:, 1:], (0, 1), value=-1))
        policy.mark_bias_reference()  # the expert bias this reference routing was chosen with
        if pb.routing is not None:
            ctx.tracker.observe_rollout(sample_ids, pb.routing.reshape(-1, *pb.routing.shape[2:]), mask)
    return OldPass(old_logp, ref_logp, router)


def needs_old_pass(ctx: StepContext) -> bool:
    """Whether the step runs the old-log-prob pass: for pi_old (decoupled mode), or in bypass mode for what else
    it records (R2's routing, the flip tracker's reference, pi_ref, the old router scores)."""
    return (not ctx.correction.bypass or ctx.tracker is not None or ctx.replay.mode == "r2"
            or ctx.reference is not None or ctx.router_shift)


def pi_old_pass(ctx: StepContext, pb: PaddedRollout) -> tuple[OldPass, dict[str, float]]:
    """(OldPass with the pi_old the correction names, engine-vs-training log-prob metrics): the old-log-prob pass,
    whose pi_old the engine's log-probs replace in bypass mode, where the pass is skipped when nothing else needs
    it (no metrics then). Skipped too where the update's forward computes pi_old itself (OldPass(None))."""
    if not needs_old_pass(ctx):
        return OldPass(pb.engine_logprobs), {}
    if ctx.forward_is_pi_old:  # update_minibatch reports the engine-vs-training metrics from its forward
        return OldPass(None), {}
    old = old_logprob_pass(ctx, pb)
    diff = rollout_probs_diff(pb.engine_logprobs, old.old_logp, pb.response_mask)
    return dataclasses.replace(old, old_logp=ctx.correction.pi_old(old.old_logp, pb.engine_logprobs)), diff


def global_count(mask_BT: torch.Tensor, mode: str, ctx: StepContext) -> torch.Tensor:
    """loss_denominator summed over data-parallel ranks, divided by dp (DDP averages gradients)."""
    d = loss_denominator(mask_BT, mode).double().to(comm_device(ctx.dp_group))
    if ctx.dp > 1:
        dist.all_reduce(d, group=ctx.dp_group)
    return d / ctx.dp


@dataclass
class LossRows:
    """The loss's inputs for rows of a minibatch, token-aligned (b, T), in the minibatch's row order."""

    old_logp: torch.Tensor | None  # pi_old; None: the log-probs the loss is given, detached
    advantages: torch.Tensor  # (b,)
    mask: torch.Tensor  # bool: response tokens the loss keeps (rejected ones already out in decoupled mode)
    ref_logp: torch.Tensor | None = None  # pi_ref (KL term)
    engine_logp: torch.Tensor | None = None  # the engine's log-probs, for the rejection of bypass mode
    rollout_is_weight: torch.Tensor | None = None  # rollout-correction weight (decoupled mode)
    router_shift_weight: torch.Tensor | None = None  # per token, from a forward's router scores

    def rows(self, sl: slice) -> LossRows:
        """Views of rows `sl` (no copy: dataclasses.astuple would deep-copy every tensor)."""
        return LossRows(*(None if (x := getattr(self, f.name)) is None else x[sl] for f in dataclasses.fields(self)))


def minibatch_rows(ctx: StepContext, pb: PaddedRollout, old: OldPass, adv_B, idx, T: int) -> tuple[LossRows, dict]:
    """(LossRows of the responses idx trimmed to T columns, the decoupled rollout correction's metrics): the
    correction is computed here, once for the minibatch, unless it compares with the current policy (bypass)."""
    corr = ctx.correction
    mask = pb.response_mask[idx][:, :T]
    ref = old.ref_logp[idx][:, :T] if ctx.loss.beta > 0 and old.ref_logp is not None else None
    if ctx.loss.beta > 0 and ref is None:
        raise RuntimeError("algorithm.kl_beta > 0 but the step has no reference log-probs")
    rows = LossRows(None if old.old_logp is None else old.old_logp[idx][:, :T], adv_B[idx], mask, ref)
    if not corr.active:
        return rows, {}
    engine = pb.engine_logprobs[idx][:, :T]
    if corr.per_loss_call:
        return dataclasses.replace(rows, engine_logp=engine), {}
    c = corr(rows.old_logp, engine, mask)
    return dataclasses.replace(rows, mask=c.mask, rollout_is_weight=c.weight), c.metrics


def rows_loss(ctx: StepContext, rows: LossRows, logp_bT: torch.Tensor, denom, check_finite: bool = True,
              entropy_bT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of the configured loss on rows with log-probs logp_bT; in bypass mode the rejection
    compares the current (detached) log-probs with the engine's first. With the global denominator the parts of
    any split of the rows add up to the loss of the whole. check_finite=False skips the loss's finiteness check
    of its inputs (a host sync): the micro-batches skip it, and the minibatch's metrics check all its rows once,
    before the optimizer step. entropy_bT (b, T), with algorithm.entropy_coeff: the entropy bonus is subtracted,
    aggregated over the loss's own mask, mode and denominator (verl's agg_loss of the entropy)."""
    corr_m = {}
    mask = rows.mask
    if rows.engine_logp is not None:
        c = ctx.correction(logp_bT, rows.engine_logp, mask)
        mask, corr_m = c.mask, c.metrics
    old_logp = logp_bT.detach() if rows.old_logp is None else rows.old_logp
    loss, m = ctx.loss(logp_bT, old_logp, rows.advantages, mask, loss_denominator=denom, ref_logp=rows.ref_logp,
                       router_shift_weight=rows.router_shift_weight, rollout_is_weight=rows.rollout_is_weight,
                       check_finite=check_finite)
    coeff = ctx.cfg.algorithm.entropy_coeff
    if coeff and entropy_bT is not None:
        loss = loss - coeff * agg_loss(entropy_bT, mask, ctx.loss.loss_agg_mode, denom)
    return loss, {**m, **corr_m}


def _rows_part(ctx: StepContext, rows: LossRows, denom, logp_bT, entropy_bT, b0: int, b1: int) -> torch.Tensor:
    """The loss part of rows b0..b1-1 (the fused kernel's callback, on as many rows as fit its workspace); entropy_bT
    is None without an entropy bonus."""
    return rows_loss(ctx, rows.rows(slice(b0, b1)), logp_bT, denom, check_finite=False, entropy_bT=entropy_bT)[0]


@dataclass
class MicroOut:
    """What one micro-batch's forward and loss give the minibatch."""

    loss: torch.Tensor  # its share of the minibatch loss, to back-propagate
    logp: torch.Tensor  # (b, T) detached
    entropy: torch.Tensor  # (b, T) detached
    gamma: torch.Tensor | None  # (b, T) router-shift ratio (router shift only)
    capture: RoutingCapture


@dataclass
class MicroInputs:
    """What a forward and its loss read, for a minibatch (plan None) or one micro-batch cut from it: the rows of
    every per-row input, with the minibatch-wide pieces (pi_old's router scores, the loss denominator) beside."""

    ids: torch.Tensor  # (b, T) token ids, trimmed to the minibatch's length
    rows: LossRows  # the loss inputs of these rows
    lengths: list[int]  # each row's tokens
    sample_ids: torch.Tensor  # (b,) the rows' sample ids (the replay cache's and the flip tracker's keys)
    old_rows: torch.Tensor  # (b,) the rows' positions in the local batch (OldRouterScores' index)
    old_router: OldRouterScores | None  # pi_old's router scores (router shift only)
    denom: torch.Tensor  # the minibatch's loss denominator
    plan: MicroBatch | None = None  # for a micro-batch: its rows of the minibatch, and how they are packed

    def cut(self, mb: MicroBatch) -> MicroInputs:
        """The micro-batch `mb` of this minibatch."""
        sl = mb.rows
        return MicroInputs(self.ids[sl], self.rows.rows(sl), self.lengths[sl], self.sample_ids[sl],
                           self.old_rows[sl], self.old_router, self.denom, mb)


def micro_step(ctx: StepContext, m: MicroInputs) -> MicroOut:
    """Forward one micro-batch (replaying its routing when asked), weight its tokens by the router shift, and
    compute its loss share: the fused kernel from hidden states, or log-probs then the loss under autograd."""
    cfg, policy = ctx.cfg, ctx.policy
    ids_bT, rows, lengths, mb, old_router, denom = m.ids, m.rows, m.lengths, m.plan, m.old_router, m.denom
    T = ids_bT.shape[1]
    src = ctx.replay.replay_source(m.sample_ids, seq_len=T, device=ids_bT.device)  # None when off
    old_src = old_router.source(m.old_rows, T, ids_bT.device) if ctx.router_shift else None
    noise = ctx.routing_noise() if src is None else None  # replayed routing is used as it is
    cap = RoutingCapture(replay=src, score_at=old_src, bias_split=ctx.tracker is not None, noise=noise)
    temperature = cfg.rollout.temperature
    with _range("forward"):
        if ctx.fused:
            packed = {} if mb.lengths is None else {"lengths": mb.lengths, "pack_to": mb.pack_to}
            hidden = policy(ids_bT, routing=cap, return_hidden=True, **packed)  # (b, T, H)
        else:
            logp, ent = batch_logprobs(policy, ids_bT, cap, cfg.train.logprob_impl, temperature, lengths=lengths,
                                       pack_to=mb.pack_to)
    gamma = None
    if old_src is not None:  # the shift needs this forward's router scores
        gamma = _router_shift_ratio(old_router, cap, old_src, rows.mask.shape)
        weight = router_shift_weight(gamma, cfg.algorithm.router_shift_floor)
        rows = dataclasses.replace(rows, router_shift_weight=weight)
    with _range("lm_head_and_loss"):
        if ctx.fused:
            loss, logp, ent = hidden_loss(policy, hidden, ids_bT, functools.partial(_rows_part, ctx, rows, denom),
                                          temperature, lengths=lengths,
                                          entropy_in_loss=cfg.algorithm.entropy_coeff != 0)
        else:
            loss = rows_loss(ctx, rows, logp, denom, check_finite=False, entropy_bT=ent)[0]
    if src is not None:
        src.check_complete()
    return MicroOut(loss, logp.detach(), ent.detach(), gamma, cap)


def update_minibatch(ctx: StepContext, pb, old: OldPass, adv_B, idx: torch.Tensor) -> dict[str, float]:
    """One optimizer step on the responses `idx` of the local batch; returns this minibatch's metrics.

    With algorithm.kl_beta > 0, `old.ref_logp` (the reference policy's log-probs) adds kl_beta * KL to the loss.
    train.loss_impl="fused" goes from the policy's hidden states to the loss and the LM head's gradient in one
    kernel (6THV); "eager" computes the log-probs (train.logprob_impl), then the loss under autograd."""
    if ctx.router_shift and old.router is None:
        raise RuntimeError("the router shift needs the old router scores, which old_logprob_pass records")
    ids = pb.input_ids[idx]
    lengths = _lengths(pb.attention_mask[idx])
    # trim the padding the whole minibatch shares, to the same length on every rank (see max_over_ranks)
    T = max_over_ranks(max(lengths), ctx.trainer_group)
    ids, sids = ids[:, :T], pb.sample_ids[idx]
    rows, corr_m = minibatch_rows(ctx, pb, old, adv_B, idx, T)
    response = pb.response_mask[idx][:, :T]
    denom = global_count(rows.mask, ctx.loss.loss_agg_mode, ctx)
    logp = torch.zeros(response.shape, device=response.device)
    ent_sum = torch.zeros((), dtype=torch.float64, device=response.device)
    gamma = torch.ones_like(logp) if ctx.router_shift else None
    moved = None  # with routing noise: (moved slots, all slots) on the response's routing positions
    whole = MicroInputs(ids, rows, lengths, sids, idx, old.router, denom)
    ctx.optim.zero_grad()
    for mb in ctx.update_batches.plan(lengths):
        sl = mb.rows
        out = micro_step(ctx, whole.cut(mb))
        with _range("backward"):
            out.loss.backward()
        if ctx.tracker is not None:
            with _range("flip_tracker"):
                ctx.tracker.observe(sids[sl], out.capture.live_stacked(), routing_mask(response[sl]).reshape(-1),
                                    bias_ref=out.capture.bias_ref_stacked())
        if out.capture.noise is not None:
            counts = moved_slots(out.capture, routing_mask(response[sl]).reshape(-1))
            moved = counts if moved is None else moved + counts
        logp[sl] = out.logp
        ent_sum += torch.where(response[sl], out.entropy, 0).sum().double()
        if gamma is not None:
            gamma[sl] = out.gamma
    # the metrics first: their loss evaluation checks every row's inputs for NaN/inf (the micro-batches skip
    # that host sync), so a non-finite forward raises before the optimizer applies its gradient
    extra = {"entropy": ent_sum / response.sum().clamp(min=1)}
    if moved is not None:  # this rank's share of the slots routing noise moved
        extra["moe/routing_noise_moved"] = moved[0] / moved[1].clamp(min=1)
    out = minibatch_metrics(ctx, rows, logp, gamma, response, denom, corr_m, extra)
    if old.old_logp is None:  # what pi_old_pass reports from its pass, from this forward
        out.update(rollout_probs_diff(pb.engine_logprobs[idx][:, :T], logp, response))
    with _range("optimizer"):
        out["grad_norm"] = ctx.optim.step()  # DP reduction, megatron's clipping, Adam on fp32 main params, LR schedule
    if ctx.tracker is not None:
        ctx.tracker.updated()  # the next minibatch's forwards are one more update away from pi_old
    return out


def _range(name: str):
    """A named range of the update (moe_gspo/update/<name>) in a torch.profiler trace (logging.profile_step)."""
    return torch.profiler.record_function(f"moe_gspo/update/{name}")


def moved_slots(capture: RoutingCapture, mask_N: torch.Tensor) -> torch.Tensor:
    """(moved, total) routed slots of the masked tokens whose expert the router did not choose (routing noise)."""
    used, live = capture.stacked(), capture.live_stacked()  # (N, L, k), each token's experts sorted
    kept = (used[..., :, None] == live[..., None, :]).any(-1)
    mask = mask_N.to(kept.device)[:, None, None].expand_as(kept)
    return torch.stack([(~kept & mask).sum(), mask.sum()]).double()


@torch.no_grad()
def minibatch_metrics(ctx: StepContext, rows: LossRows, logp, gamma, response, denom,
                      corr_m: dict, extra: dict | None = None) -> dict[str, float]:
    """The minibatch's metrics: the loss evaluated once on all its rows' log-probs (pg_loss is this rank's share
    of the global loss, the ratios and fractions are over all its tokens), the router shift's statistics and
    `extra` (one-element tensors), read to the host together."""
    floor = ctx.cfg.algorithm.router_shift_floor
    if gamma is not None:
        rows = dataclasses.replace(rows, router_shift_weight=router_shift_weight(gamma, floor))
    m = {**rows_loss(ctx, rows, logp, denom)[1], **corr_m}
    if gamma is not None:  # over this minibatch's response tokens (the loop averages minibatches, then ranks)
        m.update(router_shift_metrics(gamma[response], floor))
    return host_floats({**m, **(extra or {})})


def _router_shift_ratio(old_router: OldRouterScores, cap: RoutingCapture, old_src, shape_BT) -> torch.Tensor:
    """(b, T) router-shift ratio gamma per token, aligned with the log-probs: token j's is that of the routing at
    position j - 1, which produced it (column 0, a prompt token, gets 1)."""
    cur = old_router.round(cap.scores_stacked())  # (b*T, L, k) rounded like the stored old scores
    gamma = router_shift_ratio(cur, old_src.scores).view(shape_BT)  # by routing position
    return torch.nn.functional.pad(gamma[:, :-1], (1, 0), value=1.0)


def cold_start(policy, ddp, tc, task, tok, dp: int, dp_rank: int, log=None, prompt_ids=None,
               tools: list[dict] | None = None) -> list[float]:
    """Supervised fine-tuning on demonstrations (train.cold_start_steps batches of train.cold_start_batch_size,
    split over data-parallel ranks) with its own megatron optimizer at the constant train.cold_start_lr. Prompts
    are encoded by `prompt_ids(example)` (the rollout's chat template) when given; `tools`: the schemas of
    rollout.tools, which the template renders in multi-message demonstrations."""
    import random

    from moe_gspo.tasks.sft import demonstration_batch, sft_loss
    from moe_gspo.train.data import hash_seed

    steps, batch_size = tc.cold_start_steps, tc.cold_start_batch_size
    opt = Optimizer.from_config(ddp, policy, tc, total_steps=steps, lr=tc.cold_start_lr)
    rng = random.Random(hash_seed(tc.seed, 7919, dp_rank))
    per_rank = max(1, batch_size // dp)
    losses = []
    for s in range(steps):
        ids, m = demonstration_batch([task.sample(rng, "train") for _ in range(per_rank)], tok,
                                     context=policy.model_config.max_position_embeddings,  # checked before the forward
                                     prompt_ids=prompt_ids, tools=tools)
        opt.zero_grad()
        loss = sft_loss(policy, ids, m)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if log is not None:
            log(s, losses[-1])
    opt.zero_grad()
    return losses
