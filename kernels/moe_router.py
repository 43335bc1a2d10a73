"""An MoE layer's router product and its routing in one kernel, for a step's few rows: what
`matvec(x, w_router)` and then `moe.route_step` compute, without the 5-program product (257 rows of
64 on 132 SMs, each program over all of the 2,048 columns) and the routing kernel after it.

The product runs split: program (i_n, i_s) takes column block i_n (BN of the E (+1) router rows) over
the i_s-th range of K, for every row, and stores its float32 sums. The last program to finish (an
acq_rel count over all of them) adds each logit's parts in range order, rounds the logits to x's
dtype (the value `matvec` would hand the routing) and routes every row as moe.route_step does:
softmax over the E experts, the top k (of equal values the smaller expert first, where torch.topk's
order is unspecified: route_first_ref), renormalised; the shared
expert as choice k+1 weighted by the sigmoid of logit E, or that sigmoid as `gate`. The split is a
function of the shapes and the GPU's SM count alone, and each row's sums run in the same order
whatever the other rows hold: a row routes the same alone or among others (greedy MTP on == off).
`route_fused_ref` is the float32 reference, the order of the sums included.
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import pdl, pdl_start, tl, triton
from mtpchat.kernels.matvec import MAX_ROWS, _programs, arrival_counts
from mtpchat.kernels.moe import route_ref, stale_rows
from mtpchat.kernels.moe_layout import STEP_ROWS, StepLayout


def _split(E1: int, K: int, itemsize: int, P: int) -> tuple[int, int, int, int]:
    """(BN, BK, parts, K tiles a part): 64-row blocks, 512-byte K tiles, as many parts a block as
    keep the programs within the SMs (8 at most, one tile a part at least)."""
    BN, BK = 64, 512 // itemsize
    blocks, KI = triton.cdiv(E1, BN), triton.cdiv(K, BK)
    S = max(1, min(8, KI, P // blocks))
    KS = triton.cdiv(KI, S)
    return BN, BK, triton.cdiv(KI, KS), KS


def route_fused_ref(x: torch.Tensor, w: torch.Tensor, top_k: int, n_experts: int, shared: bool = False,
                    P: int = 132, rows: torch.Tensor | None = None):
    """What the kernel computes, in float32: the logits as the sum of the parts over its K ranges
    (in order), rounded to x's dtype, then routed (moe.route_ref; `rows`: moe.stale_rows)."""
    K = x.shape[1]
    _, BK, S, KS = _split(w.shape[0], K, x.element_size(), P)
    total = None
    for k0 in range(0, K, KS * BK):
        part = x[:, k0:k0 + KS * BK].float() @ w[:, k0:k0 + KS * BK].float().T
        total = part if total is None else total + part
    return route_first_ref(stale_rows(total.to(x.dtype), rows), top_k, n_experts, shared)


def route_first_ref(logits: torch.Tensor, top_k: int, n_experts: int, shared: bool = False):
    """moe.route_ref with the kernels' order among equal probabilities, the smaller expert first
    (torch.topk's is unspecified; bf16 logits tie often enough to matter)."""
    ids, weights, gate = route_ref(logits, top_k, n_experts, shared)
    probs = torch.softmax(logits[:, :n_experts].float(), dim=-1)
    top, first = torch.sort(probs, dim=-1, descending=True, stable=True)
    ids[:, :top_k] = first[:, :top_k].to(ids.dtype)
    weights[:, :top_k] = top[:, :top_k] / top[:, :top_k].sum(dim=-1, keepdim=True)
    return ids, weights, gate


