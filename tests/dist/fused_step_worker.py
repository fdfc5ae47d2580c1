"""One RL update through the loss-fused path and through the eager path, compared: the loss of every micro-batch,
every metric and every parameter gradient (of this rank's shards under TP).

    torchrun --nproc-per-node 2 tests/dist/fused_step_worker.py --out DIR [a.b=v ...]   # TP=2, parallel.tp=2
    compare_update(policy, cfg, case)                                                     # in-process, TP=1

The update is moe_gspo.train.step.update_minibatch on a fixed batch of random tokens with random advantages and
old (and reference) log-probs moved off the policy's own, so that ratios clip and the KL term has a gradient. The
optimizer is replaced by one that records the gradients and does not step, so both paths see the same weights.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import moe_gspo.train.step as step_mod
from moe_gspo.rollout.batch import PaddedRollout
from moe_gspo.routing import ExpertFlipTracker, RoutingReplayCache
from moe_gspo.train.step import OldPass, StepContext, old_logprob_pass, update_minibatch
from worker_args import override_args  # noqa: E402 (the worker's own folder)

# (algorithm.loss, overrides, old log-prob noise, kernel workspace in bytes or None for the default)
CASES = {
    "grpo_r2_kl": ("grpo", ["algorithm.routing_replay=r2", "algorithm.kl_beta=0.1", "algorithm.kl_estimator=k3"],
                   0.3, None),
    "gspo_temperature": ("gspo", ["rollout.temperature=0.7"], 1e-3, None),
    "gspo_token_kl_token_mean": ("gspo_token", ["algorithm.kl_beta=0.05", "algorithm.kl_estimator=low_var_kl",
                                                "algorithm.loss_agg_mode=token-mean"], 1e-3, None),
    # workspaces of 25 and 3 token rows ([V] logits + [V] entropy + [H] per row, fp32): the kernel splits each
    # micro-batch of 11-token rows into groups of two rows, or takes every row in two passes (8THV)
    "gspo_router_shift_2_rows": ("gspo", ["algorithm.router_shift=true", "algorithm.kl_beta=0.1",
                                          "algorithm.kl_estimator=k1"], 1e-3, 25 * 4 * (128 * 2 + 32)),
    "grpo_two_pass": ("grpo", ["algorithm.kl_beta=0.1", "algorithm.kl_estimator=k3"], 0.3, 3 * 4 * (128 * 2 + 32)),
}


class RecordingOptim:
    """Stands in for the optimizer: keeps the gradients at step() and leaves the weights alone."""

    def __init__(self, policy):
        self.policy, self.grads = policy, None

    def zero_grad(self):
        self.policy.zero_grad(set_to_none=True)

    def step(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters() if p.grad is not None}
        return 0.0


def batch(cfg, B=8, T=12, seed=0):
    """A right-padded batch: rows of 7..12 tokens, a 4-token prompt, random token ids."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 9, 7, 12, 10, 8, 11, 12])[:B]
    ids = torch.randint(3, cfg.model.vocab_size, (B, T), generator=g)
    pos = torch.arange(T)[None]
    attn = pos < lengths[:, None]
    ids = torch.where(attn, ids, 0)
    resp = attn & (pos >= 4)
    return PaddedRollout(ids, attn, resp, torch.zeros(B, T), None, torch.arange(B), torch.arange(B) // 4), g


def run_update(policy, cfg, impl, noise, seed=0):
    """(micro-batch losses, metrics, gradients) of one update_minibatch with train.loss_impl=impl."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_impl=impl))
    mc = cfg.model
    ctx = StepContext(policy, RecordingOptim(policy), cfg,
                      RoutingReplayCache(cfg.algorithm.routing_replay, mc.num_hidden_layers, mc.num_experts_per_tok,
                                         mc.num_experts),
                      ExpertFlipTracker(mc.num_hidden_layers, mc.num_experts), policy.groups)
    pb, g = batch(cfg, seed=seed)
    sids = pb.sample_ids
    first = old_logprob_pass(ctx, pb)
    old = first.old_logp
    old = torch.where(pb.response_mask, old + noise * torch.randn(old.shape, generator=g), 0.0)
    ref = torch.where(pb.response_mask, old + 0.3 * torch.randn(old.shape, generator=g), 0.0)
    adv = torch.randn(len(sids), generator=g)
    idx = torch.tensor([5, 0, 3, 6, 1, 2])  # two micro-batches of train.micro_batch_size=4: 4 and 2 rows
    losses = []

    def recording(fn):  # fn, appending the loss of the MicroOut it returns to `losses`
        def wrapped(*a, **k):
            out = fn(*a, **k)
            losses.append(float(out.loss.detach()))
            return out
        return wrapped

    inner = step_mod.micro_step  # the loss each micro-batch hands to backward
    step_mod.micro_step = recording(inner)
    try:
        metrics = update_minibatch(ctx, pb, OldPass(old, ref, first.router), adv, idx)
    finally:
        step_mod.micro_step = inner
    return losses, metrics, ctx.optim.grads


def compare_update(policy, cfg, case, atol=1e-6, rtol=1e-5):
    """Assert that the fused and eager updates agree; returns the largest gradient difference seen."""
    from moe_gspo.kernels import loss_fused

    _, _, noise, workspace = CASES[case]
    default = loss_fused.default_chunk_bytes
    if workspace is not None:
        loss_fused.default_chunk_bytes = lambda device: workspace
    try:
        fused = run_update(policy, cfg, "fused", noise)
    finally:
        loss_fused.default_chunk_bytes = default
    eager = run_update(policy, cfg, "eager", noise)
    (lf, mf, gf), (le, me, ge) = fused, eager
    assert len(lf) == len(le) == 2, (lf, le)
    torch.testing.assert_close(torch.tensor(lf, dtype=torch.float64), torch.tensor(le, dtype=torch.float64),
                               atol=atol, rtol=rtol, msg=lambda m: f"{case}: micro-batch losses {lf} vs {le}\n{m}")
    assert sorted(mf) == sorted(me), (sorted(mf), sorted(me))
    for k in me:
        assert abs(mf[k] - me[k]) <= atol + rtol * abs(me[k]), f"{case}: metric {k}: fused {mf[k]} eager {me[k]}"
    assert sorted(gf) == sorted(ge) and len(ge) == len(list(policy.parameters())), (sorted(gf), sorted(ge))
    worst = 0.0
    for n in ge:
        torch.testing.assert_close(gf[n], ge[n], atol=atol, rtol=rtol, msg=lambda m: f"{case}: d {n}\n{m}")
        worst = max(worst, float((gf[n] - ge[n]).abs().max()))
    assert any(float(x.abs().max()) > 1e-3 for x in ge.values()), f"{case}: no gradient to compare"
    assert me["pg_clipfrac"] > 0 or case.startswith("grpo"), f"{case}: nothing clipped"
    return worst


def case_cfg(base_overrides, case):
    from moe_gspo.config import load_config

    loss, extra, _, _ = CASES[case]
    return load_config("configs/train_tiny_cpu.yaml", [*base_overrides, f"algorithm.loss={loss}", *extra])


def main():
    import torch.distributed as dist

    from moe_gspo import init_parallel, load_policy

    args = override_args()
    source = case_cfg(args.overrides, "gspo_temperature")
    policy = load_policy(source, init_parallel(source))
    lines = []
    for case in CASES:
        worst = compare_update(policy, case_cfg(args.overrides, case), case)
        lines.append(f"{case} rank {dist.get_rank()} max |d grad| {worst:.3g}")
    out = torch.zeros(1)
    dist.all_reduce(out)
    Path(args.out, f"ok_{dist.get_rank()}").write_text("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
