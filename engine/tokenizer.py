"""Text <-> token ids: tokenizer.json through `tokenizers`, the chat template through jinja2's sandbox
rendered the way transformers renders it.

Contract: the engine sees ids; the app owns text. Text a person wrote never becomes a control token:
`encode` treats every string as plain text, and in a chat only the template's own markup becomes
special ids, while "<|im_end|>" or "<think>" typed inside a message stay the characters they are.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
BUNDLED_TEMPLATE = Path(__file__).with_name(TEMPLATE_FILE)

# Qwen's added tokens, in the order their ids follow the BPE vocabulary; True = special (skipped by
# decode(skip_special_tokens=True)). The think and tool markers are plain added tokens, as Qwen marks them.
QWEN_ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]

# Fields of a message that hold text someone wrote (transformers reads reasoning under all three names).
_TEXT_FIELDS = ("content", "reasoning_content", "thinking", "reasoning")
# Placeholders for added-token strings found inside message text: Supplementary Private Use Area-A.
_PLACEHOLDER_BASE = 0xF0000


class TokenizerError(ValueError):
    """The tokenizer files are missing or unusable, or a conversation cannot be rendered."""


class Tokenizer:
    def __init__(self, tok: tokenizers.Tokenizer, chat_template: str | None = None, config: dict | None = None):
        self._tok = tok
        self._tok.no_padding()
        self._tok.no_truncation()
        # A copy with no added tokens at all: encoding through it can only ever produce BPE ids.
        spec = json.loads(tok.to_str())
        spec["added_tokens"] = []
        self._plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
        self.config = config or {}
        self.chat_template = chat_template if chat_template is not None else BUNDLED_TEMPLATE.read_text()
        # Qwen3.5/3.6's templates take an answer's leading <think>…</think> as its reasoning; Qwen3.8's
        # read reasoning_content only, and inline tags stay the text they are
        self._inline_think = bool(re.search(r"""split\(\s*['"]</think>""", self.chat_template))
        self._compiled = None
        self._longest: int | None = None
        self._added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
        # Longest first: Python's alternation is leftmost-first, this makes it leftmost-longest like tokenizers.
        alternatives = sorted(self._added, key=len, reverse=True)
        self._added_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{folder} has no {TOKENIZER_FILE}; the checkpoint is incomplete, download it again.")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path} could not be read ({e}); the file is damaged, download it again.") from e
        config = {}
        config_path = folder / CONFIG_FILE
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except ValueError as e:
                raise TokenizerError(f"{config_path} is not valid JSON ({e}); download it again.") from e
        template = None
        if (folder / TEMPLATE_FILE).is_file():
            template = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # older form: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
            template = named.get("default")
        return cls(tok, template, config)

    # -- plain text ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token strings in `text` are encoded as ordinary characters. No BOS."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = False) -> TextStream:
        return TextStream(self._tok, skip_special_tokens)

    # -- special ids -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def longest_token(self) -> int:
        """Characters of the longest vocabulary entry (bytes, for a byte-level BPE): a text of n
        bytes is at least n / longest_token tokens, a bound known before encoding it."""
        if self._longest is None:
            self._longest = max((len(t) for t in self._tok.get_vocab(with_added_tokens=False)), default=1)
        return self._longest

    @property
    def added_token_ids(self) -> list[int]:
        """The ids of the added tokens (the chat template's markers and Qwen's special tokens)."""
        return sorted(self._added.values())

    @property
    def im_start_id(self) -> int | None:
        return self._tok.token_to_id("<|im_start|>")

    @property
    def im_end_id(self) -> int | None:
        return self._tok.token_to_id("<|im_end|>")

    @property
    def endoftext_id(self) -> int | None:
        return self._tok.token_to_id("<|endoftext|>")

    @property
    def think_start_id(self) -> int | None:
        return self._tok.token_to_id("<think>")

    @property
    def think_end_id(self) -> int | None:
        return self._tok.token_to_id("</think>")

    @property
    def eos_token_ids(self) -> list[int]:
        # Qwen's generation_config stops on both: <|im_end|> ends a turn, <|endoftext|> ends a document.
        return [i for i in (self.im_end_id, self.endoftext_id) if i is not None]

    # -- chat ------------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = True,
                    tools: list[dict] | None = None, **kw) -> str:
        pieces = self._render(messages, add_generation_prompt, enable_thinking, tools, kw)
        return "".join(text for text, _ in pieces)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = True, tools: list[dict] | None = None, **kw) -> list[int]:
        ids = []
        for text, markup in self._render(messages, add_generation_prompt, enable_thinking, tools, kw):
            if markup:
                ids.append(self._added[text])
            elif text:
                ids.extend(self._plain.encode(text, add_special_tokens=False).ids)
        return ids

    def _render(self, messages, add_generation_prompt, enable_thinking, tools, kw) -> list[tuple[str, bool]]:
        """The rendered chat as (text, is_markup) pieces; markup pieces are exactly one added token.

        Added-token strings inside message text are swapped for private-use placeholders before
        rendering, so every added token left in the output was written by the template. The output is
        then cut where tokenizers would cut it (at added tokens) and the placeholders are put back:
        the plain pieces are encoded exactly as transformers encodes them, minus the injection.
        """
        messages = [_split_reasoning(dict(m), self._inline_think) for m in messages]
        placeholders = self._placeholders(messages, tools, kw)
        for m in messages:
            for field in _TEXT_FIELDS:
                if field in m:
                    m[field] = self._defuse(m[field], placeholders)
        variables = {k: v for k, v in self._special_token_strings().items() if k not in kw}
        try:
            rendered = self._template().render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                               enable_thinking=enable_thinking, **variables, **kw)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template could not render this conversation: {e}") from e
        restore = str.maketrans({c: s for s, c in placeholders.items()})
        pieces, pos = [], 0
        for match in self._added_re.finditer(rendered) if self._added_re else ():
            pieces += [(rendered[pos:match.start()].translate(restore), False), (match.group(), True)]
            pos = match.end()
        pieces.append((rendered[pos:].translate(restore), False))
        return pieces

    def _placeholders(self, messages, tools, kw) -> dict[str, str]:
        """One private-use character per added token, none of which occurs anywhere in the input."""
        seen = set()
        for value in (messages, tools, kw):
            for s in _strings(value):
                seen.update(s)
        chars = (chr(c) for c in range(_PLACEHOLDER_BASE, 0x10FFFE) if chr(c) not in seen)
        return dict(zip(self._added, chars))

    def _defuse(self, value, placeholders):
        if isinstance(value, str) and self._added_re is not None:
            return self._added_re.sub(lambda m: placeholders[m.group()], value)
        if isinstance(value, list):  # content parts: [{"type": "text", "text": ...}, ...]
            return [{**p, "text": self._defuse(p["text"], placeholders)} if isinstance(p, dict) and "text" in p else p
                    for p in value]
        return value

    def _special_token_strings(self) -> dict[str, str]:
        # transformers hands the template its special-token strings (bos_token, eos_token, ...).
        out = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = self.config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
        return out

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"the chat template does not parse: {e}") from e
        return self._compiled


