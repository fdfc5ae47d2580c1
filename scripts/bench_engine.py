"""Rollout engine benchmarks: generation tokens/s of the hf_static engine against the hf engine, and the time of a
weight sync from the policy into the engine, tensor by tensor and in buckets.

    python scripts/bench_engine.py --device cuda --config configs/gpu_2b.yaml --json runs/bench_engine.json
        [--prompts 32] [--group 8] [--max-new-tokens 256] [--repeats 3] [--what generate,sync]
        [--buckets 0,67108864,268435456,1073741824] [--set a.b=v ...]

One policy is built from the config (random weights at its seed; bf16 with --device cuda) and both engines are
built from it, computing in rollout.engine_dtype, on the policy's device.
- generate: each engine samples --group responses for each of --prompts prompts (the config's task, the prompts of
  RL step 0) at the config's temperature, --max-new-tokens long at most. The first call of each engine is a warm-up
  (on CUDA it compiles and captures the hf_static decode step); then --repeats timed calls, engines alternating.
  Tokens/s counts response tokens (and, apart, prompt + response tokens) over the call's wall time. Agreement: the
  two engines' greedy responses for the first prompts, compared token for token (bf16 rounding can flip a
  near-tie, so a figure under 1 on CUDA is not by itself a fault).
- sync: HFEngine.update_weights(policy) at each bucket size (0: tensor by tensor), one warm-up, then the median of
  --repeats; GB/s is the engine's parameter bytes over that time. The synced weights are compared bit for bit with
  those of the tensor-by-tensor sync.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_OVERRIDES = {"cpu": ["model.params_dtype=float32", "rollout.engine_dtype=float32"],
                    "cuda": ["model.params_dtype=bfloat16", "rollout.engine_dtype=bfloat16", "parallel.tp=1",
                             "parallel.ep=1", "parallel.backend=nccl"]}


def load_cfg(path: str, device: str, extra: list[str]):
    from moe_gspo.config import apply_overrides, config_from_dict, read_yaml

    data = read_yaml(path)
    data.pop("compare", None)
    return config_from_dict(apply_overrides(data, DEVICE_OVERRIDES[device] + list(extra)))


def timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def bench_generate(hf, cfg, prompts, args, sync) -> dict:
    import torch

    from moe_gspo.rollout import SamplingParams
    from moe_gspo.rollout.hf_static import StaticHFEngine

    # the static engine decodes the hf engine's own module: one copy of the weights for both
    engines = {"hf": hf, "hf_static": StaticHFEngine(hf.model, tokenizer=hf.tokenizer, device=hf.device,
                                                     dtype=hf.dtype, cuda_graphs=cfg.rollout.cuda_graphs)}
    sp = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                        max_new_tokens=args.max_new_tokens, seed=0, return_routing=True)
    runs = {name: [] for name in engines}
    for rep in range(args.repeats + 1):
        for name, eng in engines.items():
            batch, s = timed(lambda: eng.generate(prompts, args.group, sp), sync)
            if rep:  # the first call of each engine is the warm-up
                resp = int(batch.response_lengths.sum())
                runs[name].append({"seconds": s, "response_tokens": resp,
                                   "tokens": resp + sum(int(p.numel()) for p in batch.prompt_ids)})
    rows = []
    for name, rs in runs.items():
        med = statistics.median(r["seconds"] for r in rs)
        rows.append({"engine": name, "median_s": med, "runs": rs,
                     "response_tokens_per_s": statistics.median(r["response_tokens"] / r["seconds"] for r in rs),
                     "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in rs)})
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    few = prompts[:args.agreement_prompts]
    a, b = (engines[n].generate(few, 1, greedy) for n in ("hf", "hf_static"))

    same = [torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids)]
    speed = rows[1]["response_tokens_per_s"] / rows[0]["response_tokens_per_s"]
    return {"rows": rows, "hf_static_vs_hf": speed, "greedy_identical_fraction": sum(same) / len(same),
            "compiled": engines["hf_static"].compiled,
            "decode_experts": engines["hf_static"]._decode_experts(len(prompts) * args.group)}


def bench_sync(eng, policy, args, sync) -> dict:
    import torch

    nbytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    reference, rows = None, []
    for bucket in args.buckets:
        eng.sync_bucket_bytes = bucket
        eng.update_weights(policy)  # warm-up
        secs = [timed(lambda: eng.update_weights(policy), sync)[1] for _ in range(args.repeats)]
        state = eng.model.state_dict()
        if reference is None:  # the tensor-by-tensor sync, or the first size asked for
            reference = {k: v.clone() for k, v in state.items()}
        med = statistics.median(secs)
        rows.append({"bucket_bytes": bucket, "median_s": med, "seconds": secs, "GB_per_s": nbytes / med / 1e9,
                     "copies": eng.last_sync_copies,
                     "bit_equal": all(torch.equal(state[k], v) for k, v in reference.items())})
    return {"engine_bytes": nbytes, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--config", default=str(ROOT / "configs" / "gpu_2b.yaml"))
    ap.add_argument("--what", default="generate,sync", help="comma-separated, of generate, sync")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per call (default rollout.prompts_per_step)")
    ap.add_argument("--group", type=int, default=None, help="responses per prompt (default rollout.group_size)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--agreement-prompts", type=int, default=8)
    ap.add_argument("--buckets", default="0,67108864,268435456,1073741824",
                    help="comma-separated bucket sizes in bytes (0: tensor by tensor)")
    ap.add_argument("--set", nargs="*", default=[], metavar="a.b=v", help="config overrides")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_engine.py: error: --device cuda: no CUDA device is available on this machine", file=sys.stderr)
        sys.exit(2)
    what = args.what.split(",")
    if bad := [w for w in what if w not in ("generate", "sync")]:
        ap.error(f"--what: unknown {bad}; valid: ['generate', 'sync']")
    try:
        args.buckets = [int(b) for b in args.buckets.split(",")]
    except ValueError:
        ap.error(f"--buckets {args.buckets!r}: comma-separated integers (bytes) expected")
    if args.repeats < 1 or args.max_new_tokens < 1 or min(args.buckets) < 0:
        ap.error("--repeats and --max-new-tokens must be >= 1, --buckets >= 0")

    import moe_gspo
    from moe_gspo.config import UserError
    from moe_gspo.tasks import CharTokenizer, task_from_config
    from moe_gspo.train import data

    try:
        cfg = load_cfg(args.config, args.device, args.set)
    except UserError as e:
        print(f"bench_engine.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    args.prompts = args.prompts or cfg.rollout.prompts_per_step
    args.group = args.group or cfg.rollout.group_size
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    policy = moe_gspo.load_policy(cfg)
    policy.eval()
    task, tok = task_from_config(cfg.rollout), CharTokenizer()
    prompts = [tok.encode(ex.prompt, bos=True) for ex in data.step_examples(task, cfg.train.seed, 0, 0, args.prompts)]
    total, active = cfg.model.parameter_counts()
    result = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "config": args.config, "set": args.set, "parameters": total, "active_parameters": active,
              "engine_dtype": cfg.rollout.engine_dtype, "prompts": args.prompts, "group": args.group,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__}}
    from moe_gspo.rollout.hf_engine import HFEngine

    hf = HFEngine(policy, tokenizer=tok, device=policy.device, dtype=getattr(torch, cfg.rollout.engine_dtype))
    if "generate" in what:
        result["generate"] = g = bench_generate(hf, cfg, prompts, args, sync)
        for r in g["rows"]:
            print(f"generate {r['engine']:9s} {r['median_s']:.3f} s  {r['response_tokens_per_s']:.0f} response "
                  f"tok/s  {r['tokens_per_s']:.0f} tok/s")
        print(f"hf_static / hf: {g['hf_static_vs_hf']:.2f}x (compiled {g['compiled']}, decode experts "
              f"{g['decode_experts']}); identical greedy responses {g['greedy_identical_fraction']:.2f}")
    if "sync" in what:
        result["sync"] = s = bench_sync(hf, policy, args, sync)
        for r in s["rows"]:
            print(f"sync bucket {r['bucket_bytes']:>11d} B  {r['median_s']:.4f} s  {r['GB_per_s']:.1f} GB/s  "
                  f"{r['copies']} copies  bit-equal {r['bit_equal']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
