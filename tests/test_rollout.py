"""HF rollout engine (CPU, fp32): seeded determinism, log-probs and routing equal a training forward's, batch layout.

The megatron-policy tests at the end run once moe_gspo.model.policy exists (they skip before).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moe_gspo.kernels import token_logprobs_from_logits
from moe_gspo.model.weights import WeightSource
from moe_gspo.rollout import RolloutBatch, SamplingParams, build_engine, rollout_probs_diff
from moe_gspo.rollout.hf_engine import HFEngine, copy_into_model
from moe_gspo.tasks import CharTokenizer

from helpers import concat_responses, hf_forward_with_routing, select_responses

TOK = CharTokenizer()
PROMPTS = ["12+34=", "5+6=", "123+456=", "7*8="]


def tiny_hf_model(seed: int = 0, init: float = 0.1):
    """A random Qwen3-MoE shaped like configs/tiny_cpu.yaml (init scaled up so sampling is not uniform)."""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         max_position_embeddings=512, initializer_range=init, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model()


@pytest.fixture(scope="module")
def prompts():
    return [TOK.encode(p, bos=True) for p in PROMPTS]


def _same(a: RolloutBatch, b: RolloutBatch) -> bool:
    return (all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
            and all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
            and a.finish_reasons == b.finish_reasons)


def test_generation_is_deterministic_with_a_seed(model, prompts):
    eng = HFEngine(model, tokenizer=TOK)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=7)
    a, b = eng.generate(prompts, 3, sp), eng.generate(prompts, 3, sp)
    assert _same(a, b)
    c = eng.generate(prompts, 3, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=8))
    assert not _same(a, c)
    # ids: unique samples across calls, one group per prompt
    assert len(set(a.sample_ids.tolist()) | set(b.sample_ids.tolist())) == 2 * len(a)
    assert a.group_ids.tolist() == [g for g in range(len(prompts)) for _ in range(3)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_full_forward_recomputation(model, prompts, temperature):
    eng = HFEngine(model, tokenizer=TOK)
    batch = eng.generate(prompts, 4, SamplingParams(temperature=temperature, max_new_tokens=12, seed=0))
    pb = batch.to_padded()
    logits, _ = hf_forward_with_routing(model, pb.input_ids)
    recomputed = token_logprobs_from_logits(logits, pb.input_ids, temperature)
    d = rollout_probs_diff(pb.engine_logprobs, recomputed, pb.response_mask)
    assert d["rollout_logprobs_diff_max"] < 1e-4, d  # float rounding at logits of magnitude ~5
    assert d["rollout_probs_diff_max"] < 1e-5, d
    # and a different model's log-probs are far off: the check can fail
    other, _ = hf_forward_with_routing(tiny_hf_model(seed=1), pb.input_ids)
    far = rollout_probs_diff(pb.engine_logprobs, token_logprobs_from_logits(other, pb.input_ids, temperature),
                             pb.response_mask)
    assert far["rollout_logprobs_diff_mean"] > 0.1


def test_routed_experts_equal_training_forward(model, prompts):
    eng = HFEngine(model, tokenizer=TOK)
    batch = eng.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=12, seed=3))
    pb = batch.to_padded()
    B, T = pb.input_ids.shape
    assert pb.routing.shape == (B, T, 4, 2)
    _, routing = hf_forward_with_routing(model, pb.input_ids)  # (B, T, L, k) sorted
    known = pb.routing[..., 0, 0] >= 0
    # every forwarded position is known: prompt and response except the last response token
    lengths = pb.attention_mask.sum(1)
    assert known.sum(1).tolist() == (lengths - 1).tolist()
    assert torch.equal(pb.routing[known], routing[known])
    for i, r in enumerate(batch.routed_experts):
        P = batch.prompt_ids[i].numel()
        assert r.dtype == torch.uint8 and r.shape == (batch.response_ids[i].numel(), 4, 2)
        assert torch.equal(r.long(), routing[i, P - 1:P - 1 + r.shape[0]])


def test_left_padding_matches_unbatched_generation(model, prompts):
    eng = HFEngine(model, tokenizer=TOK)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    together = eng.generate(prompts, 1, greedy)
    for i, p in enumerate(prompts):
        alone = eng.generate([p], 1, greedy)
        assert torch.equal(alone.response_ids[0], together.response_ids[i])
        assert torch.equal(alone.routed_experts[0], together.routed_experts[i])
        torch.testing.assert_close(alone.logprobs[0], together.logprobs[i], atol=1e-4, rtol=0)


def test_finish_reasons_stop_strings_and_max_tokens(model, prompts):
    eng = HFEngine(model, tokenizer=TOK)
    batch = eng.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=5, seed=0))
    for r, fr in zip(batch.response_ids, batch.finish_reasons):
        assert r.numel() <= 5
        assert (fr == "length") == (r.numel() == 5 and int(r[-1]) != TOK.eos_id)
    # a stop token id that is always sampled at once: every response is one token long, finish 'stop'
    first = eng.generate(prompts, 2, SamplingParams(temperature=0.0, max_new_tokens=6))
    stop_ids = sorted({int(r[0]) for r in first.response_ids})
    b = eng.generate(prompts, 2, SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=stop_ids))
    assert all(r.numel() == 1 for r in b.response_ids) and set(b.finish_reasons) == {"stop"}
    # stop string: ends with the token that completes it
    text = TOK.decode(first.response_ids[0][:3].tolist())
    s = eng.generate(prompts[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=6, stop=[text[1:3]]))
    assert s.finish_reasons == ["stop"] and TOK.decode(s.response_ids[0].tolist()) == text[:3]
    with pytest.raises(ValueError, match="tokenizer"):
        HFEngine(model).generate(prompts, 1, SamplingParams(stop=["x"]))


def test_top_p_small_is_greedy(model, prompts):
    eng = HFEngine(model, tokenizer=TOK)
    g = eng.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=6))
    p = eng.generate(prompts, 1, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=6, seed=0))
    assert all(torch.equal(a, b) for a, b in zip(g.response_ids, p.response_ids))


class _CheckpointWeights(WeightSource):
    """A weight source that is neither a policy nor a transformers model: config.json + checkpoint-format
    (per-expert) tensors read from disk. An engine loads it through the WeightSource interface alone."""

    def __init__(self, model, tmp_path):
        from safetensors.torch import load_file

        model.save_pretrained(tmp_path)
        self.config = json.loads((tmp_path / "config.json").read_text())
        self.state = load_file(tmp_path / "model.safetensors")

    def whole(self):
        return self.state


def test_update_weights_from_a_weight_source(model, prompts, tmp_path):
    policy = _CheckpointWeights(model, tmp_path)
    assert any(".experts.0.gate_proj.weight" in k for k in policy.state)  # per-expert checkpoint names
    eng = HFEngine(policy, tokenizer=TOK)
    assert eng.model is not model
    for k, v in model.state_dict().items():
        assert torch.equal(eng.model.state_dict()[k], v), k
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    assert _same(eng.generate(prompts, 2, sp), HFEngine(model, tokenizer=TOK).generate(prompts, 2, sp))
    built = eng.model
    ptrs = {k: v.data_ptr() for k, v in built.named_parameters()}
    with torch.no_grad():  # new weights in the exporting policy: every tensor changes
        policy.state = {k: v + 0.01 * torch.randn_like(v) for k, v in policy.state.items()}
    eng.update_weights(policy)  # same config: copied into the same module, tensor by tensor, in place
    assert eng.model is built and {k: v.data_ptr() for k, v in built.named_parameters()} == ptrs
    for k, v in built.state_dict().items():  # per-expert tensors read back out of the fused ones
        if k in policy.state:
            assert torch.equal(v, policy.state[k]), k
        elif k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            pre = k.rsplit(".", 1)[0]
            for e in range(v.shape[0]):
                if k.endswith("down_proj"):
                    assert torch.equal(v[e], policy.state[f"{pre}.{e}.down_proj.weight"]), (k, e)
                else:
                    want = torch.cat([policy.state[f"{pre}.{e}.gate_proj.weight"],
                                      policy.state[f"{pre}.{e}.up_proj.weight"]])
                    assert torch.equal(v[e], want), (k, e)
    before = {k: v.clone() for k, v in built.state_dict().items()}
    with pytest.raises(KeyError, match="missing"):
        copy_into_model(built, {k: v + 1 for k, v in policy.state.items()
                                if not k.endswith("experts.2.down_proj.weight")})
    bad = dict(policy.state)
    bad.pop(next(k for k in bad if k.endswith("experts.3.up_proj.weight")))
    with pytest.raises(KeyError, match="incomplete"):
        copy_into_model(built, bad)
    assert all(torch.equal(v, before[k]) for k, v in built.state_dict().items())  # refused: nothing written
    with pytest.raises(TypeError, match="WeightSource.*got object"):
        eng.update_weights(object())


def test_padded_layout_and_select(model, prompts):
    batch = build_engine("hf", model, tokenizer=TOK).generate(prompts, 2, SamplingParams(max_new_tokens=6, seed=1))
    pb = batch.to_padded(pad_id=TOK.pad_id, max_len=32)
    assert pb.input_ids.shape == (8, 32) and pb.input_ids.dtype == torch.long
    assert pb.engine_logprobs.dtype == torch.float32 and pb.response_mask.dtype == torch.bool
    for i in range(len(batch)):
        P, R = batch.prompt_ids[i].numel(), batch.response_ids[i].numel()
        assert pb.response_mask[i].nonzero().flatten().tolist() == list(range(P, P + R))
        assert torch.equal(pb.engine_logprobs[i, P:P + R], batch.logprobs[i])
        assert torch.equal(pb.input_ids[i, P:P + R], batch.response_ids[i])
    assert (pb.engine_logprobs[~pb.response_mask] == 0).all()
    assert pb.replay_source().indices(2).shape == (8 * 32, 2)
    sub = select_responses(batch, [3, 0])
    assert sub.sample_ids.tolist() == [batch.sample_ids[3], batch.sample_ids[0]]
    both = concat_responses([sub, select_responses(batch, [1])])
    assert len(both) == 3 and both.routed_experts is not None
    with pytest.raises(KeyError, match="valid"):
        build_engine("tgi", model)


def test_engines_are_built_from_the_config_through_the_registry(model, prompts):
    """rollout.engine names a registered engine and its own from_config reads the section: a new engine needs only its
    file and the registry; the trainer and the rollout command build every engine the same way."""
    from moe_gspo.config import RolloutConfig
    from moe_gspo.rollout import ENGINES, engine_from_config, register_engine

    hf = engine_from_config(RolloutConfig(engine="hf", engine_dtype="bfloat16"), model, tokenizer=TOK)
    assert isinstance(hf, HFEngine) and hf.dtype == torch.bfloat16

    @register_engine("probe")
    class ProbeEngine(HFEngine):
        @classmethod
        def from_config(cls, policy, rollout_cfg, tokenizer=None):
            eng = cls(policy, tokenizer=tokenizer)
            eng.seen = rollout_cfg
            return eng

    try:
        cfg = RolloutConfig(engine="probe", max_new_tokens=3)
        eng = engine_from_config(cfg, model, tokenizer=TOK)
        assert type(eng) is ProbeEngine and eng.seen is cfg
        assert len(eng.generate(prompts[:1], 2, SamplingParams(max_new_tokens=3, seed=0))) == 2
        with pytest.raises(KeyError, match="valid"):
            engine_from_config(RolloutConfig(engine="tgi"), model)
    finally:
        del ENGINES["probe"]


def test_cli_run_rollout_writes_jsonl(model, tmp_path):
    from moe_gspo.config import load_config
    from moe_gspo.commands.sample import run_rollout

    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.group_size=2", "rollout.max_new_tokens=6"])
    out = tmp_path / "r.jsonl"
    metrics = run_rollout(cfg, model, num_prompts=3, out_path=out, seed=0)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 6 and metrics["responses"] == 6
    assert metrics["rollout_logprobs_diff_max"] < 1e-4
    row = lines[0]
    assert set(row) >= {"prompt", "response", "response_ids", "logprobs", "reward", "finish_reason",
                        "routed_experts_shape"}
    assert row["routed_experts_shape"] == [len(row["response_ids"]), 4, 2]
    assert row["reward"] in (0.0, 1.0) and row["reward_error"] is None


# ---------------------------------------------------------------------------------- against the megatron policy
def _megatron_policy():
    try:
        import moe_gspo.model.policy  # noqa: F401
    except ImportError as e:
        pytest.skip(f"moe_gspo.model.policy not available yet ({e})")
    from moe_gspo import init_parallel, load_policy
    from moe_gspo.config import load_config

    torch.manual_seed(0)
    policy = load_policy(load_config("configs/tiny_cpu.yaml"), init_parallel(load_config("configs/tiny_cpu.yaml")))
    if not hasattr(policy, "export_hf"):
        pytest.skip("policy has no export_hf() yet")
    with torch.no_grad():  # larger weights than the 0.02 init: peaked logits, decisive routing
        for p in policy.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return policy


def test_hf_engine_matches_megatron_policy(prompts):
    from moe_gspo.model.routing_capture import RoutingCapture

    policy = _megatron_policy()
    eng = HFEngine(policy, tokenizer=TOK)
    batch = eng.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=10, seed=0))
    pb = batch.to_padded()
    cap = RoutingCapture()
    policy.eval()
    with torch.no_grad():
        logits = policy(pb.input_ids, routing=cap)
    logits = logits.logits if hasattr(logits, "logits") else logits
    d = rollout_probs_diff(pb.engine_logprobs, token_logprobs_from_logits(logits, pb.input_ids), pb.response_mask)
    assert d["rollout_logprobs_diff_max"] < 1e-4, d
    B, T = pb.input_ids.shape
    policy_routing = cap.stacked().reshape(B, T, *cap.stacked().shape[1:]).sort(-1).values
    known = pb.routing[..., 0, 0] >= 0
    mismatch = (pb.routing[known] != policy_routing[known]).any(-1).float().mean()
    assert mismatch == 0, f"{mismatch:.4f} of token-layers routed differently"


def test_half_precision_engines_differ_from_the_trainer_by_their_rounding(prompts):
    """rollout.engine_dtype float16 and bfloat16 build engines that compute in that dtype; the same sampled tokens
    scored by each differ from the fp32 policy's log-probs, bf16 (8 mantissa bits) more than fp16 (11)."""
    from moe_gspo.config import ConfigError, RolloutConfig
    from moe_gspo.rollout import engine_from_config

    policy = _megatron_policy()
    ref = HFEngine(policy, tokenizer=TOK)
    batch = ref.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=10, seed=0))
    pb = batch.to_padded()
    gaps = {}
    for dtype in ("float16", "bfloat16"):
        eng = engine_from_config(RolloutConfig(engine="hf", engine_dtype=dtype), policy, tokenizer=TOK)
        assert eng.dtype == getattr(torch, dtype) and next(eng.model.parameters()).dtype == eng.dtype
        with torch.no_grad():
            logits = eng.model(input_ids=pb.input_ids).logits.float()
        d = rollout_probs_diff(pb.engine_logprobs, token_logprobs_from_logits(logits, pb.input_ids), pb.response_mask)
        gaps[dtype] = d["rollout_logprobs_diff_mean"]
    assert 0 < gaps["float16"] < gaps["bfloat16"], gaps
    with pytest.raises(ConfigError, match="rollout.engine_dtype"):
        RolloutConfig(engine_dtype="float64")
