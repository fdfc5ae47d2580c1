"""A run's file system running out of space, said in one line wherever it happens: the checkpoint write, a resume's
rewrite of metrics.jsonl, a metrics line, TensorBoard's event file.

    err = enospc(e)                       # the OSError(ENOSPC) in an exception's chain, or None
    advice(ckpts, free)                   # "9.1 MiB free on its file system; each checkpoint takes about ..."
    raise OutOfSpace(...)                 # a UserError: one line, exit code 2

The space a run needs is (train.keep_checkpoints + 1) checkpoints: the kept ones stay until the next one is complete.
The size of one is read from the newest checkpoint's manifest.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

from moe_gspo.config import UserError
from moe_gspo.config.checks import exception_chain


class OutOfSpace(UserError, RuntimeError):
    """A file of the run could not be written for lack of space (the message names the file or directory, the free
    bytes, the space checkpoints need, and the checkpoint `--resume` continues from)."""


def enospc(e: BaseException) -> OSError | None:
    """The OSError with errno ENOSPC in `e`'s chain, or None."""
    return next((x for x in exception_chain(e) if isinstance(x, OSError) and x.errno == errno.ENOSPC), None)


def free_bytes(path: Path) -> int:
    """Free bytes of the file system holding `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def size(n: float) -> str:
    """`n` bytes as a person reads them: "0 bytes", "4.0 KiB", "9.8 MiB"."""
    if n < 1024:
        return f"{int(n)} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def checkpoint_dirs(ckpts) -> list[Path]:
    """The complete checkpoint directories of `ckpts` (a checkpoint.Checkpoints), newest first."""
    return [ckpts.root / ckpts.name(s) for s in ckpts.steps()]


def checkpoint_bytes(d: Path) -> int | None:
    """Bytes of checkpoint directory `d`, from its manifest (the files it lists, plus the manifest); None when it
    cannot be read."""
    try:
        files = json.loads((Path(d) / "manifest.json").read_text())["files"]
        return sum(int(e["bytes"]) for e in files) + (Path(d) / "manifest.json").stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None


def newest_checkpoint_bytes(ckpts) -> int | None:
    """Bytes of the newest complete checkpoint of `ckpts` (a checkpoint.Checkpoints); None when it has none."""
    dirs = checkpoint_dirs(ckpts)
    return checkpoint_bytes(dirs[0]) if dirs else None


def advice(ckpts, free: int, each: int | None = None) -> str:
    """What a line about a full disk says after naming the file: the free space, what the checkpoints of `ckpts`
    (a checkpoint.Checkpoints) need ((keep + 1) x one checkpoint, `each` bytes or the newest one's size) and where
    `--resume` continues from."""
    keep = ckpts.keep
    dirs = checkpoint_dirs(ckpts)
    each = each if each is not None else newest_checkpoint_bytes(ckpts)
    need = (f"; each checkpoint takes about {size(each)}, and train.keep_checkpoints={keep} needs room for "
            f"{keep + 1} of them (about {size((keep + 1) * each)}): the kept ones stay until the next is complete"
            if each else "")
    last = (f"the newest complete checkpoint is {dirs[0]}, and --resume continues from it" if dirs else
            "no checkpoint was completed, so --resume starts from step 0")
    return f"{size(free)} free on its file system{need}; {last}"


def check_room_to_resume(ckpts, tmp_prefix: str) -> None:
    """Before a run resumes from `ckpts` (a checkpoint.Checkpoints): remove the partial directories (`tmp_prefix`*)
    an earlier write left, then raise OutOfSpace when the file system cannot hold one more checkpoint of the newest
    one's size (the first checkpoint the resumed run writes would fail after its steps were computed). For the
    process that holds the run's lock."""
    for p in ckpts.root.glob(f"{tmp_prefix}*"):
        shutil.rmtree(p, ignore_errors=True)
    each = newest_checkpoint_bytes(ckpts)
    free = free_bytes(ckpts.root)
    if each and free < each:
        raise OutOfSpace(f"resuming {ckpts.root.parent}: out of space for its next checkpoint; {advice(ckpts, free)}")


def reraise_out_of_space(e: BaseException, run_dir: Path, ckpts) -> None:
    """Raise OutOfSpace, one line naming the file, for an exception whose chain holds an OSError(ENOSPC) (a metrics
    line, TensorBoard's event file, the rewrite of metrics.jsonl); return for any other (a bug keeps its traceback).
    `ckpts`: the run's checkpoint.Checkpoints."""
    full = enospc(e)
    if full is None or isinstance(e, OutOfSpace):
        return
    where = full.filename or run_dir
    raise OutOfSpace(f"writing {where}: out of space; {advice(ckpts, free_bytes(Path(where)))}") from None
