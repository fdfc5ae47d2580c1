"""The vLLM engine's weight writer on the CPU, where vLLM's own reload leaves packed weights wrong.

    with keep_dense_weights():                 # while the engine is built
        llm = LLM(...)
    load_weights_cpu(model, state_dict, model_type)   # any number of times: what a fresh engine loads

Weights. On the CPU, vLLM packs every dense linear for its GEMM when it loads a checkpoint (a oneDNN handle, or an
sgl-kernel packed weight for small layers such as the router) and then drops `layer.weight`; it also prepacks the
routed experts' `w13_weight` [E, 2I, H] and `w2_weight` [E, H, I] in place, zero-padding I to the kernel's alignment.
Its own `reload_weights` writes new, unpacked values into those packed tensors, which the kernels then misread.
So the engine is built with the dense weights kept (`keep_dense_weights` passes remove_weight=False to vLLM's GEMM
dispatch while the engine loads), and an update:
- loads the dense tensors with the model's own `load_weights` (its q/k/v and gate/up stacking), under the names the
  family's checkpoint files use (moe_gspo.model.hf_io.file_keys: Mixtral's router is `block_sparse_moe.gate`), then
  reruns each dense layer's GEMM dispatch so that its packed copy is rebuilt from the new values;
- assembles each MoE layer's routed experts, one layer at a time, in vLLM's unpacked padded layout (gate rows, then
  up rows at the padded offset) and prepacks them into the engine's expert tensors in place, as vLLM does at load.
  The experts arrive under the package's names (`model.layers.N.mlp.experts.e.gate_proj / up_proj / down_proj`,
  every family's), and layer N's expert tensors are the ones vLLM's layer N holds, whatever vLLM calls its MoE
  block (`mlp`, Mixtral's `block_sparse_moe`). A shared expert (Qwen2-MoE, DeepSeek-V3, GLM-4.5) and a dense first
  layer's MLP are dense MLPs to vLLM, and the sigmoid router's expert bias (`mlp.gate.e_score_correction_bias`) a
  parameter of its gate that the router reads in place: they load with the dense tensors. GPT-OSS's experts differ
  (vLLM's GPT-OSS, 'swigluoai' activation): w13 interleaves gate and up rows, unpadded, and their biases
  (`w13_bias` [E, 2I], interleaved the same way, `w2_bias` [E, H]) are read unpacked, so they are written in place
  as they arrive; its router (`mlp.router`, with a bias) and sinks load with the dense tensors;
- reruns the post-load step of latent attention (moe_gspo.rollout.vllm.mla.refresh_latent_attention).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from moe_gspo.model.hf_io import file_keys
from moe_gspo.rollout.sync.buckets import cast_into
from moe_gspo.rollout.vllm.mla import refresh_latent_attention

# a routed expert's projection under the package's names (every family's in-memory names; biases: GPT-OSS's)
_EXPERT_KEY = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<e>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


# ---------------------------------------------------------------------------------------------------------- weights
@contextmanager
def keep_dense_weights():
    """While the block builds an engine, vLLM's CPU GEMM dispatch keeps each dense layer's `weight` (its packed copy
    is made as usual): `load_weights` can then write new values there. Restores vLLM's function on exit."""
    from vllm.model_executor.layers import utils as vllm_utils

    original = vllm_utils.dispatch_cpu_unquantized_gemm

    def dispatch_keeping_weight(layer, remove_weight):
        return original(layer, remove_weight=False)

    vllm_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    try:
        yield
    finally:
        vllm_utils.dispatch_cpu_unquantized_gemm = original


def experts_modules(model) -> dict[int, torch.nn.Module]:
    """Layer index -> the vLLM module holding that layer's routed experts (`w13_weight`, `w2_weight`), for every MoE
    layer, whatever the layer calls its MoE block."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "w13_weight") and hasattr(mod, "w2_weight"):
            out[int(_LAYER.match(name)[1])] = mod
    return out


def _experts_isa(mod) -> str:
    """The instruction set vLLM prepacked this layer's experts for ('vec', 'amx', ...)."""
    experts_cls = getattr(mod.quant_method, "experts_cls", None)
    return getattr(experts_cls, "isa", "vec")


