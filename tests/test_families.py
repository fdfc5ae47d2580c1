"""Model families beside Qwen3-MoE (Mixtral; Qwen2-MoE with its q/k/v biases and gated shared expert; OLMoE with
its query/key norms over all heads; DeepSeek-V3 with latent attention, a dense first layer and a sigmoid router with
an expert bias and groups; GLM-4.5 with that router, q/k/v biases and rotary embeddings on half of each head;
GPT-OSS with attention sinks, a sliding window, un-rounded YaRN, a biased router and biased, clamped experts), each
from a tiny random transformers checkpoint (tests/family_checkpoints.py): the policy's fp32 logits equal
transformers' (1e-5 of the logit scale), the checkpoint exports back bit for bit to a folder transformers loads, RL
steps with R3 run on the hf and hf_static engines (which route as the trainer does), TP 2 x EP 2 equals one rank
(Qwen2-MoE, OLMoE, DeepSeek-V3, GPT-OSS), each family's comparison config draws a policy transformers computes alike, and
what a family cannot do yet is refused at config load in one line."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from family_checkpoints import CHECKPOINTS, config_with, mixtral_checkpoint
from helpers import ROOT, checked_cfg, records, run_torchrun, tiny_cfg


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def family(request, tmp_path_factory):
    """(family, checkpoint directory, the transformers model saved there)."""
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, CHECKPOINTS[request.param](d)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixtral_only")
    return d, mixtral_checkpoint(d)


def test_logits_equal_transformers_and_export_bit_for_bit(family, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import moe_gspo

    name, d, hf = family
    cfg = tiny_cfg(f"model.init_from={d}")
    assert cfg.model.family == name and cfg.model.qk_norm == (name in ("olmoe", "glm4_moe"))
    assert cfg.model.num_experts == 8
    assert (cfg.model.shared_expert_intermediate_size, cfg.model.attention_bias) == \
        {"qwen2_moe": (48, True), "deepseek_v3": (32, False), "glm4_moe": (32, True),
         "gpt_oss": (0, True)}.get(name, (0, False))
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ours = hf(ids).logits, policy(ids).float()
    assert (ref - ours).abs().max() <= 1e-5 * ref.abs().max(), (ref - ours).abs().max()
    policy.save_pretrained(tmp_path / "out")
    a, b = load_file(str(d / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    if name == "mixtral":
        assert any(".block_sparse_moe.experts.0.w3." in k for k in b)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == \
        json.loads((d / "config.json").read_text())["architectures"]
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()(ids).logits, ref)


@pytest.mark.parametrize("engine", ["hf", "hf_static"])
def test_rl_steps_with_r3_on_the_hf_engines_then_export(family, tmp_path, engine):
    """Two RL steps: the engine (a transformers model of the family updated in place after each optimizer step) samples with
    the trainer's weights and routing (R3 replays what it chose); the run's last checkpoint exports to a folder
    transformers loads, whose logits equal the trained policy's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import moe_gspo
    from moe_gspo.cli import main
    from moe_gspo.train.loop import train

    _, d, _ = family
    over = [f"model.init_from={d}", "algorithm.routing_replay=r3", f"rollout.engine={engine}", "train.steps=2",
            "rollout.reward=tests/data/spread_reward.py:compute_score", "train.cold_start_steps=0",
            "train.checkpoint_every=2"]
    train(tiny_cfg(*over), run_dir=tmp_path / "run")
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2] and all(r["grad_norm"] > 0 for r in recs)
    for r in recs:  # the engine computes what the trainer computes, on the weights pushed after each update
        assert r["moe/rollout_train_mismatch"] == 0.0 and r["rollout_probs_diff_max"] < 1e-5, r
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    cfg = tiny_cfg(f"model.init_from={tmp_path / 'hf'}")
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = exported(ids).logits
        assert (policy(ids).float() - ref).abs().max() <= 1e-5 * ref.abs().max()
    before = load_file(str(d / "model.safetensors"))
    head = before.get("lm_head.weight", before["model.embed_tokens.weight"])  # a tied head is the embedding
    assert not torch.equal(exported.lm_head.weight, head)  # it trained
    if exported.config.tie_word_embeddings:
        assert "lm_head.weight" not in load_file(str(tmp_path / "hf" / "model.safetensors"))
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("field,value,needle", [
    ("sliding_window", 64, "sliding_window=64: sliding-window attention is not implemented"),
    ("router_jitter_noise", 0.1, "router_jitter_noise=0.1: the router's training-time jitter is not implemented"),
])
def test_what_a_mixtral_checkpoint_asks_and_the_policy_lacks_is_refused(mixtral, tmp_path, field, value, needle):
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        tiny_cfg(f"model.init_from={config_with(mixtral[0], tmp_path / 'bad', field, value)}")


def test_the_sglang_engine_refuses_the_other_families(family):
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.engine=sglang serves model.family in \['qwen3_moe'\] only"):
        checked_cfg(f"model.init_from={family[1]}", "rollout.engine=sglang")


