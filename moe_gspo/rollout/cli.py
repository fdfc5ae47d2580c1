"""`moe-gspo rollout`: sample responses from the policy, score them, and check engine vs training log-probs.

    moe-gspo rollout --config configs/tiny_cpu.yaml --num-prompts 4 --out rollout.jsonl [--seed 0] [a.b=c ...]

Writes one JSON line per response (prompt, response text, token ids, log-probs, reward or reward error, finish
reason, routed-experts shape) and prints the engine-vs-training log-prob difference (rollout_probs_diff_*).
The lead's moe_gspo/cli.py calls `add_subparser(subparsers)`; `run_rollout` is the testable body.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def add_subparser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("rollout", help="sample, score and log a batch of responses",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (configs/tiny_cpu.yaml)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts to sample (each gets rollout.group_size)")
    p.add_argument("--out", required=True, help="JSONL file to write, one line per response")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: train.seed)")
    p.add_argument("overrides", nargs="*", help="config overrides a.b=value")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    from moe_gspo import load_policy
    from moe_gspo.config import load_config

    cfg = load_config(args.config, args.overrides)
    if cfg.rollout.engine == "hf":  # transformers must be imported before megatron's CPU shims are applied
        import moe_gspo.rollout.hf_engine  # noqa: F401
    policy = load_policy(cfg)
    metrics = run_rollout(cfg, policy, args.num_prompts, args.out, args.seed)
    print(" ".join(f"{k}={v:.3g}" for k, v in metrics.items()))
    return 0


def policy_logits(policy, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """(B, T, V) float32 from a megatron policy (returns logits) or a transformers model (returns .logits)."""
    with torch.no_grad():
        out = policy(input_ids_BT)
    return (out.logits if hasattr(out, "logits") else out).float()


def run_rollout(cfg, policy, num_prompts: int, out_path: str | Path, seed: int | None = None,
                engine=None) -> dict[str, float]:
    """Generate cfg.rollout.group_size responses for `num_prompts` task prompts; write JSONL; return metrics."""
    from moe_gspo.rewards import score_responses
    from moe_gspo.rollout.base import SamplingParams, build_engine
    from moe_gspo.rollout.batch import rollout_probs_diff, token_logprobs_from_logits
    from moe_gspo.tasks import CharTokenizer, task_from_config

    if num_prompts < 1:
        raise ValueError(f"--num-prompts={num_prompts} must be >= 1")
    tok = CharTokenizer()
    if cfg.model.vocab_size < tok.num_tokens:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the character tokenizer's "
                         f"{tok.num_tokens} ids")
    seed = cfg.train.seed if seed is None else seed
    task = task_from_config(cfg.rollout)
    examples = task.examples(num_prompts, seed=seed)
    prompts = [tok.encode(ex.prompt, bos=True) for ex in examples]
    engine = engine or build_engine(cfg.rollout.engine, policy, tokenizer=tok)
    sampling = SamplingParams.from_config(cfg.rollout, seed=seed)
    batch = engine.generate(prompts, cfg.rollout.group_size, sampling)

    texts = [tok.decode(r.tolist()) for r in batch.response_ids]
    per_response = [examples[i // cfg.rollout.group_size] for i in range(len(batch))]
    scored = score_responses(task.reward_fn, texts, per_response)

    pb = batch.to_padded(pad_id=tok.pad_id)
    recomputed = token_logprobs_from_logits(policy_logits(policy, pb.input_ids), pb.input_ids, sampling.temperature)
    diff = rollout_probs_diff(pb.old_logprobs, recomputed, pb.response_mask)

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w") as f:
        for i in range(len(batch)):
            ex = per_response[i]
            line = {
                "sample_id": int(batch.sample_ids[i]), "group_id": int(batch.group_ids[i]),
                "prompt": ex.prompt, "answer": ex.answer, "response": texts[i],
                "prompt_ids": batch.prompt_ids[i].tolist(), "response_ids": batch.response_ids[i].tolist(),
                "logprobs": [round(x, 6) for x in batch.logprobs[i].tolist()],
                "reward": None if not bool(scored.valid[i]) else float(scored.rewards[i]),
                "reward_error": scored.errors[i], "finish_reason": batch.finish_reasons[i],
                "routed_experts_shape": list(batch.routed_experts[i].shape) if batch.has_routing else None,
            }
            f.write(json.dumps(line) + "\n")
    return {"responses": float(len(batch)), **scored.metrics(), **diff}
