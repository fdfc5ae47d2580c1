"""train.router_lr_scale: the router (gate) weights get their own megatron param group whose learning rate is the
scale times everyone else's, at every step of the schedule; nothing else changes."""

from __future__ import annotations

import pytest
import torch
from helpers import records, tiny_cfg

from moe_gspo.config import ConfigError


def _policy_and_optimizer(cfg, weights=None):
    import moe_gspo
    from moe_gspo.train.optim import Optimizer, wrap_ddp

    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    if weights is not None:
        policy.load_full_megatron_state(weights)
    return policy, Optimizer.from_config(wrap_ddp(policy, False), policy, cfg.train, total_steps=10)


def _one_step(policy, opt, x) -> dict[str, torch.Tensor]:
    """The change of every parameter (megatron names) after one optimizer step on the batch x."""
    before = {k: v.clone() for k, v in policy.full_megatron_state().items()}
    opt.zero_grad()
    policy(x).float().logsumexp(-1).mean().backward()
    opt.step()
    return {k: v - before[k] for k, v in policy.full_megatron_state().items()}


@pytest.mark.parametrize("scale", [4.0, 0.25])
def test_router_lr_scale_changes_only_the_routers_update(scale):
    """From identical weights and data, one step at router_lr_scale s against s = 1: Adam's first step is
    -lr * g / (|g| + eps) elementwise on the same gradient g, so the router weights move exactly s times as far and
    every other parameter moves identically."""
    base = tiny_cfg("train.lr=0.01")
    x = torch.randint(0, base.model.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    p1, o1 = _policy_and_optimizer(base)
    weights = {k: v.clone() for k, v in p1.full_megatron_state().items()}
    ps, os_ = _policy_and_optimizer(tiny_cfg("train.lr=0.01", f"train.router_lr_scale={scale}"), weights)
    assert o1.router_lr is None and os_.router_lr == pytest.approx(scale * 0.01)
    d1, ds = _one_step(p1, o1, x), _one_step(ps, os_, x)
    routers = [k for k in d1 if ".mlp.router." in k]
    assert len(routers) == base.model.num_hidden_layers
    for k in d1:
        if k in routers:
            assert d1[k].abs().max() > 1e-3  # the router did move
            torch.testing.assert_close(ds[k], scale * d1[k], rtol=1e-5, atol=1e-9, msg=lambda m: f"{k}: {m}")
        else:
            torch.testing.assert_close(ds[k], d1[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def test_router_lr_follows_the_schedule_at_its_scale():
    """With warmup and cosine decay the router's rate is s times the others' at every step."""
    cfg = tiny_cfg("train.lr=0.01", "train.min_lr=0.001", "train.lr_warmup_steps=3", "train.lr_decay=cosine",
                   "train.router_lr_scale=5")
    policy, opt = _policy_and_optimizer(cfg)
    x = torch.randint(0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    seen = []
    for _ in range(8):
        seen.append((opt.lr, opt.router_lr))
        _one_step(policy, opt, x)
    assert len({a for a, _ in seen}) > 3  # the schedule moved
    for lr, router_lr in seen:
        assert router_lr == pytest.approx(5 * lr, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("bad,shown", [("0", "0.0"), ("-1", "-1.0"), ("nan", "nan"), ("inf", "inf")])
def test_router_lr_scale_is_checked_at_load(bad, shown):
    with pytest.raises(ConfigError, match=rf"train.router_lr_scale={shown} must be a finite number > 0"):
        tiny_cfg(f"train.router_lr_scale={bad}")


def test_router_lr_is_logged_and_saved_with_the_run(tmp_path):
    """A run at router_lr_scale 3 logs router_lr = 3 * lr every step and writes the scale into its config.yaml and
    its checkpoint's config; a run at the default logs no router_lr."""
    import json

    import yaml

    from moe_gspo.train.loop import train

    cfg = tiny_cfg("train.router_lr_scale=3", "train.checkpoint_every=2")
    train(cfg, run_dir=tmp_path / "s3")
    rows = records(tmp_path / "s3")
    assert rows and all(r["router_lr"] == pytest.approx(3 * r["lr"]) for r in rows)
    assert yaml.safe_load((tmp_path / "s3" / "config.yaml").read_text())["train"]["router_lr_scale"] == 3
    state = json.loads(next((tmp_path / "s3" / "checkpoints").glob("*/state.json")).read_text())
    assert state["config"]["train"]["router_lr_scale"] == 3
    train(tiny_cfg(), run_dir=tmp_path / "s1")
    assert all("router_lr" not in r for r in records(tmp_path / "s1"))
