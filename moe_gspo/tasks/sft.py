"""Supervised demonstrations for the cold start (moe_gspo.train.step.cold_start runs it) and greedy evaluation.

    ids, mask = demonstration_batch(examples, tokenizer)
    loss = sft_loss(policy, ids, mask)
    acc = greedy_accuracy(policy, task, n=64)          # held-out prompts ("test" split)

Works with any model object callable as `model(input_ids) -> logits (B, T, V)` (the megatron policy) or returning
an object with `.logits` (a transformers model), with `.parameters()`. A demonstration is bos + prompt + completion
+ eos; cross-entropy is taken on the completion and eos tokens only. Sequences are right-padded, so a causal model
needs no attention mask and greedy decoding reads each row's logits at its own last position.
"""

from __future__ import annotations


import torch

from moe_gspo.config import ConfigError
from moe_gspo.tasks.base import Example, Task
from moe_gspo.tasks.tokenizer import CharTokenizer


def _logits(model, input_ids_BT: torch.Tensor) -> torch.Tensor:
    out = model(input_ids_BT)
    return out.logits if hasattr(out, "logits") else out  # (B, T, V)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def demonstration_batch(examples: list[Example], tokenizer: CharTokenizer, context: int | None = None,
                        prompt_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (B, T) int64 right-padded with pad_id, and loss_mask (B, T) bool on completion+eos tokens.

    context: the model's model.max_position_embeddings; a demonstration longer than that raises ConfigError naming
    it (the model's forward would fail on the whole batch, deep inside). prompt_ids: `fn(example) -> ids` of the
    prompt as the engine sees it (moe_gspo.tasks.prompts.encode_prompt: chat template included); default bos +
    the prompt text."""
    seqs, masks = [], []
    for ex in examples:
        prompt = prompt_ids(ex) if prompt_ids is not None else tokenizer.encode(ex.prompt, bos=True)
        completion = tokenizer.encode(ex.completion, eos=True)
        if context is not None and len(prompt) + len(completion) > context:
            shown = repr(ex.prompt[:40]) + ("..." if len(ex.prompt) > 40 else "")
            raise ConfigError(f"cold start: demonstration {shown} has {len(prompt) + len(completion)} tokens (bos + "
                              f"prompt + completion + eos), more than the context model.max_position_embeddings="
                              f"{context}")
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
