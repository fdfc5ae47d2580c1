"""A dense Hugging Face checkpoint (or a GGUF file) upcycled to a Mixture-of-Experts checkpoint this stack trains.

Every expert starts as a copy of the dense layer's MLP; attention, norms, embeddings and head are copied as they
are. With top-k routing renormalized over the chosen experts (every target family here renormalizes), the experts'
weights sum to one, so the MoE computes the dense model's function exactly, whatever the router says:

    llama, mistral -> mixtral    (no q/k norm, no biases)
    llama, mistral -> qwen2_moe  (zero q/k/v biases; a shared expert, below)
    qwen2          -> qwen2_moe  (q/k/v biases kept)
    qwen3          -> qwen3_moe  (q/k norm kept)

Qwen2-MoE adds a shared expert behind a sigmoid gate. The shared expert is the dense MLP, the gate's weights are
zero (sigmoid(0) = 1/2), and every routed expert's down projection is halved, so the two halves sum to the dense
output; multiplying by 1/2 is exact in binary floating point.

The router is drawn from N(0, router_std) (transformers' and megatron-core's initialization of a fresh router,
std = the source's initializer_range unless given), seeded. Drop-Upcycling (Nakamura et al., ICLR 2025) makes the
experts differ from the start: in each routed expert a fraction `drop_rate` of the intermediate neurons, drawn per
expert, is re-initialized (their gate and up rows and down column), each matrix from a normal with the mean and
standard deviation of its dense original. drop_rate 0 keeps the dense function exactly.

megatron-core's own upcycling (megatron/core/transformer/moe/upcycling_utils.py) also copies the dense MLP into
every expert and keeps the MoE model's random router. It scales expert weights only where the routing needs it
(softmax before top-k, or experts finer than the dense MLP); with top-k-then-softmax at granularity 1, as here,
it scales nothing, and neither does this. It works on megatron models in memory inside a training job; this writes
a Hugging Face folder that transformers, vLLM and `model.init_from` load, and adds the shared expert split and
Drop-Upcycling, which it does not have.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_gspo.config.checks import ConfigError
from moe_gspo.model import families
from moe_gspo.model.hf_io import usual_modes

def _targets() -> dict[str, tuple[str, ...]]:
    """Dense model_type -> the families it upcycles to (each family's upcycles_from), the preferred one first."""
    out: dict[str, list] = {}
    for fam in sorted(families.every(), key=lambda f: not f.upcycle_preferred):
        for src in fam.upcycles_from:
            out.setdefault(src, []).append(fam.name)
    return {k: tuple(out[k]) for k in sorted(out)}


TARGETS = _targets()
"""Dense model_type -> the MoE families it upcycles to, the default first."""
# the dense config's fields every target takes over as they are (others are the family's own or its defaults)
SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                 "tie_word_embeddings", "initializer_range", "attention_dropout", "bos_token_id", "eos_token_id",
                 "pad_token_id")


@dataclass(frozen=True)
class UpcycleSpec:
    """How to upcycle: experts, top-k, the target family (None: the source's first), Drop-Upcycling's rate, the
    router's std (None: the source's initializer_range), the seed and the saved dtype (None: the source's)."""
    num_experts: int = 4
    top_k: int = 2
    family: str | None = None
    drop_rate: float = 0.0
    router_std: float | None = None
    seed: int = 0
    dtype: str | None = None


# ------------------------------------------------------------------------------------------------ the source
def _gguf_file(src: Path) -> Path | None:
    """The GGUF file `src` names: the file itself, or the only *.gguf in a folder that has no config.json."""
    if src.is_file():
        return src if src.suffix == ".gguf" else None
    if (src / "config.json").is_file():
        return None
    found = sorted(src.glob("*.gguf"))
    if len(found) > 1:
        raise ConfigError(f"{src}: holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}); name one")
    return found[0] if found else None


def read_source(src: str | Path) -> tuple[str, dict, object, Path]:
    """(folder, transformers' keyword for a GGUF file, config, the file named in errors) of a dense HF folder or
    GGUF file, its architecture checked; no weights are read."""
    from transformers import AutoConfig

    src = Path(src)
    if not src.exists():
        raise ConfigError(f"{src}: no such file or folder")
    gguf = _gguf_file(src)
    if gguf is None and not (src / "config.json").is_file():
        raise ConfigError(f"{src}: neither a Hugging Face checkpoint folder (config.json) nor a .gguf file")
    if gguf is not None:
        import importlib.util

        if importlib.util.find_spec("gguf") is None:
            raise ConfigError(f"{gguf}: reading GGUF needs the gguf package (pip install gguf==0.19.0, or "
                              "bash scripts/get_real_model.sh)")
        folder, kw = str(gguf.parent), {"gguf_file": gguf.name}
    else:
        folder, kw = str(src), {}
    where = gguf or src / "config.json"
    try:
        config = AutoConfig.from_pretrained(folder, **kw)
    except (OSError, ValueError, KeyError) as e:  # garbled JSON, an unknown model_type, a GGUF of another kind
        raise ConfigError(f"{where}: transformers cannot read it ({str(e).splitlines()[0][:200]})") from None
    _check_source(config, where)
    return folder, kw, config, where


