"""Exact-position snapshots of the decode state, so that a chat turn whose prompt does not extend
the tokens the engine holds still resumes where an earlier prompt or reply ended.

Why: Qwen's chat templates drop the <think> block of earlier assistant turns once a new user message
comes, so turn N+1's prompt leaves the tokens fed so far where turn N's reply began. The attention
KV caches roll back by length alone, but a GDN layer's conv window and recurrent state hold every
token fed: to resume at an earlier position they need a copy taken there.

A snapshot holds, per GDN layer, the K-1 committed conv inputs (model dtype) and the recurrent
state with every committed token folded in (float32), and the hidden state of its last position
(the MTP head's pending row: its next token comes with the new prompt). It serves a prompt that it
begins, strictly shorter, while it also begins the tokens whose KV the caches hold (a later turn
that wrote other tokens below its length voids it: `Decoder.begin` drops it then). Slots are
allocated once at load, counted by the memory plan, and reused least recently used first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpchat.engine.config import ModelConfig
from mtpchat.kernels import gdn


@dataclass
class Snapshot:
    tokens: tuple[int, ...]   # the tokens fed when it was taken; its length is its position
    slot: int
    used: int                 # the clock at its last use, for least-recently-used reuse


def begins(prefix: tuple[int, ...] | list[int], ids: list[int]) -> bool:
    n = len(prefix)
    return n <= len(ids) and tuple(ids[:n]) == tuple(prefix)


class Snapshots:
    def __init__(self, c: ModelConfig, count: int, device, dtype):
        n, hv = len(c.linear_layers), c.linear_num_value_heads
        self.count = count
        self.conv = torch.zeros(count, n, c.conv_dim, c.linear_conv_kernel_dim - 1, device=device, dtype=dtype)
        self.ssm = torch.zeros(count, n, hv, c.linear_key_head_dim, c.linear_value_head_dim, device=device,
                               dtype=torch.float32)
        self.hidden = torch.zeros(count, c.hidden_size, device=device, dtype=dtype)
        self.held: list[Snapshot] = []
        self.clock = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm, self.hidden))

    def best(self, prompt: list[int], fed: list[int]) -> Snapshot | None:
        """The longest snapshot that begins `prompt` (leaving at least one token of it to feed) and
        the tokens fed (its positions still hold its tokens' KV)."""
        usable = [s for s in self.held if len(s.tokens) < len(prompt) and begins(s.tokens, prompt)
                  and begins(s.tokens, fed)]
        return max(usable, key=lambda s: len(s.tokens), default=None)

    def keep_only(self, valid) -> None:
        """Forget the snapshots for which valid(tokens) is false."""
        self.held = [s for s in self.held if valid(s.tokens)]

    def touch(self, snap: Snapshot) -> None:
        self.clock += 1
        snap.used = self.clock

    def slot_for(self, tokens: tuple[int, ...]) -> Snapshot:
        """Where a snapshot of `tokens` goes (there are slots): the one held for the same tokens, a
        free slot, or the least recently used one's."""
        snap = next((s for s in self.held if s.tokens == tokens), None)
        if snap is None:
            taken = {s.slot for s in self.held}
            free = [i for i in range(self.count) if i not in taken]
            if free:
                snap = Snapshot(tokens, free[0], 0)
            else:
                snap = min(self.held, key=lambda s: s.used)
                self.held.remove(snap)
                snap = Snapshot(tokens, snap.slot, 0)
            self.held.append(snap)
        self.touch(snap)
        return snap

    # --- the copies, between generations, eagerly ----------------------------------------------
    def save(self, tokens: tuple[int, ...], state, mixers, conv_cols: torch.Tensor, hidden: torch.Tensor | None,
             any_stride: bool = False):
        """Keep the state (engine/state.py) at `tokens`: per GDN layer (`mixers`, in order) the
        committed conv inputs (`conv_cols` from the committed offset, no host sync) and the
        recurrent state with the last step's tokens folded in (in the steps' form of the kernel:
        KernelPlan.any_stride), and the last row's `hidden`."""
        i = self.slot_for(tokens).slot
        cols = (state.conv_off + conv_cols) % state.conv_width
        for j, ((conv_buf, ssm, pend), m) in enumerate(zip(state.gdn_layers, mixers)):
            self.conv[i, j].copy_(conv_buf.index_select(1, cols))
            self.ssm[i, j].copy_(ssm)
            gdn.fold_pending(self.ssm[i, j], pend, state.fold, state.parity, m.A_log, m.dt_bias, any_stride)
        if hidden is not None:
            self.hidden[i].copy_(hidden)

    def restore(self, snap: Snapshot, state, hidden: torch.Tensor):
        """Put `snap` back into the state, nothing left to fold, and its last row's hidden into
        `hidden` [1, H]."""
        i = snap.slot
        self.touch(snap)
        for j, (conv_buf, ssm, _) in enumerate(state.gdn_layers):
            conv_buf[:, :state.kernel - 1].copy_(self.conv[i, j])
            ssm.copy_(self.ssm[i, j])
        for t in (state.conv_off, state.fold, state.parity):
            t.zero_()
        state.length = len(snap.tokens)
        hidden.copy_(self.hidden[i:i + 1])
