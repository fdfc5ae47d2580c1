"""Hugging Face MoE checkpoints (model.family) <-> megatron-core parameter names, sharding for TP/EP, safetensors I/O.

Inside the package every family's tensors go by Qwen3-MoE's HF names (the keys of hf_sources: `mlp.gate`,
`mlp.experts.e.gate_proj / up_proj / down_proj`, which are also transformers 5's in-memory module names of every
family here); a family whose checkpoint files name them otherwise is renamed at the file boundary only
(`file_keys` on writing, `package_keys` on reading): Mixtral's `block_sparse_moe.gate` and
`block_sparse_moe.experts.e.w1 / w3 / w2`; GPT-OSS's experts, which its files (and transformers' model) keep fused:
`mlp.experts.gate_up_proj` (E, H, 2I) with gate and up columns interleaved, `gate_up_proj_bias` (E, 2I),
`down_proj` (E, I, H), `down_proj_bias` (E, H). GPT-OSS's router (`mlp.router`, with a bias) and sinks
(`self_attn.sinks`) keep its own names in the package.

Layouts (transformers 5.x; megatron-core 0.16.1):
    q/k/v_proj           -> self_attention.linear_qkv: per query group, its q heads, then its k head, then its v head
    experts (fused)      gate_up_proj (E, 2I, H), down_proj (E, H, I)  -> local_experts.e.linear_fc1 / linear_fc2
    experts (per expert) experts.e.gate_proj / up_proj / down_proj     (original Qwen3 layout; also read)
save_pretrained writes the per-expert layout (what Qwen3-MoE checkpoints ship with and what transformers,
SGLang and vLLM all read); load accepts both, single-file or sharded (model.safetensors.index.json).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moe_gspo.config import ConfigError, ModelConfig
from moe_gspo.config.hf_config import model_config_from_hf  # noqa: F401 - read by model.load

HF_ARCH = "Qwen3MoeForCausalLM"
HF_ARCHS = {"qwen3_moe": HF_ARCH, "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "olmoe": "OlmoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
            "gpt_oss": "GptOssForCausalLM"}

# package name -> file name of the tensors a family's checkpoint files name otherwise (per-expert: a suffix)
_FILE_NAMES = {"mixtral": {".mlp.gate.weight": ".block_sparse_moe.gate.weight",
                           ".gate_proj.weight": ".w1.weight", ".up_proj.weight": ".w3.weight",
                           ".down_proj.weight": ".w2.weight"}}


def file_keys(tensors: Mapping[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """The package's HF-named tensors under the names `model_type`'s checkpoint files use."""
    if model_type == "gpt_oss":
        return _fused_experts(tensors)
    names = _FILE_NAMES.get(model_type)
    return dict(tensors) if names is None else {_file_key(k, names): v for k, v in tensors.items()}


def _file_key(key: str, names: dict[str, str]) -> str:
    for ours, theirs in names.items():
        if key.endswith(ours):
            key = key[:-len(ours)] + theirs
            if ours != ".mlp.gate.weight":  # an expert's projection: its module path as well
                key = key.replace(".mlp.experts.", ".block_sparse_moe.experts.")
            return key
    return key


def package_keys(tensors: Mapping[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """A family's checkpoint tensors under the package's names (the inverse of file_keys)."""
    if model_type == "gpt_oss":
        return _per_expert(tensors)
    names = _FILE_NAMES.get(model_type)
    if names is None:
        return dict(tensors)
    back = {theirs: ours for ours, theirs in names.items()}
    out = {}
    for k, v in tensors.items():
        for theirs, ours in back.items():
            if k.endswith(theirs):
                k = k[:-len(theirs)] + ours
                k = k.replace(".block_sparse_moe.experts.", ".mlp.experts.")
                break
        out[k] = v
    return out


def file_items(state: Mapping[str, torch.Tensor], model_type: str):
    """(file name, tensor) of every tensor of `state` in its key order, as `model_type`'s checkpoint files name them,
    reading each value once (a streamed state gathers on reading). GPT-OSS's experts are fused as each layer's last
    expert tensor arrives, so one layer's experts are held at a time."""
    if model_type != "gpt_oss":
        for key, name in zip(state, file_keys(dict.fromkeys(state), model_type)):
            yield name, state[key]
        return
    expected = Counter(m["pre"] for m in map(PER_EXPERT_KEY.match, state) if m)  # each layer's expert tensors
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key in state:
        m = PER_EXPERT_KEY.match(key)
        if m is None:
            yield key, state[key]
            continue
        layer = pending.setdefault(m["pre"], {})
        layer[key] = state[key]
        if len(layer) == expected[m["pre"]]:
            yield from _fused_experts(pending.pop(m["pre"])).items()


