"""Eager reference for token_logprobs: logits -> log_softmax -> gather, the obvious way.

It materializes the [T, V] logits in fp32 (plus autograd's copies), so it is the memory the fused paths remove.
It is the `impl="eager"` switch for debugging and the oracle in tests. With a process group it runs megatron's
vocab-parallel cross-entropy pattern with autograd-aware collectives.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import vocab_parallel as vp


def token_logprobs_eager(hidden_TH, weight_VH, targets_T, *, temperature=1.0, return_entropy=False,
                         ignore_index=-100, process_group=None):
    """(logp [T] fp32, entropy [T] fp32 or None); see moe_gspo.kernels.token_logprobs."""
    _, world = vp.group_rank_size(process_group)
    V_local = weight_VH.shape[0]
    valid_T = vp.check_targets(targets_T, V_local * world, ignore_index)
    if world > 1:
        hidden_TH = vp.CopyToGroup.apply(hidden_TH, process_group)
    logits_TV = (hidden_TH @ weight_VH.t()).float() / temperature  # (T, V_local)
    start = vp.vocab_start(V_local, process_group)
    local_T = targets_T - start
    owned_T = valid_T & (local_T >= 0) & (local_T < V_local)
    idx_T = torch.where(owned_T, local_T, torch.zeros_like(local_T))
    if world == 1:
        logsm_TV = torch.log_softmax(logits_TV, dim=-1)
        logp = logsm_TV.gather(1, idx_T[:, None]).squeeze(1)
        ent = -(logsm_TV.exp() * logsm_TV).sum(-1) if return_entropy else None
    else:
        m_T = logits_TV.detach().amax(-1)
        dist.all_reduce(m_T, op=dist.ReduceOp.MAX, group=process_group)
        z_TV = logits_TV - m_T[:, None]
        e_TV = z_TV.exp()
        s_T = vp.ReduceFromGroup.apply(e_TV.sum(-1), process_group)
        zt_T = vp.ReduceFromGroup.apply(torch.where(owned_T, z_TV.gather(1, idx_T[:, None]).squeeze(1), 0.0),
                                        process_group)
        logp = zt_T - torch.log(s_T)
        ent = None
        if return_entropy:
            sd_T = vp.ReduceFromGroup.apply((e_TV * z_TV).sum(-1), process_group)
            ent = torch.log(s_T) - sd_T / s_T
    logp = torch.where(valid_T, logp, 0.0)
    if ent is not None:
        ent = torch.where(valid_T, ent, 0.0)
    return logp, ent
