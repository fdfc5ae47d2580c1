"""Fused sequence log-likelihood kernels (public import: moe_gspo.kernels; sources in the top-level kernels/).

    token_logprobs(hidden [T, H], weight [V_local, H], targets [T]) -> (logp [T] fp32, entropy [T] fp32 | None)
    sequence_reduce(values, mask=..., cu_seqlens=..., reduction="sum" | "mean") -> [B]
    fused_policy_loss(hidden, weight, targets, old_logp, advantages, cu_seqlens=..., loss="gspo" | "grpo" | ...)
        -> (loss, metrics): the loss gradient computed inside the forward (6THV instead of 8THV)
    fused_logprob_loss(hidden, weight, targets, loss_fn, cu_seqlens=...) -> (loss, logp, entropy | None):
        the same for any loss of the per-token log-probs that is additive over sequences (what the trainer uses)

Implementations: eager reference (reference.py), chunked any-device (chunked.py), Triton (triton_kernels.py),
vocab-parallel merge over a tensor-parallel group (vocab_parallel.py). Kernels know nothing of models or losses.
"""
from .api import DEFAULT_CHUNK_BYTES, IMPLS, default_chunk_bytes, resolve_impl, token_logprobs
from .chunked import plan_chunks
from .loss_fused import DEFAULT_CLIP, LOSSES, fused_logprob_loss, fused_policy_loss
from .reduce import sequence_reduce
from .reference import token_logprobs_eager

__all__ = [
    "DEFAULT_CHUNK_BYTES", "DEFAULT_CLIP", "IMPLS", "LOSSES", "default_chunk_bytes", "fused_logprob_loss",
    "fused_policy_loss", "plan_chunks", "resolve_impl", "sequence_reduce", "token_logprobs", "token_logprobs_eager",
]
