"""Step time of the tiny policy with Routing Replay off, R2 on, and the expert-flip tracker on, in one run.

    OMP_NUM_THREADS=1 python scripts/bench_replay.py --json bench_replay.json [--config configs/tiny_cpu.yaml]

A step is one micro-batch (train.micro_batch_size x train.seq_len) forward + backward + AdamW step:
  off   policy(ids)                                                       (no routing capture)
  r2    policy(ids, routing=RoutingCapture(replay=src, record=False))    src = cache.replay_source(...) per step
  flip  policy(ids, routing=RoutingCapture()); tracker.observe(ids, cap.live_stacked()); tracker.metrics()
  capture  policy(ids, routing=RoutingCapture()) alone: the model-side recording that `flip` includes
The variants are interleaved step by step (so machine noise hits them alike) and the median is reported.
The R2 record (once per rollout batch, in the old-log-prob pass) is timed separately as record_s.
The tracker's own work is timed apart: per micro-batch (live_stacked + observe) and per RL step (metrics(), which
the trainer calls once per step, after all its micro-batches; the benchmark calls it after each, as a bound).
tracker_rl_step_share is what the tracker adds to the training micro-batches of one RL step of --rl-config
(prompts_per_step x group_size / micro_batch_size of them).
Goals: overhead_r2 <= 0.02, overhead_flip <= 0.01 (tracker_rl_step_share, the tracker's own share of a step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import moe_gspo
from moe_gspo.config import load_config
from moe_gspo.model.routing_capture import RoutingCapture
from moe_gspo.routing import ExpertFlipTracker, RoutingReplayCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--rl-config", default="configs/train_tiny_cpu.yaml",
                    help="the RL run whose micro-batches per step weigh the tracker's once-per-step metrics()")
    args = ap.parse_args()

    cfg = load_config(args.config)
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg)).to(args.device)
    mc, dev = policy.model_config, torch.device(args.device)
    L, k, E = mc.num_hidden_layers, mc.num_experts_per_tok, mc.num_experts
    B, T = cfg.train.micro_batch_size, cfg.train.seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.vocab_size, (B, T + 1), generator=g).to(dev)
    x, y = ids[:, :-1], ids[:, 1:]
    sids = list(range(B))
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).reshape(-1).to(dev)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cache = RoutingReplayCache("r2", L, k, E)
    tracker = ExpertFlipTracker(L, E)
    old = RoutingCapture()
    with torch.no_grad():
        policy(x, routing=old)
    sync()
    t0 = time.perf_counter()
    cache.record_capture(sids, lengths, old)
    tracker.set_reference(sids, old.stacked(), mask)
    sync()
    record_s = time.perf_counter() - t0

    observe_times: list[float] = []
    metrics_times: list[float] = []

    def step(variant: str) -> float:
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if variant == "off":
            logits = policy(x)
        elif variant == "r2":
            src = cache.replay_source(sids, T, device=dev)
            logits = policy(x, routing=RoutingCapture(replay=src, record=False))
            src.check_complete()
        else:
            cap = RoutingCapture()
            logits = policy(x, routing=cap)
            if variant == "flip":
                t1 = time.perf_counter()
                tracker.observe(sids, cap.live_stacked(), mask)
                tracker_dt = time.perf_counter() - t1
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        if variant == "flip":
            t1 = time.perf_counter()
            tracker.metrics()  # one host sync per step, as the trainer logs
            observe_times.append(tracker_dt)
            metrics_times.append(time.perf_counter() - t1)
        sync()
        return time.perf_counter() - t0

    variants = ("off", "r2", "flip", "capture")
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(args.warmup + args.steps):
        for v in variants[i % 4:] + variants[:i % 4]:  # rotate the order too
            dt = step(v)
            if i >= args.warmup:
                times[v].append(dt)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    rl = load_config(args.rl_config)
    micro = max(1, rl.rollout.prompts_per_step * rl.rollout.group_size // rl.train.micro_batch_size)
    observe_s, metrics_s = statistics.median(observe_times), statistics.median(metrics_times)
    res = {
        "device": str(dev), "threads": torch.get_num_threads(), "config": args.config,
        "micro_batch": [B, T], "moe_layers": L, "topk": k, "experts": E, "steps": args.steps,
        "step_s_off": med["off"], "step_s_r2": med["r2"], "step_s_flip": med["flip"],
        "overhead_r2": med["r2"] / med["off"] - 1, "overhead_flip": med["flip"] / med["off"] - 1,
        "step_s_capture": med["capture"], "overhead_capture": med["capture"] / med["off"] - 1,
        "tracker_s": observe_s + metrics_s,  # observe + metrics, timed inside the flip steps
        "tracker_observe_s": observe_s, "tracker_metrics_s": metrics_s,
        "rl_config": args.rl_config, "micro_batches_per_rl_step": micro,
        "tracker_rl_step_share": (micro * observe_s + metrics_s) / (micro * med["off"]),
        "replay_bytes_per_token": cache.bytes_per_token(), "record_s": record_s,
    }
    print(f"{'variant':<10}{'step (ms)':>12}{'overhead':>10}")
    for v in variants:
        over = "" if v == "off" else f"{res[f'overhead_{v}']:+.2%}"
        print(f"{v:<10}{med[v] * 1e3:>12.2f}{over:>10}")
    print(f"replay storage: {res['replay_bytes_per_token']} bytes/token ({L} layers x top-{k}, {cache.dtype}); "
          f"record of {int(lengths.sum())} tokens: {record_s * 1e3:.2f} ms; tracker observe+metrics "
          f"{res['tracker_s'] * 1e3:.2f} ms/step ({res['tracker_s'] / med['off']:.2%} of the off step): observe "
          f"{observe_s * 1e3:.2f} ms per micro-batch, metrics {metrics_s * 1e3:.2f} ms per RL step; at {micro} "
          f"micro-batches per RL step ({args.rl_config}) {res['tracker_rl_step_share']:.2%} of the step's training")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
