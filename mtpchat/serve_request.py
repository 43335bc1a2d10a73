"""What a request asks of `mtpchat serve`, checked: the OpenAI fields this engine serves, turned into
the messages (or prompt), `SamplingParams`, stop strings and tools a generation takes.

Each field is checked by the one entry that names it in `CHAT` / `COMPLETION` (a field is added in
one place); a bad field is a `BadRequest` whose message and `param` name it. Types are strict, as
the OpenAI API's are: "false" is not a boolean, NaN and Infinity are not numbers. A field the
server does not read (user, metadata, store, parallel_tool_calls, ...) is ignored, as OpenAI-style
servers do; one whose meaning it would silently drop is refused. An unset sampling field takes
the server's default (`Defaults`: serve's own flags, else the checkpoint's generation_config.json).

The chat template's switches (`reasoning_effort`, `chat_template_kwargs`) depend on the template,
so their table entries only hand the value on: the chat layer's `request_switches` checks them
against the served model's tokenizer.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Callable

from mtpchat.chat.prompt import SwitchError, Switches, request_switches
from mtpchat.chat.tools import forced_prefix, schema_types

INT64 = 2 ** 63
MAX_TOP_LOGPROBS = 20


class BadRequest(ValueError):
    """A request the API refuses: the message names the field; `status` is 400 unless the
    convention is another (404 for an unknown model, 413 for a body too large)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass
class Defaults:
    """What a request that does not say gets: `serve`'s flags over the checkpoint's defaults."""
    params: object                       # engine SamplingParams
    switches: Switches = Switches()      # the chat template's: thinking, preserve_thinking, reasoning_effort
    system: str | None = None
    names: tuple[str, ...] = ()          # the served model name first, then its aliases


@dataclass
class Request:
    """One request, checked and turned into what the engine takes."""
    kind: str                            # "chat" or "completion"
    params: object                       # engine SamplingParams
    messages: list[dict] = field(default_factory=list)
    prompt: str = ""                     # a completion's text
    stops: list[str] = field(default_factory=list)
    think: bool = True
    keep_thinking: bool | None = None    # preserve_thinking; None: the template's default
    effort: str | None = None            # reasoning_effort; None: the template's default
    stream: bool = False
    include_usage: bool = False
    tools: list[dict] | None = None      # rendered by the chat template; None: none offered
    types: dict = field(default_factory=dict)   # {function: {argument: schema type}}
    prefix: str = ""                     # the start of the reply written for the model (a forced call)
    top_logprobs: int | None = None      # None: no logprobs asked for


# -- field checks: each takes (value, name) and returns what the request keeps --------------------

def number(kind, lo=None, hi=None, above=None) -> Callable:
    """A finite int or float in [lo, hi] (and > above); an int field takes 3.0 as 3, never 3.5."""
    def check(value, name):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (isinstance(value, float) and not math.isfinite(value)):
            raise BadRequest(f"'{name}' must be a finite {'integer' if kind is int else 'number'}, got {value!r}", name)
        if kind is int and value != int(value):
            raise BadRequest(f"'{name}' must be an integer, got {value!r}", name)
        if (lo is not None and value < lo) or (hi is not None and value > hi) or \
                (above is not None and value <= above):
            low = f"more than {above}" if above is not None else f"at least {lo}" if lo is not None else ""
            span = " and ".join(x for x in (low, f"at most {hi}" if hi is not None else "") if x)
            raise BadRequest(f"'{name}' must be {span}, got {value!r}", name)
        return kind(value)
    return check


def boolean(value, name):
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false (a JSON boolean), got {value!r}", name)
    return value


def only_one(value, name):
    number(int, 1)(value, name)
    if value != 1:
        raise BadRequest(f"'{name}': only one choice per request is served, got {value!r}", name)
    return 1


def stop_strings(value, name):
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest(f"'{name}' must be a string or a list of strings", name)
    return value


def token_ids(value, name):
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < INT64
                                            for t in value)):
        raise BadRequest(f"'{name}' must be a list of token ids", name)
    return value


