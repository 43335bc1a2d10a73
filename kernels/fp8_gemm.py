"""The prefill product over block-scaled FP8 weights (kernels/fp8.py): y [M, N] = x [M, K] @ wᵀ for
M up to thousands of tokens, w the dequantized BlockFP8 weight [N, K], on Hopper's FP8 tensor cores.

On the GPU the activations are quantized too, as the official FP8 checkpoints are meant to be run
(`activation_scheme: dynamic` over 128 x 128 weight blocks, DeepSeek-V3's recipe): each token's row,
per group of 128 columns, gets a float32 scale xs = amax / 448 and, times the scale's reciprocal,
is rounded to float8_e4m3fn (`quantize_rows`). The product then runs fp8 x fp8:
one program per BM x BN tile of y walks K in steps of BK = 128, one 128 x 128 weight-scale block a
step, and adds each step's dot, scaled by its token scales and its weight scale, to a float32 sum:
    acc += dot(xq[:, k-block], wq[n-block, k-block]ᵀ) * xs[:, k-block] * ws[n-block, k-block]
With BK = 128 and BN dividing 128 (the weight's block), one weight scale serves a whole step of a
tile. (A product of a few rows, a short prefill chunk's, runs in cuBLAS where its trial agreed, or
on a tile of 64 weight rows: `gemm_tiles`.) Each dot
covers 128 products of K, so the tensor cores' reduced-precision fp8 accumulation (Triton's default
on sm_90) never runs longer than that before the float32 sum takes over: the recipe's "promotion
every 128".

On the CPU (and for any tensor use_triton turns away) `gemm` is the exact product of the
dequantized weights in float32, activations unquantized: the engine's CPU path must not lose the
activations' precision that the GPU path trades for fp8 tensor cores. `gemm_ref` is something else:
the float32 reference of exactly what the kernel computes, from activations already quantized, that
the tests hold the kernel to.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mtpchat.kernels._triton import interpreting, tl, triton, use_triton
from mtpchat.kernels.fp8 import BLOCK, FP8, FP8_MAX, BlockFP8, dequantize_ref, scale_shape
from mtpchat.kernels.plan import ProductPlan


def quantize_rows_ref(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] float8_e4m3fn, xs [M, ceil(K / group)] float32): per token and group
    of columns, xs = amax / 448 (1 for a group of zeros) and xq = x times xs's reciprocal rounded
    to the nearest float8_e4m3fn, so that xq * xs is x to fp8's precision. The reciprocal is a
    true division, 1 / xs (then at most float32's largest: a group whose amax is under 1e-36 keeps
    its zeros and its signs), and a product stands for a division a value (an IEEE division is
    some 25 instructions on the GPU: compiled for sm_90, the add and norm into FP8 rows took 936
    a thread against 544 for the same pass unquantized). The codes may differ in their last place
    from x / xs's where the two roundings go apart."""
    M, K = x.shape
    G = -(-K // group)
    b = torch.nn.functional.pad(x.float(), (0, G * group - K)).view(M, G, group)
    amax = b.abs().amax(dim=-1)                                          # [M, G]
    xs = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    rcp = (torch.ones_like(xs) / xs).clamp(max=torch.finfo(torch.float32).max)
    xq = (b * rcp[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return xq.view(M, G * group)[:, :K].contiguous(), xs.contiguous()


def gemm_ref(xq: torch.Tensor, xs: torch.Tensor, q: BlockFP8, out_dtype: torch.dtype) -> torch.Tensor:
    """What the kernel computes, in float32: (xq * xs per 128-column group) @ dequant(q)ᵀ, cast to
    out_dtype. xq [M, K] float8_e4m3fn, xs [M, ceil(K / 128)] float32 -> [M, N]."""
    K = xq.shape[1]
    x = xq.float() * xs.float().repeat_interleave(BLOCK, dim=1)[:, :K]
    return (x @ dequantize_ref(q).T).to(out_dtype)


@triton.jit
def _round_e4m3(b_v):
    """float32 values in [-448, 448] rounded to the nearest float8_e4m3fn value (ties to even),
    still float32. Only for Triton's interpreter, whose float32 -> fp8 conversion rounds half up
    without carrying into the exponent (124.3 -> 64) and mishandles fp8's subnormals; a value already
    on the fp8 grid it converts exactly. Adding and taking away c = 1.5 * 2^(e + 20), for 2^e the
    value's power of two (2^-6 at least: fp8's subnormals are spaced as its smallest normals),
    rounds |v| to a multiple of 2^(e - 3), fp8's spacing there, with float32's own rounding."""
    b_bits = b_v.to(tl.uint32, bitcast=True)
    b_abs = (b_bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    b_e = tl.maximum((b_bits >> 23) & 0xFF, 127 - 6)                     # biased exponent
    b_c = (((b_e + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    b_r = (b_abs + b_c) - b_c
    return (b_r.to(tl.uint32, bitcast=True) | (b_bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile(b_x, INTERPRET: tl.constexpr):
    """float32 rows [R, G] of one group each -> (codes [R, G] in [-448, 448] on the e4m3 grid, still
    float32; scales [R]): quantize_rows_ref's rule, bit for bit."""
    b_amax = tl.max(tl.abs(b_x), axis=1)
    # IEEE divisions (div_rn; `/` is div.full.f32 on NVIDIA) so that the bits are the reference's:
    # two a group (the scale, its reciprocal), a product a value
    b_s = tl.where(b_amax > 0, tl.math.div_rn(b_amax, tl.full(b_amax.shape, 448., tl.float32)), 1.)
    b_r = tl.minimum(tl.math.div_rn(tl.full(b_s.shape, 1., tl.float32), b_s), 3.4028234663852886e38)
    b_q = b_x * b_r[:, None]
    b_q = tl.minimum(tl.maximum(b_q, -448.), 448.)
    if INTERPRET:
        b_q = _round_e4m3(b_q)
    return b_q, b_s


@triton.jit
def _quantize_rows_kernel(x, xq, xs, M, MP, K, s_x, s_q, s_sm, s_sk, BR: tl.constexpr, G: tl.constexpr,
                          SWIGLU: tl.constexpr, INTERPRET: tl.constexpr):
    # program (i_r, i_g): rows i_r BR .. + BR, columns of group i_g; rows M .. MP are padding (zeros).
    # SWIGLU: x is [gate | up] (K columns each) and the rows are silu(gate) * up, rounded as
    # kernels/matvec.py's silu_mul rounds them
    i_r, i_g = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_k = i_g * G + tl.arange(0, G)
    m_r = o_r < MP
    m_x = (o_r < M)[:, None] & (o_k < K)[None, :]
    p_x = x + o_r[:, None] * s_x + o_k[None, :]
    b_x = tl.load(p_x, mask=m_x, other=0.).to(tl.float32)
    if SWIGLU:
        b_u = tl.load(p_x + K, mask=m_x, other=0.).to(tl.float32)
        b_x = (b_x * tl.sigmoid(b_x)).to(x.dtype.element_ty).to(tl.float32)
        b_x = (b_x * b_u).to(x.dtype.element_ty).to(tl.float32)
    b_q, b_s = quantize_tile(b_x, INTERPRET)
    m_q = m_r[:, None] & (o_k < K)[None, :]
    tl.store(xq + o_r[:, None] * s_q + o_k[None, :], b_q.to(xq.dtype.element_ty), mask=m_q)
    tl.store(xs + o_r * s_sm + i_g * s_sk, b_s, mask=m_r)


def quantize_rows_triton(x: torch.Tensor, pad: int = 1, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref in one pass over x. xs comes as the transpose of a [KB, M] tensor (its
    shape [M, KB], strides (1, M)): the product reads a step's BM token scales as one contiguous
    run. `pad`: the rows rounded up to a multiple of it, the rows added zeros with scale 1 (cuBLAS
    takes rows in multiples of CUBLAS_ROWS only). `swiglu`: x is an MLP's [gate | up] rows and
    the rows quantized are silu(gate) * up (quantize_rows_ref(silu_mul_ref(x)), bit for bit)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows"
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"x is {x.dtype}"
    M, K = x.shape
    if swiglu:
        assert K % 2 == 0, "swiglu: x must be [M, 2I] = [gate | up]"
        K //= 2
    MP = triton.cdiv(M, pad) * pad
    KB = triton.cdiv(K, BLOCK)
    xq = torch.empty(MP, K, dtype=FP8, device=x.device)
    xs = torch.empty(KB, MP, dtype=torch.float32, device=x.device).T
    if MP == 0:
        return xq, xs
    BR = 32
    _quantize_rows_kernel[(triton.cdiv(MP, BR), KB)](
        x, xq, xs, M, MP, K, x.stride(0), xq.stride(0), xs.stride(0), xs.stride(1), BR=BR, G=BLOCK,
        SWIGLU=swiglu, INTERPRET=interpreting(), num_warps=4)
    return xq, xs


class QuantizedRows(NamedTuple):
    """Rows already quantized for an FP8 product, as quantize_rows_triton(x, CUBLAS_ROWS) gives
    them: codes [MP, K], scales [MP, KB] (M-major), `rows` of the MP real, standing for rows of
    `dtype` (the product's output dtype). A prefill kernel whose rows only an FP8 product reads
    writes them so (KernelPlan.prefill_quant: the MLP's SwiGLU, the GDN output norm), which saves
    a pass over them; `gemm` and int4_gemm.requantized_gemm take them as they take x."""
    q: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.q.shape[1]

    @property
    def device(self) -> torch.device:
        return self.q.device


def quantized_swiglu(gate_up: torch.Tensor) -> QuantizedRows:
    """An MLP's gating of [gate | up] rows straight into FP8 rows for the down product."""
    xq, xs = quantize_rows_triton(gate_up, CUBLAS_ROWS, swiglu=True)
    return QuantizedRows(xq, xs, gate_up.shape[0], gate_up.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq, xs) by rows and 128-column groups: the kernel for CUDA tensors, the
    reference otherwise."""
    return quantize_rows_triton(x) if use_triton(x) else quantize_rows_ref(x)


@triton.jit
def _gemm_kernel(a, a_s, b, b_s, y, M, N, K, s_a, s_asm, s_ask, s_b, s_bs, s_y,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # Tiles in groups of GROUP_M row blocks: consecutive programs take the group's row blocks of
    # one column block, then of the next, so a wave of programs shares its weight tiles and its
    # rows of x in L2. BK = 128 and BN divides 128, the weight's scale block: the tile's K step
    # i_k is its scale column, and its columns share the scale row i_n * BN // 128.
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    in_group = GROUP_M * n_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    i_m = first_m + (pid % in_group) % size_m
    i_n = (pid % in_group) // size_m
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    p_bs = b_s + (i_n * BN // 128) * s_bs
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_a = tl.load(a + o_m[:, None] * s_a + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.)
        b_b = tl.load(b + o_n[:, None] * s_b + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
        b_as = tl.load(a_s + o_m * s_asm + i_k * s_ask, mask=m_m, other=0.)
        b_bs = tl.load(p_bs + i_k)
        # fp8 x fp8 -> float32 on the tensor cores; b [BN, BK] rows are K-contiguous, so its
        # transpose is the K-major operand that Hopper's fp8 wgmma takes. (Triton's interpreter
        # runs the same dot: it widens fp8 to float16, exactly, and multiplies in float32.)
        acc += tl.dot(b_a, tl.trans(b_b)) * (b_as * b_bs)[:, None]
    tl.store(y + o_m[:, None] * s_y + o_n[None, :], acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


class GemmTiles(NamedTuple):
    """A tile of the prefill product: BM rows x BN weight columns (BN divides 128), K steps of 128
    (the weight's scale block), `warps`, `stages` deep."""
    BM: int
    BN: int
    warps: int
    stages: int


# Tiles for an H100: 128 x 128 outputs, K steps of 128 (the weight's scale block), two warpgroups
# (each 64 rows of the tile), 4 stages of 32 KB of fp8 operands in shared memory.
BM, BN, BK, GROUP_M, WARPS, STAGES = 128, BLOCK, BLOCK, 8, 8, 4
WIDE = GemmTiles(BM, BN, WARPS, STAGES)
# For a few rows: 64 weight rows a program, one warpgroup, 4 deep (blocks of 64 rows, 16 for 16 or
# fewer: gemm_tiles): the wide tile's 40 programs for a product of 5,120 columns become 80, the 27B's
# products of a chunk of 16-256 rows 0.53-0.61 x the wide tile's time (tests/bench/probe_small_gemm.py)
SMALL = GemmTiles(64, 64, 4, 4)


def gemm_tiles(M: int, small: GemmTiles | None = None, small_rows: int = 0) -> GemmTiles:
    """The tile for M rows: `small` up to `small_rows` rows (16 rows a block for at most 16, which
    took SMALL's products 0.95 x the time of 64 there; 32 rows a block took them 1.46 x at 32 rows,
    so its own BM beyond), the wide tile beyond (tests/bench/probe_small_gemm.py, an H200)."""
    if small is None or M > small_rows:
        return WIDE
    return small._replace(BM=16) if M <= 16 else small


def gemm_quantized_triton(xq: torch.Tensor, xs: torch.Tensor, q: BlockFP8, out_dtype: torch.dtype,
                          tiles: GemmTiles = WIDE) -> torch.Tensor:
    """The product of rows already quantized (quantize_rows) with q: y [M, N] in out_dtype, what
    gemm_ref computes, in `tiles`."""
    N, K = q.w.shape
    assert xq.dim() == 2 and xq.shape[1] == K, f"xq {tuple(xq.shape)} must be [M, {K}]"
    M = xq.shape[0]
    KB = scale_shape(N, K)[1]
    assert xq.dtype == FP8 and xq.stride(1) == 1, "xq must be float8_e4m3fn with contiguous rows"
    assert xs.dtype == torch.float32 and xs.shape == (M, KB), f"xs must be float32 [{M}, {KB}]"
    assert q.w.dtype == FP8 and q.w.is_contiguous(), "the weight must be contiguous float8_e4m3fn [N, K]"
    assert q.scale.dtype == torch.float32 and q.scale.shape == scale_shape(N, K) and q.scale.is_contiguous(), \
        f"the weight's scale must be contiguous float32 {scale_shape(N, K)}"
    assert out_dtype in (torch.float32, torch.bfloat16, torch.float16), f"out_dtype {out_dtype}"
    assert BLOCK % tiles.BN == 0, f"a tile's columns ({tiles.BN}) must divide the scale block {BLOCK}"
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, tiles.BM) * triton.cdiv(N, tiles.BN),)
    _gemm_kernel[grid](xq, xs, q.w, q.scale, y, M, N, K, xq.stride(0), xs.stride(0), xs.stride(1), q.w.stride(0),
                       q.scale.stride(0), y.stride(0), BM=tiles.BM, BN=tiles.BN, BK=BK, GROUP_M=GROUP_M,
                       num_warps=tiles.warps, num_stages=tiles.stages)
    return y


def gemm_triton(x: torch.Tensor, q: BlockFP8) -> torch.Tensor:
    """x [M, K] @ dequant(q)ᵀ -> [M, N] in x's dtype, x's rows quantized to fp8 on the way."""
    assert x.dim() == 2 and x.shape[1] == q.w.shape[1], f"x {tuple(x.shape)} and the weight {tuple(q.w.shape)} disagree"
    xq, xs = quantize_rows_triton(x)
    return gemm_quantized_triton(xq, xs, q, x.dtype)


def gemm_cublas(xq: torch.Tensor, xs: torch.Tensor, q: BlockFP8, out_dtype: torch.dtype) -> torch.Tensor:
    """What gemm_quantized_triton computes, by cuBLAS's block-scaled FP8 product (CUDA 12.9 and
    later on Hopper: torch._scaled_mm with 1 x 128 scales of the rows, M-major as quantize_rows
    lays them out, and 128 x 128 scales of the weight, seen as [KB, NB]). On an H100 at the 27B's
    prefill shapes (2048 tokens) it took 0.61-0.62 of bf16 cuBLAS's time, the Triton kernel
    1.5-1.7 (tests/bench/probe_fp8.py)."""
    return torch._scaled_mm(xq, q.w.T, scale_a=xs, scale_b=q.scale.T, out_dtype=out_dtype)


CUBLAS_MIN_ROWS = 256         # the 4-bit weights' fp8 form takes no fewer rows (int4_gemm.fp8_serves); an FP8
                              # weight's product takes cuBLAS from the plan's fp8_cublas_rows
# cuBLAS's rows in multiples of this (the rows' 1 x 128 scales are M-major; an H100, CUDA 13, with
# 1 x 128 scales on both operands: 257 and 2,047 rows refused with CUBLAS_STATUS_NOT_SUPPORTED)
CUBLAS_ROWS = 16
_cublas_trusted: dict = {}    # (what, device, N, K, dtype, rows rounded up to a power of two) -> seen right


def cublas_trusted(key: tuple, trial) -> bool:
    """Whether cuBLAS's block-scaled product serves the product named by `key` (its kind, device,
    weight shape, dtype and rows rounded up to a power of two): `trial()` runs it once against a
    reference and says whether they agree; an error there counts as no. cuBLAS refuses some shapes
    with an error, and some it returns wrong without one (an H100, CUDA 13.0: 640 x 384 weights
    came back 46% off, every 27B shape right; tests/bench/probe_fp8.py)."""
    if key not in _cublas_trusted:
        try:
            _cublas_trusted[key] = bool(trial())
        except (RuntimeError, ValueError):   # NotImplementedError too: a scaling this GPU's cuBLAS lacks;
                                             # ValueError: one torch takes for no device's (a CPU's)
            _cublas_trusted[key] = False
    return _cublas_trusted[key]


TRIAL_ROWS = 1024     # the most rows a trial takes (its float32 products of a slab's width stay some 100 MB)


def cublas_serves(q: BlockFP8, dtype: torch.dtype, M: int) -> bool:
    """Whether cuBLAS serves weights of q's shape for M rows: tried once for each power of two of
    rows from CUBLAS_ROWS up to TRIAL_ROWS (more rows are trusted as that many were: a long prompt's first chunk
    must not need some 1 GB more than its plan for the trial) against the Triton kernel
    (cublas_trusted)."""
    N, K = q.w.shape
    rows = min(max(triton.next_power_of_2(M), CUBLAS_ROWS), TRIAL_ROWS)

    def trial():
        g = torch.Generator(device=q.w.device).manual_seed(0)
        x = torch.randn(rows, K, device=q.w.device, generator=g, dtype=dtype)
        xq, xs = quantize_rows_triton(x, CUBLAS_ROWS)
        got = gemm_cublas(xq, xs, q, torch.float32)
        want = gemm_quantized_triton(xq, xs, q, torch.float32)
        return ((got - want).norm() / want.norm()) < 1e-2
    return cublas_trusted(("block", q.w.device, N, K, dtype, rows), trial)


def gemm(x: torch.Tensor | QuantizedRows, q: BlockFP8, plan: ProductPlan | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(q)ᵀ: fp8 activations and tensor cores for CUDA tensors (cuBLAS from the
    plan's fp8_cublas_rows rows, for the shapes it was seen to compute right, its rows padded to
    CUBLAS_ROWS; else the Triton kernel, on the plan's tile for the rows), the exact float32
    product of the dequantized weights otherwise (see the module's docstring). x may come
    quantized already (QuantizedRows, CUDA only)."""
    plan = plan if plan is not None else ProductPlan(programs=0)
    if isinstance(x, QuantizedRows):
        M = x.rows
        assert x.q.shape[1] == q.w.shape[1] and x.q.shape[0] % CUBLAS_ROWS == 0, \
            f"quantized rows {tuple(x.q.shape)} for the weight {tuple(q.w.shape)}, padded to {CUBLAS_ROWS}"
        if M >= plan.fp8_cublas_rows and x.dtype in (torch.bfloat16, torch.float16) and cublas_serves(q, x.dtype, M):
            try:
                return gemm_cublas(x.q, x.scale, q, x.dtype)[:M]
            except RuntimeError:
                pass
        return gemm_quantized_triton(x.q, x.scale, q, x.dtype, gemm_tiles(M, SMALL, plan.fp8_small_rows))[:M]
    if not use_triton(x, q.w):
        return (x.float() @ dequantize_ref(q).T).to(x.dtype)
    assert x.dim() == 2 and x.shape[1] == q.w.shape[1], f"x {tuple(x.shape)} and the weight {tuple(q.w.shape)} disagree"
    M = x.shape[0]
    if M >= plan.fp8_cublas_rows and x.dtype in (torch.bfloat16, torch.float16) and cublas_serves(q, x.dtype, M):
        xq, xs = quantize_rows_triton(x, CUBLAS_ROWS)
        try:
            return gemm_cublas(xq, xs, q, x.dtype)[:M]
        except RuntimeError:
            pass
    xq, xs = quantize_rows_triton(x)
    return gemm_quantized_triton(xq, xs, q, x.dtype, gemm_tiles(M, SMALL, plan.fp8_small_rows))
