"""Peak memory and step time of one training micro-batch with train.recompute none, selective and full.

    OMP_NUM_THREADS=1 python scripts/bench_recompute.py --json runs/bench_recompute.json \
        [--config configs/bench_engine_140m_cpu.yaml] [--batch 8] [--seq 256] [--steps 5]

Each mode runs in a fresh process (so one mode's peak cannot hide another's): the policy is built with the mode,
one forward + backward of a (batch, seq) micro-batch with R3 replay warms it up, then `--steps` more are timed
(median). Peak memory is the process's peak resident set during a measured step above its resident set before
it (ru_maxrss against /proc/self/statm), on the CPU; on CUDA torch.cuda.max_memory_allocated over the step.
The table gives each mode's peak and time against 'none' measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODES = ("none", "selective", "full")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(config: str, mode: str, batch: int, seq: int, steps: int, device: str) -> dict:
    """One mode, in this process: peak memory of a step above the memory before it, and the median step time."""
    import torch

    import moe_gspo
    from moe_gspo.config import load_config
    from moe_gspo.model.routing_capture import ReplaySource, RoutingCapture

    cfg = load_config(config, [f"train.recompute={mode}"])
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg)).to(device)
    policy.train()
    mc = policy.model_config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.vocab_size, (batch, seq), generator=g)
    table = torch.rand(batch * seq, mc.num_moe_layers, mc.num_experts, generator=g).topk(
        mc.num_experts_per_tok, -1).indices

    def step():
        policy.zero_grad(set_to_none=True)
        hidden = policy(ids, routing=RoutingCapture(replay=ReplaySource(table), record=False), return_hidden=True)
        hidden.float().square().mean().backward()

    step()  # warm-up: allocator pools, gradients' buffers
    policy.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"mode": mode, "peak_bytes": int(peak), "step_s": statistics.median(times), "step_s_all": times,
            "tokens": batch * seq, "device": device}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench_engine_140m_cpu.yaml")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: measure this mode, print JSON
    args = ap.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.one:
        print(json.dumps(measure(args.config, args.one, args.batch, args.seq, args.steps, args.device)))
        return
    rows = []
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--config", args.config, "--batch",
                              str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--device",
                              args.device], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"{args.config}, micro-batch {args.batch} x {args.seq} tokens, {args.device}, median of {args.steps} steps")
    print("| train.recompute | peak memory of a step (MiB) | vs none | step (s) | vs none |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        r["peak_vs_none"] = r["peak_bytes"] / base["peak_bytes"]
        r["time_vs_none"] = r["step_s"] / base["step_s"]
        print(f"| {r['mode']} | {r['peak_bytes'] / 2**20:.0f} | {r['peak_vs_none']:.2f}x | {r['step_s']:.3f} | "
              f"{r['time_vs_none']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "batch": args.batch, "seq": args.seq, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
