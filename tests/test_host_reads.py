"""Reads of device values back to the host, counted on the CPU (moe_gspo.train.host_reads.value_reads): each kind
at its call site; none in a forward and backward of the policy whose experts take their token counts on the
device (megatron's allgather dispatch reads three per MoE layer); and, in one minibatch update, the same reads
whether it runs as one micro-batch or three.

On a GPU each such read is a host synchronization (tests/test_gpu.py counts those with torch's sync debug mode);
counting them here keeps the training step free of per-micro-batch synchronizations without a GPU."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests" / "dist"))
from fused_step_worker import RecordingOptim, batch, case_cfg  # noqa: E402

import moe_gspo  # noqa: E402
from moe_gspo.config import ModelConfig  # noqa: E402
from moe_gspo.model import dispatch  # noqa: E402
from moe_gspo.train.host_reads import value_reads  # noqa: E402

HERE = "tests/test_host_reads.py"


def _reads_a_scalar(x):
    return x.sum().item()


def test_value_reads_counts_each_read_at_its_call_site():
    x = torch.arange(6.0)
    y = x.clone().requires_grad_()
    with value_reads() as sites:
        x2 = x * 2 + torch.where(x > 1, x, 0)  # device work only: nothing
        line = sys._getframe().f_lineno + 1
        _reads_a_scalar(x2), x.tolist(), int(x[0]), bool(x.any()), x.cpu(), x.numpy()  # six reads
        x[x > 2], torch.nonzero(x), x.masked_select(x > 0)  # three outputs sized by the values
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long))  # a size read...
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long), output_size=6)  # ...unless it is given
        y[y > 1].sum().backward()  # a boolean index, in the forward and again in its backward
    me = f"({sys._getframe().f_code.co_name})"
    assert dict(sites) == {f"{HERE}:{_reads_a_scalar.__code__.co_firstlineno + 1} (_reads_a_scalar)": 1,
                           f"{HERE}:{line} {me}": 5, f"{HERE}:{line + 1} {me}": 3, f"{HERE}:{line + 2} {me}": 1,
                           f"{HERE}:{line + 4} {me}": 2}
    assert not any(name in vars(torch.Tensor) for name in ("tolist", "numpy", "cpu"))  # the methods given back


MC = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, initializer_range=0.1)


def forward_backward_reads(policy):
    x = torch.randint(0, MC.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with value_reads() as sites:
        policy(x).float().pow(2).mean().backward()
    return sites


def test_packed_forward_and_backward_read_nothing_back(monkeypatch):
    """Packed rows (THD): the rotary table is applied at each token's position (model.rope); megatron's own THD
    rotary reads the bounds back twice per call, for the query and the key of every layer. Same values."""
    from megatron.core.models.common.embeddings import rope_utils

    from moe_gspo.model import rope

    policy = moe_gspo.load_policy(MC, moe_gspo.init_parallel(MC))
    x = torch.randint(0, MC.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    runs = []
    for thd in (rope._thd_at_positions, rope._MEGATRON_THD):
        monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", thd)
        policy.zero_grad(set_to_none=True)
        with value_reads() as sites:
            out = policy(x, lengths=[20, 7, 13])
            out.float().pow(2).mean().backward()
        runs.append((dict(sites), out.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}))
    (ours, out_o, grads_o), (megatron, out_m, grads_m) = runs
    assert ours == {}
    assert sum(n for s, n in megatron.items() if "rope_utils" in s) == 4 * MC.num_hidden_layers, megatron
    assert torch.equal(out_o, out_m) and all(torch.equal(grads_o[n], g) for n, g in grads_m.items())


def test_grouped_experts_forward_and_backward_read_nothing_back(monkeypatch):
    policy = moe_gspo.load_policy(MC, moe_gspo.init_parallel(MC))
    layers = [layer.mlp for layer in policy.gpt.decoder.layers]
    assert all(isinstance(m.token_dispatcher, dispatch.DeviceCountDispatcher) for m in layers)
    assert dict(forward_backward_reads(policy)) == {}
    # megatron's dispatch before the same experts: its count read and two value-sized selections per layer
    monkeypatch.setattr(dispatch, "device_counts_apply", lambda layer: False)
    megatron = moe_gspo.load_policy(MC, moe_gspo.init_parallel(MC))
    assert not isinstance(megatron.gpt.decoder.layers[0].mlp.token_dispatcher, dispatch.DeviceCountDispatcher)
    sites = forward_backward_reads(megatron)
    assert sum(n for s, n in sites.items() if s.startswith("megatron/")) == 3 * MC.num_hidden_layers, dict(sites)


# reads of tensors that stay on the host in a GPU run too: the sample ids (PaddedRollout.to leaves them on the
# CPU as keys) and the targets' range check (vocab_parallel.check_targets runs on the CPU only)
HOST_SIDE = ("(_ids)", "(check_targets)")


def step_context(*overrides):
    """A StepContext of the tiny policy (flip tracker on, no replay) whose optimizer records the gradients and
    steps nothing, and a batch of 8 rows of 7-12 tokens with its generator."""
    from moe_gspo.routing import ExpertFlipTracker, RoutingReplayCache
    from moe_gspo.train.step import StepContext

    cfg = case_cfg(list(overrides), "gspo_temperature")
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    mc = cfg.model
    ctx = StepContext(policy, RecordingOptim(policy), cfg,
                      RoutingReplayCache("off", mc.num_hidden_layers, mc.num_experts_per_tok, mc.num_experts),
                      ExpertFlipTracker(mc.num_hidden_layers, mc.num_experts), policy.groups)
    return (ctx, *batch(cfg))


def update_reads(micro_batch_size: int, impl: str, budget: int = 0):
    from moe_gspo.train.step import OldPass, old_logprob_pass, update_minibatch

    ctx, pb, g = step_context(f"train.micro_batch_size={micro_batch_size}", f"train.loss_impl={impl}",
                              f"train.max_tokens_per_micro_batch={budget}")
    first = old_logprob_pass(ctx, pb)
    adv = torch.randn(pb.input_ids.shape[0], generator=g)
    with value_reads() as sites:
        m = update_minibatch(ctx, pb, OldPass(first.old_logp, None, first.router), adv,
                             torch.tensor([5, 0, 3, 6, 1, 2]))
    assert m["pg_clipfrac"] >= 0 and ctx.optim.grads  # the update ran and produced gradients
    return {s: n for s, n in sites.items() if not s.endswith(HOST_SIDE)}


@pytest.mark.parametrize("impl,packed", [("fused", False), ("eager", False), ("fused", True)],
                         ids=["fused", "eager", "fused_packed"])
def test_a_minibatch_update_reads_per_minibatch_not_per_micro_batch(impl, packed):
    # 6 rows of 59 tokens: one micro-batch, or three (two rows each; packed, at most 24 tokens each)
    if packed:
        one, three = update_reads(6, impl, budget=64), update_reads(6, impl, budget=24)
    else:
        one, three = update_reads(6, impl), update_reads(2, impl)
    assert three == one, (one, three)
    # the rows' lengths, the loss inputs' finiteness check and the metrics, each read once
    assert sum(one.values()) <= 3, one


def test_a_non_finite_loss_input_raises_before_the_optimizer_step():
    """The micro-batches skip the loss's finiteness check; the minibatch's metrics check every row once, before
    the optimizer applies the gradient."""
    from moe_gspo.train.step import OldPass, old_logprob_pass, update_minibatch

    ctx, pb, _ = step_context("train.micro_batch_size=2")
    old = old_logprob_pass(ctx, pb).old_logp.clone()
    old[3, 6] = float("nan")  # row 3's response, in the second micro-batch of two rows
    assert pb.response_mask[3, 6]
    with pytest.raises(ValueError, match="old_logp"):
        update_minibatch(ctx, pb, OldPass(old, None, None), torch.zeros(8), torch.tensor([5, 0, 3, 6, 1, 2]))
    assert ctx.optim.grads is None  # step() never ran
