"""The prompt of a chat turn: the conversation rendered by the model's chat template, and where the
rendered conversation ends in it, the position whose decode state a later turn resumes from
(engine/snapshots.py).

The template's switches: `enable_thinking` (every Qwen template), `preserve_thinking` (Qwen3.6's and
Qwen3.8's: earlier replies' thinking kept in the prompt; Qwen3.8's keeps it unless told otherwise)
and `reasoning_effort` (Qwen3.8's: xhigh, medium or low). A switch is passed only to a template that
reads it; what a template does not take, or a level it does not accept, is refused here in one line
that names the switch, before anything renders. The levels a template accepts are found by
rendering a one-message chat with each known level: the template's own check decides.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

EFFORT_LEVELS = ("minimal", "low", "medium", "high", "xhigh")   # the names templates use, least first
APP_EFFORTS = ("off", "low", "medium", "xhigh")                # the app's key cycles these; off = no thinking
TEMPLATE_KWARGS = ("enable_thinking", "preserve_thinking", "reasoning_effort")

_PROBE = [{"role": "user", "content": "hi"}]
_PROBE_HISTORY = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r7"},
                  {"role": "user", "content": "c"}]
_probed: dict[tuple[str, str], object] = {}   # (template text, question) -> answer


class SwitchError(ValueError):
    """A template switch this template does not take, or a value it does not accept; `param` names
    the field (a request's, for a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Switches:
    """The chat template's switches for one prompt; None = the template's own default."""
    think: bool = True
    keep_thinking: bool | None = None     # preserve_thinking
    effort: str | None = None             # reasoning_effort


def _template(tokenizer) -> str:
    return getattr(tokenizer, "chat_template", None) or ""


def offers_preserve_thinking(tokenizer) -> bool:
    """Whether the chat template reads `preserve_thinking` (Qwen3.6's keeps earlier turns' thinking with it)."""
    return "preserve_thinking" in _template(tokenizer)


def offers_reasoning_effort(tokenizer) -> bool:
    """Whether the chat template reads `reasoning_effort` (Qwen3.8's)."""
    return "reasoning_effort" in _template(tokenizer)


def _probe(tokenizer, question: str, render):
    key = (_template(tokenizer), question)
    if key not in _probed:
        _probed[key] = render()
    return _probed[key]


def reasoning_efforts(tokenizer) -> tuple[str, ...]:
    """The levels of EFFORT_LEVELS the template accepts (none where it has no reasoning_effort)."""
    if not offers_reasoning_effort(tokenizer):
        return ()

    def accepted(level: str) -> bool:
        try:
            tokenizer.apply_chat_template(_PROBE, enable_thinking=True, reasoning_effort=level)
        except ValueError:          # the template raised (TokenizerError): a level it refuses
            return False
        return True
    return _probe(tokenizer, "efforts", lambda: tuple(x for x in EFFORT_LEVELS if accepted(x)))


def keeps_thinking_by_default(tokenizer) -> bool:
    """Whether the template keeps an earlier reply's thinking when preserve_thinking is not passed
    (Qwen3.8's does, Qwen3.6's does not)."""
    if not offers_preserve_thinking(tokenizer):
        return False
    def keeps():
        try:
            ids = tokenizer.apply_chat_template(_PROBE_HISTORY, add_generation_prompt=False, enable_thinking=True)
        except ValueError:
            return False
        return "r7" in tokenizer.decode(ids)
    return _probe(tokenizer, "keeps", keeps)


def default_effort(tokenizer) -> str | None:
    """The level the template takes when none is passed: the one that renders the same (Qwen3.8's: xhigh)."""
    def find():
        plain = tokenizer.apply_chat_template(_PROBE, enable_thinking=True)
        return next((x for x in reasoning_efforts(tokenizer)
                     if tokenizer.apply_chat_template(_PROBE, enable_thinking=True, reasoning_effort=x) == plain), None)
    return _probe(tokenizer, "default effort", find) if reasoning_efforts(tokenizer) else None


def check_effort(tokenizer, effort: str | None, name: str = "reasoning_effort", param: str | None = None) -> None:
    """Refuse a reasoning effort the template does not take, in one line naming `name` (the field
    `param`, where that is another)."""
    if effort is None:
        return
    levels = reasoning_efforts(tokenizer)
    if not levels:
        raise SwitchError(f"{name} {effort!r}: this model's chat template has no reasoning_effort "
                          "(only thinking on or off)", param or name)
    if effort not in levels:
        raise SwitchError(f"{name} {effort!r}: this model's chat template takes {', '.join(levels)}", param or name)


def template_kwargs(tokenizer, switches: Switches) -> dict:
    """The keyword arguments of the template's switches that this template reads."""
    kw = {}
    if switches.keep_thinking is not None and offers_preserve_thinking(tokenizer):
        kw["preserve_thinking"] = switches.keep_thinking
    if switches.effort is not None:
        check_effort(tokenizer, switches.effort)
        kw["reasoning_effort"] = switches.effort
    return kw


def build_prompt(tokenizer, messages: list[dict], think: bool, keep_thinking: bool | None = None,
                 effort: str | None = None, tools: list[dict] | None = None,
                 prefix: str = "") -> tuple[list[int], tuple]:
    """The prompt ids for the next reply, and the positions worth a snapshot of the decode state
    (engine/snapshots.py): where the rendered conversation ends, before the generation prompt. The
    next turn's prompt goes on from there even when the template drops this reply's thinking.

    keep_thinking and effort: None leaves the template's default. `tools` (OpenAI function
    definitions) are rendered by the template; `prefix` is text the reply starts with, written for
    the model (chat/tools.py forced_prefix)."""
    extra = template_kwargs(tokenizer, Switches(think, keep_thinking, effort))
    if tools:
        extra["tools"] = tools
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=think, **extra))
    history = list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, enable_thinking=think, **extra))
    if prefix:
        ids += tokenizer.encode(prefix)
    return ids, ((len(history),) if 0 < len(history) < len(ids) and ids[:len(history)] == history else ())


