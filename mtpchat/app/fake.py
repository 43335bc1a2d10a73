"""A stand-in engine for tests, screenshots and `--fake` development runs.

It is a `ChatEngine` (mtpchat/chat/engine.py): it speaks the Engine API (generate yields Prefilled, Step..., Finished; live `mtp` and
`draft_tokens`; thread-safe `cancel()`; `memory()`), with a deterministic acceptance pattern and
simulated phase times, so every number the app shows is reproducible. Nothing here reads a clock:
`elapsed_ms` is simulated time. `step_delay` (real seconds per step) and `gate` (an Event each step
waits on) only let a test act while a reply is running.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from mtpchat.app.gpu import GpuSample
from mtpchat.settings import MAX_DRAFT_TOKENS
from mtpchat.chat.think import prompt_opens_think
from mtpchat.engine.events import Finished, PhaseTimes, Prefilled, Stats, Step, TokenLogprob

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
EOS = 2                                   # <|im_end|>
_PIECE = re.compile(r" ?\w+| ?[^\w\s]+|\s+")

DEFAULT_THINKING = (
    "The user wants a short, concrete answer. Speculative decoding lets a small draft propose "
    "tokens that the full model then verifies in one forward pass, so I should explain that and "
    "give a runnable example."
)
DEFAULT_ANSWER = """\
## Self-speculative decoding

The model's **MTP head** drafts a few tokens; one forward pass of the target checks them all:

1. draft `k` tokens with the MTP head
2. verify `k + 1` positions at once
3. keep the longest accepted prefix, plus one bonus token

```python
def step(state, k):
    drafts = mtp.draft(state, k)
    accepted = target.verify(state, drafts)
    return accepted + 1
```

