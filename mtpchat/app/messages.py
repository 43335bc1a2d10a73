"""Messages the worker threads post to the app (post_message is thread-safe and never blocks).

A reply streams as `ReplyPrefilled`, then `ReplyDelta`s, one per paint (10-30 Hz), then `ReplyDone`
(or `ReplyFailed`). `target` says where the text goes: "chat", or a lane of the race screen.
"""
from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from mtpchat.app.gpu import GpuSample
from mtpchat.app.telemetry import StepRecord

Span = tuple[str, bool]   # answer text and whether it came from an accepted draft


@dataclass
class EngineReady(Message):
    engine: object


@dataclass
class LoadProgressed(Message):
    progress: object      # an engine.events.LoadProgress


@dataclass
class EngineFailed(Message):
    text: str


@dataclass
class EngineWaiting(Message):
    """The server is not reachable yet: the load is tried again in `retry_s` seconds."""
    text: str
    retry_s: float


@dataclass
class ReplyPrefilled(Message):
    target: str
    prompt_tokens: int
    prefill_ms: float
    cached_tokens: int


@dataclass
class ReplyDelta(Message):
    target: str
    thinking: str
    answer: str
    spans: tuple[Span, ...]
    steps: tuple[StepRecord, ...]


@dataclass
class ReplyDone(Message):
    target: str
    thinking: str                 # the whole reply, for the final full render
    answer: str
    spans: tuple[Span, ...]
    reason: str
    stats: object                 # engine Stats


@dataclass
class ReplyFailed(Message):
    target: str
    text: str
    thinking: str
    answer: str
    spans: tuple[Span, ...]


@dataclass
class GpuSampled(Message):
    sample: GpuSample
