"""The policy against transformers' own Qwen3-MoE: logits, routing, gradients, save/load round trips."""

import dataclasses
import json

import pytest
import torch
from helpers import ROOT, tiny_hf_model

import moe_gspo
from moe_gspo.config import ConfigError, ModelConfig, load_config
from moe_gspo.model.routing_capture import RoutingCapture


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def pair(request, tmp_path_factory):
    hf = tiny_hf_model(vocab=96, hidden=48, layers=3, heads=4, kv_heads=2, head_dim=12, experts=6, topk=2,
                       inter=24, seed=11, norm_topk_prob=request.param)
    d = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(str(d))
    return hf, moe_gspo.load_policy(d, moe_gspo.init_parallel(d)), d


def hf_routing(hf, x):
    """Top-k expert ids per layer from transformers' router logits: (B*T, L, k), sorted."""
    out = hf(x, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    return torch.stack([torch.topk(r.float(), k, dim=-1).indices.sort(-1).values for r in out.router_logits], 1)


def test_logits_match_transformers(pair):
    hf, policy, _ = pair
    x = torch.randint(0, 96, (3, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = hf(x).logits, policy(x)
    assert out.shape == (3, 21, 96) and out.dtype == torch.float32
    rel = (out - ref).abs().max() / ref.abs().max()
    assert rel < 1e-5, f"max relative logit error {rel:.2e}"


def test_routing_matches_transformers(pair):
    hf, policy, _ = pair
    x = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    cap = RoutingCapture()
    with torch.no_grad():
        policy(x, routing=cap)
        ref = hf_routing(hf, x)
    got = cap.stacked()
    assert got.shape == (2 * 17, 3, 2)
    assert torch.equal(got, ref), "top-k experts differ from transformers'"
    w = cap.layers[0].topk_weights
    if hf.config.norm_topk_prob:
        torch.testing.assert_close(w.sum(-1), torch.ones(34))


def test_hidden_path_reproduces_logits(pair):
    _, policy, _ = pair
    x = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        h = policy(x, return_hidden=True)
        logits = policy(x)
    torch.testing.assert_close(h @ policy.lm_head_weight().T, logits, rtol=1e-5, atol=1e-5)


def test_gradients_match_transformers(pair):
    hf, policy, _ = pair
    x = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))
    hf.zero_grad()
    policy.zero_grad()
    torch.nn.functional.cross_entropy(hf(x).logits.reshape(-1, 96), y.reshape(-1)).backward()
    torch.nn.functional.cross_entropy(policy(x).reshape(-1, 96), y.reshape(-1)).backward()
    pairs = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
             "lm_head.weight": "output_layer.weight",
             "model.layers.1.mlp.gate.weight": "decoder.layers.1.mlp.router.weight",
             "model.layers.2.self_attn.o_proj.weight": "decoder.layers.2.self_attention.linear_proj.weight",
             "model.layers.0.self_attn.q_norm.weight": "decoder.layers.0.self_attention.q_layernorm.weight"}
    hp, mp = dict(hf.named_parameters()), dict(policy.gpt.named_parameters())
    for h, m in pairs.items():
        torch.testing.assert_close(mp[m].grad, hp[h].grad, rtol=1e-4, atol=1e-6, msg=lambda s: f"{m}: {s}")


def test_save_load_round_trip_is_bitwise(pair, tmp_path):
    hf, policy, _ = pair
    policy.save_pretrained(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    again = moe_gspo.load_policy(tmp_path / "a", moe_gspo.init_parallel(tmp_path / "a"))
    a, b = policy.megatron_state(), again.megatron_state()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "save -> load changed a weight"
    # and transformers reads what we wrote, with identical outputs
    from transformers import Qwen3MoeForCausalLM

    back = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "a")).eval()
    x = torch.randint(0, 96, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, rtol=0, atol=0)