PER_EXPERT_KEY = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                            r"\.(?P<kind>weight|bias)$")
"""A routed expert's projection (or its bias) under the package's per-expert names."""


def fused_expert_view(fused: torch.Tensor, e: int, proj: str, interleaved: bool) -> torch.Tensor:
    """Expert e's gate_proj, up_proj or down_proj weight (or bias) as a view of a fused expert tensor, in the
    per-expert layout: weights (out, in), biases (out,). Fused (transformers 5's in-memory layout): (E, 2I, H) gate
    rows over up rows and (E, H, I); interleaved (GPT-OSS's files and model): (E, H, 2I) / (E, 2I) with gate and up
    alternating, and (E, I, H) / (E, H)."""
    if not interleaved:
        inter = fused.shape[1] // 2
        return {"down_proj": fused[e], "gate_proj": fused[e, :inter], "up_proj": fused[e, inter:]}[proj]
    x = fused[e]
    if proj != "down_proj":
        x = x[..., 0::2] if proj == "gate_proj" else x[..., 1::2]
    return x.t() if x.dim() == 2 else x


def _fused_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-OSS: per-expert gate/up/down weights and biases -> each layer's fused, interleaved tensors (module
    docstring); every expert of a layer must be there."""
    out, layers = {}, {}
    for k, v in tensors.items():
        m = PER_EXPERT_KEY.match(k)
        if m is None:
            out[k] = v
        else:
            layers.setdefault(m["pre"], {})[(int(m["e"]), m["proj"][:-len("_proj")], m["kind"])] = v
    for pre, parts in layers.items():
        E = 1 + max(e for e, _, _ in parts)
        if len(parts) != 6 * E:
            raise ValueError(f"{pre}: GPT-OSS's fused experts need every expert's six tensors, got {len(parts)}")
        gate, up = [parts[e, "gate", "weight"] for e in range(E)], [parts[e, "up", "weight"] for e in range(E)]
        out[pre + ".gate_up_proj"] = torch.stack([torch.stack([g, u], dim=1).reshape(-1, g.shape[1]).t()
                                                  for g, u in zip(gate, up)])  # (E, H, 2I): gate, up, gate, ...
        out[pre + ".gate_up_proj_bias"] = torch.stack([torch.stack([parts[e, "gate", "bias"], parts[e, "up", "bias"]],
                                                                   dim=1).reshape(-1) for e in range(E)])
        out[pre + ".down_proj"] = torch.stack([parts[e, "down", "weight"].t() for e in range(E)])
        out[pre + ".down_proj_bias"] = torch.stack([parts[e, "down", "bias"] for e in range(E)])
    return out


_FUSED_REST = (".mlp.experts.gate_up_proj_bias", ".mlp.experts.down_proj", ".mlp.experts.down_proj_bias")


def _per_expert(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-OSS: each layer's fused expert tensors -> per-expert gate/up/down weights and biases (views)."""
    out = {}
    for k, v in tensors.items():
        if not k.endswith(".mlp.experts.gate_up_proj"):
            if not k.endswith(_FUSED_REST):
                out[k] = v
            continue
        pre = k[:-len(".gate_up_proj")]
        fused = {("gate_proj", "weight"): v, ("up_proj", "weight"): v,
                 ("gate_proj", "bias"): tensors[pre + ".gate_up_proj_bias"],
                 ("up_proj", "bias"): tensors[pre + ".gate_up_proj_bias"],
                 ("down_proj", "weight"): tensors[pre + ".down_proj"],
                 ("down_proj", "bias"): tensors[pre + ".down_proj_bias"]}
        for e in range(v.shape[0]):
            for (proj, kind), f in fused.items():
                out[f"{pre}.{e}.{proj}.{kind}"] = fused_expert_view(f, e, proj, interleaved=True)
    return out


