"""SAPO and CISPO (moe_gspo/losses/sapo_cispo.py) against float64 references written out per token with `math`:
value and gradient, default hyperparameters and aggregation, both advantage shapes, every aggregation mode."""

from __future__ import annotations

import math

import pytest
import torch

from moe_gspo.losses import get_policy_loss, loss_denominator, POLICY_LOSSES

D = torch.float64


def _inputs(seed, spread=0.4, per_token=False):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = True
    mask[3] = False  # an empty response
    logp = (-torch.rand(B, T, generator=g, dtype=D) * 3).requires_grad_()
    old = logp.detach() + spread * torch.randn(B, T, generator=g, dtype=D)  # ratios far inside and outside bands
    old[~mask] = float("nan")  # garbage off the mask
    adv = torch.randn(B, T, generator=g, dtype=D) if per_token else torch.tensor([1.3, -0.7, 0.4, 2.0], dtype=D)
    return logp, old, adv, mask


def _agg(terms, mask, mode):
    """terms[b][t] per response token -> the aggregated scalar (docs/guide/losses.md)."""
    rows = [[terms[b][t] for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / len(rows)


def _adv(adv, b, t):
    return float(adv[b, t]) if adv.dim() == 2 else float(adv[b])


def _token_ref(logp, old, adv, mask, mode, term):
    """(loss, d loss / d logp) of a loss whose per-token term(a, r, logp) -> (value, d value / d logp) is given in
    python floats, aggregated by `mode`."""
    B, T = mask.shape
    val = [[0.0] * T for _ in range(B)]
    der = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                lp = float(logp[b, t].detach())
                val[b][t], der[b][t] = term(_adv(adv, b, t), math.exp(lp - float(old[b, t])), lp)
    return _agg(val, mask, mode), _weights(der, mask, mode)


def _sapo_ref(logp, old, adv, mask, mode, tau_pos=1.0, tau_neg=1.05):
    """l = -(4/tau) sigmoid(tau (r - 1)) A, dl/dlogp = -(4/tau) s (1 - s) tau r A."""
    def term(a, r, lp):
        tau = tau_pos if a > 0 else tau_neg
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        return -(4 / tau) * s * a, -4 * s * (1 - s) * r * a
    return _token_ref(logp, old, adv, mask, mode, term)


def _cispo_ref(logp, old, adv, mask, mode, low=1.0, high=0.28):
    """l = -w A logp with w = clip(r, 1 - low, 1 + high) held constant: dl/dlogp = -w A."""
    def term(a, r, lp):
        w = min(max(r, 1 - low), 1 + high)
        return -w * a * lp, -w * a
    return _token_ref(logp, old, adv, mask, mode, term)


def _weights(der, mask, mode):
    """The gradient of _agg(terms) given d term / d logp per token: the aggregation's weight times der."""
    B, T = mask.shape
    n_tok = int(mask.sum())
    n_seq = int(mask.any(-1).sum())
    out = torch.zeros(B, T, dtype=D)
    for b in range(B):
        L = int(mask[b].sum())
        for t in range(T):
            if mask[b, t]:
                k = {"token-mean": 1 / n_tok, "seq-mean-token-mean": 1 / (L * n_seq),
                     "seq-mean-token-sum": 1 / n_seq}[mode]
                out[b, t] = k * der[b][t]
    return out


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_sapo_value_and_gradient_equal_the_reference(mode, per_token, seed):
    logp, old, adv, mask = _inputs(seed, per_token=per_token)
    loss, m = get_policy_loss("sapo")(logp, old, adv, mask, loss_agg_mode=mode)
    ref, gref = _sapo_ref(logp, old, adv, mask, mode)
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, gref, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("tau", [(0.5, 2.0), (3.0, 3.0)])
def test_sapo_temperatures_are_used(tau):
    logp, old, adv, mask = _inputs(2)
    loss, _ = get_policy_loss("sapo")(logp, old, adv, mask, tau_pos=tau[0], tau_neg=tau[1])
    loss.backward()
    ref, gref = _sapo_ref(logp, old, adv, mask, "seq-mean-token-mean", *tau)
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-12)
    torch.testing.assert_close(logp.grad, gref, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="gate temperatures must be > 0"):
        get_policy_loss("sapo")(logp, old, adv, mask, tau_neg=0.0)


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    """At r = 1 the gate's slope is 1: SAPO's gradient is -A / (agg count), like an unclipped PPO term."""
    logp, _, adv, mask = _inputs(3)
    loss, m = get_policy_loss("sapo")(logp, logp.detach(), adv, mask, loss_agg_mode="token-mean")
    loss.backward()
    expected = torch.where(mask, -adv[:, None].expand_as(mask) / mask.sum(), 0.0)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-14, atol=0)
    assert float(m["sapo_grad_scale_mean"]) == 1.0 and float(m["pg_clipfrac"]) == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("clip", [None, (0.2, 0.28), (0.5, 0.1)])
