"""Hugging Face MoE checkpoints (model.family) <-> megatron-core parameter names, sharding for TP/EP, safetensors I/O.

Inside the package every family's tensors go by Qwen3-MoE's HF names (the keys of hf_sources: `mlp.gate`,
`mlp.experts.e.gate_proj / up_proj / down_proj`, which are also transformers 5's in-memory module names of every
family here); a family whose checkpoint files name them otherwise renames them at the file boundary only
(`file_keys` on writing, `package_keys` on reading), as its file in moe_gspo/model/families/ declares: Mixtral's
router and experts, GPT-OSS's fused experts. Which tensors a family has beyond the generic ones (its attention's
and router's, expert biases, shared experts) is declared there too.

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
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moe_gspo.config import ConfigError, ModelConfig
from moe_gspo.config.hf_config import model_config_from_hf  # noqa: F401 - read by model.load
from moe_gspo.model.families import DEFAULT, family
from moe_gspo.model.families.base import PER_EXPERT_KEY, fused_expert_view  # noqa: F401 - the engines read them

def file_keys(tensors: Mapping[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """The package's HF-named tensors under the names `model_type`'s checkpoint files use."""
    return family(model_type).file_keys(tensors)


def package_keys(tensors: Mapping[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """A family's checkpoint tensors under the package's names (the inverse of file_keys)."""
    return family(model_type).package_keys(tensors)


def file_items(state: Mapping[str, torch.Tensor], model_type: str):
    """(file name, tensor) of every tensor of `state` in its key order, as `model_type`'s checkpoint files name them,
    reading each value once (a streamed state gathers on reading)."""
    return family(model_type).file_items(state)


# ---------------------------------------------------------------- config.json
def hf_config_dict(mc: ModelConfig) -> dict:
    """config.json of the policy in its family's transformers config (model_type and field names)."""
    fam = family(mc.family)
    common = {
        "architectures": [fam.hf_architecture], "model_type": mc.family,
        "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size, "num_hidden_layers": mc.num_hidden_layers,
        "num_attention_heads": mc.num_attention_heads, "num_key_value_heads": mc.num_key_value_heads,
        "head_dim": mc.head_dim, "num_experts_per_tok": mc.num_experts_per_tok, "rms_norm_eps": mc.rms_norm_eps,
        "rope_theta": mc.rope_theta, "rope_scaling": None, "max_position_embeddings": mc.max_position_embeddings,
        "tie_word_embeddings": mc.tie_word_embeddings, "initializer_range": mc.initializer_range,
        "hidden_act": "silu", "router_aux_loss_coef": 0.0, "output_router_logits": False,
        "torch_dtype": mc.params_dtype,
    }
    return fam.to_hf(mc, common)


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
    if family(mc.family).drops_trailing_layers:  # multi-token-prediction layers, which neither transformers nor
        # RL uses: layer indices from L on
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
    family's attention tensors that map one to one, and an MoE layer's router (q/k/v, interleaved per query group in
    megatron, and the experts are not)."""
    fam = family(mc.family)
    return fam.attention_tensors(mc) + (fam.router_tensors(mc) if i >= mc.first_k_dense_replace else [])


def _moe_to_megatron(hf, out, take, mc: ModelConfig, p: str, m: str) -> None:
    """One MoE layer's shared and routed experts (HF prefix p, megatron prefix m) into `out`."""
    if mc.shared_expert_intermediate_size:
        sp = p + family(mc.family).shared_expert_prefix
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([take(sp + "gate_proj.weight"),
                                                                     take(sp + "up_proj.weight")])
        out[m + "mlp.shared_experts.linear_fc2.weight"] = take(sp + "down_proj.weight")
        if mc.shared_expert_gate:
            out[m + "mlp.shared_experts.gate_weight"] = take(p + "mlp.shared_expert_gate.weight")
    fused = p + "mlp.experts.gate_up_proj"
    biases = family(mc.family).linear_biases
    for e in range(mc.num_experts):
        x = f"{m}mlp.experts.local_experts.{e}."
        if fused in hf:
            out[x + "linear_fc1.weight"] = hf[fused][e]
            out[x + "linear_fc2.weight"] = hf[p + "mlp.experts.down_proj"][e]
        else:
            pe = f"{p}mlp.experts.{e}."
            out[x + "linear_fc1.weight"] = torch.cat([take(pe + "gate_proj.weight"), take(pe + "up_proj.weight")])
            out[x + "linear_fc2.weight"] = take(pe + "down_proj.weight")
            if biases:  # gate over up as the weights
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
    biases = family(mc.family).linear_biases

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
            sp, sm = p + family(mc.family).shared_expert_prefix, m + "mlp.shared_experts."
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
            if biases:
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
    tensors = file_keys(tensors, config.get("model_type", DEFAULT))
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
