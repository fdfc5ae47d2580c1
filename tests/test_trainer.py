"""The RL loop end to end on a tiny policy (CPU, one process): metrics, determinism, bad inputs, log-prob paths."""

from __future__ import annotations

import json

import pytest
import torch

from moe_gspo.config import ConfigError, UserError, load_config

from helpers import TINY, records, strip_timing, tiny_cfg  # noqa: F401 - shared with other test modules


EXPECTED = ["reward/mean", "reward/std", "accuracy", "response_length/mean", "pg_clipfrac", "pg_clipfrac_lower",
            "ppo_kl", "ratio_mean", "ratio_min", "ratio_max", "entropy", "grad_norm", "lr", "moe/flip_rate",
            "moe/flip_rate/layer_0", "moe/flip_rate/layer_1", "moe/rollout_train_mismatch",
            "rollout_probs_diff_mean", "rollout_probs_diff_max", "perf/tokens_per_s", "time/rollout",
            "time/logprob", "time/train", "time/step"]


def test_train_writes_the_fields_metrics_and_is_deterministic(tmp_path):
    from moe_gspo.train.loop import train

    cfg = tiny_cfg("logging.tensorboard=true", "algorithm.loss=grpo", "algorithm.routing_replay=r2")
    train(cfg, run_dir=tmp_path / "a")
    train(cfg, run_dir=tmp_path / "b")
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [r["step"] for r in a] == [1, 2]
    missing = [k for k in EXPECTED if k not in a[-1]]
    assert not missing, missing
    assert list((tmp_path / "a" / "tensorboard").iterdir())
    assert [strip_timing(r) for r in a] == [strip_timing(r) for r in b]  # same seed -> same run, bit for bit
    assert a[0]["rollout_probs_diff_max"] < 1e-4  # HF engine vs megatron, fp32
    # the overall flip rate is the mean over the MoE layers' rates, each a fraction of routed token-experts
    layers = [a[0][f"moe/flip_rate/layer_{i}"] for i in range(2)]
    assert all(0.0 <= x <= 1.0 for x in layers)
    assert a[0]["moe/flip_rate"] == pytest.approx(sum(layers) / 2, abs=1e-9)


def test_a_finished_run_leaves_no_ddp_or_policy_alive(tmp_path, monkeypatch):
    """Runs one after another in a process (a study worker) must not keep each other's DDP buffers and policy:
    megatron's gradient hooks and token dispatchers form cycles through C++ autograd nodes that gc cannot free."""
    import gc
    import weakref

    from moe_gspo.train import optim
    from moe_gspo.train.loop import train

    made, real = [], optim.wrap_ddp

    def recording(policy, *args, **kwargs):
        ddp = real(policy, *args, **kwargs)
        made.append((weakref.ref(ddp), weakref.ref(policy)))
        return ddp

    monkeypatch.setattr(optim, "wrap_ddp", recording)
    train(tiny_cfg("train.steps=1", "train.cold_start_steps=2"), run_dir=tmp_path)
    gc.collect()
    assert len(made) == 1
    assert [(d() is None, p() is None) for d, p in made] == [(True, True)]

def test_batch_that_does_not_divide_is_a_clear_error(tmp_path):
    from moe_gspo.train.loop import train

    with pytest.raises(ConfigError, match="train.minibatches=3"):
        train(tiny_cfg("train.minibatches=3"), run_dir=tmp_path)


class _NaNTask:
    """Wraps a task; its reward is NaN for every response of the first prompt, and 1 + the task's reward for the
    others (nonzero, so that a skipped sample counted as 0 would move the mean). `given` lists the finite rewards
    it returned."""

    def __init__(self, task):
        self.task, self.first, self.given = task, None, []

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward_fn(self, response, ex):
        if self.first is None:
            self.first = ex.prompt
        if ex.prompt == self.first:
            return float("nan")
        self.given.append(1.0 + self.task.reward_fn(response, ex))
        return self.given[-1]


