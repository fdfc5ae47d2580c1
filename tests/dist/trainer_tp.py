"""torchrun worker for tests/test_trainer_dist.py: the trainer's log-prob paths and one RL step under TP=2.

    torchrun --nproc-per-node 2 tests/dist/trainer_tp.py --out DIR [a.b=v ...]

Checks on every rank that the fused vocab-parallel log-probs (moe_gspo.kernels.token_logprobs on this rank's LM-head
shard) give the same values, entropies and parameter gradients as the eager path (gathered logits), then runs one
RL step with parallel.tp=2 into DIR/run.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from moe_gspo import init_parallel, load_policy
from moe_gspo.config import load_config
from moe_gspo.model.routing_capture import RoutingCapture
from moe_gspo.train.logprob import batch_logprobs
from moe_gspo.train.loop import train
from worker_args import override_args  # noqa: E402 (the worker's own folder)


def main():
    args = override_args()
    cfg = load_config("configs/train_tiny_cpu.yaml", args.overrides)
    policy = load_policy(cfg, init_parallel(cfg))
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    res = {}
    for impl in ("eager", "fused"):
        policy.zero_grad(set_to_none=True)
        logp, ent = batch_logprobs(policy, ids, RoutingCapture(), impl, temperature=0.8)
        (logp.sum() + 0.1 * ent.sum()).backward()
        res[impl] = (logp.detach(), ent.detach(), [p.grad.clone() for p in policy.parameters() if p.grad is not None])
    torch.testing.assert_close(res["fused"][0], res["eager"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res["fused"][1], res["eager"][1], atol=1e-5, rtol=1e-5)
    assert len(res["fused"][2]) == len(res["eager"][2])
    for gf, ge in zip(res["fused"][2], res["eager"][2]):
        torch.testing.assert_close(gf, ge, atol=1e-5, rtol=1e-4)
    m = train(cfg, run_dir=Path(args.out) / "run")
    if dist.get_rank() == 0:
        (Path(args.out) / "ok").write_text(repr(m["reward/mean"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
