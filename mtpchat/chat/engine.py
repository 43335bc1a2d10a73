"""The engine the chat layer drives, declared: the local engine (through `LocalEngine`), a server's
(mtpchat/remote/engine.py) and the fake one (mtpchat/app/fake.py) all have exactly this.

The engine sees token ids; the chat layer owns text. What a server cannot change per request says
so in `fixed` (empty where everything can change live), and `spec_estimate` says whether the last
reply's speculative decoding figures are an estimate rather than the reply's own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Protocol, runtime_checkable

from mtpchat.engine.events import Finished, Prefilled, Step

if TYPE_CHECKING:
    from mtpchat.engine import Engine

Event = Prefilled | Step | Finished


class TextStream(Protocol):
    def push(self, ids) -> str:
        """The text the ids complete (a character split across tokens waits for its last byte)."""

    def flush(self) -> str:
        """What was held back, at the end of the reply."""


@runtime_checkable
class ChatTokenizer(Protocol):
    chat_template: str | None          # the template's source, where there is one to read
    think_start_id: int | None         # the ids of <think> and </think>, where they are tokens
    think_end_id: int | None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = True, **kw) -> list[int]: ...

    def decode(self, ids, skip_special_tokens: bool = False) -> str: ...

    def stream(self) -> TextStream: ...


@runtime_checkable
class ChatEngine(Protocol):
    tokenizer: ChatTokenizer
    device: str
    dtype: str
    max_context: int
    k_max: int                         # the most draft tokens per step it can be set to
    mtp_available: bool
    mtp: bool                          # live: set between steps
    draft_tokens: int                  # live: set between steps
    weight_format: str                 # "bf16", "float32", "fp8" or "int4": how the weights are held; "" unknown
    moe_layers: int
    stop_ids: tuple[int, ...]          # what ends a turn when the sampling params name none
    notices: list[str]                 # what the user should hear about how it loaded
    fixed: str                         # why MTP and draft tokens cannot change here; "" where they can
    spec_estimate: bool

    def generate(self, prompt_ids: list[int], params, snapshot_at: tuple[int, ...] = ()) -> Iterator[Event]:
        """Prefilled, one Step per step, then Finished."""

    def cancel(self) -> None:
        """Thread-safe: the generation ends at its next step with Finished(reason="cancelled")."""

    def reset(self) -> None:
        """Forget the decode state an earlier turn left."""

    def memory(self) -> dict[str, int]:
        """Bytes held, by part (weights, kv, ...)."""


class LocalEngine:
    """The in-process `Engine` as a `ChatEngine`. `engine` is the Engine itself, for what only a
    local engine has (draft_vocab, adaptive k, logits)."""
    fixed = ""
    spec_estimate = False

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.device = str(engine.device)
        self.dtype = str(engine.dtype).removeprefix("torch.")
        self.max_context, self.k_max = engine.max_context, engine.k_max
        self.mtp_available, self.moe_layers = engine.mtp_available, engine.moe_layers
        self.weight_format = engine.weight_format
        self.stop_ids, self.notices = engine.stop_ids, engine.notices
        self.generation_config = engine.generation_config     # the server's sampling defaults

    @property
    def mtp(self) -> bool:
        return self.engine.mtp

    @mtp.setter
    def mtp(self, on: bool) -> None:
        self.engine.mtp = on

    @property
    def draft_tokens(self) -> int:
        return self.engine.draft_tokens

    @draft_tokens.setter
    def draft_tokens(self, k: int) -> None:
        self.engine.draft_tokens = k

    def generate(self, prompt_ids: list[int], params, snapshot_at: tuple[int, ...] = ()) -> Iterator[Event]:
        return self.engine.generate(prompt_ids, params, snapshot_at=snapshot_at)

    def cancel(self) -> None:
        self.engine.cancel()

    def reset(self) -> None:
        self.engine.reset()

    def memory(self) -> dict[str, int]:
        return self.engine.memory()
