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


def wrap_into(lines: list[str], partial: str, text: str, width: int) -> str:
    """Append text to a wrapped body: finished lines go to `lines`; returns the new unfinished line.
    A line breaks after its last space that fits, or mid-word when a word is longer than the line."""
    parts = (partial + text).split("\n")
    for part in parts[:-1]:
        lines.extend(_wrapped(part, width))
    last = _wrapped(parts[-1], width)
    lines.extend(last[:-1])
    return last[-1]


def _wrapped(part: str, width: int) -> list[str]:
    if part.isascii() or cell_len(part) == len(part):   # one cell per character: cut by length
        cells = None
    else:                                                # wide characters (CJK, emoji)
        cells = [cell_len(ch) for ch in part]
    out = []
    while True:
        if cells is None:
            if len(part) <= width:
                break
            fit = width
        else:
            total, fit = 0, 0
            for fit, w in enumerate(cells):
                total += w
                if total > width:
                    break
            else:
                break
            fit = max(fit, 1)
        cut = part.rfind(" ", 0, fit + 1)
        cut = cut if cut > 0 else fit
        rest = part[cut:]
        skip = len(rest) - len(rest.lstrip(" "))
        out.append(part[:cut])
        part = rest[skip:]
        if cells is not None:
            cells = cells[cut + skip:]
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
