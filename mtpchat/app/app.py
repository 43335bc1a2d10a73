"""The chat app: layout, engine loading, the generation worker and what its messages do.

The engine runs on one thread worker at a time. The app never starts a generation while the last
one's thread is still running: `busy` clears only when the worker says it has ended
(`GenerationEnded`), and an action that needs the engine while busy stops the reply and runs after.
"""
from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from textual import work
from textual.app import App
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.widgets import Footer, ProgressBar, Static
from textual.worker import get_current_worker

from mtpchat.app.actions import ChatActions
from mtpchat.app.chat import ChatLog, Composer, MessageView
from mtpchat.app.commands import BINDINGS
from mtpchat.app.errors import NO_MTP, describe_error
from mtpchat.app.gpu import NvmlProbe, ProcessProbe, Sampler
from mtpchat.app.messages import (EngineFailed, EngineReady, EngineWaiting, GpuSampled, LoadProgressed, ReplyDelta,
                                  ReplyDone, ReplyFailed, ReplyPrefilled)
from mtpchat.app.pacer import PANE_INTERVAL, Pacer
from mtpchat.app.panel import HeaderBar, Live, StatusBar, TelemetryPane
from mtpchat.app.race import RaceScreen
from mtpchat.app.runner import drive
from mtpchat.app.settings import Sampling
from mtpchat.app.store import Store, encode_spans
from mtpchat.app.telemetry import Telemetry
from mtpchat.chat.prompt import SwitchError, build_prompt, check_effort, effort_label
from mtpchat.chat.think import prompt_opens_think
from mtpchat.models import WEIGHT_LABELS
from mtpchat.progress import describe, stage_label

NARROW_BELOW = 100   # columns; below this the telemetry pane folds into the status bar


@dataclass
class GenerationEnded(Message):
    """The generation thread has returned: the engine is free."""


def reply_footer(stats, reason: str, mtp: bool, k: int, estimate: bool = False) -> str:
    """The line under a reply; `estimate`: its acceptance is a server's recent average (SGLang's
    /metrics), not this reply's own."""
    parts = []
    if stats is not None:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s" if stats.tokens_per_s else "— tok/s")
        parts.append(f"{stats.new_tokens} tokens")
        if stats.verify_steps:
            average = " (server average)" if estimate else ""
            parts.append(f"mean acceptance {stats.mean_acceptance_length:.2f}{average}")
        parts.append(f"TTFT {stats.ttft_ms:.0f} ms")
    if stats is not None and not stats.verify_steps and mtp and not k:
        parts.append("acceptance N/A")   # a server that reports no speculative figures
    parts.append((f"MTP k={k}" if k else "MTP: server's") if mtp else "MTP off")
    note = {"cancelled": "stopped", "length": "hit max tokens", "context": "context full"}.get(reason)
    if note:
        parts.append(note)
    return " · ".join(parts)