class TextStream:
    """Incremental detokenizer for accepted ids; holds back bytes of a character that is not complete yet."""

    def __init__(self, tok: tokenizers.Tokenizer, skip_special_tokens: bool = False):
        self._tok = tok
        self._skip = skip_special_tokens
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = 0  # characters returned so far

    def push(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        if not ids:
            return ""
        self._ids += ids
        text = self._stream.step(self._tok, ids) or ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD)."""
        full = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        tail = full[self._emitted:]
        self._emitted = len(full)
        return tail


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Same environment as transformers' chat templates, so checkpoint templates render identically.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _split_reasoning(m: dict, inline: bool = True) -> dict:
    """Move an assistant answer's leading <think>…</think> into reasoning_content, as Qwen3.5/3.6's
    template does (`inline`: the template splits content at </think>).

    Done before rendering because the template can no longer see the tags once message text is defused.
    """
    for alias in ("thinking", "reasoning"):  # transformers' aliases
        if not isinstance(m.get("reasoning_content"), str) and isinstance(m.get(alias), str):
            m["reasoning_content"] = m[alias]
    content = m.get("content")
    if (inline and m.get("role") == "assistant" and isinstance(content, str) and "</think>" in content
            and not isinstance(m.get("reasoning_content"), str)):
        head, _, _ = content.partition("</think>")
        m["reasoning_content"] = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
        m["content"] = content.split("</think>")[-1].lstrip("\n")
    return m


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
