"""Matrix-vector products for a few rows (decode, verify, draft): y [T, N] = x [T, K] @ w [N, K]ᵀ,
and the MLP's gate|up product with its SwiGLU fused in: silu(x @ w_gateᵀ) * (x @ w_upᵀ); also the
SwiGLU alone (`silu_mul`), for the batched products of prefill.

Float32 torch references, the Triton kernels beside them, and `matvec` / `matvec_swiglu`, which
take the kernels for CUDA tensors and the references otherwise.

The kernel streams w once: one program per block of BN output columns walks K in BK steps and
multiplies its w tile with all rows of x at once (rows padded to BT = 16, the smallest tensor-core
tile). The compiled kernel is the same for every T <= BT (T is a run-time argument, never a
specialisation), each output is accumulated over K in the same order whatever the other rows
hold, so row i of a T-row call is bit-for-bit the 1-row call of row i.

A product whose column blocks end in a small partial wave on the GPU's SMs (the 27B's MLP gate|up:
272 blocks on 132 SMs, one program an SM, leaves 8 blocks streaming alone at the end) has that
last wave split over K: each of its blocks is taken by the plan's tail_parts programs (3), each
over a run of whole K tiles, which leave float32 parts, and the last of them to finish adds them
in order and writes the block. The split is a function of the shapes, the number of SMs and the
plan (kernels/plan.py), never of T.

The weight may be a tensor, a BlockFP8 (kernels/fp8.py: each tile widened, its dot scaled) or a
GroupInt4 (kernels/int4.py: each tile's words unpacked in registers to exact bf16 integers, one
dot a group, the group's scale on its float32 result; a weight's perm applied to x once before the
kernel (ProductPlan.permute_x, the default) or to x's tile in every program).

Products with fewer column blocks than SMs are split over K in matvec_parts.py, whose norm-finishing
form hands the next product its input as a `Normed` (below).

A small product over the same rows in the rows' dtype may ride in a product's launch
(`matvec_rider`, the plan's `rides`: an FP8 or 4-bit model's GDN b|a rows beside its in_proj): its
column blocks take the launch's first programs, the product's follow, computing what they compute
in a launch of their own.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mtpchat.kernels._triton import pdl, pdl_release, pdl_start, tl, triton, use_triton
from mtpchat.kernels.conv import ConvStep, conv_columns, conv_step_ref
from mtpchat.kernels.forms import dense_ref, values_of
from mtpchat.kernels.fp8 import BLOCK, BlockFP8, fp8_fit, fp8_run, widen, widen_args
from mtpchat.kernels.int4 import (GroupInt4, check_int4, dot_int4, form_args, form_of, interleaved_args, measured,
                                  sub_tile)
from mtpchat.kernels.plan import PIPELINE_SLACK, PREFILL_ROWS, ProductPlan, default_products

MAX_ROWS = 16


class Normed(NamedTuple):
    """Rows after a residual add and RMSNorm, kept in two pieces for the product that reads them:
    x = h * (1 + w) in the model dtype, and ss [T, NB] float32, the sums of h² over NB blocks of
    columns. The product scales each output row by rsqrt(sum(ss) / K + eps), the norm's 1 / rms,
    after its dot, so no kernel between two products has to see a whole row (matvec_parts with
    `norm` makes them)."""
    x: torch.Tensor
    ss: torch.Tensor
    eps: float

    # what the model's code asks of its activations
    shape = property(lambda self: self.x.shape)
    dtype = property(lambda self: self.x.dtype)
    device = property(lambda self: self.x.device)
    is_cuda = property(lambda self: self.x.is_cuda)


def rstd_ref(n: Normed) -> torch.Tensor:
    """[T] float32: 1 / rms of each row of a Normed."""
    return torch.rsqrt(n.ss.sum(-1) / n.x.shape[1] + n.eps)


def matvec_ref(x, w) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ in float32, cast back to x's dtype; for a Normed x, each row scaled by
    its 1 / rms before the cast; a BlockFP8 or GroupInt4 w is dequantized (kernels/fp8.py, int4.py)."""
    w = dense_ref(w)
    if isinstance(x, Normed):
        return ((x.x.float() @ w.float().T) * rstd_ref(x)[:, None]).to(x.x.dtype)
    return (x.float() @ w.float().T).to(x.dtype)


def matvec_swiglu_ref(x, w: torch.Tensor) -> torch.Tensor:
    """w = [w_gate | w_up] [2I, K] -> silu(gate) * up [T, I], each step rounded to x's dtype as the
    model does it in torch (the product, silu, the multiplication)."""
    gate, up = matvec_ref(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _row_scale(ss, s_ss, NB, K, eps, o_t, m_t, NBP: tl.constexpr):
    """[BT] float32: 1 / rms of each row of a Normed input, from its NB partial sums of squares."""
    o_b = tl.arange(0, NBP)
    b_ss = tl.load(ss + o_t[:, None] * s_ss + o_b[None, :], mask=m_t[:, None] & (o_b < NB)[None, :], other=0.)
    return tl.rsqrt(tl.sum(b_ss, axis=1) / K + eps)


@triton.jit
def _finish(b_g, b_u, b_rstd, x, y, o_t, o_n, m_t, m_n, s_y, NBP: tl.constexpr, SWIGLU: tl.constexpr):
    """A column block's outputs from its float32 sums [BN, BT]: scaled by the rows' 1 / rms for a
    Normed input, then rounded as the product's value (x's dtype) and stored as y's; for SwiGLU,
    b_g and b_u are the gate and up sums, each of torch's steps rounded to the model dtype."""
    if NBP > 0:
        b_g = b_g * b_rstd[None, :]
        if SWIGLU:
            b_u = b_u * b_rstd[None, :]
    dtype = x.dtype.element_ty
    b_y = b_g.to(dtype)
    if SWIGLU:
        b_g = b_y.to(tl.float32)
        b_s = (b_g * tl.sigmoid(b_g)).to(dtype).to(tl.float32)
        b_y = (b_s * b_u.to(dtype).to(tl.float32)).to(dtype)
    tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_y.to(y.dtype.element_ty), mask=m_n[:, None] & m_t[None, :])


