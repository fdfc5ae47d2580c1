"""`moe-gspo study volatility`: the grid it plans, a tiny end-to-end study (report, table equal to the runs'
metrics), the report's statistics on constructed metrics, and one-line errors for bad study fields."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from helpers import ROOT

from moe_gspo.cli import main

CONFIG = str(ROOT / "configs/studies/volatility_cpu.yaml")

# A 2-point study (1 and 2 layers, the base lr and minibatches), 1 seed, 2 RL steps, width 32. The cold start and
# lr are large enough that the groups carry reward variance and the router moves, so flip rates are not all 0.
TINY_STUDY = ["model.hidden_size=32", "model.num_attention_heads=2", "model.num_key_value_heads=1",
              "model.moe_intermediate_size=32", "model.num_experts=4", "rollout.prompts_per_step=4",
              "rollout.group_size=4", "rollout.max_new_tokens=3", "train.micro_batch_size=8", "train.minibatches=2",
              "train.cold_start_steps=40", "train.cold_start_lr=0.01", "train.lr=0.01",
              "study.depths=[1,2]", "study.lrs=[0.01]", "study.minibatches=[2]", "study.base_depth=2",
              "study.seeds=1", "study.steps=2"]


def _flip_values(run_dir, key="moe/flip_rate"):
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if key in json.loads(line)]


def _table(out):
    with (out / "study_table.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_default_grid_is_three_sweeps_through_the_base_point():
    from moe_gspo.experiments.volatility import read_study_config

    _, study, grid = read_study_config(CONFIG)
    base = grid.base
    assert (base.depth, base.lr, base.minibatches) == (study.base_depth, 3e-4, 4)
    by_depth = {p.depth for p in grid.points if (p.lr, p.minibatches) == (base.lr, base.minibatches)}
    by_lr = {p.lr for p in grid.points if (p.depth, p.minibatches) == (base.depth, base.minibatches)}
    by_mb = {p.minibatches for p in grid.points if (p.depth, p.lr) == (base.depth, base.lr)}
    assert by_depth == set(study.depths) and by_lr == set(study.lrs) and by_mb == set(study.minibatches)
    # the base point is in all three sweeps but runs once; nothing off the three lines is run
    assert len(grid.points) == len(study.depths) + len(study.lrs) + len(study.minibatches) - 2
    assert len({p.name for p in grid.points}) == len(grid.points)
    assert grid.seeds == tuple(range(study.seeds))


def test_granularity_sweep_holds_the_active_width_and_shares_the_plain_layout():
    """Every (experts, top-k) pair with top-k <= experts at each granularity depth, expert width = active // top-k;
    the config's own layout (8 experts, top-2, width 128) is the plain point of its depth, run once; every model
    (depth, layout) gets its own cold start per seed."""
    from moe_gspo.experiments.volatility import plan_groups, read_study_config

    _, _, grid = read_study_config(CONFIG, ["study.depths=[4]", "study.lrs=[3e-4]", "study.minibatches=[4]",
                                            "study.experts=[4,8,32]", "study.top_ks=[2,8]", "study.active_width=256",
                                            "study.granularity_depths=[4,16]", "study.seeds=2"])
    layouts = {(p.depth, p.moe) for p in grid.points}
    assert layouts == {(d, m) for d in (4, 16) for m in (None, (4, 2, 128), (8, 8, 32), (32, 2, 128), (32, 8, 32))}
    assert {p.name for p in grid.points if p.depth == 16} == {
        "L16_lr0.0003_mb4", "L16_lr0.0003_mb4_E4k2", "L16_lr0.0003_mb4_E8k8", "L16_lr0.0003_mb4_E32k2",
        "L16_lr0.0003_mb4_E32k8"}
    p = next(p for p in grid.points if p.name == "L4_lr0.0003_mb4_E32k8")
    assert {"model.num_experts=32", "model.num_experts_per_tok=8", "model.moe_intermediate_size=32"} <= set(
        p.overrides(3))
    groups = plan_groups(grid)
    assert len(groups) == 2 * len(layouts) and all(len(g.points) == 1 for g in groups)


@pytest.fixture
def one_thread():
    """One torch thread in this process, so that the study's runs get one thread whatever --jobs is (the study
    gives each process this process's threads // jobs) and --jobs 1 and 2 run the same arithmetic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_cli_study_writes_report_and_table_of_run_means(tmp_path, capsys, one_thread):
    """Two groups (a cold start each) in two processes, then the same study in this process: equal metrics."""
    out = tmp_path / "study"
    assert main(["study", "volatility", "--config", CONFIG, "--out", str(out), "--jobs", "2", *TINY_STUDY]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    page = (out / "report.html").read_text()
    for png in ("study_depth.png", "study_layers.png", "study_sweeps.png"):
        assert (out / png).stat().st_size > 1000 and png in page
    meta = json.loads((out / "study.json").read_text())
    assert [p["name"] for p in meta["points"]] == ["L1_lr0.01_mb2", "L2_lr0.01_mb2"]

    rows = _table(out)
    assert [r["point"] for r in rows] == ["L1_lr0.01_mb2", "L2_lr0.01_mb2"]
    flips_seen = []
    for r in rows:
        run = out / r["point"] / "seed_0"
        values = _flip_values(run)
        assert len(values) == 2 == int(r["steps"])
        assert float(r["flip_rate"]) == pytest.approx(np.mean(values), abs=1e-12)
        last = int(r["layers"]) - 1
        assert float(r["last_layer"]) == pytest.approx(np.mean(_flip_values(run, f"moe/flip_rate/layer_{last}")))
        flips_seen += values
        assert f"{100 * float(r['flip_rate']):.4g}" in page  # the HTML table shows the same number in percent
    assert max(flips_seen) > 0  # the runs moved the router, so the equalities above compare real numbers

    meta = json.loads((out / "study.json").read_text())
    assert meta["jobs"] == 2 and meta["threads"] == 1

    # the same study with --jobs 1: a run's metrics depend on its config, weights and threads only
    one = tmp_path / "one_job"
    assert main(["study", "volatility", "--config", CONFIG, "--out", str(one), "--jobs", "1", *TINY_STUDY]) == 0
    for r in rows:
        for key in ("moe/flip_rate", "reward/mean", "pg_loss"):
            assert _flip_values(one / r["point"] / "seed_0", key) == _flip_values(out / r["point"] / "seed_0", key)
    capsys.readouterr()

    # a second study into the same directory is refused unless --overwrite
    assert main(["study", "volatility", "--config", CONFIG, "--out", str(out), *TINY_STUDY]) == 2
    assert "holds a previous study" in capsys.readouterr().err


def _fake_run(d, flips, layers):
    d.mkdir(parents=True)
    with (d / "metrics.jsonl").open("w") as f:
        for s, fl in enumerate(flips, 1):
            rec = {"step": s, "moe/flip_rate": fl, "reward/mean": 0.5, "groups/with_variance": 1.0,
                   **{f"moe/flip_rate/layer_{i}": fl * (i + 1) for i in range(layers)}}
            f.write(json.dumps(rec) + "\n")


def test_report_statistics_on_known_metrics(tmp_path):
    """Two seeds with different per-step flips: the table holds the mean over steps and seeds, the seeds' min and
    max of their own means, and per-layer means; not the last step or the largest value."""
    from moe_gspo.report.volatility_study import write_study_report

    points = [{"name": "L2_lr0.001_mb4", "depth": 2, "lr": 1e-3, "minibatches": 4},
              {"name": "L3_lr0.001_mb4", "depth": 3, "lr": 1e-3, "minibatches": 4}]
    flips = {("L2_lr0.001_mb4", 0): [0.01, 0.03, 0.02], ("L2_lr0.001_mb4", 1): [0.05, 0.01, 0.03],
             ("L3_lr0.001_mb4", 0): [0.10, 0.00, 0.02], ("L3_lr0.001_mb4", 1): [0.04, 0.04, 0.04]}
    for (name, seed), fl in flips.items():
        _fake_run(tmp_path / name / f"seed_{seed}", fl, layers=int(name[1]))
    (tmp_path / "study.json").write_text(json.dumps({
        "points": points, "base": {"depth": 2, "lr": 1e-3, "minibatches": 4}, "seeds": [0, 1], "steps": 3,
        "wall_seconds": {"L2_lr0.001_mb4/seed_0": 2.0, "L2_lr0.001_mb4/seed_1": 3.0}, "total_seconds": 10.0}))
    write_study_report(tmp_path)
    rows = {r["point"]: r for r in _table(tmp_path)}
    for name, depth in (("L2_lr0.001_mb4", 2), ("L3_lr0.001_mb4", 3)):
        a, b = flips[(name, 0)], flips[(name, 1)]
        r = rows[name]
        assert float(r["flip_rate"]) == pytest.approx(np.mean(a + b))
        assert float(r["seed_min"]) == pytest.approx(min(np.mean(a), np.mean(b)))
        assert float(r["seed_max"]) == pytest.approx(max(np.mean(a), np.mean(b)))
        assert float(r["last_layer"]) == pytest.approx(depth * np.mean(a + b))  # layer i logs (i + 1) x the rate
        assert int(r["most_volatile_layer"]) == depth - 1
    assert float(rows["L2_lr0.001_mb4"]["wall_s"]) == pytest.approx(5.0)
    assert "48" in (tmp_path / "report.html").read_text()  # the paper's reference depth is named in the caption


def test_report_granularity_figure_and_per_update_rate(tmp_path):
    """Points of a granularity sweep with 2 minibatches: the after-one-update rate is twice the step mean, the
    engine mismatch column is the runs' mean, and the granularity figures are drawn."""
    from moe_gspo.report.volatility_study import write_study_report

    lay = {"L2_lr0.001_mb2": (8, 2, 64), "L2_lr0.001_mb2_E32k4": (32, 4, 32)}
    points = [{"name": n, "depth": 2, "lr": 1e-3, "minibatches": 2, "experts": e, "top_k": k, "expert_width": w}
              for n, (e, k, w) in lay.items()]
    for i, name in enumerate(lay):
        d = tmp_path / name / "seed_0"
        _fake_run(d, [0.01 * (i + 1), 0.03 * (i + 1)], layers=2)
        with (d / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 3, "moe/rollout_train_mismatch": 0.004 * (i + 1)}) + "\n")
    (tmp_path / "study.json").write_text(json.dumps({
        "points": points, "base": {"depth": 2, "lr": 1e-3, "minibatches": 2, "experts": 8, "top_k": 2,
                                   "expert_width": 64},
        "granularity": {"depths": [2], "experts": [8, 32], "top_ks": [2, 4]}, "seeds": [0], "steps": 2,
        "wall_seconds": {}, "total_seconds": 1.0}))
    page = write_study_report(tmp_path).read_text()
    rows = {r["point"]: r for r in _table(tmp_path)}
    for i, name in enumerate(lay):
        r = rows[name]
        assert float(r["per_update"]) == pytest.approx(2 * float(r["flip_rate"]))
        assert float(r["flip_rate"]) == pytest.approx(0.02 * (i + 1))
        assert float(r["mismatch"]) == pytest.approx(0.004 * (i + 1))
        assert (int(r["experts"]), int(r["top_k"]), int(r["expert_width"])) == lay[name]
    for png in ("study_granularity.png", "study_granularity_layers.png"):
        assert (tmp_path / png).stat().st_size > 1000 and png in page


