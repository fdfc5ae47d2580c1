"""Multi-turn episodes with tool calls, around any rollout engine: the policy samples until eos; a response that
holds tool calls (Hermes/Qwen format, moe_gspo.rollout.tools) gets their results as tool messages; sampling goes on
from the whole episode so far, up to rollout.max_turns assistant turns and rollout.max_episode_tokens tokens.

    engine = MultiTurnEngine(engine_from_config(...), tools, tok, rollout_cfg)   # engine_from_config does this
    batch = engine.generate(prompts, n_per_prompt=8, sampling=sp)                 # one RolloutBatch, episodes

Exact tokens. An episode's ids are the prompt, then for each turn the ids the engine sampled, then the ids of the
tool messages and the next generation prompt, appended as ids: nothing sampled is ever re-tokenized from text. The
appended ids are the chat template's own rendering of the tool messages: the template renders a probe conversation
(a user message, then the assistant's sampled text), once with and once without the tool messages and the next
generation prompt, and the difference is encoded. A template is append-only for the episode when the longer render
starts with the shorter one plus the sampled text as the model wrote it; where it does not (Qwen3's template drops
earlier reasoning, some templates re-space), the difference is taken after the template's own render of the
assistant message, counted as multiturn/template_mismatch, and refused with rollout.strict_template. When the
template renders the turn's end token itself (ChatML's <|im_end|>) and the response ended with it, it is not
appended twice (moe_gspo.tasks.prompts.turn_ids, which the cold start's multi-message demonstrations use too).

Masks. RolloutBatch.loss_mask is True on the sampled tokens only: the loss, its length normalization (GSPO's
sequence mean, GRPO's token mean), the KL term and the rollout correction all run over response_mask, which is the
loss mask, so tool and template tokens count in none of them. Their log-probs are 0 and turn_ids gives each token's
turn.

Routing (R3). A sampled token's routes come from the engine's forward that produced it; a tool or template token's
from the next turn's prefill, which is the first forward to see it (its rows are position-aligned: the row before a
token is the forward that produced it). Only the new rows of each prefill are kept: a prefix's rows are never
taken twice.

On an engine tensor-parallel over several ranks, all of which run generate() together, the tools run on its first
rank and their results are broadcast to the others (share_tools): a tool runs once, and every rank appends the same
ids.

A tool that raises, hangs past rollout.tool_timeout_s, returns a non-string or is called malformed answers with a
tool message saying so, and the episode goes on; each is counted in the episode's record (RolloutBatch.episodes).

Rewards. A reward gets the episode's whole response as its text (tool messages included, special tokens dropped),
and the assistant turns' own texts as extra_info["turns"] (the column `turns` for TRL's signature):
reward_examples.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moe_gspo.config import UserError
from moe_gspo.rollout import base
from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.batch import RolloutBatch
from moe_gspo.rollout.tools import Tool, ToolCall, ToolResult, parse_tool_calls, run_tool_call, tool_schemas
from moe_gspo.tasks.prompts import turn_ids

SEED_STRIDE = 7_919  # each turn's sampler seed: the step's seed + turn x this


def engine_from_config(rollout_cfg, weights, tokenizer=None):
    """The engine rollout.engine names (moe_gspo.rollout.base.engine_from_config), running multi-turn episodes
    with rollout.tools when it names any."""
    engine = base.engine_from_config(rollout_cfg, weights, tokenizer)
    if not rollout_cfg.tools:
        return engine
    from moe_gspo.rollout.tools import configured_tools

    return MultiTurnEngine.from_config(engine, rollout_cfg, tokenizer, configured_tools(rollout_cfg.tools))


class TemplateMismatch(UserError):
    """The chat template does not render the episode as its ids extend it (rollout.strict_template)."""


@dataclasses.dataclass
class _Episode:
    """One episode in progress: its ids after the prompt, as lists the turns extend."""

    prompt: list[int]
    ids: list[int]
    logprobs: list[float]
    mask: list[bool]
    turns: list[int]
    routes: list[torch.Tensor]
    finish: str
    record: dict
    done: bool = False  # no further turn: no call, a cut-off response, max_turns or the token budget reached
    pending: int = 0  # ids appended after the last turn's response, whose routes the next prefill gives

    def all_ids(self) -> list[int]:
        return self.prompt + self.ids


class MultiTurnEngine:
    """A rollout engine whose generate() runs multi-turn episodes with `tools` on `inner`; every other attribute is
    the inner engine's (weight updates, sleep, metrics)."""

    def __init__(self, inner, tools: list[Tool], tok, max_turns: int, max_episode_tokens: int = 0,
                 tool_timeout_s: float = 10.0, tool_output_max_chars: int = 2000, strict_template: bool = False):
        self.inner, self.tools, self.tok = inner, {t.name: t for t in tools}, tok
        self.schemas = tool_schemas(tools)
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.tool_timeout_s, self.tool_output_max_chars = tool_timeout_s, tool_output_max_chars
        self.strict_template = strict_template
        self.stop_ids = set(getattr(tok, "stop_ids", ()) or (tok.eos_id,))
        self.group, self.src = None, 0  # share_tools

    @classmethod
    def from_config(cls, inner, rollout_cfg, tok, tools: list[Tool]) -> MultiTurnEngine:
        return cls(inner, tools, tok, rollout_cfg.max_turns, rollout_cfg.max_episode_tokens, rollout_cfg.tool_timeout_s,
                   rollout_cfg.tool_output_max_chars, rollout_cfg.strict_template)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate_parts(self, parts, n_per_prompt: int = 1) -> list[RolloutBatch]:
        return [self.generate(prompts, n_per_prompt, sp) for prompts, sp in parts]

    # ------------------------------------------------------------------------------------------ the episodes
    def generate(self, prompts: list[list[int]], n_per_prompt: int = 1,
                 sampling: SamplingParams | None = None) -> RolloutBatch:
        sp = sampling or SamplingParams()
        first = self.inner.generate(prompts, n_per_prompt, sp)
        budget = self.max_episode_tokens or self.max_turns * sp.max_new_tokens
        routed = first.routed_experts is not None
        eps = []
        for i in range(len(first)):
            r = first.response_ids[i]
            eps.append(_Episode(first.prompt_ids[i].tolist(), r.tolist(), first.logprobs[i].tolist(),
                                [True] * r.numel(), [0] * r.numel(),
                                [first.routed_experts[i]] if routed else [], first.finish_reasons[i],
                                dict(turns=1, tool_calls=0, tool_failures=0, malformed_calls=0, timeouts=0,
                                     template_mismatch=0, calls_past_max_turns=0)))
        for turn in range(1, self.max_turns + 1):
            calling = [(e, *c) for e in eps if (c := self._calls(e, turn)) is not None]
            results = self._run_calls([calls for _, calls, _ in calling])
            going = [e for (e, calls, errors), res in zip(calling, results)
                     if self._answer_tools(e, turn, budget, calls, errors, res)]
            if not going:
                break
            # one call for every episode, at the largest room any has left; each response is then cut to its own
            # episode's room (the tokens before a cut are what a smaller limit would have sampled)
            rooms = [max(1, min(sp.max_new_tokens, budget - len(e.ids))) for e in going]
            turn_sp = dataclasses.replace(sp, seed=None if sp.seed is None else sp.seed + SEED_STRIDE * turn,
                                          max_new_tokens=max(rooms))
            nxt = self.inner.generate([e.all_ids() for e in going], 1, turn_sp)
            for j, (e, room) in enumerate(zip(going, rooms)):
                self._extend(e, nxt, j, turn, room)
        return self._batch(first, eps, routed)

    def _last_turn(self, e: _Episode, turn: int) -> list[int]:
        return [t for t, m, k in zip(e.ids, e.mask, e.turns) if m and k == turn - 1]

    def _calls(self, e: _Episode, turn: int) -> tuple[list[ToolCall], list[str]] | None:
        """The calls and malformed calls of the episode's last response; None (the episode over) when it holds none,
        was cut off, or was the last turn allowed."""
        if e.finish != "stop" or e.done:
            return None
        calls, errors = parse_tool_calls(self.tok.decode(self._last_turn(e, turn), skip_special=False))
        if not calls and not errors:
            e.done = True
            return None
        if turn >= self.max_turns:
            e.record["calls_past_max_turns"] += len(calls) + len(errors)
            e.done = True
            return None
        return calls, errors

    def _run_calls(self, calls: list[list[ToolCall]]) -> list[list[ToolResult]]:
        """Each episode's tool results. On an engine of several ranks (share_tools) the engine's first rank runs
        the tools and sends the results to the others, whose episodes are the same: a tool runs once, and every
        rank appends the same ids whatever the tool does (a clock, a timeout, a side effect)."""
        if self.group is None or dist.get_rank() == self.src:
            out = [[run_tool_call(c, self.tools, self.tool_timeout_s, max_chars=self.tool_output_max_chars)
                    for c in cs] for cs in calls]
        else:
            out = None
        if self.group is not None:
            box = [out]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            out = box[0]
        return out

    def share_tools(self, group, src: int) -> None:
        """Run the tools on rank `src` alone and broadcast their results over `group`, the ranks of one
        tensor-parallel engine (all of which run generate() together); None: run them here."""
        self.group, self.src = group, src

    def _answer_tools(self, e: _Episode, turn: int, budget: int, calls: list[ToolCall], errors: list[str],
                      answers: list[ToolResult]) -> bool:
        """Append the tool messages of the episode's last response (`answers` to its `calls`, then its malformed
        `errors`) and the next generation prompt as ids; False (and nothing appended) when that would pass the
        episode's token budget."""
        last = self._last_turn(e, turn)
        results = []
        for call, res in zip(calls, answers):
            e.record["tool_calls"] += 1
            e.record["tool_failures"] += not res.ok
            e.record["timeouts"] += res.error == "timeout"
            results.append({"role": "tool", "name": call.name, "content": res.content})
        for err in errors:
            e.record["malformed_calls"] += 1
            results.append({"role": "tool", "content": f"error: malformed tool call: {err}"})
        ended_with_stop = bool(last) and last[-1] in self.stop_ids
        delta = self._tool_ids(last, results, ended_with_stop, e)
        if len(e.ids) + len(delta) >= budget:
            e.finish, e.done = "length", True
            return False
        e.ids += delta
        e.logprobs += [0.0] * len(delta)
        e.mask += [False] * len(delta)
        e.turns += [turn - 1] * len(delta)
        e.pending = len(delta)
        return True

    def _tool_ids(self, last: list[int], results: list[dict], ended_with_stop: bool, e: _Episode) -> list[int]:
        """The ids that follow the turn's sampled ids: the template's rendering of the tool messages and the next
        generation prompt (module docstring, moe_gspo.tasks.prompts.turn_ids)."""
        sampled = self.tok.decode(last[:-1] if ended_with_stop else last, skip_special=False)
        ids, rendered = turn_ids(self.tok, sampled, results, self.schemas, last[-1] if ended_with_stop else None)
        if rendered is not None:
            e.record["template_mismatch"] += 1
            if self.strict_template:
                raise TemplateMismatch(
                    f"rollout.strict_template: the chat template renders the assistant's turn otherwise than the "
                    f"engine sampled it (rendered {rendered[:60]!r}, sampled {sampled[:60]!r}); set "
                    "rollout.strict_template=false to count such turns instead")
        return ids

    def _extend(self, e: _Episode, nxt: RolloutBatch, j: int, turn: int, room: int) -> None:
        """Append turn `turn`'s response (row j of `nxt`), cut to `room` tokens (then finished by length), and, for
        R3, the prefill's rows of the ids appended since the last forward."""
        pending = e.pending
        r = nxt.response_ids[j][:room]
        if nxt.routed_experts is not None:
            if nxt.prompt_routed_experts is None:
                raise ValueError(f"{type(self.inner).__name__} returned no prompt routing: a multi-turn episode takes "
                                 "its tool tokens' routes from the next turn's prefill")
            prompt_rows = nxt.prompt_routed_experts[j]
            e.routes.append(prompt_rows[prompt_rows.shape[0] - pending:])
            e.routes.append(nxt.routed_experts[j][:r.numel()])
        e.ids += r.tolist()
        e.logprobs += nxt.logprobs[j][:room].tolist()
        e.mask += [True] * r.numel()
        e.turns += [turn] * r.numel()
        e.finish = "length" if nxt.response_ids[j].numel() > room else nxt.finish_reasons[j]
        e.record["turns"] += 1

    def _batch(self, first: RolloutBatch, eps: list[_Episode], routed: bool) -> RolloutBatch:
        return RolloutBatch(
            first.prompt_ids, [torch.tensor(e.ids, dtype=torch.long) for e in eps],
            [torch.tensor(e.logprobs, dtype=torch.float32) for e in eps], [e.finish for e in eps],
            first.sample_ids, first.group_ids,
            [torch.cat(e.routes) for e in eps] if routed else None, first.prompt_routed_experts,
            [torch.tensor(e.mask, dtype=torch.bool) for e in eps],
            [torch.tensor(e.turns, dtype=torch.int16) for e in eps], [e.record for e in eps])


