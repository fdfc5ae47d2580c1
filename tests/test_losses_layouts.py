"""Micro-batch accumulation == one full-batch step, and packed (cu_seqlens) == padded; hypothesis properties."""

import torch
from hypothesis import given, settings, strategies as st

from moe_gspo.losses import AGG_MODES, get_advantage_estimator, get_policy_loss, loss_denominator, unpad_to_packed

F64 = torch.float64
NOISE = {"grpo": 0.3, "gspo": 1e-3, "gspo_token": 1e-3}


@st.composite
def batches(draw):
    """Random groups of responses: prompt + response layout, response lengths >= 0, group advantages."""
    num_groups, group_size = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    B = num_groups * group_size
    prompt = draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
    resp = draw(st.lists(st.integers(0, 7), min_size=B, max_size=B))
    name = draw(st.sampled_from(["grpo", "gspo", "gspo_token"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    T = max(p + r for p, r in zip(prompt, resp)) + draw(st.integers(0, 2))
    T = max(T, 1)
    pos = torch.arange(T)[None]
    p_B1, r_B1 = torch.tensor(prompt)[:, None], torch.tensor(resp)[:, None]
    mask = (pos >= p_B1) & (pos < p_B1 + r_B1)  # (B, T) response tokens only
    valid = pos < p_B1 + r_B1  # prompt + response: what a packed row holds
    logp = -3 * torch.rand(B, T, generator=g, dtype=F64)
    old = logp + NOISE[name] * torch.randn(B, T, generator=g, dtype=F64)
    ref = logp + 0.1 * torch.randn(B, T, generator=g, dtype=F64)
    rewards = torch.randint(0, 2, (num_groups, group_size), generator=g).to(F64)
    adv = get_advantage_estimator("grpo")(rewards).flatten()  # (B,)
    if name == "gspo_token" and draw(st.booleans()):
        adv = adv[:, None] + 0.1 * torch.randn(B, T, generator=g, dtype=F64)  # per-token advantages
    mode = draw(st.sampled_from(AGG_MODES))
    return dict(name=name, logp=logp, old=old, ref=ref, adv=adv, mask=mask, valid=valid, mode=mode)


@settings(max_examples=40, deadline=None)
@given(b=batches(), num_micro=st.integers(1, 4), beta=st.sampled_from([0.0, 0.05]))
def test_micro_batch_accumulation_equals_full_batch(b, num_micro, beta):
    fn = get_policy_loss(b["name"])
    kw = dict(loss_agg_mode=b["mode"], ref_logp=b["ref"], beta=beta)
    logp = b["logp"].clone().requires_grad_()
    full, _ = fn(logp, b["old"], b["adv"], b["mask"], **kw)
    (full_grad,) = torch.autograd.grad(full, logp)

    denom = loss_denominator(b["mask"], b["mode"])  # counted once over the whole minibatch
    logp_acc = b["logp"].clone().requires_grad_()
    total = 0.0
    for rows in torch.arange(logp.shape[0]).chunk(num_micro):
        part = {k: b[k][rows] for k in ("old", "ref", "adv", "mask")}
        loss, _ = fn(
            logp_acc[rows], part["old"], part["adv"], part["mask"],
            loss_agg_mode=b["mode"], ref_logp=part["ref"], beta=beta, loss_denominator=denom,
        )  # fmt: skip
        loss.backward()  # gradients accumulate in logp_acc.grad
        total = total + loss.detach()
    torch.testing.assert_close(total, full.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(logp_acc.grad, full_grad, rtol=0, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(b=batches(), as_row=st.booleans(), beta=st.sampled_from([0.0, 0.05]))
def test_packed_equals_padded(b, as_row, beta):
    fn = get_policy_loss(b["name"])
    valid = b["valid"]
    lengths = valid.sum(-1)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)

    def pack(x):  # (B, T) -> (total,) or (1, total)
        x = unpad_to_packed(x, cu)
        return x[None] if as_row else x

    # padding positions of the padded layout hold garbage, which must not matter
    logp_pad = b["logp"].clone().masked_fill(~valid, float("nan")).requires_grad_()
    loss_pad, m_pad = fn(logp_pad, b["old"], b["adv"], b["mask"], loss_agg_mode=b["mode"], ref_logp=b["ref"], beta=beta)
    (g_pad,) = torch.autograd.grad(loss_pad, logp_pad)

    logp_pk = pack(b["logp"]).clone().requires_grad_()
    # per-token advantages go as [1, total]: a 1-D tensor of length B always means one per sequence
    adv_pk = unpad_to_packed(b["adv"], cu)[None] if b["adv"].dim() == 2 else b["adv"]
    loss_pk, m_pk = fn(
        logp_pk, pack(b["old"]), adv_pk, pack(b["mask"]),
        loss_agg_mode=b["mode"], ref_logp=pack(b["ref"]), beta=beta, cu_seqlens=cu,
    )  # fmt: skip
    (g_pk,) = torch.autograd.grad(loss_pk, logp_pk)
    torch.testing.assert_close(loss_pk, loss_pad, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_pk.reshape(-1), unpad_to_packed(g_pad, cu), rtol=0, atol=1e-12)
    assert m_pk.keys() == m_pad.keys()
    for k in m_pad:
        torch.testing.assert_close(m_pk[k], m_pad[k], rtol=0, atol=1e-12)
    # the packed mask also gives the same global denominators
    for mode in AGG_MODES:
        assert loss_denominator(pack(b["mask"]), mode, cu_seqlens=cu) == loss_denominator(b["mask"], mode)
