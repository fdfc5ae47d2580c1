"""Tool calls in multi-turn rollouts (moe_gspo.rollout.tools): loading tools from a file or a module with a
one-line refusal for each way a spec can be wrong, their schemas, parsing Hermes / Qwen `<tool_call>` blocks,
running calls (an exception, a timeout, a non-string return or bad arguments become a ToolResult, never an
exception), and the schemas and calls through Qwen's own chat templates."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
from helpers import ROOT

from moe_gspo.config.checks import ConfigError
from moe_gspo.rollout.tools import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Tool, ToolCall, ToolResult, load_tools,
                                    parse_tool_calls, run_tool_call, tool_schemas)

EXAMPLES = "tests/data/tools_example.py"


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture
def tools(in_root):
    return load_tools([f"{EXAMPLES}:{name}" for name in ("add", "boom", "sleepy", "number", "shout")])


# ------------------------------------------------------------------------------------------------------- loading


def test_load_by_file_spec_gives_names_functions_and_schemas(tools):
    assert [t.name for t in tools] == ["add", "boom", "sleepy", "number", "shout"]
    assert all(isinstance(t, Tool) for t in tools)
    add = tools[0]
    assert add.fn(2, 3) == "5"
    fn = add.schema["function"]
    assert add.schema["type"] == "function" and fn["name"] == "add" and fn["description"] == "Add two integers."
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["a", "b"]
    assert params["properties"]["a"] == {"type": "integer", "description": "The first addend."}
    assert params["properties"]["note"]["type"] == "string"
    assert tools[2].schema["function"]["parameters"]["properties"]["seconds"]["type"] == "number"
    assert tool_schemas(tools) == [t.schema for t in tools]
    assert tool_schemas({t.name: t for t in tools}) == [t.schema for t in tools]


def test_load_by_absolute_path_and_by_module(monkeypatch):
    (add,) = load_tools([f"{ROOT / EXAMPLES}:add"])
    assert add.name == "add" and add.fn(1, 1) == "2"
    monkeypatch.syspath_prepend(str(ROOT / "tests/data"))
    monkeypatch.delitem(__import__("sys").modules, "tools_example", raising=False)
    (shout,) = load_tools(["tools_example:shout"])
    assert shout.name == "shout" and shout.fn("hi") == "HI"
    assert shout.schema["function"]["parameters"]["required"] == ["text"]


@pytest.mark.parametrize("specs", [None, []])
def test_no_tools(specs):
    assert load_tools(specs) == []
    assert tool_schemas([]) == []


def test_one_spec_string_is_a_list_of_one(in_root):
    assert [t.name for t in load_tools(f"{EXAMPLES}:add")] == ["add"]


REFUSALS = [  # (the spec, what the one-line message says about it)
    (EXAMPLES, "names no function"),
    (":add", "names no function"),
    (f"{EXAMPLES}:1add", "'1add' is not a function name"),
    ("nowhere/no_such_tools.py:add", "tool file nowhere/no_such_tools.py not found"),
    ("tests/data:add", "is neither a Python file (.py) nor a module name"),
    ("no_such_module_for_tools:add", "cannot import module no_such_module_for_tools (ModuleNotFoundError"),
    ("json:no_such_function", "json has no 'no_such_function'"),
    (f"{EXAMPLES}:missing", "has no 'missing'; it defines add, boom, number, shout, sleepy, undocumented, untyped"),
    (f"{EXAMPLES}:NOT_A_FUNCTION", "NOT_A_FUNCTION is int 3, not a function"),
    (f"{EXAMPLES}:undocumented", "Cannot generate JSON schema for undocumented because it has no docstring!"),
    (f"{EXAMPLES}:untyped", "Argument x is missing a type hint in function untyped"),
]


@pytest.mark.parametrize("spec,says", REFUSALS, ids=[s for _, s in REFUSALS])
def test_a_bad_spec_is_refused_in_one_line_naming_field_and_spec(in_root, spec, says):
    with pytest.raises(ConfigError) as e:
        load_tools([f"{EXAMPLES}:add", spec], field="env.tools")
    message = str(e.value)
    assert message.startswith(f"env.tools[1]: {spec}: "), message
    assert says in message and "\n" not in message, message


def test_a_file_that_raises_on_import_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bad_tools.py"
    bad.write_text("def helper():\n    raise RuntimeError('no network\\nat all')\n\nhelper()\n")
    with pytest.raises(ConfigError) as e:
        load_tools([f"{bad}:helper"])
    message = str(e.value)
    assert message.startswith(f"rollout.tools[0]: {bad}:helper: importing {bad} raised RuntimeError: no network")
    assert "\n" not in message and "reward" not in message, message
    assert "bad_tools.py" in e.value.detail and "helper()" in e.value.detail  # the user's frames, for the CLI


def test_two_tools_of_one_name_are_refused(in_root):
    with pytest.raises(ConfigError) as e:
        load_tools([f"{EXAMPLES}:add", f"{EXAMPLES}:shout", f"{ROOT / EXAMPLES}:add"])
    message = str(e.value)
    assert message == (f"rollout.tools[2]: {ROOT / EXAMPLES}:add: a tool named 'add' is already given by "
                       f"rollout.tools[0] ({EXAMPLES}:add)")


# ------------------------------------------------------------------------------------------------------- parsing


def test_parse_one_call_with_whitespace_around_the_json():
    text = 'Let me add.\n<tool_call>\n  {"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("add", {"a": 2, "b": 3})], [])
    assert (TOOL_CALL_OPEN, TOOL_CALL_CLOSE) == ("<tool_call>", "</tool_call>")


def test_parse_several_calls_in_order():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and then\n'
            '<tool_call>\n{"name": "shout", "arguments": {"text": "x"}}\n</tool_call>\n'
            '<tool_call>{"name": "now"}</tool_call>')  # no arguments: a function of no parameters
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("shout", {"text": "x"}), ToolCall("now", {})]
    assert errors == []


def test_arguments_written_as_a_json_string_holding_an_object_are_decoded():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_tool_calls(text) == ([ToolCall("add", {"a": 1, "b": 2})], [])


MALFORMED = [  # (one call's body, what its error says)
    ('{"name": "add", "arguments": {"a": 1,}}', "tool call 2: invalid JSON (Expecting property name"),
    ('["add", {"a": 1}]', "tool call 2: expected a JSON object with \"name\" and \"arguments\", got list"),
    ('{"arguments": {"a": 1}}', 'tool call 2: expected a string "name", got no "name"'),
    ('{"name": 7, "arguments": {}}', 'tool call 2: expected a string "name", got "name" 7'),
    ('{"name": "", "arguments": {}}', 'tool call 2: expected a string "name", got "name" ""'),
    ('{"name": "add", "arguments": [1, 2]}', 'tool call 2 (add): expected "arguments" to be a JSON object, got [1, 2]'),
    ('{"name": "add", "arguments": "1, 2"}', 'tool call 2 (add): expected "arguments" to be a JSON object, got "1, 2"'),
    ('{"name": "add", "arguments": "[1]"}', 'tool call 2 (add): expected "arguments" to be a JSON object, got "[1]"'),
]


@pytest.mark.parametrize("body,says", MALFORMED, ids=[s for _, s in MALFORMED])
def test_a_malformed_call_gives_a_one_line_error_and_the_others_still_parse(body, says):
    good = '<tool_call>{"name": "shout", "arguments": {"text": "a"}}</tool_call>'
    calls, errors = parse_tool_calls(f"{good}\n<tool_call>\n{body}\n</tool_call>\n{good}")
    assert calls == [ToolCall("shout", {"text": "a"})] * 2
    assert len(errors) == 1 and errors[0].startswith(says) and "\n" not in errors[0], errors


def test_an_unclosed_call_is_an_error():
    calls, errors = parse_tool_calls('ok <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert calls == [] and errors == ["tool call 1: <tool_call> without </tool_call>: "
                                      "'{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}'"]
    # one left open before the next call: that one is still parsed
    calls, errors = parse_tool_calls('<tool_call>{"name": "a"\n<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert calls == [ToolCall("b", {})]
    assert len(errors) == 1 and errors[0].startswith("tool call 1: <tool_call> without </tool_call>")


@pytest.mark.parametrize("text", ["", "The answer is 5.", "a stray </tool_call> alone", "<tool_response>5"])
def test_text_without_a_call_has_no_calls_and_no_errors(text):
    assert parse_tool_calls(text) == ([], [])


# ------------------------------------------------------------------------------------------------------- running


def test_a_call_that_works(tools):
    r = run_tool_call(ToolCall("add", {"a": 2, "b": 3, "note": "apples"}), tools, timeout_s=5.0)
    assert isinstance(r, ToolResult)
    assert (r.content, r.ok, r.error) == ("5 apples", True, None) and 0 <= r.seconds < 5
    by_name = {t.name: t for t in tools}
    assert run_tool_call(ToolCall("add", {"a": 1, "b": 1}), by_name, timeout_s=5.0).content == "2"


def test_a_tool_that_raises(tools):
    r = run_tool_call(ToolCall("boom", {"x": 3}), tools, timeout_s=5.0)
    assert (r.content, r.ok, r.error) == ("error: ValueError: boom 3", False, "raised")


def test_a_tool_past_its_timeout_is_abandoned(tools):
    start = time.perf_counter()
    r = run_tool_call(ToolCall("sleepy", {"seconds": 5}), tools, timeout_s=0.2)
    elapsed = time.perf_counter() - start
    assert elapsed < 3, f"run_tool_call waited {elapsed:.1f} s for a tool with a 0.2 s timeout"
    assert (r.content, r.ok, r.error) == ("error: tool sleepy timed out after 0.2 s", False, "timeout")
    assert 0.15 <= r.seconds < 3
    # one that finishes within its timeout returns its text
    r = run_tool_call(ToolCall("sleepy", {"seconds": 0.01}), tools, timeout_s=5.0)
    assert (r.content, r.ok, r.error) == ("awake", True, None)


def test_a_tool_that_returns_no_string(tools):
    r = run_tool_call(ToolCall("number", {"x": 4}), tools, timeout_s=5.0)
    assert (r.content, r.ok, r.error) == ("error: tool returned int, not a string", False, "not_a_string")


def test_an_unknown_tool_names_the_tools_there_are(tools):
    r = run_tool_call(ToolCall("multiply", {"a": 1}), tools, timeout_s=5.0)
    assert (r.ok, r.error) == (False, "unknown_tool")
    assert r.content == "error: unknown tool 'multiply'; the tools are add, boom, sleepy, number, shout"
    assert run_tool_call(ToolCall("add", {}), [], timeout_s=5.0).content == \
        "error: unknown tool 'add'; no tools are available"


@pytest.mark.parametrize("arguments,says", [
    ({"a": 1}, "missing a required argument: 'b'"),
    ({"a": 1, "b": 2, "c": 3}, "got an unexpected keyword argument 'c'"),
])
def test_arguments_the_signature_does_not_take(tools, arguments, says):
    r = run_tool_call(ToolCall("add", arguments), tools, timeout_s=5.0)
    assert (r.content, r.ok, r.error) == (f"error: bad arguments for add: {says}", False, "bad_arguments")


def test_output_is_kept_whole_unless_max_chars_is_given(tools):
    call = ToolCall("shout", {"text": "a" * 100})
    assert run_tool_call(call, tools, timeout_s=5.0).content == "A" * 100
    r = run_tool_call(call, tools, timeout_s=5.0, max_chars=10)
    assert (r.content, r.ok) == ("A" * 10 + "... [truncated 90 chars]", True)
    assert run_tool_call(call, tools, timeout_s=5.0, max_chars=100).content == "A" * 100


# ------------------------------------------------------------------------------------- through a real chat template


def _qwen_template(name: str) -> str:
    """A chat template Qwen ships, from the copies TRL keeps (its identity checks compare against them)."""
    spec = importlib.util.find_spec("trl")  # finds the package without importing it
    path = spec and Path(spec.submodule_search_locations[0]) / "chat_templates" / f"{name}.jinja"
    if not path or not path.is_file():
        pytest.skip(f"needs TRL's copy of Qwen's {name} chat template (pip install trl)")
    return path.read_text()


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_schemas_and_calls_round_trip_through_qwens_chat_template(tools, template):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  unk_token="<unk>")
    tok.chat_template = _qwen_template(template)
    call = ToolCall("add", {"a": 2, "b": 3})
    result = run_tool_call(call, tools, timeout_s=5.0)
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "content": result.content}]
    text = tok.apply_chat_template(messages, tools=tool_schemas(tools), tokenize=False, add_generation_prompt=True)
    for t in tools:  # each schema, as the template writes it into the system prompt
        assert json.dumps(t.schema, ensure_ascii=False) in text, t.name
    # the call the template writes for the assistant turn parses back to the call, and the result is its response
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_tool_calls(assistant) == ([call], [])
    assert "<tool_response>\n5\n</tool_response>" in text
