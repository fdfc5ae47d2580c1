"""torchrun worker for tests/test_trainer_dist.py: resume a run at another TP x EP x DP layout.

    torchrun --nproc-per-node 2 tests/dist/reshard_worker.py --run-dir DIR [--fresh] [a.b=v ...]

Without --fresh: loads DIR's newest checkpoint at this layout and checks on rank 0 that the weights, the fp32 main
parameters and the Adam moments gathered back from every rank's shard equal the files bit for bit; then resumes
`train` in DIR. With --fresh: trains from step 0 into DIR (the layout that writes the checkpoint).
"""

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from moe_gspo.config import load_config
from moe_gspo.train.loop import train


def check_load(cfg, run: Path) -> int:
    """Load the newest checkpoint into a fresh policy + optimizer at this layout; compare with the files."""
    import moe_gspo
    from moe_gspo.train.checkpoint import Checkpoints
    from moe_gspo.train.optim import Optimizer, wrap_ddp

    policy = moe_gspo.load_policy(cfg)
    optim = Optimizer.from_config(wrap_ddp(policy, cfg.train.distributed_optimizer), policy, cfg.train,
                                  total_steps=cfg.train.steps * cfg.train.minibatches)
    ckpts = Checkpoints(run / "checkpoints")
    step = ckpts.latest()
    ckpts.load(step, SimpleNamespace(policy=policy, optim=optim, reference=None))
    model = policy.full_megatron_state()
    opt = {f"{kind}/{k}": v for kind, d in optim.local_state().items() for k, v in policy.gather_full(d).items()}
    if dist.get_rank() == 0:
        d = ckpts.root / ckpts.name(step)
        for name, want in (("model", load_file(d / "model.safetensors")),
                           ("optimizer", load_file(d / "optimizer.safetensors"))):
            got = model if name == "model" else opt
            assert set(got) == set(want), (name, sorted(set(got) ^ set(want))[:5])
            for k in want:
                assert torch.equal(got[k], want[k]), f"{name} {k} differs after resharding"
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("configs/train_tiny_cpu.yaml", args.overrides)
    run = Path(args.run_dir)
    if not args.fresh:
        check_load(cfg, run)
    train(cfg, run_dir=run, resume=not args.fresh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