def stream_options(value, name):
    if not isinstance(value, dict):
        raise BadRequest(f"'{name}' must be an object", name)
    return boolean(value.get("include_usage", False), f"{name}.include_usage")


def template_switch(value, name):
    """Checked in parse_request by the chat layer's request_switches, which knows the template."""
    return value


def response_format(value, name):
    if not (isinstance(value, dict) and value.get("type") == "text"):
        raise BadRequest(f"'{name}': structured output (json_object, json_schema) is not served yet; "
                         "leave the field out, or ask for JSON in the prompt", name)
    return value


def tool_list(value, name):
    if not isinstance(value, list):
        raise BadRequest(f"'{name}' must be a list of tools", name)
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"] and isinstance(fn.get("parameters", {}), dict)):
            raise BadRequest(f"'{name}[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": {...}}}", name)
    return value or None


def tool_choice(value, name):
    if value in ("none", "auto", "required"):
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
        return {"type": "function", "function": {"name": fn["name"]}}
    raise BadRequest(f"'{name}' must be \"none\", \"auto\", \"required\" or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}", name)


def logprobs_flag(value, name):
    return boolean(value, name)


def message_list(value, name):
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{name}' must be a non-empty list of {{role, content}}", name)
    return [message(m, f"{name}[{i}]", i) for i, m in enumerate(value)]


def message(m, where: str, index: int) -> dict:
    roles = ("system", "developer", "user", "assistant", "tool")
    if not isinstance(m, dict) or m.get("role") not in roles:
        raise BadRequest(f"{where} needs a role of {', '.join(roles)}", "messages")
    role = "system" if m["role"] == "developer" else m["role"]     # the OpenAI API's newer name
    if role == "system" and index:
        raise BadRequest(f"{where}: a system message must come first", "messages")
    calls = m.get("tool_calls") if role == "assistant" else None
    content = m.get("content")
    if content is None and not (calls or role == "assistant"):
        raise BadRequest(f"{where}.content is missing", "messages")
    out = {"role": role, "content": text(content or "", f"{where}.content")}
    thinking = m.get("reasoning_content", m.get("reasoning"))
    if isinstance(thinking, str) and thinking:
        out["reasoning_content"] = thinking
    if calls:
        out["tool_calls"] = [past_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)] \
            if isinstance(calls, list) else past_call(calls, f"{where}.tool_calls")
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def past_call(call, where: str) -> dict:
    """An earlier reply's tool call, its arguments read from their JSON string for the template."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                         "messages")
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise BadRequest(f"{where}.function.arguments is not valid JSON", "messages") from None
    if not isinstance(args, dict):
        raise BadRequest(f"{where}.function.arguments must be a JSON object", "messages")
    return {"type": "function", "id": call.get("id"), "function": {"name": fn["name"], "arguments": args}}


def text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (other kinds of part are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text", ""), str) for p in content):
        return "".join(p.get("text", "") for p in content)
    raise BadRequest(f"{where} must be a string or a list of text parts", "messages")


def prompt_text(value, name):
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{name}' must be a non-empty string (one prompt per request)", name)
    return value


def model_name(value, name):
    if not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a string", name)
    return value


# One entry per field the server reads: name -> check. Sampling fields go into SamplingParams.
SAMPLING = {
    "temperature": number(float, 0.0, 2.0),
    "top_p": number(float, hi=1.0, above=0.0),
    "top_k": number(int, -1),
    "min_p": number(float, 0.0, 0.999),
    "presence_penalty": number(float, -2.0, 2.0),
    "max_tokens": number(int, 1),
    "max_completion_tokens": number(int, 1),
    "seed": number(int, -INT64, INT64 - 1),
}
COMMON = {
    "model": model_name, "n": only_one, "stop": stop_strings, "stop_token_ids": token_ids,
    "ignore_eos": boolean, "stream": boolean, "stream_options": stream_options, **SAMPLING,
}
CHAT = {
    **COMMON, "messages": message_list, "chat_template_kwargs": template_switch, "reasoning_effort": template_switch,
    "response_format": response_format, "tools": tool_list, "tool_choice": tool_choice,
    "logprobs": logprobs_flag, "top_logprobs": number(int, 0, MAX_TOP_LOGPROBS),
}
COMPLETION = {
    **COMMON, "prompt": prompt_text, "logprobs": number(int, 0, MAX_TOP_LOGPROBS),
    "echo": boolean, "suffix": prompt_text,
}
REQUIRED = {"chat": ("messages",), "completion": ("prompt",)}
TEMPLATE_FIELDS = ("chat_template_kwargs", "reasoning_effort")


def check_strings(value, where: str = "body", depth: int = 0) -> None:
    """Every string encodes as UTF-8 (a lone surrogate such as \\ud800 does not), and the body is
    not nested past any use."""
    if depth > 64:
        raise BadRequest("the body is nested too deeply", None)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"{where} holds text that is not valid Unicode (a lone surrogate)",
                             where.split(".")[0].split("[")[0]) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_strings(k, where, depth + 1)
            check_strings(v, f"{k}" if where == "body" else f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_strings(v, f"{where}[{i}]", depth + 1)


def read_json(raw: bytes):
    """The body as JSON, or a BadRequest that says why not. NaN and Infinity are read (the number
    checks refuse them by field); nesting past Python's recursion limit is refused here."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON ({exc})") from None


