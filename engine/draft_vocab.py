"""The draft vocabulary: the MTP head's greedy token taken over the most frequent tokens only.

Each draft step multiplies the head's output by the lm_head: on the 27B, 248,320 rows x 5,120 in
bf16, 2.54 GB, some 6 % of a decode step per draft (twice that share with FP8 layers, whose
lm_head stays bf16). Almost every accepted draft is a common token, so the head's argmax is taken
over the `size` most frequent rows only, copied once at load into their own contiguous [Vd, H]
weight (so the product streams only those rows) beside a [Vd] map from row to token id.

This cannot change the output: the target verifies every draft, and a draft outside the subset
would simply never be proposed. Sampling stays exact too: drafts are a one-hot proposal, and the
rule of engine/spec.py accepts a proposal d with p(d) whatever chose it.

Which tokens: none of the models ship token frequencies and nothing can be downloaded, so they are
counted in a sample of text: chat answers, code in several languages, Markdown, math, a few other
languages, the chat template and Python with English comments. The sample ships as data, not as
text to tokenize: draft_pieces.json holds each distinct pre-tokenizer piece of it (a word with its
leading space, a digit, a punctuation run) and how often it occurs, written once by
tests/tools/draft_rank.py. At load each piece is encoded with the model's own tokenizer and its
tokens counted that many times: what encoding the whole sample gives with any tokenizer that cuts
its text at least where Qwen's pre-tokenizer does (byte-level BPE never merges across a cut).
Nothing is read from the package's sources, so editing one changes no draft. The rest of
the subset is filled in token-id order: byte-level BPE ids follow the order of the merges, which
is roughly the order of frequency in the tokenizer's training text. Every added token (the chat
template's <|im_end|>, <think>, </think>, ...) is always in, since a reply cannot end without them.
Without a tokenizer (random weights) the subset is the first `size` ids.

Replies also copy rare tokens from their context (identifiers of the code being edited, names in
a quoted text), and a token missing from the subset fails every draft that should be it, again and
again. So the trimmed head has `context_rows(size)` more rows, filled at run time with the tokens
of the prompt and of the reply that the subset lacks, most recent kept (the decoder's
`draft_context`): on the demo model, whose held-out code repeats names such as `_indent`, this is
the difference between losing 5 % of the acceptance length and losing none.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch

from mtpchat.kernels import int4

DEFAULT_DRAFT_VOCAB = 32768      # rows of the trimmed head (of Qwen3.5/3.6's 248,320)
QUANTIZE_AT_ONCE = 1 << 20       # weights of the head quantized at once into a 4-bit copy (some 25 MB of work)
PIECES = Path(__file__).with_name("draft_pieces.json")


def context_rows(size: int) -> int:
    """Rows kept for tokens of the context outside the subset (module docstring)."""
    return max(16, size // 16) if size else 0


def draft_vocab_size(vocab_size: int, asked: int | None) -> int:
    """Rows of the trimmed head's subset; 0 means the full head: asked 0 or None, or a subset that
    with its context rows would have as many rows as the vocabulary or more (the default on a
    small vocabulary, the demo model's 4,096 say), where trimming saves nothing."""
    if not asked or asked <= 0:
        return 0
    size = int(asked)
    return size if size + context_rows(size) < vocab_size else 0


def four_bit_rows(hidden_size: int) -> bool:
    """Whether the head's rows can be kept in 4 bits (DraftRows' four_bit): whole groups of
    int4.GROUP columns; other rows keep the head's dtype."""
    return hidden_size % int4.GROUP == 0


def draft_vocab_bytes(vocab_size: int, asked: int | None, row_bytes: int) -> int:
    """What the trimmed head allocates: its rows (the subset's and the context's) of `row_bytes`
    each as it keeps them, and the int64 map to token ids."""
    size = draft_vocab_size(vocab_size, asked)
    return (size + context_rows(size)) * (row_bytes + 8)


def shipped_pieces() -> dict[str, int]:
    """The sample's pieces and how often each occurs (module docstring)."""
    return json.loads(PIECES.read_text(encoding="utf-8"))["pieces"]


def ranked_tokens(tokenizer, vocab_size: int, pieces: Mapping[str, int] | None = None) -> list[int]:
    """Every token id below vocab_size, most useful to draft first: the added tokens, then the
    tokens counted in `pieces` (text -> occurrences; the shipped sample's by default), most frequent
    first, then the rest by id."""
    first = sorted(i for i in tokenizer.added_token_ids if 0 <= i < vocab_size) if tokenizer is not None else []
    counts: Counter = Counter()
    if tokenizer is not None:
        for piece, n in (shipped_pieces() if pieces is None else pieces).items():
            for t in tokenizer.encode(piece):
                counts[t] += n
    seen = set(first)
    counted = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t < vocab_size and t not in seen]
    seen.update(counted)
    return first + counted + [t for t in range(vocab_size) if t not in seen]