# ---------------------------------------------------------------- config.json
def hf_config_dict(mc: ModelConfig) -> dict:
    """config.json of the policy in its family's transformers config (model_type and field names)."""
    common = {
        "architectures": [HF_ARCHS[mc.family]], "model_type": mc.family,
        "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size, "num_hidden_layers": mc.num_hidden_layers,
        "num_attention_heads": mc.num_attention_heads, "num_key_value_heads": mc.num_key_value_heads,
        "head_dim": mc.head_dim, "num_experts_per_tok": mc.num_experts_per_tok, "rms_norm_eps": mc.rms_norm_eps,
        "rope_theta": mc.rope_theta, "rope_scaling": None, "max_position_embeddings": mc.max_position_embeddings,
        "tie_word_embeddings": mc.tie_word_embeddings, "initializer_range": mc.initializer_range,
        "hidden_act": "silu", "router_aux_loss_coef": 0.0, "output_router_logits": False,
        "torch_dtype": mc.params_dtype,
    }
    if mc.family == "mixtral":
        return {**common, "num_local_experts": mc.num_experts, "intermediate_size": mc.moe_intermediate_size,
                "sliding_window": None, "router_jitter_noise": 0.0}
    if mc.family == "gpt_oss":
        y = mc.rope_scaling
        rope = {"rope_parameters": {"rope_type": "yarn", "rope_theta": mc.rope_theta, **y,
                                    "original_max_position_embeddings": int(y["original_max_position_embeddings"])}
                if y else {"rope_type": "default", "rope_theta": mc.rope_theta}}
        common = {k: v for k, v in common.items() if k not in ("rope_theta", "rope_scaling")}
        return {**common, **rope, "num_local_experts": mc.num_experts, "intermediate_size": mc.moe_intermediate_size,
                "attention_bias": True, "sliding_window": mc.sliding_window or None, "layer_types": mc.layer_types,
                "swiglu_limit": mc.swiglu_limit, "swiglu_alpha": 1.702}
    if mc.family == "olmoe":
        return {**common, "num_experts": mc.num_experts, "intermediate_size": mc.moe_intermediate_size,
                "norm_topk_prob": mc.norm_topk_prob, "clip_qkv": None, "attention_bias": False}
    if mc.router_sigmoid:
        sigmoid = {**common, "n_routed_experts": mc.num_experts, "moe_intermediate_size": mc.moe_intermediate_size,
                   "intermediate_size": mc.intermediate_size or mc.moe_intermediate_size,
                   "n_shared_experts": mc.shared_expert_intermediate_size // mc.moe_intermediate_size,
                   "first_k_dense_replace": mc.first_k_dense_replace, "n_group": mc.n_group,
                   "topk_group": mc.topk_group, "routed_scaling_factor": mc.routed_scaling_factor,
                   "norm_topk_prob": mc.norm_topk_prob}
        if mc.family == "glm4_moe":
            return {**sigmoid, "attention_bias": mc.attention_bias, "use_qk_norm": mc.use_qk_norm,
                    "partial_rotary_factor": mc.partial_rotary_factor}
        # topk_method and scoring_func: what vLLM reads (transformers implies them); head_dim is the rotary part's
        # width, as transformers' DeepseekV3Config sets it
        yarn = {"rope_scaling": {"type": "yarn", **mc.rope_scaling}} if mc.rope_scaling else {}
        return {**sigmoid, **yarn, "head_dim": mc.qk_rope_head_dim, "q_lora_rank": mc.q_lora_rank or None,
                "kv_lora_rank": mc.kv_lora_rank,
                "qk_nope_head_dim": mc.qk_nope_head_dim, "qk_rope_head_dim": mc.qk_rope_head_dim,
                "v_head_dim": mc.v_head_dim, "rope_interleave": True, "attention_bias": False,
                "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    # Qwen3-MoE and Qwen2-MoE
    out = {**common, "num_experts": mc.num_experts, "moe_intermediate_size": mc.moe_intermediate_size,
           "intermediate_size": mc.moe_intermediate_size, "norm_topk_prob": mc.norm_topk_prob,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
           "shared_expert_intermediate_size": mc.shared_expert_intermediate_size}
    if mc.family == "qwen2_moe":
        return {**out, "qkv_bias": mc.attention_bias}
    return {**out, "attention_bias": False}


def usual_modes(folder: Path) -> None:
    """Give `folder` and the files in it the modes mkdir and open give under the process's umask: mkdtemp makes a
    folder private (0700) and safetensors writes its files 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for p in folder.iterdir():
        os.chmod(p, 0o666 & ~umask)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that renames and new entries inside it survive a crash (every atomic writer uses it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- names (full, unsharded tensors)
def hf_to_megatron(hf: dict[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    """Full HF state dict (the package's names or the family's file names) -> full megatron state dict
    (single-process names and shapes)."""
    hf = package_keys(hf, mc.family)
    L, H = mc.num_hidden_layers, mc.hidden_size
    nq, ng, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    out: dict[str, torch.Tensor] = {}

    def take(name):
        if name not in hf:
            raise ConfigError(f"checkpoint is missing tensor {name!r}")
        return hf.pop(name)

    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight")
    for i in range(L):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[m + "pre_mlp_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        for theirs, ours in _renamed(mc, i):
            out[m + ours] = take(p + theirs)
        if not mc.mla:  # q/k/v (and their biases) interleaved per query group
            q = take(p + "self_attn.q_proj.weight").view(ng, nq // ng * d, H)
            k = take(p + "self_attn.k_proj.weight").view(ng, d, H)
            v = take(p + "self_attn.v_proj.weight").view(ng, d, H)
            out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, H)
            if mc.attention_bias:
                qb = take(p + "self_attn.q_proj.bias").view(ng, nq // ng * d)
                kb, vb = take(p + "self_attn.k_proj.bias").view(ng, d), take(p + "self_attn.v_proj.bias").view(ng, d)
                out[m + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
        if i < mc.first_k_dense_replace:  # a dense MLP: linear_fc1 stacks gate over up
            out[m + "mlp.linear_fc1.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"),
                                                          take(p + "mlp.up_proj.weight")])
            out[m + "mlp.linear_fc2.weight"] = take(p + "mlp.down_proj.weight")
        else:
            _moe_to_megatron(hf, out, take, mc, p, m)
    if mc.router_sigmoid:  # their checkpoints append multi-token-prediction layers, which neither transformers
        # nor RL uses: layer indices from L on
        for k in [k for k in hf if k.startswith("model.layers.") and int(k.split(".")[2]) >= L]:
            del hf[k]
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if not mc.tie_word_embeddings:
        out["output_layer.weight"] = take("lm_head.weight")
    else:
        hf.pop("lm_head.weight", None)
    if hf:
        raise ConfigError(f"checkpoint has tensors this architecture does not use: {sorted(hf)[:5]}")
    return out


def _renamed(mc: ModelConfig, i: int) -> list[tuple[str, str]]:
    """(HF name, megatron name) under layer i's prefixes of the tensors both sides hold whole and alike: the
    attention's own norms and projections where they map one to one (multi-head latent attention's all do), the
    router and its expert bias (q/k/v, interleaved per query group in megatron, and the experts are not)."""
    out = [("self_attn.o_proj.weight", "self_attention.linear_proj.weight")]
    if mc.family == "gpt_oss":
        out += [("self_attn.o_proj.bias", "self_attention.linear_proj.bias"),
                ("self_attn.sinks", "self_attention.core_attention.softmax_offset"),
                ("mlp.router.weight", "mlp.router.weight"), ("mlp.router.bias", "mlp.router.bias")]
        return out
    if mc.mla:
        out += [("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight"),
                ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight"),
                ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight")] if mc.q_lora_rank else [
            ("self_attn.q_proj.weight", "self_attention.linear_q_proj.weight")]
        out += [("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight"),
                ("self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight"),
                ("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight")]
    elif mc.qk_norm:
        out += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")]
    if i >= mc.first_k_dense_replace:
        out.append(("mlp.gate.weight", "mlp.router.weight"))
        if mc.router_sigmoid:
            out.append(("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias"))
    return out


def _shared_prefix(mc: ModelConfig) -> str:
    """The HF module of the shared expert(s): Qwen2-MoE's one, or DeepSeek-V3's and GLM-4.5's n_shared_experts
    fused into one."""
    return "mlp.shared_experts." if mc.router_sigmoid else "mlp.shared_expert."


def _moe_to_megatron(hf, out, take, mc: ModelConfig, p: str, m: str) -> None:
    """One MoE layer's shared and routed experts (HF prefix p, megatron prefix m) into `out`."""
    if mc.shared_expert_intermediate_size:
        sp = p + _shared_prefix(mc)
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([take(sp + "gate_proj.weight"),
                                                                     take(sp + "up_proj.weight")])
        out[m + "mlp.shared_experts.linear_fc2.weight"] = take(sp + "down_proj.weight")
        if mc.shared_expert_gate:
            out[m + "mlp.shared_experts.gate_weight"] = take(p + "mlp.shared_expert_gate.weight")
    fused = p + "mlp.experts.gate_up_proj"
    for e in range(mc.num_experts):
        x = f"{m}mlp.experts.local_experts.{e}."
        if fused in hf:
            out[x + "linear_fc1.weight"] = hf[fused][e]
            out[x + "linear_fc2.weight"] = hf[p + "mlp.experts.down_proj"][e]
        else:
            pe = f"{p}mlp.experts.{e}."
            out[x + "linear_fc1.weight"] = torch.cat([take(pe + "gate_proj.weight"), take(pe + "up_proj.weight")])
            out[x + "linear_fc2.weight"] = take(pe + "down_proj.weight")
            if mc.family == "gpt_oss":  # biases, gate over up as the weights
                out[x + "linear_fc1.bias"] = torch.cat([take(pe + "gate_proj.bias"), take(pe + "up_proj.bias")])
                out[x + "linear_fc2.bias"] = take(pe + "down_proj.bias")
    hf.pop(fused, None)
    hf.pop(p + "mlp.experts.down_proj", None)


