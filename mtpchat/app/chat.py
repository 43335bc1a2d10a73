"""The chat pane: a scrolling log of messages and the composer.

A reply streams into `Markdown.get_stream` (it coalesces appends when rendering falls behind); when
the reply ends the stream is stopped (which flushes its tail) and the whole text is rendered once more
with `update`, so constructs that only parse complete (code fences, tables) come out right. Thinking
streams into its own collapsible block and folds away when the answer starts. The log is anchored:
it follows the reply until the user scrolls up, and follows again once they scroll back down.
"""
from __future__ import annotations

import re
import threading

from markdown_it import MarkdownIt
from textual import events
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.widgets import Collapsible, Markdown, Static, TextArea

from mtpchat.app.tail import LiveTail

_parsers = threading.local()


def markdown_parser() -> MarkdownIt:
    """Textual's default parser, built once per thread (it parses in a worker thread on `update`):
    left to itself Textual builds a new one for every streamed append, each paint."""
    parser = getattr(_parsers, "parser", None)
    if parser is None:
        parser = _parsers.parser = MarkdownIt("gfm-like")
    return parser


# how code begins where a reply is code with no fences around it (the demo model's replies are)
_CODE_START = re.compile(r"(def |class |import |from \S+ import |@\w|#!|#include|if __name__|async def |"
                         r"function |const |let |var |public |package |fn |func )")
_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s", re.M)


def bare_code(text: str) -> bool:
    """Whether a reply is code without fences: it starts as code does, or most of its lines past the
    first are indented (and it is no nested list). Markdown would join its lines into a paragraph."""
    if "```" in text or "~~~" in text:
        return False
    lines = [line for line in text.strip("\n").splitlines() if line.strip()]
    if not lines:
        return False
    if _CODE_START.match(lines[0].lstrip()):
        return True
    indented = sum(line.startswith(("    ", "\t")) for line in lines[1:])
    return len(lines) >= 3 and indented * 2 >= len(lines) - 1 and not _LIST_ITEM.search(text)


def as_markdown(text: str) -> str:
    """What the answer's Markdown widget renders: code without fences is fenced, so its line breaks
    and indentation stay as written."""
    return f"```\n{text.strip(chr(10))}\n```" if bare_code(text) else text


def code_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced code blocks, in order, as the Markdown parser finds them: fences of
    any length, indented in lists or quotes, and the open fence of a reply that was stopped (its
    body runs to the end)."""
    return [t.content for t in markdown_parser().parse(markdown) if t.type == "fence"]


def copyable_blocks(text: str) -> list[str]:
    """The code blocks copy-code offers for a message: those the screen shows, so a reply that is code
    without fences is one block."""
    return code_blocks(as_markdown(text))


def tinted(spans) -> Content:
    """Answer text coloured by provenance: accepted drafts vs the target's own tokens."""
    return Content.assemble(*((text, "$success" if draft else "") for text, draft in spans))


def thinking_title(thinking: str) -> str:
    return f"Thinking ({len(thinking.split())} words)"


