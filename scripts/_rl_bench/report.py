"""The summary of scripts/bench_rl.py: medians per phase, the markdown table and the JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

from .comparison import (BENCH_OVERRIDES, CUDA_MISMATCHES, DEVICE_OVERRIDES, MISMATCHES, ROOT, SIZES,
                         TRL_GENERATION_WHAT, VLLM_MISMATCH, bench_config)

PHASES = ("generation", "old_logprob", "training", "other")


def summarize(runs: list[dict], warmup: int) -> dict:
    steps = [s for r in runs for s in r["steps"][warmup:]]
    med = lambda k: statistics.median(s[k] for s in steps)  # noqa: E731
    row = {"timed_steps": len(steps), "tokens": statistics.mean(s["tokens"] for s in steps),
           "response_tokens": statistics.mean(s["response_tokens"] for s in steps),
           "step_s": med("step"), "tokens_per_s": statistics.median(s["tokens"] / s["step"] for s in steps),
           "reward": statistics.mean(s["reward"] for s in steps)}
    for ph in PHASES:
        row[f"{ph}_s"] = med(ph)
        row[f"{ph}_tokens_per_s"] = row["tokens"] / row[f"{ph}_s"] if row[f"{ph}_s"] > 0 else None
    row["load"] = [round(x, 2) for r in runs for x in (r["load_before"], r["load_after"])]
    row["per_step"] = [r["steps"] for r in runs]  # every step of every run, warmup included
    return row


def shape_of(size: str, args) -> dict:
    """The architecture and batch layout of `size` (for the JSON)."""
    cfg = bench_config(size, "grpo", args.set, None, 1, args.device, args.max_new_tokens, args.engine)
    m, r, t = cfg.model, cfg.rollout, cfg.train
    total, active = m.parameter_counts()
    return {"parameters": total, "active_parameters": active, "params_dtype": m.params_dtype,
            "engine": r.engine, "engine_dtype": r.engine_dtype,
            "layers": m.num_hidden_layers, "hidden": m.hidden_size, "experts": m.num_experts,
            "top_k": m.num_experts_per_tok, "vocab": m.vocab_size, "prompts": r.prompts_per_step,
            "group": r.group_size, "max_new_tokens": r.max_new_tokens, "minibatches": t.minibatches,
            "micro_batch": t.micro_batch_size}


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict]) -> str:
    head = ("| size | loss | tool | tokens/step | step s | step tok/s | generation s (tok/s) | old log-probs s (tok/s) "
            "| training s (tok/s) | other s | step speedup vs fastest TRL |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        phase = lambda p: f"{fmt(r[p + '_s'])} ({fmt(r[p + '_tokens_per_s'], '.0f')})"  # noqa: E731
        lines.append(f"| {r['size']} | {r['algo']} | {r['tool']} | {r['tokens']:.0f} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {phase('generation')} | {phase('old_logprob')} | "
                     f"{phase('training')} | {fmt(r['other_s'])} | {r['speedup_vs_trl']:.2f}x |")
    return "\n".join(lines)


def report(args, rows, probes, shapes, settings, sizes, final: bool) -> None:
    """Print the table (final) and write the JSON (after every size and algorithm, so a long run keeps what it has)."""
    from importlib.metadata import version

    table = markdown(rows)
    mismatches = MISMATCHES + (CUDA_MISMATCHES if args.device == "cuda" else [])
    if args.engine == "vllm":
        mismatches = [VLLM_MISMATCH if m.startswith("rollout sampling:") else m for m in mismatches]
    generation = {"moe-gspo": f"rollout.engine={args.engine}",
                  **{t: f"{m} ({TRL_GENERATION_WHAT[m]})" for t, m in args.trl_generation.items()}}
    if final:
        print(f"device {args.device}, {args.threads} threads, {args.steps - args.warmup} timed steps x {args.repeats} "
              f"runs per side; max |probe log-prob diff| moe-gspo vs TRL {max(probes.values()):.1e}")
        print("generation: " + "; ".join(f"{t} {g}" for t, g in generation.items()))
        for r in rows:
            if r["tool"] == "moe-gspo" and len(args.trl_generation) > 1:
                print(f"{r['size']}/{r['algo']}: TRL's fastest generation is {r['fastest_trl']}")
        print(table)
        for m in mismatches:
            print(f"- {m}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        gpu = None
        if args.device == "cuda":
            import torch

            gpu = torch.cuda.get_device_name()
        result = {"commit": commit.stdout.strip() or None, "cpu": platform.processor() or platform.machine(),
                  "cores": os.cpu_count(), "threads": args.threads, "device": args.device, "gpu": gpu,
                  "generation": generation, "max_new_tokens": args.max_new_tokens,
                  "versions": {p: version(p) for p in ("torch", "megatron-core", "transformers", "trl")},
                  "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "set": args.set,
                  "sizes": shapes, "size_overrides": {s: [str(SIZES[s][0].relative_to(ROOT)), *SIZES[s][1]]
                                                      for s in sizes},
                  "bench_overrides": BENCH_OVERRIDES + DEVICE_OVERRIDES[args.device],
                  "max_abs_probe_logprob_diff": probes, "settings": settings, "mismatches": mismatches,
                  "rows": rows, "table": table, "complete": final}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
