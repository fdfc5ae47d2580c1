"""Token log-probs of a right-padded batch under the policy, token-aligned like PaddedRollout.

    logp_BT, ent_BT = batch_logprobs(policy, input_ids_BT, capture, impl="fused", temperature=1.0)
    # logp_BT[b, j] = log pi(input_ids[b, j] | input_ids[b, :j]) at softmax(logits / temperature); column 0 is 0

"fused" runs the policy to its final hidden states and calls moe_gspo.kernels.token_logprobs on this rank's
vocab shard of the LM head (vocab-parallel over the TP group): no [B, T, V] logits. "eager" is the obvious
reference: full logits -> log_softmax -> gather. Both return float32.

    loss, logp_BT, ent_BT = hidden_loss(policy, hidden_BTH, input_ids_BT, loss_rows, temperature)

goes from the final hidden states straight to a loss of the token log-probs (moe_gspo.kernels.fused_logprob_loss,
6THV instead of token_logprobs' 8THV): loss_rows(logp_bT, b0, b1) is the loss part of rows b0..b1-1, given their
token-aligned log-probs; the LM head's gradient is computed inside the call.
"""

from __future__ import annotations

import torch

from moe_gspo.kernels import fused_logprob_loss, token_logprobs
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


def hidden_loss(policy, hidden_BTH: torch.Tensor, input_ids_BT: torch.Tensor, loss_rows, temperature: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss 0-dim float32, logp (B, T) float32, entropy (B, T) float32) from the policy's final hidden states.

    loss_rows(logp_bT, b0, b1) -> 0-dim tensor: the part of the loss carried by rows b0..b1-1, from their
    token-aligned log-probs (b1 - b0, T) (column 0 = 0, requires grad); the loss is the sum of the parts over
    consecutive row groups (as many rows as fit the kernel's workspace), so it must use a denominator fixed in
    advance. logp and entropy come back detached, token-aligned, column 0 = 0; the entropy is a metric only."""
    B, T = input_ids_BT.shape
    H = hidden_BTH.shape[-1]
    w = policy.lm_head_weight()
    targets = input_ids_BT[:, 1:].reshape(-1)  # (B*(T-1),)
    cu = torch.arange(B + 1, device=input_ids_BT.device) * (T - 1)  # every row is one sequence of T - 1 targets

    def part(lp, b0, b1):
        return loss_rows(torch.nn.functional.pad(lp.view(b1 - b0, T - 1), (1, 0)), b0, b1)

    loss, logp, ent = fused_logprob_loss(hidden_BTH[:, :-1].reshape(-1, H).to(w.dtype), w, targets, part,
                                         cu_seqlens=cu, temperature=temperature, process_group=_tp_group(policy),
                                         return_entropy=True)
    pad = lambda x: torch.nn.functional.pad(x.view(B, T - 1), (1, 0))  # noqa: E731
    return loss, pad(logp), pad(ent)
