"""Fused sequence log-likelihood kernels (public import: moe_gspo.kernels; sources in the top-level kernels/).

    token_logprobs(hidden [T, H], weight [V_local, H], targets [T]) -> (logp [T] fp32, entropy [T] fp32 | None)
    sequence_reduce(values, mask=..., cu_seqlens=..., reduction="sum" | "mean") -> [B]
    fused_logprob_loss(hidden, weight, targets, loss_fn, cu_seqlens=...) -> (loss, logp, entropy | None):
        any loss of the per-token log-probs that is additive over sequences, its gradient computed inside the
        forward (6THV instead of 8THV); moe_gspo.train.logprob.fused_policy_loss feeds it a registered loss
    token_logprobs_from_logits(logits [B, T, V], input_ids [B, T]) -> logp [B, T] fp32 (column 0 = 0): the eager
        path from a full forward's logits, token-aligned

Implementations: eager reference (reference.py), chunked any-device (chunked.py), Triton (triton_kernels.py),
vocab-parallel merge over a tensor-parallel group (vocab_parallel.py). Kernels know nothing of models or losses.
"""
from .api import DEFAULT_CHUNK_BYTES, IMPLS, default_chunk_bytes, resolve_impl, token_logprobs
from .chunked import plan_chunks
from .loss_fused import fused_logprob_loss
from .reduce import sequence_reduce
from .reference import token_logprobs_eager, token_logprobs_from_logits

__all__ = [
    "DEFAULT_CHUNK_BYTES", "IMPLS", "default_chunk_bytes", "fused_logprob_loss", "plan_chunks", "resolve_impl",
    "sequence_reduce", "token_logprobs", "token_logprobs_eager", "token_logprobs_from_logits",
]
