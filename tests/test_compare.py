"""`moe-gspo compare`: config handling, the report from metrics files (seeds, intervals, verdicts, collapses), and
tiny end-to-end runs: seeds paired across variants, `--jobs 2` equal to `--jobs 1`."""

from __future__ import annotations

import json
import math
import re

import pytest

from moe_gspo.config import ConfigError


def _fake_run(d, clip, flip, rewards, layers=2, wall=12.5, split=None):
    """A run of len(rewards) steps: 4 experts of equal load (top-2, 100 tokens a step), expert e losing 1% x e of
    its slots per step; `split` (bias, gradient) adds the per-layer flip split, layer i at (i + 1) times each."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(json.dumps({"model": {"num_experts_per_tok": 2}}))  # JSON is YAML
    with (d / "metrics.jsonl").open("w") as f:
        for s, r in enumerate(rewards, 1):
            rec = {"step": s, "reward/mean": r, "accuracy": r, "pg_clipfrac": clip,
                   "moe/flip_rate": flip, "moe/rollout_train_mismatch": 0.01, "rollout_probs_diff_mean": 1e-3,
                   **{f"moe/flip_rate/layer_{i}": flip * (i + 1) / layers for i in range(layers)},
                   **{f"moe/churn_out/expert_{e}": 0.01 * e for e in range(4)}, "moe/flip_tokens": 100.0,
                   **{f"moe/load/layer_{i}/expert_{e}": 0.25 for i in range(layers) for e in range(4)}}
            for source, x in zip(("bias", "gradient"), split or ()):
                rec.update({f"moe/flip_rate_from_{source}/layer_{i}": x * (i + 1) for i in range(layers)})
                rec[f"moe/flip_rate_from_{source}"] = x * (layers + 1) / 2
            if s == 2:
                rec["pg_clipfrac"] = 0.0  # a step with nothing clipped must not break the log scale
            f.write(json.dumps(rec) + "\n")
    (d / "wall_time.json").write_text(json.dumps({"seconds": wall}))


def _text(report):
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", report.read_text()))


def test_report_with_seeds_intervals_verdicts_and_collapses(tmp_path):
    """3 seeds: gspo ends 0.2 above grpo at every seed (distinguishable), grpo_r2 equals grpo up to +-0.01
    (not distinguishable), and one grpo_r2 seed collapses."""
    from moe_gspo.report.stats import t_interval
    from moe_gspo.report.compare import write_compare_report
    from moe_gspo.report.compare_data import load_variants, run_walls, summary_rows, variant_stats
    from moe_gspo.config import CompareConfig

    seeds = [0, 1, 2]
    level = {0: 0.3, 1: 0.5, 2: 0.4}  # seed-level spread shared by the variants of a seed
    for s in seeds:
        grpo = [level[s]] * 30
        _fake_run(tmp_path / "grpo" / f"seed_{s}", clip=0.002, flip=0.05, rewards=grpo)
        _fake_run(tmp_path / "gspo" / f"seed_{s}", clip=0.2, flip=0.04, rewards=[x + 0.2 for x in grpo])
        r2 = [x + 0.01 * (s - 1) for x in grpo]
        if s == 1:
            r2 = r2[:12] + [0.0] * 18  # falls to 0 at step 13 for good
        _fake_run(tmp_path / "grpo_r2" / f"seed_{s}", clip=0.002, flip=0.05, rewards=r2)
    (tmp_path / "compare.json").write_text(json.dumps({"variants": {"grpo": [], "grpo_r2": [], "gspo": []},
                                                       "seeds": seeds, "settings": {"final_window": 10}}))
    report = write_compare_report(tmp_path, ["grpo", "grpo_r2", "gspo"])
    text = _text(report)
    for png in ("compare_reward.png", "compare_reward_seeds.png", "compare_clipfrac.png", "compare_mismatch.png",
                "compare_flip_rate.png", "compare_flip_layers.png", "compare_churn.png", "volatility_heatmap.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
        assert png in report.read_text()
    assert "compare_accuracy.png" not in report.read_text() and "equals the mean reward" in text  # 0/1 rewards
    assert "gspo higher than grpo" in text
    assert "3 seeds per variant" in text and "Student-t" in text

    variants = load_variants(tmp_path, ["grpo", "grpo_r2", "gspo"], seeds)
    base, stats = variant_stats(variants, CompareConfig())
    assert base == "grpo"
    assert stats["gspo"].diff.mean == pytest.approx(0.2) and stats["gspo"].diff.lo > 0
    assert stats["gspo"].final.mean == pytest.approx(0.6)
    assert stats["gspo"].final.lo == pytest.approx(t_interval([0.5, 0.7, 0.6]).lo)  # the seeds' spread
    assert [bool(c) for c in stats["grpo_r2"].collapses] == [False, True, False]
    assert stats["grpo_r2"].verdict == "not distinguishable at this budget"  # the collapse drags one seed to 0
    rows = {r[0]: r for r in summary_rows(variants, stats, base, run_walls(variants))}
    assert rows["grpo_r2"][6] == "1/3" and rows["grpo"][6] == "0/3"
    assert math.isclose(rows["gspo"][8], (0.2 * 29 / 30) / (0.002 * 29 / 30))  # clip fraction ratio = 100
    assert rows["grpo"][-1] == pytest.approx(3 * 12.5)  # wall time of all seeds, from wall_time.json
    assert "step 15" in text  # where the 5-step average fell below half its peak (0.2 < 0.25), in the runs table
    # the terminal summary puts each variant's flip rate and engine mismatch (percent, 95% t) beside its reward
    from moe_gspo.report.compare_data import summary_lines
    head, *lines = summary_lines(tmp_path)
    assert "flip rate % [95% t]" in head and "engine mismatch % [95% t]" in head
    by_name = {ln.split()[0]: ln for ln in lines}
    assert "5.00 [5.00, 5.00]" in by_name["grpo"] and "4.00 [4.00, 4.00]" in by_name["gspo"]
    assert all("1.00 [1.00, 1.00]" in ln for ln in lines)  # moe/rollout_train_mismatch 0.01 in every run


def _write_config(run_dir, model=None, train=None, **algorithm):
    """A run's config.yaml with the fields the settings table reads; `model`, `train`: fields to add or replace."""
    import yaml

    cfg = {"model": {"family": "qwen3_moe", "num_hidden_layers": 8, "hidden_size": 64, "num_experts": 8,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 128, "num_attention_heads": 4,
                     "params_dtype": "float32", "shared_expert_intermediate_size": 0, **(model or {})},
           "rollout": {"engine": "hf", "engine_dtype": "bfloat16", "task": "column_addition",
                       "task_args": "min_digits=4,max_digits=6", "prompts_per_step": 8, "group_size": 8,
                       "max_new_tokens": 68, "temperature": 1.0},
           "train": {"steps": 30, "lr": 3e-4, "lr_decay": "constant", "lr_warmup_steps": 0, "minibatches": 8,
                     "micro_batch_size": 8, "adam_beta1": 0.9, "adam_beta2": 0.999, "weight_decay": 0.0,
                     "grad_clip": 1.0, "cold_start_steps": 800, "cold_start_lr": 3e-3, "cold_start_batch_size": 32,
                     "router_bias_update_rate": 0.0, **(train or {})},
           "algorithm": {"loss": "grpo", "clip_low": None, "clip_high": None, "routing_replay": "off",
                         "use_engine_logprobs": False, "loss_agg_mode": "seq-mean-token-mean", "kl_beta": 0.0,
                         **algorithm}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_settings_table_gives_the_clip_ranges_actually_used(tmp_path):
    """Shared settings once, the settings that differ by variant in their own columns; a clip range left to the
    loss resolves to its registered default, an explicit one is shown as set."""
    from moe_gspo.report.compare import write_compare_report
    from moe_gspo.report.compare_settings import settings_tables

    algos = {"grpo": {}, "grpo_r2": {"routing_replay": "r2"}, "gspo": {"loss": "gspo"},
             "gspo_wide": {"loss": "gspo", "clip_low": 0.001, "clip_high": 0.002}}
    for name, algo in algos.items():
        for s in (0, 1):
            d = tmp_path / name / f"seed_{s}"
            _fake_run(d, clip=0.01, flip=0.02, rewards=[0.3] * 6)
            _write_config(d, **algo)
    report = write_compare_report(tmp_path, list(algos))
    from moe_gspo.report.compare_data import load_variants

    shared, header, rows = settings_tables(load_variants(tmp_path, list(algos)))
    shared = dict(shared)
    assert shared["model"].startswith("8 MoE layers, hidden 64, 8 routed experts (top-2)")
    assert shared["minibatches per rollout batch"].startswith("8 optimizer steps")
    assert shared["precision"] == "trainer float32, rollout engine hf in bfloat16"
    assert shared["seeds"] == "2 paired seeds (0, 1)"
    assert header == ["variant", "loss", "clip range used (low, high)", "routing replay"]
    by = {r[0]: r for r in rows}
    assert by["grpo"][2] == "(0.2, 0.27) loss default" and by["grpo_r2"][3] == "r2"
    assert by["gspo"][2] == "(0.0003, 0.0004) loss default" and by["gspo_wide"][2] == "(0.001, 0.002)"
    text = _text(report)
    assert "Run settings" in text and "column_addition (min_digits=4,max_digits=6)" in text


def _captured_figures(monkeypatch):
    """Figures the report draws, kept open (every module saves through plots._save)."""
    import moe_gspo.report.compare_figures as compare_mod
    import moe_gspo.report.plots as plots_mod

    figs = {}
    save = plots_mod._save

    def keep(fig, path):
        fig.canvas.draw()
        figs[path.name] = fig
        save(fig, path)
        return path

    monkeypatch.setattr(plots_mod, "_save", keep)
    monkeypatch.setattr(compare_mod, "_save", keep)
    return figs


def test_curves_smoothed_alike_with_raw_faint_and_legends_outside(tmp_path, monkeypatch):
    """Every per-step figure of the report draws, per variant, the raw mean over seeds faint and its trailing
    moving average bold (log-scale figures too), and no legend overlaps a plotting area."""
    import numpy as np

    from moe_gspo.report.stats import smooth

    figs = _captured_figures(monkeypatch)
    from moe_gspo.report.compare import write_compare_report

    rng = np.random.default_rng(0)
    for name in ("grpo", "gspo", "grpo_r2"):
        for s in (0, 1, 2):
            _fake_run(tmp_path / name / f"seed_{s}", clip=0.01 + 0.001 * s, flip=0.02,
                      rewards=list(rng.uniform(0.2, 0.6, 20)))
    (tmp_path / "compare.json").write_text(json.dumps({"seeds": [0, 1, 2], "settings": {"smooth_window": 4}}))
    write_compare_report(tmp_path, ["grpo", "gspo", "grpo_r2"])
    from moe_gspo.report.compare_data import load_variants

    grpo = load_variants(tmp_path, ["grpo"], [0, 1, 2])[0]
    for png, key, scale in (("compare_reward.png", "reward/mean", 1), ("compare_clipfrac.png", "pg_clipfrac", 1),
                            ("compare_flip_rate.png", "moe/flip_rate", 100)):  # flip rates in percent
        ax = figs[png].axes[0]
        faint = [ln for ln in ax.lines if (ln.get_alpha() or 1.0) < 0.5]
        bold = [ln for ln in ax.lines if (ln.get_alpha() or 1.0) >= 0.5]
        assert len(faint) == len(bold) == 3, png
        _, Y = grpo.matrix(key)
        raw = scale * Y.mean(0)
        np.testing.assert_allclose(np.nan_to_num(faint[0].get_ydata()), np.where(raw > 0, raw, 0), err_msg=png)
        want = smooth(raw, 4)
        np.testing.assert_allclose(np.nan_to_num(bold[0].get_ydata()), np.where(want > 0, want, 0), err_msg=png)
    assert {"compare_reward_seeds.png", "compare_flip_layers.png", "compare_churn.png"} <= set(figs)
    for name, fig in figs.items():
        boxes = [ax.get_window_extent() for ax in fig.axes if ax.axison]
        legends = [ax.get_legend() for ax in fig.axes] + list(fig.legends)
        for leg in (lg for lg in legends if lg is not None):
            lb = leg.get_window_extent()
            assert not any(lb.overlaps(b) for b in boxes), f"{name}: a legend overlaps a plotting area"


def test_layer_profile_and_churn_average_runs_then_seeds(tmp_path):
    """Per layer, each run's mean over steps, then the mean over seeds with a t-band; per expert, counts pooled over
    steps and seeds (equal loads here, so the logged ratio itself)."""
    import numpy as np

    from moe_gspo.report.stats import band
    from moe_gspo.report.compare_data import expert_churn, layer_profile, load_variants
    from moe_gspo.report.volatility import CHURN_OUT

    for s, flip in enumerate((0.01, 0.02, 0.04, 0.5)):
        _fake_run(tmp_path / "grpo" / f"seed_{s}", clip=0.01, flip=flip, rewards=[0.3] * 5, layers=4)
    d = tmp_path / "grpo" / "seed_3"  # no group with reward variance at any step: no gradient, left out
    lines = [{**json.loads(x), "groups/with_variance": 0.0} for x in (d / "metrics.jsonl").read_text().splitlines()]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    v = load_variants(tmp_path, ["grpo"])[0]
    assert len(v.runs) == 4
    layers, mean, lo, hi = layer_profile(v)
    assert layers == [0, 1, 2, 3]
    per_seed = np.array([[f * (i + 1) / 4 for i in range(4)] for f in (0.01, 0.02, 0.04)])
    np.testing.assert_allclose(mean, per_seed.mean(0))
    np.testing.assert_allclose(lo, np.maximum(band(per_seed)[1], 0))  # a rate's band is cut at 0
    np.testing.assert_allclose(hi, band(per_seed)[2])
    assert np.all(np.diff(mean) > 0) and np.all(lo < mean) and np.all(mean < hi)
    assert expert_churn(v, CHURN_OUT) == (pytest.approx({e: 0.01 * e for e in range(4)}), [])
    assert layer_profile(load_variants(tmp_path, ["grpo"], [3])[0])[0] == []


def test_clip_ratio_is_paired_by_seed_over_steps_with_gradient(tmp_path):
    """GSPO clips 100x GRPO's fraction at every seed on the steps that carry gradient; steps without reward
    variance (clip fraction 0 there) are left out, and the paired geometric mean is exactly 100 with a zero-width
    interval."""
    from moe_gspo.report.compare_data import load_variants, metric_rows, run_mean

    for s in (0, 1, 2):
        for name, clip in (("grpo", 0.001 * (s + 1)), ("gspo", 0.1 * (s + 1))):
            d = tmp_path / name / f"seed_{s}"
            _fake_run(d, clip=clip, flip=0.02, rewards=[0.4] * 6)
            lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            for rec in lines:
                dead = rec["step"] >= 5  # the last two steps: every group has the same reward
                rec["groups/with_variance"] = 0.0 if dead else 0.5
                rec["pg_clipfrac"] = 0.0 if dead else clip
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    variants = load_variants(tmp_path, ["grpo", "gspo"])
    grpo0 = variants[0].runs[0]
    assert run_mean(grpo0, "pg_clipfrac", only_with_gradient=True) == pytest.approx(0.001)
    assert run_mean(grpo0, "pg_clipfrac") == pytest.approx(0.001 * 4 / 6)
    from moe_gspo.config import CompareConfig
    from moe_gspo.report.compare_data import run_rows, variant_stats

    _, stats = variant_stats(variants, CompareConfig())
    assert [r[5] for r in run_rows(variants, stats, {})] == ["4/6"] * 6  # steps 5 and 6 carry no gradient
    rows = {r[0]: r for r in metric_rows(variants, "grpo")}
    assert rows["grpo"][2] == "1" and rows["gspo"][2] == "100 [100, 100]"
    assert rows["gspo"][3].startswith("2.00 [2.00, 2.00]")  # the flip rate, in percent


def test_report_of_one_seed_says_there_is_no_interval(tmp_path):
    from moe_gspo.report.compare import write_compare_report

    _fake_run(tmp_path / "grpo", clip=0.002, flip=0.05, rewards=[0.3 + 0.01 * s for s in range(6)])
    _fake_run(tmp_path / "gspo", clip=0.2, flip=0.04, rewards=[0.3 + 0.01 * s for s in range(6)])
    report = write_compare_report(tmp_path, ["grpo", "gspo"])
    text = _text(report)
    assert "one seed per variant: no intervals" in text and "1 seed: no interval, cannot tell" in text
    assert "no confidence band" in text and "compare_reward_seeds.png" not in report.read_text()
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
    p.write_text("compare: {seeds: 0}\n")
    with pytest.raises(ConfigError, match="compare.seeds=0"):
        read_compare_config(p)
    p.write_text("compare: {jobs: 0}\n")
    with pytest.raises(ConfigError, match="compare.jobs=0"):
        read_compare_config(p)
    p.write_text("compare: {collapse_fraction: 2}\n")
    with pytest.raises(ConfigError, match="compare.collapse_fraction=2"):
        read_compare_config(p)
    p.write_text("train: {steps: 2}\ncompare: {seeds: 2}\n")
    base, variants, settings = read_compare_config(p, ["train.lr=0.5", "compare.seeds=4"])
    assert variants == DEFAULT_VARIANTS and base["train"] == {"steps": 2, "lr": 0.5} and settings.seeds == 4
    with pytest.raises(ConfigError, match="config file not found"):
        read_compare_config(tmp_path / "missing.yaml")


def test_cold_start_shared_only_where_it_is_the_same(tmp_path):
    from moe_gspo.experiments.compare import plan_jobs

    base = {"train": {"seed": 3, "cold_start_steps": 5}}
    same = {"a": ["algorithm.loss=grpo", "train.lr=0.1"], "b": ["algorithm.loss=gspo"]}
    jobs, files = plan_jobs(tmp_path, base, same, [3, 4])
    assert [(j.label, j.init.name) for j in jobs] == [
        ("a/seed_3", "seed_3.safetensors"), ("b/seed_3", "seed_3.safetensors"),
        ("a/seed_4", "seed_4.safetensors"), ("b/seed_4", "seed_4.safetensors")]
    assert [c.train.seed for c in files.values()] == [3, 4]
    deeper = {"a": [], "deep": ["model.num_hidden_layers=6"]}  # another model needs its own cold start
    jobs, files = plan_jobs(tmp_path, base, deeper, [3])
    assert [j.init.name for j in jobs] == ["seed_3_a.safetensors", "seed_3_deep.safetensors"]


SMALL = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
         "model.num_key_value_heads=1", "model.head_dim=16", "model.num_experts=4", "model.moe_intermediate_size=32",
         "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3", "train.minibatches=2",
         "train.micro_batch_size=4", "train.steps=3", "train.checkpoint_every=0", "logging.progress=false",
         "logging.tensorboard=false", "rollout.task_args=max_digits=1,num_operands=2", "train.cold_start_steps=40",
         "train.cold_start_lr=0.01", "rollout.engine_dtype=float32"]


