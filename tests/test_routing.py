"""CPU tests of moe_gspo.routing on synthetic routings: flip_rate, RoutingReplayCache, ExpertFlipTracker."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gspo.model.routing_capture import RoutingCapture
from moe_gspo.routing import ExpertFlipTracker, RoutingReplayCache, flip_rate


def random_topk(n: int, L: int, k: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """(n, L, k) int64 distinct experts per token, sorted ascending like the router's output."""
    return torch.rand(n, L, E, generator=gen).topk(k, -1).indices.sort(-1).values


def capture_of(idx_NLK: torch.Tensor) -> RoutingCapture:
    cap = RoutingCapture()
    for layer in range(idx_NLK.shape[1]):
        cap.put(layer, idx_NLK[:, layer], torch.full(idx_NLK[:, layer].shape, 0.5))
    return cap


# ------------------------------------------------------------------------------------------------ flip_rate
def test_flip_rate_hand_built():
    old = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    assert flip_rate(old, old) == 0.0
    assert flip_rate(old, old.flip(-1)) == 0.0  # order inside the top-k is ignored
    assert flip_rate(old, torch.tensor([[0, 2], [2, 3], [4, 5], [6, 7]])) == pytest.approx(1 / 8)
    assert flip_rate(old, torch.tensor([[1, 0], [3, 4], [0, 1], [6, 7]])) == pytest.approx(3 / 8)
    assert flip_rate(old, old + 1 - old.min() + 8) == 1.0
    assert flip_rate(torch.tensor([[0, 1, 2]]), torch.tensor([[2, 9, 0]], dtype=torch.uint8)) == pytest.approx(1 / 3)


