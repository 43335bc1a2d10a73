"""The accept phase of a greedy step, fused: the float32/int64 torch reference, the two Triton kernels
beside it, and `accept_greedy`, which takes the kernels for CUDA tensors and the reference otherwise.

A step verified [x_L, d_1..d_k] and left the target's logits [k+1, V] (row i predicts the token
after d_i). Greedy acceptance keeps the longest prefix of drafts with d_{i+1} == argmax p_i, a
drafts in all, and adds the target's own argmax p_a: tokens = d_1..d_a, bonus, then the bonus
again as filler up to k+1. Of those a+1 the step emits n: up to and including the first stop id,
and no more than `room`. The commit then writes the decoder's step state (engine/decoder.py says
what each buffer means): GDN fold and parity, conv offset, length, emitted count, next token, room
(0 after a stop id), presence counts, the pending rows of the MTP head, and result [n, a, tokens].
A step with room 0 (its generation has ended) emits nothing and commits nothing; only `result`
and the pending rows past `pend_n` (which nothing reads) are written.

In torch that is some 25 small kernels: 71 us (k = 0) to 83 us (k = 4) a step on an H100, in a
CUDA graph at Qwen3.5's V = 248320 and hidden 5120. Here it is two, 4.3 to 6.7 us:
1. `_argmax_partials_kernel`, grid (k+1 rows, P chunks of BV logits): each chunk's max and the
   first index attaining it, into buffers [R, P] that the decoder allocates once.
2. `_accept_greedy_kernel`, one program: the argmax of each row from its chunks (ties go to the
   smallest index, so it is torch.argmax on the same logits), then everything above.

The draft phase that follows has two kernels here too: `pick_argmax`, its greedy token (the same
two kernels over the head's logits), and `chain_start`, which hands the head's catch-up over to the
chained drafts (its last live row, pend_n - 1, and their positions L, L + 1, ..., from the pos and
pend_n the commit wrote) in one kernel where torch takes three.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mtpchat.kernels._triton import pdl, pdl_start, tl, triton, use_triton

BV = 4096          # logits per program of the partial argmax: 61 chunks a row of Qwen3.5's 248320


class AcceptBuffers(NamedTuple):
    """The decoder's buffers that acceptance reads and commits; 1-element long tensors unless said."""
    is_stop: torch.Tensor            # [V] bool
    room: torch.Tensor               # tokens the generation may still emit
    pos: torch.Tensor                # L, the committed length
    gen: torch.Tensor                # tokens emitted in this generation
    next_tok: torch.Tensor           # x_L, chosen, not yet fed
    fold: torch.Tensor               # GDN: tokens the next step folds into the recurrent states
    parity: torch.Tensor             # GDN: the half of the pending buffer the last step wrote
    conv_off: torch.Tensor           # GDN: where the committed conv window starts
    seen: torch.Tensor               # [V] int32, presence-penalty counts
    v_hidden: torch.Tensor           # [>= k+1, H] the verify's hiddens
    pend_hidden: torch.Tensor | None  # [rows, H] the MTP head's pending rows; None without a head
    pend_tokens: torch.Tensor | None  # [rows] long
    pend_n: torch.Tensor             # pending rows
    result: torch.Tensor             # [>= k+3] long: n, a, tokens


# --- the reference ------------------------------------------------------------------------------

def greedy_tokens_ref(logits: torch.Tensor, drafts: torch.Tensor):
    """logits [k+1, V], drafts [k] -> (a [1] long, tokens [k+1] long): the rule of engine/spec.py's
    accept_greedy (d_{i+1} == argmax p_i for i < a, so the first a tokens are the targets)."""
    k = drafts.shape[0]
    target = logits.argmax(-1)                                    # [k+1]
    a = (target[:k] == drafts).long().cumprod(0).sum().view(1)
    idx = torch.arange(k + 1, device=logits.device)
    return a, torch.where(idx < a, target, target.gather(0, a.expand(k + 1)))


