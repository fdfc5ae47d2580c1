"""torchrun worker for tests/test_rollout_correction.py: one update with the rollout correction under TP / EP.

    torchrun --nproc-per-node 2 tests/dist/rollout_corr_worker.py --ckpt DIR --tp 2 --out OUT.pt

Every rank loads the same HF checkpoint and takes its data-parallel rows of one fixed global batch. The old-log-prob
pass gives pi_trainer; the "engine" log-probs are pi_trainer plus a fixed perturbation on the response tokens, so
some token ratios exceed the truncation bound and some tokens are rejected. Three updates run at lr 0 on the same
weights: eager and fused loss paths (decoupled: token TIS + token_k2 rejection) and the bypass mode (engine
log-probs as pi_old, seq_mean_k1 rejection against the current policy). Global rank 0 saves each update's
rank-averaged metrics (pg_loss, grad norm, rollout_corr/*).
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from worker_args import checkpoint_args  # noqa: E402 (the worker's own folder)

sys.path.insert(0, str(Path(__file__).parent))

B, T = 4, 11
LENGTHS = [11, 7, 9, 11]
PROMPT = 3
CORRECTION = ["algorithm.rollout_is=token", "algorithm.rollout_is_threshold=1.03", "algorithm.rollout_rs=token_k2",
              "algorithm.rollout_rs_threshold=0.002"]
BYPASS = ["algorithm.use_engine_logprobs=true", "algorithm.bypass_token_ratios=true",
          "algorithm.rollout_rs=seq_mean_k1", "algorithm.rollout_rs_threshold=[0.99,1.01]"]


def main():
    args = checkpoint_args()

    import moe_gspo
    from megatron.core import parallel_state as ps

    from moe_gspo.config import ParallelConfig, load_config
    from moe_gspo.routing import RoutingReplayCache
    from moe_gspo.train.optim import Optimizer, wrap_ddp
    from moe_gspo.train.step import OldPass, StepContext, old_logprob_pass, update_minibatch

    source = args.ckpt
    layout = ParallelConfig(tp=args.tp, ep=args.ep)
    policy = moe_gspo.load_policy(source, moe_gspo.init_parallel(source, parallel=layout), parallel=layout)
    mc = policy.model_config
    base = ["algorithm.loss=grpo", "algorithm.track_flips=false", "train.lr=0", "train.micro_batch_size=2",
            f"model.num_experts={mc.num_experts}"]
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, mc.vocab_size, (B, T), generator=g)
    att = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    resp = att & (torch.arange(T)[None] >= PROMPT)
    noise = 0.06 * torch.randn(B, T, generator=g)
    per = B // dp
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    sids = torch.arange(B)[rows]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[rows]
    pb = SimpleNamespace(input_ids=ids[rows], attention_mask=att[rows], response_mask=resp[rows], routing=None,
                         sample_ids=sids)

    cfg = load_config(None, base + CORRECTION + ["train.loss_impl=eager"])
    replay = RoutingReplayCache("off", mc.num_hidden_layers, mc.num_experts_per_tok, mc.num_experts)
    ctx = StepContext(policy, None, cfg, replay, None, policy.groups)
    ctx.optim = Optimizer(wrap_ddp(policy, distributed=False), policy, lr=0.0)
    old = old_logprob_pass(ctx, pb).old_logp
    pb.engine_logprobs = torch.where(pb.response_mask, old + noise[rows], 0.0)  # the "engine"

    out = {}
    for name, ovs in (("eager", CORRECTION + ["train.loss_impl=eager"]),
                      ("fused", CORRECTION + ["train.loss_impl=fused"]),
                      ("bypass", BYPASS + ["train.loss_impl=fused"])):
        ctx = StepContext(policy, ctx.optim, load_config(None, base + ovs), replay, None, policy.groups)
        pi_old = ctx.correction.pi_old(old, pb.engine_logprobs)
        m = update_minibatch(ctx, pb, OldPass(pi_old), adv, torch.arange(per))
        keys = sorted(k for k in m if k == "pg_loss" or k.startswith("rollout_corr/"))
        vals = torch.tensor([m[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(vals)  # means over data-parallel rows (and identical values over TP ranks)
        out[name] = {k: float(v) / dist.get_world_size() for k, v in zip(keys, vals)}
        out[name]["grad_norm"] = m["grad_norm"]
    if dist.get_rank() == 0:
        torch.save(out, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
