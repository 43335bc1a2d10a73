"""The decode loop over one sequence: prefill, then decode or speculative steps that commit and
roll back the state on the device. Positions follow qwen35-model.md §6:

- x_0..x_{L-1} have been fed to the target (L = `pos` on the device, `length` on the host);
  `next_tok` x_L is chosen but not yet fed.
- The MTP head's row p takes (x_{p+1}, h_p). Its KV is complete up to the *pending* rows: the
  last `pend_n` positions, whose hiddens and next tokens wait in `pend_hidden` / `pend_tokens`.
  A speculative step first runs the head over a fixed k_max+1 pending rows (rows past `pend_n`
  write KV beyond L that is overwritten before anything reads it), takes d_1 from row pend_n-1,
  then chains d_2..d_k on the head's own output.
- The verify feeds [x_L, d_1..d_k] at L..L+k; of the a+1 accepted tokens the step emits n: up to
  and including the first stop id, and no more than `room` (what the token limit and the context
  leave). It commits them on the device: the conv offset moved on by n, GDN fold n (the next step folds those
  tokens into the recurrent states first; engine/state.py), L += n, next token, pending rows = the
  verified rows. A stop id or an exhausted room sets `room` to 0, after which a step
  emits nothing and writes no state (the kernels that write the conv windows, the in_proj's with
  the conv in it among them, and the recurrent states read `room` as their `live` flag; the other
  writes land past the committed rows).
- So the host never has to intervene: it can launch step s+1 before it reads step s (a CUDA
  device runs them back to back while the host handles the tokens), and learns (n, a, tokens) by
  one small copy per step into pinned memory.

Each phase (draft k, verify k, accept k) is a pure function of these preallocated buffers, so
engine/runner.py can capture it as a CUDA graph; eagerly, the same code runs on any device. Every
forward runs in the forms of the engine's kernel plan (engine/plan.py), fixed for the decoder's life.

A chat turn starts from the longest usable start (`begin`): the state itself when the prompt extends
the tokens fed so far, else the longest snapshot of the state that begins the prompt
(engine/snapshots.py), else nothing. The decoder's parts: the state (engine/state.py), the
snapshots, and the trimmed draft head's rows (engine/draft_vocab.py: DraftRows).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from mtpchat.engine.memory import CAPTURED_K, EARLY_GRAPHS, chunk_attention_floats, prefill_graph_sizes
from mtpchat.engine.dispatch import Ctx, linear
from mtpchat.engine.draft_vocab import DraftRows, four_bit_rows
from mtpchat.engine.events import PhaseTimes
from mtpchat.engine.model import SparseMoE
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.runner import elapsed_ms
from mtpchat.engine.sampling import SamplingParams, process_logits, sample
from mtpchat.engine.snapshots import Snapshots, begins
from mtpchat.engine.spec import accept_sampled, seen_rows
from mtpchat.kernels import gdn
from mtpchat.kernels.accept import (AcceptBuffers, accept_greedy, argmax_partials_buffers, chain_start, chain_start_ref,
                                    commit_ref, pick_argmax)


@dataclass
class StepResult:
    tokens: list[int]
    from_draft: list[bool]
    accepted: int
    times: PhaseTimes
    experts_read: tuple[int, int] = (0, 0)   # an MoE model: distinct experts the target's / the head's layers read


@dataclass
class Launched:
    """A step on its way: what `finish` needs to read it."""
    k: int
    out: torch.Tensor          # [n, a, tokens...]: pinned host memory on CUDA
    done: object               # a CUDA event after the copy, or None
    times: list
    reads: torch.Tensor | None = None   # an MoE model: the expert-read counters after the step
    why: str = ""              # why the step has k drafts (engine/policy.py), for the telemetry


class Decoder:
    """One sequence's decode loop."""

    def __init__(self, model, head, state, plan: KernelPlan, prefill_chunk: int, snapshots: int = 0,
                 count_experts: bool = True, four_bit: bool = False):
        self.model, self.head, self.state, self.prefill_chunk = model, head, state, prefill_chunk
        self.plan = plan
        self.snapshots = Snapshots(model.c, snapshots, state.fold.device, model.embed.dtype)
        # the head's catch-up rows inside a step: the captured ks' (engine/memory.py CAPTURED_K)
        # K1: the rows of the largest step (k_max drafts and the next token)
        c, dev, R, K1 = model.c, state.fold.device, min(state.k_max, CAPTURED_K) + 1, state.k_max + 1
        self.device, self.R = dev, R
        long = lambda *n: torch.zeros(*n, dtype=torch.long, device=dev)
        self.pos, self.pend_n = long(1), long(1)
        # [x_L, d_1..d_k_max]: the next token and the drafts side by side, so a verify feeds a view
        self.fed = long(K1)
        self.next_tok, self.drafts = self.fed[:1], self.fed[1:]
        self.steps = torch.arange(K1, device=dev)   # 0..K1-1, for positions with no arange per step
        self.conv_cols = torch.arange(c.linear_conv_kernel_dim - 1, device=dev)
        self.room, self.gen = long(1), long(1)   # tokens the generation may still emit / has emitted
        self.is_stop = torch.zeros(c.vocab_size, dtype=torch.bool, device=dev)
        rows = max(plan.pending_rows, R) + K1     # a step writes k+1 rows after at most that many pending
        self.pend_hidden = torch.zeros(rows, c.hidden_size, device=dev, dtype=model.embed.dtype)
        self.pend_tokens = long(rows)
        self.v_hidden = torch.zeros(K1, c.hidden_size, device=dev, dtype=model.embed.dtype)
        # a short prefill's chunks replayed as graphs (the plan's prefill_graphs): their tokens, hiddens
        # (as large as the memory plan's sizes for this model whatever this plan's, so a plan swapped
        # in may take them; larger where this plan's are; `four_bit`: the model's products are 4-bit)
        sizes = (*prefill_graph_sizes(c, four_bit, plan.products.int4_prefill_rows), *plan.prefill_graphs)
        early = (*EARLY_GRAPHS, *plan.prefill_early)
        most = max((*sizes, *early), default=1)
        self.chunk_ids = long(most)
        self.chunk_hidden = torch.zeros(most, c.hidden_size, device=dev, dtype=model.embed.dtype)
        # and their attention's partials, one workspace for every size (rather than one each in the
        # graphs' pool: 895 MiB for sizes of 8..128 on the 27B at 8K, docs/PERFORMANCE.md 2026-11-28);
        # the early chunks' over the cache's first rows alone
        self.chunk_attention = None
        if (plan.prefill_graphs or plan.prefill_early) and dev.type == "cuda":
            floats = chunk_attention_floats(c, sizes, state.rows, model.embed.element_size(), early,
                                            plan.prefill_early_rows)
            self.chunk_attention = torch.empty(floats, dtype=torch.float32, device=dev)
        self.v_logits = torch.zeros(K1, c.vocab_size, device=dev)
        self.result = long(K1 + 2)            # [n, a, tokens...]: the one device-to-host copy
        # a few pinned copies of it, used in turn, so a step's result is never overwritten unread
        self.host_results = [torch.zeros(K1 + 2, dtype=torch.long, pin_memory=dev.type == "cuda") for _ in range(4)]
        self.launched = self.read = self.most_in_flight = 0   # steps launched / read; the most unread at once
        self.seen = torch.zeros(c.vocab_size, dtype=torch.int32, device=dev)   # presence-penalty counts
        self.partials = argmax_partials_buffers(K1, c.vocab_size, dev)        # the greedy accept's argmax chunks
        # what acceptance reads and commits, named once for kernels/accept.py
        self.accept_bufs = AcceptBuffers(self.is_stop, self.room, self.pos, self.gen, self.next_tok, state.fold,
                                         state.parity, state.conv_off, self.seen, self.v_hidden,
                                         self.pend_hidden if head is not None else None,
                                         self.pend_tokens if head is not None else None, self.pend_n, self.result)
        # an MoE model's layers count the distinct experts a step reads (kernels/moe.py): the
        # target's and the head's counters, copied to the host with each step's result
        self.expert_reads = None
        if c.is_moe and count_experts:     # (a scratch decoder leaves the engine's counters bound)
            self.expert_reads = long(2)
            for i, part in enumerate((model, head)):
                for m in (part.modules() if part is not None else ()):
                    if isinstance(m, SparseMoE):
                        m.reads = self.expert_reads[i:i + 1]
            self.host_reads = [torch.zeros(2, dtype=torch.long, pin_memory=dev.type == "cuda") for _ in range(4)]
        self.draft_rows: DraftRows | None = None   # the trimmed draft vocabulary's head, or None
        self.draft_row = long(1)             # the trimmed head's argmax, before its map to a token id
        self.drafter = None                  # optional ProfileDrafter (engine/spec.py)
        self.fold_stream = None              # the GDN fold's stream beside a draft (plan.fold_beside_draft)
        self.gdn_gates = None                # its layers' A_log and dt_bias stacked [layers, Hv], made at its first use
        # the sampled acceptance rule (engine/spec.py): (logits, drafts, params, seen rows, generator)
        # -> (a, tokens); a value so that a test can hand the step a deliberately broken one
        self.accept_rule = accept_sampled
        self.runner = None                   # engine/runner.py sets itself here on CUDA
        self.reset()

    def nbytes(self) -> int:
        bufs = (self.pend_hidden, self.pend_tokens, self.v_hidden, self.v_logits, self.seen, self.fed, self.steps,
                self.is_stop, self.draft_row, self.chunk_ids, self.chunk_hidden, *self.partials,
                *((self.chunk_attention,) if self.chunk_attention is not None else ()))
        return sum(t.numel() * t.element_size() for t in bufs)

    @property
    def length(self) -> int:
        return self.state.length

    def reset(self):
        self.state.reset()
        for t in (self.pos, self.next_tok, self.pend_n, self.room, self.gen):
            t.zero_()
        if self.expert_reads is not None:
            self.expert_reads.zero_()
            self.reads_seen = (0, 0)
        self.tokens: list[int] = []          # fed to the target, on the host
        self.pending = 0                     # host mirror of pend_n
        self.generated = 0                   # tokens emitted in this generation

    def _ctx(self, start, T: int, step: bool, rows: torch.Tensor | None = None) -> Ctx:
        # a device start ([1]) stands for the T consecutive positions from it (kernels/rope.py)
        positions = torch.arange(start, start + T, device=self.device) if isinstance(start, int) else start
        return Ctx(positions, start, step, self.state.conv_off, self.state.fold, self.state.parity, self.plan,
                   live=self.room if step else None, rows=rows)

    def logits(self, hidden: torch.Tensor, rowwise: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.logits(hidden, self.plan.products, rowwise, out)

    # --- a chat turn ---------------------------------------------------------------------------
    def begin(self, prompt: list[int], snapshot_at: tuple[int, ...] = ()) -> int:
        """Start a turn from the longest usable start (module docstring) and prefill the rest,
        keeping a snapshot at each position of `snapshot_at` on the way. Returns how many prompt
        tokens were reused. A snapshot needs no copy of the attention KV: the caches still hold
        those rows below its length as long as nothing wrote other tokens there, which holds for
        the snapshots kept here: those that begin both the tokens fed and the new prompt."""
        L = len(self.tokens)
        if not (0 < L < len(prompt) and prompt[:L] == self.tokens):
            snap = self.snapshots.best(prompt, self.tokens)
            if snap is None:
                self.reset()
            else:
                self._restore(snap)
            L = self.state.length
        # what the prefill overwrites voids every snapshot that does not begin this prompt
        self.snapshots.keep_only(lambda t: begins(t, self.tokens) and begins(t, prompt))
        if self.pending:
            self.pend_tokens[self.pending - 1] = prompt[L]         # the token that follows, as fed now
        self.generated = 0
        self.seen.zero_()
        start = L
        cuts = {c for c in snapshot_at if L < c < len(prompt)} if self.snapshots.count else set()
        for cut in sorted(cuts) + [len(prompt)]:
            h = self.prefill(prompt[start:cut])
            self.pend_hidden[:1] = h                               # the last row waits for its next token
            if cut < len(prompt):
                self._pending_one()
                self.snapshot()
                if self.pending:
                    self.pend_tokens[0] = prompt[cut]
            start = cut
        self.last_logits = self.logits(h) if self.prefill_logits is None else self.prefill_logits.clone()
        return L

    def _pending_one(self):
        """After a prefill: its last row is the head's one pending row."""
        self.pending = 1 if self.head is not None else 0
        self.pend_n.fill_(self.pending)

    def snapshot(self):
        """Keep the state at the tokens fed so far (engine/snapshots.py), the head's pending rows
        but the last run first, so that its KV is complete below that row."""
        if not self.snapshots.count or not self.tokens:
            return
        self._flush_pending(keep_last=True)
        mixers = [layer.mixer for layer in self.model.layers if layer.kind != "full_attention"]
        hidden = self.pend_hidden[self.pending - 1] if self.pending else None
        self.snapshots.save(tuple(self.tokens), self.state, mixers, self.conv_cols, hidden, self.plan.any_stride)

    def _restore(self, snap):
        """Make the state what it was when `snap` was taken (its KV rows are still in the caches)."""
        self.snapshots.restore(snap, self.state, self.pend_hidden[:1])
        self.tokens = list(snap.tokens)
        self.pos.fill_(self.state.length)
        self._pending_one()

    # --- prefill (eager chunks, or short ones through the step and chunk graphs) -----------------
    def prefill(self, ids: list[int], keep_all: bool = False) -> torch.Tensor:
        """Feed `ids` after the committed tokens, in chunks; where they are few, in the pieces of
        `prefill_pieces` (the plan's): chunks of the sizes captured as graphs and pieces of a step's
        rows through the verify phase. The head follows over every row whose next token is known.
        Returns the last hidden, or every hidden with keep_all. `prefill_logits`: the last row's
        logits where the step form computed them, else None."""
        self._flush_pending(keep_last=False)
        kept = []
        self.prefill_logits = None
        p = self.plan
        pieces = prefill_pieces(len(ids), self.R, p.step_prefill, p.prefill_graphs, p.prefill_pieces,
                                self.state.length, p.prefill_early, p.prefill_early_rows, p.prefill_early_beside)
        if pieces is None:
            size = chunk_size(len(ids), self.prefill_chunk)
            pieces = [(min(size, len(ids) - s), None) for s in range(0, len(ids), size)]
        s = 0
        for T, form in pieces:
            chunk, L = ids[s:s + T], self.state.length
            s += T
            if form == "step":
                h = self._prefill_step(chunk)
            else:
                h = (self._prefill_graphed(chunk) if form == "graph" else
                     self.model(torch.tensor(chunk, device=self.device), self.state.layers, self._ctx(L, T, False)))
                self.state.fold.zero_()                            # the GDN layers folded the last step in
                self.state.commit_prefill(T)
            self.prefill_logits = self.v_logits[T - 1:T] if form == "step" else None
            self.tokens += chunk
            nxt = ids[s - T + 1:s + 1]                             # x_{p+1} of each row, where known
            if self.head is not None and nxt:
                self._run_head(torch.tensor(nxt, device=self.device), h[:len(nxt)], L)
            kept.append(h if keep_all else h[-1:])
        self.pos.fill_(self.state.length)
        return torch.cat(kept) if keep_all else kept[-1]

    def _prefill_graphed(self, chunk: list[int]) -> torch.Tensor:
        """A chunk of a short prefill in one of the sizes captured at load: its graph's replay
        (eagerly where none is), its start read on the device. Returns the T hiddens (a copy)."""
        T = len(chunk)
        self.chunk_ids[:T] = torch.tensor(chunk, device=self.device)
        self.pos.fill_(self.state.length)
        self._run(self.chunk_key(T), lambda: self.prefill_chunk_forward(T))
        return self.chunk_hidden[:T].clone()

    def _attention_rows(self, T: int) -> int | None:
        """The caches' rows a chunk of T tokens attends over: an early size's first
        prefill_early_rows (prefill_pieces takes it only where the chunk ends within them), else all."""
        return self.plan.prefill_early_rows if T in self.plan.prefill_early else None

    def chunk_key(self, T: int) -> tuple:
        """A prefill chunk's graph: ("prefill", T); an early size's names the rows its attention
        reads too, so that a plan swapped in with other rows (a benchmark's) finds no graph and
        runs the chunk eagerly rather than replaying one that reads too few."""
        rows = self._attention_rows(T)
        return ("prefill", T) if rows is None else ("prefill", T, rows)

    def prefill_chunk_forward(self, T: int):
        """The target over chunk_ids[:T] at the device position `pos`, in the prefill form, into
        chunk_hidden: a pure function of the buffers, so engine/runner.py captures it per size."""
        ctx = dataclasses.replace(self._ctx(self.pos, T, False), attention_workspace=self.chunk_attention,
                                  attention_rows=self._attention_rows(T))
        self.model(self.chunk_ids[:T], self.state.layers, ctx, out=self.chunk_hidden[:T])

    def _prefill_step(self, chunk: list[int]) -> torch.Tensor:
        """A piece of a short prefill: the verify of its T <= R tokens at the committed length (its
        graph where captured), every row kept as an acceptance of T tokens keeps them, but for the
        step's own bookkeeping (emitted tokens, pending rows), which a prefill does not touch; `room`
        is 1 while the step kernels run (they write the state only then), 0 after, until limit().
        Returns the T hiddens (a copy: the next verify overwrites its buffer)."""
        T = len(chunk)
        self.fed[:T] = torch.tensor(chunk, device=self.device)
        self.pos.fill_(self.state.length)
        self.room.fill_(1)                     # the step kernels write the state only while room > 0
        before = self.expert_reads.clone() if self.expert_reads is not None else None
        self._run(("verify", T - 1), lambda: self.verify(T - 1))
        if before is not None:
            self.expert_reads.copy_(before)    # the experts a prefill reads are no step's
        self.room.zero_()                      # nothing is emitted until the generation's limit()
        self.state.commit_step(T)
        return self.v_hidden[:T].clone()

    def _run(self, key, fn):
        """A phase or a prefill chunk: its graph where the runner captured one (CUDA), else eagerly;
        a pair of CUDA events or a time in ms (runner.elapsed_ms reads either)."""
        return self.runner.run(key, fn) if self.runner is not None else _eager(key, fn)

    def first_token(self, params: SamplingParams, generator) -> int:
        tok = self._sample(self.last_logits, params, generator, self.drafts[:0])
        self.next_tok.copy_(tok)
        self.pend_tokens[:1] = tok
        self.pend_n.fill_(1 if self.head is not None else 0)
        self.pending = int(self.pend_n)
        self.last = int(tok)
        self.seen.index_add_(0, tok, torch.ones(1, dtype=torch.int32, device=self.device))
        self.generated = 1
        self.gen.fill_(1)
        return self.last

    def limit(self, room: int, stop: set[int]):
        """What the steps of this generation may emit: at most `room` tokens, ending at a stop id."""
        self.room.fill_(max(0, room))
        self.is_stop.zero_()
        ids = [t for t in stop if 0 <= t < self.is_stop.numel()]
        if ids:
            self.is_stop[torch.tensor(ids, device=self.device)] = True

    # --- the head ------------------------------------------------------------------------------
    def _run_head(self, ids, hidden, start):
        """The head over rows at positions start.. (prefill form): fills its KV, returns its output."""
        T = ids.shape[0]
        return self.head(self.model.embed, ids, hidden, self.state.mtp, self._ctx(start, T, step=False))

    def _flush_pending(self, keep_last: bool):
        """Run the head over the pending rows (all, or all but the last) outside the step graphs."""
        n = self.pending - (1 if keep_last else 0)
        if self.head is None or n <= 0:
            return
        start = self.state.length - self.pending
        self._run_head(self.pend_tokens[:n], self.pend_hidden[:n], start)
        if keep_last:
            self.pend_hidden[:1] = self.pend_hidden[n:n + 1].clone()
            self.pend_tokens[:1] = self.pend_tokens[n:n + 1].clone()
        self.pending = 1 if keep_last else 0
        self.pend_n.fill_(self.pending)

    # --- the trimmed draft vocabulary (engine/draft_vocab.py) ----------------------------------
    def trim_draft_head(self, ids: list[int], context: int):
        """Draft from the lm_head rows of `ids` (ascending) and `context` rows for the tokens of the
        prompt and the reply outside them; in 4 bits under the plan's draft_head_int4, where the
        rows take whole groups (draft_vocab.four_bit_rows)."""
        four_bit = self.plan.draft_head_int4 and four_bit_rows(self.model.head.shape[1])
        self.draft_rows = DraftRows(self.model.head, ids, context, four_bit, self.plan.products.int4_interleave)

    def draft_context(self, tokens: list[int]):
        if self.draft_rows is not None:
            self.draft_rows.take(tokens)

    # --- the three phases of a step: pure functions of the buffers above -----------------------
    def draft(self, k: int):
        """Catch the head up over R (CAPTURED_K+1) pending rows, then draft k tokens greedily into
        `drafts`; under the plan's fold_beside_draft, the GDN layers fold the last step's accepted
        tokens meanwhile (_fold_beside)."""
        beside = self._fold_beside()
        self._draft(k)
        if beside is not None:
            torch.cuda.current_stream().wait_stream(beside)

    def _fold_beside(self):
        """Under fold_beside_draft: the committed tokens still to fold run into every GDN layer's
        state in one launch (kernels/gdn.py fold_pending_layers: the kernel a step folds them with,
        in the plan's form, any_stride; fold_beside_draft layers a program), then fold is 0, so the
        verify after the draft folds none; on a second stream where the draft runs on a GPU
        (returned, for the draft to wait on at its end), else at once. The head reads no GDN state.
        A step launched after its generation ended folds too: the tokens it folds were committed,
        and the state with them run in and fold 0 is the same committed state."""
        if not self.plan.fold_beside_draft or not self.state.gdn_layers:
            return None
        if self.gdn_gates is None:       # the layers' gate parameters side by side, as the launch reads them
            mixers = [layer.mixer for layer in self.model.layers if layer.kind != "full_attention"]
            self.gdn_gates = tuple(torch.stack([getattr(m, name) for m in mixers]) for name in ("A_log", "dt_bias"))
        s = self.state

        def fold():
            gdn.fold_pending_layers(s.gdn_states, s.gdn_pends, s.fold, s.parity, *self.gdn_gates, self.plan.any_stride,
                                    self.plan.fold_beside_draft)
            s.fold.zero_()

        if self.device.type != "cuda":
            fold()
            return None
        if self.fold_stream is None:
            self.fold_stream = torch.cuda.Stream(self.device, priority=0)     # CUDA's lowest (runner.capture_stream)
        self.fold_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.fold_stream):
            fold()
        return self.fold_stream

    def _draft(self, k: int):
        R, L = self.R, self.pos
        start = L - self.pend_n
        # rows past pend_n are stale: an MoE head routes them as the last live one, reading no more experts
        out = self.head(self.model.embed, self.pend_tokens[:R], self.pend_hidden[:R], self.state.mtp,
                        self._ctx(start, R, step=True, rows=self.pend_n))
        # the row at position L-1, and the chained drafts' positions L, L+1, ...
        hand_off = chain_start if self.plan.draft_chain else chain_start_ref
        out, chain = hand_off(out, self.pend_n, L, self.steps[:k - 1])
        self._greedy(out, self.drafts[:1])
        for j in range(1, k):
            at = chain[j - 1:j]
            out = self.head(self.model.embed, self.drafts[j - 1:j], out, self.state.mtp, self._ctx(at, 1, step=True))
            self._greedy(out, self.drafts[j:j + 1])

    def _greedy(self, hidden: torch.Tensor, into: torch.Tensor):
        """The head's greedy token, written into `into`: the argmax of the logits in the model's
        dtype (widening them to float32 first would pick the same token, one kernel later), over
        the trimmed draft vocabulary when there is one (engine/draft_vocab.py). With the plan's
        draft_pick, on the GPU, the argmax and the map to a token id run as two PDL kernels rather
        than torch's argmax and index_select (kernels/accept.py pick_argmax)."""
        w, ids = (self.draft_rows.w, self.draft_rows.ids) if self.draft_rows is not None else (self.model.head, None)
        scores = linear(hidden, w, True, self.plan.products)
        if self.plan.draft_pick and hidden.is_cuda:
            pick_argmax(scores, ids, into, self.partials)
        elif ids is None:
            torch.argmax(scores, dim=-1, out=into)
        else:
            torch.argmax(scores, dim=-1, out=self.draft_row)      # a row of w
            torch.index_select(ids, 0, self.draft_row, out=into)

    def verify(self, k: int):
        """The target over [x_L, d_1..d_k] at positions L..L+k."""
        h = self.model(self.fed[:k + 1], self.state.layers, self._ctx(self.pos, k + 1, step=True),
                       out=self.v_hidden[:k + 1])
        self.logits(h, out=self.v_logits[:k + 1])

    def accept(self, k: int, params: SamplingParams, generator):
        """Accept on the device; emit n of the a+1 accepted tokens (up to the first stop id, within
        `room`) and commit them: GDN fold, conv offset, length, next token, pending rows. With
        `room` 0 (the generation has ended) n is 0 and nothing changes (kernels/accept.py)."""
        logits, drafts = self.v_logits[:k + 1], self.drafts[:k]
        if params.greedy:                  # two kernels on CUDA, the torch reference elsewhere
            accept_greedy(logits, drafts, self.accept_bufs, self.partials)
            return
        if k == 0:
            a = torch.zeros(1, dtype=torch.long, device=self.device)
            out = self._sample(logits, params, generator, drafts)
        else:
            a, out = self.accept_rule(logits, drafts, params, seen_rows(self.seen > 0, drafts), generator)
        commit_ref(a, out, self.accept_bufs)    # sampling runs eagerly in torch: so does its commit

    def _sample(self, logits, params, generator, drafts) -> torch.Tensor:
        if params.greedy:
            return logits.argmax(-1)
        return sample(process_logits(logits, params, seen_rows(self.seen > 0, drafts)), generator)

    # --- one step, from the host ---------------------------------------------------------------
    def needs_flush(self, k: int, in_flight: list[int] = ()) -> bool:
        """Whether a step with k drafts must first run the head over the pending rows outside the
        graphs (MTP was off for a while), counting what launched but unread steps (their k) may
        add: a plain step adds its row, a speculative one restarts them."""
        if self.head is None:
            return False
        pending = self.pending
        for kf in in_flight:
            pending = (pending if kf == 0 else 0) + kf + 1
        return (k > 0 and pending > self.R) or pending >= self.plan.pending_rows

    def launch(self, k: int, params: SamplingParams, generator) -> Launched:
        """Queue one target forward: plain decode (k = 0) or a speculative step with k drafts. Needs
        no host sync, so the next step can be launched before this one is read (`finish`); a flush
        of the pending rows needs the host's count exact, so it must come with nothing in flight."""
        if self.needs_flush(k):
            self._flush_pending(keep_last=True)
        times = [0.0, 0.0, 0.0]
        if k:
            times[0] = self._run(("draft", k), lambda: self.draft(k))
            if self.drafter is not None:
                where = self.gen if getattr(self.drafter, "on_device", False) else self.generated
                drafts = self.drafter(where, self.drafts[:k])
                if not getattr(self.drafter, "writes_in_place", False):
                    self.drafts[:k] = drafts
        times[1] = self._run(("verify", k), lambda: self.verify(k))
        # greedy acceptance is captured per k; sampling runs eagerly (its parameters vary per request)
        times[2] = self._run(("accept", k) if params.greedy else ("accept, sampled", k),
                             lambda: self.accept(k, params, generator))
        slot = self.launched % len(self.host_results)
        out = self.host_results[slot][:k + 3]
        reads = self.host_reads[slot] if self.expert_reads is not None else None
        self.launched += 1
        done = None
        cuda = self.device.type == "cuda"
        out.copy_(self.result[:k + 3], non_blocking=cuda)
        if reads is not None:
            reads.copy_(self.expert_reads, non_blocking=cuda)
        if cuda:
            done = torch.cuda.Event()
            done.record()
        return Launched(k, out, done, times, reads)

    def finish(self, step: Launched) -> StepResult:
        """Read a launched step (waiting for it) and bring the host's mirror up to date."""
        self.most_in_flight = max(self.most_in_flight, self.launched - self.read)
        self.read += 1
        if step.done is not None:
            step.done.synchronize()
        n, a, *out = step.out.tolist()
        t = _clock()                                              # host time: after the device is done
        emitted = out[:n]
        if n:
            self.state.length += n
            self.tokens += [self.last] + emitted[:-1]             # x_L and the drafts it kept
            self.last = emitted[-1]
            self.pending = ((self.pending if step.k == 0 else 0) + n) if self.head is not None else 0
            self.generated += n
        read = (0, 0)
        if step.reads is not None:
            now = tuple(step.reads.tolist())
            read, self.reads_seen = (now[0] - self.reads_seen[0], now[1] - self.reads_seen[1]), now
        return StepResult(emitted, [i < a for i in range(n)], min(a, n),
                          PhaseTimes(*map(elapsed_ms, step.times), host=(_clock() - t) * 1e3), read)

    def step(self, k: int, params: SamplingParams, generator) -> StepResult:
        """Launch one step and read it."""
        return self.finish(self.launch(k, params, generator))


