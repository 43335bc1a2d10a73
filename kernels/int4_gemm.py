"""Prefill's products over 4-bit weights (kernels/int4.py): y [T, N] = x [T, K] @ w [N, K]ᵀ for many
rows, in one of three forms (ProductPlan.int4_prefill):

- "dense": the weight dequantized by a Triton kernel into the model's dtype, a slab of rows at a
  time (at most SLAB_BYTES of it), and torch's matmul over each slab. The unpacking is paid once a
  weight and a call, whatever the number of rows; the price is the dense slab written and read
  again (four times the 4-bit bytes) and its memory. x is read through the weight's perm first
  (GPTQ's desc_act), so the slab stays in the weight's own column order. The products round the
  dequantized weight to x's dtype, as the CPU's path (forms.dense_ref) does.
- "fp8": the same slabs, but of the weight's integers q - zero (-15 .. 15, exact in float8_e4m3fn)
  rather than of the weights, and the product on Hopper's FP8 tensor cores: x's rows quantized
  per token and 128 columns as fp8_gemm.py quantizes them for FP8 checkpoints, and cuBLAS's
  block-scaled product applying both scales, 1 x 128 of the rows and 1 x 128 of the weight's (its
  group scales, one per row and group, in float32: a group of 128 is such a block). The slab is
  half the dense one's bytes and the tensor cores run at twice the rate; what it costs is x's
  precision in prefill (e4m3's 3 mantissa bits a value, with a scale per 128), as the official
  FP8 checkpoints are run. Only groups of 128, at CUBLAS_MIN_ROWS rows or more, where cuBLAS was
  seen to compute the shape right (fp8_gemm.cublas_trusted); anything else takes the dense form.
- "fused": one kernel that unpacks each weight tile in registers (int4.dot_int4, as the few-row
  products do) and never writes a dense copy: a program takes BM rows of x by BN rows of w, the
  weight rows being the dot's M ([BN, G] @ [G, BM]), each group's float32 result scaled in float32.
  Each weight tile is unpacked again for every BM rows of x.

Measured at 2048 rows on an H100 (tests/bench/bench_int4.py --prefill-only, 2026-11-25; bf16's
torch matmul, fused, dense, in us): the 27B's GDN in_proj [16384 x 5120] 438, 2255, 589; MLP
gate|up [34816 x 5120] 923, 4805, 1235; MLP down [5120 x 17408] 454, 2409, 581; out_proj
[5120 x 6144] 166, 880, 191. A slab of 12800 x 5120 dequantizes in 66 us (2.5 TB/s written and
read). The dense form is the plan's default.
"""
from __future__ import annotations

import torch

from mtpchat.kernels import fp8_gemm
from mtpchat.kernels._triton import tl, triton, use_triton
from mtpchat.kernels.fp8 import BLOCK, FP8
from mtpchat.kernels.int4 import GroupInt4, check_int4, dequantize_ref, dot_int4, form_args, form_of, values_ref
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
                       zw=None, INTERLEAVED: tl.constexpr = False, SCALED: tl.constexpr = True):
    # program (i_n, i_k): rows i_n BN.., weights i_k BK... Natural words: each word's 8 weights
    # stored along a third axis (weight column 8 c + j is nibble j of word c). Interleaved int16
    # half-words (kernels/int4.py): the tile's half-words read as they lie, then
    # each quarter's nibbles stored as a run of G / 4 columns. SCALED False: q - zero, unscaled.
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
            if SCALED:
                b_w = (((b_q >> (4 * q)) & 0xF).to(tl.float32) - b_z) * b_s
            else:
                b_w = ((b_q >> (4 * q)) & 0xF).to(tl.float32) - b_z
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
        if SCALED:
            b_w = (b_v - b_z[:, :, None]) * b_s[:, :, None]
        else:
            b_w = b_v - b_z[:, :, None]
        p_o = out + o_n[:, None, None] * s_o + (o_c * 8)[None, :, None] + j[None, None, :]
        tl.store(p_o, b_w.to(out.dtype.element_ty), mask=m[:, :, None])


def dequantize_triton(w: GroupInt4, dtype: torch.dtype, rows: tuple[int, int] | None = None,
                      out: torch.Tensor | None = None, scaled: bool = True) -> torch.Tensor:
    """Rows n0 .. n1 (all without `rows`) of the dense weight in the weight's own column order (its
    perm not applied): (q - zero) * scale in float32, rounded to dtype, as dequantize_ref computes
    it; with `scaled` False the integers q - zero alone (values_minus_zero_ref; exact in any
    float dtype, float8_e4m3fn included). Written into `out` ([n1 - n0, K], rows contiguous) where
    given."""
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
        G=w.group, BN=BN, BK=BK, zw=zero, INTERLEAVED=w.interleaved, SCALED=scaled, num_warps=4)
    return out


def values_minus_zero_ref(w: GroupInt4) -> torch.Tensor:
    """[N, K] float32: the integers q - zero (-15 .. 15) in the weight's own column order."""
    N, K = w.shape
    zero = 8 if w.zero is None else w.zero.float().repeat_interleave(w.group, dim=1)
    return values_ref(w).float() - zero


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
        y[:, n0:n1] = x @ part.T
    return y


