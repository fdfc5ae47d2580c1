"""Supervised demonstrations for the cold start (moe_gspo.train.step.cold_start runs it) and greedy evaluation.

    ids, mask = demonstration_batch(examples, tokenizer)
    loss = sft_loss(policy, ids, mask)
    acc = greedy_accuracy(policy, task, n=64)          # held-out prompts ("test" split)

Works with any model object callable as `model(input_ids) -> logits (B, T, V)` (the megatron policy) or returning
an object with `.logits` (a transformers model), with `.parameters()`. A demonstration is bos + prompt + completion
+ eos; cross-entropy is taken on the completion and eos tokens only. A multi-message demonstration (assistant
turns with tool messages between them) is laid out as the rollout's agent loop lays out an episode, and trains on
the assistant turns alone (completion_ids). Sequences are right-padded, so a causal model needs no attention mask
and greedy decoding reads each row's logits at its own last position.
"""

from __future__ import annotations

import torch

from moe_gspo.config import ConfigError
from moe_gspo.tasks.base import Example, Task
from moe_gspo.tasks.prompts import turn_ids
from moe_gspo.tasks.tokenizer import CharTokenizer


def _logits(model, input_ids_BT: torch.Tensor) -> torch.Tensor:
    out = model(input_ids_BT)
    return out.logits if hasattr(out, "logits") else out  # (B, T, V)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def demonstration_batch(examples: list[Example], tokenizer: CharTokenizer, context: int | None = None,
                        prompt_ids=None, tools: list[dict] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (B, T) int64 right-padded with pad_id, and loss_mask (B, T) bool on completion+eos tokens.

    context: the model's model.max_position_embeddings; a demonstration longer than that raises ConfigError naming
    it (the model's forward would fail on the whole batch, deep inside). prompt_ids: `fn(example) -> ids` of the
    prompt as the engine sees it (moe_gspo.tasks.prompts.encode_prompt: chat template included); default bos +
    the prompt text. tools: the JSON schemas the chat template is given, for multi-message demonstrations."""
    seqs, masks = [], []
    for ex in examples:
        prompt = prompt_ids(ex) if prompt_ids is not None else tokenizer.encode(ex.prompt, bos=True)
        completion, mask = completion_ids(ex, tokenizer, tools)
        if context is not None and len(prompt) + len(completion) > context:
            shown = repr(ex.prompt[:40]) + ("..." if len(ex.prompt) > 40 else "")
            raise ConfigError(f"cold start: demonstration {shown} has {len(prompt) + len(completion)} tokens (bos + "
                              f"prompt + completion + eos), more than the context model.max_position_embeddings="
                              f"{context}")
        seqs.append(prompt + completion)
        masks.append([False] * len(prompt) + mask)
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, (s, m) in enumerate(zip(seqs, masks)):
        ids[b, :len(s)], mask[b, :len(m)] = torch.tensor(s), torch.tensor(m)
    return ids, mask


def completion_ids(example: Example, tokenizer, tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
    """The ids after the prompt of `example`'s demonstration, and which of them the loss trains on.

    A string: its ids and eos, all trained. A list of messages: each assistant turn's ids and eos (trained), and
    between two turns the ids the rollout's agent loop appends after a turn that called a tool (the chat
    template's rendering of the tool messages and the next generation prompt, moe_gspo.tasks.prompts.turn_ids;
    not trained). So a demonstration episode is the token sequence a rollout of the same turns would hold, with the
    same loss mask."""
    demo = example.demonstration
    if not isinstance(demo, list):
        ids = tokenizer.encode(example.completion, eos=True)
        return ids, [True] * len(ids)
    ids: list[int] = []
    mask: list[bool] = []
    tool_messages: list[dict] = []
    last = None
    for m in demo:
        if m["role"] == "tool":
            tool_messages.append(m)
            continue
        if last is not None:
            between, _ = turn_ids(tokenizer, last, tool_messages, tools, tokenizer.eos_id)
            ids += between
            mask += [False] * len(between)
            tool_messages = []
        turn = tokenizer.encode(m["content"], eos=True)
        ids += turn
        mask += [True] * len(turn)
        last = m["content"]
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
