"""Prefill's products over 4-bit weights (kernels/int4.py): y [T, N] = x [T, K] @ w [N, K]ᵀ for many
rows, in one of three forms (ProductPlan.int4_prefill):

- "dense": the weight dequantized by a Triton kernel into the model's dtype, a slab of rows at a
  time (at most SLAB_BYTES of it), and torch's matmul over each slab. The unpacking is paid once a
  weight and a call, whatever the number of rows; the price is the dense slab written and read
  again (four times the 4-bit bytes) and its memory. x is read through the weight's perm first
  (GPTQ's desc_act), so the slab stays in the weight's own column order. The products round the
  dequantized weight to x's dtype, as the CPU's path (forms.dense_ref) does.
- "fp8": the same slabs, but requantized to FP8 in 128 x 128 blocks (the dequantized weights in
  float32, a block's scale amax / 448 as the official FP8 checkpoints are made, each weight times
  its reciprocal; requantize_ref), x's rows quantized per token and 128 columns as fp8_gemm.py quantizes them, and
  cuBLAS's block-scaled product on Hopper's FP8 tensor cores. The slab is half the dense one's
  bytes and the tensor cores run at twice the rate; what it costs is precision in prefill alone:
  x's values to e4m3's 3 mantissa bits, and the weights rounded to e4m3 on their block's scale.
  Only on Hopper, for groups of 128 and whole 128-row blocks, at CUBLAS_MIN_ROWS rows or more
  (fp8_serves); anything else takes the dense form.
- "fused": one kernel that unpacks each weight tile in registers (int4.dot_int4, as the few-row
  products do) and never writes a dense copy: a program takes BM rows of x by BN rows of w, the
  weight rows being the dot's M ([BN, G] @ [G, BM]), each group's float32 result scaled in float32.
  Each weight tile is unpacked again for every BM rows of x.

Measured at 2048 rows on an H100 (tests/bench/bench_int4.py --prefill-only, 2026-11-25, before
the dense form wrote its products in place; bf16's torch matmul, fused, dense, in us): the 27B's
GDN in_proj [16384 x 5120] 438, 2255, 589; MLP gate|up [34816 x 5120] 923, 4805, 1235; MLP down
[5120 x 17408] 454, 2409, 581; out_proj [5120 x 6144] 166, 880, 191. A slab of 12800 x 5120 dequantizes in 66 us (2.5 TB/s written and
read). The dense form is ProductPlan's default; the engine's plan takes the fp8 form on Hopper
(engine/plan.py). Its measurements (H100, 2026-11-26, tests/bench/bench_int4.py --prefill-only,
probe_prefill_chunk.py, quality_int4.py --prefill-forms) are in docs/PERFORMANCE.md.
"""
from __future__ import annotations

import torch

from mtpchat.kernels import fp8, fp8_gemm
from mtpchat.kernels._triton import interpreting, tl, triton, use_triton
from mtpchat.kernels.fp8 import BLOCK, FP8, BlockFP8
from mtpchat.kernels.fp8_gemm import QuantizedRows
from mtpchat.kernels.int4 import GroupInt4, check_int4, dequantize_ref, dot_int4, form_args, form_of
from mtpchat.kernels.plan import ProductPlan

TILE = (64, 128, 128, 8, 3)      # the fused form's BM rows of x, BN rows of w, BK columns, warps, stages
SLAB_BYTES = 128 << 20           # the dense form's largest slab of dequantized weight
DEQUANTIZE_TILE = (16, 1024)     # rows, columns (weights) of a program of the dequantize kernel


def gemm_ref(x: torch.Tensor, w: GroupInt4) -> torch.Tensor:
    """x @ dequantize_ref(w)ᵀ in float32, cast to x's dtype."""
    return (x.float() @ dequantize_ref(w).T).to(x.dtype)