def fp8_gemm_ref(x: torch.Tensor, w: GroupInt4) -> torch.Tensor:
    """What the fp8 form computes, in float32: x (through the weight's perm) quantized per token and
    128 columns (fp8_gemm.quantize_rows_ref), times the weight's integers and scales, cast to x's
    dtype."""
    xp = x if w.perm is None else x[:, w.perm.long()]
    xq, xs = fp8_gemm.quantize_rows_ref(xp)
    K = xp.shape[1]
    xd = xq.float() * xs.repeat_interleave(BLOCK, dim=1)[:, :K]
    return (xd @ dequantize_ref(w._replace(perm=None)).T).to(x.dtype)


def _fp8_slab(xq: torch.Tensor, xs: torch.Tensor, values: torch.Tensor, scale: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's product of quantized rows (xq, xs: fp8_gemm.quantize_rows) and a slab's integers
    values [n, K] (float8_e4m3fn) with their group scales [n, K / 128]: the weight's scales handed
    over as 1 x 128 blocks of its rows, a [K / 128, n] tensor seen transposed."""
    return torch._scaled_mm(xq, values.T, scale_a=xs, scale_b=scale.float().T.contiguous(), out_dtype=dtype)


def fp8_serves(x: torch.Tensor, w: GroupInt4, slab_bytes: int = SLAB_BYTES) -> bool:
    """Whether the fp8 form takes this product (module docstring): groups of 128, enough rows, a
    16-bit x, and cuBLAS seen right on each slab shape the product takes (tried once a shape)."""
    T, K = x.shape
    N = w.shape[0]
    if w.group != BLOCK or T < fp8_gemm.CUBLAS_MIN_ROWS or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    rows = _slab_rows(K, x.element_size(), slab_bytes)
    shapes = {min(rows, N)} | ({N % rows} if N > rows and N % rows else set())
    M = triton.next_power_of_2(T)

    def trial(n: int) -> bool:
        g = torch.Generator(device=x.device).manual_seed(0)
        xr = torch.randn(M, K, device=x.device, dtype=x.dtype, generator=g)
        values = torch.randint(-15, 16, (n, K), device=x.device, generator=g, dtype=torch.int8).half().to(FP8)
        scale = torch.rand(n, K // BLOCK, device=x.device, generator=g) + 0.5
        xq, xs = fp8_gemm.quantize_rows_triton(xr)
        got = _fp8_slab(xq, xs, values, scale, torch.float32)[:64]
        xd = xq[:64].float() * xs[:64].repeat_interleave(BLOCK, dim=1)
        want = xd @ (values.float() * scale.repeat_interleave(BLOCK, dim=1)).T
        return ((got - want).norm() / want.norm()) < 1e-2
    return all(fp8_gemm.cublas_trusted(("int4 values", x.device, n, K, x.dtype, M), lambda n=n: trial(n))
               for n in sorted(shapes))


def fp8_dense_gemm(x: torch.Tensor, w: GroupInt4, slab_bytes: int = SLAB_BYTES) -> torch.Tensor:
    """The fp8 form (module docstring; fp8_serves says where it runs): x read through the weight's
    perm and quantized once, then per slab of rows the weight's integers in float8_e4m3fn and
    cuBLAS's block-scaled product."""
    T, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and x.stride(1) == 1, f"x [T, K] and w [N, K] disagree: {tuple(x.shape)}, {tuple(w.shape)}"
    assert w.group == BLOCK and (w.perm is None or w.perm.dim() == 1), "groups of 128 and a perm of [K]"
    if w.perm is not None:
        x = x.index_select(1, w.perm.long())
    xq, xs = fp8_gemm.quantize_rows_triton(x)
    rows = _slab_rows(K, x.element_size(), slab_bytes)
    if rows >= N:
        return _fp8_slab(xq, xs, dequantize_triton(w, FP8, scaled=False), w.scale, x.dtype)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    slab = torch.empty(rows, K, dtype=FP8, device=x.device)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        part = dequantize_triton(w, FP8, (n0, n1), slab[:n1 - n0], scaled=False)
        y[:, n0:n1] = _fp8_slab(xq, xs, part, w.scale[n0:n1], x.dtype)
    return y


def dense_workspace(T: int, k_min: int, k_max: int, itemsize: int, slab_bytes: int = SLAB_BYTES) -> int:
    """The most memory the dense or fp8 form takes beside its output, for T rows and products of
    k_min .. k_max columns: the slab, one slab's product before it is copied into place, x read
    through a perm, and (fp8) x's rows quantized with their scales."""
    return slab_bytes + T * (slab_bytes // k_min) + T * k_max * itemsize + T * (k_max + 4 * triton.cdiv(k_max, BLOCK))


def gemm(x: torch.Tensor, w: GroupInt4, plan: ProductPlan | None = None) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ -> [T, N] in x's dtype, for any number of rows: on CUDA the plan's
    int4_prefill form (the default plan's without one; an interleaved weight, which the fused
    kernel does not read, the dense form; the fp8 form where fp8_serves, else the dense form), the
    float32 reference otherwise."""
    if not use_triton(x, w.w):
        return gemm_ref(x, w)
    form = plan.int4_prefill if plan is not None else ProductPlan.int4_prefill
    if form == "fp8" and fp8_serves(x, w):
        return fp8_dense_gemm(x, w)
    if form in ("dense", "fp8") or w.interleaved:
        return dense_gemm(x, w)
    return gemm_triton(x, w, plan=plan)
