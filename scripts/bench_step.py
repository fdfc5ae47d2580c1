"""Forward+backward tokens/s of the tiny policy vs transformers' Qwen3MoeForCausalLM on the same weights.

    python scripts/bench_step.py --json runs/bench_step.json [--config configs/tiny_cpu.yaml] [--seq 256]
    python scripts/bench_step.py --device cuda --dtype bfloat16 --config configs/gpu_2b.yaml --json runs/step_gpu.json

Both models are measured in this run, alternating, with the same batch; the table reports medians and the
ratio against transformers. Variants: moe-gspo with SDPA attention (default), with megatron's local unfused
attention, and with the eager twins of the default grouped-GEMM experts (model.experts=torch: the per-expert loop
in plain torch ops; model.experts=megatron: megatron's own expert layers); transformers with its default experts implementation and with eager experts.

--compile adds moe-gspo with model.compile=true (the SDPA policy under torch.compile); its first forward+backward,
which compiles, is timed on its own before the warmup and reported as compile seconds.

--ragged MIN gives the rows lengths drawn uniformly from [MIN, seq] (right padding, as RL batches are): every
model runs the padded batch (transformers with its attention mask) and the loss covers the real tokens only, and
a row "moe-gspo (packed)" runs the same rows packed back to back (MoEPolicy's `lengths`: no padding computed, as
train.max_tokens_per_micro_batch does). Tokens/s count real tokens.

--device cuda runs every model on the GPU (synchronizing before each clock read); --dtype bfloat16 gives the policy
bf16 parameters (model.params_dtype) and loads transformers in bf16, so both compute in bf16. --variants picks the
rows (default: all on the CPU; on CUDA the local-attention and eager-transformers rows are left out, since they
only add time there). Each row also gives model TFLOP/s: 6 x (active parameters that multiply, i.e. without the
input embedding's lookup) x tokens, plus causal attention's 6 x layers x sum(len^2) x heads x head_dim (QK^T and
PV, fwd + bwd, half the square for the causal mask).

--variants expert_loop adds the policy with its grouped experts forced onto their per-expert loop over the stacked
weights (the path they take where torch._grouped_mm does not run), against the default grouped GEMM; on CUDA in
fp32 the default is torch's fallback of _grouped_mm (a C++ loop of GEMMs over the groups after one host read of the
offsets). --tf32 lets fp32 matmuls run on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32 and cudnn's),
for every model alike.

--variants megatron_dispatch adds the policy with megatron's allgather dispatcher in front of its grouped experts
(it reads the expert counts to the host and selects tokens by mask: three host synchronizations per MoE layer per
forward on a GPU), against the default dispatch that keeps the counts on the device (model/dispatch.py).

--optimizer adds a second table: a whole training step (forward, backward, optimizer step with clipping) of the
policy under the trainer's optimizer (megatron DDP buffers, megatron's Adam on fp32 main params, its grad norm and
LR schedule) against the same policy under plain torch.optim.AdamW + clip_grad_norm_, same weights and batch.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")


VARIANTS = ("sdpa", "local", "torch", "megatron", "hf_eager", "expert_loop", "megatron_dispatch")
CUDA_VARIANTS = ("sdpa", "torch", "megatron", "megatron_dispatch")
LOOP = "moe-gspo (megatron-core, SDPA, experts on their loop)"
HOST_DISPATCH = "moe-gspo (megatron-core, SDPA, host-count dispatch)"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, warmup, iters):
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def model_flops(mc, lengths) -> float:
    """Matmul FLOPs of one forward+backward: 6 x active multiplying parameters x tokens + causal attention."""
    _, active = mc.parameter_counts()
    if not mc.tie_word_embeddings:
        active -= mc.vocab_size * mc.hidden_size  # the input embedding is a lookup, not a matmul
    attention = 6 * mc.num_hidden_layers * sum(n * n for n in lengths) * mc.num_attention_heads * mc.head_dim
    return 6 * active * sum(lengths) + attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated, of {','.join(VARIANTS)} (default: all on the CPU, "
                         f"{','.join(CUDA_VARIANTS)} on CUDA)")
    ap.add_argument("--set", nargs="*", default=[], metavar="a.b=v", help="config overrides for every moe-gspo model")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile one step of moe-gspo's default policy and of transformers, and list each "
                         "one's N costliest kernels (torch.profiler; device time on CUDA, CPU time otherwise)")
    ap.add_argument("--tf32", action="store_true", help="TF32 tensor cores for fp32 matmuls (CUDA), every model")
    ap.add_argument("--optimizer", action="store_true", help="also time whole train steps: megatron's optimizer vs AdamW")
    ap.add_argument("--compile", action="store_true", help="also time the policy under model.compile=true")
    ap.add_argument("--ragged", type=int, default=None, metavar="MIN",
                    help="row lengths uniform in [MIN, seq]; adds the packed policy")
    args = ap.parse_args()
    variants = (args.variants or ",".join(CUDA_VARIANTS if args.device == "cuda" else VARIANTS)).split(",")
    if unknown := sorted(set(variants) - set(VARIANTS)):
        raise SystemExit(f"error: --variants: unknown {', '.join(unknown)} (valid: {', '.join(VARIANTS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: CUDA is not available on this machine")
    if args.device == "cpu" and torch.cuda.is_available():
        raise SystemExit("error: --device cpu on a CUDA machine: the policy places itself on the GPU; use "
                         "--device cuda")
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    base_overrides = [f"model.params_dtype={args.dtype}", *args.set]
    if args.threads:
        torch.set_num_threads(args.threads)

    import moe_gspo
    from moe_gspo.config import ConfigError, load_config
    from transformers import Qwen3MoeForCausalLM

    try:  # a comparison's config gives its shared config (load_config leaves its variants out)
        cfg = load_config(args.config, base_overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    d = tempfile.mkdtemp()
    policy.save_pretrained(d)
    V = cfg.model.vocab_size
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, V, (args.batch, args.seq), generator=g).to(device)
    lengths = [args.seq] * args.batch
    if args.ragged:
        lengths = torch.randint(args.ragged, args.seq + 1, (args.batch,), generator=g).tolist()
    real = (torch.arange(args.seq)[None] < torch.tensor(lengths)[:, None]).to(device)  # (B, S) True on real tokens
    y = torch.where(real, y, -100)

    def twin(overrides):
        """A policy of the same weights with overrides on the config."""
        source = load_config(args.config, [*base_overrides, *overrides])
        m = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
        m.load_full_megatron_state(policy.full_megatron_state())
        return m

    def from_hf(**kw):
        return Qwen3MoeForCausalLM.from_pretrained(d, dtype=dtype, **kw).to(device).train()

    models = {}
    if "sdpa" in variants:
        models["moe-gspo (megatron-core, SDPA)"] = policy
    if "local" in variants:
        models["moe-gspo (megatron-core, local attention)"] = twin(["model.attention=megatron"])
    for impl in ("torch", "megatron"):  # the eager twins of the default grouped-GEMM experts
        if impl in variants:
            models[f"moe-gspo (megatron-core, SDPA, {impl} experts)"] = twin([f"model.experts={impl}"])
    if "expert_loop" in variants:
        from moe_gspo.model.experts import GroupedGemmExperts

        looped = twin([])
        experts = [mod for mod in looped.modules() if isinstance(mod, GroupedGemmExperts)]
        if not experts or not all(mod.use_grouped_mm for mod in experts):
            raise SystemExit("error: --variants expert_loop: the policy's experts are not on the grouped GEMM "
                             "(model.experts=grouped, widths of 16-byte rows, a device and dtype _grouped_mm runs)")
        for mod in experts:
            mod.use_grouped_mm = False
        models[LOOP] = looped
    if "megatron_dispatch" in variants:
        from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

        from moe_gspo.model.dispatch import DeviceCountDispatcher

        host = twin([])
        layers = [mod for mod in host.modules() if isinstance(getattr(mod, "token_dispatcher", None),
                                                               DeviceCountDispatcher)]
        if not layers:
            raise SystemExit("error: --variants megatron_dispatch: the policy's MoE layers do not keep their counts "
                             "on the device (model.experts=grouped on a device and dtype _grouped_mm runs)")
        for mod in layers:
            mod.token_dispatcher = MoEAllGatherTokenDispatcher(mod.num_local_experts, mod.local_expert_indices,
                                                               config=mod.config, pg_collection=host.groups)
        models[HOST_DISPATCH] = host
    if args.compile:
        fast = twin(["model.compile=true", "train.max_tokens_per_micro_batch=0"])  # a config may pack; no matter here
        models["moe-gspo (megatron-core, SDPA, torch.compile)"] = fast
    hf = from_hf()  # the baseline: always measured
    models["transformers (default)"] = hf
    if "hf_eager" in variants:
        try:
            models["transformers (eager experts)"] = from_hf(experts_implementation="eager")
        except (TypeError, ValueError):
            pass

    packed = {}
    if args.ragged:
        models["moe-gspo (packed)"] = policy
        packed["moe-gspo (packed)"] = {"lengths": lengths}

    def step_fn(m, name=None):
        def run():
            if name in packed:
                out = m(x, **packed[name])
            elif isinstance(m, torch.nn.Module) and hasattr(m, "generation_config"):  # transformers
                out = m(x, attention_mask=real.long() if args.ragged else None)
            else:
                out = m(x)
            logits = out.logits if hasattr(out, "logits") else out
            torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1)).backward()
            m.zero_grad(set_to_none=True)
        return run

    compile_s = None
    if args.compile:  # compile at the timed shape first, so the table's warmup and steps run compiled code
        compile_s = timed(step_fn(fast), 0, 1)
    with torch.no_grad():  # same weights: outputs agree before timing anything
        diff = (policy(x[:2]).float() - hf(x[:2]).logits.float()).abs().max().item()
    secs = {name: [] for name in models}
    for _ in range(args.warmup):
        for name, m in models.items():
            step_fn(m, name)()
    for _ in range(args.iters):  # interleave so background load hits all models alike
        for name, m in models.items():
            secs[name].append(timed(step_fn(m, name), 0, 1))
    tokens = sum(lengths)
    base = statistics.median(secs["transformers (default)"])
    flops = model_flops(cfg.model, lengths)
    rows = []
    for name, ts in secs.items():
        s = statistics.median(ts)
        rows.append({"impl": name, "seconds": s, "tokens_per_s": tokens / s, "tflops": flops / s / 1e12,
                     "speedup_vs_transformers": base / s})
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "dtype": args.dtype, "tf32": args.tf32, "model_flops_per_step": flops, "overrides": base_overrides,
              "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
              "batch": args.batch, "seq": args.seq, "tokens": tokens, "max_abs_logit_diff": diff,
              "ragged_min": args.ragged, "lengths": lengths,
              "config": args.config, "rows": rows}
    if args.compile:
        result["compile_seconds"] = compile_s
    print(f"fwd+bwd, batch {args.batch} x seq {args.seq}: {tokens} real tokens, {torch.get_num_threads()} threads, "
          f"max |logit diff| moe-gspo vs transformers {diff:.1e}")
    print(f"{'implementation':47s} {'s/step':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'vs transformers':>16s}")
    for r in rows:
        print(f"{r['impl']:47s} {r['seconds']:8.3f} {r['tokens_per_s']:10.0f} {r['tflops']:8.2f} "
              f"{r['speedup_vs_transformers']:15.2f}x")
    if args.compile:
        print(f"torch.compile: first forward+backward (compiling) {compile_s:.1f} s")
    if args.profile:
        result["profile"] = {name: profile_step(name, step_fn(models[name], name), args.profile)
                             for name in ("moe-gspo (megatron-core, SDPA)", LOOP, "transformers (default)")
                             if name in models}
    if args.optimizer:
        result["optimizer_rows"] = optimizer_rows(args, cfg, policy, x, y, V)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def profile_step(label: str, step, top: int) -> list[dict]:
    """The `top` costliest operators and kernels of one step (after one untimed step), by self time on the device
    (CUDA) or the CPU, printed as a table and returned as rows after a first row of the step's wall and busy ms."""
    from torch.profiler import ProfilerActivity, profile

    from moe_gspo.train.metrics import costliest

    cuda = torch.cuda.is_available()
    step()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    busy, rows = costliest(prof.key_averages(), top)
    # on a GPU, busy time well under the wall time means the step waits on launches and host syncs, not kernels
    print(f"\none step of {label}, profiled: {wall * 1e3:.1f} ms wall (under the profiler), "
          f"{busy:.1f} ms {'of kernels on the device' if cuda else 'of CPU self time'}\n"
          f"{'operator or kernel':70s} {'calls':>6s} {'self ms':>9s} {'share':>6s}")
    for r in rows:
        print(f"{r['name'][:70]:70s} {r['calls']:6d} {r['ms']:9.2f} {r['share']:6.1%}")
    return [{"name": "(step)", "wall_ms": wall * 1e3, "busy_ms": busy}, *rows]