def turn_texts(batch: RolloutBatch, tok) -> list[list[str]] | None:
    """Each episode's assistant turns as text: turn k's sampled ids decoded (special tokens dropped, as the reward's
    text is); None for a batch of single responses."""
    if batch.episodes is None:
        return None
    out = []
    for ids, lm, t in zip(batch.response_ids, batch.loss_mask, batch.turn_ids):
        top = int(t.max()) if t.numel() else 0
        out.append([tok.decode(ids[lm & (t == k)].tolist()) for k in range(top + 1)])
    return out


def reward_examples(examples: list, batch: RolloutBatch, tok) -> list:
    """The examples a batch's responses are scored with: for episodes, copies that carry the assistant turns' texts
    (turn_texts) as the column `turns` and as extra_info["turns"], so that a reward can score the last turn alone
    rather than the whole episode (whose text holds the tool messages too); the examples themselves otherwise."""
    turns = turn_texts(batch, tok)
    if turns is None:
        return examples
    out = []
    for ex, tt in zip(examples, turns):
        extra = ex.meta.get("extra_info")
        extra = {**(extra if isinstance(extra, dict) else {}), "turns": tt}
        out.append(dataclasses.replace(ex, meta={**ex.meta, "turns": tt, "extra_info": extra}))
    return out


