"""scripts/restart_study.py: which runs of a comparison restart, and from which step (the collapse rule's start minus
the smoothing window), on constructed reward curves."""

from __future__ import annotations

import importlib.util
import json

from helpers import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("restart_study", ROOT / "scripts" / "restart_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_restart_points_are_before_the_collapse(tmp_path):
    curves = {0: [0.5] * 40, 1: [0.5] * 20 + [0.0] * 20, 2: [0.5] + [0.0] * 39, 3: [0.05] * 40}
    for s, y in curves.items():
        d = tmp_path / "grpo" / f"seed_{s}"
        d.mkdir(parents=True)
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward/mean": v}) + "\n"
                                                      for i, v in enumerate(y)))
    (tmp_path / "compare.json").write_text(json.dumps({"variants": {"grpo": []}, "seeds": list(curves)}))
    points = _script().restart_points(tmp_path, "grpo", before=5)
    # seed 1: the 5-step average first falls below 0.25 at step 23 (0.5 x 2/5 = 0.2): restart after step 18;
    # seed 2 falls at step 3, too early to restart 5 steps before; seeds 0 and 3 never collapse (3 never peaks at
    # 0.1)
    assert points == {1: (18, 0.5)}


def test_recovery_is_counted_by_the_registered_rule_and_the_stricter_reading_apart(tmp_path, capsys):
    """A restart whose final reward (last 10 steps) reaches half the pre-collapse peak, with no collapse after the
    restart, recovered: the registered rule. Its last smoothed reward below that level only changes the second,
    stricter column."""
    def write(d, y):
        d.mkdir(parents=True)
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward/mean": v}) + "\n"
                                                      for i, v in enumerate(y)))

    src, out = tmp_path / "src", tmp_path / "out"
    write(src / "grpo" / "seed_1", [0.5] * 20 + [0.0] * 20)
    (src / "compare.json").write_text(json.dumps({"variants": {"grpo": []}, "seeds": [1]}))
    # after the restart (step 18) a peak of 0.3 and an end at 0.24: no collapse by the rule (0.24 is above half of
    # 0.3), final reward 0.27 >= 0.25 (half the source's 0.5), last smoothed 0.24 < 0.25
    write(out / "late_dip" / "seed_1", [0.5] * 18 + [0.3] * 17 + [0.24] * 5)
    write(out / "flat" / "seed_1", [0.5] * 40)
    write(out / "none" / "seed_1", [0.5] * 18 + [0.0] * 22)
    _script().summary(src, "grpo", out, before=5)
    rows = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "| all |" in line}
    assert rows["late_dip"].endswith("| 1/1 | 0/1 |")
    assert rows["flat"].endswith("| 1/1 | 1/1 |")
    assert rows["none"].endswith("| 0/1 | 0/1 |")


def test_resume_keeps_only_restarts_that_reached_the_last_step(tmp_path):
    """--resume keeps a restart whose metrics reach the source run's last step; one cut off mid-way, or never
    started, is redone."""
    def write(d, steps):
        d.mkdir(parents=True)
        d.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": 0.5}) + "\n"
                                                      for i in steps))

    src, out = tmp_path / "src", tmp_path / "out"
    write(src / "grpo" / "seed_1", range(1, 41))
    write(out / "done" / "seed_1", range(1, 41))
    write(out / "cut" / "seed_1", range(1, 33))
    (out / "empty" / "seed_1").mkdir(parents=True)
    (out / "empty" / "seed_1" / "metrics.jsonl").write_text("")
    finished = _script().finished
    assert finished(src, "grpo", out, "done", 1)
    assert not finished(src, "grpo", out, "cut", 1)
    assert not finished(src, "grpo", out, "empty", 1)
    assert not finished(src, "grpo", out, "missing", 1)


def test_the_interval_rule_on_twenty_sources():
    """D'''s rule at 20 sources and level 1 - 0.05/3: 0 recoveries in every arm holds (Wilson upper 0.223); 10 in
    one arm contradicts (lower 0.264); 9 settles nothing (lower 0.226). A source that recovers with unchanged
    settings is left out of every arm's rate."""
    rule = _script().interval_rule
    level = 1 - 0.05 / 3

    def arms(**hits):
        return {"same": {s: False for s in range(20)},
                **{a: {s: s < k for s in range(20)} for a, k in hits.items()}}

    lines, verdict = rule(arms(lr3=0, gspo=0), "same", level, 0.25)
    assert verdict.startswith("holds") and "0/20" in lines[0]
    assert rule(arms(lr3=10, gspo=0), "same", level, 0.25)[1].startswith("contradicted")
    assert rule(arms(lr3=9, gspo=0), "same", level, 0.25)[1] == "not settled"
    # seed 0 recovered by itself: lr3's 10 recoveries become 9 of 19, which no longer contradicts
    outcomes = arms(lr3=10, gspo=0)
    outcomes["same"][0] = True
    lines, verdict = rule(outcomes, "same", level, 0.25)
    assert verdict == "not settled" and "9/19" in lines[1] and "seeds [0]" in lines[-1]
