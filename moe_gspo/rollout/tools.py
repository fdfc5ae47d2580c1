"""Tools a policy may call in a multi-turn rollout: loading them, the schemas its chat template shows, parsing the
calls it writes, and running them.

    tools = load_tools(["my_tools.py:add", "my_pkg.search:web_search"])   # rollout.tools
    text = tokenizer.apply_chat_template(messages, tools=tool_schemas(tools), add_generation_prompt=True,
                                         tokenize=False)
    calls, errors = parse_tool_calls(response_text)   # Hermes / Qwen <tool_call>{"name", "arguments"}</tool_call>
    results = [run_tool_call(c, tools, timeout_s=10.0) for c in calls]
    messages += [{"role": "tool", "content": r.content} for r in results]

A tool is a plain function with type hints and a Google-style docstring (a summary line and an `Args:` section
describing every parameter): transformers' get_json_schema turns it into the schema chat templates take as `tools=`.
It returns a string, the text the model reads back. Loading checks all of that and refuses a bad tool with a
one-line ConfigError naming the config field and the spec; running a call never raises for anything the tool does:
an unknown name, arguments its signature does not take, an exception, a timeout or a non-string return becomes a
ToolResult with ok=False and an error message for the model to read.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moe_gspo.config.checks import ConfigError, names_a_module
from moe_gspo.rewards.user import _describe, _import_file, _one_line, user_traceback

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CUT = 60  # characters of a malformed call quoted in its error


def _first_line(e: BaseException) -> str:
    """The first non-empty line of `e`'s message ("" for none)."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "")


def _error_line(e: BaseException) -> str:
    """`Type: first line of the message`, or `Type` alone for an empty message."""
    line = _first_line(e)
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def _cut(text: str) -> str:
    return text if len(text) <= _CUT else text[:_CUT] + "..."


# --------------------------------------------------------------------------------------------------------- loading


@dataclass
class Tool:
    """A function the policy may call, and the schema its chat template shows it."""

    name: str
    """The name the model calls it by: the schema's function name (the function's __name__)."""
    fn: Callable
    """Called with the call's arguments as keywords; returns the text the model reads back."""
    schema: dict
    """{"type": "function", "function": {"name", "description", "parameters": {JSON schema}}}, what
    tokenizer.apply_chat_template(..., tools=[...]) takes."""


def tool_from_function(fn: Callable, spec: str, field: str = "rollout.tools") -> Tool:
    """A Tool of `fn`, its schema from transformers' get_json_schema (type hints and a Google-style docstring).
    A function it cannot describe raises a one-line ConfigError naming `field` and `spec`."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises TypeError, its parsing exceptions, NameError, ...
        raise ConfigError(f"{field}: {spec}: {_first_line(e) or _error_line(e)}") from None
    return Tool(schema["function"]["name"], fn, schema)


def _load_function(spec: str, field: str) -> Callable:
    """The callable `spec` names: `path/to/file.py:function` (relative to the working directory; the file is
    imported, running its code) or `package.module:function` of an importable module."""
    where = f"{field}: {spec}"
    file, sep, name = spec.rpartition(":")
    if not sep or not file:
        raise ConfigError(f"{where}: names no function; expected path/to/file.py:function or package.module:function")
    if not name.isidentifier():
        raise ConfigError(f"{where}: {name!r} is not a function name")
    if file.endswith(".py"):
        given = Path(file).expanduser()
        resolved = given if given.is_absolute() else Path.cwd() / given
        if not resolved.is_file():
            raise ConfigError(f"{where}: tool file {file} not found (looked for {resolved})")
        path = os.path.realpath(resolved)
        try:
            module = _import_file(path, file, field)
        except ConfigError as e:  # reworded: _import_file's message speaks of a reward file
            raise ConfigError(f"{where}: importing {file} raised {_one_line(e.__cause__)}",
                              detail=e.detail) from e.__cause__
    elif names_a_module(file):
        import importlib

        try:
            module = importlib.import_module(file)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the module's own code, or no such module
            raise ConfigError(f"{where}: cannot import module {file} ({_one_line(e)})",
                              detail=None if isinstance(e, ImportError) else user_traceback(e, "")) from None
    else:
        raise ConfigError(f"{where}: {file!r} is neither a Python file (.py) nor a module name; expected "
                          "path/to/file.py:function or package.module:function")
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items()
                         if inspect.isfunction(v) and not k.startswith("_") and v.__module__ == module.__name__)
        have = f"it defines {', '.join(defined)}" if defined else "it defines no functions"
        raise ConfigError(f"{where}: {file} has no {name!r}; {have}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"{where}: {name} is {_describe(fn)}, not a function")
    return fn


def load_tools(specs: list[str] | None, field: str = "rollout.tools") -> list[Tool]:
    """The tools `specs` name, in order (none for None or []; a single spec string counts as a list of one). Each
    spec is `path/to/file.py:function` or `package.module:function`; a spec that names no callable, a function
    get_json_schema cannot describe, or two tools of one name raise a one-line ConfigError naming `field[i]` and the
    spec."""
    tools: list[Tool] = []
    taken: dict[str, str] = {}  # tool name -> the field and spec that gave it
    for i, spec in enumerate([specs] if isinstance(specs, str) else specs or []):
        where = f"{field}[{i}]"
        if not isinstance(spec, str):
            raise ConfigError(f"{where}: {spec!r} is not a string; expected path/to/file.py:function")
        tool = tool_from_function(_load_function(spec, where), spec, where)
        if tool.name in taken:
            raise ConfigError(f"{where}: {spec}: a tool named {tool.name!r} is already given by {taken[tool.name]}")
        taken[tool.name] = f"{where} ({spec})"
        tools.append(tool)
    return tools


def configured_tools(specs: list[str]) -> list[Tool]:
    """load_tools for rollout.tools, once per process and list of specs: the config check, the prompts' template
    and the engine take the same tools without running the users' files again."""
    return list(_configured(tuple(specs)))


