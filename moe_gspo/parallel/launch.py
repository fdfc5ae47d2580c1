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
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from moe_gspo.config.checks import error_line

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
    docstring). `preflight(command)` raises the UserError of a command that cannot start."""
    from moe_gspo.config import UserError

    try:
        preflight(command)
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
        if not reports:
            raise
        print(summary_line(reports, e.failures), file=sys.stderr, flush=True)
        return 2
    finally:
        for lg in loggers:
            lg.removeHandler(quiet)
            lg.propagate = True
        os.environ.pop(ERROR_DIR_ENV, None)
        os.environ.pop(LAUNCHER_PID_ENV, None)
        shutil.rmtree(root, ignore_errors=True)

