"""model.moe_router_load_balancing_type / model.moe_aux_loss_coeff: megatron's load-balancing loss reaches the
router's gradient, equal to the Switch Transformer loss computed here from the router's own input; refused when
the two fields disagree."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_cfg

from moe_gspo.config import ConfigError


def _router_grad_and_input(cfg, weights, x):
    """(router weight gradient, the router's input hidden states (N, H)) of one forward/backward of a 1-layer policy
    in training mode on the batch x, the loss being the mean square of the logits."""
    import moe_gspo

    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    if weights is not None:
        policy.load_full_megatron_state(weights)
    router = policy.routers[0]
    seen = []
    hook = router.register_forward_pre_hook(
        lambda mod, args: seen.append(args[0].detach().reshape(-1, args[0].shape[-1])))  # (s, b, H) -> (N, H)
    policy.gpt.train()
    policy(x).float().pow(2).mean().backward()
    hook.remove()
    return router.weight.grad.clone(), seen[0], policy


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_load_balancing_loss_reaches_the_router_gradient(kind):
    """With one MoE layer the router's input does not depend on its weight, so the gradient with the loss on minus
    the gradient without it is d/dW of coeff * E * sum_e f_e P_e (f_e: fraction of the top-k slots on expert e,
    P_e: mean softmax probability of e; over all tokens for aux_loss, per sequence and averaged for seq_aux_loss)."""
    base = ["model.num_hidden_layers=1"]
    off = tiny_cfg(*base)
    x = torch.randint(0, off.model.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    g_off, h, p = _router_grad_and_input(off, None, x)
    weights = {k: v.clone() for k, v in p.full_megatron_state().items()}
    c = 0.05
    on = tiny_cfg(*base, f"model.moe_router_load_balancing_type={kind}", f"model.moe_aux_loss_coeff={c}")
    g_on, h_on, _ = _router_grad_and_input(on, weights, x)
    torch.testing.assert_close(h_on, h)
    W = p.routers[0].weight.detach().clone().requires_grad_(True)
    E, k = on.model.num_experts, on.model.num_experts_per_tok
    S, B = x.shape[1], x.shape[0]

    def switch(h_N):
        probs = torch.softmax(h_N.float() @ W.t(), dim=-1)  # (N, E)
        top = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=-1).indices, 1.0)
        f = top.sum(0) / (len(h_N) * k)
        return E * (f * probs.mean(0)).sum()

    if kind == "aux_loss":
        aux = c * switch(h)
    else:  # megatron's tokens are sequence-major (s, b): sequence j is every B-th row from j
        aux = c * torch.stack([switch(h.view(S, B, -1)[:, j]) for j in range(B)]).mean()
    (want,) = torch.autograd.grad(aux, W)
    assert want.abs().max() > 1e-6
    torch.testing.assert_close(g_on - g_off, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("over,msg", [
    (["model.moe_aux_loss_coeff=0.001"], "needs both"),
    (["model.moe_router_load_balancing_type=aux_loss"], "needs both"),
    (["model.moe_router_load_balancing_type=sinkhorn", "model.moe_aux_loss_coeff=0.001"],
     "moe_router_load_balancing_type"),
    (["model.moe_router_load_balancing_type=aux_loss", "model.moe_aux_loss_coeff=-1"], "must be a finite number"),
])
def test_load_balancing_fields_are_checked_at_load(over, msg):
    with pytest.raises(ConfigError, match=msg):
        tiny_cfg(*over)
