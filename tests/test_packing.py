"""Packed micro-batches (train.max_tokens_per_micro_batch) against the padded rows they replace.

- The policy's packed forward equals the padded one at every real token: hidden states, logits, routing (recorded
  and replayed), and every parameter's gradient, the routers' included; padding reads zero / route-live.
- One old-log-prob pass and one update (R2 and R3 replay, flip tracker) give the same log-probs, R2 records,
  gradients and flip counts packed and unpacked (tests/dist/packed_worker.py), in this process and under TP=2
  and EP=2, where the ranks plan different numbers of packed forwards.
- The planner: whole rows, budgets met exactly, ranks balanced, an over-long sequence is one line naming the field.
- The packed rotary on latent attention with YaRN (DeepSeek-V3) and on part of each head (GLM-4.5) equals
  megatron's own and the padded rows.
"""
from __future__ import annotations

import sys

import pytest
import torch

from helpers import ROOT, TINY, run_torchrun

sys.path.insert(0, str(ROOT / "tests" / "dist"))
from packed_worker import BUDGET, ROWS, compare_packed  # noqa: E402

PACK_TINY = TINY + ["algorithm.loss=gspo", "train.micro_batch_size=4"]


@pytest.fixture(scope="module")
def cfg():
    from moe_gspo.config import load_config

    return load_config(ROOT / "configs/train_tiny_cpu.yaml", PACK_TINY)


@pytest.fixture(scope="module")
def policy(cfg):
    from moe_gspo import init_parallel, load_policy

    torch.manual_seed(0)
    return load_policy(cfg, init_parallel(cfg))


def _batch(vocab, lengths, T):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, vocab, (len(lengths), T), generator=g)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    return torch.where(mask, ids, 0), mask


def _grads(policy, out, mask):
    policy.zero_grad(set_to_none=True)
    w = torch.linspace(-1, 1, out.shape[-1])  # a loss that weighs every feature differently
    (out[mask] * w).sum().backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def test_packed_forward_equals_padded_rows(policy):
    from moe_gspo.model.routing_capture import ReplaySource, RoutingCapture

    lengths, T = [12, 5, 1, 9], 12  # a full row, a one-token row
    ids, mask = _batch(policy.model_config.vocab_size, lengths, T)
    flat = mask.reshape(-1)
    for hidden in (True, False):
        cr, cp = RoutingCapture(scores=True), RoutingCapture(scores=True)
        rows = policy(ids, routing=cr, return_hidden=hidden)
        packed = policy(ids, routing=cp, return_hidden=hidden, lengths=lengths)
        torch.testing.assert_close(packed[mask], rows[mask], atol=2e-6, rtol=1e-5)
        assert packed[~mask].abs().max() == 0
        assert torch.equal(cp.stacked()[flat], cr.stacked()[flat]) and (cp.stacked()[~flat] == -1).all()
        torch.testing.assert_close(cp.scores_stacked()[flat], cr.scores_stacked()[flat], atol=1e-6, rtol=1e-6)
        gr, gp = _grads(policy, rows, mask), _grads(policy, packed, mask)
        assert gr.keys() == gp.keys() and any("router" in n for n in gr)
        for n in gr:
            torch.testing.assert_close(gp[n], gr[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"d {n}\n{m}")
    # replaying another routing: packed follows the table at the same batch-major positions
    g = torch.Generator().manual_seed(1)
    mc = policy.model_config
    table = torch.sort(torch.rand(len(lengths) * T, mc.num_hidden_layers, mc.num_experts, generator=g)
                       .topk(mc.num_experts_per_tok, -1).indices, -1).values
    cr, cp = RoutingCapture(replay=ReplaySource(table)), RoutingCapture(replay=ReplaySource(table))
    with torch.no_grad():
        rows, packed = policy(ids, routing=cr), policy(ids, routing=cp, lengths=lengths)
    torch.testing.assert_close(packed[mask], rows[mask], atol=2e-6, rtol=1e-5)
    assert torch.equal(cp.stacked()[flat], table[flat])


def test_packed_rows_never_see_each_other(policy):
    """A row's outputs do not change when its neighbours in the pack do (attention and positions per row), up to
    the rounding of expert GEMMs over other token counts."""
    lengths, T = [7, 10, 4], 10
    ids, mask = _batch(policy.model_config.vocab_size, lengths, T)
    with torch.no_grad():
        a = policy(ids, lengths=lengths)
        ids2 = ids.clone()
        ids2[0, :7] = (ids2[0, :7] + 1) % policy.model_config.vocab_size
        b = policy(ids2, lengths=lengths)
        alone = policy(ids[1:2], lengths=[10])
    assert (b[0] - a[0]).abs().max() > 1e-2  # the changed row moved
    torch.testing.assert_close(b[1:][mask[1:]], a[1:][mask[1:]], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(alone[0], a[1], atol=2e-6, rtol=1e-5)


def test_packed_step_equals_rows(policy, cfg):
    compare_packed(policy, cfg, ROWS[0])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.ep=2"], ["parallel.tp=2", "model.num_key_value_heads=2"]])
def test_packed_step_equals_rows_under_tp2_and_ep2(tmp_path, layout):
    run_torchrun(ROOT / "tests/dist/packed_worker.py", "--out", tmp_path, *PACK_TINY, *layout)
    assert (tmp_path / "ok_0").exists() and (tmp_path / "ok_1").exists()


def test_planner_packs_whole_rows_up_to_the_budget():
    from moe_gspo.train.micro import PackedMicroBatches, RowMicroBatches

    plan = PackedMicroBatches(24).plan([12, 12, 7, 10, 8, 24, 1])
    assert [(m.rows.start, m.rows.stop) for m in plan] == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7)]
    assert [m.tokens for m in plan] == [24, 17, 8, 24, 1]  # two forwards exactly at the budget
    assert plan[1].lengths == [7, 10]
    assert [m.rows for m in RowMicroBatches(3).plan([5] * 7)] == [slice(0, 3), slice(3, 6), slice(6, 7)]


