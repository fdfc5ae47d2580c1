"""The policy loss as one object: a loss registered from outside the package, with its own option, read from YAML
and trained; its options checked at config load; and step metrics that do not depend on the micro-batching."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moe_gspo.config import ConfigError, load_config
from moe_gspo.losses import LossConfigError, PolicyLoss, grpo_loss, register_policy_loss
from moe_gspo.losses.registry import POLICY_LOSSES

from helpers import ROOT, TINY, records, strip_timing, tiny_cfg


@dataclass(frozen=True)
class ScaledOptions:
    scale: float = 1.0
    """Multiplies the GRPO surrogate (> 0)."""

    def __post_init__(self):
        if not self.scale > 0:
            raise LossConfigError("loss_options.scale", self.scale, "must be > 0")


def scaled_grpo(logp, old_logp, advantages, mask, *, scale, **shared):
    loss, metrics = grpo_loss(logp, old_logp, advantages, mask, **shared)
    return scale * loss, {**metrics, "pg_loss": scale * metrics["pg_loss"]}


@pytest.fixture
def scaled_loss():
    """A loss defined here, outside moe_gspo, registered for the test and removed after it."""

    @register_policy_loss
    class ScaledGRPO(PolicyLoss):
        name = "scaled_grpo_test"
        default_clip = (0.2, 0.27)
        Options = ScaledOptions
        fn = staticmethod(scaled_grpo)

    yield ScaledGRPO
    POLICY_LOSSES.pop("scaled_grpo_test")


def _yaml(tmp_path, loss: str, options: str = "") -> str:
    text = (ROOT / "configs/train_tiny_cpu.yaml").read_text().replace("  loss: gspo\n", f"  loss: {loss}\n{options}")
    path = tmp_path / f"{loss}.yaml"
    path.write_text(text)
    return str(path)


def test_a_loss_registered_outside_the_package_trains_from_yaml_with_its_option(tmp_path, scaled_loss):
    from moe_gspo.train.loop import train

    one_step = TINY + ["train.steps=1", "train.minibatches=1"]
    cfg = load_config(_yaml(tmp_path, "scaled_grpo_test", "  loss_options:\n    scale: 2.0\n"), one_step)
    assert cfg.algorithm.loss_options == {"scale": 2.0}
    assert cfg.algorithm.policy_loss().options == ScaledOptions(2.0)
    train(cfg, run_dir=tmp_path / "scaled")
    train(load_config(_yaml(tmp_path, "grpo"), one_step), run_dir=tmp_path / "grpo")
    (scaled,), (plain,) = records(tmp_path / "scaled"), records(tmp_path / "grpo")
    # the same rollout (same seed and weights), so the option reaches the loss's math: twice the loss and gradient
    assert scaled["reward/mean"] == plain["reward/mean"]
    assert scaled["pg_loss"] == pytest.approx(2 * plain["pg_loss"], rel=1e-5, abs=1e-9)
    assert scaled["grad_norm"] == pytest.approx(2 * plain["grad_norm"], rel=1e-5)
    assert scaled["ppo_kl"] == pytest.approx(plain["ppo_kl"], abs=1e-7)


@pytest.mark.parametrize("options,field", [("  loss_options:\n    scale: -1.0\n", "algorithm.loss_options.scale=-1.0"),
                                           ("  loss_options:\n    scal: 2.0\n", "algorithm.loss_options.scal=2.0")])
def test_a_bad_loss_option_fails_at_config_load_naming_the_field(tmp_path, scaled_loss, options, field):
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "scaled_grpo_test", options))
    assert field in str(e.value) and "\n" not in str(e.value)


def test_a_bad_clip_is_one_line_at_load_from_the_cli(tmp_path):
    """The loss checks its clip range when the config is read, so a user's bad value is one line, not a
    traceback from the first step."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moe_gspo.cli", "train", "--config", "configs/train_tiny_cpu.yaml",
                        "--out", str(tmp_path / "run"), "algorithm.clip_low=-0.1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "algorithm.clip_low=-0.1" in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_the_loss_default_aggregation_reaches_training():
    """The loss class owns its defaults: an unset algorithm.loss_agg_mode takes the loss's own."""
    assert load_config(None, ["algorithm.loss=cispo"]).algorithm.policy_loss().loss_agg_mode == "token-mean"
    assert load_config(None, ["algorithm.loss=gspo"]).algorithm.loss_agg_mode == "seq-mean-token-mean"


MICRO = {"rows of 16": ["train.micro_batch_size=16"], "rows of 4": ["train.micro_batch_size=4"],
         "packed 256": ["train.max_tokens_per_micro_batch=256"], "packed 40": ["train.max_tokens_per_micro_batch=40"]}


# A bf16 engine's log-probs make the ratios and the rollout correction non-trivial from the first minibatch on; lr 0
# keeps every minibatch on the same weights. (With lr > 0, Adam's first step moves every weight whose gradient is
# near 0 by +-lr according to its sign, so the rounding of another micro-batching's gradient sums would move later
# minibatches' ratios by ~1e-5: the optimizer's numerics, not the metrics'.)
# configs/train_tiny_cpu.yaml's model after 60 supervised steps: rewards that differ within groups. 64 responses,
# minibatches of 16.
OFF_POLICY = ["rollout.engine_dtype=bfloat16", "train.lr=0", "train.steps=1", "train.cold_start_steps=60",
              "train.checkpoint_every=0", "train.logprob_micro_batch_size=16", "logging.progress=false",
              "logging.tensorboard=false"]


@pytest.mark.parametrize("loss", [["algorithm.loss=gspo", "algorithm.use_engine_logprobs=true"],
                                  ["algorithm.loss=grpo", "algorithm.kl_beta=0.01", "algorithm.rollout_is=token",
                                   "algorithm.router_shift=true"]])
def test_step_metrics_do_not_depend_on_the_micro_batching(tmp_path, loss):
    """Rows at two micro-batch sizes and packed at two token budgets: the same step metrics to 1e-6 (timings
    aside). Each minibatch of 16 responses runs as 1, 4, 1 or several forwards."""
    from moe_gspo.train.loop import train

    runs = {}
    for name, ovs in MICRO.items():
        d = tmp_path / name.replace(" ", "_")
        train(load_config(ROOT / "configs/train_tiny_cpu.yaml", OFF_POLICY + loss + ovs), run_dir=d)
        (runs[name],) = [strip_timing(r) for r in records(d)]
    base = runs["rows of 16"]
    assert base["reward/std"] > 0 and base["ratio_max"] > base["ratio_min"] and base["pg_loss"] != 0
    for name, m in runs.items():
        assert set(m) == set(base), name
        bad = {k: (base[k], v) for k, v in m.items() if abs(v - base[k]) > 1e-6 * max(1.0, abs(base[k]))}
        assert not bad, (name, bad)
