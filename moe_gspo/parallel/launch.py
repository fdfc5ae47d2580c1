"""Run a moe-gspo command on torchrun's ranks, and end an error a user can cause in one line.

    moe-gspo launch [torchrun options] -- COMMAND [args]     # scripts/launch.sh builds this line
    moe-gspo launch --nproc-per-node 2 -- train --config configs/train_tiny_cpu.yaml parallel.ep=2

torch.distributed.run starts the ranks from this process, each running `python -m moe_gspo.cli COMMAND`. Before
that, the CLI's `preflight` (a train, train-lm or rollout command's config, loaded once) runs here, so that a bad
field fails in one process instead of on every rank.

Under this launcher a rank does not print its UserError: `moe_gspo.cli.main` writes it to the directory named by
$MOE_GSPO_ERROR_DIR (report_user_error) and leaves the job; a rank that fails after another one reported (a
collective whose peer left) exits quietly. The launcher then prints one line and exits 2: the message when every
failed rank reported the same one, otherwise the lowest reporting rank's, naming that rank. torchrun's own account
of the failure (its log lines and the ChildFailedError summary) is left out then. A job whose ranks failed without
a report (a bug: the rank printed its traceback) ends as under torchrun, exit 1. Each node's launcher sees only its
own ranks.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from moe_gspo.config.checks import error_line, exception_chain

ERROR_DIR_ENV = "MOE_GSPO_ERROR_DIR"
"""The directory the ranks report user errors to (set by the launcher for its ranks)."""
LAUNCHER_PID_ENV = "MOE_GSPO_LAUNCHER_PID"
"""The launcher's process id: only its own children, the ranks, report (a process a rank starts inherits the
environment but prints its errors itself)."""
GRACE_S = 5.0
"""How long a rank that reported waits for the node's other ranks to report too (see report_user_error)."""
PREFLIGHT = ("train", "train-lm", "rollout")
"""The commands whose --config is a run config that load_config reads (compare and study have their own)."""


# ------------------------------------------------------------------------------------------------ rank side
def _attempt_dir() -> Path | None:
    """This rank's report directory: one per torchrun attempt, so that a restarted job reads only its own
    reports. None outside the launcher."""
    root = os.environ.get(ERROR_DIR_ENV)
    if not root or os.environ.get(LAUNCHER_PID_ENV) != str(os.getppid()):
        return None
    return Path(root) / f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def report_user_error(command: str, message: str) -> bool:
    """Under the launcher: write this rank's user error for the launcher to print, then wait until every rank of
    this node has reported or GRACE_S has passed; False (nothing written) outside it.

    The wait keeps this rank alive while its peers catch up: a peer blocked in a collective on this rank stays
    blocked instead of failing with a closed connection, and a peer on its way to the same error gets to report it,
    so that the launcher can tell an error every rank hit from one only some ranks hit."""
    d = _attempt_dir()
    if d is None:
        return False
    d.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    tmp = d / f".rank_{rank}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "command": command, "message": message}))
    os.replace(tmp, d / f"rank_{rank}.json")  # whole or absent for a reader
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    deadline = time.monotonic() + GRACE_S
    while len(list(d.glob("rank_*.json"))) < local and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def another_rank_reported() -> bool:
    """Whether a rank of this node other than this one reported a user error in this attempt: then this rank's own
    failure is most likely its consequence (a collective whose peer left), and the report says all there is."""
    d = _attempt_dir()
    if d is None or not d.is_dir():
        return False
    own = f"rank_{os.environ.get('RANK', '0')}.json"
    return any(p.name != own for p in d.glob("rank_*.json"))


def under_launcher() -> bool:
    """Whether this process is a rank `moe-gspo launch` started (which then prints the job's one line)."""
    return _attempt_dir() is not None


def peer_lost(e: BaseException) -> bool:
    """Whether `e` (or an exception it was raised from or while handling) is a collective failing because a peer
    process went away: gloo's "Connection closed by peer" / "Connection reset by peer", or torch's
    DistNetworkError."""
    import torch.distributed as dist

    return any(isinstance(x, getattr(dist, "DistNetworkError", ())) or (
        isinstance(x, RuntimeError) and ("Connection closed by peer" in str(x) or "Connection reset by peer" in str(x)))
        for x in exception_chain(e))


STOP_WAIT_S = 30.0
"""How long a rank whose peer went away waits for the launcher's SIGTERM before it reports its own failure."""


def wait_for_stop() -> None:
    """Wait up to STOP_WAIT_S for the signal torchrun sends every rank once one has died (SIGTERM, which ends this
    process: silently by default, or with the line `stop_line_on_sigterm` installs). A peer's death is reported by
    the launcher, or by that handler, not by this rank's traceback of a collective that lost its peer."""
    import time

    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.1)


def stop_line_on_sigterm(command: str, rank: int, where) -> None:
    """Under torchrun without `moe-gspo launch`: on SIGTERM print one line, this rank, what sends SIGTERM and
    `where()` (the step and how to resume), then exit 143 at once (a rank in a collective with a dead peer could
    not unwind cleanly). torchrun sends SIGTERM to every surviving rank when one fails; its own report names the
    failed rank."""
    import signal

    def on_term(signum, frame):
        try:
            msg = ("stopped by SIGTERM (torchrun stops every rank once one fails, its report names that rank; a "
                   f"scheduler sends it before preemption) {where()}")
            print(error_line(command, msg, rank), file=sys.stderr, flush=True)
        finally:
            os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)


