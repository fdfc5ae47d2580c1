"""model.experts='torch' (the expert loop in plain torch ops) against megatron's SequentialMLP on the same weights:
logits and every parameter gradient, in fp32 and bf16, with the uneven expert loads a random batch routes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import make_hf_checkpoint

import moe_gspo
from moe_gspo.config import ConfigError, ModelConfig
from moe_gspo.model.layers import TorchLoopExperts

MC = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, initializer_range=0.1)


def run(policy, x, y):
    policy.zero_grad(set_to_none=True)
    logits = policy(x)
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, MC.vocab_size), y.reshape(-1)).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_torch_experts_equal_megatron_sequential_mlp(dtype, tol):
    mc = dataclasses.replace(MC, params_dtype=dtype)
    ref = moe_gspo.load_policy(dataclasses.replace(mc, experts="megatron"))
    fast = moe_gspo.load_policy(dataclasses.replace(mc, experts="torch"))
    assert not isinstance(ref.gpt.decoder.layers[0].mlp.experts, TorchLoopExperts)
    assert isinstance(fast.gpt.decoder.layers[0].mlp.experts, TorchLoopExperts)
    fast.load_full_megatron_state(ref.full_megatron_state())
    assert fast.full_megatron_state().keys() == ref.full_megatron_state().keys()  # same parameter names
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, MC.vocab_size, (3, 40), generator=g), torch.randint(0, MC.vocab_size, (3, 40), generator=g)
    logits_r, grads_r = run(ref, x, y)
    logits_f, grads_f = run(fast, x, y)
    assert fast.gpt.decoder.layers[0].mlp.experts._plain  # the plain loop ran, not megatron's fallback
    torch.testing.assert_close(logits_f, logits_r, rtol=tol, atol=tol)
    assert grads_f.keys() == grads_r.keys()
    for name, gr in grads_r.items():
        if "experts" in name:
            assert gr.abs().max() > 0, f"{name}: no gradient reached this expert, the check would be vacuous"
        torch.testing.assert_close(grads_f[name], gr, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def test_unknown_experts_impl_is_a_config_error():
    with pytest.raises(ConfigError, match="model.experts"):
        ModelConfig(experts="grouped")


@pytest.mark.parametrize("impl", ["torch", "megatron"])
def test_experts_choice_survives_loading_a_checkpoint(tmp_path, impl):
    make_hf_checkpoint(tmp_path / "hf")
    policy = moe_gspo.load_policy(ModelConfig(init_from=str(tmp_path / "hf"), experts=impl))
    assert policy.model_config.experts == impl
    assert isinstance(policy.gpt.decoder.layers[0].mlp.experts, TorchLoopExperts) == (impl == "torch")
