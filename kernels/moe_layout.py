"""The block layout of the MoE expert products (kernels/moe.py): which (row, choice) pairs each
block of a product takes, so that a block reads its expert's weights once for all of them.

    layout   : the (row, choice) pairs p = row * k + j grouped by expert into blocks of BM pairs:
               block b holds pairs of expert block_expert[b] (-1: an empty block, which exits at once)
    step     : in a step (a few rows: decode, verify, draft) block b takes the b-th smallest distinct
               expert the rows chose, all its pairs: the expert kernels derive it on the device from
               the routing itself (`_step_block`, exact integer bookkeeping, so the same layout as
               layout_ref gives), or, under the plan's routed_layout, the routing kernel's last row
               writes it once (`write_step_layout`, the same bookkeeping for every block at once)
               and they read it; launched for the worst case (min(E, T * k) blocks) so the step can
               be a CUDA graph; they count the step's distinct routed experts as they go (`_block`;
               `count_reads` on the CPU)

layout_ref is the float32 path's (and a prefill's) layout; `StepLayout.expand` gives a step's as
layout_ref does.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mtpchat.kernels._triton import tl, triton

STEP_ROWS = 16          # the pairs a step's block takes: one per row, for each distinct expert
STEP_PAIRS = 64         # the pairs the expert kernels' bookkeeping holds at least (8 rows of 8 choices);
                        # more (9 rows of 9 with 8 drafts and the shared expert) take the next power of 2
                        # (the routing's own is as wide as the step's pairs: moe_routing.route_step)
PREFILL_ROWS = 64       # the most pairs a block takes in a prefill (ProductPlan.prefill_block_rows: 16 to 64)


class Layout(NamedTuple):
    """Which pairs each block of an expert product takes."""
    expert: torch.Tensor    # [NB] int32: the block's expert, -1 for an empty block
    pairs: torch.Tensor     # [NB, BM] int32: pair ids row * k + j, -1 for an empty place


def most_blocks(pairs: int, n_experts: int, bm: int) -> int:
    """The most blocks of bm a layout of `pairs` pairs over n_experts can take: each expert's
    ceil(count / bm) adds at most one block to ceil(pairs / bm), and at most min(n_experts, pairs)
    experts are chosen."""
    return -(-pairs // bm) + min(n_experts, pairs)


def layout_ref(ids: torch.Tensor, n_experts: int, bm: int, blocks: int | None = None) -> Layout:
    """The pairs of ids [T, k] grouped by expert, ascending, each expert's pairs in order over
    ceil(count / bm) blocks of bm; padded with empty blocks to `blocks` when given (at least what
    the layout takes: most_blocks bounds it), and then made with no wait for the device, so that a
    CUDA graph can capture it (a prefill chunk's, engine/decoder.py)."""
    T, k = ids.shape
    flat = ids.flatten().long()
    order = torch.sort(flat, stable=True).indices                     # pair ids, grouped by expert
    counts = torch.zeros(n_experts, dtype=torch.long, device=ids.device).index_add_(
        0, flat, torch.ones_like(flat))
    per_expert = (counts + bm - 1) // bm                               # blocks each expert takes
    first_block = torch.cumsum(per_expert, 0) - per_expert
    first_pair = torch.cumsum(counts, 0) - counts
    if blocks is None:
        blocks = int(per_expert.sum())
        empty = torch.zeros(1, dtype=torch.long, device=ids.device)
    else:
        empty = (blocks - per_expert.sum()).view(1)                    # on the device: >= 0 by the bound
        if ids.is_cuda:
            torch._assert_async(empty[0] >= 0, "a layout given fewer blocks than its pairs take")
        else:
            assert int(empty) >= 0, f"{int(per_expert.sum())} blocks needed, {blocks} given"
    experts = torch.arange(n_experts + 1, dtype=torch.int32, device=ids.device)
    experts[-1:].fill_(-1)             # the empty blocks, after the rest (a fill: no host copy to capture)
    expert = torch.repeat_interleave(experts, torch.cat([per_expert, empty]), output_size=blocks)
    e_sorted = flat[order]
    rank = torch.arange(T * k, device=ids.device) - first_pair[e_sorted]   # place among its expert's pairs
    pairs = torch.full((blocks, bm), -1, dtype=torch.int32, device=ids.device)
    pairs[first_block[e_sorted] + rank // bm, rank % bm] = order.to(torch.int32)
    return Layout(expert, pairs)


class StepLayout(NamedTuple):
    """A step's layout: block b takes the b-th smallest distinct expert the rows chose, its pairs in
    order; left for the expert kernels to derive from the routing itself (`_step_block`), or
    written by the routing kernel (`expert`, `pairs`: as a Layout holds them)."""
    ids: torch.Tensor       # [T, k] int32
    blocks: int             # min(E, T * k): as many as the step could need
    expert: torch.Tensor | None = None     # [blocks] int32, or None: derived by the expert kernels
    pairs: torch.Tensor | None = None      # [blocks, STEP_ROWS] int32

    def expand(self, n_experts: int) -> Layout:
        return layout_ref(self.ids, n_experts, STEP_ROWS, self.blocks)


@triton.jit
def _ranked_pairs(ids, P, BP: tl.constexpr):
    """A step's P pairs (at most BP) as the layout places them: (pair ids [BP], which are pairs, their
    experts, each pair's place among its expert's pairs, whether it is its expert's first, its
    expert's rank among the distinct experts). `ids` may have been written by the kernel before, or
    by other programs of this one: read past L1. Integer bookkeeping, exact."""
    o_q = tl.arange(0, BP)
    m_q = o_q < P
    e_q = tl.load(ids + o_q, mask=m_q, other=-1, cache_modifier=".cg")
    earlier = (e_q[:, None] == e_q[None, :]) & m_q[None, :] & (o_q[None, :] < o_q[:, None])
    place = tl.sum(earlier.to(tl.int32), 1)
    first = m_q & (place == 0)
    rank = tl.sum(((e_q[None, :] < e_q[:, None]) & first[None, :]).to(tl.int32), 1)
    return o_q, m_q, e_q, place, first, rank


@triton.jit
def _step_block(ids, P, i_b, BP: tl.constexpr, BM: tl.constexpr):
    """Block i_b of a step: the i_b-th smallest distinct expert among the P pairs of `ids` (-1: none),
    the pairs that chose it in order (place c the c-th; -1 past them), and the number of distinct
    experts: the same layout as layout_ref gives."""
    o_q, m_q, e_q, place, first, rank = _ranked_pairs(ids, P, BP)
    mine = m_q & (rank == i_b)
    e = tl.max(tl.where(mine, e_q, -1), 0)
    o_c = tl.arange(0, BM)
    hit = mine[None, :] & (place[None, :] == o_c[:, None])
    pairs = tl.sum(tl.where(hit, o_q[None, :] + 1, 0), 1) - 1
    return e, pairs, tl.sum(first.to(tl.int32), 0)


@triton.jit
def write_step_layout(ids, P, expert, pairs, NB, BP: tl.constexpr, BM: tl.constexpr, BB: tl.constexpr):
    """A step's whole layout from its P pairs' experts `ids` (_ranked_pairs): expert [NB] and pairs
    [NB, BM], every block and place not taken -1, as _step_block gives block by block (places past
    BM dropped, as there), one store each."""
    o_q, m_q, e_q, place, first, rank = _ranked_pairs(ids, P, BP)
    o_b = tl.arange(0, BB)
    tl.store(expert + o_b, tl.full([BB], -1, tl.int32), mask=o_b < NB)
    o_f = tl.arange(0, BB * BM)
    tl.store(pairs + o_f, tl.full([BB * BM], -1, tl.int32), mask=o_f < NB * BM)
    tl.debug_barrier()                              # every -1 stored before a block's own values
    tl.store(expert + rank, e_q, mask=first)
    tl.store(pairs + rank * BM + place, o_q, mask=m_q & (place < BM))    # (a row's experts are distinct: < T places)


@triton.jit
def _block(expert, pairs, reads, P, i_b, i_n, BM: tl.constexpr, STEP: tl.constexpr, BP: tl.constexpr,
           COUNT: tl.constexpr, SHARED: tl.constexpr, LAID: tl.constexpr = False):
    """(expert, pair ids [BM]) of block i_b: from a Layout (or a step's, LAID: written by the
    routing), or derived in a step; in a step the step's distinct routed experts are counted into
    `reads` once (the shared one, in every step, is not)."""
    if STEP and not LAID:
        e, p, n = _step_block(expert, P, i_b, BP, BM)
    else:
        e = tl.load(expert + i_b)
        p = tl.load(pairs + i_b * BM + tl.arange(0, BM))
    if STEP and COUNT:
        if (i_b == 0) & (i_n == 0):
            if LAID:     # the blocks taken: every launch holds as many blocks as the step could need
                o_b = tl.arange(0, BP)
                n = tl.sum((tl.load(expert + o_b, mask=o_b < tl.num_programs(0), other=-1) >= 0).to(tl.int32), 0)
            tl.atomic_add(reads, (n - SHARED).to(tl.int64))
    return e.to(tl.int64), p


def step_pairs(P: int) -> int:
    """The pairs a step's bookkeeping holds for P pairs: a power of 2, STEP_PAIRS at least."""
    return max(STEP_PAIRS, triton.next_power_of_2(P))


def _layout_args(layout) -> tuple:
    """(expert or ids, pairs, P, BM, blocks, STEP, BP, LAID) for a kernel launch."""
    if isinstance(layout, StepLayout):
        P = layout.ids.numel()
        if layout.expert is not None:
            return layout.expert, layout.pairs, P, STEP_ROWS, layout.blocks, True, step_pairs(P), True
        return layout.ids, layout.ids, P, STEP_ROWS, layout.blocks, True, step_pairs(P), False
    return layout.expert, layout.pairs, 0, layout.pairs.shape[1], layout.expert.shape[0], False, 16, False


def count_reads(layout, reads: torch.Tensor, n_experts: int):
    """Add a step's distinct routed experts to `reads` (the CPU's; the GPU's swiglu kernel counts its own)."""
    reads += ((layout.expert >= 0) & (layout.expert < n_experts)).sum().to(reads.dtype)
