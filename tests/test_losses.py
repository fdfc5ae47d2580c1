"""Policy losses grpo / gspo / gspo_token against a plain float64 reference, closed forms and docs/guide/method.md."""

import math

import pytest
import torch

from moe_gspo.losses import AGG_MODES, POLICY_LOSSES, agg_loss, agg_seq_loss, get_policy_loss

F64 = torch.float64


def reference_loss(name, logp, old, adv, mask, clip_low, clip_high, mode, ref=None, beta=0.0, clip_c=None):
    """Eager float64 reference written sequence by sequence, straight from docs/guide/method.md."""
    total, denom = 0.0, 0
    for i in range(logp.shape[0]):
        idx = mask[i].nonzero().flatten()
        n = idx.numel()
        if n == 0:
            continue
        lp, ol = logp[i, idx], old[i, idx]
        a = adv[i] if adv.dim() == 1 else adv[i, idx]
        if name == "grpo":
            w = torch.exp(lp - ol)
            terms = -torch.min(w * a, torch.clamp(w, 1 - clip_low, 1 + clip_high) * a)
            if clip_c is not None:
                terms = torch.where(a < 0, torch.min(terms, -a * clip_c), terms)
        elif name == "gspo":
            s = torch.exp((lp - ol).sum() / n)
            terms = -torch.min(s * a, torch.clamp(s, 1 - clip_low, 1 + clip_high) * a) * torch.ones(n, dtype=F64)
        else:  # gspo_token
            s = torch.exp((lp - ol).sum().detach() / n) * torch.exp(lp - lp.detach())
            terms = -torch.min(s * a, torch.clamp(s, 1 - clip_low, 1 + clip_high) * a)
        if beta:
            d = ref[i, idx] - lp
            terms = terms + beta * (torch.exp(d) - d - 1)
        if mode == "token-mean":
            total, denom = total + terms.sum(), denom + n
        elif mode == "seq-mean-token-mean":
            total, denom = total + terms.mean(), denom + 1
        else:
            total, denom = total + terms.sum(), denom + 1
    return total / max(denom, 1)


def make_inputs(seed, B=6, T=12, noise=0.3, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(B, T, generator=g, dtype=F64)
    old = logp + noise * torch.randn(B, T, generator=g, dtype=F64)
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    start = torch.randint(0, 4, (B, 1), generator=g)
    length = torch.randint(0, T - 3, (B, 1), generator=g)
    length[0] = T - 4  # at least one non-empty row
    pos = torch.arange(T)[None]
    mask = (pos >= start) & (pos < start + length)
    adv = torch.randn(B, T, generator=g, dtype=F64) if per_token_adv else torch.randn(B, generator=g, dtype=F64)
    return logp.requires_grad_(), old, adv, mask, ref


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def test_registry_and_defaults():
    assert set(POLICY_LOSSES) == {"grpo", "gspo", "gspo_token", "gmpo", "rspo", "sapo", "cispo"}
    assert {n: c.default_clip for n, c in POLICY_LOSSES.items()} == {"grpo": (0.2, 0.27), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4),
                            "gmpo": (0.4, 0.4), "rspo": (0.4, 0.4),  # gmpo/rspo: log-space bounds
                            "sapo": (0.2, 0.28), "cispo": (1.0, 0.28)}  # sapo: diagnostic band; cispo: no lower bound
    with pytest.raises(ValueError, match="cispo, gmpo, grpo, gspo, gspo_token, rspo, sapo"):
        get_policy_loss("ppo")


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token"])
def test_none_clip_uses_paper_defaults(name):
    logp, old, adv, mask, _ = make_inputs(0, noise=1e-3)
    fn = get_policy_loss(name)
    a, _ = fn(logp, old, adv, mask)
    b, _ = fn(logp, old, adv, mask, clip_low=POLICY_LOSSES[name].default_clip[0], clip_high=POLICY_LOSSES[name].default_clip[1])
    assert a == b