# ----------------------------------------------------------------------------------------------- launcher side
def read_reports(d: Path) -> dict[int, dict]:
    """{rank: {"rank", "command", "message"}} of the reports in one attempt's directory."""
    return {int(r["rank"]): r for r in (json.loads(p.read_text()) for p in sorted(d.glob("rank_*.json")))}


def summary_line(reports: dict[int, dict], failed: Iterable[int]) -> str:
    """The one line for a failed job: the message when every failed rank reported that same message, else the
    lowest reporting rank's message naming its rank."""
    first = reports[min(reports)]
    failed = set(failed) | set(reports)
    same = all(r in reports and reports[r]["message"] == first["message"] for r in failed)
    return error_line(first["command"], first["message"], None if same else first["rank"])


# what usually sends each signal to a training rank, for the line naming it
SIGNAL_CAUSES = {"SIGKILL": "the out-of-memory killer, or kill -9", "SIGSEGV": "a crash in native code",
                 "SIGBUS": "a crash in native code, or shared memory (/dev/shm) running out",
                 "SIGABRT": "an abort in native code", "SIGINT": "an interrupt", "SIGHUP": "its terminal closing"}


def resume_command(torchrun_args: list[str], command: list[str]) -> str:
    """The launch command line that continues `command` from its newest checkpoint: the same, with --resume in
    place of --overwrite."""
    cmd = [a for a in command if a != "--overwrite"]
    if "--resume" not in cmd:
        cmd.append("--resume")
    return "moe-gspo launch " + shlex.join([*torchrun_args, "--", *cmd])


def dead_rank(failures: dict) -> tuple[int, object] | None:
    """(rank, failure) of the lowest rank a signal killed, from ChildFailedError.failures; the ranks torchrun
    itself stopped with SIGTERM once another failed do not count. None when no rank was killed."""
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and f.signal_name() != "SIGTERM"}
    return (min(killed), killed[min(killed)]) if killed else None


def dead_rank_line(command: str, rank: int, failure, where: str | None) -> str:
    """The one line for a rank a signal killed: which rank, process (on this node: each node's launcher sees only
    its own ranks) and signal, what usually sends it, and `where` (run_lock.resume_hint: the step and the command
    that resumes) when the command is a training run."""
    sig = failure.signal_name()
    cause = SIGNAL_CAUSES.get(sig)
    import socket

    msg = f"rank {rank} (pid {failure.pid} on {socket.gethostname()}) was killed by {sig}"
    msg += f" ({cause})" if cause else ""
    return error_line(command, f"{msg} {where}" if where else msg)


class _UnlessReported(logging.Handler):
    """Passes torchrun's log records on to torch's handlers while no rank has reported a user error: after a
    report, its lines about the failed and stopped ranks would only bury the one line that matters."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def emit(self, record: logging.LogRecord) -> None:
        if not any(self.root.glob("attempt_*/rank_*.json")):
            logging.getLogger("torch").handle(record)


def launch(torchrun_args: list[str], command: list[str], preflight) -> int:
    """Run `moe_gspo.cli COMMAND` on the ranks torchrun's options describe; the exit code (see the module
    docstring). `preflight(command)` raises the UserError of a command that cannot start; for a training command it
    returns a function of the command line that resumes it, giving where the run stands and how to go on (None for
    other commands)."""
    from moe_gspo.config import UserError

    try:
        where_stopped = preflight(command)
    except UserError as e:
        if getattr(e, "detail", None):
            print(e.detail.rstrip("\n"), file=sys.stderr, flush=True)
        print(error_line(command[0], str(e)), file=sys.stderr, flush=True)
        return 2

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args([*torchrun_args, "-m", "moe_gspo.cli", *command])
    root = Path(tempfile.mkdtemp(prefix="moe-gspo-errors-"))
    os.environ[ERROR_DIR_ENV] = str(root)  # the ranks inherit the launcher's environment
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    quiet = _UnlessReported(root)
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.launcher")]
    for lg in loggers:
        lg.addHandler(quiet)
        lg.propagate = False
    try:
        run(args)
        return 0
    except ChildFailedError as e:
        # the error of the attempt that failed last: torchrun gives up once --max-restarts restarts are spent
        reports = read_reports(root / f"attempt_{args.max_restarts}")
        if reports:
            print(summary_line(reports, e.failures), file=sys.stderr, flush=True)
            return 2
        dead = dead_rank(e.failures)
        if dead is None:
            raise
        where = where_stopped and where_stopped(f"`{resume_command(torchrun_args, command)}`")
        print(dead_rank_line(command[0], *dead, where), file=sys.stderr, flush=True)
        return 1
    finally:
        for lg in loggers:
            lg.removeHandler(quiet)
            lg.propagate = True
        os.environ.pop(ERROR_DIR_ENV, None)
        os.environ.pop(LAUNCHER_PID_ENV, None)
        shutil.rmtree(root, ignore_errors=True)

