"""RMSNorm variants of Qwen3.5: float32 torch references, the Triton kernels beside them, and the
dispatchers the engine calls (Triton for CUDA tensors, the reference otherwise).

rmsnorm:       y = x * rsqrt(mean(x²) + eps) * (1 + w), computed in float32, cast to x's dtype
               (the weights are stored zero-centred).
add_rmsnorm:   the residual add, h = x + residual in the stream's dtype, then rmsnorm(h); x may come
               as a split product's float32 parts (kernels/matvec_parts.py), added here.
gated_rmsnorm: the GDN output norm, per head: normalise in float32, cast, times w (plain, not 1+w),
               times silu(z) in float32, cast.
head_input:    the MTP head's input [T, 2 H]: its tokens' embedding rows and the hidden rows, each
               rmsnorm'ed with its own weight, side by side (embedding first), in one launch where
               the composition takes four (the lookup, two norms, the concatenation).
Each row is normalised on its own (by one program, or one row of a program's tile), so a row's
value does not depend on how many rows there are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtpchat.kernels._triton import interpreting, pdl, pdl_start, tl, triton, use_triton
from mtpchat.kernels.fp8 import BLOCK, FP8
from mtpchat.kernels.fp8_gemm import CUBLAS_ROWS, QuantizedRows, quantize_tile
from mtpchat.kernels.matvec_parts import parts_sum_ref


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add fused with the next norm: returns (norm(x + residual), x + residual). x is
    the block's output, or a split product's float32 parts [S, ...] (kernels/matvec_parts.py),
    added in order and rounded to the residual's dtype first."""
    if x.dim() == residual.dim() + 1:
        x = parts_sum_ref(x, residual.dtype)
    h = x + residual
    return rmsnorm_ref(h, weight, eps), h


def gated_rmsnorm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z [..., D]; weight [D]."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y * F.silu(z.float())).to(x.dtype)


