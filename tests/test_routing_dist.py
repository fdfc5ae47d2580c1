"""R2 Routing Replay under TP=2 (sequence parallel) and EP=2 with torchrun + gloo equals one process.

This file is also the torchrun worker:
    torchrun --nproc-per-node 2 tests/test_routing_dist.py --ckpt DIR --tp 2 --ep 1 --out OUT.pt
Each data-parallel rank records the old routing of its slice of a fixed global batch (T=11: odd, so sequence
parallelism pads), the router weights are perturbed identically everywhere, and a shuffled replay forward +
backward runs; rank 0 saves the replayed and live routing, the logits and the reduced router gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

B, T = 4, 11
LENGTHS = [11, 7, 9, 5]


def worker() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import moe_gspo
    from moe_gspo.config import ParallelConfig
    from moe_gspo.model.routing_capture import RoutingCapture
    from moe_gspo.train.optim import Optimizer, wrap_ddp
    from moe_gspo.routing import RoutingReplayCache

    sys.path.insert(0, str(Path(__file__).parent / "dist"))
    from parallel_worker import gather_by_dp  # noqa: E402
    from worker_args import checkpoint_args  # noqa: E402

    args = checkpoint_args()
    source = args.ckpt
    layout = ParallelConfig(tp=args.tp, ep=args.ep)
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source, parallel=layout), parallel=layout)
    mc = policy.model_config
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, mc.vocab_size, (B, T + 1), generator=g)
    per = B // dp
    rows = list(range(dp_rank * per, (dp_rank + 1) * per))
    x, y = ids[rows, :-1], ids[rows, 1:]

    cache = RoutingReplayCache("r2", mc.num_hidden_layers, mc.num_experts_per_tok, mc.num_experts)
    old = RoutingCapture()
    with torch.no_grad():
        policy(x, routing=old)
    cache.record_capture(rows, [LENGTHS[r] for r in rows], old)
    with torch.no_grad():
        for i, r in enumerate(policy.routers):  # the same perturbation on every rank
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(7 + i)) * 0.5)

    opt = Optimizer(wrap_ddp(policy, distributed=False), policy, lr=0.0)
    opt.zero_grad()
    perm = list(reversed(range(per)))  # replay in a shuffled order
    src = cache.replay_source([rows[p] for p in perm], T)
    cap = RoutingCapture(replay=src)
    logits = policy(x[perm], routing=cap)
    src.check_complete()
    V = logits.shape[-1]
    torch.nn.functional.cross_entropy(logits.reshape(-1, V), y[perm].reshape(-1)).backward()
    opt.reduce_grads()
    inv = torch.argsort(torch.tensor(perm))
    L, k = mc.num_hidden_layers, mc.num_experts_per_tok
    unperm = lambda t: t.view(per, T, *t.shape[1:])[inv]  # noqa: E731  (per, T, ...) in row order
    out = {"replayed": gather_by_dp(unperm(cap.stacked()), dp, dp_rank),
           "live": gather_by_dp(unperm(cap.live_stacked()), dp, dp_rank),
           "old": gather_by_dp(old.stacked().view(per, T, L, k), dp, dp_rank),
           "logits": gather_by_dp(logits.detach()[inv], dp, dp_rank),
           "router_grads": [r.weight.main_grad.clone() if getattr(r.weight, "main_grad", None) is not None
                            else r.weight.grad.clone() for r in policy.routers]}
    if dist.get_rank() == 0:
        torch.save(out, args.out)
    dist.barrier()
    dist.destroy_process_group()


def run_worker(ckpt, tp, ep, nproc, out):
    from helpers import run_torchrun

    run_torchrun(__file__, "--ckpt", ckpt, "--tp", tp, "--ep", ep, "--out", out, nproc=nproc)
    return torch.load(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("r2dist")
    ckpt = d / "ckpt"
    from helpers import make_hf_checkpoint

    make_hf_checkpoint(ckpt, vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4, topk=2,
                       inter=16, seed=3)
    return ckpt, d, run_worker(ckpt, 1, 1, 1, d / "single.pt")


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_r2_replay_parallel_equals_single_process(reference, tp, ep):
    ckpt, d, ref = reference
    mask = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None])  # (B, T)
    assert torch.equal(ref["replayed"][mask], ref["old"][mask])  # one process: replay reproduces the record
    assert not torch.equal(ref["live"][mask], ref["old"][mask])  # and the perturbation did move live routing
    out = run_worker(ckpt, tp, ep, 2, d / f"tp{tp}_ep{ep}.pt")
    for key in ("old", "replayed", "live"):
        assert torch.equal(out[key], ref[key]), f"{key} routing differs from the single-process run"
    torch.testing.assert_close(out["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    for i, (a, b) in enumerate(zip(out["router_grads"], ref["router_grads"])):
        assert b.abs().sum() > 0, f"router {i} got no gradient under replay"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"router {i} grad: {m}")


if __name__ == "__main__":
    worker()