def load_dense(folder: str, kw: dict, dtype: torch.dtype | None = None):
    """(model, tokenizer or None, generation config or None) of read_source's checkpoint. A GGUF file's quantized
    weights are dequantized by transformers (which needs the `gguf` package)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto", **kw).eval()
    try:
        tok = AutoTokenizer.from_pretrained(folder, **kw)
    except (OSError, ValueError):  # a weights-only folder: the trainer's own tokenizer applies
        tok = None
    try:
        gen = GenerationConfig.from_pretrained(folder) if not kw else model.generation_config
    except OSError:
        gen = None
    return model, tok, gen


def _check_source(config, where: Path) -> None:
    """Refuse in one line what no target family computes exactly."""
    mt = getattr(config, "model_type", None)
    if mt not in TARGETS:
        kind = "already a Mixture-of-Experts checkpoint" if getattr(config, "num_experts", None) or \
            getattr(config, "num_local_experts", None) else f"model_type={mt!r}"
        raise ConfigError(f"{where}: {kind}; moe-gspo upcycles dense {', '.join(TARGETS)} checkpoints")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={config.hidden_act!r}: the MoE families here use SwiGLU (silu) experts")
    for flag in ("attention_bias", "mlp_bias"):
        if mt in ("llama", "mistral") and getattr(config, flag, False):
            raise ConfigError(f"{where}: {flag}=true: Mixtral's and Qwen2-MoE's layers have no such biases")
    if mt == "qwen3" and getattr(config, "attention_bias", False):
        raise ConfigError(f"{where}: attention_bias=true: Qwen3-MoE's attention has no biases")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{where}: rope_type={rope['rope_type']!r}: the MoE families here use plain rotary "
                          "embeddings")
    window = getattr(config, "sliding_window", None)
    if window is not None and (mt == "mistral" or getattr(config, "use_sliding_window", False)):
        raise ConfigError(f"{where}: sliding_window={window}: sliding-window attention is not implemented")


# ------------------------------------------------------------------------------------------------ the target
def target_family(source_type: str, family: str | None) -> str:
    allowed = TARGETS[source_type]
    if family is None:
        return allowed[0]
    if family not in allowed:
        raise ConfigError(f"--family {family}: a {source_type} checkpoint upcycles to {' or '.join(allowed)} "
                          "(other families differ in attention: q/k norm or biases)")
    return family


def moe_config(dense_config, family: str, spec: UpcycleSpec):
    """The MoE family's transformers config for `dense_config`'s architecture."""
    from transformers import CONFIG_MAPPING

    d = dense_config.to_dict()
    fields = {k: d[k] for k in SHARED_FIELDS if d.get(k) is not None}
    fields.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    fields.update(families.family(family).upcycle_fields(spec.num_experts, spec.top_k, d["intermediate_size"]))
    config = CONFIG_MAPPING[family](**fields)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def _dropped(w: torch.Tensor, rows: torch.Tensor, dim: int, g: torch.Generator) -> torch.Tensor:
    """`w` with the slices `rows` along `dim` redrawn from N(mean(w), std(w)) (Drop-Upcycling's re-initialization)."""
    out = w.clone()
    shape = list(w.shape)
    shape[dim] = len(rows)
    fresh = torch.randn(shape, generator=g, dtype=torch.float64) * w.double().std() + w.double().mean()
    out.index_copy_(dim, rows, fresh.to(w.dtype))
    return out


def upcycled_state(dense_sd: dict[str, torch.Tensor], moe_model, family: str, spec: UpcycleSpec,
                   router_std: float) -> dict[str, torch.Tensor]:
    """The MoE model's state dict from the dense one: same-named tensors copied, experts from the dense MLP.
    `moe_model` gives the names and shapes only."""
    g = torch.Generator().manual_seed(spec.seed)
    target = moe_model.state_dict()
    out: dict[str, torch.Tensor] = {}
    E, L = spec.num_experts, moe_model.config.num_hidden_layers
    for key, t in dense_sd.items():
        if ".mlp." in key:
            continue
        if key not in target:
            raise KeyError(f"{key}: the dense tensor has no place in the {family} model")
        out[key] = t
    for i in range(L):
        p = f"model.layers.{i}.mlp."
        gate, up, down = (dense_sd[p + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
        inter = gate.shape[0]
        shared = families.family(family).upcycle_shared_expert  # the dense MLP is also the shared expert
        scale = 0.5 if shared else 1.0
        gate_up, downs = [], []
        for _ in range(E):
            eg, eu, ed = gate, up, down
            if spec.drop_rate > 0:
                n = int(round(spec.drop_rate * inter))
                rows = torch.randperm(inter, generator=g)[:n]
                eg, eu, ed = _dropped(gate, rows, 0, g), _dropped(up, rows, 0, g), _dropped(down, rows, 1, g)
            gate_up.append(torch.cat([eg, eu]))
            downs.append(ed * scale)
        out[p + "experts.gate_up_proj"] = torch.stack(gate_up)
        out[p + "experts.down_proj"] = torch.stack(downs)
        router = target[p + "gate.weight"]
        out[p + "gate.weight"] = (torch.randn(router.shape, generator=g, dtype=torch.float64) * router_std).to(
            gate.dtype)
        if shared:
            for n, w in (("gate", gate), ("up", up), ("down", down)):
                out[p + f"shared_expert.{n}_proj.weight"] = w
            out[p + "shared_expert_gate.weight"] = torch.zeros(target[p + "shared_expert_gate.weight"].shape,
                                                               dtype=gate.dtype)
    for key, t in target.items():  # zero q/k/v biases for a llama source in Qwen2-MoE
        if key not in out and key.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            out[key] = torch.zeros(t.shape, dtype=gate.dtype)
    return out


def upcycle(src: str | Path, out: str | Path, spec: UpcycleSpec = UpcycleSpec(), save_dense: str | Path | None = None,
            overwrite: bool = False) -> dict:
    """Write the MoE checkpoint of `src` to `out` (config, safetensors, tokenizer with its chat template,
    generation_config.json and upcycle.json, which records the source and the spec) atomically. With `save_dense`,
    also the dense model as a plain HF folder (a GGUF source's dequantized weights). Returns upcycle.json's record."""
    from transformers import AutoModelForCausalLM

    if spec.num_experts < 1 or not 1 <= spec.top_k <= spec.num_experts:
        raise ConfigError(f"--experts {spec.num_experts} --top-k {spec.top_k}: need 1 <= top-k <= experts")
    if not 0.0 <= spec.drop_rate <= 1.0:
        raise ConfigError(f"--drop-rate {spec.drop_rate}: a fraction in [0, 1]")
    if spec.router_std is not None and spec.router_std < 0:
        raise ConfigError(f"--router-std {spec.router_std}: must be >= 0")
    dtype = None
    if spec.dtype is not None:
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"--dtype {spec.dtype}: not a torch floating dtype (float32, bfloat16, float16)")
    out = Path(out)
    for d in [out] + ([Path(save_dense)] if save_dense else []):
        if d.exists() and any(d.iterdir()) and not overwrite:
            raise ConfigError(f"{d}: exists and is not empty (--overwrite replaces it)")
    folder, kw, source_config, where = read_source(src)
    family = target_family(source_config.model_type, spec.family)
    dense, tok, gen = load_dense(folder, kw, dtype)
    config = moe_config(dense.config, family, spec)
    config.dtype = dense.dtype
    router_std = dense.config.initializer_range if spec.router_std is None else spec.router_std
    moe = AutoModelForCausalLM.from_config(config, dtype=dense.dtype).eval()
    state = upcycled_state(dense.state_dict(), moe, family, spec, router_std)
    missing, unexpected = moe.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"upcycled state does not fit {family}: missing {missing[:6]}, unexpected "
                           f"{unexpected[:6]}")
    if config.tie_word_embeddings:
        moe.tie_weights()
    src_path = where if where.suffix == ".gguf" else Path(src)
    digest = None
    if src_path.is_file():
        with open(src_path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    record = {"source": str(src_path.resolve()), "source_model_type": dense.config.model_type,
              "source_sha256": digest,
              "family": family, "router_std": router_std, "dtype": str(dense.dtype).removeprefix("torch."),
              **{k: v for k, v in asdict(spec).items() if k not in ("family", "router_std", "dtype")}}
    _save(out, moe, tok, gen, record, overwrite)
    if save_dense:
        # a model read from GGUF refuses save_pretrained: rebuild it from its config with the same weights
        plain = AutoModelForCausalLM.from_config(dense.config, dtype=dense.dtype)
        plain.load_state_dict(dense.state_dict())
        _save(Path(save_dense), plain.eval(), tok, gen, None, overwrite)
    return record


def _save(out: Path, model, tok, gen, record: dict | None, overwrite: bool) -> None:
    """Write to a temporary folder beside `out`, then rename it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(str(tmp))
        if tok is not None:
            tok.save_pretrained(str(tmp))
        if gen is not None:
            gen.save_pretrained(str(tmp))
        if record is not None:
            (tmp / "upcycle.json").write_text(json.dumps(record, indent=1) + "\n")
        usual_modes(tmp)
        if out.exists():
            if not overwrite and any(out.iterdir()):
                raise ConfigError(f"{out}: exists and is not empty (--overwrite replaces it)")
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
