"""model.compile: the torch.compile'd policy against its eager twin on the same weights (CPU, one process).

Logits, every parameter gradient and the routing a RoutingCapture records (live, replayed, with router scores)
must equal the eager policy's to fp32 round-off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_hf_checkpoint

import moe_gspo
from moe_gspo.config import ConfigError, ModelConfig, ParallelConfig
from moe_gspo.model.policy import MoEPolicy
from moe_gspo.model.routing_capture import ReplaySource, RoutingCapture

# Small, to keep compilation short; a wide init keeps routing decisive, so round-off cannot flip a top-k choice.
MC = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, initializer_range=0.2)
B, T = 2, 16
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pair():
    eager = moe_gspo.load_policy(MC, moe_gspo.init_parallel(MC))
    source = dataclasses.replace(MC, compile=True)
    fast = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    fast.load_full_megatron_state(eager.full_megatron_state())
    return eager, fast


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MC.vocab_size, (B, T), generator=g), torch.randint(0, MC.vocab_size, (B, T), generator=g)


def loss_and_grads(policy, x, y, routing=None):
    policy.zero_grad(set_to_none=True)
    logits_BTV = policy(x, routing=routing)
    torch.nn.functional.cross_entropy(logits_BTV.reshape(-1, MC.vocab_size), y.reshape(-1)).backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    return logits_BTV.detach(), grads


def test_compiled_logits_and_gradients_equal_eager(pair):
    eager, fast = pair
    x, y = batch()
    logits_e, grads_e = loss_and_grads(eager, x, y)
    logits_c, grads_c = loss_and_grads(fast, x, y)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    torch.testing.assert_close(logits_c, logits_e, **TOL)
    assert grads_c.keys() == grads_e.keys()
    for name, g in grads_e.items():
        assert g.abs().max() > 0, f"{name}: no gradient in the eager twin, the comparison would be vacuous"
        torch.testing.assert_close(grads_c[name], g, **TOL, msg=lambda m: f"{name}: {m}")


def test_compiled_routing_capture_and_replay_equal_eager(pair):
    eager, fast = pair
    x, y = batch(1)
    caps = {}
    for name, policy in (("eager", eager), ("compiled", fast)):
        cap = RoutingCapture(scores=True)
        with torch.no_grad():
            policy(x, routing=cap)
        caps[name] = cap
    assert torch.equal(caps["compiled"].stacked(), caps["eager"].stacked())
    torch.testing.assert_close(caps["compiled"].scores_stacked(), caps["eager"].scores_stacked(), **TOL)
    for i, r in caps["eager"].layers.items():
        torch.testing.assert_close(caps["compiled"].layers[i].topk_weights, r.topk_weights, **TOL)

    # replay a routing the live router would not choose (experts shifted by one): both twins follow it alike
    shifted = (caps["eager"].stacked() + 1) % MC.num_experts
    out = {}
    for name, policy in (("eager", eager), ("compiled", fast)):
        cap = RoutingCapture(replay=ReplaySource(shifted))
        out[name] = loss_and_grads(policy, x, y, routing=cap), cap
    (logits_e, grads_e), cap_e = out["eager"]
    (logits_c, grads_c), cap_c = out["compiled"]
    assert torch.equal(cap_c.stacked(), torch.sort(shifted, dim=-1).values)
    assert torch.equal(cap_c.live_stacked(), cap_e.live_stacked())
    torch.testing.assert_close(logits_c, logits_e, **TOL)
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, **TOL, msg=lambda m: f"{name}: {m}")


def test_compile_survives_loading_a_checkpoint(tmp_path):
    """A compiled policy loaded from an HF checkpoint computes the logits of the eager policy loaded from it (and not
    those of a fresh initialization: the loaded weights reach the compiled module)."""
    make_hf_checkpoint(tmp_path / "hf")
    source = ModelConfig(init_from=str(tmp_path / "hf"), compile=True)
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    assert policy.model_config.compile and policy.model_config.hidden_size == 32
    eager_source = dataclasses.replace(source, compile=False)
    eager = moe_gspo.load_policy(eager_source, moe_gspo.init_parallel(eager_source))
    fresh = moe_gspo.load_policy(MC, moe_gspo.init_parallel(MC))
    x, _ = batch(2)
    with torch.no_grad():
        logits, want, other = policy(x), eager(x), fresh(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    torch.testing.assert_close(logits, want, **TOL)
    assert (want - other).abs().max() > 0.1


def test_compile_with_model_parallelism_is_refused():
    with pytest.raises(ConfigError, match="model.compile"):
        MoEPolicy(dataclasses.replace(MC, compile=True), ParallelConfig(ep=2), groups=None)
