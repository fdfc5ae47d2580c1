"""Routing Replay and the flip tracker on the tiny megatron-core policy (CPU, one process)."""

from __future__ import annotations

import copy

import pytest
import torch

import moe_gspo
from moe_gspo.config import load_config
from moe_gspo.model.routing_capture import RoutingCapture
from moe_gspo.routing import ExpertFlipTracker, RoutingReplayCache, flip_rate

B, T = 3, 16
LENGTHS = [16, 10, 12]  # right-padded rows
SIDS = [100, 101, 102]


@pytest.fixture(scope="module")
def built():
    source = load_config("configs/tiny_cpu.yaml")
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    return policy, copy.deepcopy(policy.state_dict())


@pytest.fixture
def policy(built):
    policy, state = built
    policy.load_state_dict(state)
    policy.zero_grad(set_to_none=True)
    return policy


def dims(policy):
    mc = policy.model_config
    return mc.num_hidden_layers, mc.num_experts_per_tok, mc.num_experts


def batch(policy, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, policy.model_config.vocab_size, (B, T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).reshape(-1)  # (B*T,)
    return ids, mask


def test_r2_replay_pins_routing_and_router_still_learns(policy):
    L, k, E = dims(policy)
    ids, mask = batch(policy)
    old = RoutingCapture()
    with torch.no_grad():
        policy(ids, routing=old)  # old-log-prob pass
    cache = RoutingReplayCache("r2", L, k, E)
    assert cache.record_capture(SIDS, LENGTHS, old) == sum(LENGTHS)
    assert cache.nbytes() == sum(LENGTHS) * L * k
    with torch.no_grad():
        for r in policy.routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(7)) * 0.1)

    live = RoutingCapture()
    with torch.no_grad():
        policy(ids, routing=live)
    assert flip_rate(old.stacked()[mask], live.stacked()[mask]) > 0.05  # without replay the routing changes

    perm = [2, 0, 1]  # a shuffled minibatch of the same samples
    src = cache.replay_source([SIDS[i] for i in perm], seq_len=T)
    rep = RoutingCapture(replay=src)
    logits = policy(ids[perm], routing=rep)
    src.check_complete()
    pmask = mask.view(B, T)[perm].reshape(-1)
    want = old.stacked().view(B, T, L, k)[perm].reshape(B * T, L, k)
    assert torch.equal(rep.stacked()[pmask], want[pmask])  # replayed exactly
    assert flip_rate(want[pmask], rep.live_stacked()[pmask]) > 0.05  # the live router disagrees
    assert torch.equal(rep.stacked()[~pmask], rep.live_stacked()[~pmask])  # padding routes live

    tracker = ExpertFlipTracker(L, E)
    tracker.set_reference(SIDS, old.stacked(), mask)
    tracker.observe([SIDS[i] for i in perm], rep.live_stacked(), pmask)
    assert tracker.metrics()["moe/flip_rate"] == pytest.approx(flip_rate(want[pmask], rep.live_stacked()[pmask]))

    targets = torch.randint(0, logits.shape[-1], (B, T), generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1)).backward()
    for i, r in enumerate(policy.routers):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0, f"router {i} got no gradient"


def test_flip_rate_zero_after_lr0_step_and_positive_after_large_step(policy):
    L, k, E = dims(policy)
    ids, mask = batch(policy, seed=1)
    targets = torch.randint(0, policy.model_config.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    tracker = ExpertFlipTracker(L, E)
    with torch.no_grad():
        old = RoutingCapture()
        policy(ids, routing=old)
    tracker.set_reference(SIDS, old.stacked(), mask)
    rates = []
    for lr in (0.0, 0.05):
        opt = torch.optim.AdamW(policy.parameters(), lr=lr)
        opt.zero_grad()
        logits = policy(ids)
        torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1)).backward()
        opt.step()
        cap = RoutingCapture()
        with torch.no_grad():
            policy(ids, routing=cap)
        tracker.observe(SIDS, cap.live_stacked(), mask)
        rates.append(tracker.metrics()["moe/flip_rate"])
    assert rates[0] == 0.0 and rates[1] > 0.0, rates


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replay_keeps_the_router_gradient_of_the_forced_experts(policy, norm_topk_prob):
    """Under replay the combine weights come from the live router logits at the replayed experts, so the router
    learns. With random experts forced in every layer, the router weight's gradient equals a float64 reference
    that recomputes the combine weights from the router's input with the same experts forced and backpropagates
    the same upstream gradient. Weights taken from the post-top-k probabilities instead (zero at experts the live
    top-k did not pick) would leave those experts without gradient."""
    from moe_gspo.model.routing_capture import ReplaySource

    L, k, E = dims(policy)
    ids, _ = batch(policy)
    N = ids.numel()
    g = torch.Generator().manual_seed(11)
    forced = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N * L)]).view(N, L, k)
    router, seen = policy.routers[0], {}

    def hook(module, args, out):  # the router's input and routing map, the gradient reaching its combine weights
        if out[0].requires_grad:
            seen["x"], seen["map"] = args[0].detach(), out[1]
            out[0].register_hook(lambda grad: seen.update(upstream=grad))

    handle = router.register_forward_hook(hook)
    router.norm_topk_prob, was = norm_topk_prob, router.norm_topk_prob
    try:
        live = RoutingCapture()
        with torch.no_grad():
            policy(ids, routing=live)
        replayed = RoutingCapture(replay=ReplaySource(forced))
        policy(ids, routing=replayed).float().logsumexp(-1).mean().backward()
    finally:
        handle.remove()
        router.norm_topk_prob = was
    assert torch.equal(replayed.stacked(), forced.sort(-1).values)  # the forced experts were used...
    assert not torch.equal(replayed.stacked(), live.stacked())  # ...and they are not the live ones
    rows_idx = torch.nonzero(seen["map"])[:, 1].view(-1, k)  # each router row's experts (rows are sequence-major)
    W = router.weight.detach().double().requires_grad_(True)
    logits = seen["x"].reshape(-1, seen["x"].shape[-1]).double() @ W.T
    w = torch.softmax(logits.gather(1, rows_idx), -1) if norm_topk_prob else \
        torch.softmax(logits, -1).gather(1, rows_idx)
    probs = torch.zeros_like(logits).scatter(1, rows_idx, w)
    (want,) = torch.autograd.grad((probs * seen["upstream"].double()).sum(), W)
    got = router.weight.grad.double()
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
