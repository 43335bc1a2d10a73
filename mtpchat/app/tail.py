"""The live tail of a streaming text: its last few lines, wrapped as the text arrives.

Thinking streams fast (a thousand tokens a second on a small model) and is shown as its last lines
at a fixed height. A Static would re-wrap the whole tail and rebuild every line on each paint; this
widget wraps only the new text and builds each finished line once, so a paint costs about one new
line's work plus Textual's fixed cost of a frame. Its height never changes: no paint needs a layout.
"""
from __future__ import annotations

from rich.cells import cell_len
from rich.segment import Segment
from textual.strip import Strip
from textual.widget import Widget

# control characters would reach the terminal as they are: tabs become spaces, the rest go
_CLEAN = {c: None for c in (*range(32), 127)} | {ord("\t"): " ", ord("\n"): "\n"}


def _cut(part: str, width: int) -> int:
    """Where a line longer than `width` cells breaks: after the last space that fits, else mid-word."""
    if part.isascii():
        fit = width
    else:
        fit, cells = 0, 0
        for fit, ch in enumerate(part):
            cells += cell_len(ch)
            if cells > width:
                break
        fit = max(fit, 1)
    cut = part.rfind(" ", 0, fit + 1)
    return cut if cut > 0 else fit


def wrap_into(lines: list[str], partial: str, text: str, width: int) -> str:
    """Append text to a wrapped body: finished lines go to `lines`; returns the new unfinished line."""
    parts = (partial + text).split("\n")
    for part in parts[:-1]:
        lines.extend(_wrapped(part, width))
    last = _wrapped(parts[-1], width)
    lines.extend(last[:-1])
    return last[-1]


def _wrapped(part: str, width: int) -> list[str]:
    out = []
    while (len(part) if part.isascii() else cell_len(part)) > width:
        cut = _cut(part, width)
        out.append(part[:cut])
        part = part[cut:].lstrip(" ")
    out.append(part)
    return out


class LiveTail(Widget):
    """Shows the last lines (as many as its height) of the text given to `append`."""

    def __init__(self, placeholder: str = "", **kwargs):
        super().__init__(**kwargs)
        self.placeholder = placeholder
        self._text = ""             # enough of the tail to re-wrap it after a resize
        self._lines: list[str] = []
        self._partial = ""
        self._width = 0
        self._rows = 1
        self._keep = 4000
        self._strips: dict[str, Strip] = {}
        self._style = None

    @property
    def text(self) -> str:
        return self._text

    def append(self, text: str) -> None:
        if not text.isprintable():
            text = text.translate(_CLEAN)
        if not text:
            return
        self._text = (self._text + text)[-self._keep:]
        if self._width:
            self._partial = wrap_into(self._lines, self._partial, text, self._width)
            del self._lines[:-self._rows]
        self.refresh()

    def on_resize(self) -> None:
        self._rows = max(self.size.height, 1)
        # characters that surely fill the box; a wider terminal after a resize re-wraps from these
        self._keep = max(4000, 2 * self.size.width * self._rows)
        width = self.content_size.width
        if width != self._width:
            self._width = width
            self._strips.clear()
            self._lines, self._partial = [], ""
            if width:
                self._partial = wrap_into(self._lines, "", self._text, width)
                del self._lines[:-self._rows]
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._style = None           # the theme or the styles changed: lines are built again

    def render_line(self, y: int) -> Strip:
        if self._style is None:
            self._style = self.rich_style   # walks the ancestors: once, not per line
            self._strips.clear()
        if not self._text:
            shown = [self.placeholder] if self.placeholder else []
        else:
            shown = [*self._lines, self._partial][-self._rows:]
        text = shown[y] if y < len(shown) else ""
        strip = self._strips.get(text)
        if strip is None:
            if len(self._strips) > 256:
                self._strips.clear()
            style = self._style
            strip = Strip([Segment(text, style)], cell_len(text)).extend_cell_length(self._width, style)
            self._strips[text] = strip
        return strip
