"""Tool calls read out of a reply (mtpchat/chat/tools.py), on the format the bundled chat template
renders for an earlier reply's calls, whole and streamed in every split, malformed ones kept as text."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpchat.chat.tools import ToolCall, ToolCallStream, forced_prefix, parse, schema_types

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "lines": {"type": "integer"}, "flags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}}}}}]
CALLS = [ToolCall("read_file", {"path": "src/a b.py", "lines": 40, "flags": ["x", 1]}),
         ToolCall("run", {"command": "pytest -q\nls -la  # two lines, \"quoted\" {not json}"})]


@pytest.fixture(scope="module")
def rendered():
    """An assistant turn with two calls as the checkpoint's own template writes it: the model's format."""
    from mtpchat.engine.tokenizer import Tokenizer
    tok = Tokenizer.load(DEMO)
    history = [{"role": "user", "content": "look"},
               {"role": "assistant", "content": "Let me look.", "tool_calls": [
                   {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in CALLS]}]
    text = tok.render_chat(history, add_generation_prompt=False, tools=TOOLS)
    assert "# Tools" in text and '"read_file"' in text        # the tools are rendered too
    reply = text.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]
    assert reply.count("<tool_call>") == 2 and "<parameter=path>\nsrc/a b.py\n</parameter>" in reply
    return reply


def test_a_whole_reply_gives_its_calls_with_typed_arguments(rendered):
    text, calls = parse(rendered, schema_types(TOOLS))
    assert text == "Let me look." and calls == CALLS
    sent = calls[0].openai("call_1")
    assert sent["type"] == "function" and json.loads(sent["function"]["arguments"]) == CALLS[0].arguments


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, 64])
def test_a_streamed_reply_gives_the_same_in_any_split(rendered, size):
    stream = ToolCallStream(schema_types(TOOLS))
    parts = []
    for i in range(0, len(rendered), size):
        parts += stream.push(rendered[i:i + size])
    parts += stream.flush()
    assert "".join(p for p in parts if isinstance(p, str)) == "Let me look."
    assert [p for p in parts if isinstance(p, ToolCall)] == CALLS
    assert not any(isinstance(p, str) and "<" in p for p in parts)   # no markup leaks as text


@pytest.mark.parametrize("bad", [
    "<tool_call>\n<function=run>\n<parameter=command>\nls\n</parameter>\n",          # never closed
    "<tool_call>\nrun ls\n</tool_call>",                                                # no function
    "<tool_call>\n<function=run>\nstray <parameter=command>\nls\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",                             # no name
    "<tool_call>\n<function=run>\n<parameter=command>\nls\n</function>\n</tool_call>",  # parameter not closed
])
def test_a_malformed_call_stays_text(bad):
    text, calls = parse("Before. " + bad)
    assert calls == [] and text == "Before. " + bad
    stream = ToolCallStream()
    parts = [p for ch in bad for p in stream.push(ch)] + stream.flush()
    assert "".join(parts) == bad


def test_text_that_only_looks_like_a_tag_is_not_held_forever():
    stream = ToolCallStream()
    assert stream.push("a <tool") == ["a "]            # might start <tool_call>: held
    assert stream.push("s> b") == ["<tools> b"]          # it did not
    assert parse("x < y and <tool_ca")[0] == "x < y and <tool_ca"


def test_untyped_arguments_read_as_json_where_they_are_json():
    text, calls = parse("<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=s>\nhello\n"
                        "</parameter>\n<parameter=q>\n\"quoted\"\n</parameter>\n</function>\n</tool_call>")
    assert calls == [ToolCall("f", {"n": 3, "s": "hello", "q": "\"quoted\""})] and text == ""


def test_a_forced_call_is_read_with_the_prefix_the_prompt_gave():
    prefix = forced_prefix({"type": "function", "function": {"name": "run"}})
    stream = ToolCallStream(schema_types(TOOLS), prefix)
    parts = stream.push("<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>") + stream.flush()
    assert parts == [ToolCall("run", {"command": "ls"})]
    stream = ToolCallStream(None, forced_prefix("required"))
    assert stream.push("run>\n</function>\n</tool_call>") == [ToolCall("run", {})]
    assert forced_prefix("auto") == forced_prefix("none") == ""