class ChatApp(ChatActions, App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "mtpchat"
    BINDINGS = BINDINGS
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (NARROW_BELOW, "-wide")]

    def __init__(self, load_engine: Callable[[Callable], object], *, model: str, store: Store, sampling: Sampling,
                 device: str = "cpu", dtype: str = "", system: str = "", think: bool = True, mtp: bool = True,
                 draft_tokens: int = 3, preserve_thinking: bool | None = None, reasoning_effort: str | None = None,
                 probe: Callable | None = None,
                 gpu_interval: float = 1.0,
                 refresh_hz: float = 4.0, keymap: dict | None = None, export_dir: Path | None = None,
                 now: Callable[[], float] = time.time, ui_budget: float = 0.02):
        super().__init__()
        self.load_engine = load_engine
        self.model_name, self.device, self.dtype = model, device, dtype
        self.store, self.sampling, self.system, self.think = store, sampling, system, think
        self.default_system = system
        self.keep_thinking = preserve_thinking   # earlier replies' thinking stays in the prompt (template permitting)
        self.effort = reasoning_effort           # the template's reasoning_effort; None: its default
        self.initial_mtp, self.initial_k = mtp, draft_tokens
        self.make_probe, self.gpu_interval, self.refresh_hz = probe, gpu_interval, refresh_hz
        self.user_keymap = keymap or {}
        self.export_dir = export_dir
        self.now = now
        self.engine = None
        self.load_error: str | None = None
        self.waiting = ""        # a server not reachable yet, being tried again: what it said
        self.session_id: int | None = None
        self.session_title = "new chat"
        self.telemetry = Telemetry()
        self.tokens_emitted = 0
        self.busy = False
        self.tint = False
        self.notices: list[tuple[str, str]] = []   # (severity, text), newest last
        self.startup_notices: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._pending: Callable | None = None
        self._queued: str | None = None         # a message submitted before the engine was ready
        self._load_shown = None                 # the last LoadProgress passed on to the bar
        self._reply_view: MessageView | None = None
        self._sampler: Sampler | None = None
        self._drawn = None
        self.pacer = Pacer(ui_budget)
        self._unpainted: dict[str, tuple[list, list, list]] = {}   # target -> thinking, answer, spans
        self._paint_timer = None
        self._pane_due = 0.0

    # --- layout and lifecycle ---
    def compose(self):
        yield HeaderBar(id="header")
        with Horizontal(id="body"):
            with Vertical(id="chat-column"):
                yield ChatLog(id="chat")
                with Horizontal(id="loading"):
                    yield ProgressBar(total=None, show_eta=True, id="loading-bar")
                    yield Static(f"loading {self.model_name} on {self.device}…", id="loading-text")
                # in a box of its own: a widget whose container overlaps a repaint is redrawn with it,
                # and the text area is dear to redraw (a streaming paint next to it would redraw it too)
                with Vertical(id="composer-box"):
                    yield Composer(id="composer", placeholder="Message  (enter sends · ctrl+j newline · ctrl+p commands)")
            yield TelemetryPane(id="telemetry")
        yield StatusBar(id="status")
        with Vertical(id="footer-box"):   # a box of its own, as the composer's
            yield Footer(compact=True)

    def on_mount(self) -> None:
        if self.user_keymap:
            self.set_keymap(self.user_keymap)
        theme = self.store.get_pref("theme")
        if theme and theme in self.available_themes:
            self.theme = theme
        self.theme_changed_signal.subscribe(self, lambda t: self.store.set_pref("theme", t.name))
        self.query_one(Composer).focus()
        # idle refreshes (GPU samples, settings); while a reply streams the paints draw the pane
        self._redraw_timer = self.set_interval(1 / self.refresh_hz, self.redraw)
        self.redraw()
        for severity, text in self.startup_notices:
            self.notice(text, severity)
        self._load()

    def on_unmount(self) -> None:
        gc.unfreeze()
        # let the threads end, or interpreter exit would wait for a whole reply
        self._stop.set()
        if self.busy and self.engine is not None:
            self.engine.cancel()
        if self._sampler is not None:
            self._sampler.stop()

    def notice(self, text: str, severity: str = "information") -> None:
        self.notices.append((severity, text))
        self.notify(text, severity=severity, timeout=8 if severity == "error" else 4)

    # --- loading ---
    retry_first_s, retry_most_s = 2.0, 15.0   # a server not up yet: tried again after these, doubling

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self) -> None:
        wait = self.retry_first_s
        while True:
            try:
                self.post_message(EngineReady(self.load_engine(self._load_progressed)))
                return
            except Exception as exc:
                if not getattr(exc, "retry", False):
                    self.post_message(EngineFailed(describe_error(exc, "load", self.device)))
                    return
                self.post_message(EngineWaiting(describe_error(exc, "load", self.device), wait))
            if self._stop.wait(wait):       # the app is closing
                return
            wait = min(2 * wait, self.retry_most_s)

    def on_engine_waiting(self, m: EngineWaiting) -> None:
        text = f"{m.text} (trying again every few seconds; a message sent now goes out once it answers)"
        if not self.waiting:                  # said once; the line under the chat keeps the state
            self.notice(text, "warning")
        self.waiting = text
        self.query_one("#loading-text", Static).update(f"waiting for the server: trying again in {m.retry_s:.0f} s")

    def _load_progressed(self, p) -> None:
        """Engine.load's progress callback, on the loading thread: passed on at most every half
        percent (an MoE checkpoint has tens of thousands of tensors), and always at a stage's end."""
        step = max(1, p.total // 200)
        last = self._load_shown
        if last is None or last.stage != p.stage or p.done >= p.total or p.done - last.done >= step:
            self._load_shown = p
            self.post_message(LoadProgressed(p))

    def on_load_progressed(self, m: LoadProgressed) -> None:
        if not self.query("#loading"):
            return
        p = m.progress
        self.query_one("#loading-bar", ProgressBar).update(total=max(p.total, 1), progress=p.done)
        self.query_one("#loading-text", Static).update(f"{stage_label(p)}: {describe(p, 0)}")

    def on_engine_ready(self, m: EngineReady) -> None:
        if self.waiting:
            self.notice("the server answers now: connected")
        self.waiting = ""
        self.engine = m.engine
        self.device, self.dtype = self.engine.device, self.engine.dtype
        self.query_one("#loading").remove()   # its bar would go on repainting
        self.refresh_bindings()               # a server's fixed switches show dimmed in the footer
        for text in self.engine.notices:
            self.notice(text, "warning")
        self._check_effort()
        if not self.engine.mtp_available and not self.engine.notices:
            self.notice(NO_MTP, "warning")
        try:
            self.telemetry.memory = dict(self.engine.memory())
        except Exception:
            self.telemetry.memory = {}
        probe = self.make_probe(self.engine) if self.make_probe else (
            NvmlProbe() if self.device.startswith("cuda") else ProcessProbe())
        self._sampler = Sampler(probe, lambda s: self.post_message(GpuSampled(s)),
                                lambda: self.tokens_emitted, self.gpu_interval)
        self.run_worker(self._sampler.run, thread=True, group="gpu", exit_on_error=False)
        # everything alive now (torch, the tokenizer, the widgets) lives as long as the app: kept out
        # of the collector's full passes, each of which would otherwise walk it all (~130 ms here)
        # holding the GIL, the decode loop waiting
        gc.collect()
        gc.freeze()
        self.redraw()
        self.query_one(Composer).border_subtitle = ""
        if self._queued is not None:         # a message sent while the model was loading
            text, self._queued = self._queued, None
            self.query_one(Composer).post_message(Composer.Submitted(text))

    def _check_effort(self) -> None:
        """A reasoning effort this model's template does not take: said once, and its default used."""
        try:
            check_effort(self.engine.tokenizer, self.effort, "--reasoning-effort")
        except SwitchError as exc:
            self.notice(f"{exc}; using the template's default", "warning")
            self.effort = None

    def on_engine_failed(self, m: EngineFailed) -> None:
        self.load_error = m.text
        self.query_one("#loading").remove()
        if self._queued is not None:         # the message stays in the box, never sent, never lost
            self.query_one(Composer).border_subtitle = "not sent: the model did not load"
        self.notice(m.text, "error")
        self.redraw()

    def on_gpu_sampled(self, m: GpuSampled) -> None:
        self.telemetry.gpu_sampled(m.sample)

    # --- what the header, pane and status bar show ---
    def live(self) -> Live:
        e = self.engine
        return Live(model=self.model_name, device=self.device, dtype=self.dtype,
                    mtp=bool(e.mtp) if e else self.initial_mtp,
                    mtp_available=e.mtp_available if e else True,
                    draft_tokens=int(e.draft_tokens) if e else self.initial_k,
                    k_max=e.k_max if e else 0,
                    thinking=self.think, busy=self.busy, loaded=e is not None,
                    effort=effort_label(e.tokenizer, self.think, self.effort) if e else "",
                    weights=WEIGHT_LABELS.get(e.weight_format, "") if e else "",
                    fixed=e.fixed if e else ("the server's" if self.device == "server" else ""),
                    moe_layers=e.moe_layers if e else 0)

    def redraw(self, force: bool = False) -> None:
        if self.busy and not force:
            return   # while a reply streams, the paints draw the pane at their own pace
        try:
            screen = self.screen_stack[0]
            pane, status = screen.query_one(TelemetryPane), screen.query_one(StatusBar)
        except (NoMatches, IndexError):
            return   # shutting down: the widgets are gone
        live = self.live()
        key = (self.telemetry.version, live, self.session_title, pane.display)
        if key == self._drawn and not force:
            return
        screen.query_one(HeaderBar).show(live, self.session_title)
        # only the one the terminal's width shows (a narrow terminal folds the pane into the bar)
        if pane.display:
            pane.show(self.telemetry, live)
        if status.display:
            status.show(self.telemetry, live)
        self._drawn = key

    # --- generation ---
    def _begin(self, runs: list[tuple[str, list[dict], bool | None]], sampling: Sampling | None = None) -> None:
        self._claim()
        self._redraw_timer.pause()
        self.query_one(Composer).cursor_blink = False   # each blink is a repaint: none while decoding
        # the engine starts once the screen has laid out the new reply, not while it decodes
        self.call_after_refresh(self._start_generation, runs, self.think, sampling or self.sampling)

    def _start_generation(self, runs, think: bool, sampling: Sampling) -> None:
        if self._stop.is_set():   # stopped before it started
            self.post_message(GenerationEnded())
            return
        self.pacer.reset()
        self._pane_due = 0.0
        self._generate(runs, think, sampling)

    def _count(self, n: int) -> None:
        self.tokens_emitted += n

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def _generate(self, runs, think: bool, sampling: Sampling) -> None:
        worker = get_current_worker()
        engine = self.engine
        cancelled = lambda: self._stop.is_set() or worker.is_cancelled
        racing = any(mtp is not None for _, _, mtp in runs)
        restore = engine.mtp
        target = runs[0][0]
        try:
            params = sampling.to_params()
            for target, messages, mtp in runs:
                if cancelled():
                    break
                if mtp is not None:
                    engine.mtp = mtp
                    engine.reset()   # each lane starts from the same empty state
                ids, keep_at = build_prompt(engine.tokenizer, messages, think, self.keep_thinking, self.effort)
                think_open = prompt_opens_think(engine.tokenizer, ids)
                drive(engine, ids, params, target=target, think_open=think_open, post=self.post_message,
                      cancelled=cancelled, count_tokens=self._count,
                      interval=lambda: self.pacer.interval, snapshot_at=keep_at)
        except Exception as exc:
            self.post_message(ReplyFailed(target, describe_error(exc, "reply"), "", "", ()))
        finally:
            if racing:
                engine.mtp = restore
                engine.reset()
            self.post_message(GenerationEnded())

    def _race_screen(self) -> RaceScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, RaceScreen)), None)

    def on_reply_prefilled(self, m: ReplyPrefilled) -> None:
        if m.target == "chat":   # shown with the first paint: a repaint costs the engine time
            self.telemetry.prefilled(m.prompt_tokens, m.prefill_ms, m.cached_tokens)

    async def on_reply_delta(self, m: ReplyDelta) -> None:
        if m.target == "chat":
            self.telemetry.add_steps(m.steps)
        thinking, answer, spans = self._unpainted.setdefault(m.target, ([], [], []))
        thinking.append(m.thinking)
        answer.append(m.answer)
        spans.extend(m.spans)
        if self.pacer.due():
            await self._paint()
        elif self._paint_timer is None:
            self._paint_timer = self.set_timer(self.pacer.delay(), self._paint)

    async def _paint(self) -> None:
        """Show the text that arrived since the last paint; the telemetry pane follows when it is due."""
        if self._paint_timer is not None:
            self._paint_timer.stop()
            self._paint_timer = None
        pending, self._unpainted = self._unpainted, {}
        for target, (thinking, answer, spans) in pending.items():
            if target == "chat":
                if self._reply_view is not None:
                    await self._reply_view.write("".join(thinking), "".join(answer), spans)
            elif race := self._race_screen():
                race.lane(target).write("".join(thinking), "".join(answer))
        now = self.pacer.clock()
        if now >= self._pane_due:
            # in a frame of its own, right after this one: one frame with both would redraw the
            # whole screen (Textual repaints the box around everything that changed)
            self.call_after_refresh(self.redraw, True)
            self._pane_due = now + PANE_INTERVAL
        self.pacer.painted()

    async def on_reply_done(self, m: ReplyDone) -> None:
        await self._paint()
        if m.target != "chat":
            if race := self._race_screen():
                race.finish_lane(m.target, m.stats, m.reason)
                race.done = race.done or m.reason == "cancelled" or m.target == "race:on"
            return
        self.telemetry.finished(m.stats)
        live = self.live()
        footer = reply_footer(m.stats, m.reason, live.mtp, live.draft_tokens,
                              estimate=self.engine.spec_estimate)
        stats = dict(m.stats.as_dict()) if m.stats is not None else {}
        stats.update(reason=m.reason, mtp=live.mtp, draft_tokens=live.draft_tokens, footer=footer)
        view = self._reply_view
        # commit before rendering: a crash after this line loses nothing that was shown
        mid = self._save("assistant", m.answer, m.thinking, encode_spans(m.spans), stats)
        if view is not None:
            view.message_id = mid
            await view.finish(m.answer, m.thinking, m.spans, footer)
        if self._sampler:
            self._sampler.wake()
        self.redraw(force=True)

    async def on_reply_failed(self, m: ReplyFailed) -> None:
        await self._paint()
        self.notice(m.text, "error")
        if m.target != "chat":
            if race := self._race_screen():
                race.fail(m.text)
            return
        view = self._reply_view
        if view is None:
            return
        if m.answer or m.thinking:
            footer = "the server's stream broke here" if self.engine.fixed else "the engine failed here"
            mid = self._save("assistant", m.answer, m.thinking, encode_spans(m.spans), {"reason": "error", "footer": footer})
            view.message_id = mid
            await view.finish(m.answer, m.thinking, m.spans, footer)
        else:
            await view.remove()
        try:
            self.engine.reset()
        except Exception:
            pass

    def on_generation_ended(self, m: GenerationEnded) -> None:
        self.busy = False
        self._redraw_timer.resume()
        view, self._reply_view = self._reply_view, None
        if view is not None and not view.finished and view.is_attached:
            view.remove()   # stopped before the engine said anything: no empty "generating…" reply stays
        self.query_one(Composer).cursor_blink = True
        self.redraw(force=True)
        if self._pending is not None:
            fn, self._pending = self._pending, None
            self.call_later(fn)

    # --- persistence ---
    def _save(self, role: str, content: str, thinking: str = "", spans=None, stats=None) -> int | None:
        try:
            if self.session_id is None:
                self.session_title = title_of(content)
                self.session_id = self.store.create_session(self.session_title, self.system, self.model_name)
            return self.store.add_message(self.session_id, role, content, thinking, spans, stats)
        except Exception as exc:   # a full disk must not take the chat down
            self.notice(f"could not save the chat ({exc}): it stays on screen; export it to keep it", "error")
            return None


def title_of(text: str) -> str:
    line = " ".join(text.split())
    return line[:48] + ("…" if len(line) > 48 else "") if line else "chat"