def _records(run_dir):
    from helpers import records, strip_timing

    return [strip_timing(r) for r in records(run_dir)]


def test_seeds_and_jobs_end_to_end(tmp_path, monkeypatch, capsys):
    """2 variants x 2 seeds, 3 steps, run one at a time in this process and then two at a time in separate
    processes: every metric (timings aside) is equal. Seeds are paired: one seed's first rollouts are the same in
    both variants, and the two seeds differ. Then --resume on both directories: an interrupted run is redone and
    reproduces the original, a larger --seeds adds a seed, a thread-count change is warned about, and a config
    change decides what is kept."""
    from moe_gspo.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["compare", "--config", "configs/compare_tiny_cpu.yaml", "--only", "grpo_r3,gspo", "--seeds", "2", *SMALL]
    assert main([*args, "--out", str(tmp_path / "seq"), "--jobs", "1"]) == 0
    assert main([*args, "--out", str(tmp_path / "par"), "--jobs", "2"]) == 0
    info = json.loads((tmp_path / "par" / "compare.json").read_text())
    assert list(info["variants"]) == ["grpo_r3", "gspo"] and info["seeds"] == [0, 1] and info["jobs"] == 2
    assert json.loads((tmp_path / "seq" / "compare.json").read_text())["jobs"] == 1  # --jobs wins over the YAML
    assert (tmp_path / "par" / "cold_start" / "seed_1.safetensors").is_file()
    seq = {(v, s): _records(tmp_path / "seq" / v / f"seed_{s}") for v in ("grpo_r3", "gspo") for s in (0, 1)}
    par = {(v, s): _records(tmp_path / "par" / v / f"seed_{s}") for v in ("grpo_r3", "gspo") for s in (0, 1)}
    assert seq == par
    # the runs learn something, or equality would be trivial
    assert any(r["grad_norm"] > 0 for rs in seq.values() for r in rs)
    for s in (0, 1):  # paired: same cold start, prompts and sampling in step 1 of one seed
        assert seq["grpo_r3", s][0]["reward/mean"] == seq["gspo", s][0]["reward/mean"]
        assert seq["grpo_r3", s][0]["moe/rollout_train_mismatch"] == 0.0  # fp32 engine routes like the trainer
    assert seq["gspo", 0][0] != seq["gspo", 1][0]
    text = _text(tmp_path / "par" / "report.html")
    assert "2 seeds per variant" in text and "gspo" in text
    # the terminal ends with the answer, then the report's path
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"report: {tmp_path / 'par' / 'report.html'}", out
    head, gr, gs = out[-4:-1]
    assert head.split()[:3] == ["variant", "seeds", "final"] and "minus grpo_r3, paired [95% t]" in head, head
    assert head.split()[-2:] == ["Fisher", "p"], head
    assert gr.startswith("grpo_r3") and "baseline" in gr and gr.endswith("/2"), gr  # no Fisher p for the baseline
    assert gs.startswith("gspo ") and gs.split()[-2].endswith("/2") and "[" in gs, gs
    assert 0 <= float(gs.split()[-1]) <= 1, gs  # Fisher's exact p of the collapse counts against the baseline
    # a second comparison into the same directory is refused unless told to replace or to complete the first
    assert main([*args, "--out", str(tmp_path / "seq"), "--jobs", "1"]) == 2
    assert main([*args, "--out", str(tmp_path / "seq"), "--resume", "--overwrite"]) == 2

    # --resume of an interrupted comparison (one run without its wall_time.json, its metrics cut short): only that
    # run is redone, in a --jobs process, and it reproduces the original; the finished runs are not touched
    cut = tmp_path / "par" / "gspo" / "seed_1"
    (cut / "wall_time.json").unlink()
    (cut / "metrics.jsonl").write_text((cut / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    kept = [tmp_path / "par" / "grpo_r3" / "seed_0" / "metrics.jsonl", tmp_path / "par" / "cold_start" / "seed_1.json"]
    stamps = [p.stat().st_mtime_ns for p in kept]
    assert main([*args, "--out", str(tmp_path / "par"), "--jobs", "2", "--resume"]) == 0
    assert _records(cut) == seq["gspo", 1] and [p.stat().st_mtime_ns for p in kept] == stamps

    # --resume with more seeds adds only the new seed's cold start and runs (in this process), paired as before
    stamp = (tmp_path / "seq" / "cold_start" / "seed_0.json").stat().st_mtime_ns
    assert main([*args, "--out", str(tmp_path / "seq"), "--jobs", "1", "--resume", "--seeds", "3"]) == 0
    info = json.loads((tmp_path / "seq" / "compare.json").read_text())
    assert (tmp_path / "seq" / "cold_start" / "seed_0.json").stat().st_mtime_ns == stamp
    assert info["seeds"] == [0, 1, 2] and set(info["wall_seconds"]) == {f"{v}/seed_{s}" for v in ("grpo_r3", "gspo")
                                                                        for s in (0, 1, 2)}
    assert {(v, s): _records(tmp_path / "seq" / v / f"seed_{s}") for v in ("grpo_r3", "gspo") for s in (0, 1)} == seq
    new = {v: _records(tmp_path / "seq" / v / "seed_2") for v in ("grpo_r3", "gspo")}
    assert len(new["gspo"]) == 3 and new["gspo"][0]["reward/mean"] == new["grpo_r3"][0]["reward/mean"]
    assert "3 seeds per variant" in _text(tmp_path / "seq" / "report.html")

    # a resumed run with another thread count than the kept ones is run, with a warning that they round differently
    import torch

    (tmp_path / "seq" / "gspo" / "seed_2" / "wall_time.json").unlink()
    capsys.readouterr()
    before = torch.get_num_threads()
    kept = json.loads((tmp_path / "seq" / "gspo" / "seed_1" / "wall_time.json").read_text())["threads"]
    torch.set_num_threads(kept + 1)  # whatever OMP_NUM_THREADS the suite runs under
    try:
        assert main([*args, "--out", str(tmp_path / "seq"), "--jobs", "1", "--resume", "--seeds", "3"]) == 0
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert "keeping 3 of 3 cold start(s) and 5 of 6 runs" in err, err
    assert f"the kept runs ran with {kept} thread(s) each and the 1 new one(s) run with {kept + 1}" in err, err
    assert json.loads((tmp_path / "seq" / "gspo" / "seed_2" / "wall_time.json").read_text())["threads"] == kept + 1

    # what --resume keeps depends on the config: an RL-only change keeps the cold starts and redoes the runs; a
    # cold-start change redoes both
    from moe_gspo.experiments.compare import plan_jobs, read_compare_config, reusable_work

    def kept_after(*change):
        base, variants, _ = read_compare_config("configs/compare_tiny_cpu.yaml", [*SMALL, *change])
        variants = {v: variants[v] for v in ("grpo_r3", "gspo")}
        return reusable_work(*plan_jobs(tmp_path / "seq", base, variants, [0, 1, 2]), base)

    cold, runs = kept_after()
    assert len(cold) == 3 and len(runs) == 6
    cold, runs = kept_after("train.lr=0.002")
    assert len(cold) == 3 and runs == {}
    cold, runs = kept_after("train.cold_start_steps=41")
    assert cold == {} and runs == {}
    # a damaged record counts as unfinished: its work is redone, not refused
    (tmp_path / "seq" / "grpo_r3" / "seed_0" / "wall_time.json").write_text("{")
    (tmp_path / "seq" / "cold_start" / "seed_1.json").write_text("")
    capsys.readouterr()
    cold, runs = kept_after()
    assert sorted(cold) == ["seed_0.safetensors", "seed_2.safetensors"]
    assert sorted(runs) == ["grpo_r3/seed_2", "gspo/seed_0", "gspo/seed_2"]
    said = "".join(capsys.readouterr())  # and says why each is redone
    assert "redoing the cold start seed_1.safetensors: its record is damaged (JSONDecodeError" in said, said
    assert "redoing grpo_r3/seed_0: its record is damaged (JSONDecodeError" in said, said


def test_compare_cli_errors(tmp_path, capsys):
    from moe_gspo.cli import main

    base = ["compare", "--config", "configs/compare_tiny_cpu.yaml", "--out", str(tmp_path / "c")]
    for extra, msg in [(["--seeds", "0"], "--seeds=0 must be >= 1"), (["--jobs", "0"], "--jobs=0 must be >= 1"),
                       (["--only", "nope"], "--only ['nope']: not among the variants"),
                       (["compare.final_window=0"], "compare.final_window=0 must be > 0")]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("moe-gspo compare: error: ") and msg in err[0], err


def test_report_shows_the_expert_load_beside_the_flip_rate(tmp_path):
    """Runs that log the tracker's expert load get an 'Expert load' table: per variant the flip rate, the load
    max/mean and entropy (each run's mean over steps with gradient, then the mean over seeds) and the per-layer
    means; runs without load metrics get no such section."""
    from moe_gspo.report.compare import write_compare_report
    from moe_gspo.report.compare_data import load_rows, load_variants

    for s, shift in ((0, 0.0), (1, 0.2)):
        d = tmp_path / "grpo" / f"seed_{s}"
        _fake_run(d, clip=0.002, flip=0.05, rewards=[0.5] * 4)
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        for i, r in enumerate(rows):
            r["groups/with_variance"] = 0.0 if i == 0 else 1.0  # step 1 has no gradient: left out of the means
            per_layer = [1.5 + shift + i + layer for layer in range(2)] if i else [100.0, 100.0]
            r.update({f"moe/load_max_over_mean/layer_{j}": v for j, v in enumerate(per_layer)},
                     **{f"moe/load_entropy/layer_{j}": 0.9 - 0.1 * j for j in range(2)})
            r["moe/load_max_over_mean"], r["moe/load_entropy"] = sum(per_layer) / 2, 0.85
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "compare.json").write_text(json.dumps({"variants": {"grpo": []}, "seeds": [0, 1]}))
    (row,) = load_rows(load_variants(tmp_path, ["grpo"], [0, 1]))
    # seed 0, steps 2-4: whole-model 3, 4, 5 -> 4.0 (layer 0: 3.5, layer 1: 4.5); seed 1: each + 0.2
    assert row[0] == "grpo" and row[1].startswith("5.00")
    assert row[2].startswith("4.1 [") and row[3] == "0.85 [0.85, 0.85]"
    assert row[4] == "3.600 4.600" and row[5] == "0.900 0.800"
    text = _text(write_compare_report(tmp_path, ["grpo"]))
    assert "Expert load" in text and "3.600 4.600" in text
    for f in (tmp_path / "grpo").glob("seed_*/metrics.jsonl"):
        f.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if "load" not in k}) + "\n"
                             for x in f.read_text().splitlines()))
    assert "Expert load" not in _text(write_compare_report(tmp_path, ["grpo"]))