def test_nan_reward_errors_naming_the_sample_or_is_skipped_and_counted(tmp_path):
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.loop import train

    cfg = tiny_cfg("train.steps=1", "train.cold_start_steps=0")
    with pytest.raises(UserError, match=r"^step 1: non-finite reward for sample 1 of 16 \(prompt as the model saw it "
                                        r"'<bos>.*', response") as info:  # the tokenizer's bos: the ids, as text
        train(cfg, run_dir=tmp_path / "e", task=_NaNTask(task_from_config(cfg.rollout)))
    assert "\n" not in str(info.value)
    cfg = tiny_cfg("train.steps=1", "train.cold_start_steps=0", "rollout.bad_reward=skip")
    task = _NaNTask(task_from_config(cfg.rollout))
    m = train(cfg, run_dir=tmp_path / "s", task=task)
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert m["reward/skipped"] == 1.0 * cfg.rollout.group_size  # NaN for the whole first group, on one rank
    # the reward statistics are over the kept samples only: exactly the rewards the task returned
    assert len(task.given) == n - cfg.rollout.group_size
    given = torch.tensor(task.given, dtype=torch.float64)
    assert m["reward/mean"] == pytest.approx(float(given.mean()), rel=1e-6)
    assert m["reward/std"] == pytest.approx(float(given.std(unbiased=False)), rel=1e-6, abs=1e-7)


class _EmptyingEngine:
    """An engine that returns an empty response for its third sample."""

    def __init__(self, inner):
        self.inner = inner

    def update_weights(self, policy):
        self.inner.update_weights(policy)

    def param_fraction(self):
        return self.inner.param_fraction()

    def sleep(self):
        self.inner.sleep()

    def wake(self):
        self.inner.wake()

    def generate_parts(self, parts, n_per_prompt=1):
        return [self.generate(prompts, n_per_prompt, sp) for prompts, sp in parts]

    def generate(self, prompts, n, sp):
        import dataclasses

        b = self.inner.generate(prompts, n, sp)
        rid, lp = list(b.response_ids), list(b.logprobs)
        rid[2], lp[2] = rid[2][:0], lp[2][:0]
        routed = None if b.routed_experts is None else [*b.routed_experts[:2], b.routed_experts[2][:0],
                                                          *b.routed_experts[3:]]
        return dataclasses.replace(b, response_ids=rid, logprobs=lp, routed_experts=routed)


def test_the_engine_sleeps_from_its_rollout_to_the_weight_sync(tmp_path):
    """The loop puts the engine to sleep after each rollout (rollout.engine_sleep frees a vLLM engine's GPU memory
    for the trainer) and wakes it before the weight sync: every step is generate, sleep, wake, sync, and the
    engine is awake when the run ends."""
    from moe_gspo.rollout.hf_engine import HFEngine
    from moe_gspo.tasks import CharTokenizer
    from moe_gspo.train.loop import train

    class Recording(HFEngine):
        def __init__(self, *a, **kw):
            self.calls, self.asleep = [], False
            super().__init__(*a, **kw)

        def generate(self, *a, **kw):
            assert not self.asleep
            self.calls.append("generate")
            return super().generate(*a, **kw)

        def sleep(self):
            self.calls.append("sleep")
            self.asleep = True

        def wake(self):
            self.calls.append("wake")
            self.asleep = False

        def update_weights(self, weights):
            assert not self.asleep
            self.calls.append("sync")
            super().update_weights(weights)

    eng = Recording(tokenizer=CharTokenizer())
    train(tiny_cfg("train.steps=2", "train.cold_start_steps=0"), run_dir=tmp_path / "a", engine=eng)
    assert eng.calls == ["sync"] + ["generate", "sleep", "wake", "sync"] * 2 and not eng.asleep, eng.calls


def test_profile_step_writes_that_steps_phases_and_operators_and_a_trace(tmp_path):
    import gzip
    import json

    from moe_gspo.train.loop import train

    train(tiny_cfg("train.steps=2", "train.cold_start_steps=0", "logging.profile_step=2"), run_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("profile_step_*")) == ["profile_step_2.json.gz",
                                                                       "profile_step_2.txt"]
    text = (tmp_path / "profile_step_2.txt").read_text()
    ranges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("moe_gspo/")}
    phases = {k: v for k, v in ranges.items() if not k.startswith("moe_gspo/update/")}
    update = {k: v for k, v in ranges.items() if k.startswith("moe_gspo/update/")}
    assert set(phases) == {f"moe_gspo/{p}" for p in ("step", "rollout", "logprob", "train", "sync")}, text
    assert phases["moe_gspo/step"] >= phases["moe_gspo/train"] + phases["moe_gspo/rollout"] > 0
    # the update's own ranges, inside the training phase
    assert set(update) == {f"moe_gspo/update/{p}" for p in ("forward", "lm_head_and_loss", "backward", "optimizer",
                                                              "flip_tracker")}, text
    assert 0 < sum(update.values()) <= phases["moe_gspo/train"]
    assert "aten::mm" in text
    events = json.loads(gzip.decompress((tmp_path / "profile_step_2.json.gz").read_bytes()))["traceEvents"]
    assert {"moe_gspo/train", "moe_gspo/rollout"} <= {e.get("name") for e in events}
    with pytest.raises(ConfigError, match="logging.profile_step=3 must be between 0"):
        tiny_cfg("train.steps=2", "logging.profile_step=3")


