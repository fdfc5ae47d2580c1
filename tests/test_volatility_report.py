"""The expert-volatility report from synthetic metrics.jsonl files (one and two runs, CLI, bad input)."""

from __future__ import annotations

import json
import math
import re

import pytest

from moe_gspo.cli import main as cli_main
from moe_gspo.config import UserError
from moe_gspo.report.volatility import write_volatility_report

L, E = 4, 8


def write_run(run_dir, scale: float, steps: int = 12, mismatch: bool = True):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(steps):
            rec = {"step": s, "loss": 1.0 / (s + 1)}
            layers = [scale * (1 + 0.3 * i) * (1 + math.sin(s / 3)) / 2 for i in range(L)]
            rec.update({f"moe/flip_rate/layer_{i}": v for i, v in enumerate(layers)})
            rec["moe/flip_rate"] = sum(layers) / L
            rec.update({f"moe/churn_in/expert_{e}": scale * (1 + e % 3) for e in range(E)})
            rec.update({f"moe/churn_out/expert_{e}": scale * (1 + e % 2) for e in range(E)})
            if mismatch:
                rec["moe/rollout_train_mismatch"] = scale / 2
            f.write(json.dumps(rec) + "\n")
            f.write(json.dumps({"step": s, "reward": 0.5}) + "\n")  # another line for the same step is merged


def test_single_run_report(tmp_path):
    write_run(tmp_path / "grpo", 0.1)
    out = write_volatility_report([tmp_path / "grpo"])
    assert out == tmp_path / "grpo" / "volatility.html"
    text = out.read_text()
    srcs = re.findall(r'<img src="([^"]+)"', text)
    assert sorted(srcs) == ["volatility_churn.png", "volatility_flip_rate.png", "volatility_heatmap.png"]
    for s in srcs:
        assert (out.parent / s).stat().st_size > 5000
    assert "grpo" in text and "<table>" in text


def test_two_runs_cli_and_errors(tmp_path, capsys):
    write_run(tmp_path / "grpo", 0.1)
    write_run(tmp_path / "gspo", 0.03, steps=7, mismatch=False)
    out_html = tmp_path / "cmp" / "vol.html"
    assert cli_main(["report", "volatility", str(tmp_path / "grpo"), str(tmp_path / "gspo"), "--out", str(out_html)]) == 0
    assert capsys.readouterr().out.strip() == str(out_html)
    text = out_html.read_text()
    for s in re.findall(r'<img src="([^"]+)"', text):
        assert (out_html.parent / s).is_file() and s.startswith("vol_")
    assert "gspo" in text and "grpo" in text
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", "volatility", str(tmp_path / "empty")]) == 2
    assert "no metrics file" in capsys.readouterr().err
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 0, "loss": 1}\n')
    with pytest.raises(UserError, match="no 'moe/flip_rate' metrics"):
        write_volatility_report([tmp_path / "empty"])
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 0}\n{oops\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not valid JSON"):
        write_volatility_report([tmp_path / "empty"])
