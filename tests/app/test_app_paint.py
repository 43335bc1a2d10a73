"""What keeps streaming cheap: the live tail's incremental wrapping, the pane's line-by-line repaints
and the paint pacing."""
from __future__ import annotations

import pytest
from rich.cells import cell_len
from textual.app import App

from mtpchat.app.pacer import LIVE_INTERVAL, MAX_INTERVAL, MIN_INTERVAL, Pacer
from mtpchat.app.panel import PaneLines, row
from mtpchat.app.tail import LiveTail, wrap_into
from apphelpers import run


def wrapped(text: str, width: int, pieces: int = 1) -> list[str]:
    lines, partial = [], ""
    step = max(1, len(text) // pieces)
    for i in range(0, len(text), step):
        partial = wrap_into(lines, partial, text[i:i + step], width)
    return lines + [partial]


def test_wrapping_breaks_at_spaces_and_inside_words_too_long_for_a_line():
    assert wrapped("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]
    assert wrapped("abcdefghijklmnop xy", 6) == ["abcdef", "ghijkl", "mnop", "xy"]
    assert wrapped("one\n\ntwo three", 20) == ["one", "", "two three"]


def test_wrapping_in_pieces_matches_wrapping_at_once():
    text = "Speculative decoding drafts a few tokens, then verifies them all in one pass. " * 12 + "\nend"
    assert wrapped(text, 37, pieces=1) == wrapped(text, 37, pieces=29) == wrapped(text, 37, pieces=len(text))


def test_wrapping_counts_cells_for_wide_characters():
    lines = wrapped("思考过程很长的文本需要换行 then ascii words after it", 10)
    assert all(cell_len(line) <= 10 for line in lines)
    assert "".join(lines).replace(" ", "") == "思考过程很长的文本需要换行thenasciiwordsafterit"


class TailApp(App):
    CSS = "LiveTail { height: 3; width: 24; }"

    def compose(self):
        yield LiveTail("thinking…")


def shown(tail: LiveTail) -> list[str]:
    return [tail.render_line(y).text.rstrip() for y in range(3)]


def test_live_tail_shows_the_last_lines_as_text_arrives():
    async def go():
        app = TailApp()
        async with app.run_test(size=(40, 10)) as pilot:
            tail = app.query_one(LiveTail)
            assert shown(tail) == ["thinking…", "", ""]
            words = [f"word{i}" for i in range(40)]
            for w in words:
                tail.append(w + " ")
            await pilot.pause()
            rows = shown(tail)
            assert rows[-1].split()[-1] == "word39" and all(len(r) <= 24 for r in rows)
            # the three rows are the end of the text, in order
            assert " ".join(" ".join(rows).split()) in " ".join(words)
            tail.append("a\x1b[31mred\tend\r\n")   # control characters never reach the terminal
            await pilot.pause()
            rows = shown(tail)
            assert " ".join(rows).split()[-3:] == ["word39", "a[31mred", "end"] and rows[-1] == ""
    run(go())


class PaneApp(App):
    CSS = "PaneLines { width: 30; }"

    def compose(self):
        yield PaneLines()


def test_pane_lines_repaint_only_what_changed_and_lay_out_only_when_the_count_does():
    async def go():
        app = PaneApp()
        async with app.run_test(size=(40, 10)) as pilot:
            lines = app.query_one(PaneLines)
            painted = []
            render = lines.render_line
            lines.render_line = lambda y: (painted.append(y), render(y))[1]
            first = [row(("SPEED", "b $accent")), row("tok/s ", ("912.3", "b")), row(("host", "$text-muted"), " 0.02")]
            lines.show_lines(first)
            await pilot.pause()
            assert lines.size.height == 3 and lines.plain == "SPEED\ntok/s 912.3\nhost 0.02"
            assert [lines.render_line(y).text.rstrip() for y in range(3)] == ["SPEED", "tok/s 912.3", "host 0.02"]
            painted.clear()
            lines.show_lines([first[0], row("tok/s ", ("915.0", "b")), first[2]])
            assert not lines._layout_required
            await pilot.pause()
            assert set(painted) == {1} and lines.render_line(1).text.rstrip() == "tok/s 915.0"
            # same text, another style: that line repaints too
            painted.clear()
            lines.show_lines([first[0], row("tok/s ", ("915.0", "i")), first[2]])
            await pilot.pause()
            assert set(painted) == {1}
            lines.show_lines(first + [row("one more")])
            assert lines._layout_required
            await pilot.pause()
            assert lines.size.height == 4 and lines.plain.endswith("one more")
    run(go())


def fake_pacer(cost_per_paint: float, **kw) -> Pacer:
    clock = {"wall": 0.0, "cpu": 0.0}
    pacer = Pacer(cpu=lambda: clock["cpu"], clock=lambda: clock["wall"], **kw)
    for _ in range(60):              # paint whenever due, each paint costing `cost_per_paint`
        clock["wall"] = pacer.next_at
        clock["cpu"] += cost_per_paint
        pacer.painted()
    return pacer


@pytest.mark.parametrize("cost, interval", [
    (0.0002, MIN_INTERVAL),          # cheap paints: as smooth as it gets
    (0.001, 0.05),                   # budget-bound: 2% of the wall time
    (0.003, LIVE_INTERVAL),          # over budget, but 10 Hz still costs less than the cap
    (0.012, 0.3),                    # 10 Hz would cost 12%: spread out to hold 4%
    (0.5, MAX_INTERVAL),
])
def test_pacer_holds_the_budget_keeps_text_live_and_caps_the_cost(cost, interval):
    assert fake_pacer(cost).interval == pytest.approx(interval, rel=0.02)
