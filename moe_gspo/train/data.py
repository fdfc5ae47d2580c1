"""The data side of the RL loop: the task, the prompts of each step, and checks of what comes back.

The prompts of step s on data-parallel rank r are a pure function of (seed, s, r): resuming at step s needs no
sampler state, and `data_position` in a checkpoint is just the next step.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_gspo.config import Config, ConfigError, UserError
from moe_gspo.tasks import Example, Task
from moe_gspo.tasks.prompts import encode_prompt
from moe_gspo.tasks.tokenizer import CharTokenizer, HFTokenizer, build_tokenizer  # noqa: F401 - shared names


@dataclass
class Layout:
    """How one rollout batch is divided: per data-parallel rank, per minibatch."""

    dp: int
    prompts_local: int  # prompts per step on this rank
    responses_local: int  # prompts_local * group_size
    minibatch_local: int  # responses per minibatch on this rank


def check_layout(cfg: Config, dp: int) -> Layout:
    """Raise ConfigError unless prompts split over DP ranks and responses over minibatches evenly."""
    P, G, M = cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.train.minibatches
    if P % dp:
        raise ConfigError(f"rollout.prompts_per_step={P} does not divide over {dp} data-parallel ranks "
                          f"(groups stay on one rank); use a multiple of {dp}")
    n_local = P // dp * G
    if n_local % M:
        raise ConfigError(f"rollout batch of {P} prompts x {G} responses = {P * G} over {dp} data-parallel ranks "
                          f"x train.minibatches={M} does not divide: each rank holds {n_local} responses, not a "
                          f"multiple of {M}")
    return Layout(dp, P // dp, n_local, n_local // M)


def template_kwargs(rollout_cfg) -> dict:
    """rollout.chat_template_kwargs, with the JSON schemas of rollout.tools as `tools` (what a chat template shows
    the model) when it names any."""
    if not rollout_cfg.tools:
        return rollout_cfg.chat_template_kwargs
    from moe_gspo.rollout.tools import configured_tools, tool_schemas

    return {**rollout_cfg.chat_template_kwargs, "tools": tool_schemas(configured_tools(rollout_cfg.tools))}


def tool_system(tok, rollout_cfg) -> str | None:
    """The system message text that names rollout.tools, under rollout.tool_prompt: 'system' always, 'auto' when
    the chat template renders nothing of `tools=` (SmolLM2's, Mixtral's), 'template' never; None without tools."""
    if not rollout_cfg.tools or rollout_cfg.tool_prompt == "template":
        return None
    return _tool_system(tok, tuple(rollout_cfg.tools), rollout_cfg.tool_prompt)


@functools.lru_cache(maxsize=8)
def _tool_system(tok, tools: tuple[str, ...], mode: str) -> str | None:
    """tool_system's answer, once per tokenizer and tools (the data load encodes every row)."""
    from moe_gspo.rollout.tools import configured_tools, template_shows_tools, tool_schemas, tool_system_message

    schemas = tool_schemas(configured_tools(list(tools)))
    return None if mode == "auto" and template_shows_tools(tok, schemas) else tool_system_message(schemas)


def prompt_ids(tok, example: Example, rollout_cfg) -> list[int]:
    """The ids the engine is given for `example` under the rollout config: its chat template, the template's
    keyword arguments and the tools (moe_gspo.tasks.prompts.encode_prompt)."""
    return encode_prompt(tok, example, rollout_cfg.chat_template, template_kwargs(rollout_cfg),
                         tool_system(tok, rollout_cfg))


def world_size() -> int:
    """The trainer's world: the default group's size once torch.distributed is initialized (a job split into
    trainer and engine ranks initializes it on the trainer ranks alone), before that torchrun's WORLD_SIZE (1
    outside torchrun)."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def world_rank() -> int:
    """This process's rank in the job: the default group's once torch.distributed is initialized, before that
    torchrun's RANK (0 outside torchrun)."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def check_names(cfg: Config, world: int | None = None) -> None:
    """Registered names the config refers to (advantage estimator, rollout engine) and what the engine declares it
    can do (rollout.check_engine; `world`: the ranks its engines spread over, when known), checked right after the
    config is loaded and before anything is built (the loss checks itself inside the config)."""
    from moe_gspo.losses import ADVANTAGE_ESTIMATORS
    from moe_gspo.rollout import check_engine

    if cfg.algorithm.advantage not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(f"algorithm.advantage={cfg.algorithm.advantage!r} is not one of "
                          f"{sorted(ADVANTAGE_ESTIMATORS)}")
    check_engine(cfg, world)
    if cfg.rollout.tools:  # each tool imports and has a schema, or the run stops here naming it
        from moe_gspo.rollout.tools import configured_tools

        configured_tools(cfg.rollout.tools)
    if cfg.rollout.group_size < 2:  # every estimator is group-relative
        raise ConfigError(f"rollout.group_size={cfg.rollout.group_size}: the group-relative advantages of "
                          f"algorithm.advantage={cfg.algorithm.advantage!r} are 0 for a group of one; use >= 2")


