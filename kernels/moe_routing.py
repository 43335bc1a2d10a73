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
from mtpchat.kernels.matvec import Normed, _row_scale, _scale_args, arrival_counts, tail_split, tiles
from mtpchat.kernels.moe_layout import PREFILL_ROWS, STEP_ROWS, StepLayout, layout_ref, write_step_layout
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


@triton.jit(do_not_specialize=["T"])
def _router_kernel(x, w, ss, ws, count, rows, ids, weights, gate, T, E, NR, H, KS, NB, s_x, s_w, s_ss, eps,
                   BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr, NBP: tl.constexpr,
                   K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, HAS_GATE: tl.constexpr,
                   SHARED: tl.constexpr, HAS_ROWS: tl.constexpr, PDL: tl.constexpr, RT: tl.constexpr = 1,
                   LAYOUT: tl.constexpr = False, expert=None, pairs=None, NBL=0, BP: tl.constexpr = 1, BB: tl.constexpr = 1,
                   BM: tl.constexpr = 1):
    # Program (i_n, i_s): the router's rows i_n BN .. over K from i_s KS, as the product kernel's
    # split programs take them (matvec._matvec_kernel), its float32 sums left in ws. The last of
    # all to arrive (its acq_rel add after every thread stored orders the others' sums before its
    # reads) adds each block's parts in order and scales and rounds them as the product kernel
    # does: the logits, the same bits. Then it routes every row at once, row by row in an [RT, BE]
    # tile (RT: T to a power of 2), with _topk_kernel's arithmetic (numerators, repeated argmax, the sum in the order of
    # the choices, an IEEE division): each row's bits whatever rows route beside it. LAYOUT: then
    # it writes the step's layout. It sets the count back to 0.
    pdl_start(PDL)
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < NR, o_t < T
    b_y = tl.zeros([BN, BT], dtype=tl.float32)
    for k in range(i_s * KS, tl.minimum(i_s * KS + KS, H), BK):
        o_k = k + tl.arange(0, BK)
        m_k = o_k < H
        b_x = tl.trans(tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.))
        b_w = tl.load(w + o_n[:, None] * s_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
        b_y = tl.dot(b_w, b_x, b_y, input_precision="ieee")
    tl.store(ws + ((i_n * S + i_s) * BN + tl.arange(0, BN))[:, None] * BT + o_t[None, :], b_y)
    tl.debug_barrier()
    if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * S - 1:
        o_r = tl.arange(0, RT)          # the rows routed: T of them (RT a power of 2, not BT: no spills)
        m_r = o_r < T
        r_src = o_r
        if HAS_ROWS:      # a row past `rows` routes as the last row before it (stale_rows)
            r_src = tl.minimum(o_r, tl.maximum(tl.load(rows) - 1, 0)).to(tl.int32)
        o_e = tl.arange(0, BE)
        b_l = _logits(ws, ss, s_ss, NB, H, eps, r_src, m_r, o_e, o_e < E, x, BT, BN, S, NBP)
        b_l = tl.where((o_e < E)[None, :], b_l, float("-inf"))
        b_p = tl.exp(b_l - tl.max(b_l, 1)[:, None])
        o_k = tl.arange(0, KP)
        b_ids = tl.zeros([RT, KP], dtype=tl.int32)
        b_top = tl.zeros([RT, KP], dtype=tl.float32)
        total = tl.zeros([RT], dtype=tl.float32)
        for j in tl.static_range(K):
            best, idx = tl.max(b_p, 1, return_indices=True, return_indices_tie_break_left=True)
            b_p = tl.where(o_e[None, :] == idx[:, None], -1.0, b_p)
            b_ids = tl.where(o_k[None, :] == j, idx[:, None], b_ids)
            b_top = tl.where(o_k[None, :] == j, best[:, None], b_top)
            total += best
        b_w = tl.div_rn(b_top, total[:, None])
        m_c = m_r[:, None] & (o_k < K)[None, :]
        if HAS_GATE or SHARED:    # the logit past the experts': the shared expert's gate
            o_g = tl.full([1], E, tl.int32)
            b_g = tl.sigmoid(tl.sum(_logits(ws, ss, s_ss, NB, H, eps, r_src, m_r, o_g, o_g == E, x, BT, BN, S,
                                            NBP), 1))
        KK: tl.constexpr = K + SHARED
        tl.store(ids + o_r[:, None] * KK + o_k[None, :], b_ids, mask=m_c)
        tl.store(weights + o_r[:, None] * KK + o_k[None, :], b_w, mask=m_c)
        if SHARED:      # choice K: the shared expert (E), weighted by its gate
            tl.store(ids + o_r * KK + K, tl.full([RT], E, tl.int32), mask=m_r)
            tl.store(weights + o_r * KK + K, b_g, mask=m_r)
        elif HAS_GATE:
            tl.store(gate + o_r, b_g, mask=m_r)
        if LAYOUT:
            tl.debug_barrier()          # every row's ids stored before the layout reads them
            write_step_layout(ids, T * KK, expert, pairs, NBL, BP, BM, BB)
        tl.atomic_xchg(count, 0)


@triton.jit
def _logits(ws, ss, s_ss, NB, H, eps, r_src, m_t, o_e, m_e, x, BT: tl.constexpr, BN: tl.constexpr,
            S: tl.constexpr, NBP: tl.constexpr):
    """[len(r_src), len(o_e)] float32: the router's outputs o_e of rows r_src from the S parts in ws, added
    in order, scaled by each row's 1 / rms for a Normed input and rounded to x's dtype, as the
    product kernel finishes them (matvec._finish)."""
    p_0 = ws + ((o_e // BN * S) * BN + o_e % BN)[None, :] * BT + r_src[:, None]
    m = m_t[:, None] & m_e[None, :]
    b_l = tl.load(p_0, mask=m, other=0., cache_modifier=".cg")
    for i_p in tl.static_range(1, S):
        b_l += tl.load(p_0 + i_p * BN * BT, mask=m, other=0., cache_modifier=".cg")
    if NBP > 0:
        b_l = b_l * _row_scale(ss, s_ss, NB, H, eps, r_src, m_t, NBP)[:, None]
    return b_l.to(x.dtype.element_ty).to(tl.float32)


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


def routes_whole(x, router, plan: ProductPlan) -> bool:
    """Whether a step's router product and routing can run as one launch (route_rows): the plan's
    router_routes, rows on the GPU (a tensor or a Normed, no more than the plan's row tile) and a
    router in their dtype with contiguous rows."""
    rows = x.x if isinstance(x, Normed) else x
    return plan.router_routes and use_triton(rows, router) and _takes(rows, router, plan)


def _takes(rows: torch.Tensor, router, plan: ProductPlan) -> bool:
    """Whether _router_kernel takes these rows and router: one dtype, contiguous rows, the plan's row tile."""
    return (isinstance(router, torch.Tensor) and router.dtype == rows.dtype and router.shape[1] == rows.shape[1]
            and router.stride(1) == 1 and rows.stride(1) == 1 and rows.shape[0] <= min(plan.rows, STEP_ROWS))


def route_rows(x, router: torch.Tensor, top_k: int, n_experts: int, shared: bool = False,
               rows: torch.Tensor | None = None, plan: ProductPlan | None = None):
    """route_step over the router's logits x @ routerᵀ (x [T, H] or a Normed, a step's rows on the
    GPU), the product and the routing in one launch (_router_kernel): the product's programs as the
    product kernel splits it (matvec.tiles, tail_split: the same logits, bit for bit), the last of
    them routing every row and, under the plan's routed_layout, writing the layout."""
    plan = plan or default_products(router.device)
    assert _takes(x.x if isinstance(x, Normed) else x, router, plan), \
        f"route_rows takes 1..{min(plan.rows, STEP_ROWS)} rows with contiguous columns and a router in their dtype"
    NR, H = router.shape
    xs, scale = _scale_args(x, H)
    T, kk = xs.shape[0], top_k + shared
    assert not shared or NR > n_experts, "a shared expert needs its gate's logit"
    BN, BK, warps, stages = tiles(NR, H, xs.element_size(), plan=plan)
    blocks, KI = triton.cdiv(NR, BN), triton.cdiv(H, BK)
    S, KS = tail_split(blocks, KI, plan) or (1, KI)
    dev = xs.device
    ids = torch.empty(T, kk, dtype=torch.int32, device=dev)
    weights = torch.empty(T, kk, dtype=torch.float32, device=dev)
    has_gate = NR > n_experts and not shared
    gate = torch.empty(T, dtype=torch.float32, device=dev) if has_gate else None
    n_blocks = min(n_experts + shared, T * kk)
    laid = {}
    if plan.routed_layout:
        laid = dict(LAYOUT=True, expert=torch.empty(n_blocks, dtype=torch.int32, device=dev),
                    pairs=torch.empty(n_blocks, STEP_ROWS, dtype=torch.int32, device=dev), NBL=n_blocks,
                    BP=max(16, triton.next_power_of_2(T * kk)), BB=triton.next_power_of_2(n_blocks), BM=STEP_ROWS)
    ws = torch.empty(blocks * S, BN, plan.rows, dtype=torch.float32, device=dev)
    _router_kernel[(blocks, S)](
        xs, router, scale["ss"], ws, arrival_counts(dev, 1, "router"), rows if rows is not None else ids,
        ids, weights, gate if has_gate else weights, T, n_experts, NR, H, KS * BK, scale["NB"], xs.stride(0),
        router.stride(0), scale["s_ss"], scale["eps"], BT=plan.rows, BN=BN, BK=BK, S=S, NBP=scale["NBP"],
        K=top_k, KP=triton.next_power_of_2(top_k), BE=triton.next_power_of_2(n_experts), HAS_GATE=has_gate,
        SHARED=shared, HAS_ROWS=rows is not None, RT=triton.next_power_of_2(T), num_warps=warps, num_stages=stages,
        **pdl(xs), **laid)
    return ids, weights, gate, StepLayout(ids, n_blocks, laid.get("expert"), laid.get("pairs"))


def route(logits: torch.Tensor, top_k: int, n_experts: int, step: bool, shared: bool = False,
          rows: torch.Tensor | None = None, plan: ProductPlan | None = None):
    """(ids, weights, gate, layout). A step on the GPU routes its rows in one kernel, which writes the
    layout too under the plan's routed_layout, or leaves it to the expert kernels (StepLayout); a
    prefill groups its pairs into blocks of PREFILL_ROWS. `shared`: the shared expert as every
    row's last choice, expert E (route_ref). `rows`: the rows that count, the rest routed as the
    last of them (stale_rows)."""
    if step and use_triton(logits):
        plan = plan or default_products(logits.device)
        return route_step(logits, top_k, n_experts, shared, rows, plan.routed_layout)
    ids, weights, gate = route_ref(stale_rows(logits, rows), top_k, n_experts, shared)
    return ids, weights, gate, layout_ref(ids, n_experts + shared, STEP_ROWS if step else PREFILL_ROWS)
