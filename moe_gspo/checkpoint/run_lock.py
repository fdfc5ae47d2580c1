"""One run per directory: an advisory lock on RUN_DIR/.lock, held by trainer rank 0 for the whole run.

    with RunLock.held(run_dir, active=rank == 0):   # UserError naming the holder's pid and host when it is taken
        ...                                          # the run; the lock goes when the block ends or the process dies

The lock is `fcntl.flock` on a file descriptor kept open for the run, so a run killed by any signal never leaves a
stale lock: the kernel releases it with the process. The file holds "pid host" of its holder for the message a
second run gets. flock is per open file, not per process, and works between processes of one machine (and on the
shared file systems that support it); ranks on other nodes never take it, only trainer rank 0.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from moe_gspo.config import UserError

NAME = ".lock"


def stopped_at(run_dir: Path) -> tuple[int, int]:
    """(the last step metrics.jsonl logged, the newest checkpoint's step) of RUN_DIR, 0 for none: where a run that
    stopped without a word stands. Reads only; the checkpoint is the newest complete directory by name (a write is
    renamed into place whole), not verified."""
    from moe_gspo.checkpoint.store import Checkpoints

    run_dir = Path(run_dir)
    logged = 0
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                logged = max(logged, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):  # a line cut off by the stop
                pass
    except OSError:
        pass
    steps = Checkpoints(run_dir / "checkpoints").steps()
    return logged, steps[0] if steps else 0


def resume_hint(run_dir: Path, resume: str = "the same command with --resume") -> str:
    """Where RUN_DIR stopped and how to continue, for the line of a run that stopped: "during step 3 of RUN_DIR;
    <resume> continues from its checkpoint of step 2". `resume` names the command that continues."""
    logged, ckpt = stopped_at(run_dir)
    where = f"during step {logged + 1} of {run_dir}"
    if ckpt:
        return f"{where}; {resume} continues from its checkpoint of step {ckpt}"
    return f"{where}; it has no checkpoint yet, so {resume} starts it over from step 0"


class RunLock:
    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Create RUN_DIR if needed and lock it; UserError when another process holds it."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").split()
            os.close(fd)
            who = f"pid {holder[0]} on {holder[1]}" if len(holder) >= 2 else "another process"
            raise UserError(f"run directory {run_dir} is in use by {who} (another train, --resume or --overwrite "
                            "there is refused until it ends; choose another --out / train.out_dir)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


    @classmethod
    @contextmanager
    def held(cls, run_dir: Path, active: bool = True):
        """The lock on RUN_DIR for the block (nothing when not `active`: every rank but trainer rank 0)."""
        lock = cls.acquire(run_dir) if active else None
        try:
            yield lock
        finally:
            if lock is not None:
                lock.release()
