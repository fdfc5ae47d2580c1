"""logging.wandb_project: trainer rank 0 logs every step's metrics to a Weights & Biases run (here in wandb's
offline mode, read back from the run's .wandb file), a run without a project needs no wandb, and a project without
wandb installed is one line."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, records

TRAIN = ["train", "--config", str(ROOT / "configs/train_tiny_cpu.yaml"), *TINY]


def _wandb_records(path):
    """The protobuf records of an offline run's .wandb file. The file is a LevelDB-style log: a 7-byte header
    (':W&B', magic, version), then 32 KiB blocks of chunks, each a 7-byte header (crc32, length, type: 1 full,
    2 first, 3 middle, 4 last) and its bytes; a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros: the end of what was written
            break
        buf = (b"" if kind in (1, 2) else buf) + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


WANDB_DIR = ROOT / ".venv" / "wandb-test"
"""Where scripts/setup.sh installs wandb for this test alone (megatron imports wandb wherever it finds it)."""


def test_offline_run_holds_every_logged_step(tmp_path, monkeypatch):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_DIR=str(tmp_path / "wandb_home"),  # wandb's own settings and cache
               PYTHONPATH=os.pathsep.join(filter(None, [str(WANDB_DIR), str(ROOT), os.environ.get("PYTHONPATH")])))
    found = subprocess.run([sys.executable, "-c", "import wandb"], env=env, capture_output=True)
    if found.returncode:
        pytest.skip(f"wandb is not installed in {WANDB_DIR} (scripts/setup.sh) nor in this environment")
    monkeypatch.syspath_prepend(str(WANDB_DIR))  # for reading the run's records back
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "moe_gspo.cli", *TRAIN, "logging.wandb_project=moe-gspo-test", "--out",
                        str(run)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(run.rglob("*"))
    recs = list(_wandb_records(files[0]))
    kinds = [r.WhichOneof("record_type") for r in recs]
    history = {r.history.step.num: {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r, k in zip(recs, kinds) if k == "history"}
    logged = records(run)
    assert sorted(history) == [r["step"] for r in logged] == [1, 2]
    for rec in logged:  # every metric of metrics.jsonl, at its step
        got = history[rec["step"]]
        assert {k: got[k] for k in rec if k != "step"} == pytest.approx({k: v for k, v in rec.items() if k != "step"})
    info = recs[kinds.index("run")].run
    assert (info.project, info.display_name, info.run_id) == ("moe-gspo-test", "run",
                                                             (run / "wandb_run_id").read_text().strip())
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in info.config.update}
    assert config["logging"]["wandb_project"] == "moe-gspo-test" and config["train"]["steps"] == 2
    assert "exit" in kinds  # finished when the writer closed


def test_without_a_project_a_run_needs_no_wandb(tmp_path):
    """A run without logging.wandb_project never imports wandb: in a process where `import wandb` fails, it trains,
    and leaves no W&B files. (megatron.core itself imports wandb where it is installed, guarded, so sys.modules
    cannot tell.)"""
    run = tmp_path / "run"
    code = ("import sys; sys.modules['wandb'] = None; from moe_gspo.cli import main; "
            f"sys.exit(main({[*TRAIN, 'train.steps=1', '--out', str(run)]!r}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in records(run)] == [1]
    assert not (run / "wandb").exists() and not (run / "wandb_run_id").exists()


def test_a_project_without_wandb_is_one_line(tmp_path, monkeypatch, capsys):
    from moe_gspo.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where it is not installed
    rc = main([*TRAIN, "logging.wandb_project=p", "train.cold_start_steps=150", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == "moe-gspo train: error: logging.wandb_project='p' needs wandb: pip install wandb", err
    assert "Traceback" not in "\n".join(err)
    assert not any("cold start" in line for line in err)  # refused before anything is built or trained
