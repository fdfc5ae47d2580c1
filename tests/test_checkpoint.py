"""Checkpoints: atomic layout, verification (truncated / corrupt / interrupted ones skipped), rotation, resume."""

from __future__ import annotations

import json
import moe_gspo.rollout.hf_engine  # noqa: F401  (transformers before megatron's CPU shims)
import pytest
import torch

from moe_gspo.train.checkpoint import CheckpointError, CheckpointLayoutError, Checkpoints


def _state(v):
    return {"w": torch.full((64,), float(v)), "step": v}


def test_save_load_rotate(tmp_path):
    ck = Checkpoints(tmp_path, keep=2)
    for s in (1, 2, 3):
        ck.save(s, _state(s))
    assert ck.steps() == [3, 2]  # keep the last 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    manifest = json.loads((tmp_path / "step_00000003" / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and len(manifest["files"][0]["sha256"]) == 64
    step, state = ck.load_latest()
    assert step == 3 and state["step"] == 3 and torch.equal(state["w"], torch.full((64,), 3.0))


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "no_manifest", "missing_file", "bad_manifest"])
def test_damaged_newest_checkpoint_is_reported_and_skipped(tmp_path, damage):
    said = []
    ck = Checkpoints(tmp_path, keep=3, log=said.append)
    ck.save(1, _state(1))
    ck.save(2, _state(2))
    d = tmp_path / "step_00000002"
    f = d / "rank_00000.pt"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "flip_byte":
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))
    elif damage == "no_manifest":  # what a crash between the rank files and the manifest leaves
        (d / "manifest.json").unlink()
    elif damage == "missing_file":
        f.unlink()
    else:
        (d / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        ck.verify(2)
    step, state = ck.load_latest()
    assert step == 1 and state["step"] == 1
    assert len(said) == 1 and "step_00000002" in said[0] and "skipping" in said[0]


def test_no_checkpoint_and_interrupted_tmp_dir(tmp_path):
    ck = Checkpoints(tmp_path / "none")
    assert ck.load_latest() == (0, None)
    ck = Checkpoints(tmp_path, keep=2)
    (tmp_path / ".tmp-step_00000005").mkdir()  # a save killed before its rename
    assert ck.load_latest() == (0, None)
    ck.save(1, _state(1))
    assert ck.load_latest()[0] == 1 and not (tmp_path / ".tmp-step_00000005").exists()


def test_wrong_world_size_is_named(tmp_path):
    ck = Checkpoints(tmp_path)
    ck.save(1, _state(1))
    with pytest.raises(CheckpointLayoutError, match="written by 1 ranks, this run has 2"):
        ck.verify(1, world=2)
    with pytest.raises(CheckpointLayoutError):  # not skipped: resuming from scratch would discard the run
        ck.latest_valid(world=2)


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    from test_trainer import records, strip_timing, tiny_cfg

    from moe_gspo.trainer import train

    full = tiny_cfg("train.steps=4", "train.checkpoint_every=2", "algorithm.loss=gspo")
    train(full, run_dir=tmp_path / "full")
    part = tiny_cfg("train.steps=3", "train.checkpoint_every=2", "algorithm.loss=gspo")
    train(part, run_dir=tmp_path / "cut")  # "crashes" after step 3; newest checkpoint is step 2
    train(full, run_dir=tmp_path / "cut", resume=True)
    a, b = records(tmp_path / "full"), records(tmp_path / "cut")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [strip_timing(r) for r in a] == [strip_timing(r) for r in b]


def test_resume_without_checkpoint_starts_fresh_and_a_rerun_replaces_metrics(tmp_path, capfd):
    from test_trainer import records, tiny_cfg

    from moe_gspo.trainer import train

    cfg = tiny_cfg("train.steps=1")
    train(cfg, run_dir=tmp_path, resume=True)
    assert "no complete checkpoint" in capfd.readouterr().err
    train(cfg, run_dir=tmp_path)
    assert [r["step"] for r in records(tmp_path)] == [1]
