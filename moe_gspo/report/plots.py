"""Reading run metrics (RUN_DIR/metrics.jsonl) and drawing the report figures with matplotlib (Agg, PNG).

Every function takes several runs at once so that comparison reports reuse them:
    runs = [load_run(d) for d in run_dirs]
    line_plot(out / "x.png", [(r.label, *r.series("moe/flip_rate")) for r in runs], "flip rate", "fraction")

metrics.jsonl: one JSON object per line with an integer "step" and flat metric keys (floats). Several lines with
the same step are merged (later values win); lines without "step" get the previous step + 1.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from moe_gspo.config import UserError  # noqa: E402


DASHES = ["-", "--", "-.", ":", (0, (6, 2, 1, 2))]  # line styles by index: identical lines overlap visibly


@dataclass
class Run:
    """One run's metrics, merged per step and sorted by step."""

    dir: Path
    label: str
    records: list[dict]

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.records]

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the records that carry a finite number under `key`."""
        pts = [(r["step"], float(r[key])) for r in self.records
               if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
        return np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts], dtype=float)

    def indexed(self, prefix: str) -> list[int]:
        """Sorted i such that some record has key f'{prefix}{i}' (e.g. prefix 'moe/flip_rate/layer_')."""
        pat = re.compile(re.escape(prefix) + r"(\d+)$")
        return sorted({int(m.group(1)) for r in self.records for k in r if (m := pat.match(k))})

    def matrix(self, prefix: str) -> tuple[np.ndarray, list[int], np.ndarray]:
        """(steps, ids, M) with M[i, j] = record j's f'{prefix}{ids[i]}' (nan where missing), records having any."""
        ids = self.indexed(prefix)
        recs = [r for r in self.records if any(f"{prefix}{i}" in r for i in ids)]
        M = np.full((len(ids), len(recs)), np.nan)
        for j, r in enumerate(recs):
            for i, e in enumerate(ids):
                v = r.get(f"{prefix}{e}")
                if isinstance(v, (int, float)):
                    M[i, j] = float(v)
        return np.array([r["step"] for r in recs], dtype=float), ids, M

    def config(self) -> dict:
        """The resolved config the run wrote (RUN_DIR/config.yaml), {} when it is missing."""
        import yaml

        p = self.dir / "config.yaml"
        return (yaml.safe_load(p.read_text()) or {}) if p.is_file() else {}