def episode_metrics(batch: RolloutBatch) -> dict[str, float]:
    """multiturn/ figures of a batch of episodes: turns, tool calls and their failures, template mismatches, and by
    turn index k the mean sampled tokens (response_tokens/turn_k) and tool-message tokens (tool_tokens/turn_k)."""
    if batch.episodes is None:
        return {}
    n = len(batch)
    m = {f"multiturn/{k}": sum(e[k] for e in batch.episodes) / n
         for k in ("turns", "tool_calls", "tool_failures", "malformed_calls", "timeouts", "calls_past_max_turns")}
    m["multiturn/template_mismatch"] = float(sum(e["template_mismatch"] for e in batch.episodes))
    calls = sum(e["tool_calls"] + e["malformed_calls"] for e in batch.episodes)
    good = sum(e["tool_calls"] - e["tool_failures"] for e in batch.episodes)
    m["multiturn/tool_success"] = good / calls if calls else 0.0
    top = max((int(t.max()) for t in batch.turn_ids if t.numel()), default=0)
    for k in range(top + 1):
        m[f"multiturn/response_tokens/turn_{k}"] = sum(int(((t == k) & lm).sum())
                                                      for t, lm in zip(batch.turn_ids, batch.loss_mask)) / n
        m[f"multiturn/tool_tokens/turn_{k}"] = sum(int(((t == k) & ~lm).sum())
                                                  for t, lm in zip(batch.turn_ids, batch.loss_mask)) / n
    return m

