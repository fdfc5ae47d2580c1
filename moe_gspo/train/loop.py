"""The RL loop: rollout -> reward -> advantage -> old log-probs -> one optimizer step per minibatch.

    moe-gspo train --config configs/train_tiny_cpu.yaml [a.b=v ...] [--resume]
    torchrun --nproc-per-node 2 -m moe_gspo.cli train --config configs/train_tiny_cpu.yaml parallel.ep=2
    from moe_gspo.train.loop import train; last_metrics = train(cfg)

Under torchrun each data-parallel rank samples its own prompts (groups never straddle ranks); the TP and EP ranks
of one DP replica see the same data. Writes RUN_DIR/metrics.jsonl, RUN_DIR/tensorboard/, RUN_DIR/checkpoints/.
The pieces live in moe_gspo/train/; the figures a step logs are listed in docs/guide/training.md.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from moe_gspo.config import Config, ConfigError, to_dict
from moe_gspo.losses import get_advantage_estimator
from moe_gspo.model.policy import MoEPolicy
from moe_gspo.parallel.state import ParallelInfo, max_over_ranks, trainer_group
from moe_gspo.rollout import engine_from_config
from moe_gspo.rollout.agent import episode_metrics, reward_examples
from moe_gspo.rollout.placement import EnginePlacement
from moe_gspo.train.rollouts import ColocatedRollouts, Rollouts
from moe_gspo.rewards import RewardFunctionError, score_responses
from moe_gspo.rewards.text import overlong_penalty
from moe_gspo.routing import ExpertFlipTracker, RoutingReplayCache
from moe_gspo.tasks import CharTokenizer, Task, task_from_config
from moe_gspo.checkpoint import disk_space
from moe_gspo.train import data
from moe_gspo.checkpoint.store import TMP, Checkpoints
from moe_gspo.train.dynamic_sampling import Scored, fill_groups
from moe_gspo.train.evaluate import check_eval_set, evaluate
from moe_gspo.train.metrics import (MetricMean, MetricsWriter, Progress, StepTimer, WandbRun, reduce_across_ranks,
                                    step_profile)
from moe_gspo.checkpoint.run_lock import RunLock
from moe_gspo.train.step import (OldPass, StepContext, cold_start, pi_old_pass, record_engine_routing,
                                 update_minibatch)


def train(cfg: Config, *, resume: bool = False, overwrite: bool = False, run_dir: str | Path | None = None,
          task=None, engine=None, init_state: dict | None = None, label: str | None = None,
          roles=None) -> dict[str, float]:
    """Run the RL loop for cfg.train.steps steps; last metrics.

    A run directory that holds a previous run (metrics or checkpoints) is continued with resume=True (from its
    newest complete checkpoint), replaced with overwrite=True, and otherwise refused. With
    rollout.placement=separate this runs on the trainer's side of a job already split (`roles`, from
    moe_gspo.rollout.bridge.split_job; the CLI splits it and sends the engine ranks to
    moe_gspo.train.separate.serve)."""
    # names and the engine's declared capabilities, before anything is built (colocated engines spread over the
    # whole world)
    data.check_names(cfg, data.world_size() if cfg.rollout.placement == "colocated" else None)
    if cfg.rollout.placement == "separate":
        if roles is None or roles.is_engine:
            raise ConfigError("rollout.placement=separate trains on the trainer's ranks of a job split into trainer "
                              "and engine ranks: launch `moe-gspo train` with torchrun or scripts/launch.sh")
        if engine is not None:
            raise ConfigError("rollout.placement=separate builds its engines on their own ranks from the trainer's "
                              "weights: it takes no engine from the caller")
    run_dir = Path(run_dir or cfg.train.out_dir)
    tok, task = preflight(cfg, task, roles)  # what needs nothing built, before the lock writes anything
    _check_run_dir(run_dir, resume, overwrite)
    if resume:
        check_resume_fits(cfg, run_dir)
    with RunLock.held(run_dir, active=data.world_rank() == 0):  # one run per directory
        try:
            run = Run.setup(cfg, run_dir=run_dir, task=task, engine=engine, init_state=init_state, resume=resume,
                            label=label, overwrite=overwrite, roles=roles, tok=tok)
            m: dict[str, float] = {}
            if cfg.train.eval_before and run.start == 0:
                run.evaluate_before()
            for step in range(run.start, cfg.train.steps):
                m = rl_step(run, step)
            run.close()
        except Exception as e:
            ckpts = Checkpoints(run_dir / "checkpoints", cfg.train.keep_checkpoints)
            disk_space.reraise_out_of_space(e, run_dir, ckpts)  # a full disk: one line
            raise
    _say(run.info, f"run directory: {run.dir} (metrics.jsonl, checkpoints/, tensorboard/)")
    return m


def preflight(cfg: Config, task, roles) -> tuple:
    """(tokenizer, task) after every check that needs nothing built beyond the names train() checked: sizes, the
    batch layout, the prompts' chat template, W&B; raises the first UserError."""
    from moe_gspo.parallel.state import validate_sizes

    tok = data.build_tokenizer(cfg)
    WandbRun.check(cfg.logging.wandb_project)
    validate_sizes(cfg.parallel, data.world_size(), cfg.model.num_experts, cfg.model.num_key_value_heads,
                   None if cfg.model.init_from else cfg.model.vocab_size)
    data.check_layout(cfg, data.world_size() // cfg.parallel.tp)
    task = task or task_from_config(cfg.rollout)
    data.check_prompts(cfg, task, tok)
    return tok, task


def rl_step(run: Run, step: int) -> dict[str, float]:
    """One RL step of the run (0-based `step`): rollout, rewards, old log-probs, the minibatch updates, the weight
    sync, then evaluation, metrics and the checkpoint when they are due; the step's logged metrics."""
    cfg, t = run.cfg, run.timer
    profiled = cfg.logging.profile_step == step + 1 and run.writer.active  # trainer rank 0
    with step_profile(run.dir, step + 1, profiled), t("step"):
        with t("rollout"):  # separate placement: waiting for the batch the engine ranks sampled
            scored, sampling_m = run.sample(step)  # prompts x G responses (engine log-probs, routing), rewards
            run.rollouts.sleep()  # rollout.engine_sleep: the engine's GPU memory goes to the trainer until the sync
            adv, valid, reward_m = run.score(scored)  # group advantages
            batch = scored.batch
            pb = run.pad(batch, valid)  # (B, T) training tensors on the policy's device
            record_engine_routing(run.ctx, pb)  # R3: the engine's routing into the replay cache
            adv = adv.to(pb.input_ids.device)
        with t("logprob"):
            old, diff = run.old_logprobs(pb)  # pi_old (and pi_ref); R2 records; flip reference
        with t("train"):
            train_m = MetricMean()
            for idx in run.minibatches(step):  # one optimizer step per minibatch
                train_m.add(update_minibatch(run.ctx, pb, old, adv, idx))
        with t("sync"):  # separate placement: the push of the next version, when a later batch needs it
            run.rollouts.publish(run.policy.weights())
            run.replay.clear()
    evals = run.evaluate(step)  # train.eval_every: the updated policy on held-out prompts
    m = run.log(step, {**reward_m, **sampling_m, **train_m.result(), **diff, **run.flip_metrics(),
                       **run.engine_metrics()},
                tokens=int(pb.attention_mask.sum()), extra=evals)
    if profiled:
        _say(run.info, f"profile of step {step + 1} (its times include the profiler's overhead): "
                       f"{run.dir / f'profile_step_{step + 1}.txt'}, .json.gz (Chrome trace)")
    last = step + 1 == cfg.train.steps
    if cfg.train.checkpoint_every and ((step + 1) % cfg.train.checkpoint_every == 0 or last):
        run.ckpts.save(step + 1, run.ctx, run.extra_state(step + 1))
    return m


@dataclass
class Run:
    """Everything the loop holds: policy, DDP, optimizer, engine, task, routing objects, logging, checkpoints."""

    cfg: Config
    dir: Path
    policy: MoEPolicy
    ctx: StepContext
    rollouts: Rollouts  # the engines, wherever they run
    task: Task
    tok: CharTokenizer | data.HFTokenizer  # the checkpoint's own tokenizer when it has one
    replay: RoutingReplayCache
    tracker: ExpertFlipTracker | None
    layout: data.Layout
    info: ParallelInfo
    writer: MetricsWriter
    progress: Progress
    ckpts: Checkpoints
    timer: StepTimer
    start: int = 0
    held_out: list = dataclasses.field(default_factory=list)  # train.eval_every's prompts
    rollout_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # how the last batch was made

    @classmethod
    def setup(cls, cfg, *, run_dir, task, engine, init_state, resume, label, overwrite=False, roles=None,
              tok) -> Run:
        """Build the run in `run_dir` (train() has checked and locked it) from `tok` and `task` as preflight
        returns them."""
        from moe_gspo.model.load import init_parallel, load_policy
        from moe_gspo.parallel.state import parallel_info
        from moe_gspo.train.optim import Optimizer, wrap_ddp

        run_dir = Path(run_dir)
        groups = init_parallel(cfg)  # megatron's ProcessGroupCollection, handed to everything below
        policy = load_policy(cfg, groups)
        policy.set_bias_update_rate(cfg.train.router_bias_update_rate)
        info = parallel_info(groups)
        layout = data.check_layout(cfg, info.dp)
        if init_state is not None:
            policy.load_full_megatron_state(init_state)
        ddp = wrap_ddp(policy, cfg.train.distributed_optimizer)
        mc = cfg.model
        replay = RoutingReplayCache(cfg.algorithm.routing_replay, mc.num_moe_layers, mc.num_experts_per_tok,
                                    mc.num_experts)
        tracker = ExpertFlipTracker(mc.num_moe_layers, mc.num_experts) if cfg.algorithm.track_flips else None
        if info.rank == 0:
            if overwrite and not resume:
                for old in ("checkpoints", "tensorboard", "metrics.jsonl"):
                    p = run_dir / old
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            run_dir.mkdir(parents=True, exist_ok=True)
        ckpts = Checkpoints(run_dir / "checkpoints", cfg.train.keep_checkpoints, group=trainer_group(policy.groups))
        start = ckpts.latest() if resume else 0
        if info.rank == 0 and not start:  # a resumed run records its config once its checkpoint has loaded
            _write_config(run_dir, cfg)
        if start and info.rank == 0:
            disk_space.check_room_to_resume(ckpts, TMP)
        _say(info, f"run directory: {run_dir}")
        if cfg.algorithm.track_flips and cfg.train.minibatches == 1:
            _say(info, "algorithm.track_flips with train.minibatches=1: each step's one update comes after its routing "
                       "is observed, so moe/flip_rate is 0 by construction (2 or more minibatches measure the flips "
                       "of each update); without the tracker the step can skip its old-log-prob pass "
                       "(train.old_logprob_pass)")
        if cfg.checkpoint_overrides:
            _say(info, f"model.init_from={cfg.model.init_from} defines the architecture; it replaces the config's "
                       f"{', '.join(cfg.checkpoint_overrides)}")
        if not start:
            if resume:
                _say(info, f"no complete checkpoint in {ckpts.root}: starting from step 0")
            steps, why_not = data.cold_start_plan(cfg, task, init_state is not None)
            if why_not:
                _say(info, why_not)
            if steps:
                _say(info, f"cold start: {steps} supervised steps on {cfg.rollout.task}")
                cold_start(policy, ddp, cfg.train, task, tok, info.dp, info.dp_rank,
                           log=data.ColdStartLog(steps) if info.rank == 0 and cfg.logging.progress else None,
                           prompt_ids=data.PromptIds(cfg, tok), tools=data.template_kwargs(cfg.rollout).get("tools"))
        # pi_ref: the weights RL starts from (restored below on resume)
        reference = policy.frozen_copy() if cfg.algorithm.kl_beta > 0 else None
        optim = Optimizer.from_config(ddp, policy, cfg.train, total_steps=cfg.train.steps * cfg.train.minibatches)
        ctx = StepContext(policy, optim, cfg, replay, tracker, groups, reference)
        if start:
            start, _ = ckpts.load_newest(start, ctx)  # one refused for unsafe content falls back to the one before
            _say(info, f"resumed from {ckpts.root / ckpts.name(start)}")
            if info.rank == 0:
                _write_config(run_dir, cfg)
        if roles is not None:  # the engines live on their own ranks: build them from this version
            from moe_gspo.train.separate import RemoteRollouts

            rollouts = RemoteRollouts(roles, cfg, info.dp_rank, info.dp, start, policy.weights())
            rollouts.begin(policy.weights())
        else:
            if engine is None:
                engine = engine_from_config(cfg.rollout, policy.weights(), tokenizer=tok)  # holds these weights
            else:
                engine.update_weights(policy.weights())
            rollouts = ColocatedRollouts(engine, EnginePlacement.build(cfg.rollout.engine_tp, info.dp_rank, groups.tp),
                                         cfg.rollout.engine_tp, info.dp_rank)
        logc = cfg.logging
        writer = MetricsWriter.for_run(run_dir, logc, to_dict(cfg), active=info.rank == 0, resume=start > 0)
        writer.truncate_after(start)  # a fresh run (start 0) replaces old metrics; a resumed one rewrites after start
        progress = Progress(cfg.train.steps, start, label or run_dir.name, logc.progress and info.rank == 0)
        held_out = []
        if cfg.train.eval_every:  # the same held-out prompts at every evaluation
            held_out = task.eval_examples(cfg.rollout.eval_prompts)
            check_eval_set(held_out, layout.dp, "rollout.eval_prompts")
        return cls(cfg, run_dir, policy, ctx, rollouts, task, tok, replay, tracker, layout, info, writer, progress,
                   ckpts, StepTimer(), start, held_out)

    # ---------------------------------------------------------------- the steps of the loop
    def rollout(self, step: int, refill: int = 0) -> Scored:
        """The step's responses and their rewards (refill r > 0: dynamic sampling's r-th extra round); a bad
        reward raises or is dropped per rollout.bad_reward."""
        cfg = self.cfg
        rc = cfg.rollout
        examples, *own = data.step_prompts(cfg, self.task, self.tok, self.layout, step, self.info.dp_rank, refill)
        prompts_of = (lambda d: tuple(own) if d == self.info.dp_rank else
                      data.step_prompts(cfg, self.task, self.tok, self.layout, step, d, refill)[1:])
        if refill:
            batch = self.rollouts.generate(prompts_of, rc.group_size)
        else:
            batch, self.rollout_metrics = self.rollouts.batch(step, prompts_of, rc.group_size)
        # sample ids from the step, not the engine's counter, so that a resumed run names samples identically
        batch = _numbered(batch, step)
        data.check_responses(batch, step)
        per_response = reward_examples([examples[i // rc.group_size] for i in range(len(batch))], batch, self.tok)
        texts = [self.tok.decode(r.tolist()) for r in batch.response_ids]
        try:
            res = score_responses(self.task.reward_fn, texts, per_response, warn=False)
        except RewardFunctionError as e:
            raise RewardFunctionError(f"step {step + 1}: {e}", detail=e.detail) from None
        seen = (lambda i: self.tok.decode(batch.prompt_ids[i].tolist(), skip_special=False))
        valid = data.handle_bad_rewards(res.rewards, res.errors, seen, texts, rc.bad_reward, step)
        penalty = overlong_penalty(batch.response_lengths.float(), rc.max_new_tokens, rc.overlong_buffer,
                                   rc.overlong_penalty)
        return Scored(batch, per_response, texts, res, valid, penalty.to(res.rewards.dtype))

    def sample(self, step: int) -> tuple[Scored, dict[str, float]]:
        """The batch the step trains on: the rollout, or with rollout.dynamic_sampling its groups with reward
        variance, refilled from extra rounds (moe_gspo.train.dynamic_sampling)."""
        rc = self.cfg.rollout
        scored = self.rollout(step)
        if not rc.dynamic_sampling:
            return scored, {}
        scored, m = fill_groups(scored, lambda r: self.rollout(step, r), self.layout.prompts_local, rc.group_size,
                                rc.dynamic_sampling_max_rounds, self.ctx.trainer_group)
        return dataclasses.replace(scored, batch=_numbered(scored.batch, step)), m

    def score(self, s: Scored) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(advantages (N,), valid (N,) bool, reward metrics) of a scored batch."""
        batch, res, valid, r = s.batch, s.rewards, s.valid, s.shaped
        rc = self.cfg.rollout
        adv = torch.zeros_like(r)
        if valid.any():
            adv[valid] = get_advantage_estimator(self.cfg.algorithm.advantage)(r[valid], batch.group_ids[valid])
        rv, gid = r[valid], batch.group_ids[valid]
        lengths = batch.response_lengths.float()
        spread = [float(rv[gid == g].std(unbiased=False)) > 0 for g in gid.unique()] if rv.numel() else [False]
        m = {"reward/mean": float(rv.mean()) if rv.numel() else 0.0,
             "reward/std": float(rv.std(unbiased=False)) if rv.numel() else 0.0,
             "accuracy": float((res.rewards[valid] >= 1.0).float().mean()) if rv.numel() else 0.0,  # unpenalized
             "reward/skipped": float((~valid).sum()),
             "groups/with_variance": float(np.mean(spread)),
             "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
             "response/truncated": float(np.mean([f == "length" for f in batch.finish_reasons]))}
        m.update(res.components)  # several reward functions: each one's mean and count of Nones
        m.update(episode_metrics(batch))  # multi-turn episodes: turns, tool calls, tokens by turn
        if rc.overlong_buffer:
            m["reward/overlong_penalty"] = float(s.penalty[valid].mean()) if valid.any() else 0.0
        return adv, valid, m

    def pad(self, batch, valid):
        """The batch as training tensors (PaddedRollout) on the policy's device, skipped samples masked out."""
        longest = max(p.numel() + r.numel() for p, r in zip(batch.prompt_ids, batch.response_ids))
        pb = batch.to_padded(pad_id=self.tok.pad_id,  # one T on every trainer rank
                             max_len=max_over_ranks(longest, self.ctx.trainer_group))
        pb.response_mask &= valid[:, None]  # skipped samples carry no loss
        if self.cfg.rollout.mask_truncated:  # cut-off responses carry no loss either (their advantages stand)
            cut = torch.tensor([f == "length" for f in batch.finish_reasons], device=pb.response_mask.device)
            pb.response_mask &= ~cut[:, None]
        return pb.to(self.policy.device)

    def old_logprobs(self, pb) -> tuple[OldPass, dict[str, float]]:
        """(OldPass with pi_old as the rollout correction names it, engine-vs-training log-prob metrics):
        moe_gspo.train.step.pi_old_pass."""
        return pi_old_pass(self.ctx, pb)

    def evaluate(self, step: int) -> dict[str, float]:
        """The eval/ metrics after this step's update when train.eval_every says so (and after the last step)."""
        every = self.cfg.train.eval_every
        if not every or ((step + 1) % every and step + 1 != self.cfg.train.steps):
            return {}
        return evaluate(self.cfg, self.task, self.tok, self.rollouts, self.held_out, self.info.dp_rank,
                        self.layout.dp, self.ctx.trainer_group, step)

    def evaluate_before(self) -> dict[str, float]:
        """train.eval_before: the starting policy's eval/ figures as metrics.jsonl's row of step 0."""
        m = evaluate(self.cfg, self.task, self.tok, self.rollouts, self.held_out, self.info.dp_rank,
                     self.layout.dp, self.ctx.trainer_group, -1)
        self.writer.write(0, m)
        _say(self.info, f"before training: eval/accuracy {m['eval/accuracy']:.4f} on {int(m['eval/prompts'])} "
                        "held-out prompts")
        return m

    def minibatches(self, step: int) -> list[torch.Tensor]:
        """The local responses shuffled (seeded by step) and cut into train.minibatches equal parts."""
        g = torch.Generator().manual_seed(data.hash_seed(self.cfg.train.seed, step, self.info.dp_rank, 2))
        perm = torch.randperm(self.layout.responses_local, generator=g)
        return list(perm.split(self.layout.minibatch_local))

    def engine_metrics(self) -> dict[str, float]:
        """The engines' figures (Rollouts.metrics) and how the step's batch was made (Rollouts.batch)."""
        return {**self.rollouts.metrics(), **self.rollout_metrics}

    def flip_metrics(self) -> dict[str, float]:
        if self.tracker is None:
            return {}
        m = self.tracker.metrics()
        self.tracker.clear()
        return m

    def log(self, step: int, m: dict[str, float], tokens: int, extra: dict[str, float] | None = None
            ) -> dict[str, float]:
        """Reduce the step's metrics over ranks and write them; `extra` holds figures already the same on every rank."""
        times = self.timer.pop()
        router_lr = self.ctx.optim.router_lr  # None unless train.router_lr_scale != 1
        m = {**m, "lr": self.ctx.optim.lr, **({"router_lr": router_lr} if router_lr is not None else {}), **times}
        m = {**reduce_across_ranks(m, self.ctx.trainer_group), **(extra or {})}
        tokens_all = tokens * self.layout.dp
        m["perf/tokens_per_s"] = tokens_all / max(m["time/step"], 1e-9)
        if (step + 1) % self.cfg.logging.every == 0 or step + 1 == self.cfg.train.steps:
            self.writer.write(step + 1, m)
        self.progress.update(m)
        return m

    def extra_state(self, step: int) -> dict:
        """What a checkpoint holds beside the sharded weights and optimizer state (JSON-able, no code)."""
        return {"step": step, "data_position": step,
                # the replay cache is filled and emptied inside a step: at a step boundary it needs only its mode
                "replay": {"mode": self.replay.mode, "samples": len(self.replay)},
                "config": to_dict(self.cfg), "time": time.time()}

    def close(self) -> None:
        from moe_gspo.train.optim import release_ddp

        self.progress.close()
        self.writer.close()
        release_ddp(self.ctx.optim.ddp)
        self.rollouts.close()


def _numbered(batch, step: int):
    """The batch with sample ids step * N, ..., step * N + N - 1."""
    n = len(batch)
    return dataclasses.replace(batch, sample_ids=torch.arange(step * n, (step + 1) * n))


def _write_config(run_dir: Path, cfg: Config) -> None:
    """RUN_DIR/config.yaml, written whole or not at all (a temporary file renamed over it)."""
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tmp.replace(run_dir / "config.yaml")


def _check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to start a fresh run over a previous one unless told to continue it or to replace it, and a run
    directory this process cannot write."""
    held = [n for n in ("metrics.jsonl", "checkpoints") if (run_dir / n).exists()]
    if held and not (resume or overwrite):
        raise ConfigError(f"run directory {run_dir} holds a previous run ({', '.join(held)}): pass --resume to "
                          f"continue it or --overwrite to replace it (or choose another --out / train.out_dir)")
    writable_dir(run_dir, "run directory")


def check_resume_fits(cfg: Config, run_dir: Path) -> None:
    """Refuse a resume whose model differs from the one the run's checkpoints hold, before anything in the run
    directory changes: the run's config.yaml against `cfg`, field by field over the architecture (and the
    parameters' dtype), naming each difference. A run without config.yaml or checkpoints has nothing to fit."""
    from moe_gspo.config.model import ARCHITECTURE

    recorded = run_dir / "config.yaml"
    if not recorded.is_file() or not Checkpoints(run_dir / "checkpoints").latest():
        return
    try:
        before = (yaml.safe_load(recorded.read_text()) or {}).get("model") or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{recorded}: invalid YAML ({str(e).splitlines()[0]}); the run's record of its config "
                          "is damaged") from None
    now = to_dict(cfg)["model"]
    keys = [k for k in (*ARCHITECTURE, "params_dtype") if k in before and before[k] != now.get(k)]
    if keys:
        diffs = ", ".join(f"model.{k}={before[k]!r} in the run, {now.get(k)!r} now" for k in keys[:6])
        hint = (f"; the run was trained from model.init_from={before['init_from']}"
                if before.get("init_from") and before.get("init_from") != now.get("init_from") else "")
        raise ConfigError(f"--resume: {run_dir}'s checkpoints hold another model than this config: {diffs}"
                          f"{', ...' if len(keys) > 6 else ''}{hint} (resume with --config {recorded}, or the "
                          "same overrides as the run); nothing in the run directory was changed")


def writable_dir(path: Path, what: str) -> None:
    """Raise ConfigError, in one line naming the directory, when this process could not create `path` or write
    in it (a read-only directory, a regular file where a directory belongs): before anything is built rather than
    at the first file a run writes. It writes and removes a file in the deepest directory of `path` that exists,
    and creates nothing, so that a run refused later for another reason leaves no directory behind. `what` names
    the directory in the message ("run directory")."""
    import tempfile

    path = existing = Path(path)
    try:
        while not existing.exists() and existing != existing.parent:  # up to the working directory or /
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(f"{what} {path} cannot be created: {existing} is not a directory")
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".moe_gspo_write_test_"):  # a name of its own per rank
            pass
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be written: {existing}: {e.strerror or e}") from None


def _say(info, msg: str) -> None:
    if info.rank == 0:
        print(msg, file=sys.stderr, flush=True)