def hf_sources(mc: ModelConfig) -> list[tuple[str, str, Callable[[torch.Tensor], torch.Tensor]]]:
    """(HF name, full megatron name, megatron tensor -> HF tensor (a view)) for every tensor of the per-expert
    checkpoint layout, in the order save_pretrained writes them."""
    L, E, H = mc.num_hidden_layers, mc.num_experts, mc.hidden_size
    nq, ng, d, inter = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.moe_intermediate_size

    def same(t):
        return t

    def qkv_part(i):  # per query group: its q heads, then its k head, then its v head
        rows = nq // ng * d if i == 0 else d
        return lambda t: t.view(ng, (nq // ng + 2) * d, H).split([nq // ng * d, d, d], dim=1)[i].reshape(
            ng * rows, H)

    def fc1_part(i):  # linear_fc1 stacks gate over up
        return lambda t: t.split([inter, inter])[i]

    shared = mc.shared_expert_intermediate_size

    def shared_fc1_part(i):
        return lambda t: t.split([shared, shared])[i]

    def qkv_bias_part(i):
        rows = nq // ng * d if i == 0 else d
        return lambda t: t.view(ng, (nq // ng + 2) * d).split([nq // ng * d, d, d], dim=1)[i].reshape(ng * rows)

    out = [("model.embed_tokens.weight", "embedding.word_embeddings.weight", same)]
    for i in range(L):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out += [(p + "input_layernorm.weight", m + "input_layernorm.weight", same),
                (p + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight", same)]
        out += [(p + theirs, m + ours, same) for theirs, ours in _renamed(mc, i)]
        if not mc.mla:
            out += [(p + f"self_attn.{x}_proj.weight", m + "self_attention.linear_qkv.weight", qkv_part(j))
                    for j, x in enumerate("qkv")]
            out += [(p + f"self_attn.{x}_proj.bias", m + "self_attention.linear_qkv.bias", qkv_bias_part(j))
                    for j, x in enumerate("qkv") if mc.attention_bias]
        if i < mc.first_k_dense_replace:  # a dense MLP
            dense = lambda j: lambda t: t.split([mc.intermediate_size] * 2)[j]  # noqa: E731 - gate over up
            out += [(p + "mlp.gate_proj.weight", m + "mlp.linear_fc1.weight", dense(0)),
                    (p + "mlp.up_proj.weight", m + "mlp.linear_fc1.weight", dense(1)),
                    (p + "mlp.down_proj.weight", m + "mlp.linear_fc2.weight", same)]
            continue
        if shared:
            sp, sm = p + _shared_prefix(mc), m + "mlp.shared_experts."
            out += [(sp + "gate_proj.weight", sm + "linear_fc1.weight", shared_fc1_part(0)),
                    (sp + "up_proj.weight", sm + "linear_fc1.weight", shared_fc1_part(1)),
                    (sp + "down_proj.weight", sm + "linear_fc2.weight", same)]
            if mc.shared_expert_gate:
                out.append((p + "mlp.shared_expert_gate.weight", sm + "gate_weight", same))
        for e in range(E):
            x, pe = f"{m}mlp.experts.local_experts.{e}.", f"{p}mlp.experts.{e}."
            out += [(pe + "gate_proj.weight", x + "linear_fc1.weight", fc1_part(0)),
                    (pe + "up_proj.weight", x + "linear_fc1.weight", fc1_part(1)),
                    (pe + "down_proj.weight", x + "linear_fc2.weight", same)]
            if mc.family == "gpt_oss":
                out += [(pe + "gate_proj.bias", x + "linear_fc1.bias", fc1_part(0)),
                        (pe + "up_proj.bias", x + "linear_fc1.bias", fc1_part(1)),
                        (pe + "down_proj.bias", x + "linear_fc2.bias", same)]
    out.append(("model.norm.weight", "decoder.final_layernorm.weight", same))
    if not mc.tie_word_embeddings:  # a tied head is the embedding: saved once, as transformers saves it
        out.append(("lm_head.weight", "output_layer.weight", same))
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    """Full megatron state dict -> HF state dict in the per-expert Qwen3-MoE layout."""
    return {k: f(mg[src]).contiguous() for k, src, f in hf_sources(mc)}


# ---------------------------------------------------------------- files
def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir (model.safetensors or an index of shards), each file checked."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{path}: no *.safetensors weights found")
    out: dict[str, torch.Tensor] = {}
    for fn in files:
        f = path / fn
        if not f.is_file():
            raise ConfigError(f"{f}: listed in the index but missing")
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ConfigError(f"{f}: unreadable or truncated safetensors file ({e})") from None
    return out


def write_hf_dir(path: Path, config: dict, tensors: dict[str, torch.Tensor], max_shard_bytes: int = 2 * 2**30):
    """Write config.json + safetensors (sharded with an index past max_shard_bytes) atomically: everything goes
    to a temp dir beside `path`, is fsynced, then renamed into place. `tensors` go by the package's names; the
    files name them as config["model_type"]'s checkpoints do."""
    tensors = file_keys(tensors, config.get("model_type", "qwen3_moe"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        nb = t.numel() * t.element_size()
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = t, size + nb
    shards.append(cur)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for n, s in zip(names, shards):
        save_file(s, str(tmp / n), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.rename(path, old)
        os.rename(tmp, path)
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    fsync_dir(path.parent)
    return path
