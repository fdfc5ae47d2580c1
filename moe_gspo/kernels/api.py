"""token_logprobs: one log-probability (and optionally the entropy) per token without the [T, V] logits.

    logp_T, ent_T = token_logprobs(hidden_TH, weight_VH, targets_T, return_entropy=True)

impl: "eager" (reference.py, materializes logits), "chunked" (chunked.py, any device, bounded workspace),
"triton" (triton_kernels.py, CUDA or TRITON_INTERPRET=1), "auto" (triton on CUDA when importable, else chunked).
"""
from __future__ import annotations

import torch

from . import chunked, reference, triton_kernels

IMPLS = ("eager", "chunked", "triton", "auto")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_CHUNK_BYTES = 128 * 2**20  # CPU: larger blocks stop paying off (docs/guide/kernels.md)
CUDA_CHUNK_BYTES = 512 * 2**20  # H100, bf16, T=16384 x V=151936: 0.143 s vs 0.195 s at 128 MiB, 171 MiB extra


def default_chunk_bytes(device: torch.device) -> int:
    """The workspace budget chunk_bytes=None stands for on `device`."""
    return CUDA_CHUNK_BYTES if device.type == "cuda" else DEFAULT_CHUNK_BYTES


def resolve_impl(impl: str, device: torch.device) -> str:
    """The implementation `impl` stands for on `device` ("auto" resolved)."""
    if impl not in IMPLS:
        raise ValueError(f"token_logprobs: unknown impl={impl!r}; valid: {', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_kernels.available() else "chunked"
    return impl


def check_inputs(hidden_TH, weight_VH, targets_T, temperature, chunk_bytes) -> None:
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(f"token_logprobs: want hidden [T, H] and weight [V, H]; got {tuple(hidden_TH.shape)} "
                         f"and {tuple(weight_VH.shape)}")
    if targets_T.shape != hidden_TH.shape[:1]:
        raise ValueError(f"token_logprobs: targets shape {tuple(targets_T.shape)} != [T] = [{hidden_TH.shape[0]}]")
    if hidden_TH.dtype not in DTYPES or weight_VH.dtype != hidden_TH.dtype:
        raise ValueError(f"token_logprobs: hidden and weight must share one of {DTYPES}; got {hidden_TH.dtype} "
                         f"and {weight_VH.dtype}")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    if chunk_bytes < 256:
        raise ValueError(f"token_logprobs: chunk_bytes must be >= 256, got {chunk_bytes}")


def token_logprobs(hidden, weight, targets, *, temperature=1.0, return_entropy=False, ignore_index=-100,
                   process_group=None, impl="auto", chunk_bytes=None):
    """Per-token log pi(target) under softmax(hidden @ weight^T / temperature).

    hidden [T, H] and weight [V_local, H], fp32/bf16/fp16 (same dtype); targets [T] int global vocab ids.
    With `process_group` (the tensor-parallel group) weight is this rank's vocab shard, rows
    [rank * V_local, (rank + 1) * V_local); hidden must be the same on every rank and its gradient comes back
    all-reduced over the group (megatron's copy-to-region is included).
    Returns (logp [T] fp32, entropy [T] fp32 or None). Rows with targets == ignore_index give 0 and no gradient.
    chunk_bytes bounds the chunked path's fp32 workspace, whatever T is (None: default_chunk_bytes(device))."""
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(hidden.device)
    check_inputs(hidden, weight, targets, temperature, chunk_bytes)
    which = resolve_impl(impl, hidden.device)
    if which == "eager":
        return reference.token_logprobs_eager(hidden, weight, targets, temperature=temperature,
                                              return_entropy=return_entropy, ignore_index=ignore_index,
                                              process_group=process_group)
    engine = "triton" if which == "triton" else "torch"
    logp, ent = chunked.ChunkedLogprob.apply(hidden, weight, targets, float(temperature), ignore_index,
                                             process_group, int(chunk_bytes), bool(return_entropy), engine)
    return logp, (ent if return_entropy else None)