@triton.jit
def _dot_tile(p_w, m_w, b_x, b_acc, sw, i_b, s_sw, k, FP8: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """b_acc + w tile [BN, BK] @ b_x [BK, BT]. FP8: the tile lies in one block of the weight's
    scales (row block i_b, column block k // BLOCK): widened to x's dtype (fp8.widen), multiplied,
    then scaled."""
    b_w = tl.load(p_w, mask=m_w, other=0.)
    if FP8:
        b_s = tl.load(sw + i_b * s_sw + k // BLOCK)
        b_acc += b_s * tl.dot(widen(b_w, b_x, BITS), b_x, input_precision="ieee")
    else:
        # "ieee" keeps float32 inputs exact (no tf32); bf16 inputs take the tensor cores regardless
        b_acc = tl.dot(b_w, b_x, b_acc, input_precision="ieee")
    return b_acc


@triton.jit(do_not_specialize=["T"])
def _matvec_kernel(x, w, sw, y, ws, count, ss, T, N, K, NB, F, KS, S, s_x, s_w, s_sw, s_y, s_ss, eps,
                   BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NBP: tl.constexpr,
                   SWIGLU: tl.constexpr, SPLIT: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
                   BITS: tl.constexpr = 0, G: tl.constexpr = 0, BG: tl.constexpr = 0, zw=None, perm=None,
                   UNPACK: tl.constexpr = False, LATE: tl.constexpr = False, RUN: tl.constexpr = 1,
                   w2=None, y2=None, N2=0, R=0, s_w2=0, s_y2=0, BN2: tl.constexpr = 0, BK2: tl.constexpr = 0,
                   cbuf=None, coff=None, clive=None, cw=None, CC=0, CWIDTH=0, s_cbuf=0, CK: tl.constexpr = 0,
                   CLIVE: tl.constexpr = False):
    # With a rider (BN2 > 0, matvec_rider), programs 0 .. R - 1 take the rider's column blocks of
    # BN2 rows of w2 over the same rows x, and program R + i the product's program i. With a conv
    # (CK > 0, conv.ConvStep) a column block below CC goes through it once its sums are stored.
    pdl_start(PDL, LATE)
    pid = tl.program_id(0)
    if BN2 > 0:
        if pid < R:
            _ride(x, w2, y2, ss, T, N2, K, NB, pid, s_x, s_w2, s_y2, s_ss, eps, BT, BN2, BK2, NBP, PDL, LATE)
        else:
            _main(pid - R, x, w, sw, y, ws, count, ss, T, N, K, NB, F, KS, S, s_x, s_w, s_sw, s_y, s_ss, eps,
                  BT, BN, BK, NBP, SWIGLU, SPLIT, FP8, PDL, BITS, G, BG, zw, perm, UNPACK, LATE, RUN,
                  cbuf, coff, clive, cw, CC, CWIDTH, s_cbuf, CK, CLIVE)
    else:
        _main(pid, x, w, sw, y, ws, count, ss, T, N, K, NB, F, KS, S, s_x, s_w, s_sw, s_y, s_ss, eps,
              BT, BN, BK, NBP, SWIGLU, SPLIT, FP8, PDL, BITS, G, BG, zw, perm, UNPACK, LATE, RUN,
              cbuf, coff, clive, cw, CC, CWIDTH, s_cbuf, CK, CLIVE)


@triton.jit
def _ride(x, w2, y2, ss, T, N2, K, NB, pid, s_x, s_w2, s_y2, s_ss, eps, BT: tl.constexpr, BN2: tl.constexpr,
          BK2: tl.constexpr, NBP: tl.constexpr, PDL: tl.constexpr, LATE: tl.constexpr):
    """A rider's program: column block pid of y2 = x @ w2ᵀ (w2 in x's dtype), all of K in steps of
    BK2, each row scaled by its 1 / rms for a Normed x, as a program of its own launch would. (Its
    first lines repeat _main's: moved into a shared helper, they changed the 4-bit product's
    compiled form, 61 -> 63 registers on sm_90, and a product's form is chosen by measurement.)"""
    o_n = pid * BN2 + tl.arange(0, BN2)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < N2, o_t < T
    b_rstd = tl.zeros([BT], dtype=tl.float32)
    if NBP > 0:
        b_rstd = _row_scale(ss, s_ss, NB, K, eps, o_t, m_t, NBP)
    b_y = tl.zeros([BN2, BT], dtype=tl.float32)
    for k in range(0, K, BK2):
        o_k = k + tl.arange(0, BK2)
        m_k = o_k < K
        b_x = tl.trans(tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.))
        b_w = tl.load(w2 + o_n[:, None] * s_w2 + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
        b_y = tl.dot(b_w, b_x, b_y, input_precision="ieee")
    if LATE:
        pdl_release(PDL)
    _finish(b_y, b_y, b_rstd, x, y2, o_t, o_n, m_t, m_n, s_y2, NBP, False)


@triton.jit
def _main(pid, x, w, sw, y, ws, count, ss, T, N, K, NB, F, KS, S, s_x, s_w, s_sw, s_y, s_ss, eps,
          BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NBP: tl.constexpr,
          SWIGLU: tl.constexpr, SPLIT: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
          BITS: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, zw, perm,
          UNPACK: tl.constexpr, LATE: tl.constexpr, RUN: tl.constexpr,
          cbuf, coff, clive, cw, CC, CWIDTH, s_cbuf, CK: tl.constexpr, CLIVE: tl.constexpr):
    # Program pid: with no SPLIT, column block pid, all of K (with SWIGLU, the gate rows n and the
    # up rows N + n of w together). With SPLIT only the first F programs do; program F + j takes
    # part i_s = j % S of block F + j // S, K from i_s KS to the lesser of (i_s + 1) KS and K, and
    # leaves its float32 sums in ws[j]; the last of the block's S parts to arrive adds them in
    # order, finishes the block and sets its count (count[j // S]) back to 0. Its acq_rel add,
    # after every thread of the program has stored, orders the parts before its reads. LATE: the
    # next kernel's programs are placed once this one's have streamed their weights. RUN: a K step
    # takes RUN tiles of BK / RUN columns, one after another along each weight row (fp8_run).
    if SPLIT:
        j = tl.maximum(pid - F, 0)
        i_s = j % S
        i_n = tl.where(pid < F, pid, F + j // S)
        k_lo = tl.where(pid < F, 0, i_s * KS)
        k_hi = tl.where(pid < F, K, tl.minimum(i_s * KS + KS, K))
    else:
        i_n, k_lo, k_hi = pid, 0, K
    o_n = i_n * BN + tl.arange(0, BN)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < N, o_t < T
    b_rstd = tl.zeros([BT], dtype=tl.float32)
    if NBP > 0:
        b_rstd = _row_scale(ss, s_ss, NB, K, eps, o_t, m_t, NBP)
    b_g = tl.zeros([BN, BT], dtype=tl.float32)
    b_u = tl.zeros([BN, BT], dtype=tl.float32)
    # the start hinted a multiple of BK: without it a split's loop over 4-bit words was not pipelined
    # (KS's known divisor, 16 weights, is 8 bytes of interleaved half-words: no 16-byte copies)
    for k in range(tl.multiple_of(k_lo, BK), k_hi, BK):
        if G > 0:
            # 4-bit weights (G columns a group, kernels/int4.py): w holds words, K counts weights
            # rows past T read row T - 1 (dot_int4: interleaved x tiles load unmasked; their sums are never stored)
            p_x = x + tl.minimum(o_t, T - 1)[None, :] * s_x
            b_g = dot_int4(b_g, w, sw, zw, perm, o_n, m_n, s_w, s_sw, p_x, m_t, k, K, BK, G, BG, UNPACK)
            if SWIGLU:
                b_u = dot_int4(b_u, w, sw, zw, perm, N + o_n, m_n, s_w, s_sw, p_x, m_t, k, K, BK, G, BG, UNPACK)
        else:
            for u in tl.static_range(RUN):
                k_u = k + u * (BK // RUN)
                o_k = k_u + tl.arange(0, BK // RUN)
                m_k = o_k < K
                m_w = m_n[:, None] & m_k[None, :]
                p_w = w + o_n[:, None] * s_w + o_k[None, :]
                b_x = tl.trans(tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                                       other=0.))
                # FP8: a column block's rows share one row of scales (BN divides the 128-row blocks)
                b_g = _dot_tile(p_w, m_w, b_x, b_g, sw, i_n * BN // 128, s_sw, k_u, FP8, 128, BITS)
                if SWIGLU:
                    b_u = _dot_tile(p_w + N * s_w, m_w, b_x, b_u, sw, (N + i_n * BN) // 128, s_sw, k_u, FP8, 128,
                                    BITS)
    if LATE:
        pdl_release(PDL)
    if not SPLIT:
        _finish(b_g, b_u, b_rstd, x, y, o_t, o_n, m_t, m_n, s_y, NBP, SWIGLU)
        if CK > 0 and i_n * BN < CC:
            conv_columns(y, o_n, m_n, T, s_y, cbuf, coff, clive, cw, CC, CWIDTH, s_cbuf, CK, BT, CLIVE)
    elif pid < F:
        _finish(b_g, b_u, b_rstd, x, y, o_t, o_n, m_t, m_n, s_y, NBP, SWIGLU)
        if CK > 0 and i_n * BN < CC:
            conv_columns(y, o_n, m_n, T, s_y, cbuf, coff, clive, cw, CC, CWIDTH, s_cbuf, CK, BT, CLIVE)
    else:
        o_ws = tl.arange(0, BN)[:, None] * BT + o_t[None, :]
        s_ws: tl.constexpr = BN * BT * (2 if SWIGLU else 1)
        tl.store(ws + j * s_ws + o_ws, b_g)
        if SWIGLU:
            tl.store(ws + j * s_ws + BN * BT + o_ws, b_u)
        tl.debug_barrier()
        if tl.atomic_add(count + j // S, 1, sem="acq_rel", scope="gpu") == S - 1:
            p_0 = ws + (j - i_s) * s_ws                              # the block's first part
            b_g = tl.load(p_0 + o_ws, cache_modifier=".cg")
            if SWIGLU:
                b_u = tl.load(p_0 + BN * BT + o_ws, cache_modifier=".cg")
            for i_p in range(1, S):
                b_g += tl.load(p_0 + i_p * s_ws + o_ws, cache_modifier=".cg")
                if SWIGLU:
                    b_u += tl.load(p_0 + i_p * s_ws + BN * BT + o_ws, cache_modifier=".cg")
            _finish(b_g, b_u, b_rstd, x, y, o_t, o_n, m_t, m_n, s_y, NBP, SWIGLU)
            if CK > 0 and i_n * BN < CC:
                conv_columns(y, o_n, m_n, T, s_y, cbuf, coff, clive, cw, CC, CWIDTH, s_cbuf, CK, BT, CLIVE)
            tl.atomic_xchg(count + j // S, 0)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up [T, I], each step rounded to the input's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(gu, y, N, s_gu, s_y, BN: tl.constexpr):
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    dtype = y.dtype.element_ty
    b_g = tl.load(gu + i_t * s_gu + o_n, mask=m_n, other=0.).to(tl.float32)
    b_u = tl.load(gu + i_t * s_gu + N + o_n, mask=m_n, other=0.).to(tl.float32)
    b_s = (b_g * tl.sigmoid(b_g)).to(dtype).to(tl.float32)
    tl.store(y + i_t * s_y + o_n, (b_s * b_u).to(dtype), mask=m_n)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    T, N2 = gate_up.shape
    assert N2 % 2 == 0 and gate_up.stride(1) == 1, "gate_up must be [T, 2I] with contiguous rows"
    N = N2 // 2
    y = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    BN = 1024
    _silu_mul_kernel[(T, triton.cdiv(N, BN))](gate_up, y, N, gate_up.stride(0), y.stride(0), BN=BN, num_warps=4)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's gating after a batched gate|up product (prefill): one pass instead of torch's two
    over strided halves; the reference otherwise."""
    return silu_mul_triton(gate_up) if use_triton(gate_up) else silu_mul_ref(gate_up)


def tiles(N: int, K: int, itemsize: int, swiglu: bool = False, fp8: bool = False,
          plan: ProductPlan | None = None, group: int = 0, interleaved: bool = False) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages): the plan's tile rule where it gives one, else the measured tile;
    never a function of T. BN counts output columns, so a SwiGLU
    program reads 2 x BN rows of w. Chosen on an H100 by whole decode steps of the 27B under other
    tiles (tests/bench/ab_step.py --plans tiles, the ratios in docs/PERFORMANCE.md): 64 x 512
    bytes suits every plain product (smaller tiles, more warps, other depths: 0-23% slower); the
    SwiGLU product is fastest with 64 columns (128 rows of w) by 256 bytes of K, 5 deep (the
    decode step 1.5% faster than with 32 x 512 bytes). float32 plain tiles take half the K. FP8
    weights: tiles of 32 rows, 2 warps, over rows of 4096 or more (K), each K step two scale blocks
    (256 bytes of each row, taken a block at a time: fp8_run) where 256 divides K and the plan's
    fp8_two_blocks name the product, the plain products 4 deep (48 KB of shared memory: four
    programs an SM), the SwiGLU 3 deep. On an H200 both: the FP8 27B's decode step 0.954 x the
    one-block tiles below, the same logits (the plain alone 0.990 x, the SwiGLU alone 0.965 x); on
    an H100 the plain ones alone (0.987 x; the SwiGLU's 1.011 x). A plain tile 5 or 6 deep, 3 deep,
    1 warp or 64 rows, a SwiGLU 2 or 4 deep, and two blocks a step in the split products beside
    these all slower on the H200 (tests/bench/ab_step.py --plans fp8tiles --tiles
    docs/bench-2026-11-27b/fp8-run-plans*.json).
    Otherwise one scale block's 128 columns a step: plain products over rows of 4096 or more 32
    rows, 2 warps, 8 deep (56 KB: four programs an SM; with the bit form 0.92 x the time of 64 rows,
    4 warps, the FP8 27B's decode step 0.994 x: bench_fp8.py --sweep, ab_step.py --plans fp8tiles),
    over shorter rows 64 rows, 4 warps, 8 deep (the 35B-A3B's K = 2048: its decode step 0.980 x the
    32-row tile's, though verify 3 1.007 x and draft 3 1.025 x); the SwiGLU product 32 columns (64
    rows of w), 2 warps, 3 deep (alone 2.38 TB/s against 1.79, the FP8 27B's decode step 0.953 x:
    tests/bench/bench_fp8.py, ab_step.py --plans fp8glu).

    4-bit weights in groups of `group` columns (kernels/int4.py; BK counts weights, 2 a byte), or
    `interleaved` ones: the plan's int4_tiles rule, else the measured tiles (int4.measured) but where
    the plan names an interleaved SwiGLU's (int4_glu_tile: 3 deep on an H200)."""
    if group:
        product = "swiglu" if swiglu else "plain"
        chosen = plan.int4_tiles(product, N, K, group) if plan is not None and plan.int4_tiles is not None else None
        if chosen is None and swiglu and interleaved and plan is not None:
            chosen = plan.int4_glu_tile
        return chosen or measured(product, N, K, interleaved)[0]
    chosen = plan.tiles(N, K, itemsize, swiglu, fp8) if plan is not None and plan.tiles is not None else None
    if chosen is not None:
        return fp8_fit(chosen, K) if fp8 else chosen
    return _fitted(_measured_tile(K, itemsize, swiglu, fp8, plan), swiglu, itemsize, plan)


def _fitted(tile: tuple[int, int, int, int], swiglu: bool, itemsize: int,
            plan: ProductPlan | None) -> tuple[int, int, int, int]:
    """A measured tile, its depth cut until its pipelined buffers fit the device's shared memory a
    program (ProductPlan.shared_memory): stages - 1 buffers of w's tile (2 BN rows for a SwiGLU) and
    x's [BK, rows] (bf16; a float32 model's float32), as Triton 3.6 lays them out (the bf16 plain
    tile, 64 x 256 x 4 deep, 122,880 bytes for sm_80-90: over the 101,376 an RTX 3090 or 4090, an
    A10 or an L4 gives, where it runs 3 deep in 81,920). The same sums at any depth; an H100's and
    an A100's tiles unchanged."""
    BN, BK, warps, stages = tile
    plan = plan or ProductPlan(programs=1)
    stage = (2 if swiglu else 1) * BN * BK * itemsize + BK * plan.rows * (4 if itemsize == 4 else 2)
    return BN, BK, warps, plan.depth(stages, stage)


def _measured_tile(K: int, itemsize: int, swiglu: bool, fp8: bool,
                   plan: ProductPlan | None) -> tuple[int, int, int, int]:
    """The measured tile of a bf16, float32 or FP8 product (tiles' docstring) on an H100."""
    if fp8:
        # rows of 4096 or more: two scale blocks a K step (fp8_run) where 256 divides K and the plan
        # takes them for this product (ProductPlan.fp8_two_blocks)
        two = plan.fp8_two_blocks if plan is not None else ProductPlan.fp8_two_blocks
        run = K >= 4096 and K % (2 * BLOCK) == 0 and ("swiglu" if swiglu else "plain") in two
        if swiglu:
            return 32, 2 * BLOCK if run else BLOCK, 2, 3
        if run:
            return 32, 2 * BLOCK, 2, 4
        return (32, BLOCK, 2, 8) if K >= 4096 else (64, BLOCK, 4, 8)
    if swiglu:
        return (64, 128, 4, 5) if itemsize == 2 else (32, 128, 4, 4)
    return 64, 512 // itemsize, 4, 4


def check_product(x: torch.Tensor, w, K: int, rows: int, most: int = MAX_ROWS) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """x [T, K] and w [N, K] as every product kernel takes them (here and in matvec_parts.py), T at
    most `rows` (the plan's row tile, at most `most`: a step's MAX_ROWS, a prefill's PREFILL_ROWS);
    returns (w's values, its scales or w again, the format's launch arguments: FP8, and for 4-bit
    weights the group G, the zeros and perm; kernels/int4.py)."""
    T = x.shape[0]
    assert 1 <= T <= rows <= most, f"this plan's products take 1..{rows} rows (at most {most}), got {T}"
    assert x.shape[1] == K == w.shape[1], f"x [T, K] and w [N, K] disagree: {tuple(x.shape)}, {tuple(w.shape)}"
    if isinstance(w, GroupInt4):
        check_int4(w, K, interleaved=True)
        assert w.perm is None or w.perm.dim() == 1, "a product's perm is [K]"
        assert x.stride(1) == 1, "x rows must be contiguous"
        return w.w, w.scale, dict(s_sw=w.scale.stride(0), FP8=False, G=w.group, zw=w.zero, perm=w.perm)
    if isinstance(w, BlockFP8):
        assert w.scale.dtype == torch.float32 and w.scale.stride(1) == 1 and w.scale.shape == \
            (triton.cdiv(w.shape[0], BLOCK), triton.cdiv(K, BLOCK)), "FP8 scales must be float32 [N/128, K/128]"
        assert w.w.stride(1) == 1 and x.stride(1) == 1, "x and w rows must be contiguous"
        return w.w, w.scale, dict(s_sw=w.scale.stride(0), FP8=True)
    assert w.stride(1) == 1 and x.stride(1) == 1, "x and w rows must be contiguous"
    assert x.dtype == w.dtype, "x and w must share a dtype"
    return w, w, dict(s_sw=0, FP8=False)


def _scale_args(x, K: int) -> tuple[torch.Tensor, dict]:
    """x's rows and the row-scale arguments of a product kernel: a Normed's sums of squares, or
    none (NBP 0) for a plain tensor."""
    if not isinstance(x, Normed):
        return x, dict(ss=x, NB=0, s_ss=0, eps=0., NBP=0)
    assert x.ss.dtype == torch.float32 and x.ss.shape[0] == x.x.shape[0] and x.ss.stride(1) == 1, \
        "a Normed's ss must be float32 [T, NB]"
    return x.x, dict(ss=x.ss, NB=x.ss.shape[1], s_ss=x.ss.stride(0), eps=x.eps,
                     NBP=triton.next_power_of_2(x.ss.shape[1]))


def tail_split(blocks: int, KI: int, plan: ProductPlan) -> tuple[int, int] | None:
    """(parts, K tiles a part) for the last, partial wave of a product of `blocks` column blocks of
    KI K tiles on the plan's P resident programs, or None to leave it whole: a last wave of at most
    P / 4 blocks is split into tail_parts parts a block (two tiles a part at least). A function of
    the shapes and the plan alone, never of T. The 27B's MLP gate|up on an H100 (8 of 272 blocks left on 132
    SMs; tests/bench/ab_step.py --plans tail): the decode step 1.2% faster in 3 parts, 1.1% in
    2, 0.6-0.8% in 4 or 5, 0.3-0.4% in 6 and 8, no faster in 14 (one part of three tiles an SM);
    splitting the large last waves of the GDN in_proj and q|gate|k|v too (126 of 258, 92 of 224
    blocks) took most of the gain back. With small_split, a product of at most P / 4 blocks in all
    (a few column blocks only stream their weight through as many SMs: on 132 SMs the MoE routers'
    5, the FP8 models' GDN a|b product's 1-2, the 35B-A3B's MTP fc's 32) is its own last wave:
    every block in min(small_parts, KI, P / blocks) parts (the router's 8 tiles: 40 programs). The
    35B-A3B's decode step measured 0.957 x (FP8) with it, the FP8 27B's 0.984 x."""
    P = plan.programs
    if P < 4 or not plan.tail_split:
        return None
    if 0 < blocks <= P // 4 and plan.small_split:
        S = min(plan.small_parts, KI, P // blocks)
        if S < 2:
            return None
        KS = triton.cdiv(KI, S)
        return triton.cdiv(KI, KS), KS
    if blocks <= P:
        return None
    r = blocks % P
    S = min(plan.tail_parts, KI // 2)
    if r == 0 or r > P // 4 or S < 2:
        return None
    KS = triton.cdiv(KI, S)
    return triton.cdiv(KI, KS), KS


def _launch(x, w, sw, y, N, K, BN, BK, warps, stages, scale, fp8: dict, swiglu: bool, plan: ProductPlan, BT: int,
            rider: tuple | None = None, conv: ConvStep | None = None):
    """One program a column block (_matvec_kernel) over rows padded to BT, a small last wave split
    over K where tail_split says so; `rider` (w2, y2): the rider's programs first (matvec_rider);
    `conv`: y's first conv.channels columns through a step's conv (conv.ConvStep)."""
    blocks, KI, P = triton.cdiv(N, BN), triton.cdiv(K, BK), plan.programs
    tail = tail_split(blocks, KI, plan)
    S, KS = tail or (1, KI)
    F = blocks - blocks % P if tail else blocks
    ws, count = y, y                                  # compiled out without a split (SPLIT False)
    if tail:
        ws = torch.empty((blocks - F) * S, 2 if swiglu else 1, BN, BT, dtype=torch.float32, device=x.device)
        count = arrival_counts(x.device, blocks - F)
    ride = {}
    if rider is not None:
        w2, y2 = rider
        BN2, BK2 = RIDER_TILE[0], RIDER_TILE[1] // x.element_size()
        ride = dict(w2=w2, y2=y2, N2=w2.shape[0], R=triton.cdiv(w2.shape[0], BN2), s_w2=w2.stride(0),
                    s_y2=y2.stride(0), BN2=BN2, BK2=BK2)
    _matvec_kernel[(ride.get("R", 0) + F + (blocks - F) * S,)](
        x, w, sw, y, ws, count, T=x.shape[0], N=N, K=K, F=F, KS=KS * BK, S=S, s_x=x.stride(0), s_w=w.stride(0),
        s_y=y.stride(0), BT=BT, BN=BN, BK=BK, SWIGLU=swiglu, SPLIT=tail is not None, num_warps=warps,
        num_stages=stages, LATE=plan.late_release, **scale, **fp8, **pdl(x), **fp8_run(BK, fp8["FP8"]),
        **_format_args(x, w, BN, BK, warps, fp8, plan, ("swiglu" if swiglu else "plain", N, K)), **ride,
        **(conv.args() if conv is not None else {}))
    return y


def _format_args(x, w, BN: int, BK: int, warps: int, fmt: dict, plan: ProductPlan, product: tuple) -> dict:
    """The launch arguments a weight format adds (w: the weight's values as the kernel reads them):
    how FP8 tiles widen (fp8.widen_args), a 4-bit tile's dots and unpack form (int4.form_args: the
    plan's int4_form, else the measured form of `product`, (name, N, K) as int4.measured takes
    them; int16 words, an interleaved weight: int4.interleaved_args)."""
    if fmt["FP8"]:
        return widen_args(x, warps, BN, plan.widen_bits, plan.widen_group)
    if fmt.get("G") and w.dtype == torch.int16:
        return interleaved_args(BK, fmt["G"])
    if fmt.get("G"):
        return form_args(BK, fmt["G"], form_of(plan.int4_form, *product))
    return {}


def permuted_once(x: torch.Tensor, w, plan: ProductPlan):
    """(x, w) as a product takes them: with the plan's permute_x, a 4-bit weight's perm applied to
    x's columns here, once (a gather of T x K values: column c of x' is x's column perm[c]), and the
    weight read without it, in place of the gather of x's tile in every program's every tile. The
    same values meet in the same order: the same sums, bit for bit."""
    if plan.permute_x and isinstance(w, GroupInt4) and w.perm is not None and w.perm.dim() == 1:
        return x.index_select(1, w.perm), w._replace(perm=None)
    return x, w


def rows_slice(x, a: int, b: int):
    """Rows a .. b of x, a tensor or a Normed."""
    return Normed(x.x[a:b], x.ss[a:b], x.eps) if isinstance(x, Normed) else x[a:b]


def pieces(T: int, BT: int) -> list[tuple[int, int]]:
    """The row ranges a product of T rows runs in under a row tile of BT: one, unless T > BT. Each
    row goes through the same compiled kernel whichever piece holds it, so its result is the same.
    A few-row product takes MAX_ROWS rows at most (more are prefill's, batched)."""
    assert 1 <= T <= MAX_ROWS, f"matvec takes 1..{MAX_ROWS} rows, got {T}"
    return [(a, min(T, a + BT)) for a in range(0, T, BT)]


def matvec_triton(x, w, out: torch.Tensor | None = None, plan: ProductPlan | None = None,
                  conv: ConvStep | None = None) -> torch.Tensor:
    N, K = w.shape
    plan = plan or default_products(x.device)
    BT = plan.rows_of(w)
    if conv is not None:
        _check_conv(conv, x, N, BT)
    if x.shape[0] > BT:
        ranges = pieces(x.shape[0], BT)
        y = _out(_rows_of(x), N, out)
        for a, b in ranges:
            matvec_triton(rows_slice(x, a, b), w, y[a:b], plan)
        return y
    x, scale = _scale_args(x, K)
    x, w = permuted_once(x, w, plan)
    w, sw, fp8 = check_product(x, w, K, BT)
    y = _out(x, N, out)
    BN, BK, warps, stages = tiles(N, K, x.element_size(), fp8=fp8["FP8"], plan=plan, group=fp8.get("G", 0),
                                  interleaved=w.dtype == torch.int16)
    return _launch(x, w, sw, y, N, K, BN, BK, warps, stages, scale, fp8, False, plan, BT, conv=conv)


def _check_conv(conv: ConvStep, x, N: int, BT: int) -> None:
    """A product's conv (conv.ConvStep) over N output columns of x's rows, BT a launch."""
    rows = _rows_of(x)
    assert rows.shape[0] <= BT, f"a product's conv takes its rows in one launch ({BT} at most), not {rows.shape[0]}"
    assert 0 < conv.channels <= N, f"a product's conv takes 1 .. {N} of its columns, not {conv.channels}"
    conv.check(rows.shape[0], rows.dtype)


def int4_buffer(BN: int, BK: int, BT: int, itemsize: int) -> int:
    """The bytes of one pipelined buffer of a product over 4-bit weights: w's [BN, BK] tile (4 bits a
    weight) and x's [BK, BT] (matvec_prefill's; kernels/moe.py's prefill experts' a dot)."""
    return BN * BK // 2 + BK * BT * itemsize


def int4_widened(BN: int, BK: int, group: int, itemsize: int) -> int:
    """The bytes a product over 4-bit weights keeps in shared memory beside its buffers: with float32
    rows (itemsize 4) one dot's weights widened to float32, [BN, one dot's columns], which go to the
    dot through shared memory; none with bf16 or fp16 rows. Compiled for sm_86 (Triton 3.9): the
    few-row kernel over 64 rows on 64 x 256 weights took 106,496 bytes at 2 deep, its buffer 73,728
    and this tile 32,768; bf16 took its buffers' alone (tests/kernels/test_int4_compile.py)."""
    return BN * sub_tile(BK, group) * 4 if itemsize == 4 else 0


def fit_int4(BN: int, stages: int, stage, widened, plan: ProductPlan) -> tuple[int, int]:
    """(BN, stages) of a tile over 4-bit weights fitted to the device's shared memory a program, from
    the bytes of one of its buffers (stage(BN)) and of the widened weights beside them (widened(BN):
    float32 rows only): BN halved (to 16 at least) while one buffer and that tile would not fit, then
    the depth cut (ProductPlan.depth). The same sums at any depth or column count."""
    while widened(BN) and BN > 16 and stage(BN) + widened(BN) > plan.shared_memory - PIPELINE_SLACK:
        BN //= 2
    return BN, plan.depth(stages, stage(BN), widened(BN))


def prefill_tile(w: GroupInt4, BT: int, itemsize: int, plan: ProductPlan) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages) of matvec_prefill over w for a row tile of BT: the plan's
    int4_prefill_tile, BK rounded up to whole groups; with float32 rows BN halved (to 16 at least)
    while one buffer of w's tile and x's [BK, BT] and the widened tile beside it (int4_widened) would
    not fit the device's shared memory a program; its depth then cut until stages - 1 buffers do (and
    the widened tile)."""
    BN, BK, warps, stages = plan.int4_prefill_tile
    BK = triton.cdiv(BK, w.group) * w.group
    BN, stages = fit_int4(BN, stages, lambda BN: int4_buffer(BN, BK, BT, itemsize),
                          lambda BN: int4_widened(BN, BK, w.group, itemsize), plan)
    return BN, BK, warps, stages


def prefill_fits(T: int, w: GroupInt4, itemsize: int, plan: ProductPlan) -> bool:
    """Whether matvec_prefill's tile for T rows fits the device's shared memory a program at its
    least depth (one buffer of w's tile and x's, and the float32 rows' widened tile): BK holds whole
    groups, so groups of 1,024 columns do not on a 99 KB GPU in bf16 (the slab forms then take the
    product)."""
    BT = max(16, triton.next_power_of_2(T))
    BN, BK, _, stages = prefill_tile(w, BT, itemsize, plan)
    need = (stages - 1) * int4_buffer(BN, BK, BT, itemsize) + int4_widened(BN, BK, w.group, itemsize)
    return need <= plan.shared_memory - PIPELINE_SLACK


def matvec_prefill(x: torch.Tensor, w: GroupInt4, plan: ProductPlan) -> torch.Tensor:
    """A prefill's product of a few rows (1..PREFILL_ROWS) over 4-bit weights (the plan's
    int4_prefill_rows): the few-row kernel, its row tile T rounded up to a power of two (16 at
    least), on the plan's int4_prefill_tile, so the weight streams through once, unpacked in
    registers, where the slab forms of kernels/int4_gemm.py write and read a dense copy of it all.
    A prefill's rows need not be batch-invariant; each is still what matvec_ref computes, within
    rounding."""
    assert isinstance(x, torch.Tensor) and isinstance(w, GroupInt4), "matvec_prefill takes rows and a 4-bit weight"
    T, K = x.shape
    N = w.shape[0]
    assert 1 <= T <= PREFILL_ROWS, f"matvec_prefill takes 1..{PREFILL_ROWS} rows, got {T}"
    BT = max(16, triton.next_power_of_2(T))
    x, w = permuted_once(x, w, plan)
    wv, sw, fmt = check_product(x, w, K, BT, PREFILL_ROWS)
    BN, BK, warps, stages = prefill_tile(w, BT, x.element_size(), plan)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    return _launch(x, wv, sw, y, N, K, BN, BK, warps, stages, _scale_args(x, K)[1], fmt, False, plan, BT)


# A rider's tile: (rows, bytes of K) a program and step. Its programs run the launch's warps and
# pipeline depth beside the product's tiles, and take no more shared memory than they do.
RIDER_TILE = (16, 256)


def rides(x, w, w2) -> bool:
    """Whether w2 can ride in the launch of the product over w (matvec_rider): a tensor in the rows'
    dtype, over the same K, with contiguous rows, where the product reads x as it is (no perm
    applied to x for it)."""
    rows = _rows_of(x)
    return (isinstance(w2, torch.Tensor) and w2.dtype == rows.dtype and w2.dim() == 2 and w2.shape[1] == w.shape[1]
            and w2.stride(1) == 1 and not (isinstance(w, GroupInt4) and w.perm is not None))


def matvec_rider_ref(x, w, w2) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ wᵀ, x @ w2ᵀ), each as matvec_ref computes it."""
    return matvec_ref(x, w), matvec_ref(x, w2)


def matvec_rider_triton(x, w, w2: torch.Tensor, plan: ProductPlan | None = None,
                        conv: ConvStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ wᵀ and x @ w2ᵀ in one launch: w2, a small product over the same rows (a GDN's b|a rows, in
    the model dtype beside an FP8 or 4-bit in_proj), takes the first programs of the product's
    launch, each RIDER_TILE[0] rows of it over all of K, so it costs no launch of its own. More
    rows than the plan's row tile run in pieces, as matvec's do (not with a `conv`, matvec's)."""
    N, K = w.shape
    plan = plan or default_products(x.device)
    assert rides(x, w, w2), "the rider must be a tensor in x's dtype [N2, K] with contiguous rows, w without a perm"
    BT = plan.rows_of(w)
    if conv is not None:
        _check_conv(conv, x, N, BT)
    y, y2 = _out(_rows_of(x), N, None), _out(_rows_of(x), w2.shape[0], None)
    for a, b in pieces(x.shape[0], BT):
        xs, scale = _scale_args(rows_slice(x, a, b), K)
        wv, sw, fp8 = check_product(xs, w, K, BT)
        BN, BK, warps, stages = tiles(N, K, xs.element_size(), fp8=fp8["FP8"], plan=plan, group=fp8.get("G", 0),
                                      interleaved=wv.dtype == torch.int16)
        _launch(xs, wv, sw, y[a:b], N, K, BN, BK, warps, stages, scale, fp8, False, plan, BT, rider=(w2, y2[a:b]),
                conv=conv)
    return y, y2


def matvec_rider(x, w, w2: torch.Tensor, plan: ProductPlan | None = None,
                 conv: ConvStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ wᵀ, x @ w2ᵀ) for x [T, K] or a Normed, w as matvec takes it and w2 a tensor that rides
    (rides): one launch on CUDA (matvec_rider_triton), the float32 references otherwise; `conv` as
    matvec takes it."""
    if not use_triton(_rows_of(x), values_of(w), w2):
        y, y2 = matvec_rider_ref(x, w, w2)
        return (y if conv is None else conv_step_ref(y, conv)), y2
    return matvec_rider_triton(x, w, w2, plan, conv)


_counts: dict = {}
_outgrown: list = []


def arrival_counts(device: torch.device, blocks: int, owner: str = "products") -> torch.Tensor:
    """Arrival counts of the kernels whose programs count in (the last to arrive finishes their
    work): int32, at least `blocks` of them, made once per device and owner outside graph capture
    and left at 0 by every launch. One buffer serves all of an owner's kernels because they run one
    after another on one stream (two running at once on two streams would share counts); the
    owners ("products": a small last wave here, a split product with `norm` in matvec_parts.py; the
    MoE routing's and its folded down kernel's, kernels/moe.py) keep theirs apart. A buffer outgrown
    by a wider model is kept, not freed: graphs captured before still count in it."""
    count = _counts.get((device, owner))
    if count is None or count.numel() < blocks:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), \
            f"run a step once before capturing a graph (the {owner} kernels' arrival counts are made then)"
        if count is not None:
            _outgrown.append(count)
        count = _counts[device, owner] = torch.zeros(max(blocks, 1024), dtype=torch.int32, device=device)
    return count


def matvec_swiglu_triton(x, w, plan: ProductPlan | None = None) -> torch.Tensor:
    N2, K = w.shape
    plan = plan or default_products(x.device)
    BT = plan.rows_of(w)
    if x.shape[0] > BT:
        return torch.cat([matvec_swiglu_triton(rows_slice(x, a, b), w, plan) for a, b in pieces(x.shape[0], BT)])
    x, scale = _scale_args(x, K)
    x, w = permuted_once(x, w, plan)
    w, sw, fp8 = check_product(x, w, K, BT)
    assert N2 % 2 == 0, "w must stack the gate and up rows"
    N = N2 // 2
    assert not fp8["FP8"] or N % BLOCK == 0, "FP8 gate rows must fill whole blocks, so the up rows start one"
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    BN, BK, warps, stages = tiles(N, K, x.element_size(), swiglu=True, fp8=fp8["FP8"], plan=plan,
                                  group=fp8.get("G", 0), interleaved=w.dtype == torch.int16)
    return _launch(x, w, sw, y, N, K, BN, BK, warps, stages, scale, fp8, True, plan, BT)


def _out(x: torch.Tensor, N: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    assert out.shape == (x.shape[0], N) and out.stride(1) == 1, f"out must be [{x.shape[0]}, {N}] with contiguous rows"
    return out


def matvec(x, w, out: torch.Tensor | None = None, plan: ProductPlan | None = None,
           conv: ConvStep | None = None) -> torch.Tensor:
    """x [T, K] (or a Normed) @ w [N, K]ᵀ (w a tensor, a BlockFP8 or a GroupInt4): the Triton kernel for CUDA
    tensors, in the plan's form (None: the measured defaults for the device), the float32
    reference otherwise. With `out` (e.g. float32 logits) the product, rounded to x's dtype, is
    written there. With `conv` (a step's, conv.ConvStep) its first conv.channels columns come out
    through the causal conv and silu, the window updated (conv_update's contract): in the product's
    own kernel on CUDA."""
    if not use_triton(_rows_of(x), values_of(w)):
        y = matvec_ref(x, w) if out is None else out.copy_(matvec_ref(x, w))
        if conv is not None:
            y.copy_(conv_step_ref(y, conv))
        return y
    return matvec_triton(x, w, out, plan, conv)


def matvec_swiglu(x, w, plan: ProductPlan | None = None) -> torch.Tensor:
    """silu(x @ w_gateᵀ) * (x @ w_upᵀ) for w = [w_gate | w_up] (x a tensor or a Normed, w a tensor,
    a BlockFP8 or a GroupInt4): one kernel on CUDA, the reference otherwise."""
    if use_triton(_rows_of(x), values_of(w)):
        return matvec_swiglu_triton(x, w, plan)
    return matvec_swiglu_ref(x, w)


def _rows_of(x) -> torch.Tensor:
    return x.x if isinstance(x, Normed) else x

