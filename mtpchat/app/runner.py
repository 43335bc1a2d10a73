"""The body of the generation worker: drive `engine.generate`, turn ids into text, post in batches.

Runs on a worker thread. Per step it only keeps the step and checks for cancellation: on the CPU the
decode loop waits for whatever this thread does between its steps, and the same work (detokenizing,
splitting off the thinking, the telemetry records) done a batch at a time costs the decoder less
than done between every two steps (about 1% of the demo model's decode rate). The first text goes to
the UI at once, then a batch every `interval` (the app passes its paint pacing, 10 to 30 times a
second) as one `ReplyDelta` through `post` (post_message: thread-safe, never blocks), so the UI cost
does not grow with tokens/s. Cancellation is checked every step and passed to the engine, which ends
the generation with Finished(reason="cancelled").
"""
from __future__ import annotations

import time
from typing import Callable

from mtpchat.app.errors import describe_error
from mtpchat.app.messages import ReplyDelta, ReplyDone, ReplyFailed, ReplyPrefilled, Span
from mtpchat.app.telemetry import StepRecord
from mtpchat.app.think import ThinkSplitter

POST_INTERVAL = 1 / 30


class ReplyText:
    """Accumulates a reply: thinking, answer, and the answer's provenance spans."""

    def __init__(self, think_open: bool):
        self.splitter = ThinkSplitter(inside=think_open)
        self.thinking: list[str] = []
        self.answer: list[str] = []
        self.spans: list[Span] = []

    def add(self, text: str, from_draft: bool) -> tuple[str, str]:
        think, answer = self.splitter.push(text)
        self._keep(think, answer, from_draft)
        return think, answer

    def flush(self) -> tuple[str, str]:
        think, answer = self.splitter.flush()
        self._keep(think, answer, False)
        return think, answer

    def _keep(self, think: str, answer: str, from_draft: bool) -> None:
        if think:
            self.thinking.append(think)
        if answer:
            self.answer.append(answer)
            if self.spans and self.spans[-1][1] == from_draft:
                self.spans[-1] = (self.spans[-1][0] + answer, from_draft)
            else:
                self.spans.append((answer, from_draft))


class Batch:
    def __init__(self):
        self.thinking: list[str] = []
        self.answer: list[str] = []
        self.spans: list[Span] = []
        self.steps: list[StepRecord] = []

    def add_text(self, think: str, answer: str, from_draft: bool) -> None:
        if think:
            self.thinking.append(think)
        if answer:
            self.answer.append(answer)
            self.spans.append((answer, from_draft))

    def take(self, target: str) -> ReplyDelta:
        msg = ReplyDelta(target, "".join(self.thinking), "".join(self.answer), tuple(self.spans), tuple(self.steps))
        self.__init__()
        return msg

    def __bool__(self) -> bool:
        return bool(self.steps or self.thinking or self.answer)


def drive(engine, prompt_ids: list[int], params, *, target: str, think_open: bool,
          post: Callable, cancelled: Callable[[], bool], count_tokens: Callable[[int], None] = lambda n: None,
          interval: float | Callable[[], float] = POST_INTERVAL, clock: Callable[[], float] = time.monotonic,
          snapshot_at: tuple[int, ...] = ()) -> None:
    text = ReplyText(think_open)
    batch = Batch()
    steps: list = []            # kept since the last batch went out
    stream = engine.tokenizer.stream()
    # the stop token ends the turn; it is not part of the text
    stop = set(getattr(engine, "stop_ids", None) or getattr(engine.tokenizer, "eos_token_ids", ()) or ())
    every = interval if callable(interval) else (lambda: interval)

    def absorb() -> None:
        """The kept steps into the batch: their text and their telemetry records."""
        tokens = 0
        for ev in steps:
            # accepted drafts come first, then the target's own token: one push for each part
            ids, drafts = ev.token_ids, ev.from_draft
            a = drafts.index(False) if False in drafts else len(ids)
            for part, from_draft in ((ids[:a], True), (ids[a:], False)):
                if part and not stop.isdisjoint(part):
                    part = [t for t in part if t not in stop]
                if part:
                    piece = stream.push(part)
                    batch.add_text(*text.add(piece, from_draft), from_draft)
            batch.steps.append(StepRecord.of(ev))
            tokens += len(ids)
        steps.clear()
        if tokens:
            count_tokens(tokens)

    last_post = float("-inf")   # the first text goes out at once: time to first token is what users watch
    asked_cancel = False
    try:
        for ev in engine.generate(prompt_ids, params, snapshot_at=snapshot_at):
            kind = type(ev).__name__
            if kind == "Step":
                steps.append(ev)
                now = clock()
                if now - last_post >= every():
                    absorb()
                    post(batch.take(target))
                    last_post = now
                if not asked_cancel and cancelled():
                    engine.cancel()
                    asked_cancel = True
            elif kind == "Prefilled":
                post(ReplyPrefilled(target, ev.prompt_tokens, ev.prefill_ms, getattr(ev, "cached_tokens", 0)))
                if not asked_cancel and cancelled():
                    engine.cancel()
                    asked_cancel = True
            elif kind == "Finished":
                absorb()
                tail = stream.flush() if hasattr(stream, "flush") else ""
                batch.add_text(*text.add(tail, False), False)
                batch.add_text(*text.flush(), False)
                if batch:
                    post(batch.take(target))
                post(ReplyDone(target, "".join(text.thinking), "".join(text.answer), tuple(text.spans),
                               ev.reason, ev.stats))
                return
        # an engine that ended without Finished: still close the reply
        absorb()
        batch.add_text(*text.flush(), False)
        if batch:
            post(batch.take(target))
        post(ReplyDone(target, "".join(text.thinking), "".join(text.answer), tuple(text.spans), "stop", None))
    except Exception as exc:   # any failure becomes a notice; the app and the chat stay up
        try:
            absorb()          # what the engine had produced before it failed still shows
        except Exception:
            steps.clear()
        text.flush()
        if batch:
            post(batch.take(target))
        post(ReplyFailed(target, describe_error(exc, during="reply"), "".join(text.thinking),
                         "".join(text.answer), tuple(text.spans)))