@pytest.mark.parametrize("override, culprit", [
    ("study.experts=[8]", "study.experts=[8] and study.top_ks=[] must both be given"),
    ("study.experts=[8] study.top_ks=[3]", "study.active_width=256 is not a multiple of top-k 3"),
    ("study.top_ks=[0]", "study.top_ks=[0] must be a list of integers >= 1"),
    ("study.depths=[0,2]", "study.depths=[0, 2] must be a non-empty list of integers >= 1"),
    ("study.depths=4", "study.depths=4 must be a list"),
    ("study.lrs=[fast]", "study.lrs: 'fast' is not a number"),
    ("study.seeds=0", "study.seeds=0 must be an integer >= 1"),
    ("study.deepths=[2]", "unknown keys under 'study': ['deepths']"),
    ("study.minibatches=[3]", "point L4_lr0.0003_mb3: rollout batch of 8 prompts x 8 responses"),
])
def test_bad_study_field_is_one_line_error(tmp_path, capsys, override, culprit):
    rc = main(["study", "volatility", "--config", CONFIG, "--out", str(tmp_path / "s"), *override.split()])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("moe-gspo study: error: ") and culprit in err, err
    assert CONFIG in err  # the file the study section came from
    assert not (tmp_path / "s").exists()  # nothing ran
