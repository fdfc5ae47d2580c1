"""torchrun worker for tests/test_parallel.py: logits, grads and 3 steps of megatron's optimizer under TP x EP x DP.

    torchrun --nproc-per-node 4 tests/dist/parallel_worker.py --ckpt DIR --tp 2 --ep 2 --out OUT.pt [--distopt] \
        [--experts grouped|torch|megatron] [--also DIR2 OUT2.pt ...]

--also runs the same on further checkpoints in the same processes, one after the other (one start for several).

Loads the same HF checkpoint on every rank, feeds each data-parallel rank its contiguous slice of one fixed
global batch, and on global rank 0 saves the full logits, the full (unsharded) gradients after megatron's DDP
reduction (without the distributed optimizer, whose buffers hold only this rank's reduced shard), and the losses,
gradient norms and final weights of three optimizer steps with clipping active.
"""


import torch
import torch.distributed as dist

import moe_gspo
from moe_gspo.config import ModelConfig, ParallelConfig
from moe_gspo.model.routing_capture import RoutingCapture
from moe_gspo.train.optim import Optimizer, wrap_ddp
from worker_args import checkpoint_args  # noqa: E402 (the worker's own folder)


def _options(ap):
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=12)
    ap.add_argument("--distopt", action="store_true")
    ap.add_argument("--experts", default=None)  # None: the family's own (ModelConfig.experts)
    ap.add_argument("--also", nargs=2, action="append", default=[], metavar=("CKPT", "OUT"))


def main():
    args = checkpoint_args(_options)
    for ckpt, out in [(args.ckpt, args.out), *args.also]:
        run(args, ckpt, out)
    dist.destroy_process_group()


def run(args, ckpt: str, out: str):
    source = ModelConfig(init_from=ckpt, experts=args.experts)
    layout = ParallelConfig(tp=args.tp, ep=args.ep)
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source, parallel=layout), parallel=layout)
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(1234)
    V = policy.model_config.vocab_size
    ids = torch.randint(0, V, (args.batch, args.seq + 1), generator=g)
    per = args.batch // dp
    local = ids[dp_rank * per:(dp_rank + 1) * per]
    x, y = local[:, :-1], local[:, 1:]

    opt = Optimizer(wrap_ddp(policy, distributed=args.distopt), policy, lr=0.05, grad_clip=0.5, weight_decay=0.01,
                    total_steps=3)

    def loss_fn(routing=None):
        logits = policy(x, routing=routing)  # (b, T, V) gathered over TP
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1)), logits

    opt.zero_grad()
    cap = RoutingCapture()
    loss, logits = loss_fn(cap)
    loss.backward()
    opt.reduce_grads()
    grads = {k: p.main_grad.detach().clone() for k, p in policy.gpt.named_parameters()}
    full_grads = None if opt.distributed else policy_full(policy, grads)
    full_logits = gather_by_dp(logits.detach(), dp, dp_rank)
    full_routing = gather_by_dp(cap.stacked().view(per, args.seq, -1), dp, dp_rank)

    losses, norms = [], []
    opt.zero_grad()
    for _ in range(3):
        loss, _ = loss_fn()
        loss.backward()
        norms.append(opt.step())  # reduction, megatron's clipping (norm > 0.5 here), Adam
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append((t / dist.get_world_size()).item())
    weights = policy.full_megatron_state()
    sync = engine_sync(policy)
    if dist.get_rank() == 0:
        torch.save({"logits": full_logits, "grads": full_grads, "losses": losses, "routing": full_routing,
                    "grad_norms": norms, "weights": weights, "engine_sync": sync}, out)
    dist.barrier()


def gather_by_dp(t, dp, dp_rank):
    """(b_local, ...) on every rank -> (B, ...) in global batch order (one copy per data-parallel rank)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    ranks = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(ranks, torch.tensor([dp_rank]))
    first = {}
    for r, d in enumerate(ranks):
        first.setdefault(int(d), parts[r])
    return torch.cat([first[d] for d in range(dp)])


def engine_sync(policy):
    """The rollout engine's weight update on every rank (streamed under TP/EP) against a model built from the
    eager full export: the largest difference, and the peak bytes the stream held against the model's size."""
    from moe_gspo.rollout.hf_engine import HFEngine, model_from_export

    engine = HFEngine(policy)  # update_weights reads policy.stream_hf() in order on every rank
    config, eager = policy.export_hf()  # every rank gathers everything: the reference
    ref = model_from_export(config, eager)
    got, want = engine.model.state_dict(), ref.state_dict()
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    _, stream = policy.stream_hf()
    for k in stream:  # read it alone to record how much it held at once
        stream[k]
    return {"max_abs_diff": diff, "peak_bytes": getattr(stream, "peak_bytes", None),
            "model_bytes": sum(t.numel() * t.element_size() for t in eager.values())}


def policy_full(policy, grads):
    """Per-parameter tensors of this rank -> full tensors under per-expert names (a collective under TP/EP)."""
    return policy.gather_full(grads)


if __name__ == "__main__":
    main()