def test_worked_example():
    # G = 4, rewards [1, 0, 1, 0] -> A = [+1, -1, +1, -1]; y_1: 512 tokens, two with ratios 1.9 and 0.4
    G, T = 4, 512
    logp = torch.zeros(G, T, dtype=F64, requires_grad=True)
    old = torch.zeros(G, T, dtype=F64)
    old[0, 0], old[0, 1] = -math.log(1.9), -math.log(0.4)
    mask = torch.ones(G, T, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)
    loss, m = get_policy_loss("gspo")(logp, old, adv, mask)
    s1 = m["ratio_min"].item()
    assert abs(s1 - 0.99946) < 5e-6 and abs(s1 - math.exp((math.log(1.9) + math.log(0.4)) / 512)) < 1e-15
    # A_1 > 0 and s_1 < 1: not clipped, every token of y_1 gets -s_1 A_1 / |y_1| / G
    assert m["seq_clipfrac"] == 0
    torch.testing.assert_close(grad_of(loss, logp)[0], torch.full((T,), -s1 / T / G, dtype=F64), rtol=0, atol=1e-15)
    # with A_1 = -1, s_1 = 0.99946 < 1 - 3e-4 is clipped: zero gradient, a quarter of sequences and tokens
    adv[0] = -1.0
    loss, m = get_policy_loss("gspo")(logp, old, adv, mask)
    assert m["seq_clipfrac"] == 0.25 and m["pg_clipfrac"] == 0.25
    assert (grad_of(loss, logp)[0] == 0).all()
    # GRPO on the same y_1 with A = +1: only the 1.9 token is clipped (at 1 + 0.27)
    adv[0] = 1.0
    loss, m = get_policy_loss("grpo")(logp, old, adv, mask)
    assert m["pg_clipfrac"] == pytest.approx(1 / (G * T))
    assert grad_of(loss, logp)[0, 0] == 0


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(
    "name,clip,noise,kw",
    [
        ("grpo", (0.2, 0.27), 0.3, {}),
        ("grpo", (0.2, 0.27), 0.8, {"clip_ratio_c": 1.5}),
        ("grpo", (0.1, 0.15), 0.3, {"per_token_adv": True}),
        ("gspo", (3e-4, 4e-4), 1e-3, {}),
        ("gspo", (0.02, 0.03), 0.1, {}),
        ("gspo_token", (3e-4, 4e-4), 1e-3, {}),
        ("gspo_token", (0.02, 0.03), 0.1, {"per_token_adv": True}),
    ],
)
def test_matches_reference(mode, name, clip, noise, kw):
    kw = dict(kw)
    per_token = kw.pop("per_token_adv", False)
    for seed in range(3):
        logp, old, adv, mask, ref = make_inputs(seed, noise=noise, per_token_adv=per_token)
        beta = 0.1 if seed == 2 else 0.0
        loss, m = get_policy_loss(name)(
            logp, old, adv, mask, clip_low=clip[0], clip_high=clip[1], loss_agg_mode=mode,
            ref_logp=ref if beta else None, beta=beta, **kw,
        )  # fmt: skip
        expected = reference_loss(
            name, logp, old, adv, mask, clip[0], clip[1], mode, ref=ref, beta=beta, clip_c=kw.get("clip_ratio_c")
        )
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad_of(loss, logp), grad_of(expected, logp), rtol=0, atol=1e-12)
        assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
        if beta:
            assert "kl_loss" in m


