"""The Transformer Engine spec's parameter names against the local spec's (moe_gspo/model/te_names.py), on the CPU.

TE itself cannot run here, so the TE-spec models are megatron-core's own TE spec and TE wrappers built over
stand-in TE base classes (tests/te_fake.py): their parameter names and checkpoint keys are megatron's. The same
check on TE itself, on a GPU: tests/test_gpu.py::test_te_spec_matches_local_spec.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from te_fake import fake_te

from moe_gspo.model import te_names
from moe_gspo.model.te_names import UnknownName

TINY = "configs/tiny_cpu.yaml"


@pytest.fixture(scope="module")
def local():
    import moe_gspo

    torch.manual_seed(0)
    return moe_gspo.load_policy(TINY, moe_gspo.init_parallel(TINY))


@pytest.fixture(scope="module", autouse=True)
def _fake_te(local):
    """megatron's TE wrappers ask for TE's version while they run, so the stand-in stays for the module."""
    mp = pytest.MonkeyPatch()
    with fake_te(mp):
        yield
    mp.undo()


def _te_policy(local, experts: str):
    from moe_gspo.model.policy import MoEPolicy

    return MoEPolicy(dataclasses.replace(local.model_config, spec="te", experts=experts, attention="te"),
                     local.parallel_config, local.groups)


@pytest.fixture(scope="module", params=["grouped", "megatron"])
def te(request, local):
    """A TE-spec policy (TEGroupedMLP experts for 'grouped', SequentialMLP of TE linears for 'megatron') holding
    the local policy's weights, loaded through the name table."""
    te = _te_policy(local, request.param)
    te.load_full_megatron_state(local.full_megatron_state())
    return te


def test_table_round_trips_every_name_of_the_tiny_model(local, te):
    grouped = te.model_config.experts == "grouped"
    assert type(te.gpt.decoder.layers[0].mlp.experts).__name__ == ("TEGroupedMLP" if grouped else "SequentialMLP")
    state = local.megatron_state()  # local-spec names (the grouped experts' stacks split into per-expert views)
    as_te = te_names.to_te(state, grouped=grouped)
    # exactly the TE-spec model's parameter names, as megatron's TE spec builds them
    assert set(as_te) == {n for n, _ in te.gpt.named_parameters()}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in as_te
    assert ("decoder.layers.3.mlp.experts.linear_fc2.weight7" in as_te) == grouped
    back = te_names.to_local(as_te)
    assert list(back) == list(state) and all(back[k] is state[k] for k in state)
    # the TE model's own state dict (with TE's _extra_state entries) maps onto the local names, shapes equal
    mapped = te_names.to_local(te.gpt.state_dict())
    assert set(mapped) == set(state)
    assert all(mapped[k].shape == state[k].shape for k in state)


def test_te_policy_exports_the_local_policys_hf_checkpoint_bit_for_bit(local, te):
    """Weights loaded into the TE spec through the table come back out through HF export unchanged; the forward,
    routing and gradients agree with the local spec (the stand-ins compute what TE computes, in plain torch)."""
    from moe_gspo.model.routing_capture import RoutingCapture

    cfg_a, hf_a = local.export_hf()
    cfg_b, hf_b = te.export_hf()
    assert cfg_a == cfg_b and list(hf_a) == list(hf_b)
    for k in hf_a:
        assert hf_a[k].dtype == hf_b[k].dtype and torch.equal(hf_a[k], hf_b[k]), k
    x = torch.randint(0, local.model_config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    out, caps = {}, {}
    for name, p in (("local", local), ("te", te)):
        p.zero_grad(set_to_none=True)
        caps[name] = RoutingCapture()
        out[name] = p(x, routing=caps[name])
        out[name].float().logsumexp(-1).mean().backward()
    torch.testing.assert_close(out["te"], out["local"], rtol=1e-5, atol=1e-5)
    assert torch.equal(caps["te"].stacked(), caps["local"].stacked())
    ga = local.per_expert({n: p.grad for n, p in local.gpt.named_parameters()})
    gb = te.per_expert({n: p.grad for n, p in te.gpt.named_parameters()})
    assert set(ga) == set(gb)
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-6, msg=k)


