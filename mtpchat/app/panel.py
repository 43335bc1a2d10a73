"""The telemetry pane (wide terminals), the one-line status bar (narrow ones) and the header.

Each section is a pure function from the Telemetry and the engine's live settings to its lines
(styled text, built directly rather than parsed from markup: the pane updates twice a second while a
reply streams, and on the CPU every millisecond of the UI is one the decoder waits), so it can be
tested and pinned; the widgets only redraw when `Telemetry.version` moved, and only the lines that
changed.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Union

from textual.containers import VerticalScroll
from textual.content import Content
from textual.geometry import Region, Size
from textual.markup import escape
from textual.strip import Strip
from textual.visual import Visual
from textual.widget import Widget
from textual.widgets import Static

from mtpchat.app.gauges import NA, bar, num, pct, size, sparkline
from mtpchat.app.telemetry import Telemetry

W = 38   # inner width of the pane's lines


@dataclass(frozen=True)
class Live:
    """The engine settings shown next to the numbers."""
    model: str = ""
    device: str = ""
    dtype: str = ""
    mtp: bool = False
    mtp_available: bool = True
    draft_tokens: int = 0
    k_max: int = 0
    thinking: bool = True
    busy: bool = False
    loaded: bool = False
    weights: str = ""          # "FP8" or "int4" when the big products' weights are in it, else "" (the model dtype)
    moe_layers: int = 0        # an MoE model's layers: the speed panel shows the experts a step reads
    fixed: str = ""            # why MTP and the draft count cannot change here (a server's), else ""
    effort: str = ""           # off or the reasoning effort, where the chat template takes one; else ""

    @property
    def mtp_label(self) -> str:
        if self.fixed:
            return "MTP: server's"
        if not self.mtp_available:
            return "MTP n/a"
        return f"MTP on · k={self.draft_tokens}" if self.mtp else "MTP off"


Part = Union[str, tuple[str, str]]   # plain text, or (text, style) as in Textual's markup tags


def row(*parts: Part) -> Content:
    """One line of the pane, its styles given directly: no markup to parse on every update."""
    return Content.assemble(*parts)


def _title(name: str, right: str = "") -> Content:
    pad = W - len(name) - len(right)
    return row((name, "b $accent"), " " * max(pad, 1), (right, "$text-muted"))


def acceptance(t: Telemetry, live: Live) -> list[Content]:
    r, s = t.reply, t.session_live
    lines = [_title("ACCEPTANCE", live.mtp_label)]
    lines.append(row("mean length   ", (f"{num(r.mean_length, '.2f'):>5}", "b"), f"  session {num(s.mean_length, '.2f')}"))
    rate = r.rate
    counts = f"({r.accepted}/{r.drafted})" if r.drafted else ""
    lines.append(row("draft accept  ", (f"{pct(rate):>5}", "b"), f"  {counts}"))
    positions = max(len(r.at_least), live.draft_tokens if live.mtp else 0)
    per = r.per_position
    for i in range(positions):
        p = per[i] if i < len(per) else None
        lines.append(row((f"pos {i + 1}", "$text-muted"), " ", (bar(p or 0.0, W - 11), "$success"), f" {pct(p):>4}"))
    if live.mtp and t.chosen_why:       # adaptive k: the k the last step carried, of at most draft_tokens, and why
        lines.append(row("drafts  ", (f"{t.chosen_k} of {live.draft_tokens}", "b"), " this step"))
        lines += [row((part, "$text-muted")) for part in textwrap.wrap(t.chosen_why, W)]
    hist = sparkline(t.acc_history, W - 8, lo=1.0, hi=float(max(live.k_max, live.draft_tokens, 1) + 1))
    lines.append(row(("history", "$text-muted"), " ", (hist, "$accent")))
    return lines


def speed(t: Telemetry, live: Live) -> list[Content]:
    lines = [_title("SPEED", f"{t.tokens} tok" if t.tokens else "")]
    tps = list(t.tps_history)[-(W - 14):]
    spark = sparkline(tps, W - 14, lo=min(tps) * 0.8 if tps else None)
    lines.append(row("tok/s ", (f"{num(t.tokens_per_s, '.1f'):>6}", "b"), " ", (spark, "$accent")))
    lines.append(row("TTFT  ", (f"{num(t.ttft_ms, '.0f', ' ms'):>9}", "b")))
    if t.prefill_ms is not None and t.prompt_tokens:   # a line of its own: at W cells it is never cut
        # (a server says its prompt's size only at the end of the reply: until then, no line)
        fed = t.prompt_tokens - t.cached_tokens
        lines.append(row(("prompt", "$text-muted"), f" {fed:,} tok prefilled"
                         + (f", {t.cached_tokens:,} reused" if t.cached_tokens else "")))
    phases = t.phase_ms()
    top = max(phases.values()) if phases else 1.0
    for name in ("draft", "verify", "accept", "host"):
        ms = phases[name] if phases else None
        frac = (ms or 0.0) / top if top else 0.0
        lines.append(row((f"{name:<6}", "$text-muted"), " ", (bar(frac, W - 17), "$warning"),
                         f" {num(ms, '6.2f', ' ms'):>9}"))
    if live.moe_layers:         # what MTP costs on an MoE at batch 1: the experts a verify reads
        per = lambda kind: t.experts_per_layer(kind, live.moe_layers)
        lines.append(row(("experts", "$text-muted"), " ", (f"{num(per('decode'), '.1f')}", "b"), " decode · ",
                         (f"{num(per('verify'), '.1f')}", "b"), (" verify /layer", "$text-muted")))
    return lines


def memory(t: Telemetry, live: Live) -> list[Content]:
    if live.fixed:   # the model runs on the server, which reports no memory over the API
        return [_title("MEMORY", "server"), row(("N/A", "b"), "  ", ("the server reports none", "$text-muted"))]
    g = t.gpu
    on_gpu = live.device.startswith("cuda")
    lines = [_title("MEMORY", (g.name or "GPU") if (on_gpu and g) else ("CPU" if not on_gpu else "GPU"))]
    if on_gpu:
        used, total = (g.used, g.total) if g else (None, None)
        frac = used / total if used is not None and total else 0.0
        lines.append(row("used ", (bar(frac, W - 25), "$error"), f" {size(used):>8} / {size(total)}"))
    else:
        lines.append(row("process  ", (size(g.rss if g else None), "b"), "  ", ("resident", "$text-muted")))
    m = t.memory
    if m:
        items = [(f"{live.weights} wts" if live.weights else "weights", m.get("weights")), ("KV", m.get("kv")), ("MTP KV", m.get("mtp_kv")),
                 ("GDN state", m.get("gdn_state")), ("graphs", m.get("graph_pool")), ("workspace", m.get("workspace"))]
        if m.get("snapshots"):   # the decode-state snapshots kept for chat turns (engine/snapshots.py)
            items.append(("turns", m.get("snapshots")))
        for i in range(0, len(items), 2):
            a, *b = items[i:i + 2]
            pair = [(f"{a[0]:<8}", "$text-muted"), f"{size(a[1]):>9}"]
            if b:
                pair += ["  ", (f"{b[0][0]:<10}", "$text-muted"), f"{size(b[0][1]):>9}"]
            lines.append(row(*pair))
    if on_gpu:
        power = num(g.power_w if g else None, '.0f', ' W')
        lines.append(row("power ", (power, "b"), "   energy ", (num(t.joules_per_token, '.2f', ' J/tok'), "b")))
    return lines


def status_line(t: Telemetry, live: Live) -> str:
    parts = [f"[b]{live.mtp_label}[/]", f"{num(t.tokens_per_s, '.1f')} tok/s",
             f"len {num(t.reply.mean_length, '.2f')}", f"acc {pct(t.reply.rate)}",
             f"TTFT {num(t.ttft_ms, '.0f', ' ms')}"]
    g = t.gpu
    if live.device.startswith("cuda"):
        parts.append(f"GPU {size(g.used if g else None)}/{size(g.total if g else None)}")
    elif g and g.rss:
        parts.append(f"RSS {size(g.rss)}")
    return " │ ".join(parts)


def header_line(live: Live, title: str) -> str:
    if not live.loaded:
        state = "connecting to the server…" if live.device == "server" else "loading…"
        return f"[b]mtpchat[/]  {escape(live.model)}  [$text-muted]{state}[/]"
    think = f"thinking {live.effort}" if live.effort else "thinking on" if live.thinking else "thinking off"
    where = f"{live.device} {live.dtype}".strip() + (f" · {live.weights} weights" if live.weights else "")
    return (f"[b]mtpchat[/]  [b $accent]{escape(live.model)}[/]  [$text-muted]{escape(where)}[/]  │  "
            f"[b]{live.mtp_label}[/]  │  {think}  │  [$text-muted]{escape(title)}[/]")


class Lines(Static):
    """A Static that skips the layout pass (a full reflow of the screen) when its height is unchanged."""

    _markup = None

    def show_markup(self, markup: str) -> None:
        if markup == self._markup:
            return
        same_height = self._markup is not None and markup.count("\n") == self._markup.count("\n")
        self._markup = markup
        self.update(markup, layout=not same_height)


class PaneLines(Widget):
    """Styled lines, each rendered once and repainted alone: an update of the pane redraws only the
    lines whose text or styles changed (titles, labels and idle bars stay as they are), with no
    layout pass unless the number of lines changed. Lines are cut at the widget's width, never
    wrapped (the pane's are at most W cells)."""

    DEFAULT_CSS = "PaneLines { height: auto; }"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._lines: list[Content] = []
        self._keys: list[tuple] = []
        self._strips: dict[tuple, Strip] = {}

    def show_lines(self, lines: list[Content]) -> None:
        keys = [(c.plain, tuple(c.spans)) for c in lines]
        old, self._lines, self._keys = self._keys, lines, keys
        if len(keys) != len(old):
            self.refresh(layout=True)
            return
        width = self.size.width
        for y, (new, was) in enumerate(zip(keys, old)):
            if new != was:
                self.refresh(Region(0, y, width, 1))

    @property
    def plain(self) -> str:
        return "\n".join(c.plain for c in self._lines)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._lines)

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return max((c.cell_length for c in self._lines), default=0)

    def on_resize(self) -> None:
        self._strips.clear()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._strips.clear()        # the theme or the styles changed: lines are built again

    def render_line(self, y: int) -> Strip:
        width = self.content_size.width
        if y >= len(self._lines):
            return Strip.blank(width, self.rich_style)
        key = self._keys[y]
        strip = self._strips.get(key)
        if strip is None:
            if len(self._strips) > 256:
                self._strips.clear()
            strips = Visual.to_strips(self, self._lines[y], width, 1, self.visual_style)
            strip = self._strips[key] = strips[0] if strips else Strip.blank(width, self.rich_style)
        return strip


class TelemetryPane(VerticalScroll):
    def compose(self):
        yield PaneLines(id="acceptance", classes="section")
        yield PaneLines(id="speed", classes="section")
        yield PaneLines(id="memory", classes="section")

    def show(self, t: Telemetry, live: Live) -> None:
        self.query_one("#acceptance", PaneLines).show_lines(acceptance(t, live))
        self.query_one("#speed", PaneLines).show_lines(speed(t, live))
        self.query_one("#memory", PaneLines).show_lines(memory(t, live))


class StatusBar(Lines):
    def show(self, t: Telemetry, live: Live) -> None:
        self.show_markup(status_line(t, live))


class HeaderBar(Lines):
    def show(self, live: Live, title: str) -> None:
        self.show_markup(header_line(live, title))


__all__ = ["HeaderBar", "Live", "NA", "PaneLines", "StatusBar", "TelemetryPane"]
