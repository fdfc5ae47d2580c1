"""The fast expert implementations against megatron's SequentialMLP (`model.experts=megatron`) on the same weights:
'torch' (the expert loop in plain torch ops) and 'grouped' (torch._grouped_mm on GroupedMLP's stacked weights).
Logits and every parameter gradient, the router's included, in fp32 and bf16, with random routing and with routing
forced so that one expert gets no token and the group sizes are no multiple of any alignment; the grouped module's
row-padding and unaligned-width paths; HF export and the experts choice surviving a checkpoint load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import make_hf_checkpoint

import moe_gspo
from moe_gspo.config import ConfigError, ModelConfig
from moe_gspo.model import experts as experts_mod
from moe_gspo.model.experts import GroupedGemmExperts
from moe_gspo.model.layers import TorchLoopExperts
from moe_gspo.model.routing_capture import ReplaySource, RoutingCapture

MC = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, initializer_range=0.1)
B, T = 3, 40
IMPLS = {"torch": TorchLoopExperts, "grouped": GroupedGemmExperts}
# Measured here (torch 2.13 CPU) against megatron's SequentialMLP: bf16 bitwise equal for both fast paths, live and
# forced routing; fp32 bitwise equal except 'grouped' under forced routing (logits 4.8e-7, gradients 1.7e-8 abs,
# 4e-7 relative: the grouped kernel blocks uneven groups differently). bf16's tolerance is about two bf16 ulps at
# 1.0, room for a blocking difference like fp32's to round the other way, still far below a wrong expert or scale.
TOL = {"float32": 1e-6, "bfloat16": 1e-2}


def forced_routing(seed: int = 0) -> torch.Tensor:
    """(B*T, L, k) experts: layer 0 never picks expert 3, layer 1 never expert 0, and the other experts get skewed
    counts, not multiples of 4 or 8."""
    g = torch.Generator().manual_seed(seed)
    table = torch.empty(B * T, MC.num_hidden_layers, MC.num_experts_per_tok, dtype=torch.long)
    for layer, empty in enumerate((3, 0)):
        weights = torch.arange(1, MC.num_experts + 1, dtype=torch.float) ** 2
        weights[empty] = 0
        table[:, layer] = torch.multinomial(weights.expand(B * T, -1), MC.num_experts_per_tok, generator=g)
    return table


def run(policy, x, y, table=None):
    policy.zero_grad(set_to_none=True)
    routing = None if table is None else RoutingCapture(replay=ReplaySource(table))
    logits = policy(x, routing=routing)
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, MC.vocab_size), y.reshape(-1)).backward()
    grads = policy.per_expert({n: p.grad.clone() for n, p in policy.gpt.named_parameters()})
    return logits.detach(), grads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["torch", "grouped"])
def test_fast_experts_equal_megatron_sequential_mlp(impl, dtype):
    tol = TOL[dtype]
    mc = dataclasses.replace(MC, params_dtype=dtype)
    source = dataclasses.replace(mc, experts="megatron")
    ref = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    source = dataclasses.replace(mc, experts=impl)
    fast = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    experts = fast.gpt.decoder.layers[0].mlp.experts
    assert type(ref.gpt.decoder.layers[0].mlp.experts) not in IMPLS.values()
    assert isinstance(experts, IMPLS[impl])
    for k, v in ref.full_megatron_state().items():  # the same initial weights, under the same names
        assert torch.equal(fast.full_megatron_state()[k], v), k
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, MC.vocab_size, (B, T), generator=g), torch.randint(0, MC.vocab_size, (B, T), generator=g)
    table = forced_routing()
    counts = torch.bincount(table[:, 0].reshape(-1), minlength=MC.num_experts)
    assert counts[3] == 0 and (counts % 4 != 0).any()
    for routing in (None, table):
        logits_r, grads_r = run(ref, x, y, routing)
        logits_f, grads_f = run(fast, x, y, routing)
        assert getattr(experts, "_plain", True) and getattr(experts, "use_grouped_mm", True)  # the fast path ran
        torch.testing.assert_close(logits_f, logits_r, rtol=tol, atol=tol)
        assert grads_f.keys() == grads_r.keys()
        for name, gr in grads_r.items():
            if "experts" in name and routing is None:
                assert gr.abs().max() > 0, f"{name}: no gradient reached this expert, the check would be vacuous"
            torch.testing.assert_close(grads_f[name], gr, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    empty = grads_f["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert empty.abs().max() == 0  # the forced run: expert 3 of layer 0 saw no token
    assert grads_f["decoder.layers.0.mlp.router.weight"].abs().max() > 0


def experts_module(hidden=32, ffn=24):
    """Layer 0's GroupedGemmExperts (4 experts) of a one-layer policy."""
    source = dataclasses.replace(MC, hidden_size=hidden, moe_intermediate_size=ffn,
                                 num_experts=4, num_hidden_layers=1, experts="grouped")
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    return policy.gpt.decoder.layers[0].mlp.experts