def test_sharded_checkpoint_loads(pair, tmp_path):
    _, policy, _ = pair
    policy.save_pretrained(tmp_path / "s", max_shard_bytes=200_000)
    files = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 1
    again = moe_gspo.load_policy(tmp_path / "s", moe_gspo.init_parallel(tmp_path / "s"))
    a, b = policy.megatron_state(), again.megatron_state()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_load_from_yaml_and_config(tmp_path):
    cfg = load_config("configs/tiny_cpu.yaml")
    p = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    x = torch.randint(0, cfg.model.vocab_size, (2, 8))
    assert p(x).shape == (2, 8, cfg.model.vocab_size)
    p2 = moe_gspo.load_policy("configs/tiny_cpu.yaml", moe_gspo.init_parallel("configs/tiny_cpu.yaml"))
    assert p2.model_config == cfg.model


def test_sequence_longer_than_context_is_refused():
    source = ModelConfig(vocab_size=32, hidden_size=32, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, num_experts=4,
                         moe_intermediate_size=16, num_hidden_layers=1,
                         max_position_embeddings=8)
    p = moe_gspo.load_policy(source, moe_gspo.init_parallel(source))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        p(torch.zeros(1, 9, dtype=torch.long))


# ---------------------------------------------------------------- bad checkpoints
def test_other_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="model_type='llama'"):
        moe_gspo.load_policy(tmp_path, moe_gspo.init_parallel(tmp_path))


def test_missing_weights_file(pair, tmp_path):
    _, _, d = pair
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        moe_gspo.load_policy(tmp_path, moe_gspo.init_parallel(tmp_path))


def test_truncated_weights_file(pair, tmp_path):
    _, _, d = pair
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    data = (d / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="model.safetensors: unreadable or truncated"):
        moe_gspo.load_policy(tmp_path, moe_gspo.init_parallel(tmp_path))


def test_garbled_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: invalid JSON"):
        moe_gspo.load_policy(tmp_path, moe_gspo.init_parallel(tmp_path))


def test_missing_tensor_is_named(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, _, d = pair
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    sd = load_file(str(d / "model.safetensors"))
    sd.pop("model.layers.1.self_attn.k_norm.weight")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="model.layers.1.self_attn.k_norm.weight"):
        moe_gspo.load_policy(tmp_path, moe_gspo.init_parallel(tmp_path))


def test_load_policy_builds_on_the_groups_it_is_given_and_changes_no_global_state():
    """init_parallel sets up the process; load_policy only builds: the caller's RNG state is as it was, and two
    loads of one config on the same groups give the same weights (the config's seed, not the RNG's history)."""
    cfg = load_config("configs/tiny_cpu.yaml")
    groups = moe_gspo.init_parallel(cfg)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = moe_gspo.load_policy(cfg, groups)
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(5)  # move the caller's RNG: the next build must not depend on it
    b = moe_gspo.load_policy(cfg, groups)
    assert a.groups is groups and a.tp == groups.tp.size() == 1
    sa, sb = a.megatron_state(), b.megatron_state()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with pytest.raises(ConfigError, match="parallel.tp=2"):
        moe_gspo.load_policy(cfg, groups, parallel=dataclasses.replace(cfg.parallel, tp=2))


def test_a_forward_sets_no_attribute_of_the_model():
    """The hidden-state forward (the fused log-prob path's input) leaves the GPT model's attributes as they were,
    during the call too: a layer's hook sees the same post_process flag and the same attribute set as before."""
    import moe_gspo

    groups = moe_gspo.init_parallel(ROOT / "configs/tiny_cpu.yaml")
    policy = moe_gspo.load_policy(ROOT / "configs/tiny_cpu.yaml", groups)
    before = dict(vars(policy.gpt))
    seen = []
    hook = policy.gpt.decoder.layers[0].register_forward_hook(
        lambda *_: seen.append((policy.gpt.post_process, dict(vars(policy.gpt)) == before)))
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = policy(ids, return_hidden=True)
        logits = policy(ids)
    hook.remove()
    assert seen == [(True, True), (True, True)] and dict(vars(policy.gpt)) == before
    assert hidden.shape == (2, 6, policy.model_config.hidden_size)
    torch.testing.assert_close(hidden @ policy.lm_head_weight().t(), logits, rtol=1e-5, atol=1e-5)
