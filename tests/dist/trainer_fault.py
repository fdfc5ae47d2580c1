"""torchrun worker for tests/test_trainer_dist.py: an uninterrupted run, then the same run SIGKILLed and resumed.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/dist/trainer_fault.py --out DIR [--kill-after 3] [a.b=v ...]

Attempt 0: runs DIR/ref to the end (marks DIR/ref/DONE), then starts DIR/run with checkpoints; right after step
--kill-after is logged, rank 1 kills itself with SIGKILL. torchrun restarts every worker (attempt 1): DIR/ref is
done, so it resumes DIR/run from its newest complete checkpoint and finishes. The test compares the two metric files.
"""

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from moe_gspo.train import loop as trainer
from moe_gspo.config import load_config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill-after", type=int, default=3)
    ap.add_argument("--config", default="configs/train_tiny_cpu.yaml")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    cfg = load_config(args.config, args.overrides)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not (out / "ref" / "DONE").exists():
        trainer.train(cfg, run_dir=out / "ref")
        dist.barrier()
        if dist.get_rank() == 0:
            (out / "ref" / "DONE").write_text("ok")
    if attempt == 0:
        log = trainer.Run.log

        def log_then_die(self, step, m, tokens, **kw):
            res = log(self, step, m, tokens, **kw)
            if step + 1 == args.kill_after and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return res

        trainer.Run.log = log_then_die
    say = trainer._say

    def say_and_record(info, msg):  # what rank 0 says, also in a file: the ranks' stderr lines can interleave
        say(info, msg)
        if dist.get_rank() == 0:
            with (out / "run_said.txt").open("a") as f:
                f.write(msg + "\n")

    trainer._say = say_and_record
    trainer.train(cfg, run_dir=out / "run", resume=True)
    if dist.get_rank() == 0:
        (out / "run" / "attempts.txt").write_text(str(attempt + 1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