def test_flip_rate_errors():
    a = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="shape mismatch"):
        flip_rate(a, torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        flip_rate(a, a.float())
    with pytest.raises(ValueError, match="tokens, k"):
        flip_rate(a[:, 0], a[:, 0])
    assert flip_rate(a[:0], a[:0]) != flip_rate(a[:0], a[:0])  # nan without tokens


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(4, 9), st.integers(0, 2**31 - 1))
def test_flip_rate_matches_python_sets(n, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    old, new = random_topk(n, 1, k, E, g)[:, 0], random_topk(n, 1, k, E, g)[:, 0]
    want = sum(len(set(b) - set(a)) for a, b in zip(old.tolist(), new.tolist())) / (n * k)
    assert flip_rate(old, new) == pytest.approx(want)
    assert flip_rate(new, old) == pytest.approx(want)  # both sets hold k experts: symmetric


# ------------------------------------------------------------------------------------------------ cache
def test_storage_is_layers_times_k_bytes_per_token():
    L, k, E = 4, 2, 8
    cache = RoutingReplayCache("r2", L, k, E)
    assert cache.dtype == torch.uint8 and cache.bytes_per_token() == L * k
    idx = random_topk(3 * 10, L, k, E, torch.Generator().manual_seed(0))
    assert cache.record_capture([1, 2, 3], [10, 4, 7], capture_of(idx)) == 21
    assert cache.nbytes() == 21 * L * k
    assert cache.get(2).dtype == torch.uint8 and cache.get(2).shape == (4, L, k)
    big = RoutingReplayCache("r3", L, k, 300)
    assert big.dtype == torch.int16 and big.bytes_per_token() == 2 * L * k


def test_r2_round_trip_shuffled_rows_and_longer_padding():
    L, k, E, B, T = 3, 2, 8, 3, 6
    idx = random_topk(B * T, L, k, E, torch.Generator().manual_seed(1))
    cache = RoutingReplayCache("r2", L, k, E)
    cache.record_capture(torch.tensor([10, 11, 12]), torch.tensor([6, 3, 4]), capture_of(idx), starts=[0, 1, 2])
    src = cache.replay_source([12, 10], seq_len=8)  # reordered, subset, padded longer
    rows = idx.view(B, T, L, k)
    for layer in range(L):
        got = src.indices(layer).view(2, 8, k)
        assert got.dtype == torch.int64
        assert torch.equal(got[0, 2:6], rows[2, 2:6, layer]) and (got[0, :2] == -1).all() and (got[0, 6:] == -1).all()
        assert torch.equal(got[1, :6], rows[0, :, layer]) and (got[1, 6:] == -1).all()
    src.check_complete()
    assert src.forwards == 1


def test_replay_consumption_rules():
    cache = RoutingReplayCache("r2", 2, 2, 4)
    cache.record_capture([0], [3], capture_of(random_topk(3, 2, 2, 4, torch.Generator().manual_seed(2))))
    src = cache.replay_source([0], 3)
    src.indices(0)
    with pytest.raises(RuntimeError, match="not consumed"):
        src.check_complete()
    with pytest.raises(RuntimeError, match="consumed twice"):
        src.indices(0)
    src.indices(1)
    src.check_complete()
    src.new_forward()  # activation recompute / next forward
    src.indices(0), src.indices(1)
    src.check_complete()
    assert src.forwards == 2
    with pytest.raises(IndexError, match="layer 2"):
        src.indices(2)


def test_cache_errors():
    L, k, E = 2, 2, 4
    cache = RoutingReplayCache("r2", L, k, E)
    good = random_topk(2 * 5, L, k, E, torch.Generator().manual_seed(3))
    cache.record_capture([0, 1], [5, 5], capture_of(good))
    with pytest.raises(KeyError, match=r"sample ids \[7\]"):
        cache.replay_source([0, 7], 5)
    with pytest.raises(ValueError, match="longer than seq_len=4"):
        cache.replay_source([0], 4)
    with pytest.raises(ValueError, match="3 layers x top-2"):
        cache.record_capture([0, 1], [5, 5], capture_of(random_topk(10, 3, k, E, torch.Generator())))
    with pytest.raises(ValueError, match="top-1"):
        cache.record_capture([0, 1], [5, 5], capture_of(good[..., :1]))
    with pytest.raises(ValueError, match="multiple of 3"):
        cache.record_capture([0, 1, 2], [5, 5, 5], capture_of(good))
    with pytest.raises(ValueError, match="outside its row"):
        cache.record_capture([0, 1], [5, 6], capture_of(good))
    with pytest.raises(ValueError, match="outside"):
        cache.record_capture([0, 1], [5, 5], capture_of(good + E))
    with pytest.raises(ValueError, match="unknown; valid: off, r2, r3"):
        RoutingReplayCache("r1", L, k, E)
    r3 = RoutingReplayCache("r3", L, k, E)
    with pytest.raises(ValueError, match=r"expected \(tokens, 2, 2\)"):
        r3.record_rollout(0, torch.zeros(5, 3, 2, dtype=torch.long))


def test_modes_off_and_r3():
    L, k, E = 2, 2, 6
    idx = random_topk(4, L, k, E, torch.Generator().manual_seed(4))
    off = RoutingReplayCache("off", L, k, E)
    assert off.record_capture([0], [4], capture_of(idx)) == 0 and off.replay_source([0], 4) is None
    r3 = RoutingReplayCache("r3", L, k, E)
    assert r3.record_capture([0], [4], capture_of(idx)) == 0 and len(r3) == 0
    assert r3.record_rollouts([5], [idx.flip(-1)[:3]], starts=[1]) == 3
    table = r3.replay_source([5], 4).stacked()  # (4, L, k)
    assert (table[0] == -1).all() and torch.equal(table[1:], idx[:3])  # sorted on record
    r3.drop([5])
    assert 5 not in r3 and r3.nbytes() == 0


# ------------------------------------------------------------------------------------------------ tracker
def test_tracker_hand_built_rates_and_churn():
    # 1 sample, T=3 tokens, L=2 layers, k=2, E=4
    ref = torch.tensor([[[0, 1], [0, 1]], [[2, 3], [1, 2]], [[0, 3], [0, 1]]])
    new = torch.tensor([[[0, 1], [0, 2]], [[3, 2], [1, 2]], [[1, 2], [0, 1]]])
    tr = ExpertFlipTracker(num_layers=2, num_experts=4)
    tr.set_reference([9], ref, torch.tensor([True, True, True]))
    tr.observe([9], new)
    m = tr.metrics()
    assert m["moe/flip_rate/layer_0"] == pytest.approx(2 / 6)  # token 2: {0,3} -> {1,2}
    assert m["moe/flip_rate/layer_1"] == pytest.approx(1 / 6)  # token 0: {0,1} -> {0,2}
    assert m["moe/flip_rate"] == pytest.approx(3 / 12)
    # by set: layer 0 token 2 changed (its token 1 only reordered), layer 1 token 0 changed: 1 of 3 pairs each
    assert m["moe/set_flip_rate/layer_0"] == m["moe/set_flip_rate/layer_1"] == pytest.approx(1 / 3)
    assert m["moe/set_flip_rate"] == pytest.approx(2 / 6)
    # reference slots per expert over both layers: e0 4, e1 4, e2 2, e3 2
    assert m["moe/churn_out/expert_0"] == pytest.approx(1 / 4)  # layer 0 token 2
    assert m["moe/churn_out/expert_1"] == pytest.approx(1 / 4)  # layer 1 token 0
    assert m["moe/churn_out/expert_3"] == pytest.approx(1 / 2)
    assert m["moe/churn_in/expert_1"] == pytest.approx(1 / 4) and m["moe/churn_in/expert_2"] == pytest.approx(2 / 2)
    assert m["moe/flip_tokens"] == 3 and "moe/rollout_train_mismatch" not in m
    assert tr.metrics() == {}  # reset per step
    # a forward padded longer than the reference pass: the extra positions have no reference and are skipped
    tr.observe([9], torch.cat([new, torch.zeros(2, 2, 2, dtype=torch.long)]))
    assert tr.metrics()["moe/flip_rate"] == pytest.approx(3 / 12)
    tr.observe([9], new[:2])  # and shorter
    assert tr.metrics()["moe/flip_rate"] == pytest.approx(1 / 8)


def test_tracker_splits_the_drift_by_updates_since_the_reference():
    """moe/flip_rate/after_j: the forwards observed j optimizer updates after the reference, counted apart; the mean
    drift moe/flip_rate pools them."""
    ref = torch.tensor([[[0, 1]], [[2, 3]]])  # 1 sample, T=2, L=1, k=2, E=4
    tr = ExpertFlipTracker(num_layers=1, num_experts=4)
    tr.set_reference([5], ref)
    tr.observe([5], ref.clone())  # depth 0: no flip
    tr.updated()
    tr.observe([5], torch.tensor([[[0, 2]], [[2, 3]]]))  # depth 1: 1 of 4 slots
    tr.updated()
    tr.observe([5], torch.tensor([[[2, 3]], [[0, 1]]]))  # depth 2: 4 of 4
    m = tr.metrics()
    assert (m["moe/flip_rate/after_0"], m["moe/flip_rate/after_1"], m["moe/flip_rate/after_2"]) == (0, 0.25, 1)
    assert m["moe/flip_rate"] == pytest.approx(5 / 12)
    # by set: depth 1 changed token 0's set only (1 of 2), depth 2 both
    assert [m[f"moe/set_flip_rate/after_{j}"] for j in range(3)] == [0, 0.5, 1]
    assert m["moe/set_flip_rate"] == pytest.approx(3 / 6)
    tr.clear()
    tr.set_reference([6], ref)
    tr.observe([6], ref.clone())  # a new rollout batch starts again at depth 0
    assert "moe/flip_rate/after_1" not in tr.metrics()


def test_tracker_expert_load_from_the_old_routing():
    """Per layer, each expert's share of the old routing's top-k slots on the observed (masked) tokens, the largest
    share times E, and the entropy of the shares over ln E, against counts and scipy.stats.entropy computed here from
    the same routing; the live routing does not enter."""
    import numpy as np
    from scipy.stats import entropy

    L, k, E, B, T = 3, 2, 5, 2, 6
    g = torch.Generator().manual_seed(4)
    ref = random_topk(B * T, L, k, E, g)
    ref[:, 0] = torch.tensor([0, 1])  # layer 0: every token on experts 0 and 1
    mask = torch.rand(B * T, generator=g) > 0.3
    tr = ExpertFlipTracker(L, E)
    tr.set_reference([0, 1], ref, mask)
    tr.observe([0, 1], random_topk(B * T, L, k, E, g), mask)
    m = tr.metrics()
    ratios, ents = [], []
    for layer in range(L):
        counts = np.bincount(ref[mask, layer].reshape(-1).numpy(), minlength=E)
        share = counts / counts.sum()
        assert [m[f"moe/load/layer_{layer}/expert_{e}"] for e in range(E)] == pytest.approx(share.tolist())
        ratios.append(share.max() * E)
        ents.append(entropy(share) / np.log(E))
        assert m[f"moe/load_max_over_mean/layer_{layer}"] == pytest.approx(ratios[-1])
        assert m[f"moe/load_entropy/layer_{layer}"] == pytest.approx(ents[-1])
    assert m["moe/load_max_over_mean/layer_0"] == pytest.approx(E / 2)  # two experts hold every slot
    assert m["moe/load_entropy/layer_0"] == pytest.approx(np.log(2) / np.log(E))
    assert m["moe/load_max_over_mean"] == pytest.approx(np.mean(ratios))
    assert m["moe/load_entropy"] == pytest.approx(np.mean(ents))


def test_tracker_mask_order_and_mismatch():
    L, k, E, B, T = 3, 2, 8, 4, 5
    g = torch.Generator().manual_seed(5)
    ref = random_topk(B * T, L, k, E, g)
    mask = torch.rand(B * T, generator=g) < 0.7
    tr = ExpertFlipTracker(L, E)
    tr.set_reference([0, 1, 2, 3], ref, mask)
    new = random_topk(B * T, L, k, E, g)
    perm = [2, 0, 3, 1]
    rows = lambda x: x.view(B, T, *x.shape[1:])[perm].reshape(B * T, *x.shape[1:])  # noqa: E731
    tr.observe(perm, rows(new), rows(mask))
    tr.observe_rollout(perm, rows(ref))  # engine agrees with training: no mismatch
    m = tr.metrics()
    assert m["moe/flip_rate"] == pytest.approx(flip_rate(ref[mask], new[mask]))
    for layer in range(L):
        assert m[f"moe/flip_rate/layer_{layer}"] == pytest.approx(flip_rate(ref[mask, layer], new[mask, layer]))
    assert m["moe/rollout_train_mismatch"] == 0.0
    engine = new.clone()
    engine[:T] = -1  # sample 0 has no engine routing
    tr.observe_rollout([0, 1, 2, 3], engine, mask)
    sel = mask.clone()
    sel[:T] = False
    m = tr.metrics()
    assert m["moe/rollout_train_mismatch"] == pytest.approx(flip_rate(ref[sel], new[sel]))
    # per token: a token whose top-k set differs in any layer, counted by hand over the compared tokens
    differs = [any(set(ref[t, layer].tolist()) != set(new[t, layer].tolist()) for layer in range(L))
               for t in range(B * T) if sel[t]]
    assert m["moe/rollout_train_token_mismatch"] == pytest.approx(sum(differs) / len(differs))
    # by hand: 3 tokens, 2 layers, top-1 of 4; the engine agrees on token 0, differs in layer 1 on token 1 and in
    # both layers on token 2: 3 of 6 slots, 2 of 3 tokens
    hand = ExpertFlipTracker(2, 4)
    hand.set_reference([0], torch.tensor([[[0], [1]], [[2], [3]], [[0], [0]]]))
    hand.observe_rollout([0], torch.tensor([[[0], [1]], [[2], [0]], [[1], [2]]]))
    m = hand.metrics()
    assert m["moe/rollout_train_mismatch"] == 0.5 and m["moe/rollout_train_token_mismatch"] == pytest.approx(2 / 3)
    with pytest.raises(KeyError, match="set_reference"):
        tr.observe([4], new[:T])
    with pytest.raises(ValueError, match="mask"):
        tr.observe([0], new[:T], mask)
    with pytest.raises(ValueError, match=r"\(B\*T, 3, k\)"):
        tr.observe([0], new[:T, :2])


def test_tracker_counts_match_python_sets_whatever_the_token_slicing(monkeypatch):
    import moe_gspo.routing.tracker as tracker_mod
    L, k, E, B, T = 3, 3, 6, 3, 7
    g = torch.Generator().manual_seed(11)
    ref, new = random_topk(B * T, L, k, E, g), random_topk(B * T, L, k, E, g)
    mask = torch.rand(B * T, generator=g) < 0.8
    gained, lost, load = torch.zeros(L, E), torch.zeros(L, E), torch.zeros(L, E)
    changed = torch.zeros(L, dtype=torch.long)
    for n in mask.nonzero().squeeze(1).tolist():  # python sets: the definition
        for layer in range(L):
            a, b = set(ref[n, layer].tolist()), set(new[n, layer].tolist())
            changed[layer] += a != b
            for e in b - a:
                gained[layer, e] += 1
            for e in a - b:
                lost[layer, e] += 1
            for e in a:
                load[layer, e] += 1
    results = []
    for set_elems in (2**24, L * (E + 1) * 2, 1):  # one slice; 2 tokens per slice; 1 token per slice
        monkeypatch.setattr(tracker_mod, "_SET_ELEMS", set_elems)
        tr = ExpertFlipTracker(L, E)
        tr.set_reference(list(range(B)), ref, mask)
        tr.observe(list(range(B)), new, mask)
        c = tr.counts()
        assert torch.equal(c["churn_in"].float(), gained) and torch.equal(c["churn_out"].float(), lost)
        assert torch.equal(c["load"].float(), load) and torch.equal(c["tokens"], torch.full((L,), int(mask.sum())))
        assert torch.equal(c["set_flips"], changed)
        results.append(tr.metrics())
    assert results[0] == results[1] == results[2]
    assert results[0]["moe/flip_rate"] == pytest.approx(float(gained.sum() / load.sum()))
    assert 0 < results[0]["moe/set_flip_rate"] == pytest.approx(float(changed.sum()) / (L * int(mask.sum())))
    for layer in range(L):
        assert results[0][f"moe/set_flip_rate/layer_{layer}"] == pytest.approx(float(changed[layer]) / int(mask.sum()))
