"""Sample a batch of responses from the policy, score them, and compare engine vs training log-probs.

    moe-gspo rollout --config configs/tiny_cpu.yaml --num-prompts 4 --out rollout.jsonl [--seed 0] [a.b=c ...]
    moe-gspo rollout --from runs/train_tiny_cpu --out rollout.jsonl       # a trained run's newest checkpoint

Takes the same data, chat-template and reward settings as `moe-gspo train` (rollout.*). Writes one JSON line per
response: the prompt, its chat messages when it is a conversation, the prompt's text and ids as the engine saw
them (chat template and special tokens included), the response's text and ids, log-probs, reward or reward error,
finish reason and routed-experts shape. Returns the reward metrics and the engine-vs-training log-prob difference
(rollout_probs_diff_*). `run_rollout` is the body `rollout_command` (the CLI's) and the tests call.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_gspo.config import UserError


def rollout_command(config: str | None, run_dir: str | None, overrides: list[str], num_prompts: int,
                    out: str | Path, seed: int | None = None) -> tuple[Path, dict[str, float]]:
    """Build the policy from a config, or from a run directory's config.yaml and newest checkpoint; sample."""
    from moe_gspo.model.load import init_parallel, load_policy
    from moe_gspo.config import ConfigError, load_config
    from moe_gspo.checkpoint.store import Checkpoints
    from moe_gspo.parallel.state import trainer_group
    from moe_gspo.train.data import check_names

    if num_prompts < 1:
        raise UserError(f"--num-prompts={num_prompts} must be >= 1")
    if run_dir is not None:
        run = Path(run_dir)
        if not (run / "config.yaml").is_file():
            raise UserError(f"--from {run}: no config.yaml (not a `moe-gspo train` run directory)")
        cfg = load_config(run / "config.yaml", overrides)
    else:
        cfg = load_config(config, overrides)
    check_names(cfg)
    policy = load_policy(cfg, init_parallel(cfg))
    if run_dir is not None:
        ckpts = Checkpoints(Path(run_dir) / "checkpoints", group=trainer_group(policy.groups))
        step = ckpts.latest()
        if not step:
            raise ConfigError(f"--from {run_dir}: no complete checkpoint in {ckpts.root}")
        ckpts.load_weights(step, policy)
    out = Path(out)
    return out, run_rollout(cfg, policy, num_prompts, out, seed)


def policy_logits(policy, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """(B, T, V) float32 from a megatron policy (returns logits) or a transformers model (returns .logits)."""
    with torch.no_grad():
        out = policy(input_ids_BT)
    return (out.logits if hasattr(out, "logits") else out).float()


def run_rollout(cfg, policy, num_prompts: int, out_path: str | Path, seed: int | None = None,
                engine=None) -> dict[str, float]:
    """Generate cfg.rollout.group_size responses for `num_prompts` task prompts; write JSONL; return metrics."""
    from moe_gspo.rewards import score_responses
    from moe_gspo.rollout import engine_from_config
    from moe_gspo.rollout.agent import reward_examples
    from moe_gspo.kernels import token_logprobs_from_logits
    from moe_gspo.rollout.batch import rollout_probs_diff
    from moe_gspo.tasks import task_from_config
    from moe_gspo.train.data import build_tokenizer, encode_prompts, sampling_params

    if num_prompts < 1:
        raise UserError(f"--num-prompts={num_prompts} must be >= 1")
    tok = build_tokenizer(cfg)
    seed = cfg.train.seed if seed is None else seed
    task = task_from_config(cfg.rollout)
    examples = task.examples(num_prompts, seed=seed)
    prompts = encode_prompts(examples, tok, cfg.rollout, cfg.model.max_position_embeddings)
    engine = engine or engine_from_config(cfg.rollout, policy, tokenizer=tok)
    sampling = sampling_params(cfg, tok, seed)
    batch = engine.generate(prompts, cfg.rollout.group_size, sampling)

    texts = [tok.decode(r.tolist()) for r in batch.response_ids]
    per_response = reward_examples([examples[i // cfg.rollout.group_size] for i in range(len(batch))], batch, tok)
    scored = score_responses(task.reward_fn, texts, per_response)

    pb = batch.to_padded(pad_id=tok.pad_id)
    recomputed = token_logprobs_from_logits(policy_logits(policy, pb.input_ids), pb.input_ids, sampling.temperature)
    diff = rollout_probs_diff(pb.engine_logprobs, recomputed, pb.response_mask)

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w") as f:
        for i in range(len(batch)):
            ex = per_response[i]
            line = {
                "sample_id": int(batch.sample_ids[i]), "group_id": int(batch.group_ids[i]),
                "prompt": ex.prompt, **({"messages": ex.messages} if ex.messages is not None else {}),
                "prompt_text": tok.decode(batch.prompt_ids[i].tolist(), skip_special=False),  # as the model saw it
                "answer": ex.answer, "response": texts[i],
                **({"turns": ex.meta["turns"]} if "turns" in ex.meta else {}),  # an episode's assistant turns
                "prompt_ids": batch.prompt_ids[i].tolist(), "response_ids": batch.response_ids[i].tolist(),
                "logprobs": [round(x, 6) for x in batch.logprobs[i].tolist()],
                "reward": None if not bool(scored.valid[i]) else float(scored.rewards[i]),
                "reward_error": scored.errors[i], "finish_reason": batch.finish_reasons[i],
                "routed_experts_shape": list(batch.routed_experts[i].shape) if batch.has_routing else None,
            }
            f.write(json.dumps(line) + "\n")
    return {"responses": float(len(batch)), **scored.metrics(), **diff}
