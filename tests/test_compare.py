"""`moe-gspo compare`: config handling, the report from metrics files, and a tiny end-to-end run of two variants."""

from __future__ import annotations

import json
import math

import pytest

from moe_gspo.config import ConfigError


def _fake_run(d, clip, flip, reward0, steps=6, layers=2):
    d.mkdir(parents=True)
    with (d / "metrics.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            rec = {"step": s, "reward/mean": reward0 + 0.01 * s, "accuracy": reward0 + 0.01 * s, "pg_clipfrac": clip,
                   "moe/flip_rate": flip, "moe/rollout_train_mismatch": 0.01, "rollout_probs_diff_mean": 1e-3,
                   **{f"moe/flip_rate/layer_{i}": flip * (i + 1) / layers for i in range(layers)},
                   **{f"moe/churn_out/expert_{e}": 0.01 * e for e in range(4)}}
            if s == 2:
                rec["pg_clipfrac"] = 0.0  # a step with nothing clipped must not break the log scale
            f.write(json.dumps(rec) + "\n")
    (d / "wall_time.json").write_text(json.dumps({"seconds": 12.5}))


def test_report_from_metrics_files(tmp_path):
    from moe_gspo.report.compare import summary_rows, write_compare_report
    from moe_gspo.report.plots import load_runs

    _fake_run(tmp_path / "grpo", clip=0.002, flip=0.05, reward0=0.3)
    _fake_run(tmp_path / "gspo", clip=0.2, flip=0.04, reward0=0.3)
    report = write_compare_report(tmp_path, ["grpo", "gspo"])
    text = report.read_text()
    for png in ("compare_reward.png", "compare_accuracy.png", "compare_clipfrac.png", "compare_mismatch.png",
                "volatility_flip_rate.png", "volatility_heatmap.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
        assert png in text
    rows = {r[0]: r for r in summary_rows(load_runs([tmp_path / "grpo", tmp_path / "gspo"]), {"grpo": 1.0})}
    ratio = rows["gspo"][7]
    assert math.isclose(ratio, (0.2 * 5 / 6) / (0.002 * 5 / 6))  # clip fraction ratio GSPO / GRPO = 100
    assert rows["grpo"][-1] == 1.0 and "12.5" in text  # wall time given, or read from wall_time.json
    assert "Identical reward curves" in text and "grpo = gspo" in text  # the fake runs share their rewards


def test_compare_config_errors(tmp_path):
    from moe_gspo.experiments.compare import DEFAULT_VARIANTS, read_compare_config

    p = tmp_path / "c.yaml"
    p.write_text("train: {steps: 2}\ncompare: {variants: {x: [algorithm.loss=nope]}}\n")
    with pytest.raises(ConfigError, match="variant 'x'"):
        read_compare_config(p)
    p.write_text("compare: {runs: 3}\n")
    with pytest.raises(ConfigError, match="unknown keys under 'compare'"):
        read_compare_config(p)
    p.write_text("train: {steps: 2}\n")
    base, variants = read_compare_config(p, ["train.lr=0.5"])
    assert variants == DEFAULT_VARIANTS and base["train"] == {"steps": 2, "lr": 0.5}
    with pytest.raises(ConfigError, match="config file not found"):
        read_compare_config(tmp_path / "missing.yaml")


def test_compare_cli_end_to_end_two_variants(tmp_path):
    from helpers import TINY

    from moe_gspo.cli import main

    assert main(["compare", "--config", "configs/compare_tiny_cpu.yaml", "--out", str(tmp_path), "--only",
                 "grpo_r3,gspo", *TINY, "rollout.engine_dtype=float32"]) == 0
    assert (tmp_path / "report.html").exists()
    info = json.loads((tmp_path / "compare.json").read_text())
    assert list(info["variants"]) == ["grpo_r3", "gspo"]
    first = {v: json.loads((tmp_path / v / "metrics.jsonl").read_text().splitlines()[0]) for v in ("grpo_r3", "gspo")}
    # same weights, prompts and seeds: the first rollout batch is identical across variants
    assert first["grpo_r3"]["reward/mean"] == first["gspo"]["reward/mean"]
    assert first["grpo_r3"]["moe/rollout_train_mismatch"] == 0.0  # fp32 engine routes exactly like the trainer
    assert main(["compare", "--config", "configs/compare_tiny_cpu.yaml", "--out", str(tmp_path), "--only", "nope"]) == 2
    # a second comparison into the same directory is refused unless told to replace the first
    assert main(["compare", "--config", "configs/compare_tiny_cpu.yaml", "--out", str(tmp_path), "--only", "gspo"]) == 2
