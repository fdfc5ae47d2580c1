"""Grouped-GEMM experts (`model.experts: grouped`): each rank's local experts stacked in megatron's GroupedMLP
layout and computed with two `torch._grouped_mm` calls, forward and backward, instead of a loop over experts.

    experts = GroupedGemmExperts(num_local_experts, config, pg_collection=pgs)   # built by the layer spec
    out_NH, _ = experts(permuted_x_NH, tokens_per_expert_E, permuted_probs_N)    # megatron's experts interface

Parameters (megatron GroupedMLP's, so its sharded_state_dict and checkpoint resharding apply as they are):
    weight1 (H, E*2F), memory (E, H, 2F): expert e's linear_fc1.weight (2F, H) transposed, gate columns then up
    weight2 (E*F, H),  memory (E, F, H):  expert e's linear_fc2.weight (H, F) transposed
`per_expert_state` turns them into SequentialMLP's per-expert names (views), the names hf_io and the policy's
full-state helpers speak. The reference is megatron's SequentialMLP (`model.experts: megatron`), tested equal.
"""

from __future__ import annotations

import re
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

_GROUPED_KEY = re.compile(r"^(?P<head>.*\.mlp\.experts\.)(?P<w>weight1|weight2)$")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a gradient with row-major strides: torch._grouped_mm's CPU backward rejects
    the zero strides that reductions such as `y.sum()` produce (which an empty tensor keeps, even `.contiguous()`)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if g.stride() == (g.shape[1], 1):
            return g
        return torch.empty(g.shape, dtype=g.dtype, device=g.device).copy_(g)


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """(M, K) rows grouped by the int32 end offsets offs_E, times w_EKN[e] per group -> (M, N); rows past
    offs_E[-1] are unspecified (torch's CPU kernel writes nonzero values there), for the caller to drop. torch's own
    autograd gives both gradients."""
    return _ContiguousGrad.apply(torch._grouped_mm(x_MK, w_EKN, offs=offs_E))


