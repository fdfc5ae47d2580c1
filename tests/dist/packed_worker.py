"""Packed micro-batches (train.max_tokens_per_micro_batch) against row micro-batches on the same weights and batch:
the old-log-prob pass's log-probs, the routing R2 records, one update's gradients under R2 and R3 replay, and the
flip tracker's counts.

    torchrun --nproc-per-node 2 tests/dist/packed_worker.py --out DIR [a.b=v ...]   # parallel.tp=2 or parallel.ep=2
    compare_packed(policy, cfg, rows_of(rank))                                        # in-process

Each data-parallel rank takes its own rows (ROWS[dp_rank]), so under expert parallelism the ranks plan different
numbers of packed forwards (at a budget of BUDGET tokens, 3 for rank 0 and 1 for rank 1, which then splits its
forward in three) and must stay in step.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fused_step_worker import RecordingOptim  # noqa: E402

from moe_gspo.rollout.batch import PaddedRollout  # noqa: E402
from moe_gspo.routing import ExpertFlipTracker, RoutingReplayCache  # noqa: E402
from moe_gspo.train.step import StepContext, old_logprob_pass, update_minibatch  # noqa: E402
from worker_args import override_args  # noqa: E402 (the worker's own folder)

T, PROMPT, BUDGET = 12, 4, 24
ROWS = {0: [12, 9, 7, 12, 10, 8], 1: [3, 4, 5, 3, 4, 4]}  # tokens per row (prompt + response) of each data-parallel rank


class SummedOptim(RecordingOptim):
    """RecordingOptim that first sums over the TP group the gradients each TP rank holds for its shard of the
    tokens only (sequence parallelism: the norms, and the experts, which each TP rank runs on part of the tokens
    at expert-TP size 1), as megatron's gradient reduction does before the optimizer: packed and padded forwards
    shard the tokens differently, so only the sums compare."""

    def step(self):
        if self.policy.tp > 1:
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            for name, p in self.policy.named_parameters():
                if p.grad is not None and (getattr(p, "sequence_parallel", False) or ".mlp.experts." in name
                                           or "_layernorm" in name):
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        return super().step()


def rows_batch(cfg, lengths, seed=0):
    """(PaddedRollout with an engine routing table for R3, advantages): random tokens, PROMPT-token prompts."""
    mc = cfg.model
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    ids = torch.randint(3, mc.vocab_size, (B, T), generator=g)
    att = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(att, ids, 0)
    resp = att & (torch.arange(T)[None] >= PROMPT)
    # the "engine's" routing: k distinct random experts per position and layer (what R3 replays)
    scores = torch.rand(B, T, mc.num_hidden_layers, mc.num_experts, generator=g)
    routing = torch.sort(scores.topk(mc.num_experts_per_tok, dim=-1).indices, dim=-1).values.to(torch.int16)
    pb = PaddedRollout(ids, att, resp, torch.zeros(B, T), routing, torch.arange(B), torch.arange(B) // 2)
    adv = torch.randn(B, generator=g)
    return pb, adv


def run(policy, cfg, pb, adv):
    """(old log-probs, R2 cache contents, gradients, flip metrics) of one old pass and one update."""
    mc = cfg.model
    replay = RoutingReplayCache(cfg.algorithm.routing_replay, mc.num_hidden_layers, mc.num_experts_per_tok,
                                mc.num_experts)
    tracker = ExpertFlipTracker(mc.num_hidden_layers, mc.num_experts)
    ctx = StepContext(policy, SummedOptim(policy), cfg, replay, tracker, policy.groups)
    sids = pb.sample_ids
    if replay.mode == "r3":
        lengths = pb.attention_mask.sum(-1).tolist()
        replay.record_rollouts(sids, [pb.routing[b, :n - 1] for b, n in enumerate(lengths)])
    old = old_logprob_pass(ctx, pb)
    stored = {int(s): replay.get(s).clone() for s in sids} if replay.mode != "off" else {}
    moved = dataclasses.replace(old, old_logp=torch.where(pb.response_mask, old.old_logp - 0.02, 0.0))  # ratios != 1
    idx = torch.arange(len(sids)).flip(0)  # rows in another order than the rollout's
    update_minibatch(ctx, pb, moved, adv, idx)
    return old.old_logp, stored, ctx.optim.grads, tracker.metrics()


def compare_packed(policy, cfg, lengths, seed=0) -> dict[str, float]:
    """Assert packed == rows for R2 and R3; returns the largest differences seen."""
    pb, adv = rows_batch(cfg, lengths, seed)
    worst = {}
    for mode in ("r2", "r3"):
        base = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, routing_replay=mode))
        packed = dataclasses.replace(base, train=dataclasses.replace(base.train, max_tokens_per_micro_batch=BUDGET))
        (lr, sr, gr, fr), (lp, sp, gp, fp) = run(policy, base, pb, adv), run(policy, packed, pb, adv)
        torch.testing.assert_close(lp, lr, atol=1e-6, rtol=1e-6, msg=lambda m: f"{mode}: old log-probs\n{m}")
        assert sr.keys() == sp.keys() and all(torch.equal(sr[s], sp[s]) for s in sr), f"{mode}: R2 records differ"
        assert gr.keys() == gp.keys() and len(gr) == len(list(policy.parameters()))
        for n in gr:
            torch.testing.assert_close(gp[n], gr[n], atol=1e-6, rtol=1e-5, msg=lambda m: f"{mode}: d {n}\n{m}")
        assert any(float(g.abs().max()) > 1e-4 for g in gr.values()), f"{mode}: no gradient to compare"
        assert fr == fp, f"{mode}: flip metrics differ: {fr} vs {fp}"
        worst[mode] = max(float((gp[n] - gr[n]).abs().max()) for n in gr)
    return worst


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config

    args = override_args()
    cfg = load_config("configs/train_tiny_cpu.yaml", args.overrides)
    policy = load_policy(cfg, init_parallel(cfg))
    dp_rank = ps.get_data_parallel_rank()
    worst = compare_packed(policy, cfg, ROWS[dp_rank], seed=dp_rank)
    Path(args.out, f"ok_{dist.get_rank()}").write_text(f"rank {dist.get_rank()} max |d grad| {worst}\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