def test_report_shows_multi_turn_episodes_by_turn(tmp_path):
    """Runs of episodes with tools get a by-turn table: per variant and turn, the mean over seeds of each run's
    step mean of the sampled and tool tokens, and the flip rate and engine mismatch in percent; runs without such
    metrics get no table."""
    from moe_gspo.report.compare import write_compare_report
    from moe_gspo.report.compare_data import load_variants, turn_rows

    for s in (0, 1):
        d = tmp_path / "grpo" / f"seed_{s}"
        _fake_run(d, clip=0.002, flip=0.05, rewards=[0.5] * 4)
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        for i, r in enumerate(rows):
            r.update({"multiturn/response_tokens/turn_0": 10.0 + i + s, "multiturn/tool_tokens/turn_0": 4.0,
                      "moe/flip_rate/turn_0": 0.01, "moe/rollout_train_mismatch/turn_0": 0.0})
            if i:  # the second turn from step 2 on
                r.update({"multiturn/response_tokens/turn_1": 6.0, "moe/flip_rate/turn_1": 0.03 * s})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "compare.json").write_text(json.dumps({"variants": {"grpo": []}, "seeds": [0, 1]}))
    rows = turn_rows(load_variants(tmp_path, ["grpo"], [0, 1]))
    # turn 0: steps 1-4 give 10..13 (seed 0) and 11..14 (seed 1): means 11.5 and 12.5 -> 12.0
    assert rows == [["grpo", "0", "12.0", "4.0", "1.00", "0.00"], ["grpo", "1", "6.0", "", "1.50", ""]]
    text = _text(write_compare_report(tmp_path, ["grpo"]))
    assert "Multi-turn episodes, by turn" in text and "12.0" in text
    for f in (tmp_path / "grpo").glob("seed_*/metrics.jsonl"):
        f.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if "turn_" not in k}) + "\n"
                             for x in f.read_text().splitlines()))
    assert "Multi-turn episodes" not in _text(write_compare_report(tmp_path, ["grpo"]))