def test_reference_has_clipped_and_unclipped_cases():
    """The random inputs above actually exercise both branches (else the reference tests prove little)."""
    for name, noise in (("grpo", 0.3), ("gspo", 1e-3)):
        logp, old, adv, mask, _ = make_inputs(1, B=32, noise=noise)
        _, m = get_policy_loss(name)(logp, old, adv, mask)
        assert 0.05 < m["pg_clipfrac"] < 0.95, (name, m["pg_clipfrac"])
    _, m = get_policy_loss("grpo")(*make_inputs(1, B=32, noise=0.8)[:4], clip_ratio_c=1.5)
    assert m["pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_token_equals_gspo_with_equal_advantages(mode):
    for seed in range(4):
        logp, old, adv, mask, _ = make_inputs(seed, B=16, noise=1e-3)
        logp2 = logp.detach().clone().requires_grad_()
        loss_s, m_s = get_policy_loss("gspo")(logp, old, adv, mask, loss_agg_mode=mode)
        adv_BT = adv[:, None].expand(-1, mask.shape[1])
        loss_t, m_t = get_policy_loss("gspo_token")(logp2, old, adv_BT, mask, loss_agg_mode=mode)
        assert abs(loss_s - loss_t) < 1e-12
        for k in ("pg_clipfrac", "seq_clipfrac", "ratio_mean", "ratio_min", "ratio_max", "ppo_kl"):
            assert abs(m_s[k] - m_t[k]) < 1e-12, k
        g_s, g_t = grad_of(loss_s, logp), grad_of(loss_t, logp2)
        torch.testing.assert_close(g_s, g_t, rtol=0, atol=1e-12)
        # same clip mask: the rows with zero gradient (clipped or empty) coincide
        assert torch.equal((g_s != 0).any(-1), (g_t != 0).any(-1))


def test_gspo_gradient_closed_form():
    # grad J_i = s_i A_i / |y_i| * sum_t grad logp_{i,t} (times 1/G); clipped responses give 0
    G = 16
    logp, old, adv, mask, _ = make_inputs(7, B=G, noise=1e-3)
    loss, m = get_policy_loss("gspo")(logp, old, adv, mask)
    grad = grad_of(loss, logp)
    n = mask.sum(-1)
    s = torch.exp(((logp - old) * mask).sum(-1) / n.clamp(min=1)).detach()
    lo, hi = POLICY_LOSSES["gspo"].default_clip
    clipped = ((adv > 0) & (s > 1 + hi)) | ((adv < 0) & (s < 1 - lo))
    assert clipped.any() and (~clipped & (n > 0)).any()
    num_seq = (n > 0).sum()
    for i in range(G):
        expected = 0.0 if clipped[i] or n[i] == 0 else -(s[i] * adv[i] / n[i] / num_seq).item()
        assert torch.allclose(grad[i][mask[i]], torch.tensor(expected, dtype=F64), rtol=0, atol=1e-15)
        assert (grad[i][~mask[i]] == 0).all()
    assert m["seq_clipfrac"] == pytest.approx((clipped & (n > 0)).sum().item() / num_seq.item())


@pytest.mark.parametrize("mode", AGG_MODES)
def test_grpo_at_ratio_one_is_plain_policy_gradient(mode):
    logp, _, adv, mask, _ = make_inputs(3)
    loss, m = get_policy_loss("grpo")(logp, logp.detach().clone(), adv, mask, loss_agg_mode=mode)
    # plain policy gradient: minimize -agg(A_i * logp_{i,t})
    pg = agg_loss(-adv[:, None] * logp, mask, mode)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(pg, logp), rtol=0, atol=1e-15)
    assert m["pg_clipfrac"] == 0 and m["ratio_min"] == 1 and m["ratio_max"] == 1