def load_metrics(run_dir: str | Path) -> list[dict]:
    """Records of RUN_DIR/metrics.jsonl merged per step, sorted by step. Bad lines raise naming file:line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"no metrics file {path} (is {run_dir} a run directory?)")
    by_step: dict[int, dict] = {}
    step = -1
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise UserError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
        step = int(rec.get("step", step + 1))
        by_step.setdefault(step, {"step": step}).update({k: v for k, v in rec.items() if k != "step"})
    return [by_step[s] for s in sorted(by_step)]


def load_runs(run_dirs: Sequence[str | Path]) -> list[Run]:
    """Runs labelled by directory name (parent/name where names collide)."""
    dirs = [Path(d) for d in run_dirs]
    names = [d.resolve().name for d in dirs]
    labels = [f"{d.resolve().parent.name}/{n}" if names.count(n) > 1 else n for d, n in zip(dirs, names)]
    return [Run(d, lab, load_metrics(d)) for d, lab in zip(dirs, labels)]


def colors(n: int) -> list:
    """n colors by index (tab10): the color of the i-th run or variant of a figure."""
    cmap = plt.get_cmap("tab10")
    return [cmap(i % 10) for i in range(n)]


# two parts of one run (slots gained / lost, flips from the bias / the gradient) in bar charts whose runs have
# colors elsewhere: dark grey and hatched white, no run's color
PARTS = ({"color": "0.25"}, {"color": "white", "edgecolor": "0.25", "hatch": "///"})


def line_plot(path: Path, lines: Sequence[tuple], title: str, ylabel: str, xlabel: str = "step",
              dashed: Sequence[tuple] = ()) -> Path:
    """One line per (label, x, y); optional `dashed` (label, x, y) lines drawn in the same color order."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    cs = colors(max(len(lines), len(dashed), 1))
    for (label, x, y), c in zip(lines, cs):
        ax.plot(x, y, color=c, lw=1.6, marker="o" if len(x) < 30 else None, ms=3, label=label)
    for (label, x, y), c in zip(dashed, cs):
        ax.plot(x, y, color=c, lw=1.2, ls="--", label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return _save(fig, path)


def band_plot(path: Path, lines: Sequence[tuple], title: str, xlabel: str, ylabel: str,
              line_colors: Sequence | None = None, line_styles: Sequence | None = None) -> Path:
    """One line per (label, x, mean, lo, hi) with markers, its band shaded where lo/hi are given (not None); x holds
    integer ids (MoE layers), ticked at whole numbers. Colors are `line_colors` (default: by index) and dash patterns
    `line_styles` (default: distinct per line, so that equal lines stay visible on top of each other)."""
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    cs = line_colors if line_colors is not None else colors(len(lines))
    styles = line_styles if line_styles is not None else [DASHES[i % len(DASHES)] for i in range(len(lines))]
    for (label, x, mean, lo, hi), c, ls in zip(lines, cs, styles):
        ax.plot(x, mean, color=c, lw=1.6, marker="o", ms=3, ls=ls, label=label)
        if lo is not None:
            ax.fill_between(x, lo, hi, color=c, alpha=0.15, lw=0)
    integer_ticks(ax.xaxis, sorted({int(i) for _, x, *_ in lines for i in x}))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return _save(fig, path)


def integer_ticks(axis, ids: Sequence[int], positions: Sequence[float] | None = None) -> None:
    """Ticks of `axis` at whole ids only: one per id up to 32 of them, else at most 16 integer ones. `positions`:
    where each id is drawn (default: at the id itself)."""
    pos = list(ids) if positions is None else list(positions)
    if len(ids) <= 32:
        axis.set_ticks(pos, [str(i) for i in ids])
        return
    axis.set_major_locator(matplotlib.ticker.MaxNLocator(16, integer=True))
    if positions is not None:  # tick labels name the id drawn at each position
        axis.set_major_formatter(matplotlib.ticker.FuncFormatter(
            lambda p, _: str(ids[int(p)]) if 0 <= int(p) < len(ids) and p == int(p) else ""))


def legend_outside(ax, **kwargs) -> None:
    """The axes' legend to the right of the plotting area, so that it never covers data (nothing when no line
    has a label)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, **kwargs)


def heatmap_panels(path: Path, panels: Sequence[tuple], title: str, ylabel: str, cbar: str) -> Path:
    """One heatmap per (label, steps (S,), row ids (R,), M (R, S)), stacked vertically with a shared color scale."""
    vmax = max([np.nanmax(M) for *_, M in panels if M.size and np.isfinite(M).any()] + [1e-12])
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.2 + 0.35 * max(len(p[2]) for p in panels) * len(panels)
                                                       + 0.8 * len(panels)), squeeze=False)
    for ax, (label, steps, ids, M) in zip(axes[:, 0], panels):
        mesh = ax.pcolormesh(_edges(steps), np.arange(len(ids) + 1) - 0.5, np.ma.masked_invalid(M),
                             cmap="magma", vmin=0, vmax=vmax, shading="flat")
        ax.set(title=f"{title}: {label}", xlabel="step", ylabel=ylabel)
        ax.set_yticks(range(len(ids)), [str(i) for i in ids] if len(ids) <= 24 else None)
        if len(ids) > 24:
            ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(12, integer=True))
        fig.colorbar(mesh, ax=ax, label=cbar, pad=0.01)
    return _save(fig, path)


def grouped_bars(path: Path, panels: Sequence[tuple], title: str, xlabel: str, ylabel: str,
                 series_style: dict[str, dict] | None = None) -> Path:
    """One bar chart per (label, ids, {series name: values}), stacked vertically, series side by side, drawn with
    `series_style` {name: bar keywords, e.g. color} (default: colored by index); ids ticked at whole numbers."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.0 * len(panels)), squeeze=False, sharey=True)
    for ax, (label, ids, groups) in zip(axes[:, 0], panels):
        x = np.arange(len(ids))
        w = 0.8 / max(len(groups), 1)
        styles = ([series_style[n] for n in groups] if series_style is not None else
                  [{"color": c} for c in colors(len(groups))])
        for j, ((name, vals), style) in enumerate(zip(groups.items(), styles)):
            ax.bar(x + (j - (len(groups) - 1) / 2) * w, vals, w, label=name, **style)
        ax.set(title=f"{title}: {label}", xlabel=xlabel, ylabel=ylabel)
        integer_ticks(ax.xaxis, list(ids), x)
        ax.grid(alpha=0.3, axis="y")
        legend_outside(ax)
    return _save(fig, path)


def _edges(centers: np.ndarray) -> np.ndarray:
    """Cell edges around possibly irregular step centers."""
    c = np.asarray(centers, dtype=float)
    if len(c) == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[c[0] - (mid[0] - c[0])], mid, [c[-1] + (c[-1] - mid[-1])]])


def _save(fig, path: Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight" keeps a legend placed outside the axes in the image
    plt.close(fig)
    return path
