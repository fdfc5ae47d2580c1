"""Checks that need CUDA: compiled Triton kernels at full size, the policy on the GPU against transformers, the
Transformer Engine spec against the local one, NCCL, and RL/LM training on the GPU against the CPU.

Every test here skips on a machine without CUDA (CI); `scripts/gpu_check.sh` runs them on a GPU machine. When
GPU_CHECK_RECORDS names a file, each test appends its measured figures to it as JSON lines, which gpu_check.sh
folds into one results file.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, free_port, tiny_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def record(name: str, **values) -> None:
    path = os.environ.get("GPU_CHECK_RECORDS")
    print(name, json.dumps(values))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"check": name, **values}) + "\n")


def _f64_reference(h, w, t, temperature, gl, ge, chunk=512):
    """float64 (logp, entropy, d hidden, d weight) of sum(gl * logp + ge * entropy), chunked over tokens so that
    no [T, V] float64 tensor exists; gradients written out by hand:
    d logp / dz = onehot - p,  d entropy / dz = -p * (log p + entropy), both divided by the temperature."""
    T = h.shape[0]
    w64 = w.double()
    dw = torch.zeros_like(w64)
    lps, ents, dhs = [], [], []
    for a in range(0, T, chunk):
        hc = h[a:a + chunk].double()
        z = hc @ w64.t() / temperature
        ls = torch.log_softmax(z, -1)
        del z
        p = ls.exp()
        tc = t[a:a + chunk]
        lp = ls.gather(1, tc[:, None]).squeeze(1)
        ent = -(p * ls).sum(-1)
        dz = -ge[a:a + chunk].double()[:, None] * p * (ls + ent[:, None])
        del ls
        dz -= gl[a:a + chunk].double()[:, None] * p
        del p
        dz.scatter_add_(1, tc[:, None], gl[a:a + chunk].double()[:, None])
        dz /= temperature
        dhs.append(dz @ w64)
        dw += dz.t() @ hc
        lps.append(lp), ents.append(ent)
        del dz
    return torch.cat(lps), torch.cat(ents), torch.cat(dhs), dw


def _rel(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("impl", ["triton", "chunked"])
def test_logprob_kernel_full_size_bf16_vs_float64(impl):
    """T=16384, H=4096, V=151936 (Qwen3's vocabulary) in bf16: log-probs, entropy and both gradients against
    float64; the compiled Triton kernel and the chunked torch path both run."""
    from moe_gspo.kernels import token_logprobs

    T, H, V = (int(x) for x in os.environ.get("GPU_CHECK_LOGPROB_SIZE", "16384,4096,151936").split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(T, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.5).bfloat16()
    t = torch.randint(0, V, (T,), device="cuda", generator=g)
    gl, ge = torch.randn(T, device="cuda", generator=g), torch.randn(T, device="cuda", generator=g)
    temperature = 0.9
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def run():
        hg.grad = wg.grad = None
        lp, ent = token_logprobs(hg, wg, t, temperature=temperature, return_entropy=True, impl=impl)
        (lp * gl + ent * ge).sum().backward()
        return lp.detach(), ent.detach()

    lp, ent = run()
    ref = _f64_reference(h, w, t, temperature, gl, ge)
    errs = {"logp_abs": float((lp.double() - ref[0]).abs().max()), "entropy_abs": float((ent.double() - ref[1]).abs().max()),
            "d_hidden_rel": _rel(hg.grad, ref[2]), "d_weight_rel": _rel(wg.grad, ref[3])}
    record(f"logprob_{impl}_bf16_vs_f64", T=T, H=H, V=V, **errs,
           device=torch.cuda.get_device_name())
    # bf16 inputs are exact in float64. The Triton kernel accumulates logits in fp32 and never rounds them; the
    # chunked path takes torch's bf16 matmul, whose logits are rounded to bf16 (|z| 2^-9, a few 1e-3 here) before
    # its fp32 softmax. Both write bf16 gradients (relative 2^-8).
    tol = 1e-4 if impl == "triton" else 1e-2
    assert errs["logp_abs"] < tol and errs["entropy_abs"] < tol, errs
    assert errs["d_hidden_rel"] < 2e-2 and errs["d_weight_rel"] < 2e-2, errs


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    tiny_hf_model(vocab=512, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, experts=16, topk=4, inter=128,
                  seed=3, std=0.05).save_pretrained(str(d))
    return d


def _hf_routing(out, k):
    return torch.stack([torch.topk(r.float(), k, dim=-1).indices.sort(-1).values for r in out.router_logits], 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_policy_on_cuda_matches_transformers(hf_dir, dtype):
    """The megatron policy on the GPU against transformers' Qwen3-MoE on the GPU, same weights: logits, top-k
    experts and gradients (fp32 to 1e-4; bf16 within bf16 rounding, routing compared where scores are untied)."""
    import moe_gspo
    from moe_gspo.config import ModelConfig
    from moe_gspo.model.routing_capture import RoutingCapture
    from transformers import Qwen3MoeForCausalLM

    dt = getattr(torch, dtype)
    source = ModelConfig(init_from=str(hf_dir), params_dtype=dtype)
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    assert policy.device.type == "cuda"
    hf = Qwen3MoeForCausalLM.from_pretrained(str(hf_dir), dtype=dt).cuda()
    hf32 = Qwen3MoeForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).cuda() if dt != torch.float32 else hf
    x = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(1)).cuda()
    cap = RoutingCapture()
    out = policy(x, routing=cap)
    ref = hf(x.cuda(), output_router_logits=True)
    logit_rel = _rel(out.float(), ref.logits.float())
    k = hf.config.num_experts_per_tok
    same = (cap.stacked().cpu() == _hf_routing(ref, k).cpu()).all(-1).float().mean().item()
    torch.nn.functional.cross_entropy(out.float().reshape(-1, 512), y.reshape(-1)).backward()
    torch.nn.functional.cross_entropy(ref.logits.float().reshape(-1, 512), y.reshape(-1)).backward()
    hp, mp = dict(hf.named_parameters()), dict(policy.gpt.named_parameters())
    pairs = {"lm_head.weight": "output_layer.weight",
             "model.layers.1.mlp.gate.weight": "decoder.layers.1.mlp.router.weight",
             "model.layers.2.self_attn.o_proj.weight": "decoder.layers.2.self_attention.linear_proj.weight",
             "model.embed_tokens.weight": "embedding.word_embeddings.weight"}
    grad_rel = max(_rel(mp[m].grad.float(), hp[h].grad.float()) for h, m in pairs.items())
    if dt == torch.float32:
        record(f"policy_vs_transformers_{dtype}", logit_rel=logit_rel, routing_same_frac=same, grad_rel=grad_rel,
               device=torch.cuda.get_device_name())
        assert logit_rel < 1e-4 and same == 1.0 and grad_rel < 1e-3
        return
    # bf16: both implementations round differently and near-tied router scores flip, so each is measured
    # against transformers in fp32, and the policy's bf16 error must stay within 2x transformers' own
    ref32 = hf32(x.cuda(), output_router_logits=True)
    torch.nn.functional.cross_entropy(ref32.logits.reshape(-1, 512), y.reshape(-1)).backward()
    h32 = dict(hf32.named_parameters())
    ours = {"logit_rel": _rel(out.float(), ref32.logits),
            "routing_same_frac": (cap.stacked().cpu() == _hf_routing(ref32, k).cpu()).all(-1).float().mean().item(),
            "grad_rel": max(_rel(mp[m].grad.float(), h32[h].grad) for h, m in pairs.items())}
    theirs = {"logit_rel": _rel(ref.logits.float(), ref32.logits),
              "routing_same_frac": (_hf_routing(ref, k).cpu() == _hf_routing(ref32, k).cpu()).all(-1).float().mean().item(),
              "grad_rel": max(_rel(hp[h].grad.float(), h32[h].grad) for h in pairs)}
    record("policy_vs_transformers_bfloat16", policy_vs_fp32=ours, transformers_bf16_vs_fp32=theirs,
           policy_vs_transformers_bf16={"logit_rel": logit_rel, "routing_same_frac": same, "grad_rel": grad_rel},
           device=torch.cuda.get_device_name())
    assert ours["logit_rel"] <= 2 * theirs["logit_rel"] and ours["grad_rel"] <= 2 * theirs["grad_rel"]
    assert ours["routing_same_frac"] >= theirs["routing_same_frac"] - 0.02


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_experts_on_cuda_match_sequential_mlp(hf_dir, dtype):
    """The default grouped experts on the GPU take torch._grouped_mm in both dtypes (bf16: CUTLASS's grouped GEMM on
    sm90+; fp32: torch's fallback loop of GEMMs) and equal megatron's SequentialMLP on the same weights: logits and
    every parameter gradient, experts' included (per expert, under SequentialMLP's names)."""
    import moe_gspo
    from moe_gspo.config import ModelConfig

    def build(experts):
        source = ModelConfig(init_from=str(hf_dir), params_dtype=dtype, experts=experts)
        return moe_gspo.load_policy(source, moe_gspo.init_parallel(source))

    fast, ref = build("grouped"), build("megatron")
    assert all(layer.mlp.experts.use_grouped_mm for layer in fast.gpt.decoder.layers)
    x = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(1)).cuda()
    results = []
    for policy in (fast, ref):
        out = policy(x)
        torch.nn.functional.cross_entropy(out.float().reshape(-1, 512), y.reshape(-1)).backward()
        results.append((out.detach().float(),
                        policy.per_expert({n: p.grad.float() for n, p in policy.gpt.named_parameters()})))
    (out_f, grads_f), (out_r, grads_r) = results
    logit_rel = _rel(out_f, out_r)
    grad_rel = max(_rel(grads_f[n], g) for n, g in grads_r.items() if g.abs().max() > 0)
    record(f"grouped_vs_sequential_mlp_{dtype}", logit_rel=logit_rel, grad_rel=grad_rel,
           device=torch.cuda.get_device_name())
    assert grads_f.keys() == grads_r.keys()
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert logit_rel < tol and grad_rel < 10 * tol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_count_dispatch_on_cuda_reads_nothing_back(hf_dir, dtype, monkeypatch):
    """The grouped experts' dispatch (model/dispatch.py) on the GPU: a forward and backward takes no host sync in
    the MoE layers (torch's sync debug mode), where megatron's allgather dispatch takes three per layer, and the
    logits and gradients equal those behind megatron's dispatch (the experts' rows padded to 16 bytes on CUDA)."""
    import moe_gspo
    from moe_gspo.config import ModelConfig
    from moe_gspo.model import dispatch
    from moe_gspo.train.host_reads import host_syncs

    def build():
        source = ModelConfig(init_from=str(hf_dir), params_dtype=dtype)
        return moe_gspo.load_policy(source, moe_gspo.init_parallel(source))

    x = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 512, (4, 96), generator=torch.Generator().manual_seed(1)).cuda()
    ours = build()
    assert all(isinstance(layer.mlp.token_dispatcher, dispatch.DeviceCountDispatcher)
               for layer in ours.gpt.decoder.layers)
    monkeypatch.setattr(dispatch, "device_counts_apply", lambda layer: False)
    host = build()
    results, syncs = [], []
    for policy in (ours, host):
        policy(x)  # warm-up: kernels loaded, the allocator filled
        torch.cuda.synchronize()
        with host_syncs() as sites:
            out = policy(x)
            torch.nn.functional.cross_entropy(out.float().reshape(-1, 512), y.reshape(-1)).backward()
        torch.cuda.synchronize()
        syncs.append(dict(sites))
        results.append((out.detach().float(), {n: p.grad.float() for n, p in policy.gpt.named_parameters()}))
    (out_o, grads_o), (out_h, grads_h) = results
    layer_files = ("megatron/core/transformer/moe/", "moe_gspo/model/dispatch.py", "moe_gspo/model/experts.py",
                   "moe_gspo/model/router.py")  # the MoE layer's own code, megatron's and ours
    moe = [{s: n for s, n in d.items() if s.startswith(layer_files)} for d in syncs]
    logit_rel = _rel(out_o, out_h)
    grad_rel = max(_rel(grads_o[n], g) for n, g in grads_h.items() if g.abs().max() > 0)
    record(f"device_count_dispatch_{dtype}", syncs_ours=syncs[0], syncs_megatron=syncs[1], logit_rel=logit_rel,
           grad_rel=grad_rel, device=torch.cuda.get_device_name())
    assert moe[0] == {}, moe[0]
    assert sum(moe[1].values()) >= 3 * len(host.gpt.decoder.layers), moe[1]
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert logit_rel < tol and grad_rel < 10 * tol


@pytest.mark.parametrize("experts", ["grouped", "megatron"])
def test_te_spec_matches_local_spec(hf_dir, experts):
    """Transformer Engine's layer spec against the local spec on the same weights (fp32), loaded through the name
    table (moe_gspo/model/te_names.py): the HF export bit for bit, logits, routing and every gradient.
    grouped: TEGroupedMLP; megatron: SequentialMLP of TE linears. The CPU version, on megatron's TE spec over
    stand-in TE classes: tests/test_te_names.py."""
    from moe_gspo.model.spec import te_missing

    if te_missing():
        pytest.skip(f"model.spec=te cannot run here: {te_missing()}")
    import moe_gspo
    from moe_gspo.config import ModelConfig
    from moe_gspo.model.routing_capture import RoutingCapture

    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    outs, routes, grads, hf = {}, {}, {}, {}
    for spec in ("local", "te"):
        source = ModelConfig(init_from=str(hf_dir), spec=spec, experts=experts)
        policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
        hf[spec] = policy.export_hf()[1]
        cap = RoutingCapture()
        outs[spec] = policy(x, routing=cap).float()
        torch.nn.functional.cross_entropy(outs[spec].reshape(-1, 512), y.reshape(-1)).backward()
        routes[spec] = cap.stacked()
        grads[spec] = policy.per_expert({n: p.grad for n, p in policy.gpt.named_parameters()})
    assert list(hf["te"]) == list(hf["local"]) and all(torch.equal(hf["te"][k], hf["local"][k]) for k in hf["te"])
    rel = _rel(outs["te"].detach(), outs["local"].detach())
    same = (routes["te"] == routes["local"]).all(-1).float().mean().item()
    assert set(grads["te"]) == set(grads["local"])
    grad_rel = max(_rel(grads["te"][k].float(), grads["local"][k].float()) for k in grads["local"])
    record(f"te_vs_local_fp32_{experts}", logit_rel=rel, routing_same_frac=same, grad_rel=grad_rel)
    assert rel < 1e-3 and same == 1.0 and grad_rel < 1e-2


def _train(args: list[str], out: Path, cuda: bool, timeout=600) -> list[dict]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "4")
    r = subprocess.run([sys.executable, "-m", "moe_gspo.cli", *args, f"train.out_dir={out}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


RL = ["train", "--config", "configs/train_tiny_cpu.yaml", "train.steps=4", "train.cold_start_steps=40",
      "logging.progress=false", "train.checkpoint_every=2"]


def test_rl_training_on_cuda_matches_cpu(tmp_path):
    """The RL loop on the GPU (NCCL group, megatron optimizer, HF engine on the GPU) against the same run on the
    CPU (gloo) from the same initial weights: the same rollouts in the first step and the same loss to fp32
    tolerance."""
    # no cold start: 40 Adam steps on two devices drift apart by rounding, and sampling amplifies any drift
    args = RL + ["train.cold_start_steps=0"]
    gpu = _train(args, tmp_path / "gpu", cuda=True)
    cpu = _train(args, tmp_path / "cpu", cuda=False)
    keys = ["reward/mean", "pg_loss", "grad_norm", "entropy"]
    record("rl_cuda_vs_cpu_step1", **{f"gpu_{k}": gpu[0].get(k) for k in keys},
           **{f"cpu_{k}": cpu[0].get(k) for k in keys}, gpu_step_s=[m["time/step"] for m in gpu],
           cpu_step_s=[m["time/step"] for m in cpu])
    assert gpu[0]["reward/mean"] == cpu[0]["reward/mean"]
    assert abs(gpu[0]["pg_loss"] - cpu[0]["pg_loss"]) <= 1e-3 * max(1.0, abs(cpu[0]["pg_loss"]))
    # the untrained policy may earn no reward (then the loss is 0 on both); the entropy of the same responses
    # under the same weights is the figure that always carries the forward of both devices
    assert abs(gpu[0]["entropy"] - cpu[0]["entropy"]) <= 1e-3 * cpu[0]["entropy"]
    assert (tmp_path / "gpu" / "checkpoints").is_dir()


@pytest.mark.parametrize("variant", [["algorithm.loss=gspo"], ["algorithm.loss=grpo", "algorithm.routing_replay=r3"],
                                     ["algorithm.loss=grpo", "algorithm.routing_replay=r2", "algorithm.kl_beta=0.01"],
                                     ["algorithm.loss=gspo", "train.max_tokens_per_micro_batch=96"]],
                         ids=["gspo", "grpo_r3", "grpo_r2_kl", "gspo_packed"])
def test_rl_training_bf16_on_cuda(tmp_path, variant):
    """bf16 weights with fp32 main parameters on the GPU: every logged figure finite, the run resumes."""
    import math

    args = RL + ["model.params_dtype=bfloat16", "rollout.engine_dtype=bfloat16", *variant]
    m = _train(args, tmp_path / "run", cuda=True)
    record("rl_bf16_" + "_".join(v.split("=")[1] for v in variant), steps=len(m),
           pg_loss=[x["pg_loss"] for x in m], grad_norm=[x["grad_norm"] for x in m],
           reward=[x["reward/mean"] for x in m], step_s=[x["time/step"] for x in m],
           train_vs_engine=[x.get("rollout_logprobs_diff_max") for x in m])
    assert len(m) == 4
    assert all(math.isfinite(v) for x in m for v in x.values() if isinstance(v, float))
    m2 = _train(["train", "--resume", *args[1:], "train.steps=6"], tmp_path / "run", cuda=True)
    assert [x["step"] for x in m2][-2:] == [5, 6]


def test_lm_training_on_cuda(tmp_path):
    """train-lm on the GPU in bf16: the loss falls below log V within 30 steps."""
    import math

    out = tmp_path / "lm"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "moe_gspo.cli", "train-lm", "--config", "configs/tiny_cpu.yaml",
                        "train.steps=30", "model.params_dtype=bfloat16", f"train.out_dir={out}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    hist = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    record("lm_bf16", loss=[h["loss"] for h in hist][::5], tokens_per_s=hist[-1]["tokens_per_s"])
    assert math.isfinite(hist[-1]["loss"]) and hist[-1]["loss"] < 0.8 * hist[0]["loss"]


def test_nccl_group_is_used():
    """A one-process group on the GPU is NCCL and its collectives work on CUDA tensors."""
    import torch.distributed as dist

    from moe_gspo.parallel.state import init_distributed

    init_distributed("auto")
    assert dist.get_backend() == "nccl"
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    record("nccl", backend=dist.get_backend(), world=dist.get_world_size(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    assert x.sum().item() == 4.0


def test_vllm_engine_sleeps_and_wakes_with_its_weights():
    """rollout.engine_sleep on a GPU with CUDA vLLM: sleep (level 1) gives device memory back, wake restores the
    engine, and after a weight sync it samples what it sampled before sleeping (same weights, same seed)."""
    pytest.importorskip("vllm", reason="the vLLM engine's CUDA path needs CUDA vllm")
    import moe_gspo
    from moe_gspo.config import load_config
    from moe_gspo.rollout import SamplingParams
    from moe_gspo.rollout.vllm.engine import VLLMEngine

    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["model.head_dim=32"])
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))  # on the GPU: CUDA is present
    eng = VLLMEngine(policy.weights(), dtype="bfloat16", sleep_mode=True, gpu_memory_utilization=0.3)
    sp = SamplingParams(max_new_tokens=16, seed=3)
    before = eng.generate([[1, 20, 21, 22]], 4, sp)
    free_awake = torch.cuda.mem_get_info()[0]
    eng.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    eng.wake()
    eng.update_weights(policy.weights())
    after = eng.generate([[1, 20, 21, 22]], 4, sp)
    total = torch.cuda.mem_get_info()[1]
    record("vllm_sleep", freed_mb=freed / 2**20, total_mb=total / 2**20)
    # the engine holds 0.3 of the GPU (gpu_memory_utilization), nearly all of it KV cache for a model this small;
    # sleep level 1 discards the cache and moves the weights to the host, so most of that 0.3 comes back
    assert freed >= 0.2 * total, (freed / 2**20, total / 2**20)
    assert all(a.tolist() == b.tolist() for a, b in zip(before.response_ids, after.response_ids))
    eng.close()


def test_device_busy_time_counts_each_kernel_once():
    """A profile's kernel time (what bench_step and logging.profile_step report) against CUDA events around the
    same back-to-back matmuls: equal within launch gaps, not doubled by the operators' own device-time rows."""
    from torch.profiler import ProfilerActivity, profile

    from moe_gspo.train.metrics import device_busy_ms

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            a @ a
        end.record()
        torch.cuda.synchronize()
    elapsed = start.elapsed_time(end)
    busy = device_busy_ms(prof.key_averages())
    record("profile_busy_vs_events", busy_ms=busy, events_ms=elapsed, device=torch.cuda.get_device_name())
    assert 0.7 * elapsed <= busy <= 1.05 * elapsed


def _reads_a_value_back(x):
    return x.sum().item()


def test_host_syncs_are_counted_at_their_call_site_on_cuda():
    """torch's sync debug mode, as logging.profile_step reports it: an .item() on a CUDA tensor counts once, at the
    line of our code that asked for it; device-only work counts nothing; the mode is restored afterwards."""
    from moe_gspo.train.metrics import host_syncs

    x = torch.ones(16, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    with host_syncs() as sites:
        y = x * 2 + 1  # no sync
        for _ in range(2):
            _reads_a_value_back(y)
    line = _reads_a_value_back.__code__.co_firstlineno + 1
    record("host_syncs", sites=dict(sites), device=torch.cuda.get_device_name())
    assert sites[f"tests/test_gpu.py:{line} (_reads_a_value_back)"] == 2 and sum(sites.values()) == 2, dict(sites)
    assert torch.cuda.get_sync_debug_mode() == before


def test_grouped_mm_with_unaligned_groups_on_cuda():
    """Whether CUDA's bf16 grouped GEMM takes groups whose row counts are not multiples of 8 (16 bytes) in the
    backward (the weight gradient's 2D x 2D product over each group's rows): the experts pad every group to that
    multiple on a GPU (align_rows), as torchtitan does; transformers does not pad. If the kernel takes them, its
    output and both gradients must equal a per-group fp32 reference, and the padding is a cost to drop; if it
    refuses, the test skips saying so."""
    from moe_gspo.model.experts import grouped_mm

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [3, 0, 13, 5, 9, 1, 0, 17]
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), 64, device="cuda", generator=g).bfloat16().requires_grad_()
    w = torch.randn(len(counts), 64, 48, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(sum(counts), 48, device="cuda", generator=g).bfloat16()
    try:
        y = grouped_mm(x, w, offs)
        y.backward(dy)
        torch.cuda.synchronize()
    except RuntimeError as e:
        record("grouped_mm_unaligned_groups", runs=False, error=str(e)[:300], device=torch.cuda.get_device_name())
        pytest.skip(f"bf16 _grouped_mm refuses unaligned groups, the padding is needed: {str(e)[:200]}")
    xs, dys = x.detach().float().split(counts), dy.float().split(counts)
    ref_y = torch.cat([xe @ w[e].detach().float() for e, xe in enumerate(xs)])
    ref_dx = torch.cat([de @ w[e].detach().float().t() for e, de in enumerate(dys)])
    ref_dw = torch.stack([xe.t() @ de for xe, de in zip(xs, dys)])
    errs = {name: _rel(got.float(), want) for name, got, want in
            (("y", y, ref_y), ("dx", x.grad, ref_dx), ("dw", w.grad, ref_dw))}
    record("grouped_mm_unaligned_groups", runs=True, **errs, device=torch.cuda.get_device_name())
    assert max(errs.values()) < 2e-2, errs


def test_separate_placement_on_one_gpu_equals_colocated(tmp_path):
    """rollout.placement=separate on one GPU: a trainer rank and an hf engine rank (torchrun, 2 processes; each
    side's group has one rank, so NCCL sees the GPU once, and the bridge between them is gloo). The engine generates
    on CUDA (its device is the rank's, never where the pushed weights arrive), and with train.max_staleness=0 the
    run logs what the colocated run on the same GPU logs."""
    args = [*RL[1:], "train.cold_start_steps=0", "train.steps=2", "train.checkpoint_every=0",
            "rollout.engine=hf", "algorithm.loss=grpo", "algorithm.routing_replay=r3"]
    col = _train(["train", *args], tmp_path / "colocated", cuda=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = tmp_path / "separate"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "moe_gspo.cli", "train",
                        *args, "rollout.placement=separate", "rollout.engine_ranks=1", f"train.out_dir={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    sep = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ["reward/mean", "pg_loss", "entropy", "grad_norm", "rollout_logprobs_diff_max"]
    record("separate_one_gpu", **{f"separate_{k}": [m.get(k) for m in sep] for k in keys},
           **{f"colocated_{k}": [m.get(k) for m in col] for k in keys},
           separate_step_s=[m["time/step"] for m in sep], colocated_step_s=[m["time/step"] for m in col])
    assert [m["engine/on_cuda"] for m in sep] == [1.0, 1.0]
    assert len(sep) == len(col) == 2 and sep[0]["reward/mean"] == col[0]["reward/mean"]
    for s, c in zip(sep, col):
        for k in ("pg_loss", "entropy", "grad_norm"):
            assert abs(s[k] - c[k]) <= 1e-3 * max(1.0, abs(c[k])), (k, s[k], c[k])
