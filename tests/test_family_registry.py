"""A model family is one file in moe_gspo/model/families/: the registry finds it, every family-specific choice is
declared there, and no code outside that folder names a family."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from helpers import ROOT

FAMILIES_DIR = ROOT / "moe_gspo" / "model" / "families"


def _docstring_ids(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
            out.add(id(n.value))  # a docstring, or a string statement documenting the line above it
    return out


def family_mentions(source: str, families: tuple[str, ...]) -> list[str]:
    """'line: what' for each place `source` names a family: a string literal equal to a family's name (docstrings
    aside), or a comparison of something called family or model_type with a string literal."""
    tree = ast.parse(source)
    docs = _docstring_ids(tree)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and n.value in families:
            out.append(f"{n.lineno}: {n.value!r}")
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            named = any(isinstance(s, ast.Name) and s.id in ("family", "model_type") or
                        isinstance(s, ast.Attribute) and s.attr in ("family", "model_type") for s in sides)
            literal = any(isinstance(s, ast.Constant) and isinstance(s.value, str) or
                          isinstance(s, (ast.Tuple, ast.List, ast.Set)) and s.elts and
                          all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in s.elts)
                          for s in sides)
            if named and literal:
                out.append(f"{n.lineno}: a family compared with a literal")
    return sorted(set(out))


def test_the_scan_finds_a_family_named_in_code():
    src = ('"""gpt_oss is described here."""\n'
           'def f(mc):\n'
           '    """qwen3_moe in a docstring is fine."""\n'
           '    if mc.family == "gpt_oss":\n'
           '        return {"mixtral": 1}\n'
           '    return model_type in ("a", "b")\n')
    assert family_mentions(src, ("gpt_oss", "mixtral", "qwen3_moe")) == [
        "4: 'gpt_oss'", "4: a family compared with a literal", "5: 'mixtral'", "6: a family compared with a literal"]


def test_no_code_outside_the_families_folder_names_a_family():
    from moe_gspo.model.families import names

    found = []
    for f in sorted((ROOT / "moe_gspo").rglob("*.py")):
        if FAMILIES_DIR in f.parents:
            continue
        found += [f"{f.relative_to(ROOT)}:{m}" for m in family_mentions(f.read_text(), names())]
    assert found == []


def test_every_file_of_the_folder_is_a_registered_family_of_its_name():
    from moe_gspo.model.families import family, names

    files = {f.stem for f in FAMILIES_DIR.glob("*.py") if f.stem != "base" and not f.stem.startswith("_")}
    assert set(names()) == files
    assert {"qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss"} <= files
    for n in names():
        fam = family(n)
        assert fam.name == n and fam.title and fam.hf_architecture.endswith("ForCausalLM")


def test_a_familys_own_fields_are_modelconfigs_and_refused_for_the_others():
    from moe_gspo.config import ConfigError, ModelConfig
    from moe_gspo.model.families import every

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    owners: dict[str, str] = {}
    for fam in every():
        for k, default in fam.own_field_defaults().items():
            assert k in fields
            assert k not in owners, f"{k} is both {owners[k]}'s and {fam.name}'s"
            owners[k] = fam.name
    assert owners["swiglu_limit"] == "gpt_oss" and owners["kv_lora_rank"] == "deepseek_v3"
    with pytest.raises(ConfigError, match=r"model.kv_lora_rank: model.family='mixtral' does not use it "
                                          r"\(DeepSeek-V3's field, model.family='deepseek_v3'\)"):
        ModelConfig(family="mixtral", kv_lora_rank=8)
    with pytest.raises(ConfigError, match=r"model.first_k_dense_replace: model.family='olmoe' does not use it "
                                          r"\(the families that do: deepseek_v3, glm4_moe\)"):
        ModelConfig(family="olmoe", first_k_dense_replace=1)


def test_a_new_family_file_is_found_and_runs_through_config_and_checkpoint_io(tmp_path, monkeypatch):
    """A file dropped in the folder (here a copy of Qwen3-MoE under another name) is a family: the config takes it,
    its config.json round-trips through the reader, and its tensors map to megatron's and back."""
    import torch

    import moe_gspo.model.families as families
    from moe_gspo.config import ModelConfig
    from moe_gspo.config.hf_config import architecture_from_hf
    from moe_gspo.model.hf_io import hf_config_dict, hf_sources, hf_to_megatron, megatron_to_hf

    (tmp_path / "toy_moe.py").write_text(
        "from moe_gspo.model.families.qwen3_moe import Qwen3Moe\n\n"
        "class ToyMoe(Qwen3Moe):\n    name = 'toy_moe'\n    title = 'Toy'\n"
        "    hf_architecture = 'ToyMoeForCausalLM'\n\n"
        "FAMILY = ToyMoe()\n")
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    monkeypatch.setattr(families, "_REGISTRY", dict(families._REGISTRY))
    families._load()
    assert "toy_moe" in families.names()
    mc = ModelConfig(family="toy_moe", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, num_experts=4, moe_intermediate_size=16, vocab_size=64)
    config = hf_config_dict(mc)
    assert config["model_type"] == "toy_moe" and config["architectures"] == ["ToyMoeForCausalLM"]
    assert ModelConfig(**architecture_from_hf(config, "config.json")) == mc
    sources = hf_sources(mc)
    full = {}
    for _, mg, _ in sources:
        full.setdefault(mg, None)
    shapes = {"embedding.word_embeddings.weight": (64, 32), "output_layer.weight": (64, 32)}
    g = torch.Generator().manual_seed(0)
    mg_state = {}
    for name in full:
        if name in shapes:
            shape = shapes[name]
        elif "linear_qkv" in name:
            shape = ((2 + 2) * 16, 32)
        elif "local_experts" in name and "fc1" in name:
            shape = (32, 32)
        elif "local_experts" in name:
            shape = (32, 16)
        elif "router" in name:
            shape = (4, 32)
        elif "linear_proj" in name:
            shape = (32, 32)
        else:
            shape = (16,) if "q_layernorm" in name or "k_layernorm" in name else (32,)
        mg_state[name] = torch.randn(shape, generator=g)
    hf = megatron_to_hf(mg_state, mc)
    assert "model.layers.1.self_attn.q_norm.weight" in hf  # Qwen3-MoE's query norm, inherited
    back = hf_to_megatron(hf, mc)
    assert back.keys() == mg_state.keys()
    assert all(torch.equal(back[k], mg_state[k]) for k in mg_state)
    assert Path(families.__file__).parent == FAMILIES_DIR
