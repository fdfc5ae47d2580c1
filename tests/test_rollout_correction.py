"""Rollout-mismatch correction (moe_gspo/losses/rollout_correction.py) and its use by every loss and the trainer.

Float64 references are written out per element with `math` from the formulas in docs/guide/losses.md; every IS level x
threshold kind and every rejection mode is checked in value, and the loss-side weight in gradient."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moe_gspo.config import ConfigError, load_config
from moe_gspo.losses import (POLICY_LOSSES, RS_MODES, get_policy_loss, rollout_is_weights, rollout_log_ratio,
                             rollout_rejection_mask)

D = torch.float64
# 3 responses: lengths 4, 2, 0 (an empty one), garbage off the mask
MASK = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
LR = torch.tensor([[0.30, -0.05, 0.01, -0.40, float("nan")],
                   [float("-inf"), 0.02, -0.01, 5.0, 7.0],
                   [1.0, 2.0, 3.0, 4.0, 5.0]], dtype=D)


def _rows():
    """(row, [(col, log-ratio)]) of the masked entries."""
    return [[(t, float(LR[b, t])) for t in range(LR.shape[1]) if MASK[b, t]] for b in range(LR.shape[0])]


def _ref_is(level, threshold):
    out = [[0.0] * LR.shape[1] for _ in range(LR.shape[0])]
    for b, row in enumerate(_rows()):
        seq = math.exp(max(-20, min(20, sum(x for _, x in row))))
        for t, x in row:
            raw = math.exp(max(-20, min(20, x))) if level == "token" else seq
            if isinstance(threshold, tuple):
                w = raw if threshold[0] <= raw <= threshold[1] else 0.0
            else:
                w = min(raw, threshold)
            out[b][t] = w
    return torch.tensor(out, dtype=D)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.1, 2.0, (0.7, 1.2), (0.95, 1.25)])
def test_is_weights_equal_the_written_out_reference(level, threshold):
    w, m = rollout_is_weights(LR, MASK, level=level, threshold=threshold)
    ref = _ref_is(level, threshold)
    assert w.dtype == D and not w.requires_grad
    torch.testing.assert_close(w, ref, rtol=1e-15, atol=0)
    vals = [float(ref[b, t]) for b, row in enumerate(_rows()) for t, _ in row]
    n = len(vals)
    assert float(m["rollout_corr/is_mean"]) == pytest.approx(sum(vals) / n, rel=1e-6)
    assert float(m["rollout_corr/is_max"]) == pytest.approx(max(vals), rel=1e-6)
    assert float(m["rollout_corr/is_min"]) == pytest.approx(min(vals), rel=1e-6)
    mean = sum(vals) / n
    ess = 1.0 / (sum((v / mean) ** 2 for v in vals) / n) if mean > 0 else 0.0
    assert float(m["rollout_corr/is_ess"]) == pytest.approx(ess, rel=1e-6)
    zeroed = [v == 0.0 for v in vals] if isinstance(threshold, tuple) else [False] * n
    assert float(m["rollout_corr/is_masked_frac"]) == pytest.approx(sum(zeroed) / n)
    seq_zeroed = [any(float(ref[b, t]) == 0.0 for t, _ in row) for b, row in enumerate(_rows()) if row]
    assert float(m["rollout_corr/is_seq_masked_frac"]) == pytest.approx(
        sum(seq_zeroed) / 2 if isinstance(threshold, tuple) else 0.0)


def test_is_hand_example():
    # token TIS at 1.1: exp(0.3) = 1.3499 -> 1.1; sequence: exp(0.30 - 0.05 + 0.01 - 0.40) = exp(-0.14)
    w, _ = rollout_is_weights(LR, MASK, "token", 1.1)
    assert float(w[0, 0]) == 1.1 and float(w[0, 1]) == math.exp(-0.05)
    w, m = rollout_is_weights(LR, MASK, "sequence", (0.9, 1.1))
    assert float(w[0, 0]) == 0.0 and float(w[1, 1]) == pytest.approx(math.exp(0.01), rel=1e-15)
    assert float(m["rollout_corr/is_masked_frac"]) == pytest.approx(4 / 6)


def _ref_keep(mode, threshold):
    est = mode.rsplit("_", 1)[1]
    if est == "k1":
        lower, upper = threshold if isinstance(threshold, tuple) else (1 / threshold, threshold)
        ok = lambda s: math.log(lower) <= s <= math.log(upper)  # noqa: E731
    else:
        ok = lambda s: s <= threshold  # noqa: E731
    f = {"k1": lambda x: -x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: math.exp(x) - 1 - x}[est]
    keep = [[False] * LR.shape[1] for _ in range(LR.shape[0])]
    for b, row in enumerate(_rows()):
        stats = [f(max(-20, min(20, x))) for _, x in row]
        for i, (t, _) in enumerate(row):
            if mode.startswith("token_"):
                keep[b][t] = ok(stats[i])
            elif mode.startswith("seq_sum_"):
                keep[b][t] = ok(sum(stats))
            elif mode.startswith("seq_mean_"):
                keep[b][t] = ok(sum(stats) / len(stats))
            else:
                keep[b][t] = ok(max(stats))
    return torch.tensor(keep)


THRESHOLDS = {"k1": [(0.8, 1.2), 1.05, (0.7, 1.6), (0.98, 1.02)], "k2": [0.001, 0.02, 1.0], "k3": [0.001, 0.02, 1.0]}


@pytest.mark.parametrize("mode,threshold", [(m, t) for m in RS_MODES for t in THRESHOLDS[m[-2:]]])
def test_rejection_mask_equals_the_written_out_reference(mode, threshold):
    keep, m = rollout_rejection_mask(LR, MASK, mode, threshold)
    ref = _ref_keep(mode, threshold)
    assert torch.equal(keep, ref), (keep, ref)
    assert not (keep & ~MASK).any()
    assert float(m["rollout_corr/rs_masked_frac"]) == pytest.approx(float((MASK & ~ref).sum()) / 6)
    assert float(m["rollout_corr/rs_seq_masked_frac"]) == pytest.approx(
        float((MASK & ~ref).any(-1).sum()) / 2)


def test_rejection_modes_differ_on_the_example():
    """The example is not trivial: every mode keeps and rejects tokens at some of its thresholds."""
    for mode in RS_MODES:
        keeps = [_ref_keep(mode, t)[MASK] for t in THRESHOLDS[mode[-2:]]]
        assert any(k.any() for k in keeps) and any((~k).any() for k in keeps), mode


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.0, 2.0, (0.5, 2.0), (1.0, 1.0)])
def test_weights_are_exactly_one_and_nothing_is_rejected_when_engine_equals_trainer(level, threshold):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 9, generator=g, dtype=torch.float32) * 5
    mask = torch.rand(4, 9, generator=g) > 0.3
    lr = rollout_log_ratio(logp, logp.clone(), mask)
    w, m = rollout_is_weights(lr, mask, level, threshold)
    assert torch.equal(w[mask], torch.ones_like(w[mask])) and torch.equal(w[~mask], torch.zeros_like(w[~mask]))
    assert float(m["rollout_corr/is_ess"]) == 1.0
    for mode in RS_MODES:
        keep, _ = rollout_rejection_mask(lr, mask, mode, (0.999, 1.001) if mode.endswith("k1") else 1e-9)
        assert torch.equal(keep, mask), mode


def test_log_ratio_ignores_garbage_off_the_mask():
    trainer = torch.tensor([[-1.0, float("nan")]])
    engine = torch.tensor([[-1.5, float("-inf")]])
    lr = rollout_log_ratio(trainer, engine, torch.tensor([[True, False]]))
    assert lr.tolist() == [[0.5, 0.0]]


# ------------------------------------------------------------------ the weight on the losses' gradients
def _inputs(seed=0, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = True
    logp = (-torch.rand(B, T, generator=g, dtype=D) * 3).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, generator=g, dtype=D)
    w = 0.5 + torch.rand(B, T, generator=g, dtype=D)
    return logp, old, adv, mask, w


def _loss_grad(name, logp, old, adv, mask, **kw):
    if name == "rspo":
        kw["router_shift_weight"] = torch.full_like(old, 0.9)
    logp.grad = None
    loss, m = get_policy_loss(name)(logp, old, adv, mask, **kw)
    loss.backward()
    return loss.detach(), logp.grad.clone(), m


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_weight_scales_every_losss_gradient_by_exactly_itself(name, level):
    logp, old, adv, mask, w = _inputs()
    if level == "sequence":
        w = w[:, :1].expand_as(w)
    base_loss, g0, m0 = _loss_grad(name, logp, old, adv, mask)
    loss, g1, m1 = _loss_grad(name, logp, old, adv, mask, rollout_is_weight=w)
    assert g0[mask].abs().min() > 0 or name.startswith("gspo")  # the test has gradients to scale
    torch.testing.assert_close(g1, torch.where(mask, w * g0, 0.0), rtol=1e-14, atol=1e-16)
    assert torch.equal(loss, base_loss)  # the value, clipping and metrics are the loss's own
    assert all(torch.equal(m0[k], m1[k]) for k in m0)


@pytest.mark.parametrize("name", ["grpo", "gspo", "sapo", "cispo"])
def test_weight_with_kl_leaves_the_kl_gradient_alone(name):
    logp, old, adv, mask, w = _inputs(1)
    ref = old - 0.1
    _, g_pg, _ = _loss_grad(name, logp, old, adv, mask, rollout_is_weight=w)
    _, g_all, _ = _loss_grad(name, logp, old, adv, mask, rollout_is_weight=w, ref_logp=ref, beta=0.3)
    _, g_kl_only, _ = _loss_grad(name, logp, old, adv, mask, ref_logp=ref, beta=0.3)
    _, g_pg_only, _ = _loss_grad(name, logp, old, adv, mask)
    torch.testing.assert_close(g_all - g_pg, g_kl_only - g_pg_only, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["grpo", "gspo", "sapo", "cispo", "gmpo"])
def test_weight_in_packed_layout_equals_padded(name):
    logp, old, adv, mask, w = _inputs(2)
    mask[:, 0] = True
    mask = mask.cumsum(-1) == torch.arange(1, mask.shape[1] + 1)  # left-aligned rows for packing
    lengths = mask.sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    pack = lambda x: x[mask]  # noqa: E731
    _, g_pad, _ = _loss_grad(name, logp, old, adv, mask, rollout_is_weight=w)
    flat = logp.detach()[mask].clone().requires_grad_()
    loss, _ = get_policy_loss(name)(flat, pack(old), adv, torch.ones_like(flat, dtype=torch.bool),
                                    rollout_is_weight=pack(w), cu_seqlens=cu)
    loss.backward()
    torch.testing.assert_close(flat.grad, g_pad[mask], rtol=1e-13, atol=1e-16)


def test_bad_weight_is_a_clear_error():
    logp, old, adv, mask, w = _inputs()
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="rollout_is_weight"):
        get_policy_loss("grpo")(logp, old, adv, mask, rollout_is_weight=w)
    with pytest.raises(ValueError, match="rollout_is_weight shape"):
        get_policy_loss("grpo")(logp, old, adv, mask, rollout_is_weight=w[:, :3])


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("overrides,field", [
    (["algorithm.rollout_is_threshold=[2.0,0.5]"], "algorithm.rollout_is_threshold"),
    (["algorithm.rollout_is_threshold=0"], "algorithm.rollout_is_threshold"),
    (["algorithm.rollout_is_threshold=-1.5"], "algorithm.rollout_is_threshold"),
    (["algorithm.rollout_is=tokens"], "algorithm.rollout_is"),
    (["algorithm.rollout_rs=seq_max_k1", "algorithm.rollout_rs_threshold=2"], "algorithm.rollout_rs"),
    (["algorithm.rollout_rs=token_k3"], "algorithm.rollout_rs_threshold"),
    (["algorithm.rollout_rs=token_k3", "algorithm.rollout_rs_threshold=0"], "algorithm.rollout_rs_threshold"),
    (["algorithm.rollout_rs=seq_mean_k1", "algorithm.rollout_rs_threshold=[1.2,0.8]"],
     "algorithm.rollout_rs_threshold"),
    (["algorithm.rollout_rs=seq_sum_k2", "algorithm.rollout_rs_threshold=[0.5,2]"], "algorithm.rollout_rs_threshold"),
    (["algorithm.rollout_rs_threshold=[2,1]"], "algorithm.rollout_rs_threshold"),  # unused while rollout_rs is off
    (["algorithm.rollout_is=token", "algorithm.use_engine_logprobs=true"], "algorithm.rollout_is"),
    (["algorithm.loss=grpo", "algorithm.use_engine_logprobs=true"], "algorithm.use_engine_logprobs"),
    (["algorithm.loss=cispo", "algorithm.use_engine_logprobs=true"], "algorithm.use_engine_logprobs"),
    (["algorithm.loss=sapo", "algorithm.loss_options.tau_neg=0"], "algorithm.loss_options.tau_neg"),
    (["algorithm.loss=sapo", "algorithm.loss_options.tau=1"], "algorithm.loss_options.tau"),
    (["algorithm.loss=gspo", "algorithm.loss_options.tau_pos=1"], "algorithm.loss_options.tau_pos"),
    (["algorithm.loss=grpo", "algorithm.loss_options.clip_ratio_c=0.5"], "algorithm.loss_options.clip_ratio_c"),
    (["algorithm.clip_low=-0.1"], "algorithm.clip_low"),
    (["algorithm.loss=cispo", "algorithm.clip_low=1.5"], "algorithm.clip_low"),
    (["algorithm.loss=gmpo", "algorithm.clip_high=-1"], "algorithm.clip_high"),
    (["algorithm.loss=gmpo", "algorithm.loss_agg_mode=seq-mean-token-sum"], "algorithm.loss_agg_mode"),
    (["algorithm.loss=ppo"], "algorithm.loss"),
    (["algorithm.kl_beta=-1"], "algorithm.kl_beta"),
    (["algorithm.kl_estimator=k9"], "algorithm.kl_estimator"),
])
def test_bad_correction_config_fails_at_load_with_one_line_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert field + "=" in msg or field + " " in msg, msg
    assert "\n" not in msg


def test_config_modes_are_the_loss_modes_and_thresholds_reach_the_functions():
    a = load_config(None, ["algorithm.rollout_is=sequence", "algorithm.rollout_is_threshold=[0.5,2]",
                           "algorithm.rollout_rs=seq_mean_k1", "algorithm.rollout_rs_threshold=1.01"]).algorithm
    assert a.rollout_is_threshold == [0.5, 2.0] and a.rollout_rs_threshold == 1.01
    rollout_is_weights(LR, MASK, a.rollout_is, a.rollout_is_threshold)
    rollout_rejection_mask(LR, MASK, a.rollout_rs, a.rollout_rs_threshold)
    assert load_config(None, ["algorithm.loss=cispo"]).algorithm.loss_agg_mode == "token-mean"
    assert load_config(None, ["algorithm.loss=sapo"]).algorithm.loss_agg_mode == "seq-mean-token-mean"


def test_functions_reject_bad_thresholds_and_modes():
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rollout_is_weights(LR, MASK, "token", (2.0, 1.0))
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rollout_is_weights(LR, MASK, "token", 0.0)
    with pytest.raises(ValueError, match="unknown rollout_is level"):
        rollout_is_weights(LR, MASK, "seq", 2.0)
    with pytest.raises(ValueError, match="unknown rollout_rs mode"):
        rollout_rejection_mask(LR, MASK, "seq_max_k1", 2.0)


# ------------------------------------------------------------------ TP=2 (torchrun, gloo)
WORKER = Path(__file__).parent / "dist" / "rollout_corr_worker.py"


@pytest.mark.slow
def test_rollout_correction_under_tp2_equals_one_process(tmp_path):
    from helpers import make_hf_checkpoint, run_torchrun

    ckpt = make_hf_checkpoint(tmp_path / "ckpt", vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8,
                              experts=4, topk=2, inter=16, seed=3)
    run_torchrun(WORKER, "--ckpt", ckpt, "--out", tmp_path / "single.pt", nproc=1)
    run_torchrun(WORKER, "--ckpt", ckpt, "--tp", 2, "--out", tmp_path / "tp2.pt", nproc=2)
    ref, out = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "tp2.pt")
    for name in ("eager", "fused"):  # the example exercises truncation and rejection
        assert 0 < ref[name]["rollout_corr/rs_masked_frac"] < 1
        assert ref[name]["rollout_corr/is_truncated_frac"] > 0 and ref[name]["grad_norm"] > 0
    assert ref["eager"] == pytest.approx(ref["fused"], rel=1e-5, abs=1e-7)
    assert ref["bypass"]["grad_norm"] > 0
    for name in ("eager", "fused", "bypass"):
        assert out[name].keys() == ref[name].keys()
        assert out[name] == pytest.approx(ref[name], rel=1e-5, abs=1e-6), name


# ------------------------------------------------------------------ the trainer's loss call
@pytest.mark.parametrize("bypass", [False, True])
@pytest.mark.parametrize("loss", ["grpo", "gspo", "cispo"])
def test_trainer_loss_call_applies_rejection_then_weights(bypass, loss):
    """train/step.py's loss call equals the functions composed by hand: rho from the trainer's old log-probs
    (decoupled) or from the detached current ones (bypass, where pi_old is the engine)."""
    from types import SimpleNamespace

    from moe_gspo.train.step import LossRows, rows_loss

    logp, old, adv, mask, _ = _inputs(3)
    g = torch.Generator().manual_seed(9)
    engine = old + 0.08 * torch.randn(old.shape, generator=g, dtype=D)
    ovs = [f"algorithm.loss={loss}", "algorithm.rollout_rs=token_k2", "algorithm.rollout_rs_threshold=0.003"]
    ovs += ["algorithm.use_engine_logprobs=true", "algorithm.bypass_token_ratios=true"] if bypass else \
        ["algorithm.rollout_is=token", "algorithm.rollout_is_threshold=1.05"]
    cfg = load_config(None, ovs)
    ctx = SimpleNamespace(cfg=cfg, loss=cfg.algorithm.policy_loss(), correction=cfg.algorithm.rollout_correction())
    pi_old = engine if bypass else old
    if bypass:  # the loss call compares the current log-probs with the engine's
        got, m = rows_loss(ctx, LossRows(pi_old, adv, mask, engine_logp=engine), logp, 7.0)
    else:  # computed once per minibatch from pi_old, before any loss call
        c = ctx.correction(old, engine, mask)
        m = c.metrics
        got, _ = rows_loss(ctx, LossRows(pi_old, adv, c.mask, rollout_is_weight=c.weight), logp, 7.0)
    (g_got,) = torch.autograd.grad(got, logp)

    lr = rollout_log_ratio(logp if bypass else old, engine, mask)
    keep, _ = rollout_rejection_mask(lr, mask, "token_k2", 0.003)
    kw = {} if bypass else {"rollout_is_weight": rollout_is_weights(lr, keep, "token", 1.05)[0]}
    want, _ = get_policy_loss(loss)(logp, pi_old, adv, keep, loss_agg_mode=cfg.algorithm.loss_agg_mode,
                                    loss_denominator=7.0, **kw)
    (g_want,) = torch.autograd.grad(want, logp)
    assert 0 < float(m["rollout_corr/rs_masked_frac"]) < 1
    assert torch.equal(got, want) and torch.equal(g_got, g_want)


def test_bypass_with_a_per_token_ratio_is_refused_at_load_unless_accepted():
    """algorithm.use_engine_logprobs with a per-token-ratio loss fails at load, one line naming the field and the
    opt-in; a sequence-ratio loss, or the opt-in, loads, and the correction object says bypass."""
    with pytest.raises(ConfigError, match=r": algorithm.use_engine_logprobs=True with algorithm.loss=.grpo.: .*"
                                          r"algorithm.bypass_token_ratios=true$"):
        load_config(None, ["algorithm.loss=grpo", "algorithm.use_engine_logprobs=true"])
    for ovs in (["algorithm.loss=grpo", "algorithm.bypass_token_ratios=true"], ["algorithm.loss=gspo"],
                ["algorithm.loss=gspo_token"]):
        corr = load_config(None, ovs + ["algorithm.use_engine_logprobs=true"]).algorithm.rollout_correction()
        assert corr.bypass and not corr.active and not corr.per_loss_call
        old, engine = torch.zeros(1, 3), torch.ones(1, 3)
        assert corr.pi_old(old, engine) is engine


def test_the_correction_object_carries_the_config_and_applies_rejection_then_weights():
    from moe_gspo.losses import RolloutCorrection

    a = load_config(None, ["algorithm.rollout_is=sequence", "algorithm.rollout_is_threshold=[0.5,2]",
                           "algorithm.rollout_rs=token_k2", "algorithm.rollout_rs_threshold=0.003"]).algorithm
    corr = a.rollout_correction()
    assert corr == RolloutCorrection("sequence", (0.5, 2.0), "token_k2", 0.003, bypass=False)
    assert corr.active and corr.per_minibatch and not corr.per_loss_call
    assert load_config(None, []).algorithm.rollout_correction() == RolloutCorrection()
    _, old, _, mask, _ = _inputs(3)
    engine = old + 0.08 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=D)
    out = corr(old, engine, mask)
    lr = rollout_log_ratio(old, engine, mask)
    keep, m_rs = rollout_rejection_mask(lr, mask, "token_k2", 0.003)
    w, m_is = rollout_is_weights(lr, keep, "sequence", (0.5, 2.0))
    assert 0 < float(m_rs["rollout_corr/rs_masked_frac"]) < 1
    assert torch.equal(out.mask, keep) and torch.equal(out.weight, w) and out.metrics.keys() == {**m_rs, **m_is}.keys()
    assert corr.pi_old(old, engine) is old