def _rewrite(run_dir, edit):
    """Apply edit(record) to every record of run_dir/metrics.jsonl."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        edit(r)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _table_after(page: str, marker: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the first table after `marker` in the HTML, cells unescaped."""
    import html as html_mod

    found = re.search(r"<table[^>]*>(.*?)</table>", page[page.index(marker):])
    assert found, f"no table after {marker}"
    t = found.group(1)
    header = [html_mod.unescape(h) for h in re.findall(r"<th>(.*?)</th>", t)]
    rows = [[html_mod.unescape(c) for c in re.findall(r"<td>(.*?)</td>", tr)]
            for tr in re.findall(r"<tr>(.*?)</tr>", t.split("<tbody>")[1])]
    return header, rows


def test_flip_split_has_a_table_per_layer_beside_its_figure(tmp_path):
    """Variants whose runs log the flip split get two columns each (bias, gradient) in a table right after the split
    figure, one row per MoE layer and one over all layers, in percent: the mean over seeds of each run's mean."""
    from moe_gspo.report.compare import write_compare_report

    for s, (bias, grad) in enumerate(((0.001, 0.004), (0.003, 0.008))):
        _fake_run(tmp_path / "dsv3" / f"seed_{s}", clip=0.01, flip=0.02, rewards=[0.3] * 4, layers=3,
                  split=(bias, grad))
        _fake_run(tmp_path / "grpo" / f"seed_{s}", clip=0.01, flip=0.02, rewards=[0.3] * 4, layers=3)
    page = write_compare_report(tmp_path, ["grpo", "dsv3"]).read_text()
    fig = page.index("compare_flip_sources.png")
    header, rows = _table_after(page, "compare_flip_sources.png")
    assert page.index("<table", fig) < page.index("compare_churn.png")  # the table sits beside its figure
    assert header == ["MoE layer", "dsv3: bias %", "dsv3: gradient %"]  # grpo has no split: no columns
    assert [r[0] for r in rows] == ["0", "1", "2", "all"]
    for i in range(3):  # _fake_run: layer i at (i + 1) x the run's rate; the mean over the two seeds
        assert float(rows[i][1]) == pytest.approx(100 * (i + 1) * (0.001 + 0.003) / 2, abs=5e-3)
        assert float(rows[i][2]) == pytest.approx(100 * (i + 1) * (0.004 + 0.008) / 2, abs=5e-3)
    assert float(rows[3][2]) == pytest.approx(100 * 2 * (0.004 + 0.008) / 2, abs=5e-3)  # overall: (L + 1) / 2