def test_grouped_stacks_round_trip_through_the_table(local):
    """The one fused layout (GroupedMLP's weight1/weight2: our grouped experts, and the TE spec's grouped
    experts where TE is older than 1.9): split into per-expert views, renamed to TE names and back, and written
    through: every byte lands in its place in the stacks."""
    from moe_gspo.model.experts import per_expert_state

    mc = local.model_config
    E, H, F = mc.num_experts, mc.hidden_size, mc.moe_intermediate_size
    w1 = torch.arange(H * E * 2 * F, dtype=torch.float32).view(H, E * 2 * F)
    w2 = torch.arange(E * F * H, dtype=torch.float32).view(E * F, H)
    stacked = {"decoder.layers.0.mlp.experts.weight1": w1.clone(), "decoder.layers.0.mlp.experts.weight2": w2.clone()}
    views = te_names.to_te(per_expert_state(stacked, E, H), grouped=True)
    assert sorted(views) == sorted([f"decoder.layers.0.mlp.experts.linear_fc{j}.weight{e}" for j in (1, 2)
                                    for e in range(E)])
    for e in range(E):  # weight1's memory is (E, H, 2F), weight2's (E, F, H): expert e's block, transposed
        assert torch.equal(views[f"decoder.layers.0.mlp.experts.linear_fc1.weight{e}"], w1.view(E, H, 2 * F)[e].t())
        assert torch.equal(views[f"decoder.layers.0.mlp.experts.linear_fc2.weight{e}"], w2.view(E, F, H)[e].t())
    target = {k: torch.zeros_like(v) for k, v in stacked.items()}
    dest = te_names.to_te(per_expert_state(target, E, H), grouped=True)
    for k, v in views.items():
        dest[k].copy_(v)
    assert torch.equal(target["decoder.layers.0.mlp.experts.weight1"], w1)
    assert torch.equal(target["decoder.layers.0.mlp.experts.weight2"], w2)


@pytest.mark.parametrize("fn, name", [
    (te_names.to_local, "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias"),
    (te_names.to_local, "decoder.layers.0.mlp.experts.linear_fc1.bias3"),
    (te_names.to_local, "decoder.layers.0.mlp.shared_experts.linear_fc1.bias"),
    (lambda s: te_names.to_te(s, grouped=True), "decoder.layers.0.mlp.experts.weight1"),
    (lambda s: te_names.to_te(s, grouped=False), "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"),
])
def test_unknown_names_are_one_clear_line(fn, name):
    with pytest.raises(UnknownName) as e:
        fn({name: torch.zeros(1)})
    msg = str(e.value)
    assert "\n" not in msg and repr(name) in msg and "te_names.py" in msg


def _ctx(local, spec: str):
    """A policy of the tiny architecture on `spec` with megatron's optimizer (what a checkpoint touches)."""
    from moe_gspo.config import load_config
    from moe_gspo.train.optim import Optimizer, wrap_ddp

    cfg = load_config("configs/train_tiny_cpu.yaml", ["train.lr=1e-2"])
    cfg = dataclasses.replace(cfg, model=local.model_config)
    policy = _te_policy(local, "grouped") if spec == "te" else local.frozen_copy().requires_grad_(True).train()
    optim = Optimizer.from_config(wrap_ddp(policy), policy, cfg.train, total_steps=10)
    return SimpleNamespace(policy=policy, optim=optim, reference=None, cfg=cfg)


@pytest.mark.parametrize("src, dst", [("local", "te"), ("te", "local")])
def test_checkpoint_moves_between_the_specs(tmp_path, local, src, dst):
    """A sharded checkpoint (weights, fp32 main params, Adam moments) saved under one spec resumes under the
    other: both specs write the same keys (te_names.CHECKPOINT_KEYS), so every tensor lands on its twin."""
    from moe_gspo.checkpoint.store import Checkpoints

    a, b = _ctx(local, src), _ctx(local, dst)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # a gradient first, so that the Adam moments are not zeros
        a.optim.zero_grad()
        a.policy(torch.randint(0, 128, (2, 9), generator=g)).float().logsumexp(-1).mean().backward()
        a.optim.step()
    ck = Checkpoints(tmp_path, keep=1)
    ck.save(2, a, {"step": 2})
    ck.load(2, b)
    wa, wb = a.policy.megatron_state(), b.policy.megatron_state()
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = a.optim.local_state(), b.optim.local_state()
    for kind in sa:
        xa, xb = a.policy.per_expert(sa[kind]), b.policy.per_expert(sb[kind])
        assert set(xa) == set(xb) and all(torch.equal(xa[k], xb[k]) for k in xa), kind
    assert b.optim.adam_step == 2
