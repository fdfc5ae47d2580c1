"""SGLang engine: a clear error without sglang/CUDA (runs everywhere); generation checks on a GPU (skip elsewhere)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moe_gspo.kernels import token_logprobs_from_logits
from moe_gspo.rollout import SamplingParams, build_engine, rollout_probs_diff
from moe_gspo.rollout.sglang_engine import decode_routed_experts
from moe_gspo.tasks import CharTokenizer

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
TOK = CharTokenizer()
PROMPTS = ["12+34=", "5+6=", "123+456=", "7*8="]


def tiny_hf_model(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=256, norm_topk_prob=True, max_position_embeddings=512,
                         initializer_range=0.1)
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.mark.skipif(HAVE_SGLANG and torch.cuda.is_available(), reason="sglang and CUDA are present")
def test_clear_error_without_sglang_or_cuda():
    with pytest.raises(RuntimeError, match="rollout.engine=hf"):
        build_engine("sglang", object())


def test_decode_routed_experts_base64():
    import base64

    import numpy as np

    arr = np.array([[[3, 1], [0, 7]], [[2, 5], [6, 4]], [[1, 0], [3, 2]]], dtype=np.int32)  # (3, L=2, k=2)
    out = decode_routed_experts(base64.b64encode(arr.tobytes()).decode(), num_layers=2, top_k=2)
    assert out.shape == (3, 2, 2) and out[0, 0].tolist() == [1, 3] and out[2, 1].tolist() == [2, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_SGLANG and torch.cuda.is_available()), reason="needs sglang and a CUDA GPU")
def test_sglang_logprobs_and_routing_match_hf_forward(tmp_path):
    from helpers import hf_forward_with_routing

    model = tiny_hf_model()
    eng = build_engine("sglang", model, tokenizer=TOK, dtype="float32", mem_fraction_static=0.3)
    try:
        prompts = [TOK.encode(p, bos=True) for p in PROMPTS]
        sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
        batch = eng.generate(prompts, 4, sp)
        again = eng.generate(prompts, 4, sp)
        assert all(torch.equal(a, b) for a, b in zip(batch.response_ids, again.response_ids))
        pb = batch.to_padded()
        logits, routing = hf_forward_with_routing(model, pb.input_ids)
        d = rollout_probs_diff(pb.engine_logprobs, token_logprobs_from_logits(logits, pb.input_ids), pb.response_mask)
        assert d["rollout_logprobs_diff_max"] < 1e-2, d  # GPU kernels vs CPU fp32
        known = pb.routing[..., 0, 0] >= 0
        agree = (pb.routing[known] == routing[known]).all(-1).float().mean()
        assert agree > 0.99, agree
        # weights update in place: a different model gives different log-probs for the same tokens
        other = tiny_hf_model(seed=1)
        eng.update_weights(other)
        moved = eng.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=4))
        ref = build_engine("hf", other, tokenizer=TOK).generate(prompts, 1,
                                                                SamplingParams(temperature=0.0, max_new_tokens=4))
        assert sum(torch.equal(a, b) for a, b in zip(moved.response_ids, ref.response_ids)) >= len(prompts) - 1
    finally:
        eng.close()
