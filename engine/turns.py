"""Chat turns: where a generation's prompt starts from, and the snapshots of the decode state a
later turn can resume from (engine/snapshots.py holds their slots).

A snapshot needs no copy of the attention KV: the caches still hold those rows below its length,
as long as nothing wrote other tokens there, which `begin` ensures by keeping only the snapshots
that begin both the tokens fed and the new prompt. Everything here runs between generations,
eagerly, outside the step graphs.
"""
from __future__ import annotations

from mtpchat.engine.snapshots import begins
from mtpchat.kernels import gdn


class Turns:
    """Mixed into the Decoder (engine/decoder.py): these methods use its state, its host mirror
    (`tokens`, `pending`) and the MTP head's pending rows."""

    def begin(self, prompt: list[int], snapshot_at: tuple[int, ...] = ()) -> int:
        """Start a turn from the longest usable start: the state itself when the prompt extends the
        tokens fed so far, else the longest snapshot that begins the prompt (engine/snapshots.py),
        else nothing. Prefill the rest, keeping a snapshot at each position of `snapshot_at` on the
        way. Returns how many prompt tokens were reused."""
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
        self.last_logits = self.model.logits(h)
        return L

    # --- snapshots of the state at a position (engine/snapshots.py) ----------------------------
    def _pending_one(self):
        """After a prefill: its last row is the head's one pending row."""
        self.pending = 1 if self.head is not None else 0
        self.pend_n.fill_(self.pending)

    def snapshot(self):
        """Keep the state at the tokens fed so far: per GDN layer the committed conv inputs and the
        recurrent state with the last step's tokens folded in, and the last row's hidden. The head
        first runs over its pending rows but the last, so its KV is complete below that row."""
        if not self.snapshots.count or not self.tokens:
            return
        self._flush_pending(keep_last=True)
        snap = self.snapshots.slot_for(tuple(self.tokens))
        i, st = snap.slot, self.state
        cols = st.conv_off + self.conv_cols                       # the committed columns, no host sync
        mixers = [layer.mixer for layer in self.model.layers if layer.kind != "full_attention"]
        for j, ((conv_buf, ssm, pend), m) in enumerate(zip(st.gdn_layers, mixers)):
            self.snapshots.conv[i, j].copy_(conv_buf.index_select(1, cols))
            self.snapshots.ssm[i, j].copy_(ssm)
            gdn.fold_pending(self.snapshots.ssm[i, j], pend, st.fold, st.parity, m.A_log, m.dt_bias)
        if self.pending:
            self.snapshots.hidden[i].copy_(self.pend_hidden[self.pending - 1])

    def _restore(self, snap):
        """Make the state what it was when `snap` was taken (its KV rows are still in the caches)."""
        i, st = snap.slot, self.state
        self.snapshots.touch(snap)
        for j, (conv_buf, ssm, _) in enumerate(st.gdn_layers):
            conv_buf[:, :st.kernel - 1].copy_(self.snapshots.conv[i, j])
            ssm.copy_(self.snapshots.ssm[i, j])
        for t in (st.conv_off, st.fold, st.parity):
            t.zero_()
        st.length = len(snap.tokens)
        self.tokens = list(snap.tokens)
        self.pos.fill_(st.length)
        self.pend_hidden[:1] = self.snapshots.hidden[i]
        self._pending_one()
