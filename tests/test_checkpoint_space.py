"""A checkpoint write that runs out of disk space ends in one line naming the directory, the free and needed bytes and
the checkpoint `--resume` continues from; the partial directory is never taken as complete, and resuming loads the
last good checkpoint. A write failure with space to spare, or any other exception, keeps its traceback.

The small disk is faked (SmallDisk) over the lowest file writes of a save, so these tests run anywhere; one test
also fills a real 2 MiB tmpfs where the kernel lets an unprivileged user namespace mount one, and one runs two ranks
under torchrun (this file is then the script each rank runs).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, TINY, free_port
from megatron.core.dist_checkpointing.strategies import filesystem_async as fs_async
from torch.distributed.checkpoint.api import CheckpointException

from moe_gspo.config import UserError
from moe_gspo.checkpoint import sharded_io, store as checkpoint
from moe_gspo.checkpoint.store import Checkpoints, OutOfSpace

# the tiny run of tests/helpers.py, saving after every step
RUN = ["train", "--config", "configs/train_tiny_cpu.yaml", *TINY, "train.cold_start_steps=0",
       "train.checkpoint_every=1", "train.keep_checkpoints=3"]


class _File(io.FileIO):
    """An unbuffered file on a SmallDisk: a write that does not fit writes what does and raises ENOSPC."""

    def __init__(self, disk: SmallDisk, path, mode: str):
        super().__init__(path, mode)
        self.disk = disk

    def write(self, b) -> int:
        b = memoryview(b).cast("B")
        room = self.disk.free()
        if len(b) > room:
            super().write(b[:max(room, 0)])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        return super().write(b)


class SmallDisk:
    """A file system of `capacity` bytes holding `root`, faked: its free space is `capacity` less the bytes of the
    files under `root`. `install` puts it under the shard files megatron's forked writers open, the files rank 0
    writes in checkpoint.py, and shutil.disk_usage; torch DCP's `.metadata` and megatron's metadata.json are written
    as usual and counted."""

    def __init__(self, root: Path, capacity: int):
        self.root, self.capacity = Path(root), capacity

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def free(self) -> int:
        return self.capacity - self.used()

    def open(self, path, mode="r", *args, **kwargs):
        if "w" in mode and Path(path).resolve().is_relative_to(self.root.resolve()):
            return _File(self, path, mode)
        return builtins.open(path, mode, *args, **kwargs)

    def install(self, monkeypatch) -> None:
        real = shutil.disk_usage(self.root)
        monkeypatch.setattr(fs_async, "open", self.open, raising=False)
        monkeypatch.setattr(checkpoint, "open", self.open, raising=False)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real._replace(
            total=self.capacity, used=self.used(), free=max(self.free(), 0)))


def _ctx(seed=0):
    """The policy and optimizer of the tiny run (the StepContext fields a checkpoint touches)."""
    from helpers import tiny_cfg

    import moe_gspo
    from moe_gspo.train.optim import Optimizer, wrap_ddp

    cfg = tiny_cfg(f"train.seed={seed}")
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    optim = Optimizer.from_config(wrap_ddp(policy), policy, cfg.train, total_steps=10)
    return SimpleNamespace(policy=policy, optim=optim, reference=None, cfg=cfg)


@pytest.fixture(scope="module")
def trained():
    ctx = _ctx()
    ids = torch.randint(0, ctx.cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    ctx.optim.zero_grad()
    ctx.policy(ids).float().logsumexp(-1).mean().backward()
    ctx.optim.step()  # Adam moments exist: the checkpoint has its full size
    return ctx


@pytest.fixture(scope="module")
def ckpt_bytes(trained, tmp_path_factory):
    """Bytes of one checkpoint of the tiny run."""
    d = tmp_path_factory.mktemp("size")
    Checkpoints(d).save(1, trained, {"step": 1})
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def _assert_one_line(msg: str, root: Path, step: int, last: int | None) -> None:
    assert "\n" not in msg, msg
    assert msg.startswith(f"writing checkpoint {root / f'.tmp-step_{step:08d}'}: out of space ("), msg
    assert "free on its file system" in msg and "the checkpoint's tensors alone take about" in msg, msg
    assert re.search(r"each checkpoint takes about [\d.]+ [KM]iB, and train.keep_checkpoints=(\d+) needs room for "
                     r"(\d+) of them", msg), msg
    keep, room = map(int, re.search(r"keep_checkpoints=(\d+) needs room for (\d+)", msg).groups())
    assert room == keep + 1, msg
    if last is None:
        assert "no checkpoint was completed, so --resume starts from step 0" in msg, msg
    else:
        assert f"the newest complete checkpoint is {root / f'step_{last:08d}'}, and --resume continues from it" \
            in msg, msg


@pytest.mark.parametrize("where", ["shards", "state.json"])
def test_a_full_disk_is_one_line_and_resume_loads_the_last_good_checkpoint(tmp_path, trained, ckpt_bytes,
                                                                            monkeypatch, where):
    """"shards": the disk fills while megatron's forked writers write the shard files (torch DCP hands back their
    failure without its errno, as it does on a real disk); "state.json": while rank 0 writes its own files
    (an OSError with errno ENOSPC)."""
    ck = Checkpoints(tmp_path, keep=3)
    ck.save(1, trained, {"step": 1})
    room = ckpt_bytes // 3 if where == "shards" else ckpt_bytes - 8000  # state.json and the manifest do not fit
    disk = SmallDisk(tmp_path, ckpt_bytes + room)
    disk.install(monkeypatch)
    with pytest.raises(OutOfSpace) as e:
        ck.save(2, trained, {"step": 2})
    assert isinstance(e.value, UserError)
    _assert_one_line(str(e.value), tmp_path, 2, last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # what got written is gone
    monkeypatch.undo()
    assert ck.steps() == [1] and ck.latest() == 1  # the partial checkpoint is not taken as complete
    fresh = _ctx(seed=5)
    assert ck.load(ck.latest(), fresh)["step"] == 1
    for (n, a), (_, b) in zip(trained.policy.gpt.named_parameters(), fresh.policy.gpt.named_parameters()):
        assert torch.equal(a, b), n


def test_a_full_disk_before_any_checkpoint_says_there_is_none(tmp_path, trained, ckpt_bytes, monkeypatch):
    SmallDisk(tmp_path, ckpt_bytes // 2).install(monkeypatch)
    with pytest.raises(OutOfSpace) as e:
        Checkpoints(tmp_path).save(1, trained, {"step": 1})
    _assert_one_line(str(e.value), tmp_path, 1, last=None)
    monkeypatch.undo()
    assert Checkpoints(tmp_path).latest() == 0


def _failing_writer(*args, **kwargs):
    raise RuntimeError("a writer bug")


def test_a_write_failure_with_space_left_keeps_its_traceback(tmp_path, trained, monkeypatch):
    """The same CheckpointException a full disk gives, on a disk with room to spare: a bug, not a user error."""
    monkeypatch.setattr(fs_async, "_write_item", _failing_writer)
    with pytest.raises(CheckpointException, match="a writer bug"):
        Checkpoints(tmp_path).save(1, trained, {"step": 1})


def test_another_exception_on_a_full_disk_keeps_its_traceback(tmp_path, trained, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("an internal table lacks a key")

    SmallDisk(tmp_path, 0).install(monkeypatch)
    monkeypatch.setattr(sharded_io, "save_sharded", broken)
    with pytest.raises(KeyError, match="internal table"):
        Checkpoints(tmp_path).save(1, trained, {"step": 1})


def test_cli_full_disk_is_one_line_exit_2_and_resume_continues(tmp_path, ckpt_bytes, monkeypatch, capsys):
    """`moe-gspo train` with a checkpoint every step on a disk that holds one and a half: step 1 saves, step 2 runs
    out of space and ends the command with one line and exit code 2; with the space back, --resume continues
    from step 1."""
    from moe_gspo.cli import main

    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    run.mkdir()
    SmallDisk(run, ckpt_bytes * 3 // 2).install(monkeypatch)
    rc = main(RUN + ["--out", str(run)])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("moe-gspo ")]
    assert rc == 2 and "Traceback" not in err and "encountered an error" not in err, err
    assert len(lines) == 1 and lines[0].startswith("moe-gspo train: error: "), err
    _assert_one_line(lines[0].removeprefix("moe-gspo train: error: "), run / "checkpoints", 2, last=1)
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    assert main(RUN + ["--out", str(run), "--resume"]) == 0
    assert f"resumed from {run / 'checkpoints' / 'step_00000001'}" in capsys.readouterr().err
    assert Checkpoints(run / "checkpoints").steps()[0] == 2


def _unshare_tmpfs() -> list[str] | None:
    """The command prefix that runs a shell as root of a new user and mount namespace, or None where the kernel
    does not let this user create one."""
    cmd = ["unshare", "--user", "--map-root-user", "--mount"]
    try:
        ok = subprocess.run([*cmd, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", "/mnt"],
                            capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return cmd if ok else None


@pytest.mark.slow
def test_cli_on_a_real_full_tmpfs(tmp_path, ckpt_bytes):
    """The same run on a real tmpfs of one and a half checkpoints (megatron's forked shard writers fail with
    "[Errno 28] ..." or torch's "unexpected pos ...", which reach this process as text inside a
    CheckpointException): one line, exit code 2, step 1 still complete and the partial step 2 removed. Then, with
    the disk still full, a --resume is refused in one line before it computes anything."""
    prefix = _unshare_tmpfs()
    if prefix is None:
        pytest.skip("this kernel does not let an unprivileged user namespace mount a tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    kib = ckpt_bytes * 3 // 2 // 1024
    script = (f'mount -t tmpfs -o size={kib}k tmpfs {mnt} && "$0" -m moe_gspo.cli "$@" --out {mnt}/run; '
              f'echo "rc=$?"; ls -a {mnt}/run/checkpoints {mnt}/run/checkpoints/step_00000001; '
              f'"$0" -m moe_gspo.cli "$@" --out {mnt}/run --resume; echo "rc=$?"')
    r = subprocess.run([*prefix, "sh", "-c", script, sys.executable, *RUN], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [x for x in r.stderr.splitlines() if x.startswith("moe-gspo ")]
    assert r.stdout.count("rc=2") == 2 and "Traceback" not in r.stderr and "encountered an error" not in r.stderr, \
        r.stdout + r.stderr[-3000:]
    assert len(lines) == 2, r.stderr
    _assert_one_line(lines[0].removeprefix("moe-gspo train: error: "), mnt / "run" / "checkpoints", 2, last=1)
    assert ".tmp-step_00000002" not in r.stdout and "manifest.json" in r.stdout, r.stdout
    ck = mnt / "run" / "checkpoints"
    assert re.fullmatch(rf"moe-gspo train: error: resuming {mnt / 'run'}: out of space for its next checkpoint; "
                        rf"[\d.]+ KiB free on its file system; each checkpoint takes about [\d.]+ KiB, and "
                        rf"train.keep_checkpoints=3 needs room for 4 of them \(about [\d.]+ [KM]iB\): the kept ones "
                        rf"stay until the next is complete; the newest complete checkpoint is {ck / 'step_00000001'}"
                        rf", and --resume continues from it", lines[1]), lines[1]


def test_a_full_disk_under_tensorboard_is_one_line(tmp_path, monkeypatch, capsys):
    """A fresh run with TensorBoard on a file system with less than metrics.TENSORBOARD_ROOM free (shutil's view
    of it stubbed: TensorBoard's writer thread would print its own traceback on a really full one): one line naming
    the event file's directory, exit 2."""
    from moe_gspo.cli import main
    from moe_gspo.train import metrics

    real = shutil.disk_usage(tmp_path)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real._replace(free=metrics.TENSORBOARD_ROOM // 2))
    run = tmp_path / "run"
    assert main(RUN + ["logging.tensorboard=true", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("moe-gspo ")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert re.fullmatch(rf"moe-gspo train: error: writing {run / 'tensorboard'}: out of space; 512.0 KiB free on "
                        rf"its file system; no checkpoint was completed, so --resume starts from step 0", lines[0]), \
        lines[0]


def test_a_full_disk_under_a_metrics_line_is_one_line(tmp_path, monkeypatch, capsys):
    """metrics.jsonl's append failing with ENOSPC (the writer stubbed: the file system itself is what fills): one
    line naming the file, the space checkpoints need, and where --resume continues."""
    from moe_gspo.cli import main
    from moe_gspo.train import metrics

    def full(self, step, m):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(metrics.MetricsWriter, "write", full)
    run = tmp_path / "run"
    assert main(RUN + ["--out", str(run)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("moe-gspo ")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert re.fullmatch(rf"moe-gspo train: error: writing {run / 'metrics.jsonl'}: out of space; [\d.]+ [KMGT]iB "
                        rf"free on its file system; no checkpoint was completed, so --resume starts from step 0",
                        lines[0]), lines[0]


@pytest.mark.slow
def test_two_ranks_end_in_one_line_each_naming_the_rank(tmp_path, ckpt_bytes):
    """Two ranks (EP=2: both write shards) under torchrun, on one SmallDisk that holds two single-rank checkpoints
    (one of this layout's). Whichever rank's writer hits the full disk, the other learns of it only as an empty
    CheckpointException; each rank then ends in its own one line (out of space, naming the rank), unless torchrun
    stops it first (its SIGTERM line). Asserted is only what holds whichever rank fails first: the rank torchrun
    names as the root cause exited 2 after the out-of-space line; every rank wrote at most one line of ours, one of
    those two, and no traceback. Each rank's stderr is read from a file of its own (the ranks' lines on torchrun's
    stderr can interleave, and torchrun may stop a rank before it prints)."""
    run = tmp_path / "run"
    run.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", __file__, str(run), str(2 * ckpt_bytes), *RUN, "parallel.ep=2",
           "--out", str(run)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    first = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", r.stderr, re.S)
    assert first and first[2] == "2", r.stderr[-6000:]
    said = {}
    for rank in (0, 1):
        err = (tmp_path / f"rank_{rank}.err").read_text()
        assert "Traceback" not in err, err[-4000:]
        ours = [x for x in err.splitlines() if x.startswith("moe-gspo ")]
        assert len(ours) <= 1, err[-4000:]
        if ours:
            said[rank] = ours[0]
    root = int(first[1])
    for rank, line in said.items():
        prefix = f"moe-gspo train: error: rank {rank}: "
        assert line.startswith(prefix), line
        if rank == root or "stopped by SIGTERM" not in line:
            _assert_one_line(line.removeprefix(prefix), run / "checkpoints", 2, last=1)
    assert root in said, r.stderr[-6000:]
    assert Checkpoints(run / "checkpoints").steps() == [1]


class _Tee(io.TextIOBase):
    """stderr that also goes to a file of this rank's own."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "w", buffering=1)  # noqa: SIM115 - for the process's life

    def write(self, s: str) -> int:
        self.file.write(s)
        self.file.flush()
        return self.stream.write(s)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()


if __name__ == "__main__":  # one rank of test_two_ranks_end_in_one_line_each_naming_the_rank: RUN_DIR BYTES ARGV
    from moe_gspo.cli import main

    run_dir = Path(sys.argv[1])
    sys.stderr = _Tee(sys.stderr, run_dir.parent / f"rank_{os.environ['RANK']}.err")
    patches = pytest.MonkeyPatch()
    SmallDisk(run_dir, int(sys.argv[2])).install(patches)
    sys.exit(main(sys.argv[3:]))