@functools.lru_cache(maxsize=8)
def _configured(specs: tuple[str, ...]) -> tuple[Tool, ...]:
    return tuple(load_tools(list(specs)))


def tool_schemas(tools: list[Tool] | dict[str, Tool]) -> list[dict]:
    """The tools' schemas in order: what tokenizer.apply_chat_template(..., tools=...) takes."""
    return [t.schema for t in (tools.values() if isinstance(tools, dict) else tools)]


TOOL_SYSTEM_INTRO = ("You can call these tools. To call one, write <tool_call>{\"name\": ..., \"arguments\": {...}}"
                     "</tool_call> and stop; its result comes back in the next message. Tools: ")


def tool_system_message(schemas: list[dict]) -> str:
    """The system message that names the tools (their JSON schemas) and the call format parse_tool_calls reads:
    what a model whose chat template ignores `tools=` is told instead (rollout.tool_prompt)."""
    return TOOL_SYSTEM_INTRO + json.dumps(schemas)


def template_shows_tools(tok, schemas: list[dict]) -> bool:
    """Whether the tokenizer's chat template renders anything of `tools=`: a probe conversation rendered with and
    without the schemas differs."""
    probe = [{"role": "user", "content": "q"}]
    return tok.render_chat(probe, tools=schemas) != tok.render_chat(probe, tools=None)


# --------------------------------------------------------------------------------------------------------- parsing


@dataclass
class ToolCall:
    """One call the model wrote."""

    name: str
    arguments: dict


