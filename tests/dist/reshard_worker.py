"""torchrun worker for tests/test_trainer_dist.py: resume a run at another TP x EP x DP layout.

    torchrun --nproc-per-node 2 tests/dist/reshard_worker.py --run-dir DIR [--fresh [--stop S]] [a.b=v ...]

Without --fresh: loads DIR's newest checkpoint at this layout, saves it again at this layout, and checks that every
tensor of the two (weights, fp32 main parameters, Adam moments), read back whole, is bit-identical; then resumes
`train` in DIR. With --fresh: trains from step 0 into DIR (the layout that writes the checkpoint); with --stop S as
well, it first trains DIR/../ref uninterrupted, then DIR to step S only, then resumes DIR to the end at this same
layout (the test compares the two runs' metrics).
"""

import argparse
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from moe_gspo.config import load_config
from moe_gspo.train.loop import train


def _with_main_params(full: dict) -> dict:
    """Without the distributed optimizer, fp32 weights are their own main parameters and are not stored twice."""
    main = "optimizer.state.fp32_param."
    implied = {main + k: v for k, v in full.items() if not k.startswith("optimizer.") and v.dtype == torch.float32}
    return {**implied, **full}


def check_load(cfg, run: Path) -> int:
    """Load the newest checkpoint into a fresh policy + optimizer at this layout, save it again at this layout, and
    compare every global tensor of the two checkpoints. Collective."""
    import moe_gspo
    from moe_gspo.checkpoint.store import Checkpoints
    from moe_gspo.train.optim import Optimizer, wrap_ddp
    from moe_gspo.checkpoint.sharded_io import load_full

    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    optim = Optimizer.from_config(wrap_ddp(policy, cfg.train.distributed_optimizer), policy, cfg.train,
                                  total_steps=cfg.train.steps * cfg.train.minibatches)
    ckpts = Checkpoints(run / "checkpoints")
    step = ckpts.latest()
    ctx = SimpleNamespace(policy=policy, optim=optim, reference=None)
    ckpts.load(step, ctx)
    again = Checkpoints(run / "resaved")
    again.save(step, ctx, {"step": step})
    want = _with_main_params(load_full(ckpts.root / ckpts.name(step) / "shards"))
    got = _with_main_params(load_full(again.root / again.name(step) / "shards"))
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after resharding"
    if dist.get_rank() == 0:
        shutil.rmtree(again.root)
    dist.barrier()
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--stop", type=int, default=0)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("configs/train_tiny_cpu.yaml", args.overrides)
    run = Path(args.run_dir)
    if not args.fresh:
        check_load(cfg, run)
    if args.fresh and args.stop:
        import dataclasses

        train(cfg, run_dir=run.parent / "ref")
        train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=args.stop)), run_dir=run)
        train(cfg, run_dir=run, resume=True)
    else:
        train(cfg, run_dir=run, resume=not args.fresh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
