"""moe_gspo.kernels against float64 references on fresh random inputs (CPU; chunked and eager paths)."""
from __future__ import annotations

import pytest
import torch

from moe_gspo.kernels import plan_chunks, sequence_reduce, token_logprobs, token_logprobs_eager
from moe_gspo.kernels.memory import peak_bytes
from moe_gspo.losses import get_policy_loss
from moe_gspo.train.logprob import fused_policy_loss
from tests.kernel_refs import close, fresh_seed, logprobs_f64, policy_loss_f64


def make(T, H, V, seed, dtype=torch.float32, scale=1.0, n_ignored=2):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=g) * scale).to(dtype)
    w = (torch.randn(V, H, generator=g) * scale).to(dtype)
    t = torch.randint(0, V, (T,), generator=g)
    t[torch.randperm(T, generator=g)[:n_ignored]] = -100
    return h, w, t, torch.randn(T, generator=g), torch.randn(T, generator=g)


def run(impl, h, w, t, gl, ge, **kw):
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_()
    lp, ent = token_logprobs(h, w, t, impl=impl, return_entropy=True, **kw)
    (lp * gl + ent * ge).sum().backward()
    return lp, ent, h.grad, w.grad


def check_all(impl, T, H, V, tol=2e-5, dtype=torch.float32, scale=1.0, temperature=1.0, chunk_bytes=128 * 2**20,
              shift=0.0):
    seed = fresh_seed()
    h, w, t, gl, ge = make(T, H, V, seed, dtype, scale)
    if shift:  # a constant feature pushes every logit to about `shift`
        h[:, 0], w[:, 0] = 1.0, shift
    got = run(impl, h, w, t, gl, ge, temperature=temperature, chunk_bytes=chunk_bytes)
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp, ent = logprobs_f64(hd, wd, t, temperature)
    (lp * gl.double() + ent * ge.double()).sum().backward()
    want = (lp, ent, hd.grad, wd.grad)
    if shift:  # d hidden[:, 0] is a sum of ~0 terms times `shift`: fp32 cancellation, not the kernel, sets its error
        got, want = got[:2] + (got[2][:, 1:],) + got[3:], want[:2] + (want[2][:, 1:],) + want[3:]
    for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), got, want):
        assert a.dtype == (torch.float32 if name in ("logp", "entropy") else dtype)
        close(a, b, tol, f"{impl} {name}", seed)
    ignored = t == -100
    assert bool((got[0][ignored] == 0).all() and (got[1][ignored] == 0).all() and (got[2][ignored] == 0).all())
    return got


@pytest.mark.parametrize("impl", ["eager", "chunked"])
def test_matches_float64(impl):
    check_all(impl, T=37, H=16, V=301, temperature=0.7)


@pytest.mark.parametrize("chunk_bytes", [9000, 1200])
def test_chunked_T_not_multiple_of_chunk_and_vocab_split(chunk_bytes):
    T, V = 45, 157
    tc, vc = plan_chunks(T, V, chunk_bytes)
    assert (T % tc if chunk_bytes == 9000 else V % vc) and tc < T, (tc, vc)
    check_all("chunked", T=T, H=8, V=V, chunk_bytes=chunk_bytes)


def test_large_vocab_small_hidden():
    check_all("chunked", T=16, H=8, V=262_147, tol=5e-5, chunk_bytes=2**20)


def test_all_negative_logits():
    got = check_all("chunked", T=20, H=8, V=97, shift=-150.0, chunk_bytes=4096 * 2)
    assert bool(torch.isfinite(got[0]).all())


def test_bf16_within_bf16_tolerance():
    check_all("chunked", T=33, H=32, V=211, tol=3e-2, dtype=torch.bfloat16, scale=0.5, chunk_bytes=8192)


def test_fp16_runs():
    check_all("chunked", T=9, H=16, V=50, tol=1e-2, dtype=torch.float16, scale=0.5)


def test_without_entropy_and_weight_frozen():
    seed = fresh_seed()
    h, w, t, gl, _ = make(21, 8, 64, seed)
    h.requires_grad_()
    lp, ent = token_logprobs(h, w, t)
    assert ent is None
    (lp * gl).sum().backward()
    hd = h.detach().double().requires_grad_()
    (logprobs_f64(hd, w, t)[0] * gl.double()).sum().backward()
    close(h.grad, hd.grad, 2e-5, "d hidden", seed)


def _peak_beyond_grads(run, h, w) -> int:
    """Peak bytes the CPU allocator holds during run() (fwd + bwd), minus the two gradients it must return."""
    return peak_bytes(run) - h.numel() * h.element_size() - w.numel() * w.element_size()


