"""Benchmark of the tensor-parallel vLLM engine (rollout.engine_tp) inside a torchrun world: build time, generation
tokens/s, sync seconds and peak memory per rank, at engine TP 1 and 2, and the sync's cost as the model grows
against this machine's floor.

    python scripts/bench_engine_tp.py --json runs/bench_engine_tp.json [--nproc 2] [--layouts parallel.ep=2]
        [--sizes 128,256,512] [--prompts 8] [--group 4] [--max-new-tokens 32] [--repeats 3] [--no-transport]
        [--no-engine-rows]

The script launches itself under torchrun (gloo, one thread per rank) once per measurement, each in a fresh world:
- `engine` rows, the 141M config (configs/bench_engine_140m_cpu.yaml, bf16 engine): the trainer layout given by
  --layouts, the engine at TP 1 (a whole-model engine on every rank) and at TP = the world. Build seconds; tokens/s
  of one generate call of --prompts x --group responses (after a warm-up; the median of --repeats, response tokens
  over the call's wall time, all ranks' samples counted once); sync seconds (median of --repeats updates); the
  rank's peak resident memory during a sync above its resident memory before it (Linux VmHWM after resetting it
  through /proc/self/clear_refs), beside the bytes of its engine shard.
- `scaling` rows: engine TP = the world, the same trainer layout, hidden sizes --sizes (experts' width scaled with
  them, 8 layers, 32 experts top-4): sync seconds against the floor, the engine shard's bytes over this machine's
  memory-copy bandwidth measured in the same process (a 256 MiB tensor copy, median of 5): the least a sync that
  writes every byte of the shard once could take. A second floor is the transport's: the bytes the rank receives
  over the bandwidth of a 64 MiB exchange between the two ranks on the same process group (gloo: loopback TCP
  here). Beside them, the slowest rank's sync by phase (ShardedSync.load):
  move (the plan's rounds), write (pieces into the engine, experts into their staging), prepack (the experts packed
  for vLLM's CPU kernel) and repack_dense (the dense layers' packed GEMM weights rebuilt).
- --no-transport adds, per size, the same sync with the transfer between ranks skipped (pieces from the other rank
  keep stale bytes, so only its time means anything): what no transport, however fast, could go below.
Prints a table and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _copy_bandwidth() -> float:
    import torch

    a = torch.empty(64 * 2**20, dtype=torch.float32)
    b = torch.empty_like(a)
    a.fill_(1.0)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return a.numel() * a.element_size() / statistics.median(times)


def _p2p_bandwidth() -> float:
    """Bytes per second one rank receives while it sends as much to the other (64 MiB each way over the world's
    process group, gloo here; median of 3): what the sync's transport alone allows."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.ones(32 * 2**20, dtype=torch.bfloat16)
    into = torch.empty_like(out)
    times = []
    for _ in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, out, (rank + 1) % world), dist.P2POp(dist.irecv, into, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        times.append(time.perf_counter() - t0)
    return into.numel() * into.element_size() / statistics.median(times[1:])


def worker(args) -> None:
    """One measurement inside torchrun: writes rank_{r}.json into args.out."""
    import torch
    import torch.distributed as dist

    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config
    from moe_gspo.rollout import SamplingParams, engine_from_config

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs/bench_engine_140m_cpu.yaml", ["rollout.engine=vllm", *args.set])
    policy = load_policy(cfg, init_parallel(cfg))
    rank = dist.get_rank()
    dist.barrier()
    t0 = time.perf_counter()
    engine = engine_from_config(cfg.rollout, policy)
    dist.barrier()
    build = time.perf_counter() - t0
    rec = {"build_s": build, "param_fraction": engine.param_fraction()}
    if args.generate:
        prompts = [[1] + [5 + (7 * i + j) % 100 for j in range(12)] for i in range(args.prompts)]
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, seed=0, return_routing=True)
        engine.generate(prompts, args.group, sp)  # warm-up
        times, tokens = [], 0
        for r in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            batch = engine.generate(prompts, args.group, SamplingParams(max_new_tokens=args.max_new_tokens,
                                                                         seed=r + 1, return_routing=True))
            dist.barrier()
            times.append(time.perf_counter() - t0)
            tokens = int(batch.response_lengths.sum())
        rec |= {"gen_s": statistics.median(times), "gen_tokens": tokens}
    if args.no_transport:  # timing only: the engine keeps stale bytes wherever a piece comes from the other rank
        from moe_gspo.rollout.sync.plan import SyncPlan

        run = SyncPlan.run
        SyncPlan.run = lambda self, views, device=None, post=None: run(self, views, device, lambda ops, i: [])
    syncs, peaks, phases = [], [], []
    for _ in range(args.repeats + 1):
        with torch.no_grad():
            for w in policy.parameters():
                w.mul_(1.0001)
        before = _rss("VmRSS")
        ok = _reset_peak()
        dist.barrier()
        t0 = time.perf_counter()
        engine.update_weights(policy.weights())
        dist.barrier()
        syncs.append(time.perf_counter() - t0)
        phases.append(dict(engine.last_sync_phases))
        peaks.append(_rss("VmHWM") - before if ok else float("nan"))
    elem = 2 if cfg.rollout.engine_dtype == "bfloat16" else 4
    total = sum(p.numel() for p in policy.parameters())  # this rank's trainer shard, for reference
    from moe_gspo.model.hf_shards import hf_shapes

    model_params = sum(torch.Size(s).numel() for s in hf_shapes(cfg.model).values())
    shard_bytes = engine.param_fraction() * model_params * elem
    rec |= {"sync_s": statistics.median(syncs[1:]), "sync_peak_above_rss": max(peaks[1:]),
            "engine_shard_bytes": shard_bytes, "model_params": model_params, "trainer_params_local": total,
            "received_bytes": getattr(engine, "last_sync_received_bytes", 0),
            # per phase, the median over the timed syncs (engine TP > 1; see ShardedSync.load)
            "sync_phases": {k: statistics.median(p[k] for p in phases[1:]) for k in phases[-1]},
            "copy_bandwidth": _copy_bandwidth(), "p2p_bandwidth": _p2p_bandwidth()}
    Path(args.out, f"rank_{rank}.json").write_text(json.dumps(rec))
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