def test_per_layer_figures_tick_whole_layers_in_the_variants_colors(tmp_path, monkeypatch):
    """The per-layer figures tick MoE layers 0, 1, 2 only, and draw each variant in its color of the per-step
    figures, also when the first variant logs nothing per layer; the flip split tells its sources apart by line
    style, not by another variant's color; the churn bars use the variants' colors too."""
    from matplotlib.colors import to_rgba

    figs = _captured_figures(monkeypatch)
    from moe_gspo.report.compare import write_compare_report

    for s in (0, 1):
        _fake_run(tmp_path / "grpo" / f"seed_{s}", clip=0.01, flip=0.02, rewards=[0.3] * 4, layers=0)
        for name, split in (("dsv3", (0.001, 0.004)), ("dsv3_fast", (0.01, 0.004))):
            _fake_run(tmp_path / name / f"seed_{s}", clip=0.01, flip=0.02, rewards=[0.3] * 4, layers=3, split=split)
    write_compare_report(tmp_path, ["grpo", "dsv3", "dsv3_fast"])
    steps = figs["compare_flip_rate.png"].axes[0]
    color = {ln.get_label().split(" (")[0]: to_rgba(ln.get_color()) for ln in steps.lines
             if not ln.get_label().startswith("_")}
    assert set(color) == {"grpo", "dsv3", "dsv3_fast"} and len(set(color.values())) == 3
    for png in ("compare_flip_layers.png", "compare_flip_sources.png"):
        ax = figs[png].axes[0]
        lo, hi = ax.get_xlim()
        assert [t for t in ax.get_xticks() if lo <= t <= hi] == [0, 1, 2], png
        lines = [ln for ln in ax.lines if not ln.get_label().startswith("_")]
        assert lines, png
        for ln in lines:
            name = ln.get_label().split(",")[0]
            assert to_rgba(ln.get_color()) == color[name], (png, ln.get_label())
    sources = [ln for ln in figs["compare_flip_sources.png"].axes[0].lines if not ln.get_label().startswith("_")]
    assert sorted(ln.get_label() for ln in sources) == ["dsv3, bias", "dsv3, gradient", "dsv3_fast, bias",
                                                        "dsv3_fast, gradient"]
    assert len({(ln.get_label().split(",")[0], ln.get_linestyle()) for ln in sources}) == 4  # sources: by style
    for ax in figs["compare_churn.png"].axes:
        for bars in ax.containers:
            assert {to_rgba(b.get_facecolor()) for b in bars} == {color[bars.get_label()]}


