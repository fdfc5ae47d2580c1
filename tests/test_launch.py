"""scripts/launch.sh: two torchrun agents ("nodes") on this machine equal one agent with the same ranks; it runs from
any directory with the repository's interpreter; and an error a user can cause on any rank ends the whole job in
one line (moe_gspo/parallel/launch.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, free_port

LM = ["train-lm", "--config", "configs/tiny_cpu.yaml", "parallel.tp=2", "parallel.ep=2", "train.steps=3",
      "train.batch_size=4", "train.micro_batch_size=4", "train.seq_len=16", "model.hidden_size=32",
      "model.head_dim=8", "model.moe_intermediate_size=32", "logging.every=1"]


def _launch(out, nnodes: int, nproc: int, port: int):
    env = dict(os.environ, NNODES=str(nnodes), NPROC_PER_NODE=str(nproc), MASTER_PORT=str(port),
               MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    procs = [subprocess.Popen(["bash", "scripts/launch.sh", *LM, f"train.out_dir={out}"], cwd=ROOT,
                              env=dict(env, NODE_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(nnodes)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_nodes_equal_one_node(tmp_path):
    one = _launch(tmp_path / "one", nnodes=1, nproc=4, port=free_port())
    two = _launch(tmp_path / "two", nnodes=2, nproc=2, port=free_port())
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):  # the same 4 ranks and TP2 x EP2 layout: the same collectives in the same order
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)


def test_a_distributed_command_leaves_no_process_group_alive(tmp_path):
    """A multi-rank command destroys its process groups before returning. gloo's threads, left alive until the
    interpreter finalizes, can abort a rank that has already succeeded."""
    from helpers import run_torchrun

    report = tmp_path / "report"
    report.mkdir()
    run_torchrun(ROOT / "tests" / "dist" / "cli_exit_worker.py", report, *LM[:3], "parallel.ep=2", "train.steps=1",
                 *LM[6:], f"train.out_dir={tmp_path / 'run'}", nproc=2)
    got = {f.name: json.loads(f.read_text()) for f in sorted(report.glob("rank_*.json"))}
    want = {"rc": 0, "process_group_alive": False}
    assert got == {"rank_0.json": want, "rank_1.json": want}, got


# ------------------------------------------------------------------------------ from anywhere, errors in one line
def _launch_sh(args, cwd, nproc: int = 2) -> subprocess.CompletedProcess:
    """scripts/launch.sh ARGS from `cwd`, with no virtual environment active and none of the repository's .venv on
    PATH (the script finds it itself; $PYTHON names this interpreter only where the repository has no .venv)."""
    venv_bin = os.path.dirname(sys.executable)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin
            and not p.startswith(str(ROOT / ".venv"))]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")}
    env.update(PATH=os.pathsep.join(path), NPROC_PER_NODE=str(nproc), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    if not (ROOT / ".venv" / "bin" / "python").exists():
        env["PYTHON"] = sys.executable
    return subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _error_lines(r: subprocess.CompletedProcess) -> list[str]:
    """The `moe-gspo ...: error:` lines of a launch, after checking that no traceback or torchrun report came
    with them."""
    for noise in ("Traceback", "ChildFailedError", "SIGTERM", "exitcode"):
        assert noise not in r.stderr, r.stderr[-4000:]
    return [line for line in r.stderr.splitlines() if line.startswith("moe-gspo ")]


def test_launch_from_another_directory_with_relative_paths(tmp_path):
    """Called from a directory outside the repository, with the config and the output directory given relative to
    it: the two ranks train and write there, and a successful job prints no error."""
    (tmp_path / "lm.yaml").write_text((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    r = _launch_sh([*LM[:2], "lm.yaml", "parallel.ep=2", "train.steps=2", *LM[6:], "train.out_dir=out"], tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert [x["step"] for x in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    assert _error_lines(r) == []


def test_a_bad_config_value_is_one_line_for_the_job(tmp_path):
    """Checked once by the launcher before any rank starts: stderr is that line alone."""
    r = _launch_sh(["train", "--config", "configs/train_tiny_cpu.yaml", "train.steps=many", "--out",
                    str(tmp_path / "run")], ROOT)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["moe-gspo train: error: command-line override train.steps=many: "
                                     "train.steps='many' must be an int"], r.stderr[-4000:]


def test_an_error_every_rank_hits_is_one_line(tmp_path):
    """A world-size check fails on both ranks: one line for the job, no traceback, no torchrun report."""
    r = _launch_sh(["train", "--config", "configs/train_tiny_cpu.yaml", "parallel.tp=3", "--out",
                    str(tmp_path / "run")], ROOT)
    lines = _error_lines(r)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr[-4000:]
    assert lines[0].startswith("moe-gspo train: error: ") and \
        lines[0].endswith("parallel.tp=3 does not divide the world size 2"), lines


def test_an_error_only_rank_1_hits_names_rank_1(tmp_path):
    """Each data-parallel rank draws its own cold-start demonstrations: with train.seed=0 rank 0's first one is the
    short row and rank 1's the long one, whose prompt fits the context and whose demonstration does not. Rank 1 stops before its forward while rank 0
    waits for it in the gradient all-reduce; the job ends in one line naming rank 1, and rank 0's failure once rank
    1 has left adds nothing."""
    from helpers import TINY

    long_prompt = "1+" * 30 + "1="
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": long_prompt, "answer": "31"}) + "\n")
    r = _launch_sh(["train", "--config", "configs/train_tiny_cpu.yaml", *TINY, "train.seed=0", "rollout.task=jsonl",
                    "rollout.task_args=", f"rollout.dataset_path={data}", "rollout.demonstration_field=answer",
                    "model.max_position_embeddings=64", "rollout.max_new_tokens=1", "train.cold_start_batch_size=2",
                    "--out", str(tmp_path / "run")], ROOT)
    assert r.returncode == 2, r.stderr[-4000:]
    assert _error_lines(r) == [f"moe-gspo train: error: rank 1: cold start: demonstration {long_prompt[:40]!r}... "
                               "has 66 tokens (bos + prompt + completion + eos), more than the context "
                               "model.max_position_embeddings=64"], r.stderr[-4000:]


def test_the_job_line_names_a_rank_only_when_the_ranks_disagree():
    """moe_gspo.parallel.launch.summary_line: the message alone when every failed rank reported it, else the lowest
    reporting rank's, naming it (a failed rank that reported nothing counts as disagreeing)."""
    from moe_gspo.parallel.launch import summary_line

    def rep(rank, message):
        return {"rank": rank, "command": "train", "message": message}

    same = {0: rep(0, "parallel.tp=3 does not divide the world size 2"),
            1: rep(1, "parallel.tp=3 does not divide the world size 2")}
    assert summary_line(same, [0, 1]) == "moe-gspo train: error: parallel.tp=3 does not divide the world size 2"
    assert summary_line({1: rep(1, "too long")}, [0, 1]) == "moe-gspo train: error: rank 1: too long"
    assert summary_line({2: rep(2, "b"), 1: rep(1, "a")}, [1, 2]) == "moe-gspo train: error: rank 1: a"
    assert summary_line({0: rep(0, "x")}, [0]) == "moe-gspo train: error: x"


