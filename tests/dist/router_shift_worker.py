"""torchrun worker for tests/test_losses_moe.py: RSPO's router scores and weights under TP (sequence parallel) / EP.

    torchrun --nproc-per-node 2 tests/dist/router_shift_worker.py --ckpt DIR --tp 2 --ep 1 --out OUT.pt

Every rank loads the same HF checkpoint; each data-parallel rank takes its rows of one fixed global batch (T = 11,
odd, so sequence parallelism pads). The old-log-prob pass records the old experts and router scores (float32
storage, so the comparison is not blurred by rounding); before any change the current scores of those experts are
read back; then the router weights are perturbed identically on every rank, the per-token router-shift ratio of
the current router is computed, and one RSPO update (lr 0) runs. Global rank 0 saves, in global batch order, the
old experts and scores, the current scores before the perturbation, the ratios, the response mask, and the update's
pg_loss (averaged over ranks) and grad norm.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from parallel_worker import gather_by_dp  # noqa: E402
from worker_args import checkpoint_args  # noqa: E402 (the worker's own folder)

B, T = 4, 11
LENGTHS = [11, 7, 9, 11]  # every data-parallel rank holds a full-length row: EP gathers equal token counts
PROMPT = 3


def main():
    args = checkpoint_args()

    import moe_gspo
    from megatron.core import parallel_state as ps

    from moe_gspo.config import ParallelConfig, load_config
    from moe_gspo.model.routing_capture import RoutingCapture
    from moe_gspo.routing import RoutingReplayCache
    from moe_gspo.train.logprob import batch_logprobs
    from moe_gspo.train.optim import Optimizer, wrap_ddp
    from moe_gspo.train.step import StepContext, _router_shift_ratio, old_logprob_pass, update_minibatch

    source = args.ckpt
    layout = ParallelConfig(tp=args.tp, ep=args.ep)
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source, parallel=layout), parallel=layout)
    mc = policy.model_config
    # one micro-batch per forward here and in the single process: the pg_loss metric is a per-micro-batch mean
    cfg = load_config(None, ["algorithm.loss=rspo", "algorithm.router_score_dtype=float32", "train.lr=0",
                             "train.micro_batch_size=4", f"model.num_experts={mc.num_experts}"])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, mc.vocab_size, (B, T), generator=g)
    att = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    per = B // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    sids = torch.arange(B)[rows]
    pb = SimpleNamespace(input_ids=ids[rows], attention_mask=att[rows],
                         response_mask=att[rows] & (torch.arange(T)[None] >= PROMPT), routing=None, sample_ids=sids)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[rows]

    replay = RoutingReplayCache("off", mc.num_hidden_layers, mc.num_experts_per_tok, mc.num_experts)
    ctx = StepContext(policy, None, cfg, replay, None, policy.groups)
    ctx.optim = Optimizer(wrap_ddp(policy, distributed=False), policy, lr=0.0)
    old = old_logprob_pass(ctx, pb)

    def current_scores():
        src = old.router.source(torch.arange(per), T, policy.device)
        cap = RoutingCapture(score_at=src)
        with torch.no_grad():
            batch_logprobs(policy, pb.input_ids, cap, cfg.train.logprob_impl, want_entropy=False)
        return cap, src

    cap, _ = current_scores()
    cur_before = old.router.round(cap.scores_stacked())
    with torch.no_grad():
        for i, r in enumerate(policy.routers):  # the same perturbation on every rank
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(7 + i)) * 0.03)
    cap, src = current_scores()
    gamma = _router_shift_ratio(old.router, cap, src, (per, T))
    m = update_minibatch(ctx, pb, old, adv, torch.arange(per))
    loss = torch.tensor([m["pg_loss"]], dtype=torch.float64)
    dist.all_reduce(loss)

    L, k = mc.num_hidden_layers, mc.num_experts_per_tok
    out = {"old_idx": gather_by_dp(old.router.idx.long(), dp, dp_rank),
           "old_scores": gather_by_dp(old.router.scores, dp, dp_rank),
           "cur_before": gather_by_dp(cur_before.view(per, T, L, k), dp, dp_rank),
           "gamma": gather_by_dp(gamma, dp, dp_rank),
           "mask": gather_by_dp(pb.response_mask, dp, dp_rank),
           "metrics": {"pg_loss": float(loss) / dist.get_world_size(), "grad_norm": m["grad_norm"]}}
    if dist.get_rank() == 0:
        torch.save(out, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
