"""Checkpoints (megatron dist_checkpointing, sharded): atomic layout, verification (truncated / corrupt / interrupted /
disguised ones skipped), rotation, nothing unpickled as code (crafted pickles never run), exact restore of weights,
fp32 main params, Adam moments, LR schedule and RNG; resume. Resharding across layouts: tests/test_trainer_dist.py."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from types import SimpleNamespace

import pytest
import torch

from moe_gspo.config import ConfigError
from moe_gspo.checkpoint.store import CheckpointError, Checkpoints

TINY_MODEL = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
              "model.num_key_value_heads=1", "model.head_dim=16", "model.num_experts=4",
              "model.moe_intermediate_size=32", "train.lr_warmup_steps=2", "train.lr_decay=cosine",
              "train.min_lr=1e-5", "train.lr=1e-2"]


def _ctx(*overrides, seed=0):
    """A policy with megatron's optimizer (the StepContext fields a checkpoint touches)."""
    import moe_gspo
    from moe_gspo.config import load_config
    from moe_gspo.train.optim import Optimizer, wrap_ddp

    cfg = load_config("configs/train_tiny_cpu.yaml", TINY_MODEL + [f"train.seed={seed}", *overrides])
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    optim = Optimizer.from_config(wrap_ddp(policy), policy, cfg.train, total_steps=10)
    return SimpleNamespace(policy=policy, optim=optim, reference=None, cfg=cfg)


def _train(ctx, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, ctx.cfg.model.vocab_size, (2, 9), generator=g)
        ctx.optim.zero_grad()
        ctx.policy(ids).float().logsumexp(-1).mean().backward()
        ctx.optim.step()


@pytest.fixture(scope="module")
def trained():
    ctx = _ctx()
    _train(ctx, 3)
    return ctx


def test_save_load_restores_everything_exactly(tmp_path, trained):
    ck = Checkpoints(tmp_path, keep=2)
    rng_at_save = torch.get_rng_state()
    ck.save(3, trained, {"step": 3, "data_position": 3})
    d = tmp_path / "step_00000003"
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and all(len(f["sha256"]) == 64 for f in manifest["files"])
    on_disk = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()} - {"manifest.json"}
    assert on_disk == {f["file"] for f in manifest["files"]}
    assert {"shards/.metadata", "shards/metadata.json", "rng.safetensors", "state.json"} <= on_disk
    assert {p.suffix or p.name for p in d.rglob("*") if p.is_file()} <= {".distcp", ".metadata", ".json", ".safetensors"}
    torch.manual_seed(123)
    fresh = _ctx(seed=5)  # different initial weights, no optimizer state
    assert ck.latest() == 3
    state = ck.load(3, fresh)
    assert state["step"] == 3 and state["data_position"] == 3
    for (n, a), (_, b) in zip(trained.policy.gpt.named_parameters(), fresh.policy.gpt.named_parameters()):
        assert torch.equal(a, b), n
    sa, sb = trained.optim.local_state(), fresh.optim.local_state()
    for kind in sa:
        for n in sa[kind]:
            assert torch.equal(sa[kind][n], sb[kind][n]), (kind, n)
    assert fresh.optim.lr == trained.optim.lr and fresh.optim.adam_step == 3
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    _train(trained, 2, seed=9)  # the next steps are identical: same Adam state, same schedule
    _train(fresh, 2, seed=9)
    for (n, a), (_, b) in zip(trained.policy.gpt.named_parameters(), fresh.policy.gpt.named_parameters()):
        assert torch.equal(a, b), n


def test_kl_reference_policy_is_saved_and_restored(tmp_path, trained):
    ref = trained.policy.frozen_copy()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)  # unlike the policy's weights
    ck = Checkpoints(tmp_path)
    ck.save(3, SimpleNamespace(policy=trained.policy, optim=trained.optim, reference=ref), {"step": 3})
    fresh = _ctx(seed=5)
    fresh.reference = fresh.policy.frozen_copy()
    ck.load(3, fresh)
    for (n, a), (_, b) in zip(ref.gpt.named_parameters(), fresh.reference.gpt.named_parameters()):
        assert torch.equal(a, b), n
    for (n, a), (_, b) in zip(trained.policy.gpt.named_parameters(), fresh.policy.gpt.named_parameters()):
        assert torch.equal(a, b), n
    ck.save(4, trained, {"step": 4})  # no reference: cannot resume a run with kl_beta > 0
    with pytest.raises(CheckpointError, match="no KL reference"):
        ck.load(4, fresh)