def optimizer_rows(args, cfg, policy, x, y, V):
    """Seconds per train step (fwd + bwd + optimizer) with the trainer's megatron optimizer vs torch AdamW."""
    import moe_gspo
    from moe_gspo.train.optim import Optimizer, wrap_ddp

    mega = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    mega.load_full_megatron_state(policy.full_megatron_state())
    opt = Optimizer.from_config(wrap_ddp(mega, False), mega, cfg.train, total_steps=10**6)
    plain = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    plain.load_full_megatron_state(policy.full_megatron_state())
    adamw = torch.optim.AdamW(plain.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)

    def loss(m):
        return torch.nn.functional.cross_entropy(m(x).reshape(-1, V), y.reshape(-1))

    def mega_step():
        opt.zero_grad()
        loss(mega).backward()
        opt.step()

    def plain_step():
        adamw.zero_grad(set_to_none=True)
        loss(plain).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.train.grad_clip)
        adamw.step()

    steps = {"megatron optimizer (DDP buffers, fp32 main params, clip, schedule)": mega_step,
             "torch AdamW + clip_grad_norm_": plain_step}
    for _ in range(args.warmup):
        for fn in steps.values():
            fn()
    secs = {k: [] for k in steps}
    for _ in range(args.iters):
        for k, fn in steps.items():
            secs[k].append(timed(fn, 0, 1))
    base = statistics.median(secs["torch AdamW + clip_grad_norm_"])
    rows = [{"impl": k, "seconds": statistics.median(v), "time_vs_adamw": statistics.median(v) / base}
            for k, v in secs.items()]
    print(f"\ntrain step (fwd + bwd + optimizer), {args.batch} x {args.seq} tokens")
    for r in rows:
        print(f"{r['impl']:70s} {r['seconds']:8.3f} s  x{r['time_vs_adamw']:.3f}")
    return rows


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # the policy's one-process group (NCCL on a GPU)
        torch.distributed.destroy_process_group()
