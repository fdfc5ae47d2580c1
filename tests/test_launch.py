"""scripts/launch.sh across two torchrun agents ("nodes") on this machine equals one agent with the same ranks."""
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