@triton.jit(do_not_specialize=["T"])
def _router_kernel(x, w, parts, count, ids, weights, gate, rows, T, E, E1, K, KS, s_x, s_w,
                   BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr,
                   TOPK: tl.constexpr,
                   KP: tl.constexpr, HAS_GATE: tl.constexpr, SHARED: tl.constexpr, HAS_ROWS: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_start(PDL)
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n, o_t = i_n * BN + tl.arange(0, BN), tl.arange(0, BT)
    m_n, m_t = o_n < E1, o_t < T
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    for k in range(i_s * KS, tl.minimum(i_s * KS + KS, K), BK):
        o_k = k + tl.arange(0, BK)
        m_k = o_k < K
        b_w = tl.load(w + o_n[:, None] * s_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
        b_x = tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        acc = tl.dot(b_w, tl.trans(b_x), acc, input_precision="ieee")
    # parts [S, BT, BP]: part i_s of row t's logit n at (i_s * BT + t) * BP + n
    tl.store(parts + (i_s * BT + o_t[None, :]) * BP + o_n[:, None], acc, mask=m_n[:, None] & m_t[None, :])
    tl.debug_barrier()
    # the last of all programs routes: its acq_rel add, after every thread stored, orders the parts
    if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * tl.num_programs(1) - 1:
        o_e = tl.arange(0, BE)                                   # the E experts' logits (BE >= E)
        m_l = m_t[:, None] & (o_e < E)[None, :]
        o_src = o_t                 # HAS_ROWS: a row past `rows` routes as the last before it (moe.stale_rows)
        if HAS_ROWS:
            o_src = tl.minimum(o_t, tl.maximum(tl.load(rows) - 1, 0).to(tl.int32))
        p_l = parts + o_src[:, None] * BP + o_e[None, :]
        b_l = tl.load(p_l, mask=m_l, other=0., cache_modifier=".cg")
        for i_p in range(1, tl.num_programs(1)):
            b_l += tl.load(p_l + i_p * BT * BP, mask=m_l, other=0., cache_modifier=".cg")
        b_g = tl.zeros([BT], dtype=tl.float32)                   # logit E, where there is one
        if HAS_GATE or SHARED:
            for i_p in range(0, tl.num_programs(1)):
                b_g += tl.load(parts + (i_p * BT + o_src) * BP + E, mask=m_t, other=0., cache_modifier=".cg")
        dtype = x.dtype.element_ty
        # the logits matvec would give; the rows past T stay finite (0), never read
        b_l = tl.where((o_e < E)[None, :], b_l.to(dtype).to(tl.float32), float("-inf"))
        b_g = tl.sigmoid(b_g.to(dtype).to(tl.float32))
        b_p = tl.exp(b_l - tl.max(b_l, 1)[:, None])
        b_p = b_p / tl.sum(b_p, 1)[:, None]
        o_k = tl.arange(0, KP)
        b_ids = tl.zeros([BT, KP], dtype=tl.int32)
        b_top = tl.zeros([BT, KP], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            best = tl.max(b_p, 1)
            idx = tl.argmax(b_p, 1)
            b_p = tl.where(o_e[None, :] == idx[:, None], -1.0, b_p)
            b_ids = tl.where(o_k[None, :] == j, idx[:, None], b_ids)
            b_top = tl.where(o_k[None, :] == j, best[:, None], b_top)
        b_top = b_top / tl.sum(b_top, 1)[:, None]
        KK: tl.constexpr = TOPK + SHARED
        m_k = m_t[:, None] & (o_k < TOPK)[None, :]
        tl.store(ids + o_t[:, None] * KK + o_k[None, :], b_ids, mask=m_k)
        tl.store(weights + o_t[:, None] * KK + o_k[None, :], b_top, mask=m_k)
        if SHARED:          # choice k+1: the shared expert (E), weighted by its gate
            tl.store(ids + o_t * KK + TOPK, tl.full([BT], 0, tl.int32) + E, mask=m_t)
            tl.store(weights + o_t * KK + TOPK, b_g, mask=m_t)
        elif HAS_GATE:
            tl.store(gate + o_t, b_g, mask=m_t)
        tl.atomic_xchg(count, 0)


def route_fused(x: torch.Tensor, w: torch.Tensor, top_k: int, n_experts: int, shared: bool = False,
                rows: torch.Tensor | None = None):
    """moe.route_step(matvec(x, w), ..., rows) in one kernel for a step's rows x [T, H] (a tensor,
    CUDA) and the router w [E (+1), H]: (ids, weights, gate, StepLayout)."""
    T, K = x.shape
    E1 = w.shape[0]
    assert T <= min(STEP_ROWS, MAX_ROWS), f"a step routes at most {STEP_ROWS} rows, got {T}"
    assert w.shape[1] == K and x.dtype == w.dtype and x.stride(1) == 1 and w.stride(1) == 1, \
        "x [T, H] and the router [E (+1), H] must share a dtype and have contiguous rows"
    assert not shared or E1 > n_experts, "a shared expert needs its gate's logit"
    BN, BK, S, KS = _split(E1, K, x.element_size(), _programs(x.device))
    BT, BP, BE = MAX_ROWS, triton.cdiv(E1, BN) * BN, triton.next_power_of_2(n_experts)
    kk, dev = top_k + shared, x.device
    has_gate = E1 > n_experts and not shared
    ids = torch.empty(T, kk, dtype=torch.int32, device=dev)
    weights = torch.empty(T, kk, dtype=torch.float32, device=dev)
    gate = torch.empty(T, dtype=torch.float32, device=dev) if has_gate else None
    parts = torch.empty(S, BT, BP, dtype=torch.float32, device=dev)
    count = arrival_counts(dev, 1)
    _router_kernel[(triton.cdiv(E1, BN), S)](
        x, w, parts, count, ids, weights, gate if has_gate else weights, rows if rows is not None else ids,
        T, n_experts, E1, K, KS * BK,
        x.stride(0), w.stride(0), BT=BT, BN=BN, BK=BK, BP=BP, BE=BE, TOPK=top_k, KP=triton.next_power_of_2(top_k),
        HAS_GATE=has_gate, SHARED=shared, HAS_ROWS=rows is not None, num_warps=4, num_stages=2, **pdl(x))
    return ids, weights, gate, StepLayout(ids, min(n_experts + shared, T * kk))