class MessageView(Vertical, can_focus=True):
    """One message. Focus it (click or tab) to pick it for copying."""

    def __init__(self, role: str, content: str = "", thinking: str = "", spans=None,
                 footer: str = "", tint: bool = False, message_id: int | None = None, thinking_live: bool = False):
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content
        self.thinking = thinking
        self.spans = list(spans) if spans else []
        self.footer = footer
        self.tint = tint and bool(self.spans)
        self.message_id = message_id
        self._streams = {}
        self._answer_started = bool(content)
        self._thinking_live = thinking_live   # a reply that will likely think first: the tail shows from the start
        self._live: LiveTail | None = None
        self.finished = bool(content)         # a streamed reply: once finish() has rendered it whole

    def compose(self):
        if self.role == "assistant":
            with Collapsible(title=thinking_title(self.thinking), collapsed=True, id="thinking") as c:
                c.display = bool(self.thinking)
                yield Markdown(self.thinking, id="think-md", parser_factory=markdown_parser)
            # laid out with the view when the reply is expected to think: then no paint changes the layout
            live = LiveTail("thinking…", id="think-live")
            live.display = self._thinking_live
            yield live
        yield Markdown(as_markdown(self.content), id="answer", parser_factory=markdown_parser)
        yield Static(tinted(self.spans) if self.spans else "", id="tinted")
        yield Static(self.footer, id="footer", markup=False)

    def on_mount(self) -> None:
        self._apply_tint()

    def _apply_tint(self) -> None:
        tint = self.tint and bool(self.spans)
        self.query_one("#answer").display = not tint
        self.query_one("#tinted").display = tint

    def set_tint(self, on: bool) -> None:
        self.tint = on
        if on and self.spans:
            self.query_one("#tinted", Static).update(tinted(self.spans))
        self._apply_tint()

    def set_footer(self, text: str) -> None:
        self.footer = text
        self.query_one("#footer", Static).update(text)

    def _stream(self, wid: str):
        if wid not in self._streams:
            self._streams[wid] = Markdown.get_stream(self.query_one(f"#{wid}", Markdown))
        return self._streams[wid]

    async def write(self, thinking: str, answer: str, spans) -> None:
        if thinking:
            # while it streams, thinking shows as its last few lines: a cost per paint that does not
            # grow with its length; the whole of it is rendered once, folded, when the answer starts
            self.thinking += thinking
            if self._live is None:
                self._live = self.query_one("#think-live", LiveTail)
                self._live.display = True
            self._live.append(thinking)
        if answer:
            if not self._answer_started:
                self._answer_started = True
                if self.thinking:
                    await self._fold_thinking()
            self.content += answer
            self.spans.extend(spans)
            if self.tint:
                self.query_one("#tinted", Static).update(tinted(self.spans))
                self._apply_tint()
            else:
                if self.content == answer and _CODE_START.match(answer.lstrip()):
                    answer = "```\n" + answer      # streams as code; finish() renders it whole
                await self._stream("answer").write(answer)

    async def _fold_thinking(self) -> None:
        self.query_one("#think-live").display = False
        self._live = None
        box = self.query_one("#thinking", Collapsible)
        await self.query_one("#think-md", Markdown).update(self.thinking)
        box.title = thinking_title(self.thinking)
        box.collapsed = True
        box.display = True

    async def finish(self, content: str, thinking: str, spans, footer: str) -> None:
        """Stop the streams (flushing their tails) and render the whole reply once."""
        for stream in self._streams.values():
            await stream.stop()
        self._streams.clear()
        self.content, self.thinking, self.spans = content, thinking, list(spans)
        await self.query_one("#answer", Markdown).update(as_markdown(content))
        if self.role == "assistant":
            if thinking:
                await self._fold_thinking()
            else:
                self.query_one("#thinking").display = False
                self.query_one("#think-live").display = False
        if self.spans:
            self.query_one("#tinted", Static).update(tinted(self.spans))
        self._apply_tint()
        self.set_footer(footer)
        self.finished = True


class ChatLog(VerticalScroll):
    def on_mount(self) -> None:
        self.anchor()

    async def add(self, view: MessageView) -> MessageView:
        await self.mount(view)
        return view

    async def clear(self) -> None:
        await self.remove_children()
        self.anchor()

    def views(self) -> list[MessageView]:
        return list(self.query(MessageView))


class Composer(TextArea):
    """Enter sends; ctrl+j (which every terminal passes through) or shift+enter adds a newline."""

    BINDINGS = [
        Binding("enter", "submit", "Send", id="send", show=False, priority=True),
        Binding("ctrl+j,shift+enter", "newline", "Newline", id="newline", show=False, priority=True),
    ]

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    class EditLast(Message):
        """Up arrow in an empty composer: take the last exchange back for editing."""

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         compact=True, highlight_cursor_line=False, **kwargs)

    def action_submit(self) -> None:
        text = self.text
        if text.strip():
            self.post_message(self.Submitted(text))

    def action_newline(self) -> None:
        self.insert("\n")

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "up" and not self.text:
            event.stop()
            event.prevent_default()
            self.post_message(self.EditLast())
            return
        await super()._on_key(event)