_clock = time.perf_counter


def chunk_size(n: int, most: int, multiple: int = 64) -> int:
    """The chunk a prefill of n tokens takes: as few chunks as `most` tokens each allow, of equal
    size rounded up to `multiple` (the chunked GDN's 64; the last takes the rest). A short last
    chunk costs what the host takes to launch a whole forward (some 50 ms on the 27B,
    docs/PERFORMANCE.md 2026-11-28): 8,195 tokens go as 4,160 + 4,035, not 8,192 + 3."""
    if n <= most:
        return most
    per = -(-n // -(-n // most))                      # n over the fewest chunks, rounded up
    return min(most, -(-per // multiple) * multiple)


def prefill_pieces(n: int, rows: int, step_pieces: int, sizes: tuple[int, ...], most: int, start: int = 0,
                   early: tuple[int, ...] = (), early_rows: int = 0, beside: int = 0) -> list | None:
    """How a short prefill of n tokens after `start` goes: [(tokens, "step" | "graph"), ...], or
    None (in chunks, eagerly): at most `step_pieces` equal pieces of at most `rows` tokens (a step's)
    in the step form, each about a decode step's time; else at most `most` chunks of the graphs'
    sizes, the largest that fit in turn (on the 27B some 2.5 steps' time each), those of `early` only
    where the chunk ends within the first `early_rows` positions, up to `beside` of them beside the
    `most` rather than among them; then the rest in step pieces."""
    out, rest, taken = [], n, 0
    for size in sorted({*sizes, *early}, reverse=True) if n > step_pieces * rows else ():
        is_early = size in early
        while rest >= size and len(out) < most + min(beside, taken + is_early) and \
                (not is_early or start + n - rest + size <= early_rows):
            out.append((size, "graph"))
            rest -= size
            taken += is_early
    if rest > step_pieces * rows:
        return None
    size = chunk_size(rest, rows, 1)
    return out + [(min(size, rest - s), "step") for s in range(0, rest, size)]


def eager_prefill_length(rows: int, step_pieces: int, sizes: tuple[int, ...], most: int,
                         early: tuple[int, ...] = (), early_rows: int = 0, beside: int = 0) -> int:
    """A prefill length that no route through the graphs takes from an empty cache (prefill_pieces
    gives None): the early chunks' rows, `most` chunks of the largest size and one token more than
    the step pieces hold, so it goes as eager chunks, whose own kernels (prefill attention's) a
    warm-up then compiles."""
    n = most * max(sizes, default=0) + step_pieces * rows + 1
    while prefill_pieces(n, rows, step_pieces, sizes, most, 0, early, early_rows, beside) is not None:
        n += 1
    return n


def _eager(key, fn) -> float:
    t = _clock()
    fn()
    return (_clock() - t) * 1e3
