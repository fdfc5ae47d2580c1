"""The trainer's loss-fused path (train.loss_impl=fused) against its eager twin.

- One update_minibatch on the tiny model through both paths: the loss of every micro-batch, every metric and every
  parameter gradient agree (tests/dist/fused_step_worker.py's CASES: grpo with R2 replay and k3 KL, gspo at
  temperature 0.7, gspo_token with token-mean and KL, gspo with the router-shift weight in groups of two rows,
  grpo with every row in two passes); at TP=1 in this process and at TP=2 under torchrun (gloo), each rank
  checking its own shards.
- fused_logprob_loss with a moe_gspo.losses loss equals float64 log-probs fed to the same loss.
"""
from __future__ import annotations

import sys

import pytest
import torch

from helpers import ROOT, TINY, run_torchrun

sys.path.insert(0, str(ROOT / "tests" / "dist"))
from fused_step_worker import CASES, case_cfg, compare_update  # noqa: E402

BASE = TINY + ["train.micro_batch_size=4"]


@pytest.fixture(scope="module")
def policy():
    from moe_gspo import init_parallel, load_policy

    return load_policy(case_cfg(BASE, "gspo_temperature"), init_parallel(case_cfg(BASE, "gspo_temperature")))


@pytest.mark.parametrize("case", list(CASES))
def test_fused_update_equals_eager_tp1(policy, case):
    compare_update(policy, case_cfg(BASE, case), case)


@pytest.mark.slow
def test_fused_update_equals_eager_tp2(tmp_path):
    run_torchrun(ROOT / "tests/dist/fused_step_worker.py", "--out", tmp_path, *BASE, "model.num_key_value_heads=2",
                 "parallel.tp=2")
    assert (tmp_path / "ok_0").exists() and (tmp_path / "ok_1").exists()


def test_fused_logprob_loss_with_project_loss_matches_float64():
    from moe_gspo.kernels import fused_logprob_loss
    from moe_gspo.losses import get_policy_loss
    from tests.kernel_refs import close, fresh_seed, logprobs_f64

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    B, S, H, V = 5, 9, 16, 173
    h, w = torch.randn(B * S, H, generator=g), torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (B * S,), generator=g)
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[3] = False
    with torch.no_grad():  # old log-probs near the policy's own: most sequences inside the clip range
        old = logprobs_f64(h, w, t, 0.9)[0].view(B, S).float() + 0.05 * torch.randn(B, S, generator=g)
    adv = torch.randn(B, generator=g)
    cu = torch.arange(B + 1) * S
    fn = get_policy_loss("gspo_token")
    kw = dict(clip_low=0.05, clip_high=0.05, loss_denominator=4.0)

    def rows(lp, b0, b1):
        return fn(lp.view(b1 - b0, S), old[b0:b1], adv[b0:b1], mask[b0:b1], **kw)[0]

    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    value, logp, ent = fused_logprob_loss(hf, wf, t, rows, cu_seqlens=cu, temperature=0.9, return_entropy=True,
                                          chunk_bytes=2 * S * 4 * (2 * V + H))  # two rows per group
    value.backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp64, ent64 = logprobs_f64(hd, wd, t, 0.9)
    want, _ = fn(lp64.view(B, S), old.double(), adv.double(), mask, **kw)
    want.backward()
    close(value, want, 1e-5, "value", seed)
    close(logp, lp64, 2e-5, "logp", seed)
    close(ent, ent64, 2e-5, "entropy", seed)
    close(hf.grad, hd.grad, 2e-5, "d hidden", seed)
    close(wf.grad, wd.grad, 2e-5, "d weight", seed)
    assert float(hd.grad.abs().max()) > 1e-3


@pytest.mark.parametrize("rows_per_group", [2, 0])  # 0: a workspace smaller than one sequence (the two-pass path)
def test_fused_loss_with_an_entropy_term_matches_float64(rows_per_group):
    """entropy_in_loss: a loss of the log-probs and the entropies (GSPO-token minus an entropy bonus over the
    response tokens) has the value and the hidden and weight gradients of float64 autograd, in the one-pass path
    and in the two-pass path of a sequence too long for the workspace."""
    from moe_gspo.kernels import fused_logprob_loss
    from moe_gspo.losses import get_policy_loss
    from tests.kernel_refs import close, fresh_seed, logprobs_f64

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    B, S, H, V = 4, 9, 16, 173
    h, w = torch.randn(B * S, H, generator=g), torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (B * S,), generator=g)
    mask = torch.rand(B, S, generator=g) > 0.3
    with torch.no_grad():
        old = logprobs_f64(h, w, t, 0.9)[0].view(B, S).float() + 0.05 * torch.randn(B, S, generator=g)
    adv = torch.randn(B, generator=g)
    fn, kw, c = get_policy_loss("gspo_token"), dict(clip_low=0.05, clip_high=0.05, loss_denominator=4.0), 0.3

    def rows(lp, ent, b0, b1):
        m = mask[b0:b1]
        pg = fn(lp.view(b1 - b0, S), old[b0:b1], adv[b0:b1], m, **kw)[0]
        return pg - c * torch.where(m, ent.view(b1 - b0, S), 0.0).sum() / 4.0

    chunk = rows_per_group * S * 4 * (2 * V + H) if rows_per_group else 4 * 4 * (2 * V + H)
    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    value, _, ent = fused_logprob_loss(hf, wf, t, rows, cu_seqlens=torch.arange(B + 1) * S, temperature=0.9,
                                       chunk_bytes=chunk, entropy_in_loss=True)
    value.backward()
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    lp64, ent64 = logprobs_f64(hd, wd, t, 0.9)
    want = fn(lp64.view(B, S), old.double(), adv.double(), mask, **kw)[0] - c * (ent64.view(B, S) * mask).sum() / 4.0
    want.backward()
    close(value, want, 1e-5, "value", seed)
    close(ent, ent64, 2e-5, "entropy", seed)
    close(hf.grad, hd.grad, 2e-5, "d hidden", seed)
    close(wf.grad, wd.grad, 2e-5, "d weight", seed)
