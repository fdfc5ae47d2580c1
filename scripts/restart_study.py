"""Restart collapsed runs of a `moe-gspo compare` directory from a checkpoint before their collapse, in several arms.

    python scripts/restart_study.py SRC VARIANT OUT [--before 5] [--jobs 2] [--resume] \
        same= lr3=train.lr=3.3333e-5 gspo=algorithm.loss=gspo
    python scripts/restart_study.py SRC VARIANT OUT --summary

SRC is a compare directory whose VARIANT runs kept a checkpoint after every step (`train.checkpoint_every=1`,
`train.keep_checkpoints` at least the number of steps). For each seed whose reward the collapse rule flags (SRC's
compare.json settings, moe_gspo/report/stats.py), the restart step is the step where the first collapse begins minus
--before (the smoothing window, so that no step inside the smoothed drop has been trained on). Each arm NAME=OVERRIDES
(comma-separated `a.b=v`, empty for the same settings) copies the run's config.yaml, its metrics up to the restart
step and that checkpoint into OUT/NAME/seed_<s>/ and continues it with `moe-gspo train --resume` to the run's last
step, with the checkpoint's weights and optimizer state and the arm's overrides. With --resume, a restart whose
metrics already reach the source run's last step is kept, and any other is prepared afresh and rerun.

--summary prints, per arm and seed, the restart step, the pre-collapse peak of the smoothed reward, the final reward
(mean of the last final_window steps) and whether the restart recovered as registered: final reward at least
collapse_fraction of that peak and no collapse after it. Beside it, apart, a stricter reading that was not
registered: also the last smoothed reward at that level. With --interval LEVEL it adds the interval rule: sources
whose --control arm (the same settings) recovered are left out; each other arm's recovery rate gets its Wilson
interval at LEVEL; irreversibility holds if every arm's upper end is below --threshold, is contradicted if any arm's
lower end is above it, and is otherwise not settled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from moe_gspo.report.compare_data import read_meta
from moe_gspo.report.stats import collapses, final_value, smooth, wilson
from moe_gspo.checkpoint.store import Checkpoints


def rewards(run: Path) -> list[float]:
    return [json.loads(x)["reward/mean"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def restart_points(src: Path, variant: str, before: int) -> dict[int, tuple[int, float]]:
    """{seed: (restart step, peak of the smoothed reward before the collapse)} for the collapsed runs."""
    meta, st = read_meta(src)
    out = {}
    for s in meta["seeds"]:
        y = rewards(src / variant / f"seed_{s}")
        events = collapses(y, st.collapse_fraction, st.collapse_patience, st.collapse_min_peak, st.smooth_window)
        if events:
            step = events[0].start + 1 - before  # Collapse.start is an index: step start + 1
            if step >= 1:
                out[s] = (step, events[0].peak)
    return out


def prepare(src: Path, variant: str, out: Path, arm: str, seed: int, step: int) -> Path:
    run, dest = src / variant / f"seed_{seed}", out / arm / f"seed_{seed}"
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.yaml", dest / "config.yaml")
    rows = [x for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] <= step]
    (dest / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    name = Checkpoints.name(step)
    shutil.copytree(run / "checkpoints" / name, dest / "checkpoints" / name)
    return dest


def finished(src: Path, variant: str, out: Path, arm: str, seed: int) -> bool:
    """Whether OUT/ARM/seed_<s> holds a restart that reached the source run's last step."""
    done = out / arm / f"seed_{seed}" / "metrics.jsonl"
    if not done.is_file():
        return False
    last = json.loads((src / variant / f"seed_{seed}" / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    rows = done.read_text().splitlines()
    return bool(rows) and json.loads(rows[-1])["step"] == last


def restart(dest: Path, overrides: list[str]) -> int:
    cmd = [sys.executable, "-m", "moe_gspo.cli", "train", "--config", str(dest / "config.yaml"), "--out", str(dest),
           "--resume", "logging.progress=false", "logging.tensorboard=false", "train.checkpoint_every=0", *overrides]
    with (dest / "log.txt").open("w") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
                              ).returncode


def interval_rule(outcomes: dict[str, dict[int, bool]], control: str, level: float,
                  threshold: float) -> tuple[list[str], str]:
    """(one line per arm, verdict) of the interval rule on {arm: {seed: recovered}}: sources whose control arm
    recovered recover without any change and are left out of every rate."""
    by_itself = {s for s, ok in outcomes.get(control, {}).items() if ok}
    lines, intervals = [], []  # one interval per arm, None where no source is left
    for arm, seeds in sorted(outcomes.items()):
        if arm == control:
            continue
        kept = [ok for s, ok in seeds.items() if s not in by_itself]
        intervals.append(wilson(sum(kept), len(kept), level) if kept else None)
        lines.append(f"{arm}: {sum(kept)}/{len(kept)} recovered, Wilson {level:.4g} interval "
                     f"[{intervals[-1][0]:.3f}, {intervals[-1][1]:.3f}]" if kept else f"{arm}: no sources left")
    if by_itself:
        lines.append(f"left out, recovered in the {control} arm: seeds {sorted(by_itself)}")
    if any(iv and iv[0] > threshold for iv in intervals):
        verdict = f"contradicted: some arm's lower end is above {threshold:g}"
    elif intervals and all(iv and iv[1] < threshold for iv in intervals):
        verdict = f"holds: every arm's upper end is below {threshold:g}"
    else:
        verdict = "not settled"
    return lines, verdict


def summary(src: Path, variant: str, out: Path, before: int, rule: tuple[float, str, float] | None = None) -> None:
    _, st = read_meta(src)
    points = restart_points(src, variant, before)
    print(f"{out}: restarts of {src}/{variant}'s collapsed runs, {before} steps before the collapse began; recovered = "
          f"final reward (last {st.final_window} steps) >= {st.collapse_fraction:g} x the pre-collapse peak and no "
          "collapse after the restart (the registered rule); 'and last smoothed' also asks the last smoothed reward "
          "to be at that level (not registered)")
    print("| arm | seed | restart step | pre-collapse peak (smoothed) | final reward | recovered | and last smoothed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    outcomes: dict[str, dict[int, bool]] = {}
    for arm in sorted(p.name for p in out.iterdir() if p.is_dir()):
        n = hits = strict_hits = 0
        outcomes[arm] = {}
        for s, (step, peak) in sorted(points.items()):
            d = out / arm / f"seed_{s}"
            if not (d / "metrics.jsonl").is_file():
                continue
            y = rewards(d)
            final = final_value(y, st.final_window)
            after = collapses(y[step:], st.collapse_fraction, st.collapse_patience, st.collapse_min_peak,
                              st.smooth_window)
            level = st.collapse_fraction * peak
            ok = final >= level and not after
            strict = ok and smooth(y, st.smooth_window)[-1] >= level
            n, hits, strict_hits = n + 1, hits + ok, strict_hits + strict
            outcomes[arm][s] = ok
            print(f"| {arm} | {s} | {step} | {peak:.3f} | {final:.3f} | {'yes' if ok else 'no'} | "
                  f"{'yes' if strict else 'no'} |")
        print(f"| {arm} | all | | | | {hits}/{n} | {strict_hits}/{n} |")
    src_final = [final_value(rewards(src / variant / f"seed_{s}"), st.final_window) for s in points]
    print(f"source runs' final rewards: {np.round(src_final, 3).tolist()}")
    if rule is not None:
        level, control, threshold = rule
        lines, verdict = interval_rule(outcomes, control, level, threshold)
        print("\n".join(["interval rule (registered outcome):", *lines, f"verdict: {verdict}"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("variant")
    ap.add_argument("out", type=Path)
    ap.add_argument("arms", nargs="*", help="NAME=OVERRIDES (comma-separated a.b=v; empty: the same settings)")
    ap.add_argument("--before", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--summary", action="store_true")
    ap.add_argument("--resume", action="store_true", help="keep the restarts that reached the last step")
    ap.add_argument("--interval", type=float, help="--summary: the interval rule's confidence level")
    ap.add_argument("--control", default="same", help="the arm with unchanged settings (default: same)")
    ap.add_argument("--threshold", type=float, default=0.25, help="the interval rule's recovery rate (default 0.25)")
    a = ap.parse_args()
    if a.summary:
        summary(a.src, a.variant, a.out, a.before,
                None if a.interval is None else (a.interval, a.control, a.threshold))
        return
    points = restart_points(a.src, a.variant, a.before)
    print(f"collapsed seeds and restart steps: {({s: p[0] for s, p in points.items()})}", flush=True)
    todo = []
    for spec in a.arms:
        name, _, ovs = spec.partition("=")
        for s, (step, _) in points.items():
            if a.resume and finished(a.src, a.variant, a.out, name, s):
                print(f"{a.out / name / f'seed_{s}'}: kept (finished)", flush=True)
                continue
            todo.append((prepare(a.src, a.variant, a.out, name, s, step), [o for o in ovs.split(",") if o]))
    with ThreadPoolExecutor(a.jobs) as pool:
        for (dest, _), rc in zip(todo, pool.map(lambda t: restart(*t), todo)):
            print(f"{dest}: exit {rc}", flush=True)


if __name__ == "__main__":
    main()
