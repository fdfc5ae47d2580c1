"""Evaluation during training (train.eval_every): held-out prompts through the run's own engines, scored by the
run's reward.

    held_out = task.eval_examples(cfg.rollout.eval_prompts)     # the same prompts at every evaluation
    m = evaluate(cfg, task, tok, rollouts, held_out, dp_rank, dp, group, step)
    # {"eval/reward_mean", "eval/accuracy", "eval/pass@N" (rollout.eval_samples = N > 1), "eval/reward_errors"}

The held-out prompts are dealt over data-parallel ranks (rank d takes prompts d, d + dp, ...), each answered
greedily (rollout.eval_samples = 1) or with N samples at rollout.temperature. Accuracy is the share of responses
with reward >= 1; pass@N the share of prompts with at least one such response; a response whose reward failed
counts as wrong and is counted in eval/reward_errors. Sums are reduced over the trainer's ranks, so every rank
returns the figures of the whole held-out set.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moe_gspo.config import Config, ConfigError
from moe_gspo.parallel.state import comm_device
from moe_gspo.rewards import score_responses
from moe_gspo.rollout.agent import reward_examples
from moe_gspo.train.data import encode_prompts, hash_seed, sampling_params


def check_eval_set(examples: list, dp: int, where: str) -> None:
    """ConfigError when the held-out set cannot give every data-parallel rank a prompt."""
    if len(examples) < dp:
        raise ConfigError(f"{where}: {len(examples)} held-out prompts for {dp} data-parallel ranks; train.eval_every "
                          "needs at least one per rank")


def evaluate(cfg: Config, task, tok, rollouts, held_out: list, dp_rank: int, dp: int, group,
             step: int) -> dict[str, float]:
    """The eval/ metrics of the held-out prompts (collective over the trainer's ranks and the engine placement)."""
    rc = cfg.rollout
    n = rc.eval_samples
    sp = dataclasses.replace(sampling_params(cfg, tok, hash_seed(cfg.train.seed, step, 3) % 2**31),
                             return_routing=False, **({"temperature": 0.0} if n == 1 else {}))
    batch = rollouts.generate(lambda d: (encode_prompts(held_out[d::dp], tok, rc, cfg.model.max_position_embeddings),
                                         sp), n)
    mine = held_out[dp_rank::dp]
    per_response = reward_examples([mine[i // n] for i in range(len(batch))], batch, tok)
    texts = [tok.decode(r.tolist()) for r in batch.response_ids]
    scored = score_responses(task.reward_fn, texts, per_response, warn=False)
    r = torch.where(scored.valid, scored.rewards, torch.zeros_like(scored.rewards))
    correct = (r >= 1.0) & scored.valid
    passed = correct.view(len(mine), n).any(dim=1)
    sums = torch.tensor([float(r.sum()), float(correct.sum()), float(len(batch)), float(passed.sum()),
                         float(len(mine)), float((~scored.valid).sum())], dtype=torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        # every rank of a data-parallel replica holds the same sums: the ratios below are unchanged by that
        sums = sums.to(comm_device(group))
        dist.all_reduce(sums, group=group)
        copies = dist.get_world_size(group) // dp
        sums = sums.cpu() / copies
    reward_sum, correct_sum, responses, passed_sum, prompts, errors = sums.tolist()
    m = {"eval/reward_mean": reward_sum / responses, "eval/accuracy": correct_sum / responses,
         "eval/reward_errors": errors, "eval/prompts": prompts}
    if n > 1:
        m[f"eval/pass@{n}"] = passed_sum / prompts
    return m
