"""Benchmark token log-prob implementations: time (median fwd+bwd) and extra memory against naive.

    python scripts/bench_logprob.py --json bench.json [--sizes 1024,1024,151936 ...] [--dtype fp32]

Two groups, each against its own naive baseline measured in the same run:
  plain: naive (logits -> log_softmax -> gather, 6THV) vs chunked / triton / liger / cut-cross-entropy (8THV)
  loss:  naive_loss (naive log-probs + moe_gspo.losses' GSPO under autograd, 6THV) vs fused_loss
         (moe_gspo.train.logprob.fused_policy_loss: the same loss through fused_logprob_loss, 6THV)
`seconds` is wall-clock, or with --clock cpu (CPU device only) the process CPU time, which a busy shared
machine distorts less at --threads 1. extra_bytes = peak allocated memory during fwd+bwd minus the gradients d hidden and d weight (which any
implementation must return); inputs exist before measuring. CPU: the torch profiler's allocation events
(every tensor allocation of the CPU allocator, in time order); CUDA: torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from moe_gspo.kernels import memory, token_logprobs
from moe_gspo.losses import get_policy_loss
from moe_gspo.train.logprob import fused_policy_loss
from moe_gspo.kernels.triton_kernels import available as triton_available

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def inputs(T, H, V, dtype, device, seq=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=g) * H**-0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).to(device, dtype).requires_grad_()
    t = torch.randint(0, V, (T,), generator=g).to(device)
    gl = torch.randn(T, generator=g).to(device)
    cu = torch.arange(0, T + 1, seq).clamp(max=T)
    cu = torch.unique(torch.cat([cu, torch.tensor([T])])).to(device)
    adv = torch.randn(cu.numel() - 1, generator=g).to(device)
    return h, w, t, gl, cu, adv


def naive_logp(h, w, t):
    return torch.log_softmax((h @ w.t()).float(), -1).gather(1, t[:, None]).squeeze(1)


def plain_impls(device):
    impls = {"naive": ("6THV", lambda h, w, t, gl: (naive_logp(h, w, t) * gl).sum().backward()),
             "chunked": ("8THV", lambda h, w, t, gl: (token_logprobs(h, w, t, impl="chunked", chunk_bytes=CHUNK[0])[0] * gl).sum().backward())}
    if device.type == "cuda" and triton_available():
        impls["triton"] = ("8THV", lambda h, w, t, gl: (token_logprobs(h, w, t, impl="triton", chunk_bytes=CHUNK[0])[0] * gl).sum().backward())
    if device.type == "cuda":
        try:  # optional, lazy
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
            liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            impls["liger"] = ("8THV", lambda h, w, t, gl: liger(w, h, t).backward())
        except Exception as e:  # noqa: BLE001 - optional; say why it is missing from the table
            print(f"liger-kernel not benchmarked: {type(e).__name__}: {e}")
        try:
            from cut_cross_entropy import linear_cross_entropy
            impls["cut_cross_entropy"] = ("8THV", lambda h, w, t, gl: linear_cross_entropy(
                h, w, t, reduction="sum").backward())
        except Exception as e:  # noqa: BLE001
            print(f"cut-cross-entropy not benchmarked: {type(e).__name__}: {e}")
    return impls


def loss_impls():
    def naive_loss(h, w, t, gl, cu, adv):
        lp = naive_logp(h, w, t)
        value = get_policy_loss("gspo")(lp, _OLD[0], adv, torch.ones_like(t, dtype=torch.bool), cu_seqlens=cu,
                                        loss_denominator=float(adv.numel()))[0]
        value.backward()

    def fused(h, w, t, gl, cu, adv):
        fused_policy_loss(h, w, t, _OLD[0], adv, cu_seqlens=cu, loss="gspo", chunk_bytes=CHUNK[0])[0].backward()

    return {"naive_loss": ("6THV", naive_loss), "fused_loss": ("6THV", fused)}


_OLD = [None]
CHUNK = [None]  # chunk_bytes for chunked / triton / fused_loss (--chunk-mib)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, args, device, repeats, warmup):
    """(median wall seconds, median process CPU seconds) of fn(*args) after `warmup` calls."""
    wall, cpu = [], []
    for i in range(warmup + repeats):
        for x in args[:2]:
            x.grad = None
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        fn(*args)
        sync(device)
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def peak_bytes(fn, args, device):
    for x in args[:2]:
        x.grad = None
    return memory.peak_bytes(lambda: fn(*args), device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write the records here")
    ap.add_argument("--sizes", nargs="+", default=["1024,1024,151936"], help="T,H,V triples")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="CPU device: time by wall clock or by process CPU time (fairer on a shared machine)")
    ap.add_argument("--seq-len", type=int, default=64,
                    help="tokens per sequence for the loss group (fused_loss does one pass only for sequences that "
                         "fit its workspace: chunk_bytes / (8 V) tokens in fp32)")
    ap.add_argument("--chunk-mib", type=int, default=None,
                    help="chunk_bytes of chunked / triton / fused_loss in MiB (default: the library's for the device)")
    ap.add_argument("--only", nargs="*", default=None, help="subset of implementations (naive baselines always run)")
    args = ap.parse_args(argv)
    CHUNK[0] = (args.chunk_mib << 20) if args.chunk_mib else None
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    if device.type == "cpu":
        try:
            dev_name = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
    records = []
    for spec in args.sizes:
        T, H, V = (int(x) for x in spec.split(","))
        h, w, t, gl, cu, adv = inputs(T, H, V, dtype, device, args.seq_len)
        with torch.no_grad():
            _OLD[0] = naive_logp(h, w, t) + 1e-3 * gl
        grads = (h.numel() + w.numel()) * h.element_size()
        for group, impls, fargs in (("plain", plain_impls(device), (h, w, t, gl)),
                                    ("loss", loss_impls(), (h, w, t, gl, cu, adv))):
            base = None
            for name, (flops, fn) in impls.items():
                if args.only is not None and name not in args.only and not name.startswith("naive"):
                    continue
                sec, cpu_sec = timed(fn, fargs, device, args.repeats, args.warmup)
                if device.type == "cpu" and args.clock == "cpu":
                    sec, cpu_sec = cpu_sec, sec  # `seconds` is CPU time; the wall time is kept as wall_seconds
                extra = max(0, peak_bytes(fn, fargs, device) - grads)
                if base is None:
                    base = (sec, extra)
                rec = dict(group=group, impl=name, T=T, H=H, V=V, dtype=args.dtype, device=dev_name,
                           threads=args.threads, seconds=sec, clock=args.clock if device.type == "cpu" else "wall",
                           wall_seconds=cpu_sec if (device.type == "cpu" and args.clock == "cpu") else sec,
                           extra_bytes=extra, flops_counted=flops,
                           tflops_equiv=int(flops[0]) * T * H * V / sec / 1e12,
                           time_vs_naive=sec / base[0], extra_mem_vs_naive=extra / max(base[1], 1))
                records.append(rec)
                print(f"{group:6s} {name:18s} T={T} H={H} V={V} {args.dtype} {sec:8.3f}s "
                      f"extra {extra / 2**20:9.1f} MiB  x{rec['time_vs_naive']:.2f} time  "
                      f"x{rec['extra_mem_vs_naive']:.3f} mem  {rec['tflops_equiv']:.1f} TFLOP/s ({flops})", flush=True)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    print(f"| group | impl | T | H | V | dtype | device | seconds | extra MiB | flops | TFLOP/s | time/naive | mem/naive |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['group']} | {r['impl']} | {r['T']} | {r['H']} | {r['V']} | {r['dtype']} | {r['device']} | "
              f"{r['seconds']:.3f} | {r['extra_bytes'] / 2**20:.1f} | {r['flops_counted']} | {r['tflops_equiv']:.1f} | "
              f"{r['time_vs_naive']:.2f} | {r['extra_mem_vs_naive']:.3f} |")


if __name__ == "__main__":
    main()