def parse_request(body, kind: str, defaults: Defaults, tokenizer=None) -> Request:
    """The request's fields, checked; unset ones take the server's defaults. `tokenizer` (the
    served model's) checks a chat request's template switches."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    check_strings(body)
    table = CHAT if kind == "chat" else COMPLETION
    for name in REQUIRED[kind]:
        if name not in body:
            raise BadRequest(f"'{name}' is required", name)
    got = {name: check(body[name], name) for name, check in table.items() if body.get(name) is not None}
    if got.get("model") and defaults.names and got["model"] not in defaults.names:
        raise BadRequest(f"the model '{got['model']}' does not exist; this server serves '{defaults.names[0]}'",
                         "model", 404, "model_not_found")
    req = Request(kind, sampling(got, body, defaults), stops=got.get("stop", []), stream=got.get("stream", False),
                  include_usage=got.get("stream_options", False))
    if kind == "completion":
        req.prompt, req.think = got["prompt"], False
        req.top_logprobs = got.get("logprobs")
        return req
    messages = got["messages"]
    if defaults.system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": defaults.system}, *messages]
    req.messages = messages
    try:
        switches = request_switches(tokenizer, defaults.switches, {k: got.get(k) for k in TEMPLATE_FIELDS})
    except SwitchError as exc:
        raise BadRequest(str(exc), exc.param) from None
    req.think, req.keep_thinking, req.effort = switches.think, switches.keep_thinking, switches.effort
    if got.get("logprobs"):
        req.top_logprobs = got.get("top_logprobs", 0)
    elif "top_logprobs" in got:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    choice = got.get("tool_choice", "auto")
    tools = got.get("tools")
    if choice != "auto" and choice != "none" and not tools:
        raise BadRequest("'tool_choice' asks for a tool call but 'tools' offers none", "tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise BadRequest(f"'tool_choice' names the function '{name}', which 'tools' does not offer", "tool_choice")
    if tools and choice != "none":
        req.tools, req.types, req.prefix = tools, schema_types(tools), forced_prefix(choice)
        if req.prefix:
            req.think = False      # the reply starts with the call, after an empty thinking block
    return req


def sampling(got: dict, body: dict, defaults: Defaults):
    """The defaults' SamplingParams with the request's own fields over them."""
    base = defaults.params
    pick = {k: got[k] for k in ("temperature", "top_p", "min_p", "presence_penalty", "seed") if k in got}
    if "top_k" in got:
        pick["top_k"] = max(got["top_k"], 0)       # -1, as vLLM spells "off"
    limit = got.get("max_completion_tokens", got.get("max_tokens"))
    if limit is not None:
        pick["max_tokens"] = limit
    eos = () if got.get("ignore_eos") else tuple(base.stop_token_ids or ())
    pick["stop_token_ids"] = eos + tuple(got.get("stop_token_ids", ()))
    return replace(base, **pick)
