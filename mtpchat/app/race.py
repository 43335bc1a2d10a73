"""Race: the last prompt again with MTP off, then on, side by side, and the speedup.

The runs are sequential (one engine, one stream), so each gets the whole device. Tokens/s is the
engine's own decode rate (prefill excluded), the same figure `mtpchat run` reports.
"""
from __future__ import annotations

from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Static

LANES = ("race:off", "race:on")


def speedup_line(off, on) -> str:
    """Markup comparing the two runs' Stats (either may still be None)."""
    if off is None or on is None:
        return "[$text-muted]racing…[/]"
    if not off.tokens_per_s or not on.tokens_per_s:
        return "[$warning]too few tokens to compare speeds[/]"
    x = on.tokens_per_s / off.tokens_per_s
    return (f"[b]speedup {x:.2f}×[/]   {off.tokens_per_s:.1f} → {on.tokens_per_s:.1f} tok/s   "
            f"mean acceptance length {on.mean_acceptance_length:.2f}")


class RaceLane(Vertical):
    def __init__(self, title: str, lane: str):
        super().__init__(classes="lane", id=lane.replace(":", "-"))
        self.title_text = title
        self.thinking = ""
        self.answer = ""

    def compose(self):
        yield Static(f"[b]{self.title_text}[/]", classes="lane-title")
        with VerticalScroll(classes="lane-body") as body:
            body.anchor()
            yield Static("", classes="lane-text")
        yield Static("[$text-muted]waiting…[/]", classes="lane-stats")

    def write(self, thinking: str, answer: str) -> None:
        self.thinking += thinking
        self.answer += answer
        text = Content.assemble((self.thinking, "$text-muted italic"), "\n\n" if self.thinking and self.answer else "",
                                self.answer)
        self.query_one(".lane-text", Static).update(text)

    def set_stats(self, markup: str) -> None:
        self.query_one(".lane-stats", Static).update(markup)


class RaceScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop_or_close", "Stop / close", id="race.close"),
        Binding("q", "close", "Close", id="race.quit"),
    ]

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        self.stats = {lane: None for lane in LANES}
        self.done = False

    def compose(self):
        yield Static("[b]Race[/]  the last prompt, MTP off then on, greedy: the same reply on both sides",
                     id="race-title")
        with Horizontal(id="lanes"):
            yield RaceLane("MTP off", LANES[0])
            yield RaceLane(f"MTP on · k={self.k}", LANES[1])
        yield Static(speedup_line(None, None), id="race-result")
        yield Footer()

    def lane(self, target: str) -> RaceLane:
        return self.query_one(f"#{target.replace(':', '-')}", RaceLane)

    def finish_lane(self, target: str, stats, reason: str) -> None:
        self.stats[target] = stats
        tps = f"{stats.tokens_per_s:.1f} tok/s" if stats and stats.tokens_per_s else "— tok/s"
        extra = f" · {reason}" if reason not in ("stop", "length") else ""
        n = stats.new_tokens if stats else 0
        self.lane(target).set_stats(f"[b]{tps}[/] · {n} tokens · TTFT "
                                    f"{(stats.ttft_ms if stats else 0):.0f} ms{extra}")
        self.query_one("#race-result", Static).update(speedup_line(*(self.stats[x] for x in LANES)))

    def fail(self, text: str) -> None:
        self.done = True
        self.query_one("#race-result", Static).update(f"[$error]{text}[/]")

    def action_stop_or_close(self) -> None:
        if self.done:
            self.action_close()
        else:
            self.app.action_stop()

    def action_close(self) -> None:
        self.app.action_stop()
        self.dismiss()
