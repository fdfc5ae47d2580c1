"""The run's progress where a batch job's log can show it: with stdout not a terminal (a file under nohup or a batch
queue), one plain flushed line per step with the key figures and an eta from the measured s/step; a whole run
through the CLI writes one such line per step to a file."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from helpers import ROOT, TINY

from moe_gspo.train.metrics import Progress


def test_one_plain_line_per_step_off_a_terminal():
    out = io.StringIO()
    p = Progress(total=4, start=1, label="run", enabled=True, stream=out)
    assert p.bar is None
    p.update({"reward/mean": 0.25, "moe/flip_rate": 0.0123, "time/step": 10.0})
    p.update({"reward/mean": 0.5, "pg_clipfrac": 0.1, "eval/accuracy": 0.3, "time/step": 20.0})
    p.close()
    assert out.getvalue().splitlines() == [
        "run step 2/4  reward 0.25  flip 0.0123  s/step 10  eta 0:00:20",
        "run step 3/4  reward 0.5  clip 0.1  eval 0.3  s/step 20  eta 0:00:15"]


def test_disabled_prints_nothing():
    out = io.StringIO()
    p = Progress(total=2, start=0, label="run", enabled=False, stream=out)
    p.update({"reward/mean": 1.0, "time/step": 1.0})
    assert out.getvalue() == ""


def test_a_run_with_stdout_in_a_file_logs_every_step(tmp_path):
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "moe_gspo.cli", "train", "--config", "configs/train_tiny_cpu.yaml",
                            *TINY, "train.steps=3", "train.cold_start_steps=0", "logging.tensorboard=false",
                            "rollout.prompts_per_step=2", "rollout.group_size=4", "train.minibatches=1",
                            "logging.progress=true",
                            "--out", str(tmp_path / "run")], cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [line for line in log.read_text().splitlines() if " step " in line]
    assert [line.split()[2] for line in steps] == ["1/3", "2/3", "3/3"], log.read_text()
    assert all(" reward " in line and " s/step " in line and " eta " in line for line in steps)
    assert steps[-1].endswith("eta 0:00:00")
