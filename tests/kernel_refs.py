"""Float64 references shared by the kernel tests: the formulas written out plainly, independent of moe_gspo/kernels/."""
from __future__ import annotations

import os

import torch


def fresh_seed() -> int:
    """This test's seed: fixed per test (a hash of its pytest node id), so a failure reproduces by rerunning the
    test; KERNEL_TEST_SEED=N shifts every test's seed by N to try other inputs (the seed is in each message)."""
    import zlib

    node = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    return (zlib.crc32(node.encode()) + int(os.environ.get("KERNEL_TEST_SEED", "0"))) % 2**31


def logprobs_f64(hidden, weight, targets, temperature=1.0, ignore_index=-100):
    """(logp, entropy) in float64 with autograd, from logits -> log_softmax -> gather."""
    z = (hidden.double() @ weight.double().t()) / temperature
    ls = torch.log_softmax(z, -1)
    ok = targets != ignore_index
    lp = ls.gather(1, torch.where(ok, targets, 0)[:, None]).squeeze(1)
    ent = -(ls.exp() * ls).sum(-1)
    return torch.where(ok, lp, 0.0), torch.where(ok, ent, 0.0)


def policy_loss_f64(logp, old, adv_B, cu_seqlens, mask, loss, clip_low, clip_high, denom):
    """docs/guide/method.md's GSPO (sequence ratio) or GRPO (token ratio, seq-mean-token-mean) objective, negated."""
    total = logp.new_zeros(())
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        sl = slice(cu[b], cu[b + 1])
        m = mask[sl].double()
        n = m.sum()
        if n == 0:
            continue
        lr = (logp[sl] - old[sl].double()) * m
        A = adv_B[b].double()
        if loss == "gspo":
            s = torch.exp(lr.sum() / n)
            total = total - torch.minimum(s * A, s.clamp(1 - clip_low, 1 + clip_high) * A)
        else:
            w = torch.exp(lr)
            tok = -torch.minimum(w * A, w.clamp(1 - clip_low, 1 + clip_high) * A)
            total = total + (tok * m).sum() / n
    return total / denom


def close(got, want, tol, what, seed):
    """max |got - want| <= tol * max(1, max |want|), with the seed in the message."""
    got, want = got.detach().double(), want.detach().double()
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol * scale, f"{what}: max err {err:.3g} > {tol:g} * {scale:.3g} (seed {seed})"