def test_planner_balances_ranks(monkeypatch):
    """A rank that plans fewer forwards than another splits its fullest ones where the halves are closest."""
    import moe_gspo.train.micro as micro

    monkeypatch.setattr(micro, "max_over_ranks", lambda n, group: 4)  # another rank plans 4 forwards
    plan = micro.PackedMicroBatches(BUDGET).plan([5, 6, 7, 2])  # 20 tokens: one forward alone
    assert [(m.rows.start, m.rows.stop) for m in plan] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    plan = micro.PackedMicroBatches(BUDGET).plan([9, 1, 1, 1, 6, 2, 2])  # 22 tokens: 11 | 11, then each half
    assert [m.lengths for m in plan] == [[9], [1, 1], [1, 6], [2, 2]]
    with pytest.raises(RuntimeError, match="holds 3 rows, fewer than the 4 forwards"):
        micro.PackedMicroBatches(BUDGET).plan([5, 6, 7])


def test_a_sequence_over_the_budget_is_one_line_naming_the_field():
    from moe_gspo.config import ConfigError
    from moe_gspo.train.micro import PackedMicroBatches

    with pytest.raises(ConfigError, match=r"^train.max_tokens_per_micro_batch=16 is below a sequence of 17 tokens"):
        PackedMicroBatches(16).plan([3, 17, 2])


def test_packing_refuses_what_cannot_pack():
    from moe_gspo.config import ConfigError, load_config

    for extra, what in ((["model.attention=megatron"], "model.attention=sdpa"), (["model.compile=true"], "compile")):
        with pytest.raises(ConfigError, match=what):
            load_config(ROOT / "configs/train_tiny_cpu.yaml", ["train.max_tokens_per_micro_batch=64", *extra])


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_packed_rotary_equals_megatrons_for_latent_and_partial_rotary(family, monkeypatch):
    """The packed rotary (model/rope.py: the table gathered at each token's position) on DeepSeek-V3's latent
    attention with YaRN and GLM-4.5's rotary on part of each head: equal to megatron's own THD rotary bit for bit,
    and to the padded rows at every real token."""
    from megatron.core.models.common.embeddings import rope_utils

    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config
    from moe_gspo.model import rope

    c = load_config(ROOT / f"configs/families/{family}.yaml")
    policy = load_policy(c, init_parallel(c)).eval()
    lengths = [20, 7, 13]
    ids, _ = _batch(c.model.vocab_size, lengths, 20)
    outs = {}
    with torch.no_grad():
        rows = policy(ids)
        for name, thd in (("ours", rope._thd_at_positions), ("megatron", rope._MEGATRON_THD)):
            monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", thd)
            outs[name] = policy(ids, lengths=lengths)
    assert torch.equal(outs["ours"], outs["megatron"])
    for b, n in enumerate(lengths):
        torch.testing.assert_close(outs["ours"][b, :n], rows[b, :n], rtol=1e-5, atol=1e-5)
