"""torchrun worker for tests/test_idle_rank.py: the trainer on ranks 0-1 of a 3-rank job whose rank 2 never trains.

    torchrun --nproc-per-node 3 tests/dist/idle_rank_worker.py --store-port P --out DIR [a.b=v ...]
    torchrun --nproc-per-node 2 tests/dist/idle_rank_worker.py --out DIR [a.b=v ...]      # the trainer alone

With --store-port the ranks split the job as a launcher that places engines on ranks of their own would: every rank
opens a client of a TCPStore (rank 0 hosts it, on that port); the trainer ranks initialize torch.distributed on
PrefixStore("trainer") with world 2, so megatron's groups hold the trainer ranks only; every rank joins a "bridge"
ProcessGroupGloo over all 3. The idle rank waits on the bridge while the trainer trains; the trainer ranks meet it
there when done. Without it, the trainer ranks are the whole torchrun world (the reference run).

In both, a collective that trainer code (moe_gspo/train, moe_gspo/parallel) runs without a group fails at once,
naming the call site: with engine ranks in the job's default group, such a call would wait on ranks that never
join it. Rank 0 writes DIR/metrics.jsonl and DIR/groups.json (the sizes megatron's groups have).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
TRAINER_RANKS = 2
TRAINER_CODE = tuple(str(ROOT / "moe_gspo" / d) + os.sep for d in ("train", "parallel"))
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter_tensor", "all_to_all_single",
               "gather_object", "scatter_object_list", "monitored_barrier")


def refuse_default_group_in_trainer_code() -> None:
    """Wrap torch.distributed's collectives: a call from trainer code with no group (or the default group) raises."""
    for name in COLLECTIVES:
        fn = getattr(dist, name)
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def guarded(*args, _fn=fn, _sig=sig, _name=name, **kwargs):
            group = _sig.bind(*args, **kwargs).arguments.get("group")
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(TRAINER_CODE) and (group is None or group is dist.group.WORLD):
                raise RuntimeError(f"dist.{_name} on the default group from trainer code "
                                   f"{caller.f_code.co_filename}:{caller.f_lineno}")
            return _fn(*args, **kwargs)

        setattr(dist, name, guarded)


class ParityTask:
    """The configured task with the parity of the response's length as its reward: reward variance in every group
    of the untrained tiny policy, so that every step updates."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward_fn(self, response, ex):
        return float(len(response) % 2)


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--store-port", type=int, default=0)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    bridge = None
    if args.store_port:
        timeout = datetime.timedelta(seconds=60)  # a collective that waits on the wrong ranks fails within this
        store = dist.TCPStore("127.0.0.1", args.store_port, world, is_master=rank == 0, timeout=timeout)
        bridge = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), rank, world, datetime.timedelta(minutes=5))
        if rank >= TRAINER_RANKS:  # idle: joins nothing but the bridge, until the trainer is done
            bridge.barrier().wait()
            return
        dist.init_process_group("gloo", store=dist.PrefixStore("trainer", store), rank=rank,
                                world_size=TRAINER_RANKS, timeout=timeout)
        os.environ["WORLD_SIZE"] = str(TRAINER_RANKS)  # what the launcher tells the trainer its world is
    refuse_default_group_in_trainer_code()

    from helpers import tiny_cfg
    from megatron.core import parallel_state as ps

    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.loop import train

    cfg = tiny_cfg(*args.overrides)
    train(cfg, run_dir=args.out, task=ParityTask(task_from_config(cfg.rollout)))
    if rank == 0:
        sizes = {"world": dist.get_world_size(), "dp": ps.get_data_parallel_world_size(),
                 "ep": ps.get_expert_model_parallel_world_size(),
                 "expert_dp": ps.get_expert_data_parallel_world_size()}
        (Path(args.out) / "groups.json").write_text(json.dumps(sizes))
    if bridge is not None:
        bridge.barrier().wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
