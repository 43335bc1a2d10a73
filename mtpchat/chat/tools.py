"""Tool calls in a reply: the Qwen3.5/3.6 chat templates ask the model to call a function with

    <tool_call>
    <function=NAME>
    <parameter=ARGUMENT>
    VALUE
    </parameter>
    </function>
    </tool_call>

and this reads such blocks back out of the answer, whole (`parse`) or as the text streams
(`ToolCallStream`). A block that does not read as one call (unclosed, no function, text between
the parts) stays text: what the model wrote is never lost, and never an error.

A VALUE is text; where the tool's JSON schema says the argument is not a string, or the text reads
as JSON that is not a string, it is that JSON value ("3" -> 3, "[1, 2]" -> [1, 2]).

`forced_prefix` is how a request that must call a tool gets one without constrained decoding: the
reply is started for the model, in the prompt, at the point where it names the function.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def openai(self, call_id: str) -> dict:
        """The call as the OpenAI API writes it (arguments as a JSON string)."""
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def schema_types(tools: list[dict] | None) -> dict[str, dict[str, object]]:
    """{function: {argument: its JSON schema type}} from an OpenAI `tools` list."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        if isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def _value(text: str, kind) -> object:
    if kind == "string" or (isinstance(kind, list) and kind == ["string"]):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    # text that reads as a JSON string stays the text the model wrote, quotes and all, unless asked
    return text if isinstance(value, str) and kind is None else value


def read_call(block: str, types: dict | None = None) -> ToolCall | None:
    """One block's inside (between <tool_call> and </tool_call>) as a call; None where it is not one."""
    m = _CALL.fullmatch(block)
    if m is None:
        return None
    name, body = m.group(1).strip(), m.group(2)
    kinds = (types or {}).get(name, {})
    args, pos = {}, 0
    for p in _PARAM.finditer(body):
        if p.start() != pos:
            return None
        args[p.group(1).strip()] = _value(p.group(2), kinds.get(p.group(1).strip()))
        pos = p.end()
    if body[pos:].strip() or not name:
        return None
    return ToolCall(name, args)


def parse(text: str, types: dict | None = None) -> tuple[str, list[ToolCall]]:
    """(the text outside the calls, the calls) of a whole answer."""
    stream = ToolCallStream(types)
    parts = stream.push(text) + stream.flush()
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, ToolCall)]


class ToolCallStream:
    """Answer text in, text and whole `ToolCall`s out, in the order the model wrote them. A possible
    start of <tool_call> at the end of a push waits for the next; a block waits for its close."""

    def __init__(self, types: dict | None = None, prefix: str = ""):
        self.types = types
        self.held = ""          # text that may start a tag, or an open block
        self.inside = False
        self.calls = 0
        self.trim = False       # after a call: the newlines before what follows are markup
        self.push_prefix = prefix

    def push(self, text: str) -> list[str | ToolCall]:
        text, self.push_prefix = self.push_prefix + text, ""
        text, self.held = self.held + text, ""
        out: list[str | ToolCall] = []
        while text:
            if not self.inside:
                i = text.find(OPEN)
                if i < 0:
                    # held: what may start the tag, and the newlines that would go before a call
                    cut = len(text) - _partial_suffix(text, OPEN)
                    cut = len(text[:cut].rstrip("\n"))
                    self._text(out, text[:cut])
                    self.held = text[cut:]
                    return out
                self._text(out, text[:i].rstrip("\n") if i else "")
                self.inside, text = True, text[i:]
            j = text.find(CLOSE)
            if j < 0:
                self.held = text
                return out
            block, text = text[:j + len(CLOSE)], text[j + len(CLOSE):]
            call = read_call(block[len(OPEN):-len(CLOSE)], self.types)
            self.inside = False
            if call is None:
                self._text(out, block)
            else:
                out.append(call)
                self.calls += 1
                self.trim = True
        return out

    def flush(self) -> list[str | ToolCall]:
        """The end of the answer: an unclosed block is text."""
        held, self.held, self.inside = self.push_prefix + self.held, "", False
        out: list[str | ToolCall] = []
        self._text(out, held)
        return out

    def _text(self, out: list, text: str) -> None:
        if self.trim:
            text = text.lstrip()
            self.trim = not text
        if text:
            out.append(text)


def forced_prefix(choice) -> str:
    """The start of a reply that must call a tool: "required" leaves the name to the model, a named
    function names it. Empty for "auto" and "none"."""
    if choice == "required":
        return OPEN + "\n<function="
    if isinstance(choice, dict):
        return f"{OPEN}\n<function={choice['function']['name']}>\n"
    return ""


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
