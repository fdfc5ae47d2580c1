"""GMPO and RSPO: the geometric-mean loss and the router-shift weight against float64 references written from the
papers (arXiv:2507.20673, arXiv:2510.23027), the router scores the policy records, and TP=2 / EP=2 parity."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_gspo.config import ConfigError, load_config
from moe_gspo.losses import (POLICY_LOSSES, get_policy_loss, router_shift_metrics,
                             router_shift_ratio, router_shift_weight)

F64 = torch.float64
GEO_MODES = ("seq-mean-token-mean", "token-mean")


# ----------------------------------------------------------------------------------------------- references
def geo_mean_ref(logp, old, adv, mask, clip_low, clip_high, mode, gamma=None):
    """The GMPO objective as the paper writes it, negated: per response, the |y_i|-th root of the product of
    |min(rho A, clip(rho, e^-clip_low, e^clip_high) A)| times sgn(A); with gamma (RSPO), rho -> gamma * rho."""
    total, denom = logp.new_zeros(()), 0
    for i in range(logp.shape[0]):
        idx = mask[i].nonzero().flatten()
        n = idx.numel()
        if n == 0:
            continue
        rho = torch.exp(logp[i, idx] - old[i, idx])
        if gamma is not None:
            rho = gamma[i, idx] * rho
        a = adv[i]
        if a == 0:
            j = 0.0 * rho.sum()
        else:
            terms = torch.minimum(rho * a, rho.clamp(math.exp(-clip_low), math.exp(clip_high)) * a)
            j = torch.prod(terms.abs()) ** (1.0 / n) * torch.sign(a)
        w = 1 if mode == "seq-mean-token-mean" else n
        total, denom = total + w * j, denom + w
    return -total / max(denom, 1)


def ratio_loss_ref(name, logp, old, adv, mask, clip_low, clip_high, gamma):
    """docs/guide/method.md's GRPO (token ratio) or GSPO (sequence ratio) objective on the rescaled ratios gamma * rho,
    seq-mean-token-mean, negated."""
    total, denom = logp.new_zeros(()), 0
    for i in range(logp.shape[0]):
        idx = mask[i].nonzero().flatten()
        if idx.numel() == 0:
            continue
        rho = gamma[i, idx] * torch.exp(logp[i, idx] - old[i, idx])
        a = adv[i]
        if name == "grpo":
            total = total - torch.minimum(rho * a, rho.clamp(1 - clip_low, 1 + clip_high) * a).mean()
        else:
            s = torch.prod(rho) ** (1.0 / idx.numel())
            total = total - torch.minimum(s * a, s.clamp(1 - clip_low, 1 + clip_high) * a)
        denom += 1
    return total / denom


def gamma_ref(cur, old):
    """exp(-1/L sum_l 1/k sum_e |cur - old|) token by token, with Python loops over layers and experts."""
    N, L, k = cur.shape
    out = torch.empty(N, dtype=F64)
    for t in range(N):
        per_layer = [sum(abs(float(cur[t, l, e]) - float(old[t, l, e])) for e in range(k)) / k for l in range(L)]
        out[t] = math.exp(-sum(per_layer) / L)
    return out


def make_inputs(seed, B=8, T=10, noise=0.4):
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(B, T, generator=g, dtype=F64)
    old = logp + noise * torch.randn(B, T, generator=g, dtype=F64)
    start = torch.randint(0, 3, (B, 1), generator=g)
    length = torch.randint(1, T - 2, (B, 1), generator=g)
    length[0] = 0  # one empty response
    mask = (torch.arange(T)[None] >= start) & (torch.arange(T)[None] < start + length)
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[1] = 0.0  # one response without signal
    return logp.requires_grad_(), old, adv, mask


def hand_scores(seed, B, T, L=3, k=2, E=6, spread=0.3):
    """Old and current router scores (B, T, L, k) float64: log-probs of the old top-k experts under the old and
    the current router softmax, the current router being the old one plus noise of size `spread`."""
    g = torch.Generator().manual_seed(seed)
    old_logits = torch.randn(B, T, L, E, generator=g, dtype=F64)
    cur_logits = old_logits + spread * torch.randn(B, T, L, E, generator=g, dtype=F64)
    idx = old_logits.topk(k, dim=-1).indices
    return (torch.log_softmax(cur_logits, -1).gather(-1, idx), torch.log_softmax(old_logits, -1).gather(-1, idx),
            cur_logits, idx)


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# ----------------------------------------------------------------------------------------------- GMPO
def test_registry_defaults_and_clip_space():
    assert {"gmpo", "rspo"} <= set(POLICY_LOSSES) and {n for n, c in POLICY_LOSSES.items() if c.needs_router_shift} == {"rspo"}
    assert POLICY_LOSSES["gmpo"].default_clip == POLICY_LOSSES["rspo"].default_clip == (0.4, 0.4)
    logp, old, adv, mask = make_inputs(0)
    a, _ = get_policy_loss("gmpo")(logp, old, adv, mask)
    b, _ = get_policy_loss("gmpo")(logp, old, adv, mask, clip_low=0.4, clip_high=0.4)
    assert a == b
    get_policy_loss("gmpo")(logp, old, adv, mask, clip_low=1.5)  # a log-space bound may exceed 1
    with pytest.raises(ValueError, match="clip_low"):
        get_policy_loss("grpo")(logp, old, adv, mask, clip_low=1.5)
    with pytest.raises(ValueError, match="log-ratio"):
        get_policy_loss("gmpo")(logp, old, adv, mask, clip_high=-0.1)


@pytest.mark.parametrize("mode", GEO_MODES)
@pytest.mark.parametrize("clip", [(0.4, 0.4), (0.1, 0.3)])
def test_gmpo_matches_float64_paper_formula(mode, clip):
    for seed in range(4):
        logp, old, adv, mask = make_inputs(seed)
        loss, m = get_policy_loss("gmpo")(logp, old, adv, mask, clip_low=clip[0], clip_high=clip[1],
                                          loss_agg_mode=mode)
        want = geo_mean_ref(logp, old, adv, mask, clip[0], clip[1], mode)
        torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad_of(loss, logp), grad_of(want, logp), rtol=0, atol=1e-12)
        assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_gmpo_metrics_and_both_branches():
    """Clipped and unclipped tokens both occur (else the reference test proves little); the metrics count them."""
    logp, old, adv, mask = make_inputs(5, B=32)
    lo, hi = POLICY_LOSSES["gmpo"].default_clip
    loss, m = get_policy_loss("gmpo")(logp, old, adv, mask)
    lr = (logp - old).detach()
    clipped = (((adv[:, None] > 0) & (lr > hi)) | ((adv[:, None] < 0) & (lr < -lo))) & mask
    assert 0.05 < clipped.sum() / mask.sum() < 0.5
    assert m["pg_clipfrac"] == pytest.approx(float(clipped.sum() / mask.sum()), abs=1e-12)
    assert m["ppo_kl"] == pytest.approx(float(((old - logp.detach()) * mask).sum() / mask.sum()), abs=1e-12)
    # a clipped token gets no gradient; every other token of a response with A != 0 gets the same one
    g = grad_of(loss, logp)
    assert (g[clipped] == 0).all() and (g[~mask] == 0).all()
    for i in range(32):
        free = mask[i] & ~clipped[i]
        if adv[i] != 0 and free.any():
            assert torch.allclose(g[i][free], g[i][free][0].expand(int(free.sum())), rtol=0, atol=1e-15)
    tok = torch.where(clipped, torch.where(adv[:, None] > 0, torch.full_like(lr, hi), torch.full_like(lr, -lo)), lr)
    n = mask.sum(-1)
    s = torch.exp((tok * mask).sum(-1) / n.clamp(min=1))[n > 0]
    assert m["ratio_min"] == pytest.approx(float(s.min()), abs=1e-12)
    assert m["ratio_max"] == pytest.approx(float(s.max()), abs=1e-12)


def test_gmpo_refuses_token_sum_and_per_token_advantages():
    logp, old, adv, mask = make_inputs(1)
    for name in ("gmpo", "rspo"):
        with pytest.raises(ValueError, match="loss_agg_mode"):
            get_policy_loss(name)(logp, old, adv, mask, loss_agg_mode="seq-mean-token-sum",
                                  router_shift_weight=torch.ones_like(old))
        with pytest.raises(ConfigError, match="algorithm.loss_agg_mode"):
            load_config(None, [f"algorithm.loss={name}", "algorithm.loss_agg_mode=seq-mean-token-sum"])
    with pytest.raises(ValueError, match="one advantage per sequence"):
        get_policy_loss("gmpo")(logp, old, adv[:, None].expand(mask.shape), mask)


# ----------------------------------------------------------------------------------------------- router shift
def test_router_shift_ratio_hand_example_and_float64_reference():
    # one token, L = 2, k = 2: |diffs| 0.1, 0.2 (layer 0) and 0, 0.4 (layer 1) -> mean 0.175
    old = torch.tensor([[[-1.0, -2.0], [-0.5, -3.0]]], dtype=F64)
    cur = torch.tensor([[[-1.1, -1.8], [-0.5, -3.4]]], dtype=F64)
    assert router_shift_ratio(cur, old).item() == pytest.approx(math.exp(-0.175), rel=0, abs=1e-15)
    cur_s, old_s, _, _ = hand_scores(0, 4, 6, spread=0.5)
    gamma = router_shift_ratio(cur_s, old_s)  # (B, T)
    torch.testing.assert_close(gamma.reshape(-1), gamma_ref(cur_s.reshape(-1, 3, 2), old_s.reshape(-1, 3, 2)),
                               rtol=0, atol=1e-15)
    w = router_shift_weight(gamma, floor=0.8)
    assert (gamma < 0.8).any() and (gamma > 0.8).any()  # the floor binds for some tokens, not all
    torch.testing.assert_close(w, torch.where(gamma < 0.8, torch.full_like(gamma, 0.8), gamma), rtol=0, atol=0)
    m = router_shift_metrics(gamma.reshape(-1), 0.8)
    g = gamma.reshape(-1)
    assert m["moe/router_shift_mean"] == pytest.approx(float(g.mean()), abs=1e-7)
    assert m["moe/router_shift_p10"] == pytest.approx(float(g.quantile(0.1)), abs=1e-6)
    assert m["moe/router_shift_p90"] == pytest.approx(float(g.quantile(0.9)), abs=1e-6)
    assert m["moe/router_shift_floor_frac"] == pytest.approx(float((g < 0.8).double().mean()), abs=1e-7)
    with pytest.raises(ValueError, match="router_shift_floor"):
        router_shift_weight(gamma, floor=0.0)


def test_router_shift_weight_is_exactly_one_when_router_unchanged():
    _, old_s, _, _ = hand_scores(1, 3, 5)
    for dtype in (F64, torch.float32, torch.float16, torch.bfloat16):
        w = router_shift_weight(router_shift_ratio(old_s.to(dtype), old_s.to(dtype)), floor=0.5)
        assert (w == 1).all()
    m = router_shift_metrics(torch.ones(10), 0.8)
    assert all(float(m[f"moe/router_shift_{k}"]) == 1 for k in ("mean", "p10", "p90", "min"))


@pytest.mark.parametrize("mode", GEO_MODES)
def test_rspo_matches_float64_reference_on_hand_built_router_scores(mode):
    for seed in range(3):
        logp, old, adv, mask = make_inputs(seed, noise=0.3)
        cur_s, old_s, _, _ = hand_scores(10 + seed, *mask.shape, spread=0.4)
        w = router_shift_weight(router_shift_ratio(cur_s, old_s), floor=0.8)
        gamma = torch.clamp(gamma_ref(cur_s.flatten(0, 1), old_s.flatten(0, 1)).view(mask.shape), min=0.8)
        loss, m = get_policy_loss("rspo")(logp, old, adv, mask, loss_agg_mode=mode, router_shift_weight=w)
        want = geo_mean_ref(logp, old, adv, mask, 0.4, 0.4, mode, gamma=gamma)
        torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad_of(loss, logp), grad_of(want, logp), rtol=0, atol=1e-12)
        # the weight changed the loss, and ppo_kl still compares with the true old policy
        plain, _ = get_policy_loss("gmpo")(logp, old, adv, mask, loss_agg_mode=mode)
        assert abs(float((plain - loss).detach())) > 1e-6
        assert m["ppo_kl"] == pytest.approx(float(((old - logp.detach()) * mask).sum() / mask.sum()), abs=1e-12)


@pytest.mark.parametrize("name,clip", [("grpo", (0.2, 0.27)), ("gspo", (0.02, 0.03))])
def test_router_shift_plugs_into_grpo_and_gspo(name, clip):
    for seed in range(3):
        logp, old, adv, mask = make_inputs(seed, noise=0.1 if name == "grpo" else 0.02)
        cur_s, old_s, _, _ = hand_scores(20 + seed, *mask.shape, spread=0.3)
        w = router_shift_weight(router_shift_ratio(cur_s, old_s), floor=0.85)
        loss, _ = get_policy_loss(name)(logp, old, adv, mask, clip_low=clip[0], clip_high=clip[1],
                                        router_shift_weight=w)
        want = ratio_loss_ref(name, logp, old, adv, mask, clip[0], clip[1], w)
        torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad_of(loss, logp), grad_of(want, logp), rtol=0, atol=1e-12)


def test_gradient_flows_through_the_ratio_not_through_the_weight():
    logp, old, adv, mask = make_inputs(3, noise=0.3)
    B, T = mask.shape
    _, _, cur_logits, idx = hand_scores(4, B, T, spread=0.4)
    old_logits = cur_logits.detach().clone()
    cur_logits = (cur_logits + 0.3 * torch.randn(cur_logits.shape, dtype=F64,
                                                 generator=torch.Generator().manual_seed(9))).requires_grad_()
    cur = torch.log_softmax(cur_logits, -1).gather(-1, idx)  # depends on the router logits
    old_s = torch.log_softmax(old_logits, -1).gather(-1, idx)
    w = router_shift_weight(router_shift_ratio(cur, old_s), floor=0.8)
    assert not w.requires_grad  # a stop-gradient weight
    loss, _ = get_policy_loss("rspo")(logp, old, adv, mask, router_shift_weight=w)
    loss.backward()
    assert cur_logits.grad is None  # nothing reached the router through the weight
    want = geo_mean_ref(logp, old, adv, mask, 0.4, 0.4, "seq-mean-token-mean", gamma=w.detach())
    torch.testing.assert_close(logp.grad, grad_of(want, logp), rtol=0, atol=1e-12)
    assert logp.grad.abs().sum() > 0
    # the loss itself stops the gradient too, for a weight handed over with a graph attached
    x = torch.full((B, T), 0.1, dtype=F64, requires_grad=True)
    loss, _ = get_policy_loss("gspo")(logp, old, adv, mask, router_shift_weight=torch.exp(-x))
    loss.backward()
    assert x.grad is None


def test_router_shift_weight_checks():
    logp, old, adv, mask = make_inputs(2)
    with pytest.raises(ValueError, match="router_shift_weight"):
        get_policy_loss("rspo")(logp, old, adv, mask)
    bad = torch.ones_like(old)
    bad[mask.nonzero()[0].tolist()] = 0.0
    with pytest.raises(ValueError, match="router_shift_weight must be finite and > 0"):
        get_policy_loss("grpo")(logp, old, adv, mask, router_shift_weight=bad)
    with pytest.raises(ValueError, match="router_shift_weight shape"):
        get_policy_loss("grpo")(logp, old, adv, mask, router_shift_weight=bad[:, :-1])
    garbage = torch.ones_like(old)
    garbage[~mask] = float("nan")  # off the mask nothing is read
    a, _ = get_policy_loss("rspo")(logp, old, adv, mask, router_shift_weight=garbage)
    b, _ = get_policy_loss("gmpo")(logp, old, adv, mask)
    assert a == b


def test_router_shift_config_fields():
    cfg = load_config(None, ["algorithm.loss=grpo", "algorithm.router_shift=true"])
    assert cfg.algorithm.router_shift_floor == 0.8 and cfg.algorithm.router_score_dtype == "float16"
    with pytest.raises(ConfigError, match="algorithm.router_shift_floor"):
        load_config(None, ["algorithm.router_shift_floor=0"])
    with pytest.raises(ConfigError, match="algorithm.router_score_dtype"):
        load_config(None, ["algorithm.router_score_dtype=int8"])
    with pytest.raises(ConfigError, match="algorithm.use_engine_logprobs"):
        load_config(None, ["algorithm.loss=rspo", "algorithm.use_engine_logprobs=true"])


# ----------------------------------------------------------------------------------------------- on the policy
@pytest.fixture(scope="module")
def tiny():
    import copy

    import moe_gspo
    from helpers import TINY

    cfg = load_config("configs/train_tiny_cpu.yaml", TINY + ["algorithm.loss=rspo", "train.lr=0",
                                                             "train.micro_batch_size=3"])
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    return cfg, policy, copy.deepcopy(policy.state_dict())


def rollout_batch(cfg, B=5, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    lengths = torch.tensor([9, 6, 8, 9, 4][:B])
    att = torch.arange(T)[None] < lengths[:, None]
    resp = att & (torch.arange(T)[None] >= 3)
    return SimpleNamespace(input_ids=ids, attention_mask=att, response_mask=resp, routing=None,
                           sample_ids=torch.arange(B))


def test_recorded_scores_are_router_log_probs_of_the_routed_experts(tiny):
    from moe_gspo.model.routing_capture import RoutingCapture

    cfg, policy, state = tiny
    policy.load_state_dict(state)
    ids = rollout_batch(cfg).input_ids
    B, T = ids.shape
    inputs = []
    hooks = [r.register_forward_hook(lambda m, args, out: inputs.append(args[0].detach())) for r in policy.routers]
    cap = RoutingCapture(scores=True)
    with torch.no_grad():
        policy(ids, routing=cap)
    for h in hooks:
        h.remove()
    idx, scores = cap.stacked(), cap.scores_stacked()  # (B*T, L, k)
    for layer, (r, x) in enumerate(zip(policy.routers, inputs)):  # x: (T, B, H) sequence-major router input
        logits = x.double().transpose(0, 1).reshape(B * T, -1) @ r.weight.double().t()
        want = torch.log_softmax(logits, -1).gather(-1, idx[:, layer])
        torch.testing.assert_close(scores[:, layer].double(), want, rtol=0, atol=1e-5)
    # renormalized over the k routed experts the scores give the combine weights
    for layer, lr in cap.layers.items():
        torch.testing.assert_close(torch.softmax(scores[:, layer], -1), lr.topk_weights, rtol=0, atol=1e-6)
    # scoring the same experts by name gives the same numbers, in the given order
    order = torch.arange(idx.shape[-1] - 1, -1, -1)
    src = SimpleNamespace(indices=lambda layer: idx[:, layer, order])
    cap2 = RoutingCapture(score_at=src)
    with torch.no_grad():
        policy(ids, routing=cap2)
    assert torch.equal(cap2.scores_stacked(), scores[..., order])


def make_ctx(cfg, policy):
    from moe_gspo.routing import RoutingReplayCache
    from moe_gspo.train.optim import Optimizer, wrap_ddp
    from moe_gspo.train.step import StepContext

    mc = cfg.model
    replay = RoutingReplayCache("off", mc.num_hidden_layers, mc.num_experts_per_tok, mc.num_experts)
    ctx = StepContext(policy, None, cfg, replay, None)
    ctx.optim = Optimizer(wrap_ddp(policy, distributed=False), policy, lr=0.0)
    return ctx


def perturb_routers(policy, scale=0.05):
    with torch.no_grad():
        for i, r in enumerate(policy.routers):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(i)) * scale)


def test_step_weight_is_one_without_an_update_and_below_one_after_the_router_moves(tiny):
    from moe_gspo.train.step import old_logprob_pass, update_minibatch

    cfg, policy, state = tiny
    policy.load_state_dict(state)
    pb = rollout_batch(cfg)
    B = pb.input_ids.shape[0]
    ctx = make_ctx(cfg, policy)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0])
    old = old_logprob_pass(ctx, pb)
    mc = cfg.model
    assert old.router.bytes_per_token() == mc.num_hidden_layers * mc.num_experts_per_tok * 3  # uint8 + fp16
    m = update_minibatch(ctx, pb, old, adv, torch.arange(B))  # same weights, same batch layout
    assert m["moe/router_shift_mean"] == 1 and m["moe/router_shift_min"] == 1
    assert m["ratio_min"] == m["ratio_max"] == 1
    perturb_routers(policy)
    m = update_minibatch(ctx, pb, old, adv, torch.tensor([3, 0, 4, 1, 2]))  # shuffled rows
    assert 0.3 < m["moe/router_shift_p10"] <= m["moe/router_shift_mean"] <= m["moe/router_shift_p90"] < 1
    assert m["moe/router_shift_min"] < m["moe/router_shift_p10"]


def test_token_weight_uses_the_routing_that_produced_the_token(tiny):
    """Token t's log-prob depends on ids[:t] only, and so must its weight: changing the token at position p leaves
    the weights of tokens <= p alone and moves those after it (a weight read at the token's own position would
    move at p too)."""
    from moe_gspo.model.routing_capture import RoutingCapture
    from moe_gspo.train.logprob import batch_logprobs
    from moe_gspo.train.step import _router_shift_ratio, old_logprob_pass

    cfg, policy, state = tiny
    p = 5
    gammas = []
    for change in (False, True):
        policy.load_state_dict(state)
        pb = rollout_batch(cfg)
        if change:
            pb.input_ids[:, p] = (pb.input_ids[:, p] + 1) % cfg.model.vocab_size
        B, T = pb.input_ids.shape
        ctx = make_ctx(cfg, policy)
        old = old_logprob_pass(ctx, pb)
        perturb_routers(policy)
        src = old.router.source(torch.arange(B), T, policy.device)
        cap = RoutingCapture(score_at=src)
        with torch.no_grad():
            batch_logprobs(policy, pb.input_ids, cap, want_entropy=False)
        gammas.append(_router_shift_ratio(old.router, cap, src, (B, T)))
    a, b = gammas
    assert (a[:, 0] == 1).all()
    assert torch.equal(a[:, :p + 1], b[:, :p + 1])
    assert (a[:, p + 1] != b[:, p + 1]).any()


# ----------------------------------------------------------------------------------------------- TP / EP
WORKER = Path(__file__).parent / "dist" / "router_shift_worker.py"


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    from helpers import make_hf_checkpoint, run_torchrun

    d = tmp_path_factory.mktemp("rshift")
    ckpt = make_hf_checkpoint(d / "ckpt", vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8,
                              experts=4, topk=2, inter=16, seed=3)
    run_torchrun(WORKER, "--ckpt", ckpt, "--out", d / "single.pt", nproc=1)
    return ckpt, d, torch.load(d / "single.pt")


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_router_shift_parallel_equals_single_process(single_process, tp, ep):
    from helpers import run_torchrun

    ckpt, d, ref = single_process
    assert 0.5 < ref["gamma"][ref["mask"]].min() < 1  # the perturbation moved the router
    torch.testing.assert_close(ref["cur_before"], ref["old_scores"], rtol=0, atol=1e-6)  # unchanged router
    run_torchrun(WORKER, "--ckpt", ckpt, "--tp", tp, "--ep", ep, "--out", d / f"tp{tp}_ep{ep}.pt", nproc=2)
    out = torch.load(d / f"tp{tp}_ep{ep}.pt")
    assert torch.equal(out["old_idx"], ref["old_idx"]), "old experts differ from the single-process run"
    for key in ("old_scores", "gamma"):
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-5, msg=lambda m: f"{key}: {m}")
    for key in ("pg_loss", "grad_norm"):  # rank-averaged loss with global denominators; the reduced grad norm
        assert out["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
