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
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from moe_gspo.config import UserError

NAME = ".lock"


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
