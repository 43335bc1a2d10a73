"""A server behind the Engine API (a `ChatEngine`, mtpchat/chat/engine.py), so the app and `mtpchat run` use it as they use the local engine.

A server takes messages, not token ids, and streams text, not ids. So the tokenizer here keeps what
the app hands it: "applying the chat template" files the messages under a one-id prompt, and each
piece of streamed text travels in a `Step` under an id of its own, which `stream().push` turns back
into the text. Thinking comes as `reasoning` / `reasoning_content` deltas; it is wrapped in
`<think>` ... `</think>` pieces so the app's splitter files it as it files the local model's.

What a server cannot do live (MTP on/off, draft tokens, the race) is fixed by how it was launched:
`fixed` says so, and the app shows those actions dimmed. The speculative decoding figures arrive at
the end of a reply (metrics.py), in the `Finished` stats; tokens/s and time to first token are
measured here, from the stream.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from mtpchat.engine.events import Finished, PhaseTimes, Prefilled, Stats, Step
from mtpchat.remote import metrics
from mtpchat.remote.client import RemoteError, Server

THINK_OPEN, THINK_CLOSE = 0, 1


class RemoteTokenizer:
    think_start_id, think_end_id = THINK_OPEN, THINK_CLOSE
    chat_template = None      # the server's template is its own: nothing here to offer
    eos_token_ids: tuple = ()

    def __init__(self):
        self._lock = threading.Lock()
        self._next = 2
        self._pieces: dict[int, str] = {THINK_OPEN: "<think>", THINK_CLOSE: "</think>"}
        self._prompts: OrderedDict[int, tuple[list[dict], bool]] = OrderedDict()

    def _new_id(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = True, **_) -> list[int]:
        pid = self._new_id()
        self._prompts[pid] = ([dict(m) for m in messages], enable_thinking)
        while len(self._prompts) > 16:
            self._prompts.popitem(last=False)
        return [pid]

    def prompt(self, ids) -> tuple[list[dict], bool]:
        """The messages and the thinking switch filed under a prompt id."""
        try:
            return self._prompts[list(ids)[-1]]
        except (KeyError, IndexError):
            raise ValueError("this prompt was not made by this server's tokenizer") from None

    def piece(self, text: str) -> int:
        pid = self._new_id()
        self._pieces[pid] = text
        return pid

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self._pieces.get(i, "") for i in ids)

    def stream(self) -> "PieceStream":
        return PieceStream(self)


class PieceStream:
    """Text pieces back out of their ids; each piece is read once, then forgotten."""

    def __init__(self, tok: RemoteTokenizer):
        self.tok = tok

    def push(self, ids) -> str:
        pieces = self.tok._pieces
        return "".join(pieces.pop(i, "") if i > THINK_CLOSE else pieces[i] for i in ids)

    def flush(self) -> str:
        return ""


METRICS_LAG_S = (0.0, 0.1, 0.2, 0.4)    # the waits before each read of /metrics after a reply

FIXED = "set when the server was launched (its speculative config); it cannot change them per request"


class RemoteEngine:
    device, dtype, k_max, weight_format, moe_layers = "server", "", 0, "", 0
    mtp_available = True
    stop_ids: tuple = ()

    def __init__(self, server: Server, model: str, max_context: int = 0):
        self.server, self.name, self.max_context = server, model, max_context
        self.tokenizer = RemoteTokenizer()
        self.mtp = True             # shown as the server's: whatever it was launched with
        self.draft_tokens = 0
        self.fixed = f"MTP and draft tokens are {FIXED}"
        self.notices = [f"connected to {server.url} ({model}): MTP, draft tokens and the race are {FIXED}"]
        self.spec_source = ""
        self.spec_estimate = False     # the last reply's figures are the server's average, not its own
        self._cancel = threading.Event()

    @classmethod
    def connect(cls, url: str, api_key: str | None = None, model: str | None = None) -> "RemoteEngine":
        server = Server(url, api_key)
        listed = server.models()
        ids = [m["id"] for m in listed]
        if not ids:
            raise RemoteError(f"the server at {server.url} serves no model")
        if model is not None and model not in ids:
            raise RemoteError(f"the server at {server.url} does not serve {model!r}; it serves {', '.join(ids)}")
        chosen = next(m for m in listed if m["id"] == (model or ids[0]))
        return cls(server, chosen["id"], int(chosen.get("max_model_len") or 0))

    # --- the Engine API ---
    def cancel(self) -> None:
        self._cancel.set()

    def reset(self) -> None:
        pass    # the server keeps no conversation state of ours

    def memory(self) -> dict[str, int]:
        return {}

    def request_body(self, messages: list[dict], think: bool, params) -> dict:
        """The request; a sampling field left as None (or off) is left to the server's defaults."""
        body = {"model": self.name, "messages": messages, "stream_options": {"include_usage": True},
                "chat_template_kwargs": {"enable_thinking": think}}
        off = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "seed"):
            value = getattr(params, name, None)
            if value is not None and not (name in off and value == off[name] and name != "top_p"):
                body[name] = value
        return body

    def chat(self, messages: list[dict], think: bool, params):
        """The reply as ("thinking" | "answer", text) pairs, then ("end", finish reason, Stats)."""
        self._cancel.clear()
        before = metrics.parse(page) if (page := self.server.metrics_text()) else None
        t0 = time.perf_counter()
        first = last = None
        per_request, used, reason, chunks = None, {}, "stop", 0
        stream = self.server.stream_chat(self.request_body(messages, think, params))
        try:
            for event in stream:
                per_request = metrics.from_response(event) or per_request
                used = event.get("usage") or used
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    thinking = delta.get("reasoning") or delta.get("reasoning_content")
                    for kind, text in (("thinking", thinking), ("answer", delta.get("content"))):
                        if text:
                            last = time.perf_counter()
                            first = first or last
                            chunks += 1
                            yield kind, text
                    reason = {"length": "length", "stop": "stop"}.get(choice.get("finish_reason"), reason)
                if self._cancel.is_set():
                    reason = "cancelled"
                    break
        finally:
            stream.close()         # the server sees the connection close and stops generating
        stats = Stats(prompt_tokens=int(used.get("prompt_tokens", 0)),
                      new_tokens=int(used.get("completion_tokens", 0)) or chunks)
        stats.ttft_ms = stats.prefill_ms = ((first or time.perf_counter()) - t0) * 1e3
        stats.decode_ms = ((last or first or t0) - (first or t0)) * 1e3
        spec = per_request
        if spec is None and reason != "cancelled" and before is not None:
            # a server's counters can trail its stream (vLLM's are logged after the step that ends
            # the reply): a reply of several tokens with no drafts counted is read again, briefly
            for wait in METRICS_LAG_S:
                time.sleep(wait)
                after = metrics.parse(page) if (page := self.server.metrics_text()) else None
                spec = metrics.between(before, after, stats.new_tokens)
                if spec is None or spec.verify_steps or stats.new_tokens < 2:
                    break
        if spec is not None:
            stats.verify_steps, stats.drafted, stats.accepted = spec.verify_steps, spec.drafted, spec.accepted
            stats.accepted_at_least = list(spec.at_least)
            stats.steps = spec.verify_steps
        self.spec_source = spec.source if spec is not None else ""
        self.spec_estimate = spec is not None and not spec.exact
        yield "end", reason, stats

    def generate(self, prompt_ids, params=None, snapshot_at=()):
        """Prefilled at the first text, a Step per streamed piece, Finished with the server's figures."""
        messages, think = self.tokenizer.prompt(prompt_ids)
        t0, inside, started = time.perf_counter(), False, False
        for kind, *rest in self.chat(messages, think, params):
            if kind == "end":
                reason, stats = rest
                if not started:
                    yield Prefilled(prompt_tokens=stats.prompt_tokens, prefill_ms=stats.ttft_ms)
                yield Finished(reason, stats, ())
                return
            ids = []
            if kind == "thinking" and not inside:
                ids.append(THINK_OPEN)
            if kind == "answer" and inside:
                ids.append(THINK_CLOSE)
            inside = kind == "thinking"
            ids.append(self.tokenizer.piece(rest[0]))
            elapsed = (time.perf_counter() - t0) * 1e3
            if not started:
                started = True
                yield Prefilled(prompt_tokens=0, prefill_ms=elapsed)
            yield Step(tuple(ids), (False,) * len(ids), 0, 0, False, PhaseTimes(), elapsed)
