"""GPT-OSS beyond what every family's tests check (tests/test_families.py): YaRN without rounding equals
transformers' frequencies and attention factor, the packed forward (sinks and sliding window on right-padded rows)
equals the padded one, the family picks its own experts module, and what it does not implement is refused at config
load in one line."""

from __future__ import annotations


import pytest
import torch

from family_checkpoints import config_with, gpt_oss_checkpoint
from helpers import tiny_cfg


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss")
    return d, gpt_oss_checkpoint(d)


@pytest.mark.parametrize("rope", [
    {"factor": 8.0, "original_max_position_embeddings": 32, "truncate": False},
    {"factor": 8.0, "original_max_position_embeddings": 32, "truncate": True},
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
])
def test_yarn_equals_transformers(rope):
    """model.rope's inverse frequencies and attention factor equal transformers' YaRN for GPT-OSS's head width,
    rounded or not (the rounding moves the ramp's ends: the two truncate cases differ, and each equals its own)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moe_gspo.config import ModelConfig
    from moe_gspo.model.rope import yarn_attention_factor, yarn_inv_freq

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **rope}
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(head_dim=64, rope_parameters=params), "cpu")
    mc = ModelConfig(family="gpt_oss", head_dim=64, rope_theta=150000.0, attention_bias=True,
                     rope_scaling={k: float(v) if k != "truncate" else v for k, v in rope.items()})
    torch.testing.assert_close(yarn_inv_freq(mc), ref_inv, rtol=1e-6, atol=0)
    assert yarn_attention_factor(mc) == pytest.approx(ref_factor, rel=1e-12)


def test_packed_forward_equals_padded_rows(checkpoint):
    """Sequences packed back to back (THD) go through the explicit attention as right-padded rows: logits and
    routing equal the padded batch's at every real token, with rows longer than the 6-token window."""
    import moe_gspo
    from moe_gspo.model.routing_capture import RoutingCapture

    d, _ = checkpoint
    cfg = tiny_cfg(f"model.init_from={d}")
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    lengths, T = [14, 3, 9], 14
    ids = torch.randint(1, 128, (3, T), generator=torch.Generator().manual_seed(4))
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(mask, ids, 0)
    cr, cp = RoutingCapture(), RoutingCapture()
    with torch.no_grad():
        rows = policy(ids, routing=cr)
        packed = policy(ids, routing=cp, lengths=lengths)
    torch.testing.assert_close(packed[mask], rows[mask], atol=2e-5, rtol=1e-5)
    flat = mask.reshape(-1)
    assert torch.equal(cp.stacked()[flat], cr.stacked()[flat])


def test_experts_default_to_the_torch_loop_and_others_are_refused(checkpoint):
    from moe_gspo.config import ConfigError

    d, _ = checkpoint
    assert tiny_cfg(f"model.init_from={d}").model.experts == "torch"
    assert tiny_cfg().model.experts == "grouped"
    with pytest.raises(ConfigError,
                       match=r"model.experts='grouped' with model.family='gpt_oss': .* model.experts=torch only"):
        tiny_cfg(f"model.init_from={d}", "model.experts=grouped")


@pytest.mark.parametrize("field,value,needle", [
    ("swiglu_alpha", 1.5, r"swiglu_alpha=1.5: moe-gspo's GPT-OSS implements 1.702 only"),
    ("quantization_config", {"quant_method": "mxfp4"}, r"quantization_config: .* \(dequantize"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, r"rope_scaling type 'linear'"),
    ("layer_types", ["sliding_attention"], r"model.layer_types=\['sliding_attention'\]: one of"),
])
def test_what_a_gpt_oss_checkpoint_asks_and_the_policy_lacks_is_refused(checkpoint, tmp_path, field, value, needle):
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        tiny_cfg(f"model.init_from={config_with(checkpoint[0], tmp_path, field, value)}")


@pytest.mark.parametrize("overrides,needle", [
    (["model.sliding_window=8"], r"model.sliding_window: model.family='qwen3_moe' does not use it"),
    (["model.swiglu_limit=7"], r"model.swiglu_limit: model.family='qwen3_moe' does not use it"),
    (["model.family=gpt_oss", "model.attention_bias=false"], r"model.attention_bias=false with model.family='gpt_oss'"),
    (["model.family=gpt_oss", "model.attention_bias=true", "model.attention=megatron"],
     r"model.attention='megatron' with model.family='gpt_oss'"),
    (["model.rope_scaling={factor: 4.0, original_max_position_embeddings: 16}"],
     r"model.rope_scaling: model.family='qwen3_moe' does not use it \(the families that do: deepseek_v3, gpt_oss\)"),
])
def test_gpt_oss_fields_are_checked_in_one_line(overrides, needle):
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        tiny_cfg(*overrides)


def test_file_items_stream_the_checkpoint_files_tensors_a_layer_of_experts_at_a_time(checkpoint):
    """What a GPU vLLM engine's loader is fed (hf_io.file_items): the package's per-expert tensors under the file's
    names, GPT-OSS's experts fused as each layer completes, every value read once in key order."""
    from collections.abc import Mapping

    from moe_gspo.model.hf_io import file_items, package_keys, read_safetensors_dir

    d, _ = checkpoint
    files = read_safetensors_dir(d)
    state = package_keys(files, "gpt_oss")

    class Reads(Mapping):  # a streamed state: counts reads, as StreamedHFState gathers on each
        def __init__(self):
            self.reads = []

        def __getitem__(self, k):
            self.reads.append(k)
            return state[k]

        def __iter__(self):
            return iter(state)

        def __len__(self):
            return len(state)

    src = Reads()
    got = {}
    for name, tensor in file_items(src, "gpt_oss"):
        if name.endswith(".mlp.experts.down_proj_bias"):  # a layer's experts arrive together, once it is complete
            layer = name.split(".mlp.")[0] + "."
            assert all(k.startswith(layer) or ".mlp.experts." not in k for k in src.reads[-48:])
        got[name] = tensor
    assert src.reads == list(state) and sorted(got) == sorted(files)
    assert all(torch.equal(got[k], files[k]) for k in files)
