"""Faults a user's cluster meets, each reproducible: one run per directory (an advisory lock the OS drops with its
holder), and metrics.jsonl rewritten whole on resume."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

from helpers import ROOT, TINY

HOLD = ("import sys, time; from moe_gspo.train.run_lock import RunLock; lock = RunLock.acquire(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(600)")
TRAIN = ["train", "--config", str(ROOT / "configs/train_tiny_cpu.yaml"), *TINY, "train.steps=1",
         "train.cold_start_steps=0"]


def _hold(run_dir):
    """A process holding RUN_DIR's lock, once it says so."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_held_run_directory_is_refused_in_one_line_and_left_as_it_was(tmp_path, capsys):
    from moe_gspo.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.name for p in run.iterdir())
    holder = _hold(run)
    try:
        for flags in (["--resume"], ["--overwrite"], []):
            assert main([*TRAIN, "--out", str(run), *flags]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            if not flags:  # a plain start is refused first for the previous run it would replace
                assert "holds a previous run" in err[-1]
                continue
            assert err == [f"moe-gspo train: error: run directory {run} is in use by pid {holder.pid} on "
                           f"{socket.gethostname()} (another train, --resume or --overwrite there is refused until "
                           "it ends; choose another --out / train.out_dir)"]
        assert sorted(p.name for p in run.iterdir()) == sorted(before + [".lock"])
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died without releasing anything: its lock went with it
    assert main([*TRAIN, "--out", str(run), "--overwrite"]) == 0
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_finished_run_releases_its_directory(tmp_path):
    """The same process can run there again (compare runs many runs in one process), and another process can."""
    from moe_gspo.cli import main

    run = tmp_path / "run"
    assert main([*TRAIN, "--out", str(run)]) == 0
    assert main([*TRAIN, "--out", str(run), "--overwrite"]) == 0
    _hold(run).kill()


def test_resume_rewrites_metrics_whole(tmp_path):
    from moe_gspo.train.metrics import MetricsWriter

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "x"')
    w = MetricsWriter(run, jsonl=True, tensorboard=False)
    w.truncate_after(2)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert sorted(os.listdir(run)) == ["metrics.jsonl"]  # nothing left beside it