def commit_ref(a: torch.Tensor, out: torch.Tensor, b: AcceptBuffers):
    """Emit n of the a+1 accepted tokens `out` [k+1] (up to the first stop id, within `room`) and
    commit them into b. Also the commit of a sampled step, which chooses (a, out) by its own rule."""
    k = out.shape[0] - 1
    idx = torch.arange(k + 1, device=out.device)
    stop_at = torch.where(b.is_stop[out] & (idx <= a), idx, k + 1).min().view(1)
    n = torch.minimum(torch.minimum(a, stop_at) + 1, b.room)
    live = n > 0
    if k:                              # the next step folds the n tokens in (a decode wrote its own)
        b.fold.copy_(torch.where(live, n, b.fold))
        b.parity.copy_(torch.where(live, 1 - b.parity, b.parity))
    else:
        b.fold.copy_(torch.where(live, 0, b.fold))
    b.conv_off.add_(n)                 # the conv window moves on by n (a ring: kernels/conv.py)
    b.pos.add_(n)
    b.gen.add_(n)
    b.next_tok.copy_(torch.where(live, out.index_select(0, (n - 1).clamp(min=0)), b.next_tok))
    b.room.copy_(torch.where(stop_at < n, 0, b.room - n))          # a stop id emitted ends it
    b.seen.index_add_(0, out, (idx < n).int())
    if b.pend_hidden is not None:
        base = b.pend_n if k == 0 else torch.zeros_like(b.pend_n)     # a step restarts the rows
        base = torch.where(live, base, b.pend_n)                      # an ended step writes past them
        rows = base + idx
        b.pend_hidden.index_copy_(0, rows, b.v_hidden[:k + 1])
        b.pend_tokens.index_copy_(0, rows, out)
        b.pend_n.copy_(torch.where(live, base + n, b.pend_n))
    b.result[0:1] = n
    b.result[1:2] = a
    b.result[2:k + 3] = out


def accept_greedy_ref(logits: torch.Tensor, drafts: torch.Tensor, b: AcceptBuffers):
    commit_ref(*greedy_tokens_ref(logits, drafts), b)


# --- the kernels --------------------------------------------------------------------------------