def launch(nproc: int, overrides: list[str], generate: bool, a, no_transport: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={29500 + os.getpid() % 1000}", __file__, "--worker", "--out", out,
               "--prompts", str(a.prompts), "--group", str(a.group), "--max-new-tokens", str(a.max_new_tokens),
               "--repeats", str(a.repeats)] + (["--generate"] if generate else []) + \
              (["--no-transport"] if no_transport else []) + \
              [x for o in overrides for x in ("--set", o)]
        r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                           text=True)
        if r.returncode:
            sys.exit(f"bench_engine_tp: torchrun failed ({' '.join(overrides)}):\n{r.stderr[-3000:]}")
        return [json.loads(Path(out, f"rank_{i}.json").read_text()) for i in range(nproc)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--no-transport", action="store_true",
                    help="also time each size's sync with the transfer between ranks skipped (the pieces from the "
                         "other rank keep stale bytes): what the sync would take with a transport that cost nothing")
    ap.add_argument("--no-engine-rows", action="store_true", help="only the scaling rows")
    ap.add_argument("--json")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layouts", default="parallel.ep=2", help="the trainer's layout overrides, ';'-separated")
    ap.add_argument("--sizes", default="128,256,512")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    layout = [o for o in a.layouts.split(";") if o]
    common = ["rollout.engine_dtype=bfloat16", "model.head_dim=64"]
    rows = []
    for tp in () if a.no_engine_rows else (1, a.nproc):
        reps = launch(a.nproc, layout + common + [f"rollout.engine_tp={tp}"], True, a)
        r0 = reps[0]
        served = a.nproc // tp  # replicas: each samples its own call's prompts
        rows.append({"kind": "engine", "engine_tp": tp, "build_s": max(r["build_s"] for r in reps),
                     "gen_tok_s": r0["gen_tokens"] * served / r0["gen_s"], "sync_s": r0["sync_s"],
                     "peak_mb": max(r["sync_peak_above_rss"] for r in reps) / 2**20,
                     "shard_mb": r0["engine_shard_bytes"] / 2**20, "param_fraction": r0["param_fraction"],
                     "received_mb": max(r["received_bytes"] for r in reps) / 2**20})
    for h in map(int, a.sizes.split(",")):
        size = layout + common + [f"rollout.engine_tp={a.nproc}", f"model.hidden_size={h}",
                                  f"model.moe_intermediate_size={h // 2}"]
        reps = launch(a.nproc, size, False, a)
        r0 = max(reps, key=lambda r: r["sync_s"])
        floor = r0["engine_shard_bytes"] / r0["copy_bandwidth"]
        received = max(r["received_bytes"] for r in reps)
        p2p = min(r["p2p_bandwidth"] for r in reps)
        transport = received / p2p
        rows.append({"kind": "scaling", "hidden": h, "model_params_m": r0["model_params"] / 1e6,
                     "sync_s": r0["sync_s"], "floor_s": floor, "over_floor": r0["sync_s"] / floor,
                     "shard_mb": r0["engine_shard_bytes"] / 2**20, "received_mb": received / 2**20,
                     "copy_gb_s": r0["copy_bandwidth"] / 1e9, "phases_s": r0["sync_phases"],
                     "transport_s": transport, "p2p_gb_s": p2p / 1e9,
                     "over_copy_and_transport": r0["sync_s"] / (floor + transport)})
        if a.no_transport:
            free = max(launch(a.nproc, size, False, a, True), key=lambda r: r["sync_s"])
            rows[-1] |= {"no_transport_sync_s": free["sync_s"], "no_transport_phases_s": free["sync_phases"],
                         "no_transport_over_floor": free["sync_s"] / (free["engine_shard_bytes"] /
                                                                      free["copy_bandwidth"])}
    print("| engine TP | build s | gen tok/s | sync s | sync peak above RSS MB | engine shard MB | received MB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["kind"] == "engine":
            print(f"| {r['engine_tp']} | {r['build_s']:.1f} | {r['gen_tok_s']:.0f} | {r['sync_s']:.3f} | "
                  f"{r['peak_mb']:.1f} | {r['shard_mb']:.1f} | {r['received_mb']:.1f} |")
    names = ("move", "write", "prepack", "repack_dense")
    print("\n| hidden | params (M) | sync s | floor s | sync / floor | shard MB | received MB | copy GB/s | "
          "transport s | sync / (floor + transport) | " + " | ".join(f"{n} s" for n in names) + " |")
    print("| --- " * (10 + len(names)) + "|")
    for r in rows:
        if r["kind"] == "scaling":
            ph = " | ".join(f"{r['phases_s'].get(n, float('nan')):.3f}" for n in names)
            print(f"| {r['hidden']} | {r['model_params_m']:.1f} | {r['sync_s']:.4f} | {r['floor_s']:.4f} | "
                  f"{r['over_floor']:.1f}x | {r['shard_mb']:.1f} | {r['received_mb']:.1f} | {r['copy_gb_s']:.1f} | "
                  f"{r['transport_s']:.4f} | {r['over_copy_and_transport']:.1f}x | {ph} |")
    if a.no_transport:
        print("\nwith the transfer skipped (a transport that costs nothing; its own launch, so its copy bandwidth)")
        print("| hidden | sync s | sync / floor | " + " | ".join(f"{n} s" for n in names) + " |")
        print("| --- " * (3 + len(names)) + "|")
        for r in rows:
            if "no_transport_sync_s" in r:
                ph = " | ".join(f"{r['no_transport_phases_s'].get(n, float('nan')):.3f}" for n in names)
                print(f"| {r['hidden']} | {r['no_transport_sync_s']:.4f} | {r['no_transport_over_floor']:.1f}x | "
                      f"{ph} |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"nproc": a.nproc, "layout": layout, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
