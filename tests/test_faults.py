"""Faults a user's cluster meets, each reproducible: one run per directory (an advisory lock the OS drops with its
holder), metrics.jsonl rewritten whole on resume, and a rank killed mid-run (one line naming it, the step and the
command that resumes, under `moe-gspo launch`; one line from each surviving rank under plain torchrun)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, free_port

HOLD = ("import sys, time; from moe_gspo.checkpoint.run_lock import RunLock; lock = RunLock.acquire(sys.argv[1]); "
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


# two ranks (EP=2) of the tiny run, a checkpoint after every step; rank 1 is killed while it scores step 3 (8 of its
# responses a step: its 20th reward call), after the step-2 checkpoint, which is collective, was complete
KILLED = ["train", "--config", "configs/train_tiny_cpu.yaml", *TINY, "train.steps=4", "train.cold_start_steps=0",
          "train.checkpoint_every=1", "parallel.ep=2", "rollout.reward=tests/data/kill_reward.py:compute_score"]
KILL_ENV = {"MOE_GSPO_TEST_KILL_RANK": "1", "MOE_GSPO_TEST_KILL_AT": "20"}


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **extra)


def _ours(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("moe-gspo ")]


@pytest.mark.slow
def test_a_rank_killed_under_the_launcher_is_one_line_naming_the_command_that_resumes(tmp_path):
    run = tmp_path / "run"
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "moe_gspo.cli", "launch", "--nproc-per-node", "2", "--master-port",
                        str(port), "--", *KILLED, "--out", str(run)], cwd=ROOT, env=_env(**KILL_ENV),
                       capture_output=True, text=True, timeout=300)
    lines = _ours(r.stderr)
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-4000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr[-4000:]
    m = re.fullmatch(r"moe-gspo train: error: rank 1 \(pid \d+ on (.+)\) was killed by SIGKILL \(the out-of-memory "
                     r"killer, or kill -9\) during step 3 of (.+); `(.+)` continues from its checkpoint of step 2",
                     lines[0])
    assert m and m[1] == socket.gethostname() and m[2] == str(run), lines[0]
    # the same launch with --resume (a resume after a SIGKILL equals the uninterrupted run: tests/test_trainer_dist.py)
    assert shlex.split(m[3]) == ["moe-gspo", "launch", "--nproc-per-node", "2", "--master-port", str(port), "--",
                                 *KILLED, "--out", str(run), "--resume"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_00000001", "step_00000002"]


@pytest.mark.slow
def test_under_plain_torchrun_the_surviving_rank_says_where_the_run_stopped(tmp_path):
    """torchrun stops the other ranks with SIGTERM once one dies; rank 0's handler says so in one line. torchrun's
    own report (which names the dead rank) follows as torchrun prints it."""
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "moe_gspo.cli", *KILLED,
                        "--out", str(run)], cwd=ROOT, env=_env(**KILL_ENV), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert _ours(r.stderr) == [
        f"moe-gspo train: error: rank 0: stopped by SIGTERM (torchrun stops every rank once one fails, its report "
        f"names that rank; a scheduler sends it before preemption) during step 3 of {run}; the same command with "
        "--resume continues from its checkpoint of step 2"], r.stderr[-4000:]
    assert re.search(r"rank\s*:\s*1 .*\n.*exitcode\s*:\s*-9", r.stderr), r.stderr[-4000:]


@pytest.mark.parametrize("command", [["compare", "--config", "configs/compare_tiny_cpu.yaml"],
                                     ["study", "volatility", "--config", "configs/studies/volatility_cpu.yaml"]])
def test_a_comparison_or_study_in_a_held_directory_is_refused_in_one_line(tmp_path, capsys, monkeypatch, command):
    from moe_gspo.cli import main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    holder = _hold(out)
    try:
        assert main([*command, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].endswith(f"error: run directory {out} is in use by pid {holder.pid} on {socket.gethostname()} "
                                "(another train, --resume or --overwrite there is refused until it ends; choose "
                                "another --out / train.out_dir)"), err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_run_killed_at_any_point_resumes_to_the_uninterrupted_run(tmp_path):
    """SIGKILL during step 3 of a one-process run (checkpoints after every step): while sampling, between two
    optimizer updates, after its metrics line, and after its shards but before its manifest. `--resume` continues
    from step 2's checkpoint (the partial one is never taken), rewrites metrics.jsonl from there, and every metric of
    steps 1-4 equals the uninterrupted run's."""
    from helpers import records, strip_timing, tiny_cfg

    from moe_gspo.train.loop import train

    over = ["rollout.reward=tests/data/spread_reward.py:compute_score", "train.cold_start_steps=0",
            "train.lr=0.003", "train.checkpoint_every=1", "train.steps=4"]
    points = ["rollout", "update", "logged", "checkpoint"]
    r = subprocess.run([sys.executable, "tests/dist/kill_points.py", str(tmp_path), ",".join(points), *TINY, *over],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    cfg = tiny_cfg(*over)
    train(cfg, run_dir=tmp_path / "ref")
    ref = [strip_timing(x) for x in records(tmp_path / "ref")]
    for point in points:
        run = tmp_path / point
        logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert logged == ([1, 2, 3] if point in ("logged", "checkpoint") else [1, 2]), (point, logged)
        assert (run / "checkpoints" / ".tmp-step_00000003").is_dir() == (point == "checkpoint"), point
        train(cfg, run_dir=run, resume=True)
        assert [strip_timing(x) for x in records(run)] == ref, point
        assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_00000004"