_KERNEL_RUNS: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm computes forward and backward in `dtype` on `device`, tried once per device and
    dtype on a 2-group problem. CPU kernels take fp32 and bf16. On CUDA, bf16 on sm90/sm100 runs CUTLASS's grouped
    GEMM; other dtypes and GPUs run torch's fallback where torch has one (a C++ loop of GEMMs over the groups after
    one host read of the offsets), which on an H200 in fp32 still halves the forward+backward of the per-expert
    Python loop (docs/gpu.md). A torch without that fallback raises here, and the experts take the loop."""
    key = (str(device), dtype)
    if key not in _KERNEL_RUNS:
        try:  # with autograd on: a model may be built under no_grad or inference_mode
            with torch.inference_mode(False), torch.enable_grad():
                x = torch.ones(8, 16, dtype=dtype, device=device, requires_grad=True)
                w = torch.ones(2, 16, 16, dtype=dtype, device=device, requires_grad=True)
                offs = torch.tensor([4, 8], dtype=torch.int32, device=device)
                grouped_mm(x, w, offs).sum().backward()
            _KERNEL_RUNS[key] = True
        except (RuntimeError, NotImplementedError):
            _KERNEL_RUNS[key] = False
    return _KERNEL_RUNS[key]


def aligned(width: int, dtype: torch.dtype) -> bool:
    """torch._grouped_mm needs 16-byte aligned row strides for its operands and gradients."""
    return width * torch.empty((), dtype=dtype).element_size() % 16 == 0


class GroupedGemmExperts(GroupedMLP):
    """SwiGLU experts on megatron GroupedMLP's parameters, computed with torch._grouped_mm.

    Not megatron's GroupedMLP itself: its constructor asserts the `grouped_gemm` package (CUTLASS kernels, CUDA
    only) and its forward asserts bf16 and hands that package host-side batch sizes. This subclass keeps
    GroupedMLP's parameters, their attributes and its sharded_state_dict (checkpoint keys and global shapes equal
    SequentialMLP's, so a checkpoint moves between the two), draws its initial weights exactly as SequentialMLP
    draws its experts' (a fresh model is the same whichever experts setting builds it), and computes
    x W1 -> SwiGLU -> x routing probability -> W2 as two grouped GEMMs whose int32 group offsets are built on the
    device from tokens_per_expert (no host sync). Where a device needs each group's row count aligned
    (`align_rows` > 1: the CUDA kernels' 16-byte rule for the transposed operand of the weight gradient), groups
    are zero-padded to that multiple, again without leaving the device. Widths whose rows are not 16-byte
    aligned (H, F) fall back, at build time, to a loop over the stacked weights; so does a device and dtype whose
    _grouped_mm kernel does not run (`grouped_mm_runs`), and fp32 weights under torch.compile, whose tracing kernel
    of _grouped_mm takes bf16 only.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules=None, pg_collection=None):
        MegatronModule.__init__(self, config=config)
        c = config
        unsupported = [name for name, bad in [
            ("biases", c.add_bias_linear), ("a non-gated MLP", not c.gated_linear_unit),
            ("an activation other than silu", c.activation_func is not F.silu),
            ("fp8/fp4", c.fp8 or c.fp4), ("an activation clamp", c.activation_func_clamp_value is not None),
            ("a GLU offset", bool(c.glu_linear_offset)), ("probabilities on the input", c.moe_apply_probs_on_input),
            ("expert tensor parallelism", get_pg_size(pg_collection.expt_tp) != 1)] if bad]
        if unsupported:
            raise ValueError(f"model.experts=grouped does not support {', '.join(unsupported)}; "
                             f"use model.experts=megatron")
        self.num_local_experts = E = num_local_experts
        self.expert_parallel = c.expert_model_parallel_size > 1
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        H, Fh = c.hidden_size, c.moe_ffn_hidden_size
        device = "cpu" if c.use_cpu_initialization else torch.cuda.current_device()
        self.weight1 = torch.nn.Parameter(torch.empty(H, E * 2 * Fh, dtype=c.params_dtype, device=device))
        self.weight2 = torch.nn.Parameter(torch.empty(E * Fh, H, dtype=c.params_dtype, device=device))
        if c.perform_initialization:
            self._init_like_sequential_mlp()
        set_tensor_model_parallel_attributes(self.weight1, is_parallel=True, dim=1, stride=1)
        set_tensor_model_parallel_attributes(self.weight2, is_parallel=True, dim=0, stride=1)
        for w in (self.weight1, self.weight2):
            setattr(w, "allreduce", not self.expert_parallel)
        self.register_load_state_dict_post_hook(_ignore_extra_state)
        on_cpu = self.weight1.device.type == "cpu"
        self.use_grouped_mm = (aligned(H, c.params_dtype) and aligned(Fh, c.params_dtype)
                               and grouped_mm_runs(self.weight1.device, c.params_dtype))
        # CPU kernels take any group sizes (measured, forward and backward); CUDA's want 16-byte aligned groups
        self.align_rows = 1 if on_cpu else 16 // self.weight1.element_size()

    @torch.no_grad()
    def _init_like_sequential_mlp(self) -> None:
        """SequentialMLP's draws in its order: per expert, fc1's (2F, H) with init_method, then fc2's (H, F) with
        output_layer_init_method, in fp32, cast to the parameter dtype (megatron's CPU initialization); on a GPU
        under the expert-parallel RNG stream, as megatron's GPU initialization of expert linears."""
        c, E = self.config, self.num_local_experts
        w1_EHF2, w2_EFH = self._stacked()
        on_gpu = not c.use_cpu_initialization
        rng = tensor_parallel.get_cuda_rng_tracker().fork(tensor_parallel.get_expert_parallel_rng_tracker_name()) \
            if on_gpu else nullcontext()
        with rng:
            for e in range(E):
                fc1 = torch.empty(w1_EHF2.shape[2], w1_EHF2.shape[1], dtype=torch.float32, device=w1_EHF2.device)
                c.init_method(fc1)
                fc2 = torch.empty(w2_EFH.shape[2], w2_EFH.shape[1], dtype=torch.float32, device=w2_EFH.device)
                c.output_layer_init_method(fc2)
                w1_EHF2[e].copy_(fc1.t())
                w2_EFH[e].copy_(fc2.t())

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (E, H, 2F) and (E, F, H) of weight1 and weight2 (megatron GroupedMLP's reading of them)."""
        E, H = self.num_local_experts, self.config.hidden_size
        return self.weight1.view(E, H, -1), self.weight2.view(E, -1, H)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """x (N, H) sorted by local expert, tokens_per_expert (E,) int, probs (N,) -> ((N, H), None)."""
        if not self.use_grouped_mm or (torch.compiler.is_compiling() and self.weight1.dtype != torch.bfloat16):
            # torch 2.13's fake-tensor kernel of _grouped_mm (what torch.compile traces with) takes bf16 only
            return self._forward_loop(permuted_local_hidden_states, tokens_per_expert, permuted_probs), None
        x_NH, p_N = permuted_local_hidden_states, permuted_probs
        w1_EHF2, w2_EFH = self._stacked()
        counts_E = tokens_per_expert.to(x_NH.device, non_blocking=True)
        rows_N = None
        if self.align_rows > 1:
            x_NH, p_N, counts_E, rows_N = pad_groups(x_NH, p_N, counts_E, self.align_rows)
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        h_N2F = grouped_mm(x_NH, w1_EHF2, offs_E)
        gate, up = torch.chunk(h_N2F, 2, dim=-1)
        act_NF = ((F.silu(gate) * up) * p_N.unsqueeze(-1)).to(h_N2F.dtype)  # scaled after the GLU, as megatron
        out_NH = grouped_mm(act_NF, w2_EFH, offs_E)
        if rows_N is not None:
            out_NH = out_NH[rows_N]
        return out_NH, None

    def _forward_loop(self, x_NH, tokens_per_expert, p_N):
        """The same math one expert at a time (widths grouped_mm cannot take); needs the counts on the host. The
        stacked weights are unbound once, so the backward stacks the experts' gradients in one op instead of
        adding each expert's into a zero-filled gradient of the whole stacked weight."""
        w1_EHF2, w2_EFH = self._stacked()
        w1s, w2s = w1_EHF2.unbind(0), w2_EFH.unbind(0)
        counts = tokens_per_expert.tolist()
        n = sum(counts)  # rows past the groups (a dispatch of fixed slots, some empty) come out zero
        out = []
        for e, (x, p) in enumerate(zip(torch.split(x_NH[:n], counts), torch.split(p_N[:n], counts), strict=True)):
            gate, up = torch.chunk(x @ w1s[e], 2, dim=-1)
            out.append((((F.silu(gate) * up) * p.unsqueeze(-1)).to(x.dtype)) @ w2s[e])
        if n < x_NH.shape[0]:
            out.append(x_NH.new_zeros(x_NH.shape[0] - n, w2_EFH.shape[-1]))
        return torch.cat(out, dim=0)


def pad_groups(x_NH: torch.Tensor, p_N: torch.Tensor, counts_E: torch.Tensor, align: int):
    """Rows grouped by counts_E -> the same groups each zero-padded to a multiple of `align` rows, in a buffer of
    the static size N + E*(align-1) rounded up to `align` (no host sync). Rows past the groups (counts_E may sum to
    less than N: a dispatch of a fixed number of slots, some empty) follow the last padded group, outside every
    group. Returns (x (M, H), probs (M,), padded counts (E,), rows (N,): where each original row went)."""
    N, E = x_NH.shape[0], counts_E.numel()
    M = -(-(N + E * (align - 1)) // align) * align
    tail = (N - counts_E.sum()).reshape(1)
    counts_G = torch.cat([counts_E, tail])  # the rows past the groups as one more group, left unpadded
    padded_G = torch.cat([(counts_E + align - 1) // align * align, tail])
    start_G = torch.cumsum(counts_G, 0) - counts_G
    pstart_G = torch.cumsum(padded_G, 0) - padded_G
    group_N = torch.repeat_interleave(torch.arange(E + 1, device=x_NH.device), counts_G, output_size=N)
    rows_N = torch.arange(N, device=x_NH.device) - start_G[group_N] + pstart_G[group_N]
    x_MH = x_NH.new_zeros(M, x_NH.shape[1]).index_copy(0, rows_N, x_NH)
    p_M = p_N.new_zeros(M).index_copy(0, rows_N, p_N)
    return x_MH, p_M, padded_G[:E], rows_N


def _ignore_extra_state(module, incompatible_keys):
    """GroupedMLP's sharded state carries placeholder `_extra_state` entries for SequentialMLP compatibility."""
    for key in [k for k in incompatible_keys.unexpected_keys if "_extra_state" in k]:
        incompatible_keys.unexpected_keys.remove(key)


def per_expert_state(state: dict[str, torch.Tensor], num_local_experts: int, hidden_size: int
                     ) -> dict[str, torch.Tensor]:
    """A state dict (weights, gradients or optimizer state per parameter) with GroupedGemmExperts' stacked
    `...mlp.experts.weight1` / `weight2` replaced by SequentialMLP's per-local-expert names
    `...mlp.experts.local_experts.<e>.linear_fc1.weight` (2F, H) / `linear_fc2.weight` (H, F), as views: writing
    into them writes the stacked tensor. Other entries pass through."""
    out = {}
    for name, t in state.items():
        m = _GROUPED_KEY.match(name)
        if m is None:
            out[name] = t
            continue
        E, H = num_local_experts, hidden_size
        if m["w"] == "weight1":
            for e, w in enumerate(t.view(E, H, -1)):
                out[f"{m['head']}local_experts.{e}.linear_fc1.weight"] = w.t()
        else:
            for e, w in enumerate(t.view(E, -1, H)):
                out[f"{m['head']}local_experts.{e}.linear_fc2.weight"] = w.t()
    return out
