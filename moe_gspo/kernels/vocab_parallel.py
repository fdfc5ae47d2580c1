"""Vocab-parallel plumbing shared by every implementation of token_logprobs.

Megatron's VocabParallel output layer gives rank r of the tensor-parallel group the rows
[r * V_local, (r + 1) * V_local) of the LM head. Every implementation first reduces its local vocab
shard to three fp32 numbers per token, then merges them over the group here:

    m   running max of the logits                         (all-reduce MAX)
    s   sum_j exp(z_j - m)                                 (all-reduce SUM after rescaling to the global m)
    sd  sum_j exp(z_j - m) * (z_j - m)                     (entropy term, same rescaling)
    zt  the target logit, 0 on ranks that do not own it    (all-reduce SUM)

From them: lse = m + log s, logp = zt - lse, entropy = log s - sd / s.
The same merge combines vocab chunks on one rank (`merge_stats`), so there is one formula, tested once.
The process group is always passed in; nothing here reads a global group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_rank_size(process_group) -> tuple[int, int]:
    """(rank, world size) within `process_group`; (0, 1) when it is None."""
    if process_group is None:
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def vocab_start(weight_V: int, process_group) -> int:
    """First global vocab id held by this rank's shard of V_local rows."""
    rank, _ = group_rank_size(process_group)
    return rank * weight_V


def rescale(m_T: torch.Tensor, s_T: torch.Tensor, sd_T: torch.Tensor, m_new_T: torch.Tensor):
    """Re-express (s, sd) accumulated against max m as sums against max m_new >= m (fp32, [T])."""
    alpha = torch.exp(m_T - m_new_T)  # m = -inf (nothing seen yet) gives 0
    shift = torch.where(s_T > 0, (m_T - m_new_T) * s_T, torch.zeros_like(s_T))
    return s_T * alpha, (sd_T + shift) * alpha


def merge_stats(m_T, s_T, sd_T, bm_T, bs_T, bsd_T):
    """Online-softmax merge of running stats (m, s, sd) with a block's stats (bm, bs, bsd)."""
    m_new = torch.maximum(m_T, bm_T)
    s_a, sd_a = rescale(m_T, s_T, sd_T, m_new)
    s_b, sd_b = rescale(bm_T, bs_T, bsd_T, m_new)
    return m_new, s_a + s_b, sd_a + sd_b


def allreduce_stats(m_T, s_T, sd_T, zt_T, process_group):
    """Merge per-rank stats over the vocab-parallel group (two collectives). No-op without a group."""
    if process_group is None or dist.get_world_size(process_group) == 1:
        return m_T, s_T, sd_T, zt_T
    m_glob = m_T.clone()
    dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=process_group)
    s_T, sd_T = rescale(m_T, s_T, sd_T, m_glob)
    packed = torch.stack([s_T, sd_T, zt_T])  # (3, T)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=process_group)
    return m_glob, packed[0], packed[1], packed[2]


def finish_stats(m_T, s_T, sd_T, zt_T, valid_T):
    """(logp, entropy, lse) from merged stats; rows with valid=False give 0."""
    log_s = torch.log(s_T)
    lse = m_T + log_s
    zero = torch.zeros_like(lse)
    logp = torch.where(valid_T, zt_T - lse, zero)
    ent = torch.where(valid_T, log_s - sd_T / s_T, zero)
    return logp, ent, lse


def allreduce_sum_(t: torch.Tensor, process_group) -> torch.Tensor:
    """In-place SUM over the group (the partial d hidden of each vocab shard)."""
    if process_group is not None and dist.get_world_size(process_group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=process_group)
    return t


class CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce SUM backward (megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, process_group):
        ctx.process_group = process_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return allreduce_sum_(g.clone(), ctx.process_group), None


class ReduceFromGroup(torch.autograd.Function):
    """All-reduce SUM forward; identity backward (megatron's reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, process_group):
        return allreduce_sum_(x.clone(), process_group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def check_targets(targets_T: torch.Tensor, V_global: int, ignore_index: int) -> torch.Tensor:
    """Validate global target ids (CPU only, to avoid a device sync); returns the valid-row mask."""
    valid = targets_T != ignore_index
    if not targets_T.is_cuda and targets_T.numel():
        bad = valid & ((targets_T < 0) | (targets_T >= V_global))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"token_logprobs: targets[{i}] = {int(targets_T[i])} is outside the vocab [0, {V_global}) "
                f"and is not ignore_index={ignore_index}")
    return valid
