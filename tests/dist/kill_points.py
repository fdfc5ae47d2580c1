"""For tests/test_faults.py: a single-process run SIGKILLed at each of several points of step 3, one forked child
per point (this process imports the package once and never starts torch.distributed itself).

    python tests/dist/kill_points.py OUT POINT[,POINT...] [a.b=v ...]

Each child trains OUT/<point> (train.steps, checkpoints after every step from the overrides) and kills itself with
SIGKILL at its point; this process checks that it died that way, and exits 0 when every child did. The test then
resumes each directory and compares it with an uninterrupted run.

Points: "rollout" (step 3 sampling), "update" (between step 3's two optimizer updates), "logged" (step 3's
metrics line written, its checkpoint not yet), "checkpoint" (step 3's shards written, its manifest not yet).
"""

import os
import signal
import sys
from pathlib import Path

import torch

from moe_gspo.config import load_config
from moe_gspo.checkpoint import sharded_io
from moe_gspo.train import loop, optim

KILL_STEP = 3  # 1-based, as metrics.jsonl numbers steps


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    """Patch the one place of `point` to SIGKILL this process during step KILL_STEP."""
    if point == "rollout":
        rollout = loop.Run.rollout

        def killed_rollout(self, step, refill=0):
            if step + 1 == KILL_STEP:
                _die()
            return rollout(self, step, refill)

        loop.Run.rollout = killed_rollout
    elif point == "update":
        step_fn, calls = optim.Optimizer.step, [0]

        def killed_step(self):
            calls[0] += 1
            if calls[0] == 2 * (KILL_STEP - 1) + 2:  # two updates a step: after step 3's first, before its second
                _die()
            return step_fn(self)

        optim.Optimizer.step = killed_step
    elif point == "logged":
        log = loop.Run.log

        def killed_log(self, step, m, tokens, **kw):
            out = log(self, step, m, tokens, **kw)
            if step + 1 == KILL_STEP:
                _die()
            return out

        loop.Run.log = killed_log
    elif point == "checkpoint":
        save = sharded_io.save_sharded

        def killed_save(sharded, directory):
            save(sharded, directory)
            if f"{KILL_STEP:08d}" in str(directory):
                _die()

        sharded_io.save_sharded = killed_save
    else:
        raise SystemExit(f"unknown kill point {point!r}")


def main():
    out, points, overrides = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
    torch.set_num_threads(1)
    cfg = load_config("configs/train_tiny_cpu.yaml", overrides)
    failed = []
    for point in points:
        pid = os.fork()
        if pid == 0:  # the child: one run, killed at its point
            arm(point)
            loop.train(cfg, run_dir=out / point)
            os._exit(3)  # it was not killed
        _, status = os.waitpid(pid, 0)
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            failed.append(f"{point}: {status}")
    if failed:
        raise SystemExit(f"not killed at: {failed}")


if __name__ == "__main__":
    main()
