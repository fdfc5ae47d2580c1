"""Token log-probs of a right-padded batch under the policy, token-aligned like PaddedRollout.

    logp_BT, ent_BT = batch_logprobs(policy, input_ids_BT, capture, impl="fused", temperature=1.0)
    # logp_BT[b, j] = log pi(input_ids[b, j] | input_ids[b, :j]) at softmax(logits / temperature); column 0 is 0

"fused" runs the policy to its final hidden states and calls moe_gspo.kernels.token_logprobs on this rank's
vocab shard of the LM head (vocab-parallel over the TP group): no [B, T, V] logits. "eager" is the obvious
reference: full logits -> log_softmax -> gather. Both return float32.
"""

from __future__ import annotations

import torch

from moe_gspo.kernels import token_logprobs
from moe_gspo.rollout.batch import token_logprobs_from_logits


def _tp_group(policy):
    if getattr(policy, "tp", 1) == 1:
        return None
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def batch_logprobs(policy, input_ids_BT: torch.Tensor, routing=None, impl: str = "fused",
                   temperature: float = 1.0, want_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp (B, T) float32, entropy (B, T) float32 or None), token-aligned, column 0 = 0."""
    B, T = input_ids_BT.shape
    targets = input_ids_BT[:, 1:].reshape(-1)  # (B*(T-1),)
    if impl == "eager":  # already token-aligned with column 0 = 0
        out = token_logprobs_from_logits(policy(input_ids_BT, routing=routing), input_ids_BT, temperature,
                                         return_entropy=want_entropy)
        return out if want_entropy else (out, None)
    if impl == "fused":
        hidden = policy(input_ids_BT, routing=routing, return_hidden=True)  # (B, T, H), same on every TP rank
        group = _tp_group(policy)
        H = hidden.shape[-1]
        w = policy.lm_head_weight()
        logp, ent = token_logprobs(hidden[:, :-1].reshape(-1, H).to(w.dtype), w, targets, temperature=temperature,
                                   return_entropy=want_entropy, process_group=group)
        logp = logp.view(B, T - 1)
        ent = ent.view(B, T - 1) if ent is not None else None
    else:
        raise ValueError(f"train.logprob_impl={impl!r} is not one of ['fused', 'eager']")
    pad = lambda x: None if x is None else torch.nn.functional.pad(x.float(), (1, 0))  # noqa: E731
    return pad(logp), pad(ent)