Output is identical to plain decoding; only the speed changes.
"""
# drafts accepted per speculative step, cycled (clipped to the live draft count): easy stretches
# (boilerplate, code) and hard ones, so the history sparkline has a shape
ACCEPT_PATTERN = (3, 3, 2, 3, 3, 3, 1, 3, 2, 3, 1, 0, 2, 1, 0, 1, 2, 0, 1, 3, 2, 3, 3, 3, 2, 0, 3, 3, 1, 3)


def fake_logprobs(ids, params) -> tuple[TokenLogprob, ...] | None:
    """Made-up logprobs where the params ask for them: each token likely, then the specials after it."""
    top = getattr(params, "logprobs", None)
    if top is None:
        return None
    made = lambda t, i: -0.05 * (1 + (t + i) % 7)
    return tuple(TokenLogprob(t, made(t, 0), tuple((t, made(t, 0)) if j == 0 else (j - 1, made(t, 0) - j)
                                                   for j in range(top)))
                 for t in ids)


class FakeTokenizer:
    """Word-piece ids assigned on first sight; the specials have fixed ids 0..4."""
    chat_template: str | None = None     # none to read: no preserve_thinking to offer

    def __init__(self):
        self._lock = threading.Lock()
        self._pieces: list[str] = list(SPECIALS)
        self._ids: dict[str, int] = {p: i for i, p in enumerate(SPECIALS)}
        self.eos_token_ids = [EOS, 0]
        self.think_start_id, self.think_end_id = 3, 4

    def _id(self, piece: str) -> int:
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            return self._ids[piece]

    def encode(self, text: str) -> list[int]:
        # user text is never parsed for special tokens: "<think>" typed by a user stays plain pieces
        return [self._id("\x00" + p if p in SPECIALS else p) for p in _PIECE.findall(text)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            if skip_special_tokens and i in (0, 1, 2):
                continue
            out.append(self._pieces[i].removeprefix("\x00"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = True) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [1] + self.encode(m["role"] + "\n" + m["content"]) + [2] + self.encode("\n")
        if add_generation_prompt:
            ids += [1] + self.encode("assistant\n")
            ids += [3] + self.encode("\n") if enable_thinking else [3] + self.encode("\n\n") + [4] + self.encode("\n\n")
        return ids

    def stream(self) -> "FakeDecodeStream":
        return FakeDecodeStream(self)


class FakeDecodeStream:
    def __init__(self, tok: FakeTokenizer):
        self._tok = tok

    def push(self, ids) -> str:
        return self._tok.decode(ids)

    def flush(self) -> str:
        return ""


@dataclass
class FakeTimes:
    """Simulated milliseconds per phase: verify grows with the window, drafting with k."""
    prefill_per_token: float = 0.12
    first_sample: float = 1.5
    draft_per_token: float = 0.9
    verify_base: float = 11.0
    verify_per_token: float = 0.4
    accept: float = 0.3
    host: float = 0.2


class FakeEngine:
    def __init__(self, *, name: str = "fake-model", device: str = "cpu", mtp: bool = True,
                 draft_tokens: int = 3, k_max: int = MAX_DRAFT_TOKENS, mtp_available: bool = True,
                 answer: str = DEFAULT_ANSWER, thinking: str = DEFAULT_THINKING,
                 step_delay: float = 0.0, fail_after: int | None = None,
                 times: FakeTimes | None = None, max_context: int = 4096, weight_format: str | None = None):
        self.name = name
        self.device = device
        self.dtype = "bfloat16" if device == "cuda" else "float32"
        self.max_context = max_context
        self.k_max = k_max
        self.mtp_available = mtp_available
        self.mtp = mtp and mtp_available
        self.draft_tokens = draft_tokens
        self.tokenizer = FakeTokenizer()
        self.answer, self.thinking = answer, thinking
        self.step_delay = step_delay
        self.fail_after = fail_after
        self.times = times or FakeTimes()
        self.gate = threading.Event()
        self.gate.set()
        self.stop_ids = (EOS, 0)
        self.notices: list[str] = []
        self.fixed, self.spec_estimate = "", False
        self.weight_format = weight_format or ("bf16" if device == "cuda" else "float32")
        self.moe_layers = 0
        self.step_log: list[tuple[bool, int]] = []   # (mtp, draft count) of every step, in order
        self.tokens_emitted = 0
        self.resets = 0
        self._cancel = threading.Event()
        self._steps = threading.Condition()

    # --- the Engine API ---
    def cancel(self) -> None:
        self._cancel.set()

    def reset(self) -> None:
        self.resets += 1

    def memory(self) -> dict[str, int]:
        gib = 1 << 30
        return {"weights": int(50.1 * gib), "kv": int(4.0 * gib), "mtp_kv": int(0.25 * gib),
                "gdn_state": int(0.86 * gib), "graph_pool": int(0.4 * gib), "workspace": int(0.3 * gib)}

    def generate(self, prompt_ids, params, snapshot_at=()):
        self._cancel.clear()
        t = self.times
        tok = self.tokenizer
        inside_think = prompt_opens_think(tok, prompt_ids)
        text = (self.thinking + "\n</think>\n\n" if inside_think else "") + self.answer
        script = tok.encode(text) + [EOS]

        stats = Stats(prompt_tokens=len(prompt_ids), prefill_ms=t.prefill_per_token * len(prompt_ids))
        stats.ttft_ms = stats.prefill_ms + t.first_sample
        yield Prefilled(prompt_tokens=len(prompt_ids), prefill_ms=stats.prefill_ms)

        emitted: list[int] = []
        clock = stats.ttft_ms
        reason = "stop"
        while len(emitted) < len(script):
            self.gate.wait()
            if self.step_delay:
                time.sleep(self.step_delay)
            if self._cancel.is_set():
                reason = "cancelled"
                break
            if self.fail_after is not None and stats.steps >= self.fail_after:
                raise RuntimeError("simulated engine failure")
            first = not emitted
            spec = self.mtp and not first
            k = max(1, min(self.draft_tokens, self.k_max)) if spec else 0
            a = min(ACCEPT_PATTERN[stats.verify_steps % len(ACCEPT_PATTERN)], k) if spec else 0
            n = min(a + 1, len(script) - len(emitted), params.max_tokens - len(emitted))
            a = min(a, n - 1)
            ids = tuple(script[len(emitted):len(emitted) + n])
            if first:
                times = PhaseTimes(host=t.host)
            else:
                times = PhaseTimes(draft=t.draft_per_token * k, verify=t.verify_base + t.verify_per_token * k,
                                   accept=t.accept if spec else 0.0, host=t.host)
                clock += times.total
                stats.decode_ms = clock - stats.ttft_ms
            emitted += ids
            stats.new_tokens = len(emitted)
            stats.steps += 1
            if spec:
                stats.verify_steps += 1
                stats.drafted += k
                stats.accepted += a
                while len(stats.accepted_at_least) < k:
                    stats.accepted_at_least.append(0)
                for i in range(a):
                    stats.accepted_at_least[i] += 1
            p = stats.phase_ms
            stats.phase_ms = PhaseTimes(p.draft + times.draft, p.verify + times.verify,
                                        p.accept + times.accept, p.host + times.host)
            self.tokens_emitted += n
            with self._steps:
                self.step_log.append((spec, k))
                self._steps.notify_all()
            yield Step(token_ids=ids, from_draft=(True,) * a + (False,) * (n - a), drafted=k, accepted=a,
                       mtp=spec, times=times, elapsed_ms=clock, logprobs=fake_logprobs(ids, params))
            if len(emitted) >= params.max_tokens and emitted[-1] != EOS:
                reason = "length"
                break
        yield Finished(reason=reason, stats=stats, token_ids=tuple(emitted))

    # --- test helpers ---
    def wait_for_steps(self, n: int, timeout: float = 10.0) -> bool:
        """Block until at least n steps have been yielded in total (call from a thread, not the loop)."""
        with self._steps:
            return self._steps.wait_for(lambda: len(self.step_log) >= n, timeout)


@dataclass
class FakeGpu:
    """A GPU probe with fixed readings; the energy counter advances 9.7 J per token the engine emitted."""
    engine: FakeEngine | None = None
    name: str = "NVIDIA H100 80GB HBM3"
    used: int = int(61.3 * (1 << 30))
    total: int = int(79.6 * (1 << 30))
    power_w: float = 412.0
    joules_per_token: float = 9.7

    def sample(self):
        tokens = self.engine.tokens_emitted if self.engine else 0
        return GpuSample(name=self.name, used=self.used, total=self.total, power_w=self.power_w,
                         energy_j=1000.0 + self.joules_per_token * tokens, tokens=tokens)
