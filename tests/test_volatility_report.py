"""The expert-volatility report from synthetic metrics.jsonl files (one and two runs, CLI, bad input)."""

from __future__ import annotations

import html
import json
import math
import re

import numpy as np
import pytest

from moe_gspo.cli import main as cli_main
from moe_gspo.config import UserError
from moe_gspo.report.volatility import write_volatility_report

L, E = 4, 8


def write_run(run_dir, scale: float, steps: int = 12, mismatch: bool = True):
    """Flip rates from a formula; every expert holds 16 of a layer's 128 top-2 slots (64 tokens) at every step."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(json.dumps({"model": {"num_experts_per_tok": 2}}))  # JSON is YAML
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(steps):
            rec = {"step": s, "loss": 1.0 / (s + 1)}
            layers = [scale * (1 + 0.3 * i) * (1 + math.sin(s / 3)) / 2 for i in range(L)]
            rec.update({f"moe/flip_rate/layer_{i}": v for i, v in enumerate(layers)})
            rec["moe/flip_rate"] = sum(layers) / L
            rec.update({f"moe/churn_in/expert_{e}": scale * (1 + e % 3) for e in range(E)})
            rec.update({f"moe/churn_out/expert_{e}": scale * (1 + e % 2) for e in range(E)})
            rec.update({f"moe/load/layer_{i}/expert_{e}": 1 / E for i in range(L) for e in range(E)})
            rec["moe/flip_tokens"] = 64.0
            if mismatch:
                rec["moe/rollout_train_mismatch"] = scale / 2
            f.write(json.dumps(rec) + "\n")
            f.write(json.dumps({"step": s, "reward": 0.5}) + "\n")  # another line for the same step is merged


def expected_flips(scale: float, steps: int) -> tuple[list[float], list[list[float]]]:
    """write_run's overall flip rate per step and its per-layer rates [layer][step], computed from its formula."""
    layers = [[scale * (1 + 0.3 * i) * (1 + math.sin(s / 3)) / 2 for s in range(steps)] for i in range(L)]
    return [sum(col) / L for col in zip(*layers)], layers


def expected_row(label: str, scale: float, steps: int, mismatch: bool) -> list:
    """The summary row the report should show for write_run(scale, steps, mismatch), as numbers and strings; rates
    in percent."""
    flips, layers = expected_flips(scale, steps)
    top = max(range(steps), key=flips.__getitem__)
    layer_means = [sum(x) / steps for x in layers]
    hot = max(range(L), key=layer_means.__getitem__)
    return [label, steps, 100 * sum(flips) / steps, 100 * flips[-1], f"{100 * flips[top]:.3g} (step {top})",
            f"{hot} ({100 * layer_means[hot]:.3g})", f"1 ({200 * scale:.3g})",  # churn_out is 2*scale for odd experts
            50 * scale if mismatch else None]


def summary_rows(text: str) -> list[list[str]]:
    """The cells of the report's first table (the summary), unescaped."""
    body = re.search(r"<tbody>(.*?)</tbody>", text).group(1)
    trs = re.findall(r"<tr>(.*?)</tr>", body)
    return [[html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", tr)] for tr in trs]


def assert_row(cells: list[str], expected: list) -> None:
    assert len(cells) == len(expected), cells
    for got, want in zip(cells, expected):
        if want is None:
            assert got == "\u2014"
        elif isinstance(want, float):
            assert float(got) == pytest.approx(want, rel=5e-4), (cells, expected)  # cells carry 4 digits
        else:
            assert got == str(want), (cells, expected)


def test_single_run_report(tmp_path, monkeypatch):
    """The summary table and every figure's data equal what write_run's formulas give."""
    import moe_gspo.report.volatility as vol

    drawn = {}

    def recording(name):
        real = getattr(vol, name)

        def draw(path, data, *args, **kwargs):
            drawn[name] = (data, kwargs)
            return real(path, data, *args, **kwargs)
        return draw

    for name in ("line_plot", "heatmap_panels", "grouped_bars"):
        monkeypatch.setattr(vol, name, recording(name))
    write_run(tmp_path / "grpo", 0.1)
    out = write_volatility_report([tmp_path / "grpo"])
    assert out == tmp_path / "grpo" / "volatility.html"
    text = out.read_text()
    srcs = re.findall(r'<img src="([^"]+)"', text)
    assert sorted(srcs) == ["volatility_churn.png", "volatility_flip_rate.png", "volatility_heatmap.png"]
    for s in srcs:
        assert (out.parent / s).stat().st_size > 5000

    rows = summary_rows(text)
    assert len(rows) == 1
    assert_row(rows[0], expected_row("grpo", 0.1, 12, mismatch=True))

    flips, layers = expected_flips(0.1, 12)
    lines, kw = drawn["line_plot"]
    [(label, x, y)] = lines
    assert label == "grpo" and x.tolist() == list(range(12)) and np.allclose(y, 100 * np.array(flips))
    [(label, x, y)] = kw["dashed"]
    assert label == "grpo rollout-train mismatch" and x.tolist() == list(range(12)) and np.allclose(y, 5.0)
    [(label, x, ids, M)] = drawn["heatmap_panels"][0]
    assert label == "grpo" and x.tolist() == list(range(12)) and ids == list(range(L))
    assert np.allclose(M, 100 * np.array(layers))
    [(label, ids, groups)] = drawn["grouped_bars"][0]
    assert label == "grpo" and ids == list(range(E))
    assert np.allclose(groups["gained (in)"], [10 * (1 + e % 3) for e in range(E)])
    assert np.allclose(groups["lost (out)"], [10 * (1 + e % 2) for e in range(E)])


def test_two_runs_cli_and_errors(tmp_path, capsys):
    write_run(tmp_path / "grpo", 0.1)
    write_run(tmp_path / "gspo", 0.03, steps=7, mismatch=False)
    out_html = tmp_path / "cmp" / "vol.html"
    assert cli_main(["report", "volatility", str(tmp_path / "grpo"), str(tmp_path / "gspo"), "--out", str(out_html)]) == 0
    assert capsys.readouterr().out.strip() == str(out_html)
    text = out_html.read_text()
    for s in re.findall(r'<img src="([^"]+)"', text):
        assert (out_html.parent / s).is_file() and s.startswith("vol_")
    rows = summary_rows(text)
    assert [r[0] for r in rows] == ["grpo", "gspo"]
    assert_row(rows[0], expected_row("grpo", 0.1, 12, mismatch=True))
    assert_row(rows[1], expected_row("gspo", 0.03, 7, mismatch=False))
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", "volatility", str(tmp_path / "empty")]) == 2
    assert "no metrics file" in capsys.readouterr().err
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 0, "loss": 1}\n')
    with pytest.raises(UserError, match="no 'moe/flip_rate' metrics"):
        write_volatility_report([tmp_path / "empty"])
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 0}\n{oops\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not valid JSON"):
        write_volatility_report([tmp_path / "empty"])