def _parse_body(body: str, k: int) -> ToolCall | str:
    """The call in the text between one pair of tags, or a one-line error naming call `k` (1-based)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"tool call {k}: invalid JSON ({e.msg} at char {e.pos}): {_cut(body.strip())!r}"
    if not isinstance(obj, dict):
        return f"tool call {k}: expected a JSON object with \"name\" and \"arguments\", got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        got = "no \"name\"" if name is None else f"\"name\" {_cut(json.dumps(name))}"
        return f"tool call {k}: expected a string \"name\", got {got}"
    arguments = obj.get("arguments", {})  # a call to a function of no parameters may leave them out
    if isinstance(arguments, str):
        # some models write the arguments as a JSON string holding the object (OpenAI's wire format): decoded
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        arguments = decoded if isinstance(decoded, dict) else arguments
    if not isinstance(arguments, dict):
        return f"tool call {k} ({name}): expected \"arguments\" to be a JSON object, got {_cut(json.dumps(arguments))}"
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The calls in `text` written as the Qwen2.5 / Qwen3 (Hermes) chat templates ask,
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, in order, and a one-line error for each
    malformed one (invalid JSON, not an object, no string name, arguments not an object, no closing tag).
    Calls are numbered from 1 in the errors, counting every opening tag. A closing tag without an opening one is
    ignored. Text without an opening tag gives ([], [])."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    start, k = text.find(TOOL_CALL_OPEN), 0
    while start != -1:
        k += 1
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        reopen = text.find(TOOL_CALL_OPEN, body_start)
        if end == -1 or (reopen != -1 and reopen < end):  # no closing tag before the text or the next call ends
            body = text[body_start:] if reopen == -1 else text[body_start:reopen]
            errors.append(f"tool call {k}: {TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}: {_cut(body.strip())!r}")
            start = reopen
            continue
        parsed = _parse_body(text[body_start:end], k)
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
        start = text.find(TOOL_CALL_OPEN, end + len(TOOL_CALL_CLOSE))
    return calls, errors


# --------------------------------------------------------------------------------------------------------- running


@dataclass
class ToolResult:
    """What one call gave: the text for the tool message, and how it went."""

    content: str
    """The tool's returned string (cut to max_chars when asked), or an `error: ...` line for the model to read."""
    ok: bool
    """The tool ran and returned a string."""
    error: str | None
    """None when ok, else the kind of failure: unknown_tool, bad_arguments, raised, timeout or not_a_string."""
    seconds: float
    """Wall time of the call (up to the timeout for one that did not finish)."""


class _Run:
    """fn(**arguments) on a daemon thread: its return value or its exception, once `done` is set."""

    def __init__(self, fn: Callable, arguments: dict):
        self.fn, self.arguments = fn, arguments
        self.value, self.exception = None, None
        self.done = threading.Event()

    def __call__(self) -> None:
        try:
            self.value = self.fn(**self.arguments)
        except BaseException as e:  # noqa: BLE001 - anything the tool raises is reported to the model
            self.exception = e
        finally:
            self.done.set()


def _truncated(content: str, max_chars: int | None) -> str:
    if max_chars is None or len(content) <= max_chars:
        return content
    return f"{content[:max_chars]}... [truncated {len(content) - max_chars} chars]"


def run_tool_call(call: ToolCall, tools: dict[str, Tool] | list[Tool], timeout_s: float | None,
                  max_chars: int | None = None) -> ToolResult:
    """Run one call; never raises for anything the tool does.

    The tool runs on a daemon thread, waited for up to `timeout_s` seconds (None: no limit). Python cannot kill a
    thread, so a tool that runs past its timeout is abandoned, still running, while the rollout goes on: it holds
    whatever it holds until it returns, and the process exits without waiting for it. A tool that must be stopped
    (a subprocess, a network request) should enforce its own deadline.

    `max_chars` (None: keep all) cuts the content to that many characters, followed by
    `... [truncated N chars]`."""
    begin = time.perf_counter()
    by_name = tools if isinstance(tools, dict) else {t.name: t for t in tools}

    def failed(content: str, kind: str) -> ToolResult:
        return ToolResult(_truncated(content, max_chars), False, kind, time.perf_counter() - begin)

    tool = by_name.get(call.name)
    if tool is None:
        have = f"the tools are {', '.join(by_name)}" if by_name else "no tools are available"
        return failed(f"error: unknown tool {call.name!r}; {have}", "unknown_tool")
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as e:  # a missing or unexpected argument, or arguments that are no mapping
        return failed(f"error: bad arguments for {call.name}: {e}", "bad_arguments")
    except ValueError:  # a callable whose signature cannot be read: the call itself says whether they fit
        pass
    run = _Run(tool.fn, call.arguments)
    threading.Thread(target=run, name=f"tool-{call.name}", daemon=True).start()
    if not run.done.wait(timeout_s):
        return failed(f"error: tool {call.name} timed out after {timeout_s:g} s", "timeout")
    if run.exception is not None:
        return failed(f"error: {_error_line(run.exception)}", "raised")
    if not isinstance(run.value, str):
        return failed(f"error: tool returned {type(run.value).__name__}, not a string", "not_a_string")
    return ToolResult(_truncated(run.value, max_chars), True, None, time.perf_counter() - begin)
