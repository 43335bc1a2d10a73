"""The decode loop over one sequence: prefill, decode steps and speculative steps, with commit and
rollback of the state. Position bookkeeping, in the notation of qwen35-model.md §6:

- `tokens` x_0..x_{L-1} have been fed to the target (L = state.length); `next_token` x_L is chosen
  but not yet fed; `hidden` holds the target's post-norm hiddens h_p for p in [mtp_len, L).
- The MTP head's KV is complete for positions < mtp_len. Its row p needs (x_{p+1}, h_p), so before
  drafting, a catch-up pass runs it over [mtp_len, L) and its last row gives the first draft. With
  MTP off the pending rows just accumulate, so MTP can be switched back on at any step.
- A step feeds [x_L, d_1..d_k] at positions L..L+k; accepting and emitting n tokens commits n of
  them: slot n-1 of the GDN ring, conv offset n, KV length L+n; nothing is copied or recomputed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mtpchat.engine.events import PhaseTimes
from mtpchat.engine.model import Ctx
from mtpchat.engine.sampling import SamplingParams, process_logits, sample
from mtpchat.engine.spec import accept_greedy, accept_sampled, seen_rows


@dataclass
class StepResult:
    tokens: list[int]
    from_draft: list[bool]
    accepted: int
    times: PhaseTimes


class Decoder:
    def __init__(self, model, head, state, prefill_chunk: int):
        self.model, self.head, self.state, self.prefill_chunk = model, head, state, prefill_chunk
        self.device = state.slot.device
        self.drafter = None   # optional ProfileDrafter (engine/spec.py) replacing the head's tokens
        self.reset()

    @property
    def length(self) -> int:
        return self.state.length

    def reset(self):
        self.state.reset()
        self.tokens: list[int] = []
        self.next_token: int | None = None
        self.hidden: list[torch.Tensor] = []
        self.mtp_len = 0
        self.last_logits: torch.Tensor | None = None

    def _ctx(self, start: int, T: int, step: bool) -> Ctx:
        positions = torch.arange(start, start + T, device=self.device)
        return Ctx(positions, start, step, self.state.conv_off, self.state.slot)

    def _caches(self):
        return self.state.layers

    # --- prefill -------------------------------------------------------------------------------
    def prefill(self, ids: list[int], keep_all: bool = False) -> torch.Tensor:
        """Feed `ids` after the committed tokens, in chunks. Returns the hidden of the last token,
        or of every token with keep_all."""
        kept = []
        for s in range(0, len(ids), self.prefill_chunk):
            chunk = ids[s:s + self.prefill_chunk]
            start = self.state.length
            ctx = self._ctx(start, len(chunk), step=False)
            h = self.model(torch.tensor(chunk, device=self.device), self._caches(), ctx)
            self.state.commit(len(chunk), len(chunk), step=False)
            self.tokens += chunk
            self.hidden.append(h)
            self._catch_up_mtp(known_next=ids[s + len(chunk)] if s + len(chunk) < len(ids) else None)
            kept.append(h if keep_all else h[-1:])
        return torch.cat(kept) if keep_all else kept[-1]

    def begin(self, prompt: list[int]) -> int:
        """Start a turn: reuse the state when the prompt extends the tokens fed so far. Returns how
        many prompt tokens were reused."""
        L = len(self.tokens)
        reuse = 0 < L < len(prompt) and prompt[:L] == self.tokens
        if not reuse:
            self.reset()
        self.next_token = None
        self.generated = 0    # tokens emitted in this generation
        self.seen = torch.zeros(self.model.c.vocab_size, dtype=torch.bool, device=self.device)
        h = self.prefill(prompt[L:] if reuse else prompt)
        self.last_logits = self.model.logits(h)
        return L if reuse else 0

    def first_token(self, params: SamplingParams, generator) -> int:
        tok = self._sample_one(self.last_logits, params, generator)
        self._set_next(tok)
        self.generated = 1
        return tok

    # --- steps ---------------------------------------------------------------------------------
    def step(self, k: int, params: SamplingParams, generator, budget: int, stop: set[int]) -> StepResult:
        """One target forward: plain decode (k = 0) or a speculative step with k drafts. Emits at
        most `budget` tokens and stops after a stop id, rolling the state back to what it emitted."""
        t0 = time.perf_counter()
        drafts = self._draft(k) if k else torch.empty(0, dtype=torch.long, device=self.device)
        t1 = time.perf_counter()
        L = self.state.length
        fed = torch.cat([torch.tensor([self.next_token], device=self.device), drafts])
        hidden = self.model(fed, self._caches(), self._ctx(L, k + 1, step=True))
        logits = self.last_logits = self.model.logits(hidden)
        t2 = time.perf_counter()
        if k == 0:
            a, out = torch.zeros(1, dtype=torch.long), self._sample_rows(logits, params, generator, drafts)
        elif params.greedy:
            a, out = accept_greedy(logits, drafts)
        else:
            a, out = accept_sampled(logits, drafts, params, seen_rows(self.seen, drafts), generator)
        t3 = time.perf_counter()
        a, *emitted = torch.cat([a.to(out.device), out]).tolist()   # the step's one device-to-host copy
        emitted = emitted[:a + 1]
        n = min(a + 1, budget)
        for i, tok in enumerate(emitted[:n]):
            if tok in stop:
                n = i + 1
                break
        emitted = emitted[:n]
        # commit n of the k+1 fed tokens: x_L and the first n-1 drafts
        self.state.commit(k + 1, n, step=True)
        self.tokens += [self.next_token] + emitted[:n - 1]
        self.hidden.append(hidden[:n])
        self._set_next(emitted[-1])
        self.generated += n
        for tok in emitted[:-1]:
            self.seen[tok] = True
        t4 = time.perf_counter()
        ms = lambda x, y: (y - x) * 1e3
        return StepResult(emitted, [i < a for i in range(n)], min(a, n), PhaseTimes(
            draft=ms(t0, t1), verify=ms(t1, t2), accept=ms(t2, t3), host=ms(t3, t4)))

    def _set_next(self, tok: int):
        self.next_token = tok
        self.seen[tok] = True

    def _sample_rows(self, logits, params, generator, drafts) -> torch.Tensor:
        if params.greedy:
            return logits.argmax(-1)
        return sample(process_logits(logits, params, seen_rows(self.seen, drafts)), generator)

    def _sample_one(self, logits, params, generator) -> int:
        return int(self._sample_rows(logits, params, generator, logits.new_empty(0, dtype=torch.long))[0])

    # --- the MTP head --------------------------------------------------------------------------
    def _catch_up_mtp(self, known_next: int | None):
        """Run the head over the pending positions whose next token is known, filling its KV.
        Returns the head's output for the last of them (None if nothing ran)."""
        if self.head is None:
            self.hidden = []
            return None
        L = self.state.length
        upto = L if (known_next is not None or self.next_token is not None) else L - 1
        if upto <= self.mtp_len:
            return None
        hidden = torch.cat(self.hidden)                       # rows for positions [mtp_len, L)
        nxt = self.tokens[self.mtp_len + 1:L] + ([known_next if known_next is not None else self.next_token]
                                                   if upto == L else [])
        rows = hidden[:upto - self.mtp_len]
        T = rows.shape[0]
        ctx = self._ctx(self.mtp_len, T, step=T <= self.state.k_max + 1)
        out = self.head(self.model.embed, torch.tensor(nxt, device=self.device), rows, self.state.mtp, ctx)
        self.hidden = [hidden[upto - self.mtp_len:]]
        self.mtp_len = upto
        return out[-1:]

    def _draft(self, k: int) -> torch.Tensor:
        """k greedy drafts: the catch-up pass gives d_1, then the head chains on its own output."""
        out = self._catch_up_mtp(known_next=None)
        assert out is not None and self.mtp_len == self.state.length, "MTP catch-up must reach the last token"
        drafts = [self.model.logits(out).argmax(-1)]
        for j in range(1, k):
            ctx = self._ctx(self.state.length + j - 1, 1, step=True)
            out = self.head(self.model.embed, drafts[-1], out, self.state.mtp, ctx)
            drafts.append(self.model.logits(out).argmax(-1))
        drafts = torch.cat(drafts)
        if self.drafter is not None:
            drafts = self.drafter(self.generated, drafts)
        return drafts