@triton.jit
def _argmax_partials_kernel(x, val, idx, V, s_x, s_p, BV: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    i_r, i_p = tl.program_id(0), tl.program_id(1)
    o_v = i_p * BV + tl.arange(0, BV)
    b_x = tl.load(x + i_r * s_x + o_v, mask=o_v < V, other=float("-inf"))
    # a NaN is the largest value to torch.argmax: the first one wins (tl.max would skip it, and no
    # index would match the max); told by its bits, which no compiler flag can fold away
    b_nan = (b_x.to(tl.float32).to(tl.uint32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    b_x = tl.where(b_nan, float("inf"), b_x)
    b_max = tl.max(b_x, 0)
    # the first index attaining the max (torch.argmax's rule); a chunk holds at least one index < V,
    # and the -inf padding after it can only tie, never come first
    b_arg = tl.min(tl.where(b_x == b_max, o_v, V), 0)
    tl.store(val + i_r * s_p + i_p, b_max)
    tl.store(idx + i_r * s_p + i_p, b_arg)


@triton.jit
def _pick_kernel(val, idx, s_p, P, ids, into, HAS_IDS: tl.constexpr, BP: tl.constexpr, PDL: tl.constexpr):
    # row i_r's argmax from its chunks (the largest max, the smallest index among equal ones: the
    # first index overall, torch.argmax's rule), through the id map when there is one
    pdl_start(PDL)
    i_r = tl.program_id(0)
    o_p = tl.arange(0, BP)
    m_p = o_p < P
    b_v = tl.load(val + i_r * s_p + o_p, mask=m_p, other=float("-inf"))
    b_i = tl.load(idx + i_r * s_p + o_p, mask=m_p, other=0)
    b_arg = tl.min(tl.where(m_p & (b_v == tl.max(b_v, 0)), b_i, 2 ** 30), 0)
    if HAS_IDS:
        b_arg = tl.load(ids + b_arg)
    tl.store(into + i_r, b_arg.to(tl.int64))


@triton.jit
def _accept_greedy_kernel(val, idx, s_p, P, drafts, is_stop, room, pos, gen, next_tok, fold, parity, conv_off,
                          seen, v_hidden, pend_hidden, pend_tokens, pend_n, result, H, N_PEND, s_v, s_ph,
                          K: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, BH: tl.constexpr,
                          HAS_HEAD: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    # Every thread reads the state (scalars are loaded by all threads, stored by one) before the
    # barrier, and nothing is written before it: a thread late to read `room` or `pend_n` must not
    # see this step's own value.
    o_r = tl.arange(0, BR)                                # row i of the window: x_L, d_1..d_K
    m_r = o_r <= K
    o_p = tl.arange(0, BP)
    m_rp = m_r[:, None] & (o_p < P)[None, :]
    b_val = tl.load(val + o_r[:, None] * s_p + o_p[None, :], mask=m_rp, other=float("-inf"))
    b_idx = tl.load(idx + o_r[:, None] * s_p + o_p[None, :], mask=m_rp, other=0)
    b_max = tl.max(b_val, 1)
    # argmax p_i: the smallest index among the chunks that reach the row's max
    b_target = tl.min(tl.where(m_rp & (b_val == b_max[:, None]), b_idx, 2147483647), 1).to(tl.int64)
    b_draft = tl.load(drafts + o_r, mask=o_r < K, other=-1)
    # a = the first row whose draft the target rejects; K when it keeps them all
    i_a = tl.min(tl.where((o_r < K) & (b_target == b_draft), BR, o_r), 0)
    b_bonus = tl.sum(tl.where(o_r == i_a, b_target, 0), 0)
    b_tok = tl.where(o_r < i_a, b_target, b_bonus)        # d_1..d_a (equal to the targets), bonus, filler
    b_stop = tl.load(is_stop + b_tok, mask=m_r, other=0) != 0
    i_stop = tl.min(tl.where(b_stop & (o_r <= i_a), o_r, K + 1), 0)
    b_room = tl.load(room)
    i_n = tl.minimum(tl.minimum(i_a, i_stop) + 1, b_room)   # emitted
    live = i_n > 0
    b_last = tl.sum(tl.where(o_r == tl.maximum(i_n - 1, 0), b_tok, 0), 0)
    b_pos, b_gen, b_next = tl.load(pos), tl.load(gen), tl.load(next_tok)
    b_fold, b_parity, b_off = tl.load(fold), tl.load(parity), tl.load(conv_off)
    b_pend = tl.load(pend_n)
    tl.debug_barrier()

    if K > 0:                             # the next step folds the n tokens in (a decode wrote its own)
        tl.store(fold, tl.where(live, i_n, b_fold))
        tl.store(parity, tl.where(live, 1 - b_parity, b_parity))
    else:
        tl.store(fold, tl.where(live, 0, b_fold))
    tl.store(conv_off, b_off + i_n)       # the conv window moves on by n (a ring: kernels/conv.py)
    tl.store(pos, b_pos + i_n)
    tl.store(gen, b_gen + i_n)
    tl.store(next_tok, tl.where(live, b_last, b_next))
    tl.store(room, tl.where(i_stop < i_n, 0, b_room - i_n))     # a stop id emitted ends it
    # one atomic per emitted token, so a token emitted twice counts twice
    tl.atomic_add(seen + b_tok, 1, mask=m_r & (o_r < i_n))
    if HAS_HEAD:
        # a decode appends its row; a live speculative step restarts the rows, an ended one writes
        # past them (nothing reads those rows)
        b_base = b_pend
        if K > 0:
            b_base = tl.where(live, 0, b_pend)
        o_row = b_base + o_r
        m_row = m_r & (o_row < N_PEND)
        tl.store(pend_tokens + o_row, b_tok, mask=m_row)
        for h0 in range(0, H, BH):
            o_h = h0 + tl.arange(0, BH)
            m_h = m_row[:, None] & (o_h < H)[None, :]
            b_h = tl.load(v_hidden + o_r[:, None] * s_v + o_h[None, :], mask=m_h)
            tl.store(pend_hidden + o_row[:, None] * s_ph + o_h[None, :], b_h, mask=m_h)
        tl.store(pend_n, tl.where(live, b_base + i_n, b_pend))
    tl.store(result, i_n)
    tl.store(result + 1, i_a)
    tl.store(result + 2 + o_r, b_tok, mask=m_r)


# --- the launchers ------------------------------------------------------------------------------

def argmax_partials_buffers(rows: int, V: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-chunk (max, first index) buffers of the partial argmax, for up to `rows` rows."""
    P = triton.cdiv(V, BV)
    return (torch.empty(rows, P, dtype=torch.float32, device=device),
            torch.empty(rows, P, dtype=torch.int32, device=device))


def _check(logits, drafts, b: AcceptBuffers, val, idx):
    R, V = logits.shape
    assert drafts.shape == (R - 1,) and drafts.dtype == torch.long and drafts.is_contiguous(), \
        f"drafts must be [{R - 1}] contiguous long, got {tuple(drafts.shape)} {drafts.dtype}"
    assert logits.stride(1) == 1, "the logits rows must be contiguous"
    assert val.dtype == torch.float32 and idx.dtype == torch.int32 and val.shape == idx.shape, \
        "partials must be a float32 and an int32 buffer of one shape"
    assert val.is_contiguous() and idx.is_contiguous(), "partials must be contiguous"
    assert val.shape[0] >= R and val.shape[1] >= triton.cdiv(V, BV), \
        f"partials {tuple(val.shape)} too small for [{R}, {triton.cdiv(V, BV)}]"
    for name in ("room", "pos", "gen", "next_tok", "fold", "parity", "conv_off", "pend_n"):
        t = getattr(b, name)
        assert t.numel() == 1 and t.dtype == torch.long, f"{name} must be a 1-element long tensor"
    assert b.is_stop.shape == (V,) and b.is_stop.dtype == torch.bool, f"is_stop must be [{V}] bool"
    assert b.seen.shape == (V,) and b.seen.dtype == torch.int32, f"seen must be [{V}] int32"
    assert b.result.dtype == torch.long and b.result.numel() >= R + 2 and b.result.is_contiguous(), \
        f"result must hold [{R + 2}] long"
    assert b.v_hidden.shape[0] >= R and b.v_hidden.stride(1) == 1, "v_hidden must be [>= k+1, H], rows contiguous"
    if b.pend_hidden is not None:
        assert b.pend_hidden.shape[1:] == b.v_hidden.shape[1:] and b.pend_hidden.dtype == b.v_hidden.dtype \
            and b.pend_hidden.stride(1) == 1, "pend_hidden must be [rows, H] of v_hidden's dtype, rows contiguous"
        assert b.pend_tokens.dtype == torch.long and b.pend_tokens.is_contiguous() \
            and b.pend_tokens.shape[0] == b.pend_hidden.shape[0], "pend_tokens must be [rows] long, one per row"


def accept_greedy_triton(logits: torch.Tensor, drafts: torch.Tensor, b: AcceptBuffers, partials=None):
    R, V = logits.shape
    val, idx = partials if partials is not None else argmax_partials_buffers(R, V, logits.device)
    _check(logits, drafts, b, val, idx)
    P = triton.cdiv(V, BV)
    _argmax_partials_kernel[(R, P)](logits, val, idx, V, logits.stride(0), val.stride(0), BV=BV,
                                    num_warps=4, **pdl(logits))
    head = b.pend_hidden is not None
    pend_hidden, pend_tokens = (b.pend_hidden, b.pend_tokens) if head else (b.v_hidden, b.result)
    H = b.v_hidden.shape[1]
    _accept_greedy_kernel[(1,)](val, idx, val.stride(0), P, drafts, b.is_stop, b.room, b.pos, b.gen, b.next_tok,
                                b.fold, b.parity, b.conv_off, b.seen, b.v_hidden, pend_hidden, pend_tokens,
                                b.pend_n, b.result, H, pend_hidden.shape[0], b.v_hidden.stride(0),
                                pend_hidden.stride(0), K=R - 1, BR=triton.next_power_of_2(R),
                                BP=triton.next_power_of_2(P), BH=min(1024, triton.next_power_of_2(H)),
                                HAS_HEAD=head, num_warps=4, **pdl(logits))


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor, b: AcceptBuffers, partials=None):
    """Greedy acceptance of logits [k+1, V] against drafts [k], committed into b (module docstring).
    `partials`: argmax_partials_buffers for at least k+1 rows, so a captured step allocates nothing."""
    if use_triton(logits):
        accept_greedy_triton(logits, drafts, b, partials)
    else:
        accept_greedy_ref(logits, drafts, b)


def pick_argmax_ref(logits: torch.Tensor, ids: torch.Tensor | None, into: torch.Tensor):
    """into [R] = ids[argmax of each row of logits [R, V]] (ids None: the argmax itself)."""
    top = logits.argmax(-1)
    into.copy_(top if ids is None else ids.index_select(0, top))


def pick_argmax(logits: torch.Tensor, ids: torch.Tensor | None, into: torch.Tensor, partials=None):
    """The head's greedy draft: torch's argmax and index_select as two kernels (the partial argmax
    above, then one program a row that reduces its chunks and maps the index through `ids`), which
    start behind the product before them (PDL). `partials`: argmax_partials_buffers for at least R
    rows of V logits, so a captured step allocates nothing."""
    if use_triton(logits):
        pick_argmax_triton(logits, ids, into, partials)
    else:
        pick_argmax_ref(logits, ids, into)


def pick_argmax_triton(logits: torch.Tensor, ids: torch.Tensor | None, into: torch.Tensor, partials=None):
    R, V = logits.shape
    val, idx = partials if partials is not None else argmax_partials_buffers(R, V, logits.device)
    P = triton.cdiv(V, BV)
    assert logits.stride(1) == 1, "the logits rows must be contiguous"
    assert val.dtype == torch.float32 and idx.dtype == torch.int32 and val.shape == idx.shape, \
        "partials must be a float32 and an int32 buffer of one shape"
    assert val.shape[0] >= R and val.shape[1] >= P and val.is_contiguous() and idx.is_contiguous(), \
        f"partials {tuple(val.shape)} too small for [{R}, {P}], or not contiguous"
    assert into.shape == (R,) and into.dtype == torch.long and into.is_contiguous(), "into must be [R] long"
    assert ids is None or (ids.dtype == torch.long and ids.dim() == 1 and ids.shape[0] >= V), \
        f"ids must map the {V} rows to token ids (long)"
    _argmax_partials_kernel[(R, P)](logits, val, idx, V, logits.stride(0), val.stride(0), BV=BV,
                                    num_warps=4, **pdl(logits))
    _pick_kernel[(R,)](val, idx, val.stride(0), P, ids if ids is not None else into, into,
                       HAS_IDS=ids is not None, BP=triton.next_power_of_2(P), num_warps=1, **pdl(logits))


def chain_start_ref(out: torch.Tensor, pend_n: torch.Tensor, pos: torch.Tensor, steps: torch.Tensor):
    """The chained drafts' start after the head's catch-up over rows `out` [R, H]: its last live row
    out[pend_n - 1] ([1, H]) and the positions pos + steps (steps: 0, 1, ..., one a chained draft)."""
    return out.index_select(0, pend_n - 1), pos + steps


@triton.jit
def _chain_start_kernel(out, s_o, pend_n, pos, row, chain, R, H, C, BH: tl.constexpr, BC: tl.constexpr,
                        PDL: tl.constexpr):
    # pend_n is 1 .. R wherever the decoder drafts; a count outside reads the nearest row, not
    # another tensor's memory (the reference's lookup would fail)
    pdl_start(PDL)
    i_r = tl.minimum(tl.maximum(tl.load(pend_n) - 1, 0), R - 1)
    o_h = tl.arange(0, BH)
    tl.store(row + o_h, tl.load(out + i_r * s_o + o_h, mask=o_h < H), mask=o_h < H)
    o_c = tl.arange(0, BC)
    tl.store(chain + o_c, tl.load(pos) + o_c, mask=o_c < C)


def chain_start(out: torch.Tensor, pend_n: torch.Tensor, pos: torch.Tensor, steps: torch.Tensor):
    """chain_start_ref's contract: one PDL kernel for CUDA tensors, the reference otherwise."""
    if use_triton(out):
        return chain_start_triton(out, pend_n, pos, steps)
    return chain_start_ref(out, pend_n, pos, steps)


def chain_start_triton(out: torch.Tensor, pend_n: torch.Tensor, pos: torch.Tensor, steps: torch.Tensor):
    """chain_start_ref's contract in one kernel for pend_n in 1 .. R (the decoder's catch-up; a
    count outside reads the nearest row); `steps` must be 0 .. C - 1 (only its length is read)."""
    R, H = out.shape
    assert out.stride(1) == 1, "the head's rows must be contiguous"
    assert pend_n.shape == pos.shape == (1,) and pend_n.dtype == pos.dtype == torch.long, "pend_n and pos: [1] long"
    C = steps.shape[0]
    row = torch.empty(1, H, dtype=out.dtype, device=out.device)
    chain = torch.empty(C, dtype=torch.long, device=out.device)
    _chain_start_kernel[(1,)](out, out.stride(0), pend_n, pos, row, chain, R, H, C, BH=triton.next_power_of_2(H),
                              BC=triton.next_power_of_2(max(C, 1)), num_warps=4, **pdl(out))
    return row, chain
