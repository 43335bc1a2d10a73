"""One reply: drive `engine.generate` and turn its token ids into thinking and answer text.

The app's worker, the server and `mtpchat run` all go through `Reply`. Iterating it yields the
engine's events (Prefilled, Step..., then exactly one Finished, made up where an engine ended
without one); `take()` turns the steps seen since the last take into text, and `finish()` adds what
the detokenizer, the stop strings and the think split held back. Taking is left to the caller
because detokenizing costs the decoder time on the CPU: the app takes a batch of steps at a time,
the server and `run` after every step.

In order, text goes: ids less the ones that end the turn -> incremental detokenizer -> stop strings
-> think split. Cancellation (asked for, or a stop string seen) is passed to the engine once, after
the event that showed it, and the engine ends the reply with Finished(reason="cancelled"); a reply
cut by a stop string still finishes with reason "stop".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from mtpchat.chat.engine import ChatEngine, Event
from mtpchat.chat.stops import StopStrings
from mtpchat.chat.think import ThinkSplitter, prompt_opens_think
from mtpchat.engine.events import Finished, Step

Span = tuple[str, bool]   # answer text, and whether it came from accepted drafts


@dataclass(frozen=True)
class Piece:
    """Text of part of a reply: its thinking, its answer, and where the tokens came from."""
    thinking: str
    answer: str
    from_draft: bool = False


class Reply:
    def __init__(self, engine: ChatEngine, prompt_ids: list[int], params, *, stops: list[str] = (),
                 cancelled: Callable[[], bool] = lambda: False, snapshot_at: tuple[int, ...] = (),
                 think_open: bool | None = None):
        """`think_open`: whether the reply starts inside the thinking; None reads it from the prompt."""
        self.engine, self.prompt_ids, self.params, self.snapshot_at = engine, prompt_ids, params, snapshot_at
        self.cancelled = cancelled
        # the engine stops on these and they are not text (engine semantics: None = the engine's own)
        ends = params.stop_token_ids if params.stop_token_ids is not None else engine.stop_ids
        self.ends = set(ends)
        self.stream = engine.tokenizer.stream()
        self.stops = StopStrings(stops)
        inside = prompt_opens_think(engine.tokenizer, prompt_ids) if think_open is None else think_open
        self.split = ThinkSplitter(inside=inside)
        self.pending: list[Step] = []
        self.thinking: list[str] = []
        self.answer: list[str] = []
        self.spans: list[Span] = []    # the answer, runs of the same provenance merged
        self.finished: Finished | None = None
        self._asked = False
        self.logprobs: list[dict] = []  # the entries of the steps taken, not yet handed on (take_logprobs)

    def __iter__(self) -> Iterator[Event]:
        for ev in self.engine.generate(self.prompt_ids, self.params, snapshot_at=self.snapshot_at):
            if isinstance(ev, Step):
                self.pending.append(ev)
            elif isinstance(ev, Finished):
                self.finished = ev
                yield ev
                return
            yield ev
            if not self._asked and (self.stops.hit or self.cancelled()):
                self.engine.cancel()
                self._asked = True
        # an engine that ended without Finished: the reply still ends
        self.finished = Finished("stop", None, ())
        yield self.finished

    @property
    def reason(self) -> str:
        """Why the reply ended: the engine's reason, or "stop" where a stop string cut it."""
        return "stop" if self.stops.hit else self.finished.reason if self.finished else "stop"

    @property
    def stats(self):
        return self.finished.stats if self.finished else None

    def take(self) -> list[Piece]:
        """The text of the steps since the last take; accepted drafts and the target's own token
        of a step are apart, for provenance."""
        pieces = []
        for ev in self.pending:
            # accepted drafts come first, then the target's own token
            ids, drafts = ev.token_ids, ev.from_draft
            a = drafts.index(False) if False in drafts else len(ids)
            for part, from_draft in ((ids[:a], True), (ids[a:], False)):
                part = [t for t in part if t not in self.ends]
                if part:
                    pieces += self._text(self.stops.push(self.stream.push(part)), from_draft)
            if ev.logprobs is not None and not self.stops.hit:
                self.logprobs += [self._entry(lp) for lp in ev.logprobs if lp.token_id not in self.ends]
        self.pending.clear()
        return pieces

    def finish(self) -> list[Piece]:
        """The rest of the reply: steps not taken yet and everything held back."""
        pieces = self.take()
        pieces += self._text(self.stops.push(self.stream.flush()) + self.stops.flush(), False)
        return pieces + self._keep(Piece(*self.split.flush()))

    def take_logprobs(self) -> list[dict]:
        """The logprob entries of the tokens taken since the last call (the params asked for them),
        in OpenAI's chat form: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}.
        The ids that end the turn have none, as they have no text."""
        got, self.logprobs = self.logprobs, []
        return got

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        text = self.engine.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))

    def _entry(self, lp) -> dict:
        text, raw = self._piece(lp.token_id)
        top = []
        for tid, value in lp.top:
            t, b = self._piece(tid)
            top.append({"token": t, "logprob": value, "bytes": b})
        return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}

    def text(self) -> tuple[str, str]:
        """(thinking, answer) so far."""
        return "".join(self.thinking), "".join(self.answer)

    def _text(self, text: str, from_draft: bool) -> list[Piece]:
        return self._keep(Piece(*self.split.push(text), from_draft)) if text else []

    def _keep(self, piece: Piece) -> list[Piece]:
        if not (piece.thinking or piece.answer):
            return []
        if piece.thinking:
            self.thinking.append(piece.thinking)
        if piece.answer:
            self.answer.append(piece.answer)
            if self.spans and self.spans[-1][1] == piece.from_draft:
                self.spans[-1] = (self.spans[-1][0] + piece.answer, piece.from_draft)
            else:
                self.spans.append((piece.answer, piece.from_draft))
        return [piece]


def summary(result: dict) -> str:
    """The one line `mtpchat run` prints on stderr after a reply: its result's stats, in words."""
    s = result["stats"]
    line = (f"[{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, "
            f"time to first token {s['ttft_ms']:.0f} ms")
    if s["drafted"]:
        line += (f", mean acceptance length {s['mean_acceptance_length']:.2f}, "
                 f"draft acceptance {100 * s['draft_acceptance_rate']:.0f}%")
    if result["finish_reason"] != "stop":
        line += f", stopped: {result['finish_reason']}"
    return line + "]"
