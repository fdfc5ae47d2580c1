"""torchrun worker: vocab-parallel token_logprobs / fused_policy_loss at TP=world size (gloo) equal one process.

    torchrun --nproc-per-node 2 tests/dist_kernels_worker.py SEED OK_FILE

Every rank builds the same full inputs from SEED, runs the single-process op on the full LM head, then the
vocab-parallel op on its shard rows [r * V_local, (r + 1) * V_local), and compares values and gradients
(d hidden in full, d weight on its own rows). Exits non-zero with a message on the first mismatch.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_gspo.kernels import fused_logprob_loss, token_logprobs
from moe_gspo.train.logprob import fused_policy_loss


def close(a, b, tol, what):
    err = float((a.detach().double() - b.detach().double()).abs().max())
    scale = max(1.0, float(b.detach().abs().max()))
    if not err <= tol * scale:
        raise AssertionError(f"rank {dist.get_rank()}: {what}: max err {err:.3g} > {tol} * {scale:.3g}")


def main():
    seed = int(sys.argv[1])
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    T, H, V_local = 29, 12, 37
    V = V_local * world
    h = torch.randn(T, H, generator=g)
    w = torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (T,), generator=g)
    t[[0, 7]] = -100
    gl, ge = torch.randn(T, generator=g), torch.randn(T, generator=g)
    rows = slice(rank * V_local, (rank + 1) * V_local)

    def run(weight, impl, pg, chunk_bytes):
        hh, ww = h.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = token_logprobs(hh, ww, t, temperature=1.3, return_entropy=True, impl=impl, process_group=pg,
                                 chunk_bytes=chunk_bytes)
        (lp * gl + ent * ge).sum().backward()
        return lp, ent, hh.grad, ww.grad

    ref = run(w, "eager", None, 2**27)
    for impl, cb in (("eager", 2**27), ("chunked", 2**27), ("chunked", 12 * 8 * 16)):
        got = run(w[rows], impl, group, cb)
        for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), got, ref[:3] + (ref[3][rows],)):
            close(a, b, 2e-5, f"{impl}/{cb} {name}")

    lengths = [4, 9, 1, 15]
    cu = torch.tensor([0, 4, 13, 14, 29])
    mask = torch.rand(T, generator=g) > 0.2
    with torch.no_grad():
        old = token_logprobs(h, w, torch.where(mask, t, -100))[0] + 0.2 * torch.randn(T, generator=g)
    adv = torch.randn(len(lengths), generator=g)
    for loss in ("gspo", "grpo"):
        kw = dict(cu_seqlens=cu, loss_mask=mask, loss=loss, clip_low=0.1, clip_high=0.1,
                  chunk_bytes=4 * V * 2 * 10)  # TP: one-pass groups; one process: a two-pass group too
        outs = []
        for weight, pg in ((w, None), (w[rows], group)):
            hh, ww = h.clone().requires_grad_(), weight.clone().requires_grad_()
            value, metrics = fused_policy_loss(hh, ww, t, old, adv, process_group=pg, **kw)
            value.backward()
            outs.append((value, metrics["logp"], hh.grad, ww.grad))
        (v1, lp1, gh1, gw1), (v2, lp2, gh2, gw2) = outs
        close(v2, v1, 1e-5, f"{loss} value")
        close(lp2, lp1, 2e-5, f"{loss} logp")
        close(gh2, gh1, 2e-5, f"{loss} d hidden")
        close(gw2, gw1[rows], 2e-5, f"{loss} d weight")
    # a loss of the log-probs and the entropies (entropy_in_loss): the same objective as `run`'s, so its gradients
    # are the eager reference's, over one process and the vocab shards, in one-pass and two-pass groups
    bounds = cu.tolist()

    def ent_loss(lp, ent, b0, b1):
        s = slice(bounds[b0], bounds[b1])
        return (lp * gl[s]).sum() + (ent * ge[s]).sum()

    for weight, pg, cb in ((w, None, 4 * V * 2 * 10), (w[rows], group, 4 * V * 2 * 10), (w[rows], group, 4 * V * 6)):
        hh, ww = h.clone().requires_grad_(), weight.clone().requires_grad_()
        value, lp, ent = fused_logprob_loss(hh, ww, t, ent_loss, cu_seqlens=bounds, temperature=1.3, process_group=pg,
                                            chunk_bytes=cb, entropy_in_loss=True)
        value.backward()
        what = f"entropy_in_loss tp={1 if pg is None else world} chunk={cb}"
        close(lp, ref[0], 2e-5, f"{what} logp")
        close(ent, ref[1], 2e-5, f"{what} entropy")
        close(hh.grad, ref[2], 2e-5, f"{what} d hidden")
        close(ww.grad, ref[3] if pg is None else ref[3][rows], 2e-5, f"{what} d weight")
    dist.barrier()
    if rank == 0:  # a file, not stdout: the ranks share torchrun's stdout, where lines can interleave
        Path(sys.argv[2]).write_text(f"dist kernels OK at world size {world}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