@triton.jit
def _gemm_kernel(x, w, sw, y, T, N, K, s_x, s_w, s_sw, s_y, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, zw=None, perm=None, UNPACK: tl.constexpr = False):
    # program (i_m, i_n): rows i_m BM.. of x, weight rows i_n BN..; acc [BN, BM] is yᵀ's tile
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < T, o_n < N
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k in range(0, K, BK):
        acc = dot_int4(acc, w, sw, zw, perm, o_n, m_n, s_w, s_sw, x + o_m[None, :] * s_x, m_m, k, K, BK, G, BG,
                       UNPACK)
    tl.store(y + o_m[None, :] * s_y + o_n[:, None], acc.to(y.dtype.element_ty), mask=m_n[:, None] & m_m[None, :])


def gemm_triton(x: torch.Tensor, w: GroupInt4, tile: tuple[int, int, int, int, int] = TILE,
                plan: ProductPlan | None = None) -> torch.Tensor:
    """`plan`: its int4_form (int4.form_args); the reshape form where it names none (int4.form_of)."""
    T, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and x.stride(1) == 1, f"x [T, K] and w [N, K] disagree: {tuple(x.shape)}, {tuple(w.shape)}"
    check_int4(w, K)
    assert w.perm is None or w.perm.dim() == 1, "a product's perm is [K]"
    BM, BN, BK, warps, stages = tile
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _gemm_kernel[(triton.cdiv(T, BM), triton.cdiv(N, BN))](
        x, w.w, w.scale, y, T, N, K, x.stride(0), w.w.stride(0), w.scale.stride(0), y.stride(0),
        BM=BM, BN=BN, BK=BK, G=w.group, zw=w.zero, perm=w.perm,
        **form_args(BK, w.group, form_of(plan.int4_form if plan is not None else None, "gemm", N, K)),
        num_warps=warps, num_stages=stages)
    return y