def test_empty_response_and_too_long_prompt_are_clear_errors(tmp_path):
    from moe_gspo.rollout.hf_engine import HFEngine
    from moe_gspo.tasks import CharTokenizer
    from moe_gspo.train.loop import train

    cfg = tiny_cfg("train.steps=1", "train.cold_start_steps=0")
    with pytest.raises(ValueError, match=r"step 1: rollout engine returned an empty response for sample 3 of 16 "
                                         r"\(group 1\)"):
        train(cfg, run_dir=tmp_path / "a", engine=_EmptyingEngine(HFEngine(tokenizer=CharTokenizer())))
    cfg = tiny_cfg("train.steps=1", "train.cold_start_steps=0", "model.max_position_embeddings=8")
    with pytest.raises(ValueError, match="exceeds the context model.max_position_embeddings=8"):
        train(cfg, run_dir=tmp_path / "b")


def test_train_cli_reports_config_errors_with_exit_code_2(tmp_path, capsys):
    from moe_gspo.cli import main

    assert main(["train", "--config", "configs/train_tiny_cpu.yaml", "--out", str(tmp_path), "algorithm.loss=ppo"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.loss='ppo': unknown policy loss; valid names:" in err and " gspo," in err and err.count("\n") == 1


def test_config_rejects_bad_trainer_values():
    with pytest.raises(ConfigError, match="rollout.bad_reward"):
        tiny_cfg("rollout.bad_reward=ignore")
    with pytest.raises(ConfigError, match="train.logprob_impl"):
        tiny_cfg("train.logprob_impl=magic")
    with pytest.raises(ConfigError, match="rollout.task_args"):
        from moe_gspo.tasks import task_from_config

        task_from_config(tiny_cfg("rollout.task_args=max_digits").rollout)


def test_fused_logprobs_equal_eager_values_and_gradients():
    from moe_gspo import init_parallel, load_policy
    from moe_gspo.model.routing_capture import RoutingCapture
    from moe_gspo.train.logprob import batch_logprobs

    cfg = tiny_cfg()
    policy = load_policy(cfg, init_parallel(cfg))
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    out = {}
    for impl in ("eager", "fused"):
        policy.zero_grad(set_to_none=True)
        logp, ent = batch_logprobs(policy, ids, RoutingCapture(), impl, temperature=0.7)
        (logp.sum() + 0.1 * ent.sum()).backward()
        out[impl] = (logp.detach(), ent.detach(), [p.grad.clone() for p in policy.parameters()])
    assert out["eager"][0].shape == (3, 9) and bool((out["eager"][0][:, 0] == 0).all())
    torch.testing.assert_close(out["fused"][0], out["eager"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["fused"][1], out["eager"][1], atol=1e-5, rtol=1e-5)
    for gf, ge in zip(out["fused"][2], out["eager"][2]):
        torch.testing.assert_close(gf, ge, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_megatron_optimizer_step_equals_torch_adamw(clip):
    """megatron's optimizer (fp32, one process), its grad norm and clipping == torch AdamW + clip_grad_norm_ on the
    same gradients."""
    from moe_gspo import init_parallel, load_policy
    from moe_gspo.train.optim import Optimizer, wrap_ddp

    cfg = tiny_cfg(f"train.grad_clip={clip}", "train.weight_decay=0.1", "train.lr=0.01")
    policy = load_policy(cfg, init_parallel(cfg))
    opt = Optimizer.from_config(wrap_ddp(policy), policy, cfg.train, total_steps=4)
    params = dict(policy.gpt.named_parameters())
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    # megatron's default: no weight decay on 1-D parameters (norms, biases)
    groups = [{"params": [t for t in ref.values() if t.dim() > 1], "weight_decay": 0.1},
              {"params": [t for t in ref.values() if t.dim() <= 1], "weight_decay": 0.0}]
    ref_opt = torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 100, (2, 6), generator=g)
        opt.zero_grad()
        policy(ids).float().pow(2).mean().backward()
        opt.reduce_grads()
        grads = {n: p.main_grad.detach().clone() for n, p in params.items()}
        opt.zero_grad()  # the same backward again, then megatron's step (it reduces the buffers itself)
        policy(ids).float().pow(2).mean().backward()
        norm = opt.step()
        expect = torch.linalg.vector_norm(torch.stack([x.double().norm() for x in grads.values()]))
        assert abs(norm - float(expect)) < 1e-6 * float(expect), (norm, float(expect))
        for n, t in ref.items():
            t.grad = grads[n].clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(ref.values()), clip)
        ref_opt.step()
        for n, p in params.items():
            torch.testing.assert_close(p.detach(), ref[n].detach(), rtol=1e-6, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_lr_schedule_follows_megatron_warmup_and_cosine(tmp_path):
    from moe_gspo.train.loop import train

    train(tiny_cfg("train.steps=3", "train.minibatches=2", "train.lr=0.001", "train.lr_warmup_steps=2",
                   "train.lr_decay=cosine", "train.min_lr=0.0001"), run_dir=tmp_path)
    lrs = [r["lr"] for r in records(tmp_path)]
    # logged lr is the one the next optimizer step uses: after 2, 4, 6 of 6 optimizer steps
    import math
    cos = lambda n: 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * (n - 2) / (6 - 2)))  # noqa: E731
    assert lrs == pytest.approx([1e-3, cos(4), 1e-4], rel=1e-9)


@pytest.mark.parametrize("track_flips", [False, True])
def test_gspo_with_engine_logprobs_trains_on_the_engines_logprobs_as_pi_old(tmp_path, monkeypatch, track_flips):
    """Bypass mode: every update's pi_old is, value for value, the log-prob the engine sampled each response token
    with (a bf16 engine, so they differ from the trainer's). The old-log-prob pass runs only when something else
    needs it (here the flip tracker), and then its own log-probs are not pi_old."""
    import moe_gspo.train.loop as trainer
    import moe_gspo.train.step as step

    passes, updates, rollouts = [], [], []
    real_pass, real_update, real_rollout = step.old_logprob_pass, trainer.update_minibatch, trainer.Run.rollout
    monkeypatch.setattr(step, "old_logprob_pass", lambda *a, **k: passes.append(real_pass(*a, **k)) or passes[-1])
    monkeypatch.setattr(trainer, "update_minibatch", lambda ctx, pb, old, *a: updates.append((pb, old.old_logp)) or
                        real_update(ctx, pb, old, *a))
    monkeypatch.setattr(trainer.Run, "rollout", lambda self, st, *a: rollouts.append(real_rollout(self, st, *a)) or
                        rollouts[-1])
    cfg = tiny_cfg("train.steps=1", "algorithm.loss=gspo", "algorithm.use_engine_logprobs=true",
                   f"algorithm.track_flips={str(track_flips).lower()}", "rollout.engine_dtype=bfloat16")
    m = trainer.train(cfg, run_dir=tmp_path)
    assert "pg_clipfrac" in m and len(updates) == cfg.train.minibatches and len(rollouts) == 1
    batch = rollouts[0].batch
    for pb, pi_old in updates:
        for b, (p, lp) in enumerate(zip(batch.prompt_ids, batch.logprobs)):  # what the engine sampled with
            assert torch.equal(pi_old[b, len(p):len(p) + len(lp)], lp.float())
            assert not pi_old[b, :len(p)].any() and not pi_old[b, len(p) + len(lp):].any()
    assert len(passes) == int(track_flips)
    if track_flips:  # the pass ran (for the tracker) and measured the engine's mismatch, not pi_old
        resp = updates[0][0].response_mask
        gap = (passes[0].old_logp - updates[0][1])[resp].abs()
        assert float(gap.max()) > 1e-4 and m["rollout_probs_diff_max"] > 0
    else:
        assert "rollout_probs_diff_mean" not in m


def _k3_reference(response_mask, logp_ref, logp_new) -> float:
    """KL(pi || pi_ref) by Schulman's k3, exp(d) - d - 1 with d = logp_ref - logp, averaged as the loss
    aggregates (seq-mean-token-mean, one rank): the independent check of the logged kl_loss."""
    d = (logp_ref - logp_new).double()
    k3 = torch.where(response_mask, d.exp() - d - 1, 0.0)
    n = response_mask.sum(-1)
    keep = n > 0
    return float((k3.sum(-1)[keep] / n[keep]).mean())


def test_kl_to_the_reference_policy_equals_k3_against_the_frozen_weights_and_costs_nothing_when_off(
        tmp_path, monkeypatch):
    """With kl_beta > 0 the logged kl_loss of a step is the k3 KL between the policy being trained and the frozen
    reference, recomputed here from both policies' log-probs on the minibatch: 0 before the first optimizer step
    (pi == pi_ref), then > 0 once lr 0.01 moved the weights."""
    import moe_gspo.train.loop as trainer
    from moe_gspo.model.policy import MoEPolicy
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.logprob import batch_logprobs

    seen = []
    real = trainer.update_minibatch

    def recording(ctx, pb, old, adv, idx):
        with torch.no_grad():  # the minibatch's metrics are those of its forwards, before its optimizer step
            ids, t = pb.input_ids[idx], ctx.cfg.rollout.temperature
            new = batch_logprobs(ctx.policy, ids, None, "eager", t, want_entropy=False)[0]
            ref = batch_logprobs(ctx.reference, ids, None, "eager", t, want_entropy=False)[0]
        m = real(ctx, pb, old, adv, idx)
        seen.append((m["kl_loss"], _k3_reference(pb.response_mask[idx], ref, new)))
        return m

    monkeypatch.setattr(trainer, "update_minibatch", recording)
    train_cfg = tiny_cfg("algorithm.kl_beta=0.1", "algorithm.kl_estimator=k3", "train.lr=0.01",
                         "algorithm.track_flips=false")
    # rewards with variance in every group: the policy gradient, not round-off, moves the policy off pi_ref
    trainer.train(train_cfg, run_dir=tmp_path / "kl", task=_ParityTask(task_from_config(train_cfg.rollout)))
    assert len(seen) == train_cfg.train.steps * train_cfg.train.minibatches
    assert seen[0] == (0.0, 0.0)  # before the first optimizer step pi is pi_ref
    for logged, want in seen[1:]:
        assert want > 1e-4 and logged == pytest.approx(want, rel=1e-4)
    monkeypatch.setattr(trainer, "update_minibatch", real)
    monkeypatch.setattr(MoEPolicy, "frozen_copy", lambda self: pytest.fail("built a reference with kl_beta=0"))
    m = trainer.train(tiny_cfg("train.steps=1"), run_dir=tmp_path / "nokl")
    assert "kl_loss" not in m


class _ParityTask:
    """Wraps a task; its reward is the parity of the response's length, so that an untrained policy's groups have
    reward variance and every step updates."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward_fn(self, response, ex):
        return float(len(response) % 2)


@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_logprob_micro_batch_size_changes_only_how_the_old_logprob_pass_is_chunked(tmp_path, monkeypatch, replay):
    """The no-grad pass over the rollout batch (16 rows here) in one forward or in forwards of 3 rows (uneven
    chunks) gives the training run of the default chunking (4 rows): the same metrics at every step up to float
    rounding, with the routing R2 records and R3 replays sliced alongside."""
    import moe_gspo.train.step as step
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.loop import train

    rows = []
    real = step.batch_logprobs
    monkeypatch.setattr(step, "batch_logprobs", lambda policy, ids, *a, **k: rows.append(len(ids)) or real(policy, ids, *a, **k))
    runs = {}
    for size in ("null", "16", "3"):
        rows.clear()
        cfg = tiny_cfg("algorithm.loss=grpo", f"algorithm.routing_replay={replay}", "rollout.return_routing=true",
                       f"train.logprob_micro_batch_size={size}", "train.lr=0.01")
        train(cfg, run_dir=tmp_path / size, task=_ParityTask(task_from_config(cfg.rollout)))
        runs[size] = (list(rows), [strip_timing(r) for r in records(tmp_path / size)])
    assert runs["null"][0] == [4, 4, 4, 4] * 2 and runs["16"][0] == [16] * 2 and runs["3"][0] == [3, 3, 3, 3, 3, 1] * 2
    base = runs["null"][1]
    assert all(r["groups/with_variance"] > 0 for r in base) and base[-1]["moe/flip_rate"] > 0  # updates moved routing
    for size in ("16", "3"):
        for a, b in zip(base, runs[size][1], strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (size, k)


def test_logprob_micro_batch_size_must_be_positive():
    with pytest.raises(ConfigError, match=r"train.logprob_micro_batch_size=0 must be > 0"):
        tiny_cfg("train.logprob_micro_batch_size=0")


def test_cpu_adam_steps_fused_and_equals_torch_adams_parameter_loop():
    """Megatron's optimizer falls back to torch's Adam on the CPU; the trainer switches it to torch's fused kernel.
    Three steps of it equal three steps of torch's default per-parameter loop on the same gradients."""
    import moe_gspo
    from moe_gspo.train.optim import Optimizer, wrap_ddp

    cfg = tiny_cfg("train.lr=0.01")
    pols, opts = [], []
    for _ in range(2):
        p = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
        if pols:
            p.load_full_megatron_state(pols[0].full_megatron_state())
        pols.append(p)
        opts.append(Optimizer.from_config(wrap_ddp(p, False), p, cfg.train, total_steps=10))
    groups = opts[1].optimizer.param_groups
    assert all(g["fused"] is True for g in groups)
    for g in groups:  # the twin: torch's default on CPU tensors
        g["fused"] = None
    x = torch.randint(0, cfg.model.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    start = {k: v.clone() for k, v in pols[0].full_megatron_state().items()}
    for _ in range(3):
        for p, o in zip(pols, opts, strict=True):
            o.zero_grad()
            p(x).float().logsumexp(-1).mean().backward()
            o.step()
    a, b = pols[0].full_megatron_state(), pols[1].full_megatron_state()
    assert any((a[k] - start[k]).abs().max() > 1e-3 for k in a)  # the steps moved the weights
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _asks_the_device_for_a_value():
    import warnings

    from moe_gspo.train.metrics import SYNC_WARNING

    warnings.warn(f"called a synchronizing CUDA operation ({SYNC_WARNING})")  # what torch's sync debug mode says


def test_host_syncs_are_counted_where_our_code_asked_for_the_value():
    # the attribution of torch's sync warnings (tests/test_gpu.py has the real ones on CUDA): the innermost frame
    # outside torch and the warnings machinery, here the helper above; other warnings pass through
    import warnings

    from moe_gspo.train.metrics import host_syncs

    with host_syncs() as sites:
        for _ in range(3):
            _asks_the_device_for_a_value()
        with pytest.warns(UserWarning, match="unrelated"):
            warnings.warn("unrelated")
    line = _asks_the_device_for_a_value.__code__.co_firstlineno + 5
    assert dict(sites) == {f"tests/test_trainer.py:{line} (_asks_the_device_for_a_value)": 3}


def test_host_floats_equals_float_of_each_value():
    from moe_gspo.train.metrics import host_floats

    m = {"pg_loss": torch.tensor(0.1234567, dtype=torch.float32), "n": 3, "frac": torch.tensor([0.25]),
         "ratio": torch.tensor(1.5, dtype=torch.bfloat16), "kl": 2e-9, "count": torch.tensor(7)}
    out = host_floats(m)
    assert list(out) == list(m)
    assert out == {k: float(v) for k, v in m.items()} and all(type(v) is float for v in out.values())
    assert host_floats({"a": 1.0}) == {"a": 1.0}


@pytest.mark.parametrize("overrides", [
    ["train.minibatches=2"], ["algorithm.track_flips=true"], ["algorithm.routing_replay=r2"], ["algorithm.kl_beta=0.1"],
    ["algorithm.rollout_is=token"], ["algorithm.rollout_rs=token_k2", "algorithm.rollout_rs_threshold=0.01"],
    ["algorithm.router_shift=true"], ["algorithm.loss=rspo"], ["train.routing_noise=0.1"],
    ["train.old_logprob_pass=always"], ["algorithm.use_engine_logprobs=true"]])
def test_the_old_logprob_pass_is_kept_whenever_the_update_forward_is_not_pi_old(overrides):
    from moe_gspo.train.step import forward_gives_pi_old

    one_update = ["train.minibatches=1", "algorithm.track_flips=false"]
    assert forward_gives_pi_old(tiny_cfg(*one_update))
    assert not forward_gives_pi_old(tiny_cfg(*one_update, *overrides))


def test_one_update_per_step_takes_pi_old_from_its_own_forward_and_trains_as_the_pass_does(tmp_path, monkeypatch):
    """train.minibatches=1 without the tracker: the step skips the old-log-prob pass and the loss takes the update
    forward's own detached log-probs as pi_old (ratio exactly 1, the policy gradient for gradient). Two steps train
    as with the pass (train.old_logprob_pass=always) up to float rounding, with the engine-vs-trainer metrics."""
    import moe_gspo.train.step as step

    passes = []
    real_pass = step.old_logprob_pass
    monkeypatch.setattr(step, "old_logprob_pass", lambda *a, **k: passes.append(1) or real_pass(*a, **k))
    ovs = ["train.minibatches=1", "algorithm.track_flips=false", "algorithm.loss=grpo", "train.lr=0.01",
           "train.micro_batch_size=8", "train.logprob_micro_batch_size=8"]
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.loop import train

    def run(name, *more):  # rewards with variance in every group: every step has a policy gradient
        cfg = tiny_cfg(*ovs, *more)
        train(cfg, run_dir=tmp_path / name, task=_ParityTask(task_from_config(cfg.rollout)))

    run("auto")
    assert len(passes) == 0
    run("always", "train.old_logprob_pass=always")
    assert len(passes) == 2
    auto, always = records(tmp_path / "auto"), records(tmp_path / "always")
    for a, b in zip(auto, always):
        assert a["ratio_min"] == a["ratio_max"] == 1.0 and a["pg_clipfrac"] == 0.0
        assert a["rollout_probs_diff_max"] < 1e-4 and b["rollout_probs_diff_max"] < 1e-4  # fp32 engine and trainer
        for k in ("pg_loss", "grad_norm", "entropy", "reward/mean", "rollout_probs_diff_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-7), k
    # the gradient is the policy gradient, not the 0 of a constant ratio
    assert min(a["grad_norm"] for a in auto) > 1e-3


@pytest.mark.parametrize("mode,impl", [("token-mean", "fused"), ("seq-mean-token-mean", "fused"),
                                       ("token-mean", "eager")])
def test_the_entropy_bonus_is_the_gradient_of_the_aggregated_entropy(tmp_path, monkeypatch, mode, impl):
    """algorithm.entropy_coeff = c subtracts c * agg(entropy) from the loss (verl's entropy_coeff). With a constant
    reward GRPO's advantages, and so its policy gradient, are 0, so each update's gradient is -c * grad agg(H): its
    norm, recomputed here by autograd on the eager logits' entropy over the minibatch's response tokens, equals the
    logged grad_norm, and the update raises the entropy of the rows it trained on. The fused loss kernel and the
    log-probs-then-loss path (train.loss_impl=eager) alike."""
    import moe_gspo.train.loop as trainer
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.logprob import batch_logprobs

    c, seen = 0.5, []
    real = trainer.update_minibatch

    def entropy(ctx, pb, idx):
        ids, mask = pb.input_ids[idx], pb.response_mask[idx]
        ent = batch_logprobs(ctx.policy, ids, None, "eager", ctx.cfg.rollout.temperature)[1]
        if mode == "token-mean":
            return (ent * mask).sum() / mask.sum()
        return ((ent * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / mask.any(-1).sum()

    def recording(ctx, pb, old, adv, idx):
        params = [p for p in ctx.policy.parameters() if p.requires_grad]
        before = entropy(ctx, pb, idx)
        grads = torch.autograd.grad(-c * before, params, allow_unused=True)
        want = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
        m = real(ctx, pb, old, adv, idx)
        with torch.no_grad():
            after = entropy(ctx, pb, idx)
        seen.append((m["grad_norm"], want, float(before.detach()), float(after)))
        return m

    monkeypatch.setattr(trainer, "update_minibatch", recording)
    cfg = tiny_cfg(f"algorithm.entropy_coeff={c}", "algorithm.loss=grpo", f"algorithm.loss_agg_mode={mode}",
                   "algorithm.track_flips=false", "train.cold_start_steps=0", "train.grad_clip=0",
                   f"train.loss_impl={impl}")
    task = _ConstantTask(task_from_config(cfg.rollout))
    trainer.train(cfg, run_dir=tmp_path / "ent", task=task)
    assert len(seen) == cfg.train.steps * cfg.train.minibatches
    for logged, want, before, after in seen:
        assert want > 1e-3 and logged == pytest.approx(want, rel=1e-4)
        assert after > before


class _ConstantTask(_ParityTask):
    """Every response scores 1: no group has reward variance, so no policy gradient."""

    def reward_fn(self, response, ex):
        return 1.0
