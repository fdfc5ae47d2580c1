"""Eager reference for token_logprobs: logits -> log_softmax -> gather, the obvious way.

It materializes the [T, V] logits in fp32 (plus autograd's copies), so it is the memory the fused paths remove.
It is the `impl="eager"` switch for debugging and the oracle in tests. With a process group it runs megatron's
vocab-parallel cross-entropy pattern with autograd-aware collectives. token_logprobs_from_logits is the same math
on a full forward's logits [B, T, V], token-aligned (the rollout check and `train.logprob_impl=eager`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import vocab_parallel as vp


def _log_softmax_gather(logits_NV: torch.Tensor, idx_N: torch.Tensor, return_entropy: bool):
    """(log softmax(logits)[n, idx[n]] [N], entropy [N] or None) in the logits' dtype."""
    logsm_NV = torch.log_softmax(logits_NV, dim=-1)
    logp = logsm_NV.gather(-1, idx_N[..., None]).squeeze(-1)
    return logp, (-(logsm_NV.exp() * logsm_NV).sum(-1) if return_entropy else None)


def token_logprobs_from_logits(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float = 1.0,
                               return_entropy: bool = False):
    """Token-aligned log pi(input_ids[b, j] | prefix) from a full forward's logits; (B, T) float32, column 0 = 0.

    float32 log_softmax of logits / temperature (temperature 0, greedy sampling, reads as 1). With
    return_entropy, also the token-aligned entropy of the same distributions: (logp, entropy)."""
    t = 1.0 if temperature == 0 else temperature
    tgt = input_ids_BT[:, 1:].long().to(logits_BTV.device)
    lp, ent = _log_softmax_gather(logits_BTV[:, :-1].float() / t, tgt, return_entropy)
    pad = lambda x: torch.nn.functional.pad(x, (1, 0))  # noqa: E731
    return (pad(lp), pad(ent)) if return_entropy else pad(lp)


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
        logp, ent = _log_softmax_gather(logits_TV, idx_T, return_entropy)
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