class StagingPool:
    """Unpacked expert staging buffers kept for the next layer and the next update. A fresh buffer pays its page
    faults on every fill (48 MB at hidden 1024: 19 ms to allocate and fill against 2.2 ms to fill a kept one), and
    every update would pay them again. A layer takes a pair when its first expert arrives and returns it once
    prepacked; no pair serves two layers at once (a sync's rounds can start layer i+1 before layer i is complete),
    so the pool holds as many pairs as layers were ever filled at once."""

    def __init__(self):
        self.free: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self, mod, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
        E, two_ipad, H = mod.w13_weight.shape
        ipad = two_ipad // 2
        for i, (w13, w2) in enumerate(self.free):
            if w13.shape == mod.w13_weight.shape and w2.shape == (E, H, ipad) and w13.dtype == mod.w13_weight.dtype:
                return self.free.pop(i)
        # every element but the padding is written by the 3E puts a layer needs before its commit, and the padding
        # of a kept pair is never written: zero it once
        w13 = torch.empty(E, two_ipad, H, dtype=mod.w13_weight.dtype)
        w2 = torch.empty(E, H, ipad, dtype=mod.w2_weight.dtype)
        if ipad > intermediate:
            w13[:, intermediate:ipad].zero_()
            w13[:, ipad + intermediate:].zero_()
            w2[:, :, intermediate:].zero_()
        return w13, w2

    def give(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.free.append(pair)


def staging_pool(model) -> StagingPool:
    """The pool kept with an engine's model (one per model, for every update)."""
    return model.__dict__.setdefault("_moe_gspo_staging_pool", StagingPool())


def interleaved_w13(mod) -> bool:
    """Whether this experts module's w13 rows (and w13_bias) interleave gate and up (gate 0, up 0, gate 1, ...):
    vLLM's GPT-OSS loads its checkpoint's interleaved gate_up_proj as it is and its 'swigluoai' activation reads
    it so; every other family's w13 is gate rows over up rows. Its intermediate dimension is never padded."""
    return str(getattr(getattr(mod, "activation", None), "value", "")) == "swigluoai"


def w13_rows(mod, proj: str, start: int, stop: int, ipad: int) -> slice:
    """The rows of vLLM's (unpacked) w13 or w13_bias holding rows [start, stop) of an expert's gate or up
    projection (gate over up at the padded offset, or interleaved)."""
    if interleaved_w13(mod):
        return slice(2 * start + (proj == "up_proj"), 2 * stop, 2)
    off = ipad if proj == "up_proj" else 0
    return slice(off + start, off + stop)


def put_expert_bias(mod, e: int, proj: str, b: torch.Tensor, start: int = 0, ipad: int | None = None) -> None:
    """One expert's gate/up/down bias into vLLM's w13_bias (E, 2I) / w2_bias (E, H), which the CPU kernel reads
    as they are (unpacked): in place. Gate/up: rows [start, start + len) of the expert's."""
    if proj == "down_proj":
        cast_into(mod.w2_bias.data[e], b)
    else:
        ipad = mod.w13_bias.shape[1] // 2 if ipad is None else ipad
        cast_into(mod.w13_bias.data[e, w13_rows(mod, proj, start, start + b.shape[0], ipad)], b)


class _ExpertStaging:
    """One MoE layer's experts in vLLM's unpacked, padded layout, filled from per-expert HF tensors."""

    def __init__(self, mod, intermediate: int, pool: StagingPool):
        E, two_ipad, H = mod.w13_weight.shape
        self.mod, self.I, self.Ipad, self.pool = mod, intermediate, two_ipad // 2, pool
        self.w13, self.w2 = pool.take(mod, intermediate)
        self.left = 3 * E  # weights still to come (biases are written in place as they come)

    def put(self, e: int, proj: str, w: torch.Tensor) -> bool:
        """Copy one expert's projection in; True once the layer is complete."""
        if proj == "down_proj":
            cast_into(self.w2[e, :, :self.I], w)
        else:
            cast_into(self.w13[e, w13_rows(self.mod, proj, 0, self.I, self.Ipad)], w)
        self.left -= 1
        return self.left == 0

    def commit(self) -> None:
        """Prepack into the engine's expert tensors in place."""
        isa = _experts_isa(self.mod)
        torch.ops._C.prepack_moe_weight(self.w13, self.mod.w13_weight.data, isa)
        torch.ops._C.prepack_moe_weight(self.w2, self.mod.w2_weight.data, isa)
        self.pool.give((self.w13, self.w2))
        self.w13 = self.w2 = None


def _redispatch_dense(model) -> int:
    """Rebuild every dense layer's packed GEMM weight from its (kept) `weight`. Returns the layers redone."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    n = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if (hasattr(mod, "cpu_linear") and isinstance(w, torch.Tensor) and w.ndim == 2 and w.numel()
                and not getattr(mod, "_cpu_skip_gemm_dispatch", False)):
            dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
            n += 1
    return n


@torch.no_grad()
def load_weights_cpu(model, state: Mapping[str, torch.Tensor], model_type: str) -> int:
    """Write a state under the package's HF names (one tensor per expert) into a CPU vLLM model of `model_type`
    (config.json's) built under `keep_dense_weights`, reading the keys once in the state's order (a streamed state
    gathers on reading). Returns the number of tensors written. Raises KeyError naming an expert layer the state
    leaves incomplete or the engine lacks."""
    experts = experts_modules(model)
    staging: dict[int, _ExpertStaging] = {}
    pool = staging_pool(model)
    count = 0

    # the names the family's checkpoint files use for the dense tensors, which the model's load_weights maps
    # (key by key: GPT-OSS's file_keys would fuse the experts, which take the experts path instead)
    keys = list(state)
    dense_keys = [k for k in keys if _EXPERT_KEY.match(k) is None]
    names = dict(zip(dense_keys, file_keys(dict.fromkeys(dense_keys), model_type)))

    def dense() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for key in keys:
            w = state[key]
            count += 1
            m = _EXPERT_KEY.match(key)
            if m is None:
                yield names[key], w
                continue
            layer, proj = int(m["layer"]), m["proj"]
            if layer not in experts:
                raise KeyError(f"{key}: the engine has no MoE layer {layer}")
            if m["kind"] == "bias":
                put_expert_bias(experts[layer], int(m["e"]), proj, w)
                continue
            if layer not in staging:
                inter = w.shape[1] if proj == "down_proj" else w.shape[0]
                if experts[layer].w13_weight.shape[1] // 2 < inter:
                    raise ValueError(f"{key}: expert width {inter} exceeds the engine's expert tensors")
                staging[layer] = _ExpertStaging(experts[layer], inter, pool)
            st = staging[layer]
            if st.put(int(m["e"]), proj, w):
                st.commit()
                del staging[layer]  # one layer's staging at a time when the state comes layer by layer

    model.load_weights(dense())
    if staging:
        raise KeyError(f"per-expert weights incomplete for layers {sorted(staging)[:4]}")
    _redispatch_dense(model)
    refresh_latent_attention(model)
    return count
