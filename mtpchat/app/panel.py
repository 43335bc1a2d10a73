"""The telemetry pane (wide terminals), the one-line status bar (narrow ones) and the header.

Each section is a pure function from the Telemetry and the engine's live settings to markup, so it
can be tested and pinned; the widgets only redraw when `Telemetry.version` moved.
"""
from __future__ import annotations

from dataclasses import dataclass

from textual.containers import VerticalScroll
from textual.markup import escape
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

    @property
    def mtp_label(self) -> str:
        if not self.mtp_available:
            return "MTP n/a"
        return f"MTP on · k={self.draft_tokens}" if self.mtp else "MTP off"


def _title(name: str, right: str = "") -> str:
    pad = W - len(name) - len(right)
    return f"[b $accent]{name}[/]{' ' * max(pad, 1)}[$text-muted]{escape(right)}[/]"


def acceptance(t: Telemetry, live: Live) -> str:
    r, s = t.reply, t.session_live
    lines = [_title("ACCEPTANCE", live.mtp_label)]
    lines.append(f"mean length   [b]{num(r.mean_length, '.2f'):>5}[/]  session {num(s.mean_length, '.2f')}")
    rate = r.rate
    counts = f"({r.accepted}/{r.drafted})" if r.drafted else ""
    lines.append(f"draft accept  [b]{pct(rate):>5}[/]  {counts}")
    positions = max(len(r.at_least), live.draft_tokens if live.mtp else 0)
    per = r.per_position
    for i in range(positions):
        p = per[i] if i < len(per) else None
        lines.append(f"[$text-muted]pos {i + 1}[/] [$success]{bar(p or 0.0, W - 11)}[/] {pct(p):>4}")
    hist = sparkline(t.acc_history, W - 8, lo=1.0, hi=float(max(live.k_max, live.draft_tokens, 1) + 1))
    lines.append(f"[$text-muted]history[/] [$accent]{hist}[/]")
    return "\n".join(lines)


def speed(t: Telemetry, live: Live) -> str:
    lines = [_title("SPEED", f"{t.tokens} tok" if t.tokens else "")]
    tps = list(t.tps_history)[-(W - 14):]
    spark = sparkline(tps, W - 14, lo=min(tps) * 0.8 if tps else None)
    lines.append(f"tok/s [b]{num(t.tokens_per_s, '.1f'):>6}[/] [$accent]{spark}[/]")
    prompt = f"prefill {t.prompt_tokens} tok" if t.prefill_ms is not None else ""
    lines.append(f"TTFT  [b]{num(t.ttft_ms, '.0f', ' ms'):>9}[/]  [$text-muted]{prompt}[/]")
    phases = t.phase_ms()
    top = max(phases.values()) if phases else 1.0
    for name in ("draft", "verify", "accept", "host"):
        ms = phases[name] if phases else None
        frac = (ms or 0.0) / top if top else 0.0
        lines.append(f"[$text-muted]{name:<6}[/] [$warning]{bar(frac, W - 17)}[/] {num(ms, '6.2f', ' ms'):>9}")
    return "\n".join(lines)


def memory(t: Telemetry, live: Live) -> str:
    g = t.gpu
    on_gpu = live.device.startswith("cuda")
    lines = [_title("MEMORY", (g.name or "GPU") if (on_gpu and g) else ("CPU" if not on_gpu else "GPU"))]
    if on_gpu:
        used, total = (g.used, g.total) if g else (None, None)
        frac = used / total if used is not None and total else 0.0
        lines.append(f"used [$error]{bar(frac, W - 25)}[/] {size(used):>8} / {size(total)}")
    else:
        lines.append(f"process  [b]{size(g.rss if g else None)}[/]  [$text-muted]resident[/]")
    m = t.memory
    if m:
        items = [("weights", m.get("weights")), ("KV", m.get("kv")), ("MTP KV", m.get("mtp_kv")),
                 ("GDN+ring", m.get("gdn_state")), ("graphs", m.get("graph_pool")), ("workspace", m.get("workspace"))]
        for a, b in zip(items[::2], items[1::2]):
            lines.append(f"[$text-muted]{a[0]:<8}[/]{size(a[1]):>9}  [$text-muted]{b[0]:<10}[/]{size(b[1]):>9}")
    if on_gpu:
        power = num(g.power_w if g else None, '.0f', ' W')
        lines.append(f"power [b]{power}[/]   energy [b]{num(t.joules_per_token, '.2f', ' J/tok')}[/]")
    return "\n".join(lines)


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
        return f"[b]mtpchat[/]  {escape(live.model)}  [$text-muted]loading…[/]"
    think = "thinking on" if live.thinking else "thinking off"
    where = f"{live.device} {live.dtype}".strip()
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


class TelemetryPane(VerticalScroll):
    def compose(self):
        yield Lines(id="acceptance", classes="section")
        yield Lines(id="speed", classes="section")
        yield Lines(id="memory", classes="section")

    def show(self, t: Telemetry, live: Live) -> None:
        self.query_one("#acceptance", Lines).show_markup(acceptance(t, live))
        self.query_one("#speed", Lines).show_markup(speed(t, live))
        self.query_one("#memory", Lines).show_markup(memory(t, live))


class StatusBar(Lines):
    def show(self, t: Telemetry, live: Live) -> None:
        self.show_markup(status_line(t, live))


class HeaderBar(Lines):
    def show(self, live: Live, title: str) -> None:
        self.show_markup(header_line(live, title))


__all__ = ["HeaderBar", "Live", "NA", "StatusBar", "TelemetryPane"]
