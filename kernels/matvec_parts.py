"""Split products for a few rows, y [T, N] = x [T, K] @ w [N, K]ᵀ as in matvec.py, where w has fewer
column blocks than the GPU has SMs (the 27B's 5120-row o_proj, out_proj and MLP down: 80 blocks of
64 on 132 SMs), which one program a block would leave idle. `matvec_parts` splits K into S ranges,
one program per (column block, range), and returns the S float32 partial products; the kernel that
reads the product (the residual add and norm after it, kernels/norm.py) adds them up in order.
With `norm` the product finishes that norm block by block instead: the last of each column block's
programs adds its parts and the residual and writes the block's share of the normalised rows as a
`Normed` (h * (1 + w) and the block's sums of h²), and the next product, given the Normed, scales
each output row by the row's 1 / rms after its dot. The split is a function of the shapes alone,
so it keeps the row invariance; its tiles and number of parts come from the ProductPlan
(kernels/plan.py). The float32 references sit beside the kernel.
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import pdl, pdl_release, pdl_start, tl, triton, use_triton
from mtpchat.kernels.forms import dense_ref, values_of
from mtpchat.kernels.fp8 import fp8_fit, fp8_run
from mtpchat.kernels.int4 import GroupInt4, dot_int4, measured
from mtpchat.kernels.matvec import (Normed, _dot_tile, _format_args, arrival_counts, check_product, pieces,
                                    permuted_once)
from mtpchat.kernels.plan import ProductPlan, default_products


@triton.jit(do_not_specialize=["T"])
def _matvec_parts_kernel(x, w, sw, y, count, r, nw, xn, h, ss, T, N, K, KS, s_x, s_w, s_yp, s_y, s_r, s_xn,
                         s_h, s_ss, s_sw, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr,
                         NORM: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr, BITS: tl.constexpr = 0,
                         RESIDUAL: tl.constexpr = True, G: tl.constexpr = 0, BG: tl.constexpr = 0, zw=None,
                         perm=None, UNPACK: tl.constexpr = False, LATE: tl.constexpr = False,
                         RUN: tl.constexpr = 1):
    # program (i_n, i_s): output columns i_n*BN.. over K[i_s*KS : (i_s+1)*KS], float32 into y[i_s]
    # (LATE: the next kernel's programs placed after the loop; RUN: tiles a K step, matvec._matvec_kernel)
    pdl_start(PDL, LATE)
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < N, o_t < T
    m_y = m_n[:, None] & m_t[None, :]
    b_y = tl.zeros([BN, BT], dtype=tl.float32)
    # the start hinted a multiple of BK: a 4-bit weight's words then load in 16-byte copies (KS's
    # known divisor, 16 weights, is 8 bytes of interleaved half-words)
    for k in range(tl.multiple_of(i_s * KS, BK), tl.minimum(i_s * KS + KS, K), BK):
        if G > 0:       # 4-bit weights (kernels/int4.py)
            # rows past T read row T - 1 (dot_int4: interleaved x tiles load unmasked; their sums are never stored)
            b_y = dot_int4(b_y, w, sw, zw, perm, o_n, m_n, s_w, s_sw, x + tl.minimum(o_t, T - 1)[None, :] * s_x, m_t,
                           k, K, BK, G, BG, UNPACK)
        else:
            for u in tl.static_range(RUN):
                k_u = k + u * (BK // RUN)
                o_k = k_u + tl.arange(0, BK // RUN)
                m_k = o_k < K
                b_x = tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
                # FP8: BK / RUN divides the 128-column scale blocks and BN the 128-row ones (matvec._dot_tile)
                b_y = _dot_tile(w + o_n[:, None] * s_w + o_k[None, :], m_n[:, None] & m_k[None, :], tl.trans(b_x),
                                b_y, sw, i_n * BN // 128, s_sw, k_u, FP8, 128, BITS)
    if LATE:
        pdl_release(PDL)
    o_y = o_t[None, :] * s_y + o_n[:, None]
    tl.store(y + i_s * s_yp + o_y, b_y, mask=m_y)
    if NORM:
        # The last of a column block's S programs to end finishes its columns: the parts added in
        # order and rounded (the product's value), the residual added (h), x = h * (1 + w) and the
        # block's sums of h² for the next product (Normed), then sets the block's count back to 0.
        # Its acq_rel add, after every thread of the program has stored, orders the S parts
        # before the last program's reads of them (from L2).
        tl.debug_barrier()
        if tl.atomic_add(count + i_n, 1, sem="acq_rel", scope="gpu") == S - 1:
            b_v = tl.load(y + o_y, mask=m_y, other=0., cache_modifier=".cg")
            for i_p in tl.static_range(1, S):
                b_v += tl.load(y + i_p * s_yp + o_y, mask=m_y, other=0., cache_modifier=".cg")
            dtype = h.dtype.element_ty
            b_h = b_v.to(dtype)
            if RESIDUAL:
                b_r = tl.load(r + o_t[None, :] * s_r + o_n[:, None], mask=m_y, other=0.).to(tl.float32)
                b_h = (b_h.to(tl.float32) + b_r).to(dtype)
            tl.store(h + o_t[None, :] * s_h + o_n[:, None], b_h, mask=m_y)
            b_h = b_h.to(tl.float32)
            b_nw = 1. + tl.load(nw + o_n, mask=m_n, other=0.).to(tl.float32)
            tl.store(xn + o_t[None, :] * s_xn + o_n[:, None], (b_h * b_nw[:, None]).to(dtype), mask=m_y)
            tl.store(ss + o_t * s_ss + i_n, tl.sum(b_h * b_h, axis=0), mask=m_t)
            tl.atomic_xchg(count + i_n, 0)


def split_config(N: int, K: int, itemsize: int, plan: ProductPlan, group: int = 0,
                 interleaved: bool = False) -> tuple[int, int, int, int, int]:
    """(S, BN, BK, warps, stages) of a split product: the plan's split rule where it gives one, else
    S ranges of K (no more than K / (8 BK), rounded up; 4-bit: K / (3 BK)), for some
    plan.split_programs programs in all (240: the 27B's 5120-row products, 80 column blocks x 3).
    Tiles of 16 KB of w, 4 deep (80 KB of shared memory with x's), so that two programs fit on an
    SM and all 240 are resident at once on an H100; never a function of T. 4-bit weights in groups
    of `group` columns (kernels/int4.py), `interleaved` or not: the plan's int4_tiles rule
    ("split"), else the measured tile (int4.measured, which for rows of 16384 or more, the 27B's
    MLP down, comes with its parts: 4); interleaved ones in parts for twice the programs (their
    32-row tiles: 480 on the 27B, 3 parts)."""
    if group:
        chosen = plan.int4_tiles("split", N, K, group) if plan.int4_tiles is not None else None
        tile = measured("split", N, K, interleaved)[0]
        if chosen is None and len(tile) == 5:       # a measured tile with its parts
            return tile
        BN, BK, warps, stages = tile[-4:]
    else:
        chosen = plan.split_tiles(N, K, itemsize) if plan.split_tiles is not None else None
        BN, BK, warps, stages = 64, 256 // itemsize, 4, 4
    if chosen is not None:
        return chosen
    # a part takes 8 K tiles at least (4-bit: 3; the 27B's interleaved out_proj in 3 parts of 512)
    programs = plan.split_programs * (2 if interleaved else 1)
    S = max(1, min(triton.cdiv(K, (3 if group else 8) * BK), round(programs / triton.cdiv(N, BN))))
    return S, BN, BK, warps, stages


def split_ranges(N: int, K: int, itemsize: int, plan: ProductPlan, group: int = 0,
                 interleaved: bool = False) -> list[tuple[int, int]]:
    """The K ranges [k0, k1) of a split product's parts, in the order they are added (`group`,
    `interleaved`: 4-bit weights, split_config)."""
    S, _, BK, _, _ = split_config(N, K, itemsize, plan, group, interleaved)
    KS = triton.cdiv(triton.cdiv(K, S), BK) * BK
    return [(k0, min(K, k0 + KS)) for k0 in range(0, K, KS)]


def matvec_parts_ref(x: torch.Tensor, w, plan: ProductPlan | None = None) -> torch.Tensor:
    """[S, T, N] float32: the products of x and w (a BlockFP8 or GroupInt4 dequantized) over each
    K range of split_ranges (under the plan; None: the measured defaults for x's device), ranges
    of the weight's columns (a GroupInt4 with perm: in its sorted order)."""
    ranges = split_ranges(w.shape[0], w.shape[1], x.element_size(), plan or default_products(x.device), _group(w),
                          isinstance(w, GroupInt4) and w.interleaved)
    if isinstance(w, GroupInt4) and w.perm is not None:
        # a part is over weight columns k0 .. k1, in the sorted order: x's columns perm[k0:k1]
        x, w = x[:, w.perm.long()], w._replace(perm=None)
    w = dense_ref(w)
    return torch.stack([x[:, k0:k1].float() @ w[:, k0:k1].float().T for k0, k1 in ranges])


def _group(w) -> int:
    """The group of a 4-bit weight (kernels/int4.py), 0 for any other."""
    return w.group if isinstance(w, GroupInt4) else 0


def parts_sum_ref(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The product from its parts [S, T, N]: added in order in float32, rounded to dtype."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total.to(dtype)


def matvec_parts_triton(x: torch.Tensor, w: torch.Tensor, norm: tuple | None = None,
                        plan: ProductPlan | None = None):
    """The parts [S, T, N]; with norm = (residual [T, N], weight [N], eps), the residual add and
    the norm's two pieces instead: returns (Normed(h * (1 + weight), sums of h², eps), h) for
    h = x @ wᵀ + residual, finished block by block by each column block's last program. A residual
    of None adds nothing (h = x @ wᵀ: the MTP head's fc, which its layer's input norm reads)."""
    N, K = w.shape
    plan = plan or default_products(x.device)
    BT = plan.rows_of(w)
    if x.shape[0] > BT:
        if norm is None:
            return torch.cat([matvec_parts_triton(x[a:b], w, None, plan) for a, b in pieces(x.shape[0], BT)], 1)
        r, nw, eps = norm
        done = [matvec_parts_triton(x[a:b], w, (None if r is None else r[a:b], nw, eps), plan)
                for a, b in pieces(x.shape[0], BT)]
        return (Normed(torch.cat([n.x for n, _ in done]), torch.cat([n.ss for n, _ in done]), eps),
                torch.cat([h for _, h in done]))
    x, w = permuted_once(x, w, plan)
    w, sw, fp8 = check_product(x, w, K, BT)
    T = x.shape[0]
    G = fp8.get("G", 0)
    il = w.dtype == torch.int16                   # interleaved 4-bit weights
    ranges = split_ranges(N, K, x.element_size(), plan, G, il)
    _, BN, BK, warps, stages = split_config(N, K, x.element_size(), plan, G, il)
    if fp8["FP8"] and plan.split_tiles is None:
        stages = plan.split_fp8_stages
    # an FP8 tile of two scale blocks (fp8_run) must divide K, or the last part's K step would read
    # a scale past its row; the rule that chose it must say so (its parts' ranges follow from BK)
    assert not fp8["FP8"] or fp8_fit((BK, warps, stages), K)[0] == BK, \
        f"an FP8 split tile's K ({BK}) must be 128 or less, or 256 dividing K ({K})"
    blocks = triton.cdiv(N, BN)
    y = torch.empty(len(ranges), T, N, dtype=torch.float32, device=x.device)
    if norm is None:
        r = nw = xn = h = ss = count = y
        eps = 0.
    else:
        r, nw, eps = norm
        if r is not None:
            assert r.shape == (T, N) and r.stride(1) == 1 and r.dtype == x.dtype, f"residual must be [{T}, {N}] like x"
        assert nw.shape == (N,) and nw.is_contiguous(), f"the norm's weight must be [{N}] contiguous"
        xn, h = (torch.empty(T, N, dtype=x.dtype, device=x.device) for _ in range(2))
        r = h if r is None else r                 # never read without a residual (RESIDUAL False)
        ss = torch.empty(T, blocks, dtype=torch.float32, device=x.device)
        count = arrival_counts(x.device, blocks)
    _matvec_parts_kernel[(blocks, len(ranges))](
        x, w, sw, y, count, r, nw, xn, h, ss, T, N, K, ranges[0][1], x.stride(0), w.stride(0), y.stride(0),
        y.stride(1), r.stride(0), xn.stride(0), h.stride(0), ss.stride(0), BT=BT, BN=BN, BK=BK,
        S=len(ranges), NORM=norm is not None, RESIDUAL=norm is None or norm[0] is not None, num_warps=warps,
        num_stages=stages, LATE=plan.late_release, **fp8, **pdl(x), **fp8_run(BK, fp8["FP8"]),
        **_format_args(x, w, BN, BK, warps, fp8, plan, ("split", N, K)))
    return y if norm is None else (Normed(xn, ss, eps), h)


def matvec_parts(x: torch.Tensor, w, plan: ProductPlan | None = None) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ (w a tensor, a BlockFP8 or a GroupInt4) as its float32 parts [S, T, N] over the K
    ranges of split_ranges (S may be 1): the Triton kernel for CUDA tensors, the float32 reference
    otherwise. parts_sum_ref, or the norm that reads them, makes the product."""
    if use_triton(x, values_of(w)):
        return matvec_parts_triton(x, w, plan=plan)
    return matvec_parts_ref(x, w, plan)
