"""train.recompute: megatron's activation recompute on the policy (selective: core attention; full: whole decoder
layers), with routing that the recomputed forward takes from the first one (model.router.RecomputeBoundary).

- with R2-like replay (the old policy's experts), with R3-like replay (another table) and with routing noise, a
  policy built with recompute gives the gradients of one without (<= 1e-6 relative, fp32);
- the replay is used in the recomputed forward: corrupting the router's live choice during the backward's recompute
  moves nothing, where a recompute that routed live would move the gradients;
- the capture records each layer once, and a strict replay source is read once per forward;
- a training run with recompute follows the run without it.
"""

from __future__ import annotations

import pytest
import torch

from helpers import records, strip_timing, tiny_cfg


def _policy(mode: str):
    import moe_gspo

    cfg = tiny_cfg(f"train.recompute={mode}")
    torch.manual_seed(0)
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    policy.train()
    return policy


def _ids(policy):
    return torch.randint(0, policy.model_config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(2))


def _table(policy, seed: int):
    mc = policy.model_config
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3 * 14, mc.num_moe_layers, mc.num_experts, generator=g).topk(mc.num_experts_per_tok, -1).indices


def _grads(policy, capture):
    policy.zero_grad(set_to_none=True)
    out = policy(_ids(policy), routing=capture)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def _assert_equal_grads(a, b):
    assert a.keys() == b.keys() and any("router" in n for n in a)
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-6, atol=1e-6 * max(1.0, a[n].abs().max().item()),
                                   msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("routing", ["r2", "r3", "noise"])
def test_recompute_gives_the_gradients_of_no_recompute(mode, routing):
    from moe_gspo.model.router import RoutingNoise
    from moe_gspo.model.routing_capture import ReplaySource, RoutingCapture

    def capture(policy):
        if routing == "noise":
            return RoutingCapture(noise=RoutingNoise(0.3, torch.Generator().manual_seed(5)))
        if routing == "r3":
            return RoutingCapture(replay=ReplaySource(_table(policy, 3), strict=True))
        old = RoutingCapture()  # R2: the old policy's experts (this policy's own, before an update)
        with torch.no_grad():
            policy(_ids(policy), routing=old)
        return RoutingCapture(replay=ReplaySource(old.stacked(), strict=True))

    plain, recomputed = _policy("none"), _policy(mode)
    cp, cr = capture(plain), capture(recomputed)
    _assert_equal_grads(_grads(plain, cp), _grads(recomputed, cr))
    assert torch.equal(cr.stacked(), cp.stacked())  # recorded once, the same routing
    if cr.replay is not None:
        cr.replay.check_complete()  # read once per forward: the recompute does not read it again


def test_the_recomputed_forward_uses_the_first_forwards_routing(monkeypatch):
    """Under full recompute, the router's live choice is corrupted only inside the backward's recompute: with the
    replayed (R3) experts kept for it the gradients do not move. The same corruption in a forward of its own moves
    the routing, so the check would show a recompute that routed live."""
    from moe_gspo.model import router
    from moe_gspo.model.routing_capture import ReplaySource, RoutingCapture

    policy = _policy("full")
    table = _table(policy, 3)
    clean = _grads(policy, RoutingCapture(replay=ReplaySource(table)))
    original = router.MoERouter.choice_scores

    def corrupted(self, logits, bias=None):
        scores = original(self, logits, bias)
        return -scores if router.active_routing()[1] else scores  # the worst experts, in the recompute only

    monkeypatch.setattr(router.MoERouter, "choice_scores", corrupted)
    _assert_equal_grads(clean, _grads(policy, RoutingCapture(replay=ReplaySource(table))))
    # without replay, live routing: the recompute reuses the first forward's live experts too
    live = _grads(policy, RoutingCapture())
    monkeypatch.setattr(router.MoERouter, "choice_scores", original)
    _assert_equal_grads(_grads(policy, RoutingCapture()), live)


def test_a_run_with_full_recompute_follows_the_run_without(tmp_path):
    from moe_gspo.train.loop import train

    over = ["train.steps=2", "rollout.reward=tests/data/spread_reward.py:compute_score", "train.cold_start_steps=0",
            "algorithm.routing_replay=r3"]
    train(tiny_cfg(*over), run_dir=tmp_path / "none")
    train(tiny_cfg(*over, "train.recompute=full"), run_dir=tmp_path / "full")
    a, b = [strip_timing(r) for r in records(tmp_path / "none")], [strip_timing(r) for r in records(tmp_path / "full")]
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            assert rb[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_recompute_is_checked_at_config_load():
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match="train.recompute"):
        tiny_cfg("train.recompute=partial")
    with pytest.raises(ConfigError, match=r"train.recompute_layers=5 exceeds model.num_hidden_layers=2"):
        tiny_cfg("train.recompute=full", "train.recompute_layers=5")