def effort_label(tokenizer, think: bool, effort: str | None) -> str:
    """The app's level: off, or the effort (the template's default where none is set); "" where the
    template takes no effort."""
    if not reasoning_efforts(tokenizer):
        return ""
    return "off" if not think else (effort or default_effort(tokenizer) or "default")


def next_effort(tokenizer, think: bool, effort: str | None) -> tuple[bool, str | None]:
    """The app's key: off -> low -> medium -> xhigh -> off, over the levels this template accepts
    (no effort set counts as the template's default). Returns (think, effort)."""
    levels = [x for x in APP_EFFORTS[1:] if x in reasoning_efforts(tokenizer)]
    cycle = ["off"] + levels
    now = "off" if not think else (effort or default_effort(tokenizer))
    after = cycle[(cycle.index(now) + 1) % len(cycle)] if now in cycle else "off"
    return (False, effort) if after == "off" else (True, after)


def request_switches(tokenizer, defaults: Switches, body: dict) -> Switches:
    """A chat request's switches over the server's defaults: the top-level `reasoning_effort` (as
    vLLM and SGLang take it) and `chat_template_kwargs` {enable_thinking, preserve_thinking,
    reasoning_effort}; the kwargs' effort wins over the top-level one. Raises SwitchError naming
    the field for anything else in chat_template_kwargs, a value of the wrong type, or an effort the
    template does not accept."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise SwitchError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    unknown = sorted(k for k in kwargs if k not in TEMPLATE_KWARGS)
    if unknown:
        raise SwitchError(f"chat_template_kwargs: {', '.join(map(repr, unknown))} not supported "
                          f"(this server takes {', '.join(TEMPLATE_KWARGS)})", "chat_template_kwargs")
    out = defaults
    for name, field in (("enable_thinking", "think"), ("preserve_thinking", "keep_thinking")):
        if kwargs.get(name) is not None:
            if not isinstance(kwargs[name], bool):
                raise SwitchError(f"chat_template_kwargs.{name} must be true or false, got {kwargs[name]!r}",
                                  "chat_template_kwargs")
            out = replace(out, **{field: kwargs[name]})
    for value, param in ((body.get("reasoning_effort"), "reasoning_effort"),
                         (kwargs.get("reasoning_effort"), "chat_template_kwargs")):
        if value is None:
            continue
        if not isinstance(value, str):
            raise SwitchError(f"{param} must be a string, got {value!r}", param)
        check_effort(tokenizer, value, param if param == "reasoning_effort" else f"{param}.reasoning_effort", param)
        out = replace(out, effort=value)
    return out


def fewest_tokens(tokenizer, texts) -> int:
    """A lower bound on the tokens of these texts, known without encoding them: a text of n bytes
    is at least n / (the longest token's bytes) tokens. 0 where the tokenizer does not say."""
    longest = getattr(tokenizer, "longest_token", None)
    if not isinstance(longest, int) or longest < 1:
        return 0
    return sum(len(t.encode("utf-8", "replace")) for t in texts) // longest