def test_the_slurm_example_starts_one_launcher_per_node_and_resumes_a_requeued_run(tmp_path):
    """examples/slurm/train_multinode.sbatch under stand-ins for srun (one task per node, SLURM_NODEID set),
    scontrol and scripts/launch.sh (which records what it was given): every node's launcher gets its node rank,
    the first node as rendezvous, the node count, the config, run directory and overrides; a run directory with
    checkpoints (a requeued job) adds --resume."""
    import os
    import stat
    import subprocess

    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    (work / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    stubs = {bin_dir / "srun": 'for n in 0 1; do SLURM_NODEID=$n "${@:2}"; done\n',
             bin_dir / "scontrol": 'printf "gpu-a17\\ngpu-a18\\n"\n',
             work / "scripts" / "launch.sh": 'echo "node=$NODE_RANK of=$NNODES at=$MASTER_ADDR:$MASTER_PORT '
                                             'ranks=$NPROC_PER_NODE args=$*" >> launches.txt\n'}
    for path, body in stubs.items():
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(work),
           "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4"}
    script = ROOT / "examples/slurm/train_multinode.sbatch"
    for requeued in (False, True):
        (work / "launches.txt").unlink(missing_ok=True)
        if requeued:
            (work / "runs/q/checkpoints").mkdir(parents=True)
        r = subprocess.run(["bash", str(script), "configs/tiny_cpu.yaml", "runs/q", "parallel.ep=8"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        resume = " --resume" if requeued else ""
        assert (work / "launches.txt").read_text().splitlines() == [
            f"node={n} of=2 at=gpu-a17:29500 ranks=4 args=train --config configs/tiny_cpu.yaml --out runs/q{resume} "
            "parallel.ep=8" for n in (0, 1)]
