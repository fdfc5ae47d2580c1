"""train.routing_noise: noise in the trainer's routing of the pi_theta forward alone (model.router.RoutingNoise).

- each moved slot goes to the router's next-best expert its token does not use, within a grouped router's groups;
- the measured fraction of moved slots is q (within 0.2 points at q = 0.05, over 82k slots of four forwards);
- with no slot moved the run is bitwise today's, and q = 0 keeps today's code path (the golden curves pin it);
- the engine's tokens, the old policy's log-probs and the rollout-train comparison do not depend on q, while the
  update does; with R3 the replayed routing is used as it is, whatever q.
"""

from __future__ import annotations

import pytest
import torch

from helpers import records, strip_timing, tiny_cfg


def test_moved_slots_take_the_next_best_experts_in_order():
    from moe_gspo.model.router import RoutingNoise

    choice = torch.tensor([[9.0, 8.0, 7.0, 6.0, 5.0, 4.0],  # ranking 0 1 2 3 4 5
                           [1.0, 6.0, 5.0, 4.0, 3.0, 2.0],  # ranking 1 2 3 4 5 0
                           [9.0, 8.0, float("-inf"), float("-inf"), float("-inf"), 7.0]])  # groups left 0 1 5
    g = torch.Generator().manual_seed(0)
    every = RoutingNoise(1.0, g).apply(choice, 2)
    assert every.tolist() == [[2, 3], [3, 4], [5, 1]]  # both slots moved: the 3rd and 4th best; row 3 has one left
    assert RoutingNoise(0.0, g).apply(choice, 2).tolist() == [[0, 1], [1, 2], [0, 1]]


def test_the_fraction_of_moved_slots_is_q():
    import moe_gspo
    from moe_gspo.model.router import RoutingNoise
    from moe_gspo.model.routing_capture import RoutingCapture

    cfg = tiny_cfg()
    torch.manual_seed(0)
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    mc = policy.model_config
    ids = torch.randint(0, mc.vocab_size, (160, 32), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(7)
    moved = total = 0
    for _ in range(4):  # four forwards, each drawing afresh
        cap = RoutingCapture(noise=RoutingNoise(0.05, g))
        with torch.no_grad():
            policy(ids, routing=cap)
        noisy, live = cap.stacked(), cap.live_stacked()  # (N, L, k), sorted per token
        kept = (noisy[..., :, None] == live[..., None, :]).any(-1)  # a slot whose expert the router chose too
        moved += int((~kept).sum())
        total += kept.numel()
    assert total >= 80_000 and abs(moved / total - 0.05) < 0.002, moved / total


TWO_STEPS = ["train.steps=2", "rollout.reward=tests/data/spread_reward.py:compute_score", "train.cold_start_steps=0"]


def _run(tmp_path, name, *over):
    from moe_gspo.train.loop import train

    train(tiny_cfg(*TWO_STEPS, *over), run_dir=tmp_path / name)
    return [strip_timing(r) for r in records(tmp_path / name)]


def test_no_moved_slot_is_bitwise_today_and_noise_reaches_the_update_alone(tmp_path):
    today = _run(tmp_path, "q0")
    none_moved = _run(tmp_path, "tiny_q", "train.routing_noise=1e-12")
    assert [r.pop("moe/routing_noise_moved") for r in none_moved] == [0.0, 0.0]
    assert none_moved == today
    noisy = _run(tmp_path, "q", "train.routing_noise=0.5")
    # step 1's rollout and old pass come before any update: the engine's tokens and pi_old are untouched
    for key in ("reward/mean", "response_length/mean", "rollout_probs_diff_max", "moe/rollout_train_mismatch"):
        assert noisy[0][key] == today[0][key], key
    assert noisy[0]["grad_norm"] != today[0]["grad_norm"]


def test_replayed_routing_is_used_as_it_is(tmp_path):
    r3 = ["algorithm.routing_replay=r3"]
    assert _run(tmp_path, "r3", *r3) == _run(tmp_path, "r3_noise", *r3, "train.routing_noise=0.5")


def test_routing_noise_is_a_probability():
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.routing_noise=1.5 must be in \[0, 1\]"):
        tiny_cfg("train.routing_noise=1.5")


def test_the_moved_share_is_logged_per_step(tmp_path):
    """moe/routing_noise_moved: the share of the response's routed slots the noise moved in the update forwards."""
    recs = _run(tmp_path, "logged", "train.routing_noise=0.3")
    shares = [r["moe/routing_noise_moved"] for r in recs]
    assert all(abs(s - 0.3) < 0.1 for s in shares), shares
    assert "moe/routing_noise_moved" not in _run(tmp_path, "off")[0]


def test_variants_differing_in_routing_noise_share_a_cold_start():
    """The supervised cold start never routes with noise, so a comparison's arms at different q start from one."""
    from moe_gspo.experiments.compare import cold_start_key

    assert cold_start_key(tiny_cfg("train.routing_noise=0.05")) == cold_start_key(tiny_cfg())