def test_settings_name_family_shared_experts_grouped_routing_latent_attention_and_bias_rate(tmp_path):
    """The settings table names the model family, the shared experts (how many, or none), n_group/topk_group where
    set, latent attention where used and the router's bias update rate, and says that dense layers and shared
    experts are not in the flip rates."""
    from moe_gspo.report.compare import write_compare_report
    from moe_gspo.report.compare_data import load_variants
    from moe_gspo.report.compare_settings import settings_tables

    models = {"qwen": ({}, {}),
              "qwen2": ({"family": "qwen2_moe", "shared_expert_intermediate_size": 512}, {}),
              "dsv3": ({"family": "deepseek_v3", "num_hidden_layers": 4, "num_key_value_heads": 4,
                        "first_k_dense_replace": 1, "intermediate_size": 256, "shared_expert_intermediate_size": 256,
                        "n_group": 4, "topk_group": 2, "kv_lora_rank": 32, "q_lora_rank": 0,
                        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16},
                       {"router_bias_update_rate": 0.001})}
    for name, (model, train) in models.items():
        d = tmp_path / name / "seed_0"
        _fake_run(d, clip=0.01, flip=0.02, rewards=[0.3] * 4)
        _write_config(d, model, train)
    shared, header, rows = settings_tables(load_variants(tmp_path, list(models)))
    by = {r[0]: dict(zip(header, r)) for r in rows}
    assert by["qwen"]["model family"] == "qwen3_moe" and by["dsv3"]["model family"] == "deepseek_v3"
    assert by["qwen"]["shared experts"] == "none"
    assert by["qwen2"]["shared experts"] == "1 (FFN width 512 in all, sigmoid-gated), not routed"
    assert by["dsv3"]["shared experts"] == "2 (FFN width 256 in all), not routed"  # 256 / expert FFN 128
    assert by["dsv3"]["grouped routing"].startswith("n_group 4, topk_group 2")
    assert by["qwen"]["grouped routing"] == "none"
    assert by["dsv3"]["attention"].startswith("multi-head latent attention (MLA)")
    assert "key/value rank 32" in by["dsv3"]["attention"]
    assert by["qwen"]["attention"].startswith("grouped-query attention")
    assert by["dsv3"]["router bias update rate"] == "0.001 per optimizer step"
    assert by["qwen"]["router bias update rate"] == "0 (no expert-bias update)"
    assert by["dsv3"]["model"].startswith("4 layers (the first 1 dense)")
    text = _text(write_compare_report(tmp_path, list(models)))
    assert "dense layers and shared experts have no routing, so they are excluded" in text
    # a setting no variant uses has no row
    shared, header, _ = settings_tables(load_variants(tmp_path, ["qwen"]))
    assert "grouped routing" not in [k for k, _ in shared] + header