def test_agg_seq_loss_equals_broadcast_agg_loss():
    _, _, adv, mask, _ = make_inputs(4)
    for mode in AGG_MODES:
        broadcast = agg_loss(adv[:, None].expand(mask.shape), mask, mode)
        torch.testing.assert_close(agg_seq_loss(adv, mask.sum(-1), mode), broadcast, rtol=0, atol=1e-15)
    # the pitfall: token-mean of a broadcast per-sequence term weighs sequences by length
    lengths = torch.tensor([1, 9])
    vals = torch.tensor([1.0, 0.0], dtype=F64)
    assert agg_seq_loss(vals, lengths, "seq-mean-token-mean") == 0.5
    assert agg_seq_loss(vals, lengths, "token-mean") == 0.1


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token"])
@pytest.mark.parametrize("tensor", ["logp", "old_logp", "advantages", "ref_logp"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_inputs_raise_naming_tensor(name, tensor, bad):
    logp, old, adv, mask, ref = make_inputs(5)
    inputs = {"logp": logp.detach().clone(), "old_logp": old, "advantages": adv, "ref_logp": ref}
    i, t = mask.nonzero()[0].tolist()
    if tensor == "advantages":
        inputs[tensor][i] = bad
    else:
        inputs[tensor][i, t] = bad
    with pytest.raises(ValueError, match=rf"\b{tensor}\b"):
        get_policy_loss(name)(
            inputs["logp"], inputs["old_logp"], inputs["advantages"], mask, ref_logp=inputs["ref_logp"], beta=0.1
        )


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token"])
def test_garbage_off_mask_is_ignored(name):
    logp, old, adv, mask, ref = make_inputs(6)
    loss, _ = get_policy_loss(name)(logp, old, adv, mask, ref_logp=ref, beta=0.1)
    old2, ref2, logp2 = old.clone(), ref.clone(), logp.detach().clone()
    old2[~mask], ref2[~mask], logp2[~mask] = -float("inf"), float("nan"), float("nan")
    adv2 = adv.clone()
    adv2[~mask.any(-1)] = float("nan")
    logp2.requires_grad_()
    loss2, m2 = get_policy_loss(name)(logp2, old2, adv2, mask, ref_logp=ref2, beta=0.1)
    assert loss2 == loss
    g = grad_of(loss2, logp2)
    assert torch.isfinite(g).all() and (g[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in m2.values())


def test_extreme_log_ratio_is_clamped_and_finite():
    logp = torch.zeros(2, 3, requires_grad=True)
    old = torch.tensor([[-200.0, 0.0, 0.0], [300.0, 0.0, 0.0]])
    for name in POLICY_LOSSES:
        extra = {"router_shift_weight": torch.ones(2, 3)} if name == "rspo" else {}  # rspo needs its weight
        loss, m = get_policy_loss(name)(logp, old, torch.tensor([-1.0, 1.0]), torch.ones(2, 3, dtype=torch.bool),
                                        **extra)
        assert torch.isfinite(loss) and torch.isfinite(grad_of(loss, logp)).all()
        assert m["ratio_max"] <= math.exp(20) * 1.001


def test_bad_arguments():
    logp, old, adv, mask, _ = make_inputs(0)
    with pytest.raises(ValueError, match="gspo_token"):
        get_policy_loss("gspo")(logp, old, adv[:, None].expand(mask.shape), mask)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        get_policy_loss("grpo")(logp, old, adv, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="ref_logp"):
        get_policy_loss("grpo")(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        get_policy_loss("grpo")(logp, old, adv[:-1], mask)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss("grpo")(logp, old, adv, mask, clip_ratio_c=0.5)
    with pytest.raises(TypeError):
        get_policy_loss("gspo")(logp, old, adv, mask, clip_ratio_c=3.0)  # dual-clip is grpo-only


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token"])
def test_low_precision_inputs_compute_in_float32(name):
    logp, old, adv, mask, _ = make_inputs(8, noise=1e-2)
    lp16 = logp.detach().to(torch.bfloat16).requires_grad_()
    loss, m = get_policy_loss(name)(lp16, old.to(torch.bfloat16), adv.float(), mask, clip_low=0.01, clip_high=0.02)
    assert loss.dtype == torch.float32
    g = grad_of(loss, lp16)
    assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()


@pytest.mark.parametrize("estimator", ["k1", "k3", "low_var_kl"])
@pytest.mark.parametrize("loss_name", ["grpo", "gspo"])
def test_kl_beta_adds_exactly_the_estimators_gradient_float64(estimator, loss_name):
    """d/dlogp [loss(beta) - loss(0)] == beta * w_it * dKL_t/dlogp, with the KL derivative written out by hand
    (k1: 1; k3 and low_var_kl inside their clamps: 1 - exp(ref - logp)) and w_it the seq-mean-token-mean weight."""
    from moe_gspo.losses import get_policy_loss, POLICY_LOSSES

    g = torch.Generator().manual_seed(0)
    B, T, beta = 4, 7, 0.3
    logp0 = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp0 + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp0 + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    fn = get_policy_loss(loss_name)
    grads = []
    for b in (0.0, beta):
        logp = logp0.clone().requires_grad_(True)
        loss, m = fn(logp, old, adv, mask, ref_logp=ref, beta=b, kl_estimator=estimator)
        loss.backward()
        grads.append(logp.grad)
    d_kl = torch.ones_like(logp0) if estimator == "k1" else 1 - torch.exp(ref - logp0)
    w = mask / mask.sum(-1, keepdim=True) / B  # seq-mean-token-mean over B non-empty sequences
    torch.testing.assert_close(grads[1] - grads[0], beta * w * d_kl, rtol=1e-6, atol=1e-12)
    kl = {"k1": logp0 - ref, "k3": torch.exp(ref - logp0) - (ref - logp0) - 1}.get(estimator)
    if kl is None:
        kl = torch.exp(ref - logp0) - (ref - logp0) - 1
    torch.testing.assert_close(m["kl_loss"], ((kl * mask).sum(-1) / mask.sum(-1)).mean(), rtol=1e-6, atol=1e-12)


def test_gspo_without_length_normalization_uses_the_whole_responses_ratio():
    """algorithm.loss_options.length_normalize=false (an ablation): s_i = exp(sum_t (logp - old_logp)), in value and
    gradient equal to the float64 formula; the default keeps the paper's 1/|y_i|."""
    from moe_gspo.config import load_config

    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.02 - 1).requires_grad_()
    old = logp.detach() + torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.02
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[0, 3:] = False
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    a = load_config(None, ["algorithm.loss_options.length_normalize=false", "algorithm.clip_low=0.9",
                           "algorithm.clip_high=100"]).algorithm
    got, m = a.policy_loss()(logp, old, adv, mask)
    s = torch.exp(torch.where(mask, logp - old, 0).sum(-1))
    want = (-adv * s).mean()  # no clip is active at these bounds
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert torch.allclose(torch.autograd.grad(got, logp)[0], torch.autograd.grad(want, logp)[0], rtol=1e-12, atol=0)
    normalized, _ = load_config(None, ["algorithm.clip_low=0.9", "algorithm.clip_high=100"]).algorithm.policy_loss()(
        logp, old, adv, mask)
    assert not torch.allclose(normalized, want)