def module_run(m, counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    x = torch.randn(n, m.config.hidden_size, generator=g).to(m.weight1.dtype).requires_grad_()
    p = torch.rand(n, generator=g).requires_grad_()
    out, _ = m(x, torch.tensor(counts), p)
    out.sum().backward()  # a zero-stride gradient, which torch._grouped_mm's backward rejects as is
    grads = (x.grad, p.grad, m.weight1.grad, m.weight2.grad)
    m.zero_grad(set_to_none=True)
    return out.detach(), grads


def loop_reference(m, counts, seed=0):
    w = m.use_grouped_mm
    m.use_grouped_mm = False
    try:
        return module_run(m, counts, seed)
    finally:
        m.use_grouped_mm = w


@pytest.mark.parametrize("counts", [[5, 0, 27, 3], [0, 0, 0, 0], [0, 9, 0, 0]])
def test_grouped_rows_padded_for_alignment_equal_unpadded(counts):
    m = experts_module()
    ref = loop_reference(m, counts)
    for align in (1, 8):
        m.align_rows = align
        out, grads = module_run(m, counts)
        torch.testing.assert_close(out, ref[0], rtol=1e-6, atol=1e-6)
        for a, b in zip(grads, ref[1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_rows_past_the_groups_stay_outside_them_when_padded():
    """A dispatch of a fixed number of slots (model.dispatch, under expert parallelism) hands the experts more rows
    than its counts sum to; padded for alignment, the groups' rows must still equal the unpadded groups alone, in
    the output and every gradient. What the experts write past the groups is the dispatcher's to drop: torch's CPU
    grouped kernel writes nonzero values there (measured), so it must not reach the output or a gradient."""
    counts, tail = [5, 0, 27, 3], 6
    m = experts_module()
    ref_out, ref_grads = loop_reference(m, counts)
    n = sum(counts)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, m.config.hidden_size, generator=g)
    p = torch.rand(n, generator=g)
    assert torch.equal(module_run(m, counts)[0], ref_out)  # the same draws as module_run's
    for align, grouped in ((1, True), (8, True), (1, False)):  # and the loop over the stacked weights
        m.align_rows, m.use_grouped_mm = align, grouped
        xt = torch.cat([x, torch.randn(tail, x.shape[1], generator=g)]).requires_grad_()
        pt = torch.cat([p, torch.rand(tail, generator=g)]).requires_grad_()
        out, _ = m(xt, torch.tensor(counts), pt)
        out[:n].sum().backward()
        torch.testing.assert_close(out[:n].detach(), ref_out, rtol=1e-6, atol=1e-6)
        for got, want in zip((xt.grad[:n], pt.grad[:n], m.weight1.grad, m.weight2.grad), ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        if not grouped:  # the loop writes zeros there; torch's grouped kernel leaves them unspecified
            assert out[n:].abs().max() == 0
        m.zero_grad(set_to_none=True)


def test_unaligned_width_falls_back_to_the_loop():
    m = experts_module(ffn=6)  # 6 fp32 = 24-byte rows: torch._grouped_mm refuses them
    assert not m.use_grouped_mm
    out, _ = module_run(m, [4, 0, 7, 2])
    assert out.shape == (13, 32)


def test_grouped_experts_built_without_autograd_still_take_the_grouped_kernel(monkeypatch):
    # the kernel probe runs a backward: a policy built under no_grad or inference_mode must still find the kernel
    monkeypatch.setattr(experts_mod, "_KERNEL_RUNS", {})
    with torch.inference_mode():
        assert experts_mod.grouped_mm_runs(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(experts_mod, "_KERNEL_RUNS", {})
    with torch.no_grad():
        assert experts_module().use_grouped_mm


def test_a_grouped_kernel_that_does_not_run_falls_back_to_the_loop(monkeypatch):
    # a torch whose _grouped_mm lacks the device's or dtype's kernel raises; the experts then take the loop
    def refuse(*args, **kwargs):
        raise RuntimeError("grouped gemm is not supported for this dtype")

    m = experts_module()
    counts = [4, 0, 7, 2]
    ref = loop_reference(m, counts)
    monkeypatch.setattr(experts_mod, "_KERNEL_RUNS", {})
    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    m = experts_module()
    assert not m.use_grouped_mm
    out, grads = module_run(m, counts)
    torch.testing.assert_close(out, ref[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, ref[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_grouped_hf_export_equals_torch_experts_export(tmp_path):
    make_hf_checkpoint(tmp_path / "hf")
    policies = {impl: moe_gspo.load_policy(ModelConfig(init_from=str(tmp_path / "hf"), experts=impl),
                                           moe_gspo.init_parallel(ModelConfig(init_from=str(tmp_path / "hf"), experts=impl)))
                for impl in ("torch", "grouped")}
    (_, a), (_, b) = policies["torch"].export_hf(), policies["grouped"].export_hf()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    policies["grouped"].save_pretrained(tmp_path / "out")
    source = ModelConfig(init_from=str(tmp_path / "out"), experts="grouped")
    again = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    _, c = again.export_hf()
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_unknown_experts_impl_is_a_config_error():
    with pytest.raises(ConfigError, match="model.experts"):
        ModelConfig(experts="bogus")


@pytest.mark.parametrize("impl", ["grouped", "torch", "megatron"])
def test_experts_choice_survives_loading_a_checkpoint(tmp_path, impl):
    make_hf_checkpoint(tmp_path / "hf")
    source = ModelConfig(init_from=str(tmp_path / "hf"), experts=impl)
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    assert policy.model_config.experts == impl
    got = type(policy.gpt.decoder.layers[0].mlp.experts)
    assert got is IMPLS[impl] if impl in IMPLS else got not in IMPLS.values()