def head_input_ref(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                   w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """ids [T], embed [V, H], hidden [T, H] -> [T, 2 H]: rmsnorm(embed[ids], w_embed) beside
    rmsnorm(hidden, w_hidden)."""
    return torch.cat([rmsnorm_ref(F.embedding(ids, embed), w_embed, eps), rmsnorm_ref(hidden, w_hidden, eps)], -1)


# Rows are addressed as [A, B, D] with element strides (s0, s1, 1): that covers a contiguous [T, D],
# per-head rows [T, H, D], and per-head views of a wider projection (q of q_proj, z of in_proj).

@triton.jit
def _rmsnorm_kernel(x, r, w, y, h, R, B, D, eps, s_xp, s_x0, s_x1, s_r0, s_r1, s_y0, s_y1, s_h0, s_h1,
                    ys, s_sm, s_sk, BD: tl.constexpr, PARTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    QUANT: tl.constexpr, SCALE_GROUP: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    # QUANT (rows [1, R, D], a residual): the normalised rows quantized for an FP8 product, y the
    # codes [R', D] and ys their scales [R', D / 128] (fp8_gemm.quantize_rows_triton's layout),
    # programs R .. R' the padding rows (zeros, scale 1)
    pdl_start(PDL)
    i_r = tl.program_id(0)
    i_a, i_b = i_r // B, i_r % B
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    if QUANT:
        m_d = m_d & ((tl.zeros([BD], dtype=tl.int32) + i_r) < R)   # (a scalar boolean makes no mask everywhere)
    p_x = x + i_a * s_x0 + i_b * s_x1 + o_d
    b_x = tl.load(p_x, mask=m_d, other=0.).to(tl.float32)
    if PARTS > 1:
        # a split product's float32 parts, added in order, then rounded as the product's value
        for i_p in tl.static_range(1, PARTS):
            b_x += tl.load(p_x + i_p * s_xp, mask=m_d, other=0.)
    if PARTS > 0:
        b_x = b_x.to(h.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        # the sum is rounded to the stream's dtype first, as `x + residual` is in torch
        b_x += tl.load(r + i_a * s_r0 + i_b * s_r1 + o_d, mask=m_d, other=0.).to(tl.float32)
        b_x = b_x.to(h.dtype.element_ty)
        tl.store(h + i_a * s_h0 + i_b * s_h1 + o_d, b_x, mask=m_d)
        b_x = b_x.to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x) / D + eps)
    b_w = 1. + tl.load(w + o_d, mask=m_d, other=0.).to(tl.float32)
    if QUANT:
        NG: tl.constexpr = BD // SCALE_GROUP
        b_y = (b_x * b_rstd * b_w).to(h.dtype.element_ty).to(tl.float32)
        b_q, b_s = quantize_tile(tl.reshape(b_y, (NG, SCALE_GROUP)), INTERPRET)
        tl.store(y + i_r * s_y0 + o_d, tl.reshape(b_q, (BD,)).to(y.dtype.element_ty), mask=o_d < D)
        o_g = tl.arange(0, NG)
        tl.store(ys + i_r * s_sm + o_g * s_sk, b_s, mask=o_g * SCALE_GROUP < D)
    else:
        tl.store(y + i_a * s_y0 + i_b * s_y1 + o_d, (b_x * b_rstd * b_w).to(y.dtype.element_ty), mask=m_d)


@triton.jit
def _gated_rmsnorm_kernel(x, z, w, y, R, RP, B, D, eps, s_x0, s_x1, s_z0, s_z1, s_y0, s_y1, ys, s_sm, s_sk,
                          BR: tl.constexpr, BD: tl.constexpr, QUANT: tl.constexpr, INTERPRET: tl.constexpr,
                          PDL: tl.constexpr):
    # BR rows a program (rows r = a * B + b of the [A, B, D] views), each normalised on its own.
    # QUANT: each row (D = 128, one group) quantized to FP8 for the product after it, y [A', B * D]
    # the codes and ys [A', B] their scales (fp8_gemm.quantize_rows_triton's layout), rows R .. RP
    # the padding (zeros, scale 1)
    pdl_start(PDL)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    i_a, i_b = o_r // B, o_r % B
    o_d = tl.arange(0, BD)
    m = (o_r < R)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + (i_a * s_x0 + i_b * s_x1)[:, None] + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    b_n = (b_x * b_rstd[:, None]).to(x.dtype.element_ty).to(tl.float32)
    # weight * normed is rounded to the model dtype, as torch does for bf16 x bf16
    b_wn = (tl.load(w + o_d, mask=o_d < D, other=0.).to(tl.float32)[None, :] * b_n).to(x.dtype.element_ty)
    b_z = tl.load(z + (i_a * s_z0 + i_b * s_z1)[:, None] + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_y = (b_wn.to(tl.float32) * (b_z * tl.sigmoid(b_z))).to(x.dtype.element_ty)
    if QUANT:
        b_q, b_s = quantize_tile(b_y.to(tl.float32), INTERPRET)
        m_p = (o_r < RP)[:, None] & (o_d < D)[None, :]
        tl.store(y + (i_a * s_y0 + i_b * s_y1)[:, None] + o_d[None, :], b_q.to(y.dtype.element_ty), mask=m_p)
        tl.store(ys + i_a * s_sm + i_b * s_sk, b_s, mask=o_r < RP)
    else:
        tl.store(y + (i_a * s_y0 + i_b * s_y1)[:, None] + o_d[None, :], b_y, mask=m)


@triton.jit
def _head_input_kernel(ids, embed, hidden, w_e, w_h, y, D, eps, s_e, s_h, s_y, BD: tl.constexpr, PDL: tl.constexpr):
    # Program (r, 0) normalises row r's embedding into y[r, :D], (r, 1) its hidden into y[r, D:],
    # as _rmsnorm_kernel does a row (the same sum, the same BD and warps: the same bits). The ids
    # are read after the wait: the draft before wrote them.
    pdl_start(PDL)
    i_r = tl.program_id(0)
    i_h = tl.program_id(1)          # the half: 0 the embedding's, 1 the hidden's
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    if i_h == 0:
        i_v = tl.load(ids + i_r).to(tl.int64)
        b_x = tl.load(embed + i_v * s_e + o_d, mask=m_d, other=0.).to(tl.float32)
        b_w = 1. + tl.load(w_e + o_d, mask=m_d, other=0.).to(tl.float32)
    else:
        b_x = tl.load(hidden + i_r * s_h + o_d, mask=m_d, other=0.).to(tl.float32)
        b_w = 1. + tl.load(w_h + o_d, mask=m_d, other=0.).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x) / D + eps)
    tl.store(y + i_r * s_y + i_h * D + o_d, (b_x * b_rstd * b_w).to(y.dtype.element_ty), mask=m_d)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View [..., D] as [A, B, D] without copying when the strides allow it; the last dim contiguous."""
    if t.dim() == 1:
        t = t[None, None]
    elif t.dim() == 2:
        t = t[None]
    elif t.dim() > 3:
        t = t.reshape(-1, t.shape[-2], t.shape[-1])
    assert t.stride(-1) == 1, "the normalised dimension must be contiguous"
    return t


def _launch_params(D: int):
    BD = triton.next_power_of_2(D)
    return BD, min(16, max(1, BD // 512))


def _rmsnorm_launch(x, residual, weight, eps, out=None, quantize: bool = False, warps: int | None = None):
    D = x.shape[-1]
    assert weight.shape == (D,) and weight.is_contiguous(), f"weight must be [{D}] contiguous"
    parts = residual is not None and x.dim() == residual.dim() + 1
    if parts:
        assert x.dtype == torch.float32 and x.shape[1:] == residual.shape, \
            f"parts {tuple(x.shape)} must be float32 [S, {', '.join(map(str, residual.shape))}]"
    dtype = residual.dtype if parts else x.dtype
    shape = x.shape[1:] if parts else x.shape
    if out is not None:
        assert out.shape == shape and out.dtype == dtype, f"out must be {tuple(shape)} {dtype}"
    BD, default_warps = _launch_params(D)
    warps = warps or default_warps
    if quantize:
        assert residual is not None and residual.dim() == 2 and out is None and BD >= BLOCK, \
            f"quantize: rows [T, D >= {BLOCK // 2 + 1}] with a residual, no `out`"
        T = residual.shape[0]
        MP = triton.cdiv(T, CUBLAS_ROWS) * CUBLAS_ROWS
        xq = torch.empty(MP, D, dtype=FP8, device=x.device)
        xs = torch.empty(triton.cdiv(D, BLOCK), MP, dtype=torch.float32, device=x.device).T
        y, y3, grid, s_scales = QuantizedRows(xq, xs, T, dtype), xq[None], MP, xs.stride()
        h = torch.empty(shape, dtype=dtype, device=x.device)
    else:
        y = out if out is not None else torch.empty(shape, dtype=dtype, device=x.device)
        h = torch.empty_like(y) if residual is not None else y
        y3, xs, s_scales = _rows(y), None, (0, 0)
    x3, h3 = _rows(x[0] if parts else x), _rows(h)
    r3 = _rows(residual) if residual is not None else x3
    assert r3.shape == x3.shape and r3.dtype == dtype, "residual must match x"
    A, B = x3.shape[0], x3.shape[1]
    if not quantize:
        grid = A * B
    _rmsnorm_kernel[(grid,)](x3, r3, weight, y3, h3, A * B, B, D, eps, x.stride(0) if parts else 0, x3.stride(0),
                             x3.stride(1), r3.stride(0), r3.stride(1), y3.stride(1) if quantize else y3.stride(0),
                             y3.stride(1), h3.stride(0), h3.stride(1), xs if quantize else y3, *s_scales, BD=BD,
                             PARTS=x.shape[0] if parts else 0, HAS_RESIDUAL=residual is not None, QUANT=quantize,
                             SCALE_GROUP=BLOCK,
                             INTERPRET=interpreting(), num_warps=warps, **pdl(x))
    return y, h


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rmsnorm_launch(x, None, weight, eps)[0]


def add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out=None,
                       quantize: bool = False, warps: int | None = None):
    """add_rmsnorm_ref's contract; `quantize` (rows [T, D]): the normalised rows come quantized for
    an FP8 product (fp8_gemm.QuantizedRows: quantize_rows of them, bit for bit, at the same `warps`).
    `warps` a row (a power of two; by default up to 16, one per 512 of D) sets the order of its
    sum of squares, so two calls agree bit for bit at the same warps."""
    return _rmsnorm_launch(x, residual, weight, eps, out, quantize, warps)


def gated_rmsnorm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                         rows: int = 1, quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """gated_rmsnorm_ref's contract, `rows` rows (heads of tokens) a program: 1 in a step (48
    programs of one warp a token on the 27B), more in a prefill (KernelPlan.prefill_rows), where
    one a program makes some 100,000 programs of 256 bytes a chunk. For a given `rows`, a row's
    value does not depend on how many rows there are (its sum's order may depend on `rows`).
    `quantize` (x [T, H, 128]): the output's [T, H * 128] rows come quantized for an FP8 product
    (fp8_gemm.QuantizedRows: quantize_rows_ref of the output, bit for bit, each head one group)."""
    D = x.shape[-1]
    assert z.shape == x.shape, f"z {tuple(z.shape)} must match x {tuple(x.shape)}"
    assert weight.shape == (D,) and weight.is_contiguous(), f"weight must be [{D}] contiguous"
    assert weight.dtype == x.dtype, "the gated norm's weight must have x's dtype"
    assert rows >= 1 and rows & (rows - 1) == 0, f"rows a program must be a power of two, got {rows}"
    x3, z3 = _rows(x), _rows(z)
    R, B = x3.shape[0] * x3.shape[1], x3.shape[1]
    if quantize:
        assert x.dim() == 3 and D == BLOCK, f"quantize: x must be [T, H, {BLOCK}] (a head a group)"
        MP = triton.cdiv(x.shape[0], CUBLAS_ROWS) * CUBLAS_ROWS
        xq = torch.empty(MP, B * D, dtype=FP8, device=x.device)
        xs = torch.empty(B, MP, dtype=torch.float32, device=x.device).T
        out, RP = QuantizedRows(xq, xs, x.shape[0], x.dtype), MP * B
        y, y_strides, s_scales = xq, (xq.stride(0), D), xs.stride()
    else:
        out, RP = torch.empty(x.shape, dtype=x.dtype, device=x.device), R
        y = _rows(out)
        y_strides, s_scales = y.stride()[:2], (0, 0)
    BD, warps = _launch_params(D)
    warps = max(warps, min(8, rows * BD // 512))
    _gated_rmsnorm_kernel[(triton.cdiv(RP, rows),)](
        x3, z3, weight, y, R, RP, B, D, eps, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), *y_strides,
        out.scale if quantize else y, *s_scales, BR=rows, BD=BD, QUANT=quantize, INTERPRET=interpreting(),
        num_warps=warps, **pdl(x))
    return out


def head_input_triton(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                      w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """head_input_ref's contract in one launch; each half the bits rmsnorm_triton gives it."""
    T, H = hidden.shape
    assert ids.shape == (T,) and (ids.stride(0) == 1 or T == 1), \
        f"ids must be [{T}] contiguous, one a hidden row, got {tuple(ids.shape)}"
    assert embed.dim() == 2 and embed.shape[1] == H, f"embed must be [V, {H}], got {tuple(embed.shape)}"
    assert embed.dtype == hidden.dtype, f"embed ({embed.dtype}) and hidden ({hidden.dtype}) must share a dtype"
    for w in (w_embed, w_hidden):
        assert w.shape == (H,) and w.is_contiguous(), f"the norms' weights must be [{H}] contiguous"
    assert embed.stride(1) == 1 and hidden.stride(1) == 1, "embed and hidden rows must be contiguous"
    y = torch.empty(T, 2 * H, dtype=hidden.dtype, device=hidden.device)
    BD, warps = _launch_params(H)
    _head_input_kernel[(T, 2)](ids, embed, hidden, w_embed, w_hidden, y, H, eps, embed.stride(0), hidden.stride(0),
                               y.stride(0), BD=BD, num_warps=warps, **pdl(hidden))
    return y


def head_input(ids: torch.Tensor, embed: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
               w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """head_input_ref's contract: the kernel for CUDA tensors, the reference otherwise."""
    if use_triton(hidden, embed, w_embed, w_hidden):
        return head_input_triton(ids, embed, hidden, w_embed, w_hidden, eps)
    return head_input_ref(ids, embed, hidden, w_embed, w_hidden, eps)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rmsnorm_triton(x, weight, eps) if use_triton(x, weight) else rmsnorm_ref(x, weight, eps)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out=None,
                quantize: bool = False):
    """add_rmsnorm_ref's contract; the normalised rows written into `out` when given, or quantized
    for an FP8 product with `quantize` (CUDA only)."""
    if use_triton(x, residual, weight):
        return add_rmsnorm_triton(x, residual, weight, eps, out, quantize)
    assert not quantize, "quantized rows come from the kernel only"
    y, h = add_rmsnorm_ref(x, residual, weight, eps)
    return (y if out is None else out.copy_(y)), h


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, rows: int = 1,
                  quantize: bool = False) -> torch.Tensor | QuantizedRows:
    """gated_rmsnorm_ref's contract; the kernel for CUDA tensors, `rows` rows a program, its output
    quantized for an FP8 product with `quantize` (CUDA only)."""
    if use_triton(x, z, weight):
        return gated_rmsnorm_triton(x, z, weight, eps, rows, quantize)
    assert not quantize, "quantized rows come from the kernel only"
    return gated_rmsnorm_ref(x, z, weight, eps)