def test_cispo_value_and_gradient_equal_the_reference(mode, per_token, clip):
    logp, old, adv, mask = _inputs(4, per_token=per_token)
    kw = {} if clip is None else {"clip_low": clip[0], "clip_high": clip[1]}
    loss, m = get_policy_loss("cispo")(logp, old, adv, mask, loss_agg_mode=mode, **kw)
    ref, gref = _cispo_ref(logp, old, adv, mask, mode, *(clip or (1.0, 0.28)))
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, gref, rtol=1e-12, atol=1e-15)
    r = torch.exp(logp.detach() - old)[mask]
    low, high = clip or (1.0, 0.28)
    capped = ((r < 1 - low) | (r > 1 + high)).double().mean()
    assert float(m["pg_clipfrac"]) == pytest.approx(float(capped)) and 0 < float(m["pg_clipfrac"]) < 1


def test_cispo_keeps_the_gradient_of_tokens_whose_weight_is_capped():
    """Where GRPO's clipped branch zeroes a token's gradient, CISPO's is the capped weight times -A."""
    logp, old, adv, mask = _inputs(5, spread=1.0)
    (cispo,) = torch.autograd.grad(get_policy_loss("cispo")(logp, old, adv, mask)[0], logp)
    (grpo,) = torch.autograd.grad(get_policy_loss("grpo")(logp, old, adv, mask, loss_agg_mode="token-mean")[0], logp)
    dead = mask & (grpo == 0) & (adv[:, None] != 0)
    assert dead.any() and (cispo[dead] != 0).all()


def test_defaults():
    assert POLICY_LOSSES["cispo"].default_clip == (1.0, 0.28) and POLICY_LOSSES["cispo"].default_agg_mode == "token-mean"
    assert POLICY_LOSSES["sapo"].default_agg_mode == "seq-mean-token-mean"
    logp, old, adv, mask = _inputs(6)
    for name in ("sapo", "cispo"):
        a, _ = get_policy_loss(name)(logp, old, adv, mask)
        b, _ = get_policy_loss(name)(logp, old, adv, mask, loss_agg_mode=POLICY_LOSSES[name].default_agg_mode,
                                     clip_low=POLICY_LOSSES[name].default_clip[0], clip_high=POLICY_LOSSES[name].default_clip[1])
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="clip_low <= 1"):
        get_policy_loss("cispo")(logp, old, adv, mask, clip_low=1.5)
    with pytest.raises(ValueError, match="clip_low < 1"):
        get_policy_loss("grpo")(logp, old, adv, mask, clip_low=1.0)


@pytest.mark.parametrize("name", ["sapo", "cispo"])
@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_the_global_denominator_sum_to_the_full_batch(name, mode):
    logp, old, adv, mask = _inputs(7)
    fn = get_policy_loss(name)
    full, _ = fn(logp, old, adv, mask, loss_agg_mode=mode)
    d = loss_denominator(mask, mode)
    parts = sum(fn(logp[s], old[s], adv[s], mask[s], loss_agg_mode=mode, loss_denominator=d)[0]
                for s in (slice(0, 1), slice(1, 3), slice(3, 4)))
    assert float(parts) == pytest.approx(float(full), rel=1e-13)
