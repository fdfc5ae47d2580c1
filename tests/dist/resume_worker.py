"""torchrun worker for tests/test_resume_layouts.py: at each named layout, an uninterrupted run, and the same run
stopped after a checkpoint and resumed, one after the other in this process group.

    torchrun --nproc-per-node N tests/dist/resume_worker.py --out DIR --layouts tp2,dp2_nodist [a.b=v ...]

Writes DIR/<layout>/ref and DIR/<layout>/run; the test compares their metrics.jsonl.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from moe_gspo.config import load_config
from moe_gspo.train.loop import train

# the overrides of each layout (the world size comes from torchrun); TP needs as many key-value heads as ranks
LAYOUTS = {
    "tp2": ["parallel.tp=2", "model.num_key_value_heads=2"],
    "ep2": ["parallel.ep=2"],
    "ep2_nodist": ["parallel.ep=2", "train.distributed_optimizer=false"],
    "dp": [],
    "dp_nodist": ["train.distributed_optimizer=false"],
    "tp2_ep2": ["parallel.tp=2", "parallel.ep=2", "model.num_key_value_heads=2"],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--stop", type=int, required=True, help="the interrupted run stops after this step")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--config", default="configs/train_tiny_cpu.yaml")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in args.layouts.split(","):
        out = Path(args.out) / name
        over = [*args.overrides, *LAYOUTS[name]]
        train(load_config(args.config, [*over, f"train.steps={args.steps}"]), run_dir=out / "ref")
        train(load_config(args.config, [*over, f"train.steps={args.stop}"]), run_dir=out / "run")
        train(load_config(args.config, [*over, f"train.steps={args.steps}"]), run_dir=out / "run", resume=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
