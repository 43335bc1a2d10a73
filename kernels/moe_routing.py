"""The MoE models' routing (kernels/moe.py's first piece): softmax over the router's E logits
(float32), the top k in descending probability, renormalised to sum to 1; a logit past the E
experts' is the shared expert's gate, returned as its sigmoid, or with `shared` the shared expert
is every row's last choice, expert E, weighted by it. The float32 reference, the step's kernel (one
program a row, which may also write the step's block layout: moe_layout.write_step_layout) and
`route`, which takes the kernel for a step's rows on the GPU. A row routes the same whatever rows
route beside it.
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import pdl, pdl_start, tl, triton, use_triton
from mtpchat.kernels.matvec import arrival_counts
from mtpchat.kernels.moe_layout import STEP_ROWS, StepLayout, layout_ref, most_blocks, write_step_layout
from mtpchat.kernels.plan import ProductPlan, default_products


def route_ref(logits: torch.Tensor, top_k: int, n_experts: int, shared: bool = False):
    """logits [T, E (+1)] -> (ids [T, k] int32, weights [T, k] float32, gate [T] float32 or None).
    The top k in descending probability; `gate`: the sigmoid of logit E where there is one. With
    `shared`, the shared expert is a choice k+1 of every row instead: expert E, weighted by the gate."""
    probs = torch.softmax(logits[:, :n_experts].float(), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    weights = top / top.sum(dim=-1, keepdim=True)
    gate = torch.sigmoid(logits[:, n_experts].float()) if logits.shape[1] > n_experts else None
    ids = ids.to(torch.int32)
    if shared:
        ids = torch.cat([ids, torch.full_like(ids[:, :1], n_experts)], 1)
        weights, gate = torch.cat([weights, gate[:, None]], 1), None
    return ids, weights, gate


@triton.jit
def _topk_kernel(logits, s_l, ids, weights, gate, rows, E, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                 HAS_GATE: tl.constexpr, SHARED: tl.constexpr, HAS_ROWS: tl.constexpr, PDL: tl.constexpr,
                 LAYOUT: tl.constexpr = False, expert=None, pairs=None, count=None, NB=0,
                 BP: tl.constexpr = 1, BB: tl.constexpr = 1, BM: tl.constexpr = 1):
    # One program a row: the softmax's numerators exp(l - max), the top k of them by repeated
    # argmax in descending order (of equal values the smaller expert first; torch.topk's order is
    # unspecified), divided by their own sum: route_ref's weights, the softmax's denominator
    # cancelled. The row's bits must not depend on how the kernel was compiled (LAYOUT's BB and BP
    # follow the row count, and a decode's row must equal the same row in a verify): the sum is
    # added in the order of the choices and the division rounded as IEEE's, never a reduction over
    # a layout the compiler picks (tl.sum of the top k gave a decode's weights other last bits
    # than a verify's under LAYOUT). HAS_ROWS: a row past `rows` routes as the last row before it
    # (stale_rows). LAYOUT: the last row to arrive writes the step's layout (expert [NB], pairs
    # [NB, BM]: write_step_layout) and sets its count back to 0; its acq_rel add, after every
    # thread of the program has stored, orders the other rows' ids before its reads (a decode's
    # one row takes no count: 3.2 against 5.7 us a launch, H100). One program for all the rows
    # (in one warp, or spread by Triton over 2 or 4 warps) took longer at every row count (2.8-7.3
    # us at 1-4 rows against 2.4-5.6 here; tests/bench/bench_routing.py).
    pdl_start(PDL)
    r = tl.program_id(0)
    r_src = r
    if HAS_ROWS:
        r_src = tl.minimum(r, tl.maximum(tl.load(rows) - 1, 0)).to(tl.int32)
    o_e = tl.arange(0, BE)
    b_l = tl.load(logits + r_src * s_l + o_e, mask=o_e < E, other=float("-inf")).to(tl.float32)
    b_p = tl.exp(b_l - tl.max(b_l, 0))
    o_k = tl.arange(0, KP)
    b_ids = tl.zeros([KP], dtype=tl.int32)
    b_top = tl.zeros([KP], dtype=tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for j in tl.static_range(K):
        best, idx = tl.max(b_p, 0, return_indices=True, return_indices_tie_break_left=True)
        b_p = tl.where(o_e == idx, -1.0, b_p)
        b_ids = tl.where(o_k == j, idx, b_ids)
        b_top = tl.where(o_k == j, best, b_top)
        total += best
    b_w = tl.div_rn(b_top, total)
    if SHARED:      # choice K: the shared expert (E), weighted by its gate
        g = tl.sigmoid(tl.load(logits + r_src * s_l + E).to(tl.float32))
        tl.store(ids + r * (K + 1) + o_k, b_ids, mask=o_k < K)
        tl.store(weights + r * (K + 1) + o_k, b_w, mask=o_k < K)
        tl.store(ids + r * (K + 1) + K, E)
        tl.store(weights + r * (K + 1) + K, g)
    else:
        tl.store(ids + r * K + o_k, b_ids, mask=o_k < K)
        tl.store(weights + r * K + o_k, b_w, mask=o_k < K)
        if HAS_GATE:
            tl.store(gate + r, tl.sigmoid(tl.load(logits + r_src * s_l + E).to(tl.float32)))
    if LAYOUT:
        T = tl.num_programs(0)
        tl.debug_barrier()
        last = T == 1                   # a decode's one row: the last to arrive, no count to take
        if T > 1:
            last = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == T - 1
        if last:
            write_step_layout(ids, T * (K + SHARED), expert, pairs, NB, BP, BM, BB)
            if T > 1:
                tl.atomic_xchg(count, 0)


def stale_rows(logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The logits each row routes by: a row past `rows` (a [1] count on the logits' device: the MTP
    head's stale catch-up rows, whose output is never read) takes the last row's, so reads no more."""
    if rows is None:
        return logits
    src = torch.minimum(torch.arange(logits.shape[0], device=logits.device), (rows - 1).clamp(min=0))
    return logits.index_select(0, src)