def test_expert_churn_pools_counts_so_a_tiny_denominator_cannot_dominate(tmp_path):
    """Expert 3 holds 1 slot at step 1 and gains 40 there (a ratio of 40), and 100 slots at the other steps with 2%
    gained: pooled, its churn is 48 / 401 slots, not the mean of the ratios (about 8). Expert 2 holds 1 slot in the
    whole run: fewer than MIN_CHURN_SLOTS, so it is left out, and the report says so."""
    from moe_gspo.report.compare import write_compare_report
    from moe_gspo.report.compare_data import expert_churn, load_variants
    from moe_gspo.report.volatility import CHURN_IN, MIN_CHURN_SLOTS

    d = tmp_path / "grpo" / "seed_0"
    _fake_run(d, clip=0.01, flip=0.02, rewards=[0.3] * 5)  # 100 tokens, top-2, 2 layers, shares 0.25

    def edit(r):
        r.update({f"moe/churn_in/expert_{e}": 0.02 for e in range(4)})
        r.update({"moe/load/layer_0/expert_2": 0.005 if r["step"] == 1 else 0.0, "moe/load/layer_1/expert_2": 0.0})
        if r["step"] == 1:  # held: 2 x 100 x (0.005 + 0) = 1 slot
            r.update({"moe/load/layer_0/expert_3": 0.005, "moe/load/layer_1/expert_3": 0.0,
                      "moe/churn_in/expert_3": 40.0})
    _rewrite(d, edit)
    v = load_variants(tmp_path, ["grpo"])[0]
    churn, left_out = expert_churn(v, CHURN_IN)
    held = [1] + [2 * 100 * (0.25 + 0.25)] * 4
    moved = [40.0 * 1] + [0.02 * h for h in held[1:]]
    assert churn[3] == pytest.approx(sum(moved) / sum(held))
    assert churn[3] < 0.2 and churn[0] == pytest.approx(0.02) and churn[1] == pytest.approx(0.02)
    assert left_out == [2] and 1 < MIN_CHURN_SLOTS
    text = _text(write_compare_report(tmp_path, ["grpo"]))
    assert f"fewer than {MIN_CHURN_SLOTS} slots in all are left out (a gap): grpo: expert 2." in text