@triton.jit
def _dequantize_kernel(w, sw, out, N, K, s_w, s_sw, s_o, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       zw=None, INTERLEAVED: tl.constexpr = False):
    # program (i_n, i_k): rows i_n BN.., weights i_k BK... Natural words: each word's 8 weights
    # stored along a third axis (weight column 8 c + j is nibble j of word c). Interleaved int16
    # half-words (kernels/int4.py): the tile's half-words read as they lie, then
    # each quarter's nibbles stored as a run of G / 4 columns.
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    if INTERLEAVED:
        Q: tl.constexpr = G // 4
        o_h = i_k * (BK // 4) + tl.arange(0, BK // 4)            # half-word h: group h // Q, place h % Q
        m = (o_n < N)[:, None] & (o_h < K // 4)[None, :]
        b_q = tl.load(w + o_n[:, None] * s_w + o_h[None, :], mask=m, other=0).to(tl.int32)
        o_g = o_h // Q
        b_s = tl.load(sw + o_n[:, None] * s_sw + o_g[None, :], mask=m, other=0.).to(tl.float32)
        if zw is None:
            b_z = tl.full(b_s.shape, 8, tl.float32)
        else:
            b_z = tl.load(zw + o_n[:, None] * s_sw + o_g[None, :], mask=m, other=0).to(tl.float32)
        p_o = out + o_n[:, None] * s_o + (o_g * G + o_h % Q)[None, :]
        for q in tl.static_range(4):
            b_w = (((b_q >> (4 * q)) & 0xF).to(tl.float32) - b_z) * b_s
            tl.store(p_o + q * Q, b_w.to(out.dtype.element_ty), mask=m)
    else:
        o_c = i_k * (BK // 8) + tl.arange(0, BK // 8)
        m = (o_n < N)[:, None] & (o_c < K // 8)[None, :]
        b_q = tl.load(w + o_n[:, None] * s_w + o_c[None, :], mask=m, other=0)
        o_g = o_c * 8 // G
        b_s = tl.load(sw + o_n[:, None] * s_sw + o_g[None, :], mask=m, other=0.).to(tl.float32)
        if zw is None:
            b_z = tl.full(b_q.shape, 8, tl.float32)
        else:
            b_z = tl.load(zw + o_n[:, None] * s_sw + o_g[None, :], mask=m, other=0).to(tl.float32)
        j = tl.arange(0, 8)
        b_v = ((b_q[:, :, None] >> (4 * j)[None, None, :]) & 0xF).to(tl.float32)
        b_w = (b_v - b_z[:, :, None]) * b_s[:, :, None]
        p_o = out + o_n[:, None, None] * s_o + (o_c * 8)[None, :, None] + j[None, None, :]
        tl.store(p_o, b_w.to(out.dtype.element_ty), mask=m[:, :, None])


def dequantize_triton(w: GroupInt4, dtype: torch.dtype, rows: tuple[int, int] | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows n0 .. n1 (all without `rows`) of the dense weight in the weight's own column order (its
    perm not applied): (q - zero) * scale in float32, rounded to dtype, as dequantize_ref computes
    it. Written into `out` ([n1 - n0, K], rows contiguous) where given."""
    N, K = w.shape
    n0, n1 = rows or (0, N)
    assert 0 <= n0 < n1 <= N
    check_int4(w, K, interleaved=True)
    if out is None:
        out = torch.empty(n1 - n0, K, dtype=dtype, device=w.device)
    assert out.shape == (n1 - n0, K) and out.stride(1) == 1 and out.dtype == dtype
    BN, BK = DEQUANTIZE_TILE
    zero = w.zero[n0:n1] if w.zero is not None else None
    _dequantize_kernel[(triton.cdiv(n1 - n0, BN), triton.cdiv(K, BK))](
        w.w[n0:n1], w.scale[n0:n1], out, n1 - n0, K, w.w.stride(0), w.scale.stride(0), out.stride(0),
        G=w.group, BN=BN, BK=BK, zw=zero, INTERLEAVED=w.interleaved, num_warps=4)
    return out


def _slab_rows(K: int, itemsize: int, slab_bytes: int) -> int:
    """The rows of a slab of dequantized weight (of bf16's bytes a weight, whatever a form stores:
    the fp8 form's slab then takes half the bytes and leaves as many rows for the product's output)."""
    BN = DEQUANTIZE_TILE[0]
    return max(BN, slab_bytes // (K * itemsize) // BN * BN)


def dense_gemm(x: torch.Tensor, w: GroupInt4, slab_bytes: int = SLAB_BYTES) -> torch.Tensor:
    """The dense form (module docstring): x read through the weight's perm, then per slab of rows
    the dequantized weight and torch's matmul."""
    T, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and x.stride(1) == 1, f"x [T, K] and w [N, K] disagree: {tuple(x.shape)}, {tuple(w.shape)}"
    assert w.perm is None or w.perm.dim() == 1, "a product's perm is [K]"
    if w.perm is not None:
        x = x.index_select(1, w.perm.long())         # weight column k multiplies x's column perm[k]
    rows = _slab_rows(K, x.element_size(), slab_bytes)
    if rows >= N:
        return x @ dequantize_triton(w, x.dtype).T
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    slab = torch.empty(rows, K, dtype=x.dtype, device=x.device)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        part = dequantize_triton(w, x.dtype, (n0, n1), slab[:n1 - n0])
        # straight into y's columns (cuBLAS takes y's row stride): no slab-wide product copied after
        # (the 27B's products at 2,048 rows 0.87-0.96 x the time, at 8,192 0.87 x; the same bits)
        torch.mm(x, part.T, out=y[:, n0:n1])
    return y


@triton.jit
def _requantize_kernel(w, sw, out, os, N, KG, s_w, s_sw, s_o, s_os, GROUPS: tl.constexpr, zw=None,
                       INTERLEAVED: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    # program (i_n, j): the FP8 blocks of rows i_n 128.. and of groups j GROUPS .. (j + 1) GROUPS
    # (each 128 columns) of the KG, one after another
    i_n = tl.program_id(0)
    for i in tl.static_range(GROUPS):
        i_g = tl.program_id(1) * GROUPS + i
        if i_g < KG:
            _requantize_block(w, sw, out, os, N, s_w, s_sw, s_o, s_os, i_n, i_g, zw, INTERLEAVED, INTERPRET)


@triton.jit
def _requantize_block(w, sw, out, os, N, s_w, s_sw, s_o, s_os, i_n, i_g, zw, INTERLEAVED: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """The FP8 block of rows i_n 128.. and the 128 columns of group i_g: its weights (q - zero) *
    scale in float32, their amax, the block's scale amax / 448 and the weights over it rounded to
    e4m3, as requantize_ref computes them."""
    if INTERLEAVED:
        o_n = i_n * 128 + tl.arange(0, 128)
        m_n = o_n < N
        b_s, b_z = _group_scale(sw, zw, o_n, m_n, s_sw, i_g)
        # the group's 32 half-words: half-word h holds column 32 q + h in its bits 4 q .. 4 q + 3
        o_h = tl.arange(0, 32)
        b_q = tl.load(w + o_n[:, None] * s_w + i_g * 32 + o_h[None, :], mask=m_n[:, None], other=0).to(tl.int32)
        b_w0 = ((b_q & 0xF).to(tl.float32) - b_z[:, None]) * b_s[:, None]
        b_w1 = (((b_q >> 4) & 0xF).to(tl.float32) - b_z[:, None]) * b_s[:, None]
        b_w2 = (((b_q >> 8) & 0xF).to(tl.float32) - b_z[:, None]) * b_s[:, None]
        b_w3 = (((b_q >> 12) & 0xF).to(tl.float32) - b_z[:, None]) * b_s[:, None]
        b_amax = tl.maximum(tl.maximum(tl.max(tl.abs(b_w0)), tl.max(tl.abs(b_w1))),
                            tl.maximum(tl.max(tl.abs(b_w2)), tl.max(tl.abs(b_w3))))
        b_f = tl.where(b_amax > 0, tl.math.div_rn(b_amax, tl.full([], 448., tl.float32)), 1.)
        p_o = out + o_n[:, None] * s_o + i_g * 128 + o_h[None, :]
        tl.store(p_o, _e4m3(b_w0, b_f, INTERPRET).to(out.dtype.element_ty), mask=m_n[:, None])
        tl.store(p_o + 32, _e4m3(b_w1, b_f, INTERPRET).to(out.dtype.element_ty), mask=m_n[:, None])
        tl.store(p_o + 64, _e4m3(b_w2, b_f, INTERPRET).to(out.dtype.element_ty), mask=m_n[:, None])
        tl.store(p_o + 96, _e4m3(b_w3, b_f, INTERPRET).to(out.dtype.element_ty), mask=m_n[:, None])
    else:
        # natural words: the block's amax from its integers first (each row's largest |q - zero|
        # times its scale: a product rounds monotonically, so this is the largest |weight|), then
        # its weights 16 rows at a time (the whole block's [128, 16, 8] at once takes too many
        # registers)
        o_n = i_n * 128 + tl.arange(0, 128)
        m_n = o_n < N
        b_s, b_z = _group_scale(sw, zw, o_n, m_n, s_sw, i_g)
        b_q = tl.load(w + o_n[:, None] * s_w + i_g * 16 + tl.arange(0, 16)[None, :], mask=m_n[:, None], other=0)
        b_zi = b_z.to(tl.int32)[:, None]
        b_m = tl.abs(((b_q >> 28) & 0xF) - b_zi)
        for j in tl.static_range(7):
            b_m = tl.maximum(b_m, tl.abs(((b_q >> (4 * j)) & 0xF) - b_zi))
        b_amax = tl.max(tl.max(b_m, axis=1).to(tl.float32) * tl.abs(b_s), axis=0)
        b_f = tl.where(b_amax > 0, tl.math.div_rn(b_amax, tl.full([], 448., tl.float32)), 1.)
        j = tl.arange(0, 8)
        for r in tl.static_range(0, 128, 16):
            b_w = _natural_rows(w, sw, zw, N, s_w, s_sw, i_n * 128 + r, i_g)
            o_r = i_n * 128 + r + tl.arange(0, 16)
            o_c = i_g * 16 + tl.arange(0, 16)
            p_o = out + o_r[:, None, None] * s_o + (o_c * 8)[None, :, None] + j[None, None, :]
            tl.store(p_o, _e4m3(b_w, b_f, INTERPRET).to(out.dtype.element_ty), mask=(o_r < N)[:, None, None])
    tl.store(os + i_n * s_os + i_g, b_f)


@triton.jit
def _group_scale(sw, zw, o_n, m_n, s_sw, i_g):
    """Rows o_n's (m_n) scale and zero of group i_g, float32 (a symmetric weight's zero 8)."""
    b_s = tl.load(sw + o_n * s_sw + i_g, mask=m_n, other=0.).to(tl.float32)
    if zw is None:
        b_z = tl.full(o_n.shape, 8, tl.float32)
    else:
        b_z = tl.load(zw + o_n * s_sw + i_g, mask=m_n, other=0).to(tl.float32)
    return b_s, b_z


@triton.jit
def _natural_rows(w, sw, zw, N, s_w, s_sw, r0, i_g):
    """Rows r0 .. r0 + 16 of group i_g (128 columns) of natural words: their weights (q - zero) *
    scale in float32 [16, 16, 8] (column 8 c + j at [., c, j]); rows past N zeros."""
    o_n = r0 + tl.arange(0, 16)
    m_n = o_n < N
    b_s, b_z = _group_scale(sw, zw, o_n, m_n, s_sw, i_g)
    o_c = i_g * 16 + tl.arange(0, 16)
    b_q = tl.load(w + o_n[:, None] * s_w + o_c[None, :], mask=m_n[:, None], other=0)
    b_v = ((b_q[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF).to(tl.float32)
    return (b_v - b_z[:, None, None]) * b_s[:, None, None]


@triton.jit
def _e4m3(b_w, b_f, INTERPRET: tl.constexpr):
    """Weights times the reciprocal of their block's scale (one true division a block: a division
    a weight took 3-4 x the time of dequantizing), clamped to e4m3's range (and, under the
    interpreter, rounded to its grid: fp8_gemm._round_e4m3), ready for the conversion."""
    b_r = tl.math.div_rn(tl.full([], 1., tl.float32), b_f)
    b_v = b_w * b_r
    b_v = tl.minimum(tl.maximum(b_v, -448.), 448.)
    if INTERPRET:
        b_v = fp8_gemm._round_e4m3(b_v)
    return b_v


def requantize_ref(w: GroupInt4) -> BlockFP8:
    """The fp8 form's weight: the dequantized weight (its own column order, perm not applied) in
    float32, quantized to FP8 in 128 x 128 blocks: a block's scale amax / 448 (as fp8.quantize_ref;
    a true division: torch on a GPU divides by a scalar as a product by its reciprocal, which can
    move a scale by its last bit), each weight times the scale's reciprocal (1 / scale, a true
    division) rounded to e4m3, which fp8.quantize_ref's w / scale gives within a rounding."""
    d = dequantize_ref(w._replace(perm=None))
    N, K = d.shape
    NB = -(-N // BLOCK)
    b = torch.nn.functional.pad(d, (0, 0, 0, NB * BLOCK - N)).view(NB, BLOCK, K // BLOCK, BLOCK)
    amax = b.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / torch.full_like(amax, fp8.FP8_MAX), torch.ones_like(amax))
    rcp = torch.ones_like(scale) / scale
    q = (b * rcp[:, None, :, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(FP8)
    return BlockFP8(q.view(NB * BLOCK, K)[:N].contiguous(), scale.contiguous())


# (groups a program requantizes, each a 128 x 128 block; warps) over interleaved and natural words:
# an H100, 12,800 rows of the 27B's in_proj, 51 and 69 us (dequantizing them to bf16: 97 and 66);
# several groups a program, or other warps, 3-40 % slower (tests/bench/probe_requantize.py)
REQUANTIZE_TILES = {True: (1, 8), False: (1, 4)}


def requantize_triton(w: GroupInt4, rows: tuple[int, int] | None = None, out: BlockFP8 | None = None,
                      tile: tuple[int, int] | None = None) -> BlockFP8:
    """requantize_ref's rows n0 .. n1 (all without `rows`; n0 a multiple of 128), groups of 128,
    into `out` ([n1 - n0, K] and its [ceil((n1 - n0) / 128), K / 128] scales) where given; `tile`:
    (groups a program, warps), None for the layout's REQUANTIZE_TILES."""
    N, K = w.shape
    n0, n1 = rows or (0, N)
    assert 0 <= n0 < n1 <= N and n0 % BLOCK == 0 and w.group == BLOCK, "rows from a block's first, groups of 128"
    check_int4(w, K, interleaved=True)
    NB = triton.cdiv(n1 - n0, BLOCK)
    if out is None:
        out = BlockFP8(torch.empty(n1 - n0, K, dtype=FP8, device=w.device),
                       torch.empty(NB, K // BLOCK, dtype=torch.float32, device=w.device))
    assert out.w.shape == (n1 - n0, K) and out.w.is_contiguous() and out.scale.shape == (NB, K // BLOCK)
    zero = w.zero[n0:n1] if w.zero is not None else None
    groups, warps = tile or REQUANTIZE_TILES[w.interleaved]
    _requantize_kernel[(NB, triton.cdiv(K // BLOCK, groups))](
        w.w[n0:n1], w.scale[n0:n1], out.w, out.scale, n1 - n0, K // BLOCK, w.w.stride(0), w.scale.stride(0),
        out.w.stride(0), out.scale.stride(0), GROUPS=groups, zw=zero, INTERLEAVED=w.interleaved,
        INTERPRET=interpreting(), num_warps=warps)
    return out


def fp8_gemm_ref(x: torch.Tensor, w: GroupInt4) -> torch.Tensor:
    """What the fp8 form computes, in float32: x (through the weight's perm) quantized per token and
    128 columns (fp8_gemm.quantize_rows_ref) times requantize_ref(w), cast to x's dtype."""
    xp = x if w.perm is None else x[:, w.perm.long()]
    xq, xs = fp8_gemm.quantize_rows_ref(xp)
    return fp8_gemm.gemm_ref(xq, xs, requantize_ref(w), x.dtype)


def fp8_form_runs_on(device) -> bool:
    """Whether the fp8 form runs on `device`: a Hopper GPU (cuBLAS's block-scaled FP8 product with
    1 x 128 row scales is Hopper's; Ada runs FP8 but not it, Blackwell takes other scalings)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def fp8_serves(x: torch.Tensor, w: GroupInt4) -> bool:
    """Whether the fp8 form takes this product (module docstring): a Hopper GPU (cuBLAS's block-scaled
    FP8 product is Hopper's), groups of 128 and whole 128-row blocks, enough rows, a 16-bit x. (On
    an H100 at 2,048 rows it took the 27B's products in 0.66-0.73 x the dense form's time over
    interleaved words, 0.76-0.82 x over natural ones: tests/bench/bench_int4.py --prefill-only.)"""
    T = x.shape[0]
    return (fp8_form_runs_on(x.device) and w.group == BLOCK and w.shape[0] % BLOCK == 0
            and T >= fp8_gemm.CUBLAS_MIN_ROWS and x.dtype in (torch.bfloat16, torch.float16))


def requantized_gemm(x: torch.Tensor | QuantizedRows, w: GroupInt4, slab_bytes: int = SLAB_BYTES) -> torch.Tensor:
    """The fp8 form (module docstring; fp8_serves says where it runs): x read through the weight's
    perm and quantized once (its rows padded for cuBLAS; or x quantized already, for a weight with
    no perm), then per slab of rows the weight requantized to FP8 blocks and cuBLAS's block-scaled
    product (the Triton FP8 kernel for a slab shape cuBLAS was not seen to compute right:
    fp8_gemm.cublas_serves)."""
    T, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and (isinstance(x, QuantizedRows) or x.stride(1) == 1), \
        f"x [T, K] and w [N, K] disagree: {tuple(x.shape)}, {tuple(w.shape)}"
    assert w.group == BLOCK and N % BLOCK == 0 and (w.perm is None or w.perm.dim() == 1), \
        "groups of 128, whole 128-row blocks and a perm of [K]"
    if isinstance(x, QuantizedRows):
        assert w.perm is None, "rows quantized already cannot take the weight's perm"
        (xq, xs), dtype, device = (x.q, x.scale), x.dtype, x.q.device
    else:
        if w.perm is not None:
            x = x.index_select(1, w.perm.long())
        (xq, xs), dtype, device = fp8_gemm.quantize_rows_triton(x, fp8_gemm.CUBLAS_ROWS), x.dtype, x.device
    rows = max(BLOCK, _slab_rows(K, dtype.itemsize, slab_bytes) // BLOCK * BLOCK)
    y = torch.empty(xq.shape[0], N, dtype=dtype, device=device)
    slab = BlockFP8(torch.empty(min(rows, N), K, dtype=FP8, device=device),
                    torch.empty(min(rows, N) // BLOCK, K // BLOCK, dtype=torch.float32, device=device))
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        part = requantize_triton(w, (n0, n1), BlockFP8(slab.w[:n1 - n0], slab.scale[:(n1 - n0) // BLOCK]))
        if fp8_gemm.cublas_serves(part, dtype, T):
            torch._scaled_mm(xq, part.w.T, scale_a=xs, scale_b=part.scale.T, out_dtype=dtype, out=y[:, n0:n1])
        else:
            y[:, n0:n1] = fp8_gemm.gemm_quantized_triton(xq, xs, part, dtype)
    return y[:T]


def dense_workspace(T: int, k_min: int, k_max: int, itemsize: int, slab_bytes: int = SLAB_BYTES) -> int:
    """The most memory the dense or fp8 form takes beside its output, for T rows and products of
    k_min .. k_max columns: the slab, one slab's product made apart (the fp8 form's Triton
    fallback; the others write in place), x read through a perm, and (fp8) x's rows quantized with
    their scales."""
    return slab_bytes + T * (slab_bytes // k_min) + T * k_max * itemsize + T * (k_max + 4 * triton.cdiv(k_max, BLOCK))


def gemm(x: torch.Tensor, w: GroupInt4, plan: ProductPlan | None = None) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ -> [T, N] in x's dtype, for any number of rows: on CUDA the plan's
    int4_prefill form (the default plan's without one; an interleaved weight, which the fused
    kernel does not read, the dense form; the fp8 form where fp8_serves, else the dense form), the
    float32 reference otherwise. x quantized already (QuantizedRows) takes the fp8 form."""
    if isinstance(x, QuantizedRows):
        return requantized_gemm(x, w)
    if not use_triton(x, w.w):
        return gemm_ref(x, w)
    form = plan.int4_prefill if plan is not None else ProductPlan.int4_prefill
    if form == "fp8" and fp8_serves(x, w):
        return requantized_gemm(x, w)
    if form in ("dense", "fp8") or w.interleaved:
        return dense_gemm(x, w)
    return gemm_triton(x, w, plan=plan)
