"""Typed config: YAML + overrides, and one clear error per bad input, before any model is built."""

import pytest

from moe_gspo.config import ConfigError, apply_overrides, load_config
from moe_gspo.config import ParallelConfig
from moe_gspo.parallel.state import validate_sizes


def test_yaml_and_overrides():
    c = load_config("configs/tiny_cpu.yaml", ["train.lr=3e-4", "parallel.ep=2", "algorithm.loss=grpo"])
    assert c.train.lr == 3e-4 and c.parallel.ep == 2 and c.algorithm.loss == "grpo"
    assert c.model.num_experts == 8 and c.model.num_experts_per_tok == 2


def test_a_comparison_config_trains_its_shared_config_with_a_variants_overrides():
    # what `moe-gspo train --config configs/gpu_single.yaml algorithm.loss=grpo ...` loads: the config compare
    # shares across variants, with the overrides on top; the compare section is compare's alone
    from moe_gspo.config import config_from_dict
    from moe_gspo.experiments.compare import read_compare_config

    variant = ["algorithm.loss=grpo", "algorithm.routing_replay=r3"]
    c = load_config("configs/gpu_single.yaml", variant)
    shared, variants, _ = read_compare_config("configs/gpu_single.yaml")
    assert variants["grpo_r3"] == variant
    assert c == config_from_dict(apply_overrides(shared, variant))
    assert (c.algorithm.loss, c.algorithm.routing_replay, c.model.num_experts) == ("grpo", "r3", 32)


@pytest.mark.parametrize("override,match", [
    (["train.foo=1"], "unknown config key 'train.foo'"),
    (["nosuch.x=1"], "unknown config key 'nosuch'"),
    (["train.steps=abc"], "train.steps='abc' must be an int"),
    (["model.norm_topk_prob=3"], "model.norm_topk_prob=3 must be a bool"),
    (["parallel.tp=0"], "parallel.tp=0 must be > 0"),
    (["algorithm.routing_replay=r5"], "algorithm.routing_replay='r5' is not one of"),
    (["model.num_key_value_heads=3"], "model.num_key_value_heads=3 must divide"),
    (["trainlr"], "not of the form"),
    (["model.spec=fused"], "model.spec='fused' is not one of"),
    (["model.spec=te", "model.attention=sdpa"], r"model.attention='sdpa' is not one of \['te'\]"),
    (["model.attention=te"], r"model.attention='te' is not one of \['sdpa', 'megatron'\]"),
    (["model.spec=te", "model.experts=torch"], "model.experts='torch' is a local-spec module"),
    (["model.spec=te", "model.experts=megatron", "model.compile=true"], "model.compile=true is tested on the local"),
])
def test_bad_values_name_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/tiny_cpu.yaml", override)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml:[0-9]+: invalid YAML"):
        load_config(bad)


@pytest.mark.parametrize("tp,ep,world,experts,match", [
    (3, 1, 4, 8, "parallel.tp=3 does not divide the world size 4"),
    (1, 3, 4, 8, "parallel.ep=3 does not divide the world size 4"),
    (1, 4, 4, 6, "model.num_experts=6 is not divisible by parallel.ep=4"),
])
def test_parallel_sizes_checked_before_build(tp, ep, world, experts, match):
    with pytest.raises(ConfigError, match=match):
        validate_sizes(ParallelConfig(tp=tp, ep=ep), world, experts)


def test_load_policy_rejects_ep_not_dividing_experts():
    import moe_gspo

    cfg = load_config("configs/tiny_cpu.yaml", ["parallel.ep=3", "model.num_experts=8"])
    with pytest.raises(ConfigError, match="does not divide the world size 1|not divisible by parallel.ep=3"):
        moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))


def test_off_stays_a_string():
    """YAML 1.1 would read `off` as False; the config reader keeps it the string it is."""
    c = load_config("configs/tiny_cpu.yaml", ["algorithm.routing_replay=off", "algorithm.track_flips=false"])
    assert c.algorithm.routing_replay == "off" and c.algorithm.track_flips is False


def test_layer_spec_is_chosen_by_the_config_alone():
    """model.spec defaults to the local spec whatever is installed; its attention default follows the spec; 'te' where
    TE cannot run is one ConfigError naming the field and what is missing, raised when the layer spec is built."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from moe_gspo.model.experts import GroupedGemmExperts
    from moe_gspo.model.layers import RMSNorm, SDPAttention, TorchLoopExperts
    from moe_gspo.model.router import MoERouter
    from moe_gspo.model.spec import layer_spec, te_missing

    local = load_config("configs/tiny_cpu.yaml").model
    assert local.spec == "local" and local.attention == "sdpa" and local.experts == "grouped"
    sub = layer_spec(local).submodules  # the local spec with this package's router, norms, attention, experts
    attn = sub.self_attention.submodules
    assert sub.input_layernorm is RMSNorm and sub.pre_mlp_layernorm is RMSNorm
    assert attn.q_layernorm is RMSNorm and attn.k_layernorm is RMSNorm and attn.core_attention is SDPAttention
    assert sub.mlp.submodules.router is MoERouter and sub.mlp.submodules.experts.module is GroupedGemmExperts
    other = layer_spec(load_config("configs/tiny_cpu.yaml", ["model.attention=megatron", "model.experts=torch"]).model)
    assert other.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert other.submodules.mlp.submodules.experts.module is TorchLoopExperts
    te = load_config("configs/tiny_cpu.yaml", ["model.spec=te", "model.experts=grouped"]).model
    assert te.attention == "te"
    if te_missing() is None:
        pytest.skip("Transformer Engine runs here: the refusal cannot be shown")
    with pytest.raises(ConfigError, match=r"model.spec='te' needs Transformer Engine on CUDA: "):
        layer_spec(te)


def test_a_config_may_start_from_a_base_config(tmp_path):
    """`base:` reads the named file first (relative to the file naming it); the file's sections override it key by
    key, nested mappings merged; a cycle and a missing base are refused in one line naming the file."""
    from moe_gspo.config import ConfigError, read_yaml

    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text("model:\n  hidden_size: 48\n  num_experts: 4\ntrain:\n  steps: 7\n")
    (tmp_path / "sub" / "mid.yaml").write_text("base: ../root.yaml\nmodel:\n  num_experts: 6\n")
    (tmp_path / "leaf.yaml").write_text("base: sub/mid.yaml\ntrain:\n  steps: 9\n  lr: 0.01\n")
    assert read_yaml(tmp_path / "leaf.yaml") == {"model": {"hidden_size": 48, "num_experts": 6},
                                                 "train": {"steps": 9, "lr": 0.01}}
    cfg = load_config(tmp_path / "leaf.yaml", ["model.num_experts=8"])
    assert (cfg.model.hidden_size, cfg.model.num_experts, cfg.train.steps) == (48, 8, 9)
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"b.yaml: base='a.yaml' makes a cycle \(a.yaml -> b.yaml -> a.yaml\)"):
        read_yaml(tmp_path / "a.yaml")
    (tmp_path / "lost.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="config file not found: .*nowhere.yaml"):
        read_yaml(tmp_path / "lost.yaml")
