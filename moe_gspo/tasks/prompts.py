"""Prompt token ids from an Example: chat messages through the tokenizer's chat template, strings as they are.

    ids = encode_prompt(tok, example, chat_template="auto", template_kwargs={"enable_thinking": False})

`chat_template` (rollout.chat_template): 'auto' templates chat-message prompts and encodes strings as they are
(bos first where the tokenizer has one), 'always' wraps a string as one user message and templates it too, 'none'
refuses chat-message prompts. The same ids feed the engine, the cold start's demonstrations and `moe-gspo rollout`.

    ids, rendered = turn_ids(tok, sampled_text, [{"role": "tool", "content": "579"}], tools=schemas, end_id=eos)

turn_ids gives the ids that follow an assistant turn in a multi-turn episode: the template's rendering of the tool
messages and the next generation prompt. The rollout's agent loop (moe_gspo.rollout.agent) appends them after each
turn that called a tool, and the cold start's multi-message demonstrations (moe_gspo.tasks.sft) put the same ids
between their assistant turns.
"""

from __future__ import annotations

from moe_gspo.config import ConfigError
from moe_gspo.tasks.base import Example


def _messages(example: Example, chat_template: str) -> list[dict] | None:
    if example.messages is not None:
        if chat_template == "none":
            raise ConfigError(f"rollout.chat_template='none', but the prompt {example.prompt[:60]!r} is a list of "
                              "chat messages; use 'auto' to apply the tokenizer's chat template")
        return example.messages
    if chat_template == "always":
        return [{"role": "user", "content": example.prompt}]
    return None


def check_chat_template(tok, example: Example, chat_template: str) -> None:
    """ConfigError when `example` needs a chat template the tokenizer does not have, or rollout.chat_template
    refuses it; nothing otherwise."""
    if _messages(example, chat_template) is not None and not getattr(tok, "chat_template", None):
        what = ("chat messages" if example.messages is not None else
                "a string that rollout.chat_template='always' wraps as a user message")
        raise ConfigError(f"rollout.chat_template={chat_template!r}: the prompt {example.prompt[:60]!r} is {what}, but "
                          f"the tokenizer ({type(tok).__name__}) has no chat template; start from a checkpoint whose "
                          "tokenizer has one (model.init_from), or give string prompts")


def with_system(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` as their system message: appended to the first message's content when that is a
    system message, else a system message put in front."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def encode_prompt(tok, example: Example, chat_template: str = "auto", template_kwargs: dict | None = None,
                  system: str | None = None) -> list[int]:
    """The ids the engine is given for `example`'s prompt (see the module docstring). `system`: text a templated
    prompt's system message carries besides its own (the tools, for a template that ignores `tools=`)."""
    messages = _messages(example, chat_template)
    if messages is None:
        return tok.encode(example.prompt, bos=True)
    check_chat_template(tok, example, chat_template)
    if system:
        messages = with_system(messages, system)
    try:
        return tok.apply_chat_template(messages, **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja raises TemplateError and others on a template that cannot render
        raise ConfigError(f"the tokenizer's chat template failed on the prompt {example.prompt[:60]!r} with "
                          f"rollout.chat_template_kwargs={template_kwargs or {}}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())}") from None


def unrendered_roles(tok, roles) -> dict[str, str]:
    """{role: why} for each chat role in `roles` that the tokenizer's chat template leaves out of what it renders
    (a message whose content does not appear) or refuses. Each role is probed in a short conversation (after a user
    message, a system message before one); a template that raises on the probe of a standard role (system, user,
    assistant: some insist on their own order) is given the benefit of the doubt. Needs a transformers tokenizer
    (the character tokenizer's template renders every role)."""
    hf = getattr(tok, "tok", None)
    if hf is None or not getattr(hf, "chat_template", None):
        return {}
    mark = "moe-gspo role probe 7f3a"
    out = {}
    for role in sorted(set(roles)):
        probe = {"role": role, "content": mark}
        conv = ([probe] if role == "user" else [probe, {"role": "user", "content": "q"}] if role == "system"
                else [{"role": "user", "content": "q"}, probe])
        try:
            text = hf.apply_chat_template(conv, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja's raise_exception and others
            if role not in ("system", "user", "assistant"):
                out[role] = f"the template refuses it ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
            continue
        if mark not in text:
            out[role] = "the template renders nothing of its messages"
    return out


PROBE_USER = {"role": "user", "content": "q"}


def turn_ids(tok, sampled: str, messages: list[dict], tools: list[dict] | None = None,
             end_id: int | None = None) -> tuple[list[int], str | None]:
    """(ids, rendered): the ids that follow an assistant turn whose text is `sampled`, and None, or, where the
    template is not append-only for it, the template's own text of that turn.

    The template renders a probe conversation (a user message, then the assistant's `sampled` text) once with and
    once without `messages` (the turn's tool messages) and the next generation prompt, and the difference is
    encoded. The template is append-only when the longer render starts with the probe's opening plus `sampled` as
    the model wrote it; where it does not (Qwen3's template drops earlier reasoning, some templates re-space), the
    difference is taken after the template's render of the assistant message, and `rendered` says how the
    template wrote the turn. `end_id`: the end-of-turn id the turn was sampled with (ChatML's <|im_end|>), which is
    not appended again when the template renders it; None when the turn ended otherwise. `tools`: the JSON
    schemas the template is given (`tools=`)."""
    def render(msgs, generation_prompt):
        return tok.render_chat(msgs, tools=tools, add_generation_prompt=generation_prompt)

    assistant = {"role": "assistant", "content": sampled}
    opening = render([PROBE_USER], True)
    opened = opening + sampled
    full = render([PROBE_USER, assistant, *messages], True)
    if full.startswith(opened):
        delta, rendered = full[len(opened):], None
    else:
        delta = full[len(render([PROBE_USER, assistant], False)):]
        rendered = full[len(opening):]
    ids = tok.encode(delta)
    if end_id is not None and ids and ids[0] == end_id:
        ids = ids[1:]  # the template's own end of turn, which the turn already has
    return ids, rendered
