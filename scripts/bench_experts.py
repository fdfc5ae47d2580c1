"""Forward+backward of one MoE layer's experts alone: model.experts grouped vs torch vs megatron, and grouped on its
per-expert loop (grouped_loop: where torch._grouped_mm cannot run), same weights and routed rows, timed interleaved in
one process (so background load hits all of them alike).

    python scripts/bench_experts.py [--threads 1] [--iters 20] [--experts 8] [--json runs/bench_experts.json]

Each case is (hidden H, expert width F, routed rows N) with --experts local experts (default 8) and rows spread over
them as a top-2 router over random tokens spreads them (uneven counts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")
CASES = [(64, 128, 512), (128, 256, 2048), (128, 256, 8192), (512, 512, 2048)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--experts", type=int, default=8, help="local experts of the layer")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import moe_gspo
    from moe_gspo.config import ModelConfig

    rows = []
    for H, F, N in CASES:
        mc = ModelConfig(vocab_size=64, hidden_size=H, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=args.experts, num_experts_per_tok=2,
                         moe_intermediate_size=F)
        mods = {}
        for impl in ("grouped", "torch", "megatron", "grouped_loop"):
            source = dataclasses.replace(mc, experts=impl.removesuffix("_loop"))
            p = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
            mods[impl] = p.gpt.decoder.layers[0].mlp.experts
        mods["grouped_loop"].use_grouped_mm = False  # the loop the grouped experts take where _grouped_mm cannot run
        g = torch.Generator().manual_seed(0)
        expert = torch.multinomial(torch.rand(args.experts, generator=g) + 0.2, N, replacement=True, generator=g)
        counts = torch.bincount(expert, minlength=args.experts)
        x = torch.randn(N, H, generator=g)
        probs = torch.rand(N, generator=g)
        dy = torch.randn(N, H, generator=g)

        def step(m):
            xi = x.clone().requires_grad_()
            out, _ = m(xi, counts, probs)
            out.backward(dy)
            m.zero_grad(set_to_none=True)

        secs = {k: [] for k in mods}
        for _ in range(3):
            for m in mods.values():
                step(m)
        for _ in range(args.iters):
            for k, m in mods.items():
                t0 = time.perf_counter()
                step(m)
                secs[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in secs.items()}
        rows.append({"H": H, "F": F, "rows": N, "ms": med})
        print(f"H={H:4d} F={F:4d} rows={N:5d}  " + "  ".join(f"{k} {v:7.2f} ms" for k, v in med.items())
              + f"  grouped vs torch {med['torch'] / med['grouped']:.2f}x, vs megatron "
              f"{med['megatron'] / med['grouped']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "iters": args.iters, "experts": args.experts, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
