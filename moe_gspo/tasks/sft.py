"""Supervised cold start: fine-tune on task demonstrations so that RL begins with nonzero reward variance.

    acc0 = greedy_accuracy(policy, task, n=64)
    losses = cold_start(policy, task, steps=200, batch_size=32, lr=3e-3)
    acc1 = greedy_accuracy(policy, task, n=64)          # held-out prompts ("test" split)

Works with any model object callable as `model(input_ids) -> logits (B, T, V)` (the megatron policy) or returning
an object with `.logits` (a transformers model), with `.parameters()`. A demonstration is bos + prompt + completion
+ eos; cross-entropy is taken on the completion and eos tokens only. Sequences are right-padded, so a causal model
needs no attention mask and greedy decoding reads each row's logits at its own last position.
"""

from __future__ import annotations

import random

import torch

from moe_gspo.tasks.base import Example, Task
from moe_gspo.tasks.tokenizer import CharTokenizer


def _logits(model, input_ids_BT: torch.Tensor) -> torch.Tensor:
    out = model(input_ids_BT)
    return out.logits if hasattr(out, "logits") else out  # (B, T, V)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def demonstration_batch(examples: list[Example], tokenizer: CharTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (B, T) int64 right-padded with pad_id, and loss_mask (B, T) bool on completion+eos tokens."""
    seqs, masks = [], []
    for ex in examples:
        prompt = tokenizer.encode(ex.prompt, bos=True)
        completion = tokenizer.encode(ex.completion, eos=True)
        seqs.append(prompt + completion)
        masks.append([False] * len(prompt) + [True] * len(completion))
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (s, m) in enumerate(zip(seqs, masks)):
        ids[b, :len(s)], mask[b, :len(m)] = torch.tensor(s), torch.tensor(m)
    return ids, mask


def sft_loss(model, input_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the masked (token-aligned) positions."""
    logits = _logits(model, input_ids_BT)[:, :-1].float()  # (B, T-1, V) predicts tokens 1..T-1
    tgt, m = input_ids_BT[:, 1:].to(logits.device), loss_mask_BT[:, 1:].to(logits.device)
    return torch.nn.functional.cross_entropy(logits[m], tgt[m])


def cold_start(model, task: Task, tokenizer: CharTokenizer | None = None, steps: int = 200, batch_size: int = 32,
               lr: float = 3e-3, weight_decay: float = 0.0, seed: int = 0, grad_clip: float = 1.0,
               log_every: int = 0) -> list[float]:
    """Train `model` in place on `steps` batches of train-split demonstrations; returns the loss per step."""
    tokenizer = tokenizer or CharTokenizer()
    rng = random.Random(seed)
    dev = _device(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    was_training = model.training
    model.train()
    losses = []
    try:
        for step in range(steps):
            ids, mask = demonstration_batch([task.sample(rng, "train") for _ in range(batch_size)], tokenizer)
            loss = sft_loss(model, ids.to(dev), mask.to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            losses.append(float(loss.detach()))
            if log_every and (step + 1) % log_every == 0:
                print(f"cold start step {step + 1}/{steps} loss {losses[-1]:.4f}")
    finally:
        model.train(was_training)
    return losses


@torch.no_grad()
def greedy_decode(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int = 0) -> list[list[int]]:
    """Greedy continuation of each prompt (full forward per step, right padding); eos included when emitted."""
    dev = _device(model)
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        T = max(map(len, seqs))
        ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = torch.tensor(s)
        logits = _logits(model, ids.to(dev))  # (B, T, V)
        last = torch.tensor([len(s) - 1 for s in seqs], device=logits.device)
        nxt = logits[torch.arange(len(seqs), device=logits.device), last].argmax(-1).tolist()
        for b, t in enumerate(nxt):
            if not done[b]:
                seqs[b].append(t), out[b].append(t)
                done[b] = t == eos_id
        if all(done):
            break
    return out


def greedy_accuracy(model, task: Task, tokenizer: CharTokenizer | None = None, n: int = 64, seed: int = 1234,
                    split: str = "test", max_new_tokens: int | None = None) -> float:
    """Fraction of `n` prompts from `split` whose greedy response gets reward 1.0."""
    tokenizer = tokenizer or CharTokenizer()
    examples = task.examples(n, seed=seed, split=split)
    max_new = max_new_tokens or max(len(tokenizer.encode(ex.completion)) for ex in examples) + 2
    was_training = model.training
    model.eval()
    try:
        responses = greedy_decode(model, [tokenizer.encode(ex.prompt, bos=True) for ex in examples], max_new,
                                  tokenizer.eos_id, tokenizer.pad_id)
    finally:
        model.train(was_training)
    rewards = [task.reward(tokenizer.decode(r), ex) for r, ex in zip(responses, examples)]
    return sum(r == 1.0 for r in rewards) / len(rewards)