def draft_token_ids(tokenizer, vocab_size: int, size: int, pieces: Mapping[str, int] | None = None) -> list[int]:
    """The `size` ids of the trimmed head, ascending (so ties in the argmax go to the smaller id, as
    in the full head's)."""
    return sorted(ranked_tokens(tokenizer, vocab_size, pieces)[:size])


class DraftRows:
    """The trimmed head on the device: the lm_head rows of the subset `ids` (ascending) and
    `context` rows for tokens of the prompt and the reply outside it, in their own contiguous copy
    `w` [Vd + C, H], beside `ids` [Vd + C], the token of each row. The context rows start as copies
    of the first row (a tie of equal tokens cannot change a draft).

    `four_bit` (the plan's draft_head_int4): the copy is kept in 4 bits, each row quantized on its
    own (kernels/int4.py quantize_ref: symmetric, groups of 128 columns; `interleave`d where the
    plan stores 4-bit weights so), a quarter of the bytes each draft reads. Only which token is
    proposed can change, never the output: the target verifies every draft (module docstring)."""

    def __init__(self, head: torch.Tensor, ids: list[int], context: int, four_bit: bool = False,
                 interleave: bool = False):
        self.head, self.static, self.context = head, len(ids), context
        self.four_bit, self.interleave = four_bit, interleave
        self.subset, self.ring, self.slots, self.next = set(ids), {}, [None] * context, 0
        rows = torch.tensor(ids + [ids[0]] * context, device=head.device)
        self.w, self.ids = self._stored(rows), rows

    def _stored(self, rows: torch.Tensor):
        """The head's rows `rows` (ids) as the copy keeps them: as they are, or quantized a slice at
        a time into the 4-bit copy, so that neither a bf16 copy of them all nor quantize_ref's
        float32 work on them all ever sits beside it (the memory plan counts the 4-bit rows only:
        memory.weight_bytes' draft_int4)."""
        head = self.head.detach()
        if not self.four_bit:
            return head.index_select(0, rows).contiguous()
        out, step = None, max(1, QUANTIZE_AT_ONCE // head.shape[1])
        for i in range(0, len(rows), step):
            q = int4.quantize_ref(head.index_select(0, rows[i:i + step]), int4.GROUP)
            q = int4.interleave_ref(q) if self.interleave else q
            if out is None:
                out = int4.GroupInt4(*(None if t is None else t.new_empty(len(rows), *t.shape[1:]) for t in q))
            for kept, t in zip(out, q):
                if t is not None:
                    kept[i:i + len(t)] = t
        return out

    def nbytes(self) -> int:
        w = self.w.nbytes() if self.four_bit else self.w.numel() * self.w.element_size()
        return w + self.ids.numel() * self.ids.element_size()

    def take(self, tokens: list[int]):
        """Give the tokens outside the subset a context row, oldest replaced first: a few small
        copies between steps, only when such a token shows up, queued behind the steps in flight
        (no host sync: the ids come from pinned memory; nothing in the graphs)."""
        if not self.context:
            return
        V = self.head.shape[0]
        fresh = list(dict.fromkeys(t for t in tokens[-self.context:]
                                   if t not in self.subset and t not in self.ring and 0 <= t < V))
        if not fresh:
            return
        slots = []
        for t in fresh:                      # fewer than the context rows: no slot is written twice
            i = self.next
            self.next = (i + 1) % self.context
            self.ring.pop(self.slots[i], None)
            self.slots[i], self.ring[t] = t, i
            slots.append(self.static + i)
        toks, rows = _to_device([fresh, slots], self.w.device)
        fresh_rows = self._stored(toks)
        if self.four_bit:               # each row quantized on its own: the others keep their bits
            self.w.w.index_copy_(0, rows, fresh_rows.w)
            self.w.scale.index_copy_(0, rows, fresh_rows.scale)
        else:
            self.w.index_copy_(0, rows, fresh_rows)
        self.ids.index_copy_(0, rows, toks)


def _to_device(values: list[list[int]], device) -> torch.Tensor:
    """Host ints on the device without a host sync: a copy from pageable memory waits for every
    step in flight. The caching host allocator keeps the pinned block until its copy is done."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