def route_count(device: torch.device) -> torch.Tensor:
    """The routing's own arrival count on a device (int32, left at 0 by every routing), apart from
    the split products' (matvec.arrival_counts)."""
    return arrival_counts(device, 1, "routing")


def route_step(logits: torch.Tensor, top_k: int, n_experts: int, shared: bool = False,
               rows: torch.Tensor | None = None, layout: bool = False):
    """route_ref on the GPU for a step's few rows, with the step's layout (`rows`: stale_rows);
    `layout`: written by the routing kernel (the plan's routed_layout), else left for the expert
    kernels to derive."""
    T, kk = logits.shape[0], top_k + shared
    assert T <= STEP_ROWS, f"a step routes at most {STEP_ROWS} rows, got {T}"
    assert logits.stride(1) == 1
    assert not shared or logits.shape[1] > n_experts, "a shared expert needs its gate's logit"
    dev = logits.device
    ids = torch.empty(T, kk, dtype=torch.int32, device=dev)
    weights = torch.empty(T, kk, dtype=torch.float32, device=dev)
    has_gate = logits.shape[1] > n_experts and not shared
    gate = torch.empty(T, dtype=torch.float32, device=dev) if has_gate else None
    blocks = min(n_experts + shared, T * kk)
    laid = {}
    if layout:
        laid = dict(LAYOUT=True, expert=torch.empty(blocks, dtype=torch.int32, device=dev),
                    pairs=torch.empty(blocks, STEP_ROWS, dtype=torch.int32, device=dev),
                    # the bookkeeping as wide as the step's pairs (16 at least), not the expert
                    # kernels' 64 at least: a decode's 9 pairs compare 16 x 16, not 64 x 64
                    count=route_count(dev), NB=blocks, BP=max(16, triton.next_power_of_2(T * kk)),
                    BB=triton.next_power_of_2(blocks), BM=STEP_ROWS)
    _topk_kernel[(T,)](logits, logits.stride(0), ids, weights, gate if has_gate else weights,
                       rows if rows is not None else ids, n_experts, K=top_k, KP=triton.next_power_of_2(top_k),
                       BE=triton.next_power_of_2(n_experts), HAS_GATE=has_gate, SHARED=shared,
                       HAS_ROWS=rows is not None, num_warps=1, **pdl(logits), **laid)
    return ids, weights, gate, StepLayout(ids, blocks, laid.get("expert"), laid.get("pairs"))


def route(logits: torch.Tensor, top_k: int, n_experts: int, step: bool, shared: bool = False,
          rows: torch.Tensor | None = None, plan: ProductPlan | None = None, four_bit: bool = False):
    """(ids, weights, gate, layout). A step on the GPU routes its rows in one kernel, which writes the
    layout too under the plan's routed_layout, or leaves it to the expert kernels (StepLayout); a
    prefill groups its pairs into blocks of 16, 32 or 64, as the plan gives the chunk's
    pairs an expert (ProductPlan.prefill_block_rows; `four_bit`: the experts' weights are).
    `shared`: the shared expert as every row's last choice, expert E (route_ref). `rows`: the rows
    that count, the rest routed as the last of them (stale_rows)."""
    plan = plan or default_products(logits.device)
    if step and use_triton(logits):
        return route_step(logits, top_k, n_experts, shared, rows, plan.routed_layout)
    ids, weights, gate = route_ref(stale_rows(logits, rows), top_k, n_experts, shared)
    if step:
        return ids, weights, gate, layout_ref(ids, n_experts + shared, STEP_ROWS)
    bm = plan.prefill_block_rows(ids.numel(), n_experts + shared, four_bit)
    # a prefill's blocks as many as its pairs could take, so no count waits for the device
    blocks = most_blocks(ids.numel(), n_experts + shared, bm) if logits.is_cuda else None
    return ids, weights, gate, layout_ref(ids, n_experts + shared, bm, blocks)