def step_examples(task: Task, seed: int, step: int, dp_rank: int, n: int, dp: int = 1) -> list[Example]:
    """The n training prompts of `step` on data-parallel rank `dp_rank` of `dp` (deterministic). A data set's rows
    come by epochs (each row once per epoch, in an order drawn per epoch): the step's dp x n rows are the next in
    that stream, rank by rank. A generated task draws fresh examples."""
    if hasattr(task, "epoch_examples"):
        return task.epoch_examples((step * dp + dp_rank) * n, n, seed)
    return task.examples(n, seed=hash_seed(seed, step, dp_rank), split="train")


def hash_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's hash of ints is not salted, but keep it explicit)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def encode_prompts(examples: list[Example], tok, rollout_cfg, context: int) -> list[list[int]]:
    """Prompt ids (moe_gspo.tasks.prompts.encode_prompt with rollout.chat_template); raise ConfigError naming the
    prompt when its ids + rollout.max_new_tokens exceed the context."""
    out = []
    for i, ex in enumerate(examples):
        ids = prompt_ids(tok, ex, rollout_cfg)
        if len(ids) + rollout_cfg.max_new_tokens > context:
            raise ConfigError(f"prompt {i} ({ex.prompt[:40]!r}...) has {len(ids)} tokens; with rollout.max_new_tokens="
                              f"{rollout_cfg.max_new_tokens} it exceeds the context model.max_position_embeddings="
                              f"{context}")
        out.append(ids)
    return out


def sampling_params(cfg: Config, tok, seed: int):
    """SamplingParams of the config, stopping at every eos id of the tokenizer."""
    from moe_gspo.rollout import SamplingParams

    sp = SamplingParams.from_config(cfg.rollout, seed=seed)
    sp.stop_token_ids = [int(t) for t in getattr(tok, "stop_ids", ())]
    sp.return_routing = sp.return_routing or cfg.algorithm.routing_replay == "r3"
    return sp


def check_responses(batch, step: int) -> None:
    """An empty response (no token at all, not even eos) is an engine error: name the sample (step as the metrics
    count it, the sample's place in the step's batch)."""
    for i, r in enumerate(batch.response_ids):
        if r.numel() == 0:
            raise ValueError(f"step {step + 1}: rollout engine returned an empty response for sample {i + 1} of "
                             f"{len(batch)} (group {int(batch.group_ids[i]) + 1})")


def handle_bad_rewards(rewards: torch.Tensor, errors: list, seen: Callable[[int], str], texts: list[str],
                       mode: str, step: int) -> torch.Tensor:
    """(N,) bool valid. mode 'error' raises naming the first bad sample (step as the metrics count it, the
    sample's place in the batch, the prompt as the model saw it: seen(i)); 'skip' returns the mask to drop them."""
    valid = torch.isfinite(rewards)
    if bool(valid.all()):
        return valid
    i = int((~valid).nonzero()[0])
    why = errors[i] if errors and errors[i] else f"reward {float(rewards[i])}"
    if mode == "error":
        raise UserError(f"step {step + 1}: non-finite reward for sample {i + 1} of {len(texts)} (prompt as the model "
                        f"saw it {seen(i)!r}, response {texts[i]!r}): {why}; {int((~valid).sum())} bad in this "
                        f"batch. Set rollout.bad_reward=skip to drop such samples instead.")
    return valid


def step_prompts(cfg: Config, task: Task, tok, layout: Layout, step: int, dp_rank: int, refill: int = 0):
    """(examples, prompt ids, SamplingParams) of data-parallel rank dp_rank at this step: a function of the seed,
    the step and dp_rank only, so any rank (an engine replica, an engine rank) can build the prompts it samples.
    refill r > 0: the prompts of dynamic sampling's r-th extra round of the step, drawn from a stream of their own
    (seeded by the run's seed and r), so that the step's own prompts stay those of a run without it."""
    seed = cfg.train.seed if refill == 0 else hash_seed(cfg.train.seed, REFILL, refill)
    examples = step_examples(task, seed, step, dp_rank, layout.prompts_local, layout.dp)
    prompts = encode_prompts(examples, tok, cfg.rollout, cfg.model.max_position_embeddings)
    draw = (cfg.train.seed, step, dp_rank, 1) + ((REFILL, refill) if refill else ())
    return examples, prompts, sampling_params(cfg, tok, hash_seed(*draw) % 2**31)


REFILL = 0x5EF111  # mixed into the seeds of dynamic sampling's extra rounds


def check_prompts(cfg: Config, task: Task, tok) -> None:
    """Before anything is built: a data set's chat prompts against rollout.chat_template and the tokenizer (the
    first row that cannot be encoded is named), so a template problem never waits for the first step."""
    from moe_gspo.tasks.prompts import check_chat_template

    rows = getattr(task, "rows", [])
    first_chat = next((ex for ex in rows if ex.messages is not None), None)
    for ex in rows[:1] + ([first_chat] if first_chat is not None else []):
        check_chat_template(tok, ex, cfg.rollout.chat_template)
    check_roles(task, tok)
    check_lengths(cfg, task, tok)