def test_tp2_and_ep2_equal_one_rank(tmp_path):
    """The parallel worker of tests/test_parallel.py on one checkpoint of each family whose pieces tensor
    parallelism splits its own way, all in one start of 2 ranks (the one-rank reference runs the worker's code in this
    process): TP 2 x EP 2 gives one rank's
    logits, routing, gradients (within 1e-5 of each gradient's scale) and three optimizer steps, and the engine's
    weights streamed from the shards equal the export.
    - Qwen2-MoE: q/k/v biases split with their query groups, the gated shared expert split over TP.
    - OLMoE: the query/key norms over all heads, each rank holding its heads' part and summing the mean of squares
      over TP (megatron's TP sum of q/k-layernorm gradients kept off them).
    - DeepSeek-V3: latent attention's up projections split by heads, its down projections replicated, the dense
      layer's MLP and the shared expert over TP. With megatron's local MLA spec (column-parallel down projections)
      the rotary key's gradient stays partial per rank: the embedding's gradient then differs by 7.5e3 of 4.2e4.
    - GPT-OSS: the sinks split with their heads, o_proj's bias replicated, the router's bias, and the experts' biases,
      whose output bias megatron marks for a TP sum of its gradient (an expert's gradient would then take its TP
      peer's other expert's: relative errors up to 3.6 before TorchLoopExperts unmarks it)."""
    names = ("qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
    for name in names:
        CHECKPOINTS[name](tmp_path / name)
    worker = ROOT / "tests/dist/parallel_worker.py"

    first, *rest = names
    also = [x for n in rest for x in ("--also", tmp_path / n, tmp_path / f"{n}_tp2ep2.pt")]
    run_torchrun(worker, "--ckpt", tmp_path / first, "--tp", 2, "--ep", 2, "--out", tmp_path / f"{first}_tp2ep2.pt",
                 *also, nproc=2)
    pars = {n: torch.load(tmp_path / f"{n}_tp2ep2.pt") for n in names}
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    from parallel_worker import run as one_rank  # the reference in this process: the worker's own code at 1 x 1

    for n in names:
        one_rank(types.SimpleNamespace(tp=1, ep=1, batch=4, seq=12, distopt=False, experts=None),
                 str(tmp_path / n), str(tmp_path / f"{n}_one.pt"))
    ones = {n: torch.load(tmp_path / f"{n}_one.pt") for n in names}
    for name in names:
        ref, par = ones[name], pars[name]
        torch.testing.assert_close(par["logits"], ref["logits"], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert torch.equal(par["routing"], ref["routing"]), name
        assert sorted(par["grads"]) == sorted(ref["grads"]), name
        for k, g in ref["grads"].items():
            torch.testing.assert_close(par["grads"][k], g, rtol=0, atol=1e-5 * max(1.0, g.abs().max().item()),
                                       msg=lambda m: f"{name} grad {k}: {m}")
        # Adam at the worker's lr 0.05 turns reduction-order noise into up to ~9e-5 of the loss by step 3 (a wrong
        # reduction moves it by O(lr), as tests/test_parallel.py explains). GPT-OSS amplifies it most (its clamped
        # SwiGLU switches a gradient off where noise crosses the clamp): on one CPU its third loss differed by 1.0e-3
        # (relative) with its second at 1.3e-5, so its third gets 5e-3
        torch.testing.assert_close(torch.tensor(par["losses"][:2]), torch.tensor(ref["losses"][:2]), rtol=2e-4,
                                   atol=1e-6, msg=lambda m: f"{name} losses: {m}")
        torch.testing.assert_close(par["losses"][2], ref["losses"][2], rtol=5e-3 if name == "gpt_oss" else 2e-4,
                                   atol=1e-6, msg=lambda m: f"{name} third loss: {m}")
        assert ref["losses"][2] < ref["losses"][0], name
        assert par["engine_sync"]["max_abs_diff"] == 0.0, name


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_each_family_config_draws_a_policy_that_transformers_computes_alike(name, tmp_path):
    """configs/compare_tiny_<family>.yaml (the embedded comparison on a freshly drawn policy of the family) builds
    its policy, and the folder it exports is that family's transformers model with the same logits."""
    from transformers import AutoModelForCausalLM

    import moe_gspo
    from moe_gspo.config import load_config

    cfg = load_config(ROOT / "configs" / "families" / f"{name}.yaml")
    assert cfg.model.family == name and cfg.algorithm.track_flips
    policy = moe_gspo.load_policy(cfg, moe_gspo.init_parallel(cfg))
    policy.save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.model_type == name
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (policy(ids).float() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_olmoe_needs_heads_times_head_dim_to_be_the_hidden_size():
    """transformers' and vLLM's OLMoE size the query norm by hidden_size: another head_dim would export a checkpoint
    neither can load, so the config refuses it in one line."""
    from moe_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.head_dim=16 with model.family='olmoe': .* \(head_dim=8\)"):
        tiny_cfg("model.family=olmoe", "model.num_attention_heads=4")