def test_rate_intervals_stay_in_their_bounds(tmp_path):
    """Flip rates of 0.1%, 0.1% and 5% over three seeds: their t-interval reaches below 0, and every table cuts it
    at 0 (metric table, load table, terminal summary, per-layer band); load entropies near 1 are cut at 1."""
    import numpy as np

    from moe_gspo.report.compare_data import layer_profile, load_rows, load_variants, metric_rows, summary_lines
    from moe_gspo.report.stats import t_interval

    flips = (0.001, 0.001, 0.05)
    entropies = (0.999, 0.999, 0.9)
    for s, (flip, ent) in enumerate(zip(flips, entropies)):
        d = tmp_path / "grpo" / f"seed_{s}"
        _fake_run(d, clip=0.01, flip=flip, rewards=[0.3] * 4)
        _rewrite(d, lambda r, ent=ent: r.update({"moe/load_entropy": ent, "moe/load_max_over_mean": 1.01}))
    (tmp_path / "compare.json").write_text(json.dumps({"variants": {"grpo": []}, "seeds": [0, 1, 2]}))
    assert t_interval(flips).lo < 0 and t_interval(entropies).hi > 1  # what an uncut interval would say
    v = load_variants(tmp_path, ["grpo"], [0, 1, 2])
    lo, hi = (100 * x for x in (max(t_interval(flips).lo, 0), t_interval(flips).hi))
    want = f"{100 * np.mean(flips):.2f} [{lo:.2f}, {hi:.2f}]"
    assert want.endswith(f"[0.00, {hi:.2f}]")
    assert metric_rows(v, "grpo")[0][3] == want
    row = load_rows(v)[0]
    assert row[1] == want and row[3].endswith(", 1]") and row[2].startswith("1.01 [1.01, 1.01]")
    assert want in summary_lines(tmp_path)[1]
    _, _, band_lo, band_hi = layer_profile(v[0])
    assert band_lo.min() == 0 and np.all(band_hi <= 1)


def test_flip_rates_are_in_percent_throughout(tmp_path, monkeypatch):
    """Every table header that names a flip rate or the routing mismatch says %, with values 100 x the logged
    fractions, and every figure of them has a percent axis."""
    figs = _captured_figures(monkeypatch)
    from moe_gspo.report.compare import write_compare_report

    for s in (0, 1):
        _fake_run(tmp_path / "grpo" / f"seed_{s}", clip=0.01, flip=0.05, rewards=[0.3] * 4, split=(0.01, 0.02))
    page = write_compare_report(tmp_path, ["grpo"]).read_text()
    headers = [h for h in re.findall(r"<th>(.*?)</th>", page) if re.search("flip|mismatch|: bias|: gradient", h)]
    unit = [h for h in headers if re.search(r"%(?! t)", h)]  # a percent sign that is not 95% t's
    assert len(headers) >= 5 and unit == headers, headers
    header, rows = _table_after(page, "<h2>Summary</h2>")
    assert float(rows[0][header.index("flip rate %")]) == pytest.approx(5.0)
    assert float(rows[0][header.index("engine mismatch %")]) == pytest.approx(1.0)
    for png in ("compare_flip_rate.png", "compare_flip_layers.png", "compare_flip_sources.png", "compare_churn.png",
                "compare_mismatch.png", "volatility_heatmap.png"):
        labels = [ax.get_ylabel() for ax in figs[png].axes]
        assert any("%" in x for x in labels), (png, labels)
    assert figs["compare_flip_rate.png"].axes[0].lines[1].get_ydata()[0] == pytest.approx(5.0)


def test_summary_table_fits_1400_px(tmp_path):
    """The page is 1400 px wide at most and a table scrolls sideways in its container rather than widening it; in
    the summary, headers wrap between words and cells never wrap, and at about 9 px per character (system-ui at 16
    px) plus 21 px of padding and border per column, five variants with long names, intervals and a dash with its
    reason fit in 1400 px less the page's 2 x 16 px of padding."""
    from moe_gspo.report.compare import write_compare_report

    names = ["grpo", "grpo_r2", "grpo_r3", "gspo", "gspo_token"]
    for i, name in enumerate(names):
        for s in (0, 1, 2):
            flat = name == "gspo_token"  # the same final reward at every seed: no spread, a dash with the reason
            _fake_run(tmp_path / name / f"seed_{s}", clip=0.0001234 * (i + 1), flip=0.012345,
                      rewards=[0.5 if flat else 0.123456 + 0.1 * s + 0.01 * i] * 12, wall=1234.5)
    page = write_compare_report(tmp_path, names).read_text()
    css = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    assert "max-width:1400px" in css and ".scroll{max-width:100%;overflow-x:auto}" in css
    assert "table.numeric td{white-space:nowrap}" in css and "white-space:normal" in css
    assert page.count("<table") == page.count("<div class='scroll'><table")
    start = page.index("<h2>Summary</h2>")
    assert page[start:].split("<table", 1)[1].startswith(" class='numeric'")
    header, rows = _table_after(page, "<h2>Summary</h2>")
    assert any("no spread" in c for r in rows for c in r)
    width = 0
    for j, h in enumerate(header):
        cells = [r[j] for r in rows]
        assert all(len(c) <= 26 for c in cells), cells
        chars = max([len(w) for w in h.split()] + [len(c) for c in cells])
        width += 9 * chars + 21
    assert width <= 1400 - 32, width
