"""The body of the generation worker: drive a `Reply` (mtpchat/chat/reply.py), post it in batches.

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
from mtpchat.chat.engine import ChatEngine
from mtpchat.chat.reply import Piece, Reply
from mtpchat.engine.events import Finished, Prefilled, Step

POST_INTERVAL = 1 / 30


class Batch:
    """What goes to the UI in one ReplyDelta: the text and the step records since the last one."""

    def __init__(self):
        self.thinking: list[str] = []
        self.answer: list[str] = []
        self.spans: list[Span] = []
        self.steps: list[StepRecord] = []

    def add(self, pieces: list[Piece]) -> None:
        for p in pieces:
            if p.thinking:
                self.thinking.append(p.thinking)
            if p.answer:
                self.answer.append(p.answer)
                self.spans.append((p.answer, p.from_draft))

    def take(self, target: str) -> ReplyDelta:
        msg = ReplyDelta(target, "".join(self.thinking), "".join(self.answer), tuple(self.spans), tuple(self.steps))
        self.__init__()
        return msg

    def __bool__(self) -> bool:
        return bool(self.steps or self.thinking or self.answer)


def drive(engine: ChatEngine, prompt_ids: list[int], params, *, target: str, think_open: bool,
          post: Callable, cancelled: Callable[[], bool], count_tokens: Callable[[int], None] = lambda n: None,
          interval: float | Callable[[], float] = POST_INTERVAL, clock: Callable[[], float] = time.monotonic,
          snapshot_at: tuple[int, ...] = ()) -> None:
    reply = Reply(engine, prompt_ids, params, cancelled=cancelled, snapshot_at=snapshot_at, think_open=think_open)
    batch = Batch()
    every = interval if callable(interval) else (lambda: interval)

    def absorb() -> None:
        """The steps since the last batch into the batch: their text and their telemetry records."""
        batch.steps += [StepRecord.of(ev) for ev in reply.pending]
        tokens = sum(len(ev.token_ids) for ev in reply.pending)
        batch.add(reply.take())
        if tokens:
            count_tokens(tokens)

    def done(pieces: list[Piece]) -> tuple:
        batch.add(pieces)
        if batch:
            post(batch.take(target))
        return (*reply.text(), tuple(reply.spans))

    last_post = float("-inf")   # the first text goes out at once: time to first token is what users watch
    try:
        for ev in reply:
            if isinstance(ev, Step):
                now = clock()
                if now - last_post >= every():
                    absorb()
                    post(batch.take(target))
                    last_post = now
            elif isinstance(ev, Prefilled):
                post(ReplyPrefilled(target, ev.prompt_tokens, ev.prefill_ms, ev.cached_tokens))
            elif isinstance(ev, Finished):
                absorb()
                post(ReplyDone(target, *done(reply.finish()), reply.reason, reply.stats))
    except Exception as exc:   # any failure becomes a notice; the app and the chat stay up
        try:
            absorb()          # what the engine had produced before it failed still shows
            pieces = reply.finish()
        except Exception:
            pieces = []
        post(ReplyFailed(target, describe_error(exc, during="reply"), *done(pieces)))
