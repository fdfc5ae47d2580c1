"""Tokens/s of the whole RL step, moe-gspo against TRL's GRPOTrainer, on the same weights, task and batch shape.

    pip install -e ".[bench]"            # trl (scripts/setup.sh installs it)
    python scripts/bench_rl.py --json runs/bench_rl.json [--sizes default,large] [--algos grpo,gspo]
                               [--steps 4] [--warmup 1] [--repeats 1] [--threads 2] [--set a.b=v ...]
    python scripts/bench_rl.py --device cuda --json runs/bench_rl_gpu.json [--sizes gpu_single,gpu_2b]
                               [--max-new-tokens 256] [--engine hf_static]
                               [--trl-generation continuous_batching,generate]

What is compared. One policy is built from configs/compare_tiny_cpu.yaml (per size, see SIZES) and saved as a HF
Qwen3-MoE checkpoint; moe-gspo trains from it (model.init_from) and TRL loads it with
Qwen3MoeForCausalLM.from_pretrained. Both sample the same prompts (the addition task's prompts of steps 0..S-1,
in order, wrapped as a `datasets.Dataset` for TRL with shuffle_dataset=False), G responses each, score them with
the task's own reward function (wrapped as a TRL reward function), and take one optimizer step per minibatch:

    moe-gspo                                        TRL GRPOConfig
    rollout.prompts_per_step P, group_size G        generation_batch_size P*G, num_generations G
    train.minibatches M, micro_batch_size m         per_device_train_batch_size m,
                                                    gradient_accumulation_steps P*G/(M*m),
                                                    steps_per_generation P*G/m, num_iterations 1
    rollout.max_new_tokens, temperature, top_p      max_completion_length, temperature, top_p (top_k 0)
    algorithm.loss grpo, seq-mean-token-mean        loss_type "grpo", importance_sampling_level "token",
      clip (0.2, 0.27)                                epsilon 0.2, epsilon_high 0.27
    algorithm.loss gspo                             loss_type "grpo", importance_sampling_level "sequence",
      clip (3e-4, 4e-4)                               epsilon 3e-4, epsilon_high 4e-4
    kl_beta 0, advantage grpo (group std)           beta 0, scale_rewards "group"
    megatron Adam, lr, betas, eps, grad clip 1.0    AdamW with the same values, max_grad_norm 1.0,
      constant LR, no weight decay                    lr_scheduler_type "constant", weight_decay 0
    fp32 policy and fp32 rollout engine             bf16 False (TRL's default is True), fp32 model
    no activation recomputation                     gradient_checkpointing False (TRL's default is True)

On CUDA (--device cuda; sizes gpu_single and gpu_2b, from configs/gpu_single.yaml and configs/gpu_2b.yaml) both
sides compute in bf16 on one GPU:

    moe-gspo                                        TRL
    model.params_dtype bfloat16, fp32 main params   bf16 True (autocast), the model loaded in bf16
    rollout.engine hf_static (--engine), bf16       each of --trl-generation (default both), one TRL side each:
                                                      continuous_batching (transformers' generate_batch: paged
                                                      KV cache, continuous batching) and generate
                                                      (model.generate); speedups are against the faster
    grouped experts (torch._grouped_mm)             experts_implementation "grouped_mm", attention "sdpa"
    rollout.max_new_tokens = --max-new-tokens       max_completion_length = --max-new-tokens (default 256)

With P*G/m micro-batches per generation and M optimizer steps per rollout, TRL's generation is not aligned with an
optimizer step, so it computes old log-probs in a no-grad pass over the rollout batch, as moe-gspo does.
moe-gspo runs with algorithm.track_flips=false and rollout.return_routing=false: TRL has neither, and both are
extra work. MISMATCHES lists what could not be made equal; the JSON and the table carry it.

How it is timed. Each (size, algorithm, tool) runs in its own process (`--_worker`), one after the other, with
the same thread count; --repeats alternates the order. Step k's wall time runs from the start of rollout k to the
start of rollout k + 1 (the last step ends when training returns); the first --warmup steps are dropped, and the
table gives medians of the rest.
- moe-gspo: the trainer's own StepTimer phases (`time/rollout`, `time/logprob`, `time/train`; `time/sync`, the
  engine weight update, goes to "other"), read from `Run.log`; step starts from wrapping `Run.rollout`.
- TRL: instance methods of the trainer are wrapped with timers: `_generate_and_score_completions` (generation:
  tokenize, `model.generate`, decode, rewards, advantages, padding; minus the old-log-prob pass inside it) and
  `_get_per_token_logps_and_entropies` when called with grad disabled (the old-log-prob pass). Training is the
  rest of the step: the micro-batch forward/backward passes, clipping, optimizer steps and the trainer loop.
  Step starts are the TrainerCallback `on_train_begin` and `on_step_end` of every M-th optimizer step.
Tokens of a step are the prompt + response tokens of its P*G sequences (padding excluded); a phase's tokens/s is
those tokens over the phase's seconds. Both processes also compute the log-probs of one probe sequence before
training; their largest difference is reported (the two tools hold the same weights when it is ~1e-6).

Where it lives. This file is the CLI and the worker processes; scripts/_rl_bench/ holds the rest: comparison.py
(SIZES, ALGOS, MISMATCHES, the moe-gspo Config of a run), moe_gspo_side.py and trl_side.py (one timed run of each
side, with the GRPOConfig mapping above) and report.py (medians, the table and the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from _rl_bench.comparison import ALGOS, DEVICE_SIZES, SIZES, TRL_GENERATION
from _rl_bench.moe_gspo_side import run_moe_gspo
from _rl_bench.report import PHASES, report, shape_of, summarize
from _rl_bench.trl_side import run_trl

warnings.filterwarnings("ignore")


def run_worker(spec: dict, threads: int) -> dict:
    """One side in its own process (TRL/accelerate and megatron each set up process-wide state)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--_worker", str(spec_path), str(out_path)], env=env,
                           capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{spec['tool']} worker failed ({spec['size']}, {spec['algo']}):\n{p.stderr[-4000:]}")
        out = json.loads(out_path.read_text())
    out.update(load_before=load, load_after=os.getloadavg()[0], wall_s=time.perf_counter() - t0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: fp32, the CPU sizes; cuda: bf16 on one GPU, the GPU sizes")
    ap.add_argument("--sizes", default=None,
                    help=f"comma-separated, of {sorted(SIZES)} (default: {DEVICE_SIZES})")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="response length of both sides (default: the size's config on the CPU, 256 on CUDA)")
    ap.add_argument("--engine", default=None, help="moe-gspo's rollout.engine (default: hf on the CPU, hf_static "
                                                   "on CUDA)")
    ap.add_argument("--trl-generation", default=None,
                    help=f"TRL's generation, comma-separated, of {list(TRL_GENERATION)}: each runs as its own TRL "
                         f"side, and speedups are against the fastest (default: generate on the CPU, both on CUDA)")
    ap.add_argument("--algos", default="grpo,gspo", help=f"comma-separated, of {sorted(ALGOS)}")
    ap.add_argument("--steps", type=int, default=4, help="RL steps per run, warmup included")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the medians")
    ap.add_argument("--repeats", type=int, default=1, help="runs per side, alternating which side goes first")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each worker process")
    ap.add_argument("--set", nargs="*", default=[], metavar="a.b=v", help="config overrides for every size")
    ap.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        spec = json.loads(Path(args._worker[0]).read_text())
        import torch

        torch.set_num_threads(spec["threads"])
        out = (run_moe_gspo if spec["tool"] == "moe-gspo" else run_trl)(spec)
        Path(args._worker[1]).write_text(json.dumps(out))
        return
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_rl.py: error: --device cuda: no CUDA device is available on this machine", file=sys.stderr)
            sys.exit(2)
    cuda = args.device == "cuda"
    if args.max_new_tokens is None and cuda:
        args.max_new_tokens = 256
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    args.engine = args.engine or ("hf_static" if cuda else "hf")
    modes = (args.trl_generation or (",".join(TRL_GENERATION) if cuda else "generate")).split(",")
    sizes, algos = (args.sizes or ",".join(DEVICE_SIZES[args.device])).split(","), args.algos.split(",")
    # one TRL side per generation mode; a single mode keeps the name "trl"
    trl_tools = {"trl": modes[0]} if len(modes) == 1 else {f"trl:{m}": m for m in modes}
    args.trl_generation = trl_tools
    for name, chosen, valid in (("--sizes", sizes, SIZES), ("--algos", algos, ALGOS),
                                ("--trl-generation", modes, TRL_GENERATION)):
        if bad := [x for x in chosen if x not in valid]:
            ap.error(f"{name}: unknown {bad}; valid: {sorted(valid)}")
    rows, probes, shapes, settings = [], {}, {}, {}
    with tempfile.TemporaryDirectory() as d:
        for size in sizes:
            ckpt = str(Path(d) / size)
            shapes[size] = shape_of(size, args)
            for algo in algos:
                runs = {"moe-gspo": [], **{t: [] for t in trl_tools}}
                for rep in range(args.repeats):
                    # moe-gspo goes first in the first repeat: its first run of a size writes the checkpoint
                    order = ["moe-gspo", *trl_tools] if rep % 2 == 0 else [*trl_tools, "moe-gspo"]
                    for tool in order:
                        spec = {"tool": tool, "size": size, "algo": algo, "set": args.set, "ckpt": ckpt,
                                "steps": args.steps, "threads": args.threads, "device": args.device,
                                "max_new_tokens": args.max_new_tokens, "engine": args.engine,
                                "trl_generation": trl_tools.get(tool)}
                        runs[tool].append(run_worker(spec, args.threads))
                        # this run's medians now, so that a benchmark cut off later still leaves them in its log
                        one = summarize(runs[tool][-1:], min(args.warmup, args.steps - 1))
                        phases = ", ".join(f"{ph} {one[ph + '_s']:.3f} s" for ph in PHASES)
                        print(f"{size} {algo} {tool} run {rep + 1}: {runs[tool][-1]['wall_s']:.1f} s; median step "
                              f"{one['step_s']:.3f} s ({one['tokens_per_s']:.0f} tokens/s): {phases}",
                              file=sys.stderr, flush=True)
                ours = runs["moe-gspo"][0]
                for t in trl_tools:
                    if ours["prompts"] != runs[t][0]["prompts"]:
                        raise RuntimeError(f"{size}/{algo}: moe-gspo and {t} sampled different prompts")
                probes[f"{size}/{algo}"] = max(abs(a - b) for t in trl_tools
                                               for a, b in zip(ours["probe"], runs[t][0]["probe"]))
                settings[f"{size}/{algo}"] = {**{t: runs[t][0]["trl_settings"] for t in trl_tools},
                                              "optimizer_steps_per_rollout": {
                                                  t: runs[t][0]["optimizer_steps_per_rollout"] for t in runs}}
                summ = {t: summarize(runs[t], args.warmup) for t in runs}
                fastest = min(trl_tools, key=lambda t: summ[t]["step_s"])  # speedups are against it
                for tool in runs:
                    rows.append({"size": size, "algo": algo, "tool": tool, **summ[tool], "fastest_trl": fastest,
                                 "speedup_vs_trl": summ[fastest]["step_s"] / summ[tool]["step_s"]})
                report(args, rows, probes, shapes, settings, sizes, final=False)
    report(args, rows, probes, shapes, settings, sizes, final=True)


if __name__ == "__main__":
    main()
