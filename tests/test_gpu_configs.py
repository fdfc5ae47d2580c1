"""The GPU configs load on any machine, and the parameter counts they state are the ones their fields give
(ModelConfig.parameter_counts, checked here against a built transformers model)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import ROOT

from moe_gspo.config import load_config


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_counts_equal_a_built_model(tie):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from moe_gspo.model.hf_io import hf_config_dict

    mc = dataclasses.replace(load_config(ROOT / "configs" / "tiny_cpu.yaml").model, tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"].from_dict(hf_config_dict(mc)))
    total, active = mc.parameter_counts()
    assert total == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert active == total - experts + experts * mc.num_experts_per_tok // mc.num_experts


def test_gpu_2b_config_is_about_2b_parameters():
    path = ROOT / "configs" / "gpu_2b.yaml"
    cfg = load_config(path)
    m = cfg.model
    assert (m.num_experts, m.num_experts_per_tok, m.max_position_embeddings) == (64, 8, 2048)
    total, active = m.parameter_counts()
    assert 1.9e9 <= total <= 2.1e9, total
    assert 0.25e9 <= active <= 0.4e9, active
    text = path.read_text()
    assert f"total {total:,}" in text and f"active per token {active:,}" in text  # the comment states these


def test_gpu_single_config_counts():
    from moe_gspo.config import ModelConfig, read_yaml

    path = ROOT / "configs" / "gpu_single.yaml"
    total, active = ModelConfig(**read_yaml(path)["model"]).parameter_counts()
    assert (round(total / 1e6), round(active / 1e6)) == (636, 108)
    assert "636M parameters, 108M active" in path.read_text()  # its comment (and docs/gpu.md) state these
