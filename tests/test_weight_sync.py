"""Bucketed weight sync from the megatron policy into the HF rollout engine: bit-equal to the policy's export at every
bucket size (one tensor per bucket, several, one bucket for the whole model), in fp32 and bf16, in place on later
syncs; and under TP=2 x EP=2 with gloo, where the state is gathered while it streams (every rank reports to its
own file)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, make_hf_checkpoint, run_torchrun

from moe_gspo.rollout.hf_engine import HFEngine, model_from_export
from moe_gspo.rollout.sync.buckets import buckets, copy_in_buckets


@pytest.fixture(scope="module")
def policy():
    import moe_gspo
    from moe_gspo.config import ModelConfig

    source = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16)
    p = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    with torch.no_grad():
        for w in p.parameters():
            w.normal_(0.0, 0.1)
    return p


def _assert_bit_equal(model, reference):
    got, want = model.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucketed_sync_is_bit_equal_to_the_export(policy, dtype):
    total = sum(t.numel() * t.element_size() for t in policy.parameters())
    for bucket in (1, 4096, 10 * total):  # one tensor per bucket, several tensors per bucket, one bucket in all
        eng = HFEngine(policy, dtype=dtype, sync_bucket_bytes=bucket)
        _assert_bit_equal(eng.model, model_from_export(*policy.export_hf(), dtype))  # tensor by tensor
        with torch.no_grad():  # a later sync writes into the same module, in place
            for w in policy.parameters():
                w.add_(0.01)
        ptrs = {k: v.data_ptr() for k, v in eng.model.named_parameters()}
        eng.update_weights(policy)
        assert {k: v.data_ptr() for k, v in eng.model.named_parameters()} == ptrs
        _assert_bit_equal(eng.model, model_from_export(*policy.export_hf(), dtype))


def test_bucket_count_and_shape_check():
    dests = [(torch.zeros(3, 4), "a"), (torch.zeros(5), "b"), (torch.zeros(2, 2), "c")]
    state = {"a": torch.arange(12.0).view(3, 4), "b": torch.arange(5.0), "c": torch.ones(2, 2)}
    assert copy_in_buckets(dests, state, bucket_bytes=1) == 3  # a tensor larger than the bucket is a bucket alone
    assert copy_in_buckets(dests, state, bucket_bytes=17 * 4) == 2  # a + b fill 68 bytes; c starts the next
    assert copy_in_buckets(dests, state, bucket_bytes=1 << 20) == 1
    assert all(torch.equal(d, state[k]) for d, k in dests)
    with pytest.raises(ValueError, match="b: exported shape"):
        copy_in_buckets(dests, {**state, "b": torch.zeros(6)}, bucket_bytes=64)
    with pytest.raises(ValueError, match="bucket_bytes"):
        copy_in_buckets(dests, state, bucket_bytes=0)


def test_config_rejects_a_negative_bucket():
    from moe_gspo.config import ConfigError, RolloutConfig

    with pytest.raises(ConfigError, match="rollout.sync_bucket_bytes=-1"):
        RolloutConfig(sync_bucket_bytes=-1)


@pytest.mark.slow
def test_bucketed_sync_under_tp2_ep2_equals_the_export(tmp_path):
    ckpt = make_hf_checkpoint(tmp_path / "ckpt", vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8,
                              experts=4, topk=2, inter=16, seed=3)
    report = tmp_path / "report"
    report.mkdir()
    run_torchrun(ROOT / "tests" / "dist" / "weight_sync_worker.py", ckpt, report, 2048, nproc=4)
    got = {f.name: json.loads(f.read_text()) for f in sorted(report.glob("rank_*.json"))}
    assert sorted(got) == [f"rank_{r}.json" for r in range(4)], got
    for name, r in got.items():
        assert r["unequal"] == [] and r["tensors"] > 0, (name, r)
        assert 1 < r["buckets"] < r["tensors"], (name, r)  # several tensors per bucket, more than one bucket


def test_the_policy_weight_source_is_its_export_and_views_of_its_parameters(policy):
    """policy.weights(): the config and whole tensors of the policy's export, in its order and bit for bit; its
    shards (tp = ep = 1: every tensor whole on this rank) are views of the parameters, so they see an optimizer's
    in-place update without a new export."""
    from moe_gspo.model.hf_io import hf_config_dict
    from moe_gspo.model.hf_shards import WHOLE
    from moe_gspo.model.weights import PolicyWeights, weights_of

    config, export = policy.export_hf()
    export = {k: v.clone() for k, v in export.items()}
    w = policy.weights()
    assert isinstance(w, PolicyWeights) and weights_of(w) is w and isinstance(weights_of(policy), PolicyWeights)
    assert w.config == config == hf_config_dict(policy.model_config)
    whole = w.whole()
    assert list(whole) == list(export) and all(torch.equal(whole[k], v) for k, v in export.items())
    here = w.shards
    assert (here.tp_rank, here.ep_rank) == (0, 0)
    assert all(here.layout.region(k, 0, 0) == WHOLE for k in export)
    local = here.local()
    assert set(local) == set(export) and all(torch.equal(local[k], v) for k, v in export.items())
    key = next(k for k in export if k.endswith("lm_head.weight"))
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(-1.0)
    try:
        assert torch.equal(local[key], -export[key])  # a view: the update is visible without re-reading
    finally:
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(-1.0)


def test_weights_of_converts_models_and_names_what_it_refuses():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moe_gspo.model.weights import ModuleWeights, weights_of

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=8, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=8))
    w = weights_of(model)
    assert isinstance(w, ModuleWeights) and w.module is model and w.shards is None
    state = w.whole()  # checkpoint names: one tensor per expert
    assert any(k.endswith("experts.3.down_proj.weight") for k in state)
    assert torch.equal(state["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    with pytest.raises(TypeError, match="got dict"):
        weights_of({})


def test_cast_into_equals_copy_bitwise():
    """The cast-then-transpose path for transposed sources gives exactly what one copy_ gives, in every dtype
    pair and layout it can meet (transposed, narrowed either way, contiguous, same dtype)."""
    from moe_gspo.rollout.sync.buckets import cast_into

    g = torch.Generator().manual_seed(0)
    storage = torch.randn(96, 64, generator=g)  # [H, 2I] as megatron holds an expert's fc1
    sources = [storage.t(), storage[:, :32].t(), storage[:, :32].t().narrow(0, 8, 16), storage.t().narrow(1, 4, 40),
               storage, storage.t().contiguous()]
    for src in sources:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            want = torch.empty(src.shape, dtype=dtype).copy_(src)
            got = cast_into(torch.empty(src.shape, dtype=dtype), src)
            assert torch.equal(got, want), (src.shape, src.stride(), dtype)
            padded = torch.zeros(src.shape[0], src.shape[1] + 8, dtype=dtype)  # a row-strided destination
            cast_into(padded[:, :src.shape[1]], src)
            assert torch.equal(padded[:, :src.shape[1]], want) and not padded[:, src.shape[1]:].any()


def _reference_buckets(sizes, bound):
    """Greedy bucketing written out plainly: a bucket closes before an item would take it past the bound, and an
    item larger than the bound stands alone."""
    out, cur, used = [], [], 0
    for i, n in enumerate(sizes):
        if cur and used + n > bound:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
        if n > bound:
            out.append(cur)
            cur, used = [], 0
    return out + ([cur] if cur else [])


def test_one_bucketing_rule_for_every_sync():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        sizes = torch.randint(0, 40, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        bound = int(torch.randint(1, 60, (1,), generator=g))
        got = list(buckets(range(len(sizes)), lambda i: {None: sizes[i]}, bound))
        assert got == _reference_buckets(sizes, bound)
        assert [i for b in got for i in b] == list(range(len(sizes)))  # every item once, in order
        assert all(sum(sizes[i] for i in b) <= bound or len(b) == 1 for b in got)
    # a refusing `joins` splits where the bound would not
    assert list(buckets("aabba", lambda c: {None: 1}, 10, lambda first, c: first == c)) == [["a", "a"], ["b", "b"],
                                                                                           ["a"]]
    # several resources: a round closes when any one of them would pass the bound (rank 0's sends here)
    sends = [(0, 1, 4), (0, 2, 4), (1, 2, 4), (0, 1, 4)]
    got = list(buckets(sends, lambda t: {("out", t[0]): t[2], ("in", t[1]): t[2]}, 8))
    assert got == [[(0, 1, 4), (0, 2, 4), (1, 2, 4)], [(0, 1, 4)]]
    with pytest.raises(ValueError, match="bound 0 must be > 0"):
        list(buckets([1], lambda i: {None: 1}, 0))


def test_buckets_read_their_items_as_they_fill():
    read = []

    def items():
        for i in range(6):
            read.append(i)
            yield i

    it = buckets(items(), lambda i: {None: 1}, 2)
    assert next(it) == [0, 1] and read == [0, 1, 2]  # the item that closed the bucket, and no further
    assert next(it) == [2, 3] and read == [0, 1, 2, 3, 4]
