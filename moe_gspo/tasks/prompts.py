"""Prompt token ids from an Example: chat messages through the tokenizer's chat template, strings as they are.

    ids = encode_prompt(tok, example, chat_template="auto", template_kwargs={"enable_thinking": False})

`chat_template` (rollout.chat_template): 'auto' templates chat-message prompts and encodes strings as they are
(bos first where the tokenizer has one), 'always' wraps a string as one user message and templates it too, 'none'
refuses chat-message prompts. The same ids feed the engine, the cold start's demonstrations and `moe-gspo rollout`.
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

