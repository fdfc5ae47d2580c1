"""Rollout engines behind one interface, and the batch of sampled responses they return.

    engine = build_engine("hf", policy, tokenizer=CharTokenizer())      # or "hf_static", or "sglang" on a GPU
    batch = engine.generate(prompts, n_per_prompt=8, sampling=SamplingParams(temperature=1.0, seed=0))
    pb = batch.to_padded()                                              # (B, T) training tensors
    rollout_probs_diff(pb.engine_logprobs, recomputed_logp, pb.response_mask)
"""

from __future__ import annotations

# the engines register themselves by name on import (sglang and vllm themselves are imported only when their
# engine is built)
from moe_gspo.rollout import hf_engine, hf_static, sglang_engine  # noqa: F401
from moe_gspo.rollout.vllm import engine as vllm_engine  # noqa: F401
from moe_gspo.rollout.agent import engine_from_config  # the engine, for multi-turn episodes with rollout.tools
from moe_gspo.rollout.base import (ENGINES, RolloutEngine, SamplingParams, build_engine, check_engine, engine_class,
                                   register_engine)
from moe_gspo.rollout.batch import PaddedRollout, RolloutBatch, rollout_probs_diff

__all__ = ["ENGINES", "PaddedRollout", "RolloutBatch", "RolloutEngine", "SamplingParams", "build_engine",
           "check_engine", "engine_class", "engine_from_config", "register_engine", "rollout_probs_diff"]
