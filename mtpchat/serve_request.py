"""What a chat completion request asks of `mtpchat serve`, checked: the OpenAI fields this engine
supports, turned into the messages, `SamplingParams` and stop strings a generation takes.

Every field is checked by hand and a bad one is a `BadRequest` (HTTP 400) whose message names it;
an unset sampling field takes the checkpoint's generation_config.json default, as the app does.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtpchat.chat.prompt import Switches, request_switches


class BadRequest(ValueError):
    """A request the API refuses with 400; the message names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Request:
    """One chat completion request, checked and turned into what the engine takes."""
    messages: list[dict]
    params: object                 # engine SamplingParams
    stops: list[str]
    think: bool
    stream: bool
    include_usage: bool
    switches: Switches = Switches()    # the chat template's: thinking, preserve_thinking, reasoning_effort


def _number(body: dict, name: str, kind, lo=None, hi=None, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise BadRequest(f"'{name}' must be a{'n integer' if kind is int else ' number'}, got {value!r}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {value!r}", name)
    return kind(value)


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (other kinds of part are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest(f"{where}.content must be a string or a list of text parts", where)


def parse_request(body, engine, think_default: bool, defaults: Switches | None = None) -> Request:
    """The request's fields, checked; unset sampling fields take the checkpoint's defaults."""
    from mtpchat.engine.sampling import SamplingParams
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list of {role, content}", "messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}] needs a role of system, user, assistant or tool", "messages")
        msg = {"role": m["role"], "content": _text(m.get("content") or "", f"messages[{i}]")}
        thinking = m.get("reasoning_content", m.get("reasoning"))
        if isinstance(thinking, str) and thinking:
            msg["reasoning_content"] = thinking
        messages.append(msg)
    if _number(body, "n", int, 1, 1, 1) != 1:
        raise BadRequest("only n = 1 is served", "n")
    gen = engine.generation_config
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(isinstance(t, int) for t in stop_ids)):
        raise BadRequest("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    eos = () if body.get("ignore_eos") else tuple(engine.stop_ids)
    max_tokens = _number(body, "max_completion_tokens", int, 1, default=None) or \
        _number(body, "max_tokens", int, 1, default=None) or engine.max_context
    # reasoning_effort and chat_template_kwargs over the server's defaults; a bad one is a SwitchError (400)
    switches = request_switches(engine.tokenizer, defaults or Switches(think=think_default), body)
    options = body.get("stream_options") or {}
    params = SamplingParams(
        temperature=_number(body, "temperature", float, 0.0, 2.0, gen.temperature if gen.temperature is not None else 0.0),
        top_p=_number(body, "top_p", float, 0.0, 1.0, gen.top_p if gen.top_p is not None else 1.0) or 1.0,
        top_k=max(_number(body, "top_k", int, -1, default=gen.top_k if gen.top_k is not None else 0), 0),
        min_p=_number(body, "min_p", float, 0.0, 0.999, 0.0),
        presence_penalty=_number(body, "presence_penalty", float, -2.0, 2.0, 0.0),
        max_tokens=max_tokens, seed=_number(body, "seed", int, default=None),
        stop_token_ids=eos + tuple(stop_ids or ()))
    return Request(messages, params, stop, switches.think,
                   bool(body.get("stream", False)), bool(isinstance(options, dict) and options.get("include_usage")),
                   switches)