def test_load_weights_reads_only_the_policy(tmp_path, trained):
    """What `moe-gspo rollout --from RUN` does: the policy's weights, no optimizer."""
    ck = Checkpoints(tmp_path)
    ck.save(3, trained, {"step": 3})
    fresh = _ctx(seed=5)
    ck.load_weights(3, fresh.policy)
    for (n, a), (_, b) in zip(trained.policy.gpt.named_parameters(), fresh.policy.gpt.named_parameters()):
        assert torch.equal(a, b), n


def test_rotation_keeps_the_last_k(tmp_path, trained):
    ck = Checkpoints(tmp_path, keep=2)
    for s in (1, 2, 3):
        ck.save(s, trained, {"step": s})
    assert ck.steps() == [3, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


class _RunsCode:
    """Unpickling this runs `touch <path>`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.path}",)


def _rewrite_manifest(d, fname):
    import hashlib

    m = json.loads((d / "manifest.json").read_text())
    data = (d / fname).read_bytes()
    for e in m["files"]:
        if e["file"] == fname:
            e["bytes"], e["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m))


def _first_shard(d):
    return sorted((d / "shards").glob("*.distcp"))[0]


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "no_manifest", "missing_file", "bad_manifest",
                                    "metadata_payload", "bad_state_json"])
def test_damaged_newest_checkpoint_is_reported_and_skipped(tmp_path, trained, damage):
    said = []
    ck = Checkpoints(tmp_path, keep=3, log=said.append)
    ck.save(1, trained, {"step": 1})
    ck.save(2, trained, {"step": 2})
    d = tmp_path / "step_00000002"
    f = _first_shard(d)
    marker = tmp_path / "payload_ran"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "flip_byte":
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF
        f.write_bytes(bytes(b))
    elif damage == "no_manifest":  # what a crash between the files and the manifest leaves
        (d / "manifest.json").unlink()
    elif damage == "missing_file":
        f.unlink()
    elif damage == "bad_manifest":
        (d / "manifest.json").write_text("{not json")
    elif damage == "metadata_payload":  # torch DCP's pickled index replaced, manifest to match: refused, never run
        (d / "shards" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
        _rewrite_manifest(d, "shards/.metadata")
    else:
        (d / "state.json").write_bytes(pickle.dumps(_RunsCode(marker)))
        _rewrite_manifest(d, "state.json")
    with pytest.raises(CheckpointError):
        ck.verify(2)
    assert not marker.exists(), "a checkpoint file ran code"
    assert ck.latest() == 1
    assert len(said) == 1 and "step_00000002" in said[0] and "skipping" in said[0], said
    fresh = _ctx(seed=5)
    if damage == "metadata_payload":
        assert "refused to load global posix.system" in said[0] or "refused to load global os.system" in said[0]
        with pytest.raises(CheckpointError, match=r"shards/\.metadata: not a torch DCP metadata file"):
            ck.load(2, fresh)  # loading it directly, without verifying first, is refused too
    ck.load(1, fresh)
    assert not marker.exists(), "a checkpoint file ran code"


def _craft_tensor_blob(d, marker):
    """Point every tensor of the first shard file at a torch.save blob whose unpickling runs `touch marker`; the
    `.metadata` (rewritten with DCP's own classes) and the manifest match it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    f = _first_shard(d)
    blob = io.BytesIO()
    torch.save(_RunsCode(marker), blob)
    f.write_bytes(blob.getvalue())
    md_path = d / "shards" / ".metadata"
    md = pickle.loads(md_path.read_bytes())  # our own file, written a moment ago
    for k, info in md.storage_data.items():
        if info.relative_path == f.name:
            md.storage_data[k] = _StorageInfo(f.name, 0, len(blob.getvalue()))
    md_path.write_bytes(pickle.dumps(md))
    _rewrite_manifest(d, f"shards/{f.name}")
    _rewrite_manifest(d, "shards/.metadata")
    return f


def test_crafted_tensor_blob_is_refused_naming_its_file(tmp_path, trained):
    ck = Checkpoints(tmp_path)
    ck.save(1, trained, {"step": 1})
    marker = tmp_path / "payload_ran"
    f = _craft_tensor_blob(tmp_path / "step_00000001", marker)
    assert ck.latest() == 1  # every file matches the manifest and parses: only loading can tell
    with pytest.raises(CheckpointError) as e:
        ck.load(1, _ctx(seed=5))
    assert not marker.exists(), "a tensor blob ran code"
    msg = str(e.value)
    assert msg.startswith(f"{f}: refused by torch.load(weights_only=True)") and "\n" not in msg, msg


def test_a_crafted_tensor_blob_in_the_newest_checkpoint_falls_back_to_the_one_before(tmp_path, trained):
    said = []
    ck = Checkpoints(tmp_path, keep=3, log=said.append)
    ck.save(1, trained, {"step": 1})
    ck.save(2, trained, {"step": 2})
    marker = tmp_path / "payload_ran"
    f = _craft_tensor_blob(tmp_path / "step_00000002", marker)
    fresh = _ctx(seed=5)
    assert ck.latest() == 2  # it verifies: only loading can tell
    step, state = ck.load_newest(2, fresh)
    assert (step, state["step"]) == (1, 1)
    assert said == [f"warning: skipping checkpoint {tmp_path / 'step_00000002'}: {f}: refused by "
                    f"torch.load(weights_only=True)" + said[0].split("torch.load(weights_only=True)", 1)[1]]
    assert "\n" not in said[0]
    for (n, a), (_, b) in zip(trained.policy.gpt.named_parameters(), fresh.policy.gpt.named_parameters()):
        assert torch.equal(a, b), n
    assert not marker.exists(), "a tensor blob ran code"


def test_resume_from_a_crafted_checkpoint_is_one_line_and_runs_nothing(tmp_path, capsys, monkeypatch):
    """`moe-gspo train --resume`: a crafted `.metadata` in the newest checkpoint is reported and skipped (the run
    resumes from the one before); a crafted tensor blob in the only checkpoint ends the run with one line naming
    the file, exit code 2, no traceback. The payload never runs."""
    from helpers import ROOT, TINY

    from moe_gspo.cli import main

    monkeypatch.chdir(ROOT)
    run, marker = tmp_path / "run", tmp_path / "payload_ran"
    argv = ["train", "--config", "configs/train_tiny_cpu.yaml", *TINY, "train.cold_start_steps=0",
            "train.checkpoint_every=1", "train.keep_checkpoints=3", "--out", str(run)]
    assert main(argv) == 0
    d2 = run / "checkpoints" / "step_00000002"
    (d2 / "shards" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    _rewrite_manifest(d2, "shards/.metadata")
    capsys.readouterr()
    assert main(argv[:-2] + ["train.steps=3", "--out", str(run), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "step_00000002" in err and "refused" in err, err
    assert "resumed from" in err and "step_00000001" in err, err
    for s in ("00000002", "00000003"):  # leave one checkpoint: step 1, crafted
        shutil.rmtree(run / "checkpoints" / f"step_{s}", ignore_errors=True)
    f = _craft_tensor_blob(run / "checkpoints" / "step_00000001", marker)
    assert main(argv + ["--resume"]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.startswith("moe-gspo ")]
    assert len(lines) == 1 and str(f) in lines[0] and "Traceback" not in err, err
    assert not marker.exists(), "a checkpoint file ran code"


def test_no_checkpoint_and_interrupted_tmp_dir(tmp_path, trained):
    assert Checkpoints(tmp_path / "none").latest() == 0
    ck = Checkpoints(tmp_path, keep=2)
    (tmp_path / ".tmp-step_00000005").mkdir()  # a save killed before its rename
    assert ck.latest() == 0
    ck.save(1, trained, {"step": 1})
    assert ck.latest() == 1 and not (tmp_path / ".tmp-step_00000005").exists()


def test_bf16_checkpoint_keeps_fp32_main_params(tmp_path):
    from moe_gspo.checkpoint.sharded_io import load_full

    ctx = _ctx("model.params_dtype=bfloat16")
    _train(ctx, 2)
    Checkpoints(tmp_path).save(2, ctx, {"step": 2})
    full = load_full(tmp_path / "step_00000002" / "shards")
    name = next(n for n in full if n.endswith("linear_qkv.weight") and not n.startswith("optimizer."))
    main = full[f"optimizer.state.fp32_param.{name}"]
    assert full[name].dtype == torch.bfloat16 and main.dtype == torch.float32
    assert not torch.equal(main, full[name].float())  # the fp32 copy holds more than bf16 does
    torch.testing.assert_close(main.bfloat16(), full[name], rtol=0, atol=0)


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    import shutil

    from helpers import records, strip_timing, tiny_cfg

    from moe_gspo.train.loop import train

    full = tiny_cfg("train.steps=4", "train.checkpoint_every=2", "algorithm.loss=gspo", "train.lr_warmup_steps=3",
                    "train.lr_decay=linear", "train.min_lr=1e-5")
    train(full, run_dir=tmp_path / "full")
    part = tiny_cfg("train.steps=3", "train.checkpoint_every=2", "algorithm.loss=gspo")
    train(part, run_dir=tmp_path / "part")
    assert Checkpoints(tmp_path / "part" / "checkpoints").steps() == [3, 2]  # the last step is always saved
    train(full, run_dir=tmp_path / "cut")  # then "crash" after step 3: only the step-2 checkpoint survives
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_00000004")
    train(full, run_dir=tmp_path / "cut", resume=True)
    a, b = records(tmp_path / "full"), records(tmp_path / "cut")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [strip_timing(r) for r in a] == [strip_timing(r) for r in b]
    assert len({r["lr"] for r in a}) == 4  # the schedule moved, and was resumed where it was


def test_resume_without_checkpoint_starts_fresh_and_only_overwrite_replaces_a_run(tmp_path, capfd):
    from helpers import records, tiny_cfg

    from moe_gspo.train.loop import train

    cfg = tiny_cfg("train.steps=1")
    train(cfg, run_dir=tmp_path, resume=True)
    assert "no complete checkpoint" in capfd.readouterr().err
    with pytest.raises(ConfigError, match="holds a previous run"):
        train(cfg, run_dir=tmp_path)  # neither resume nor overwrite: the first run is kept
    train(cfg, run_dir=tmp_path, overwrite=True)
    assert [r["step"] for r in records(tmp_path)] == [1]


def _adam_groups(ctx):
    subs = getattr(ctx.optim.optimizer, "chained_optimizers", [ctx.optim.optimizer])
    return [g for s in subs for g in s.optimizer.param_groups]


def test_a_checkpoint_saved_by_the_looping_adam_resumes_with_the_fused_kernel(tmp_path):
    """A checkpoint whose optimizer stepped torch's per-tensor loop (fused=False in its param groups) resumes on
    the fused kernel, with the same Adam state: loading keeps the live groups' kernel flags."""
    ctx = _ctx()
    for g in _adam_groups(ctx):
        g["fused"], g["foreach"] = False, False
    _train(ctx, 2)
    ck = Checkpoints(tmp_path, keep=1)
    ck.save(2, ctx, {"step": 2, "data_position": 2})
    fresh = _ctx(seed=5)
    ck.load(2, fresh)
    assert [g["fused"] for g in _adam_groups(fresh)] == [True] * len(_adam_groups(fresh))
    sa, sb = ctx.optim.local_state(), fresh.optim.local_state()
    assert all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k])


def test_checkpoint_of_one_experts_setting_resumes_with_another(tmp_path):
    """model.experts=torch (SequentialMLP's per-expert parameters) saves, model.experts=grouped (GroupedMLP's stacked
    ones) resumes: weights, fp32 main params and Adam moments equal, and the next steps agree to float rounding (the
    grouped GEMM and the per-expert loop need not round alike)."""
    src, dst = _ctx("model.experts=torch"), _ctx("model.experts=grouped", seed=5)
    _train(src, 2)
    Checkpoints(tmp_path).save(2, src, {"step": 2})
    Checkpoints(tmp_path).load(2, dst)
    for kind in ("param", "exp_avg"):
        a = src.policy.per_expert(src.optim.local_state()[kind])
        b = dst.policy.per_expert(dst.optim.local_state()[kind])
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), kind
    assert any(v.abs().max() > 0 for n, v in a.items() if ".experts." in n)  # experts moments, not zeros
    _train(src, 2, seed=9)
    _train(dst, 2, seed=9)
    a, b = src.policy.megatron_state(), dst.policy.megatron_state()
    for n in a:  # the two experts implementations compute the same steps up to float rounding (9e-8 seen)
        torch.testing.assert_close(b[n], a[n], atol=1e-6, rtol=1e-5, msg=lambda m: f"{n} after two more steps\n{m}")