def check_lengths(cfg: Config, task: Task, tok) -> None:
    """Every train and eval row of a data set encoded once: one whose prompt ids + rollout.max_new_tokens exceed the
    context is an error naming its file and line, or (rollout.overlong_prompts='drop') is left out, with one line
    saying how many were. An empty train or eval set after dropping is an error."""
    rc, context = cfg.rollout, cfg.model.max_position_embeddings
    room = context - rc.max_new_tokens
    for rows_name, wheres_name, what in (("rows", "wheres", "train"), ("eval_rows", "eval_wheres", "eval")):
        rows, wheres = getattr(task, rows_name, None), getattr(task, wheres_name, None)
        if not rows or wheres is None:
            continue
        keep = []
        for i, ex in enumerate(rows):
            n = len(prompt_ids(tok, ex, rc))
            if n <= room:
                keep.append(i)
            elif rc.overlong_prompts == "error":
                raise ConfigError(f"{wheres[i]}: the prompt has {n} tokens; with rollout.max_new_tokens="
                                  f"{rc.max_new_tokens} it exceeds the context model.max_position_embeddings={context} "
                                  "(rollout.overlong_prompts=drop leaves such rows out)")
        if len(keep) < len(rows):
            if not keep:
                raise ConfigError(f"rollout.overlong_prompts=drop left no {what} rows: every prompt is longer than "
                                  f"{room} tokens (model.max_position_embeddings={context} - rollout.max_new_tokens="
                                  f"{rc.max_new_tokens})")
            if world_rank() == 0:
                print(f"{what} data: {len(rows) - len(keep)} of {len(rows)} rows dropped, their prompts longer than "
                      f"{room} tokens (rollout.overlong_prompts=drop)", file=sys.stderr, flush=True)
            setattr(task, rows_name, [rows[i] for i in keep])
            setattr(task, wheres_name, [wheres[i] for i in keep])


def check_roles(task: Task, tok) -> None:
    """ConfigError naming the file, row and role of the first chat message, train or eval, whose role the chat
    template would drop or refuse: a model that never sees part of its prompt trains on a silently different task."""
    from moe_gspo.tasks.prompts import unrendered_roles

    sets = [(getattr(task, "rows", []), getattr(task, "wheres", [])),
            (getattr(task, "eval_rows", []), getattr(task, "eval_wheres", []))]
    roles = {m["role"] for rows, _ in sets for ex in rows if ex.messages for m in ex.messages}
    bad = unrendered_roles(tok, roles) if roles else {}
    if not bad:
        return
    for rows, wheres in sets:
        for i, ex in enumerate(rows):
            for j, m in enumerate(ex.messages or []):
                if m["role"] in bad:
                    where = wheres[i] if i < len(wheres) else f"row {i + 1}"
                    raise ConfigError(f"{where}: message {j} has role {m['role']!r}, which the chat template drops: "
                                      f"{bad[m['role']]} (roles in the data: {', '.join(sorted(roles))}); use the "
                                      "roles the template renders (system, user, assistant)")


def cold_start_plan(cfg: Config, task: Task, has_init_state: bool) -> tuple[int, str | None]:
    """(supervised steps to run, the line that says why the cold start does not run, or None)."""
    steps = cfg.train.cold_start_steps
    if not steps or has_init_state:  # none asked for, or the caller hands the weights RL starts from
        return 0, None
    if cfg.model.init_from and not cfg.train.cold_start_pretrained:
        return 0, (f"cold start skipped: model.init_from={cfg.model.init_from} is pretrained (set "
                   f"train.cold_start_pretrained=true to run train.cold_start_steps={steps} supervised steps on it)")
    if not getattr(task, "has_demonstrations", True):
        return 0, (f"cold start skipped: train.cold_start_steps={steps}, but the data set has no demonstrations "
                   "(rollout.demonstration_field names a column of gold completions)")
    return steps, None


class ColdStartLog:
    """`log(step, loss)` for moe_gspo.train.step.cold_start: about `lines` progress lines on stderr, each with the
    mean loss since the line before."""

    def __init__(self, steps: int, lines: int = 10):
        self.steps, self.every = steps, max(1, steps // lines)
        self.since: list[float] = []

    def __call__(self, step: int, loss: float) -> None:
        import sys

        self.since.append(loss)
        if (step + 1) % self.every == 0 or step + 1 == self.steps:
            print(f"cold start: step {step + 1}/{self.steps}, loss {sum(self.since) / len(self.since):.4f}",
                  file=sys.stderr, flush=True)
            self.since.clear()


class PromptIds:
    """`fn(example) -> prompt ids` as the engine sees them (rollout.chat_template), for the cold start."""

    def __init__(self, cfg: Config, tok):
        self.tok, self.rollout = tok, cfg.rollout

    def __call__(self, example: Example) -> list[int]:
        return prompt_ids(self.tok, example, self.rollout)
