"""The RL step at the real model's size (configs/real_smollm2_cpu.yaml: the upcycled SmolLM2-135M, 30 layers, a
49,152-token vocabulary, 64 responses a step), its phases against an isolated forward+backward of the same rows.

    bash scripts/get_real_model.sh                               # once
    python scripts/bench_real_step.py --json runs/bench_real_step.json [--steps 2] [--set a.b=v ...]

The trainer runs `--steps` RL steps from the config (no evaluation, no checkpoints), phase by phase as the training
loop runs them (rollout, old log-probs, the minibatch updates, the engine sync); the last step's batch is kept. On
that batch's rows, cut into the trainer's micro-batches, are then timed in the same process:

- "policy fwd+bwd": the same policy's forward to full logits, token cross-entropy on the response tokens, and
  backward (no optimizer step, no routing capture, no loss object): what the training phase's kernels cost;
- "transformers fwd+bwd": transformers' MixtralForCausalLM loaded from the same checkpoint, the same rows, the
  same loss: the reference the policy's forward+backward is held to;
- "optimizer step": the trainer's optimizer step alone (megatron's Adam over all parameters, with clipping).

--trl first runs TRL's GRPOTrainer in a process of its own (model.generate, fp32, AdamW) on the same checkpoint,
prompts, reward and batch shape (scripts/_rl_bench/trl_side.py's mapping), and the report gives both sides' phases
and the step-time ratio.

The ratio `isolated / training phase` (isolated = policy fwd+bwd + optimizer step, times the minibatches; the
training phase of the last step, whose rows they are) is the
training phase's speed relative to its kernels; 1.0 means the RL machinery adds nothing. Each isolated row runs
--repeats times after one warmup; the table gives medians. Run it on a quiet machine: nothing else beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # scripts/_rl_bench: TRL's settings for a moe-gspo config


def rl_step(run, step: int, profile: dict | None = None) -> tuple[dict, object]:
    """(phase seconds, padded batch) of RL step `step` as the training loop runs it. With `profile` (a dict), each
    phase runs under torch.profiler and profile[phase] gets its costliest operators and the update's named ranges
    (moe_gspo/update/...): the phase times then include the profiler's overhead."""
    from moe_gspo.train.step import record_engine_routing, update_minibatch

    def phase(name):
        if profile is None:
            return contextlib.nullcontext()
        return profiled(profile, name)

    t = {}
    t0 = time.perf_counter()
    with phase("rollout"):
        scored, _ = run.sample(step)
        adv, valid, _ = run.score(scored)
        pb = run.pad(scored.batch, valid)
        record_engine_routing(run.ctx, pb)
    t["rollout"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    with phase("logprob"):
        old, _ = run.old_logprobs(pb)
    t["logprob"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    with phase("train"):
        for idx in run.minibatches(step):
            update_minibatch(run.ctx, pb, old, adv.to(pb.input_ids.device), idx)
    t["train"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    with phase("sync"):
        run.rollouts.publish(run.policy.weights())
        run.replay.clear()
    t["sync"] = time.perf_counter() - t3
    t["step"] = time.perf_counter() - t0
    t["tokens"] = int(pb.attention_mask.sum())
    t["responses"] = int(pb.input_ids.shape[0])
    return t, pb


@contextlib.contextmanager
def profiled(out: dict, name: str, top: int = 12):
    """Run the block under torch.profiler (CPU); out[name] = its wall seconds, named ranges and costliest ops."""
    from torch.profiler import ProfilerActivity, profile

    from moe_gspo.train.metrics import costliest

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        yield
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy, ops = costliest(events, top)
    ranges = {e.key: e.cpu_time_total / 1e3 for e in events if e.key.startswith("moe_gspo/update/")}
    out[name] = {"wall_ms": wall * 1e3, "ops_ms": busy, "ranges_ms": ranges, "ops": ops}


def rl_steps(cfg, run_dir: Path, steps: int):
    """(per-step phase seconds, the last step's padded batch, the Run) of `steps` RL steps."""
    from moe_gspo.train.loop import Run, preflight

    tok, task = preflight(cfg, None, None)
    run = Run.setup(cfg, run_dir=run_dir, task=task, engine=None, init_state=None, resume=False, label="bench",
                    tok=tok)
    phases, kept = [], None
    for step in range(steps):
        t, pb = rl_step(run, step)
        phases.append(t)
        print(f"step {step + 1}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in t.items()), flush=True)
        kept = pb  # the last step's rows: the isolated rows below are timed on them
    return phases, kept, run


def micro_batches(pb, micro: int):
    """(ids, target mask) per micro-batch of `micro` rows, each trimmed to its longest row (as the trainer trims)."""
    lengths = pb.attention_mask.sum(1)
    out = []
    for s in range(0, pb.input_ids.shape[0], micro):
        T = int(lengths[s:s + micro].max())
        out.append((pb.input_ids[s:s + micro, :T], pb.response_mask[s:s + micro, :T]))
    return out


def fwd_bwd(forward, params, batches) -> float:
    """Seconds of forward to logits, cross-entropy on the response tokens, backward, over every micro-batch."""
    t0 = time.perf_counter()
    for ids, mask in batches:
        logits = forward(ids)[:, :-1].float()
        target = ids[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                reduction="none").view(target.shape)
        (nll * mask[:, 1:]).sum().div(mask.sum()).backward()
    dt = time.perf_counter() - t0
    for p in params:
        p.grad = None
    return dt


def trl_steps(cfg, steps: int, vllm: bool = False) -> list[dict]:
    """TRL's GRPOTrainer on the same checkpoint, the same prompts (the ones moe-gspo's loop draws for steps
    0..steps-1, chat messages through the checkpoint's template), the same reward and batch shape
    (scripts/_rl_bench/trl_side.py maps the settings); per-step seconds: the whole step, generation with scoring,
    the old-log-prob pass, and the rest (training). vllm: TRL generates with vLLM inside its trainer's process
    (its "colocate" mode) instead of model.generate."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from _rl_bench.trl_side import trl_kwargs
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train import data

    task = task_from_config(cfg.rollout)
    P = cfg.rollout.prompts_per_step
    examples = [ex for s in range(steps) for ex in data.step_examples(task, cfg.train.seed, s, 0, P)]

    def reward(prompts, completions, example_index, **_):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [float(task.reward_fn(t, examples[i])) for t, i in zip(texts, example_index)]

    dataset = Dataset.from_dict({"prompt": [ex.messages or ex.prompt for ex in examples],
                                 "example_index": list(range(len(examples)))})
    tok = AutoTokenizer.from_pretrained(cfg.model.init_from, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(cfg.model.init_from, dtype=torch.float32)
    marks, out = [], []

    class Boundaries(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % cfg.train.minibatches == 0:
                marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as d:
        kwargs = trl_kwargs(cfg, "grpo", d)
        if vllm:
            kwargs.update(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=2048)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**kwargs),
                              train_dataset=dataset, processing_class=tok, callbacks=[Boundaries()])
        gen, logps = trainer._generate_and_score_completions, trainer._get_per_token_logps_and_entropies

        def timed_gen(inputs):
            out.append({"logprob": 0.0})
            t0 = time.perf_counter()
            result = gen(inputs)
            out[-1]["rollout_and_logprob"] = time.perf_counter() - t0
            out[-1]["tokens"] = int(result["prompt_mask"].sum() + result["completion_mask"].sum())
            return result

        def timed_logps(*a, **kw):
            if torch.is_grad_enabled():
                return logps(*a, **kw)
            t0 = time.perf_counter()
            result = logps(*a, **kw)
            out[-1]["logprob"] += time.perf_counter() - t0
            return result

        trainer._generate_and_score_completions, trainer._get_per_token_logps_and_entropies = timed_gen, timed_logps
        trainer.train()
    for k, s in enumerate(out):
        s["step"] = marks[k + 1] - marks[k]
        s["rollout"] = s.pop("rollout_and_logprob") - s["logprob"]
        s["train"] = s["step"] - s["rollout"] - s["logprob"]
        print(f"TRL step {k + 1}: " + ", ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                                 for key, v in s.items()), flush=True)
    return out


def print_profile(profile: dict) -> None:
    """Each profiled phase: wall time, the update's named ranges, the costliest operators by self CPU time."""
    for name in ("rollout", "logprob", "train", "sync"):
        p = profile[name]
        print(f"\nprofiled {name}: {p['wall_ms'] / 1e3:.2f} s wall (profiler overhead included)")
        for key, ms in sorted(p["ranges_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {key:40s} {ms / 1e3:8.2f} s")
        for op in p["ops"]:
            print(f"  {op['name'][:60]:60s} {op['calls']:7d} {op['ms'] / 1e3:8.2f} s {op['share']:6.1%}")


def trl_in_own_process(argv) -> list[dict]:
    """TRL's steps in a fresh process (`--trl-side-only`), so that neither side's memory or threads weigh on the
    other."""
    import subprocess

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "trl.json"
        cmd = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv), "--trl-side-only", str(out)]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main(argv=None) -> int:
    from moe_gspo.config import load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/real_smollm2_cpu.yaml", help="relative to the checkout")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--set", nargs="*", default=[], metavar="a.b=v", help="config overrides")
    p.add_argument("--json", default=None)
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer on the same checkpoint and prompts")
    p.add_argument("--trl-vllm", action="store_true", help="TRL generates with vLLM (colocate) instead of generate")
    p.add_argument("--trl-side-only", metavar="JSON", help=argparse.SUPPRESS)  # the TRL side's own process
    p.add_argument("--profile", action="store_true",
                   help="then one more RL step, each phase under torch.profiler (kept out of the timings)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    over = ["train.eval_every=0", "train.eval_before=false", "train.checkpoint_every=0", "logging.progress=false",
            "logging.tensorboard=false", f"train.steps={args.steps}", *args.set]
    if not Path(args.config).is_absolute() and not Path(args.config).exists():
        args.config = str(ROOT / args.config)  # run from elsewhere: the checkout's own config
    cfg = load_config(args.config, over)
    if args.trl_side_only:
        Path(args.trl_side_only).write_text(json.dumps(trl_steps(cfg, args.steps, vllm=args.trl_vllm)))
        return 0
    # TRL's side first, in its own process, while this one holds nothing large: the trainer's side below keeps
    # its policy, optimizer state and engine until the end, and two 10-20 GB processes do not fit in 24 GB
    trl = trl_in_own_process(argv) if args.trl else None
    with tempfile.TemporaryDirectory() as tmp:
        phases, pb, run = rl_steps(cfg, Path(tmp) / "run", args.steps)
        peak_rl = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux reports KiB)
        policy, optim = run.policy, run.ctx.optim
        micro = cfg.train.micro_batch_size
        batches = micro_batches(pb, micro)
        params = [q for q in policy.parameters() if q.requires_grad]
        policy.train()
        rows = {"policy fwd+bwd": [], "transformers fwd+bwd": [], "optimizer step": []}
        for _ in range(args.repeats + 1):
            rows["policy fwd+bwd"].append(fwd_bwd(lambda x: policy(x), params, batches))
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(cfg.model.init_from, dtype=torch.float32).train()
        hf_params = list(hf.parameters())
        for _ in range(args.repeats + 1):
            rows["transformers fwd+bwd"].append(fwd_bwd(lambda x: hf(x).logits, hf_params, batches))
        del hf
        for _ in range(args.repeats + 1):  # the trainer's optimizer on gradients of the right shapes
            optim.zero_grad()
            fwd_bwd(lambda x: policy(x), [], batches[:1])
            t0 = time.perf_counter()
            optim.step()
            rows["optimizer step"].append(time.perf_counter() - t0)
        profile = None
        if args.profile:
            profile = {}
            t, _ = rl_step(run, args.steps, profile)
            profile["step_s"] = t
            print_profile(profile)
        run.close()
    med = {k: statistics.median(v[1:]) for k, v in rows.items()}
    measured = phases[1:] or phases  # the first step pays for first-touch allocations and the engine's warmup
    phase = {k: statistics.median(s[k] for s in measured) for k in ("rollout", "logprob", "train", "sync", "step")}
    isolated = med["policy fwd+bwd"] + cfg.train.minibatches * med["optimizer step"]
    same_rows = phases[-1]["train"]  # the training phase of the step whose rows the isolated rows ran on
    config = Path(args.config).resolve()
    config = str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config)  # no machine's paths
    result = {"config": config, "overrides": over, "threads": torch.get_num_threads(),
              "cpu": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "steps": phases, "phase_median": phase,
              "isolated": rows, "isolated_median": med, "micro_batch_size": micro,
              "responses": phases[-1]["responses"], "tokens": phases[-1]["tokens"],
              "peak_rss_gib_rl_steps": peak_rl, "profile": profile,
              "training_phase_vs_isolated": isolated / same_rows,
              "policy_vs_transformers_fwd_bwd": med["transformers fwd+bwd"] / med["policy fwd+bwd"]}
    print(f"\n{result['responses']} responses, {result['tokens']} tokens a step, micro-batches of {micro} rows, "
          f"{result['threads']} threads")
    print(f"{'phase (median of steps 2..)':32s} {'s':>8s}")
    for k, v in phase.items():
        print(f"{k:32s} {v:8.2f}")
    print(f"{'isolated (median)':32s} {'s':>8s}")
    for k, v in med.items():
        print(f"{k:32s} {v:8.2f}")
    print(f"peak resident memory of the process through the RL steps: {peak_rl:.2f} GiB")
    print(f"training phase at {result['training_phase_vs_isolated']:.2f} of isolated fwd+bwd + optimizer; policy "
          f"fwd+bwd {result['policy_vs_transformers_fwd_bwd']:.2f}x transformers'")
    if trl:
        trl_med = {k: statistics.median(s[k] for s in (trl[1:] or trl)) for k in ("rollout", "logprob", "train", "step")}
        result["trl_steps"], result["trl_phase_median"] = trl, trl_med
        result["speedup_vs_trl"] = trl_med["step"] / phase["step"]
        print(f"{'phase (median of steps 2..)':32s} {'moe-gspo':>9s} {'TRL':>9s}")
        for k in ("rollout", "logprob", "train", "step"):
            print(f"{k:32s} {phase[k]:9.2f} {trl_med[k]:9.2f}")
        print(f"RL step {result['speedup_vs_trl']:.2f}x TRL's GRPOTrainer (tokens a step: moe-gspo "
              f"{phases[-1]['tokens']}, TRL {trl[-1]['tokens']}: each samples its own responses)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