def test_workspace_bounded_independent_of_T():
    def peak(T, chunk_bytes):
        h, w, t, gl, _ = make(T, 16, 3000, 1)
        h.requires_grad_()
        w.requires_grad_()
        return _peak_beyond_grads(
            lambda: (token_logprobs(h, w, t, chunk_bytes=chunk_bytes, impl="chunked")[0] * gl).sum().backward(), h, w)

    budget = 2**20
    small, big = peak(256, budget), peak(2048, budget)
    assert big <= budget + 64 * 2048, (small, big)  # + O(T) per-token stats
    assert 2048 * 3000 * 4 > 20 * budget  # eager would need 24 MB here


@pytest.mark.parametrize("loss", ["gspo", "grpo"])
def test_fused_loss_workspace_bounded_independent_of_T(loss):
    def peak(n_seq):
        lengths = [7, 40, 3, 25] * (n_seq // 4)  # GSPO: the 40-token sequences exceed the budget (two passes)
        h, w, t, cu, mask, old, adv = _loss_inputs(1, lengths, H=16, V=3000)
        h.requires_grad_()
        w.requires_grad_()
        return _peak_beyond_grads(lambda: fused_policy_loss(h, w, t, old, adv, cu_seqlens=cu, loss_mask=mask,
                                                            loss=loss, chunk_bytes=budget)[0].backward(), h, w)

    budget = 32 * 3016 * 4  # 32 rows of [V + H] fp32
    small, big = peak(8), peak(64)
    T = 75 * 16
    assert big <= budget + 64 * T, (small, big)  # + O(T) per-token vectors
    assert T * 3000 * 4 > 20 * budget


@pytest.mark.parametrize("loss", ["gspo", "grpo"])
def test_fused_policy_loss_bf16_within_bf16_tolerance(loss):
    seed = fresh_seed()
    h, w, t, cu, mask, _, adv = _loss_inputs(seed, [5, 12, 9, 30], H=32, V=211)
    h, w = (h * 0.5).bfloat16(), (w * 0.5).bfloat16()
    with torch.no_grad():  # old log-probs near the bf16 policy's own, so the ratios stay near 1
        old = (logprobs_f64(h, w, t)[0] + 0.2 * torch.randn(t.shape[0], dtype=torch.float64)).float()
    hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
    value, _ = fused_policy_loss(hb, wb, t, old, adv, cu_seqlens=cu, loss_mask=mask, loss=loss, clip_low=0.2,
                                 clip_high=0.2, denominator=4, chunk_bytes=12 * (211 * 2 + 32) * 4)
    value.backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp, _ = logprobs_f64(hd, wd, torch.where(mask, t, -100))
    want = policy_loss_f64(lp, old, adv, cu, mask & (t != -100), loss, 0.2, 0.2, 4.0)
    want.backward()
    close(value, want, 3e-2, f"{loss} bf16 value", seed)
    close(hb.grad, hd.grad, 3e-2, f"{loss} bf16 d hidden", seed)
    close(wb.grad, wd.grad, 3e-2, f"{loss} bf16 d weight", seed)


def test_bad_inputs_name_the_problem():
    h, w, t, _, _ = make(4, 8, 10, 0)
    with pytest.raises(ValueError, match="impl"):
        token_logprobs(h, w, t, impl="cuda")
    with pytest.raises(ValueError, match=r"targets\[1\] = 10"):
        token_logprobs(h, w, torch.tensor([0, 10, 1, 2]))
    with pytest.raises(ValueError, match="weight"):
        token_logprobs(h, w[:, :4], t)


def test_sequence_reduce_padded_and_packed_agree():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    B, S = 4, 7
    vals = torch.randn(B, S, generator=g, requires_grad=True)
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[2] = False
    lengths = [7, 7, 7, 7]
    cu = torch.tensor([0, 7, 14, 21, 28])
    for red in ("sum", "mean"):
        a = sequence_reduce(vals, mask=mask, reduction=red)
        b = sequence_reduce(vals.reshape(-1), mask=mask.reshape(-1), cu_seqlens=cu, reduction=red)
        want = [(vals[i][mask[i]].sum() / (1 if red == "sum" else max(1, int(mask[i].sum())))) for i in range(B)]
        close(a, torch.stack(want), 1e-6, f"padded {red}", seed)
        close(b, torch.stack(want), 1e-6, f"packed {red}", seed)
        assert float(a[2].detach()) == 0.0 and sum(lengths) == 28
    sequence_reduce(vals.reshape(-1), cu_seqlens=cu, reduction="mean").sum().backward()
    close(vals.grad, torch.full((B, S), 1 / 7), 1e-6, "grad", seed)
    with pytest.raises(ValueError, match="reduction"):
        sequence_reduce(vals, reduction="max")


def _loss_inputs(seed, lengths, H=16, V=173, noise=1e-3):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    h, w, t, _, _ = make(T, H, V, seed, n_ignored=1)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    mask = torch.rand(T, generator=g) > 0.2
    with torch.no_grad():
        lp, _ = logprobs_f64(h, w, t)
    old = (lp + noise * torch.randn(T, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(len(lengths), generator=g)
    return h, w, t, cu, mask, old, adv


@pytest.mark.parametrize("loss,clip,noise", [("gspo", (3e-4, 4e-4), 1e-3), ("gspo", (0.05, 0.05), 0.1),
                                             ("grpo", (0.2, 0.27), 0.3)])
@pytest.mark.parametrize("impl", ["fused", "unfused"])
def test_fused_policy_loss_matches_float64(loss, clip, noise, impl):
    seed = fresh_seed()
    # a 10-token workspace: GSPO packs whole sequences and takes the 13- and 30-token ones in two passes; GRPO
    # cuts its 10-token chunks through sequences
    lengths = [5, 1, 13, 0, 9, 30, 4]
    h, w, t, cu, mask, old, adv = _loss_inputs(seed, lengths, noise=noise)
    kw = dict(cu_seqlens=cu, loss_mask=mask, loss=loss, clip_low=clip[0], clip_high=clip[1], denominator=11,
              temperature=0.9)
    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    value, metrics = fused_policy_loss(hf, wf, t, old, adv, chunk_bytes=16 * 173 * 3, impl=impl, **kw)
    value.backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp, _ = logprobs_f64(hd, wd, torch.where(mask, t, -100), 0.9)
    want = policy_loss_f64(lp, old, adv, cu, mask & (t != -100), loss, clip[0], clip[1], 11.0)
    want.backward()
    close(value, want, 1e-5, f"{loss} value", seed)
    close(metrics["logp"], lp, 2e-5, f"{loss} logp", seed)
    close(hf.grad, hd.grad, 2e-5, f"{loss} d hidden", seed)
    close(wf.grad, wd.grad, 2e-5, f"{loss} d weight", seed)
    # the clip fraction against the registered loss's, computed in float64 on the same log-probs (the temperature's
    # log-probs, the same clip range)
    valid = mask & (t != -100)
    _, want_m = get_policy_loss(loss)(lp.detach(), old.double(), adv.double(), valid, cu_seqlens=cu,
                                      clip_low=clip[0], clip_high=clip[1])
    close(metrics["pg_clipfrac"], want_m["pg_clipfrac"], 1e-6, f"{loss} clip fraction", seed)


@pytest.mark.parametrize("loss,noise", [("gspo", 1e-3), ("grpo", 0.3), ("gspo_token", 1e-3), ("gmpo", 0.3),
                                        ("cispo", 0.3), ("sapo", 0.3)])
def test_fused_policy_loss_metrics_are_the_losses_own(loss, noise):
    """The fused path hands back the registered loss's metrics of the whole batch (its chunks only see parts)."""
    seed = fresh_seed()
    h, w, t, cu, mask, old, adv = _loss_inputs(seed, [5, 1, 13, 0, 9, 30, 4], noise=noise)
    value, metrics = fused_policy_loss(h, w, t, old, adv, cu_seqlens=cu, loss_mask=mask, loss=loss,
                                       chunk_bytes=16 * 173 * 3)
    valid = mask & (t != -100)
    lp, _ = logprobs_f64(h, w, torch.where(valid, t, -100))
    want, want_m = get_policy_loss(loss)(lp, old.double(), adv.double(), valid, cu_seqlens=cu)
    close(value, want, 1e-5, f"{loss} value vs moe_gspo.losses", seed)
    for k in ("pg_clipfrac", "ratio_mean", "ppo_kl"):
        close(metrics[k], want_m[k], 1e-5, k, seed)


def test_fused_loss_gradient_scales_with_upstream_and_no_grad_path():
    seed = fresh_seed()
    h, w, t, cu, mask, old, adv = _loss_inputs(seed, [6, 7], noise=0.2)
    hf = h.clone().requires_grad_()
    value, _ = fused_policy_loss(hf, w, t, old, adv, cu_seqlens=cu, loss="grpo")
    (3.0 * value).backward()
    hu = h.clone().requires_grad_()
    value_u, _ = fused_policy_loss(hu, w, t, old, adv, cu_seqlens=cu, loss="grpo", impl="unfused")
    (3.0 * value_u).backward()
    close(hf.grad, hu.grad, 2e-5, "3x grad", seed)
    with torch.no_grad():
        v2, _ = fused_policy_loss(h, w, t, old, adv, cu_seqlens=cu, loss="grpo")
    close(v2, value, 1e-6, "no-grad value", seed)
    with pytest.raises(ValueError, match="loss"):
        fused_policy_loss(h, w, t, old, adv, cu_seqlens=cu, loss="ppo")


def test_eager_reference_is_the_float64_formula():
    seed = fresh_seed()
    h, w, t, _, _ = make(11, 8, 40, seed)
    lp, ent = token_logprobs_eager(h, w, t, return_entropy=True, temperature=1.3)
    lp64, ent64 = logprobs_f64(h, w, t, 1.3)
    close(lp, lp64, 1e-5, "logp", seed)
    close(ent, ent64, 1e-5, "entropy", seed)
