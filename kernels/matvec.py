"""Matrix-vector products for a few rows (decode, verify, draft): y [T, N] = x [T, K] @ w [N, K]ᵀ,
and the MLP's gate|up product with its SwiGLU fused in: silu(x @ w_gateᵀ) * (x @ w_upᵀ); also the
SwiGLU alone (`silu_mul`), for the batched products of prefill.

The products can take their input's norm with them (`norm_matvec`, `norm_matvec_swiglu`: the
residual add + RMSNorm before a layer's mixer or MLP; `gated_matvec`: the GDN output norm) and the
GDN convolution after the input projection (`norm_matvec(..., conv=...)`), so that a decode step
has no norm or conv kernels of its own.

Float32 torch references, the Triton kernels beside them, and dispatchers which take the kernels
for CUDA tensors and the references otherwise.

The kernel streams w once: one program per block of BN output columns walks K in BK steps and
multiplies its w tile with all rows of x at once (rows padded to BT = 16, the smallest tensor-core
tile). The compiled kernel is the same for every T <= BT (T is a run-time argument, never a
specialisation), each output is accumulated over K in the same order whatever the other rows
hold, so row i of a T-row call is bit-for-bit the 1-row call of row i.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtpchat.kernels._triton import (pdl, pdl_release, pdl_start, pdl_wait, prefetch_bytes, prefetch_rows, tl, triton,
                                     use_triton)
from mtpchat.kernels.conv import conv_update_ref
from mtpchat.kernels.norm import add_rmsnorm_ref, gated_rmsnorm_ref, rmsnorm_ref

MAX_ROWS = 16


def matvec_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ in float32, cast back to x's dtype."""
    return (x.float() @ w.float().T).to(x.dtype)


def matvec_swiglu_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """w = [w_gate | w_up] [2I, K] -> silu(gate) * up [T, I], each step rounded to x's dtype as the
    model does it in torch (the product, silu, the multiplication)."""
    gate, up = matvec_ref(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


# What a product may do to x on its way in (NORM) and to its output on the way out (KC): the
# norms before a layer's first products and the GDN convolution after its input projection run
# inside the product, so a decode step launches three kernels fewer per layer. Each transform
# rounds where the model's torch code rounds, and works on one row at a time, so rows stay
# independent of T.
NORM_NONE, NORM_RMS, NORM_ADD_RMS, NORM_GATED = 0, 1, 2, 3


@triton.jit
def _norm_rstd(x, r, h, T, K, s_x, s_r, s_h, eps, write_h,
               NORM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """rsqrt(mean(u²) + eps) per row [BT] of u = x, or of u = x + r rounded to x's dtype (NORM_ADD_RMS),
    which the program with write_h also stores to h: the residual stream after this add."""
    o_t = tl.arange(0, BT)
    m_t = o_t < T
    b_ss = tl.zeros([BT], dtype=tl.float32)
    for k in range(0, K, BK):
        o_k = k + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_u = tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m, other=0.).to(tl.float32)
        if NORM == 2:
            b_u += tl.load(r + o_t[:, None] * s_r + o_k[None, :], mask=m, other=0.).to(tl.float32)
            b_u = b_u.to(x.dtype.element_ty).to(tl.float32)
            if write_h:
                tl.store(h + o_t[:, None] * s_h + o_k[None, :], b_u.to(h.dtype.element_ty), mask=m)
        b_ss += tl.sum(b_u * b_u, axis=1)
    return tl.rsqrt(b_ss / K + eps)


@triton.jit
def _x_tile(x, r, nw, z, o_t, o_k, m_t, m_k, b_rstd, s_x, s_r, s_z, eps,
            NORM: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """The [BT, BK] tile of the product's input at columns o_k, transformed as NORM says."""
    m = m_t[:, None] & m_k[None, :]
    dtype = x.dtype.element_ty
    b_x = tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m, other=0.)
    if NORM == 1 or NORM == 2:
        # rmsnorm (1 + w) of x (+ r), with the row's rstd from _norm_rstd
        b_u = b_x.to(tl.float32)
        if NORM == 2:
            b_u = (b_u + tl.load(r + o_t[:, None] * s_r + o_k[None, :], mask=m, other=0.).to(tl.float32))
            b_u = b_u.to(dtype).to(tl.float32)
        b_w = 1. + tl.load(nw + o_k, mask=m_k, other=0.).to(tl.float32)
        b_x = (b_u * b_rstd[:, None] * b_w[None, :]).to(dtype)
    elif NORM == 3:
        # the GDN output norm: each head's GROUP columns normalised, times w, times silu(z)
        b_g = tl.reshape(b_x.to(tl.float32), [BT, BK // GROUP, GROUP])
        b_rs = tl.rsqrt(tl.sum(b_g * b_g, axis=2) / GROUP + eps)
        b_n = (b_g * b_rs[:, :, None]).to(dtype).to(tl.float32)
        b_w = tl.load(nw + o_k % GROUP, mask=m_k, other=0.).to(tl.float32)
        b_wn = (tl.reshape(b_w, [1, BK // GROUP, GROUP]) * b_n).to(dtype).to(tl.float32)
        b_z = tl.load(z + o_t[:, None] * s_z + o_k[None, :], mask=m, other=0.).to(tl.float32)
        b_z = tl.reshape(b_z, [BT, BK // GROUP, GROUP])
        b_x = tl.reshape((b_wn * (b_z * tl.sigmoid(b_z))).to(dtype), [BT, BK])
    return b_x


@triton.jit
def _conv_epilogue(b_y, y, buf, off, cw, o_n, T, s_y, s_buf,
                   KC: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr):
    """The GDN's causal depthwise conv + silu over the new rows of this program's channels o_n
    (kernels/conv.py's contract, for K-1 + T <= the window width): b_y [BN, BT] are the pre-conv
    products. The channels are this program's alone, so it may rewrite their window in place."""
    dtype = y.dtype.element_ty
    o_t, o_w = tl.arange(0, BT), tl.arange(0, BW)
    m_t, m_w = o_t < T, o_w < KC - 1
    p_buf = buf + o_n * s_buf
    b_win = tl.load(p_buf[:, None] + tl.load(off) + o_w[None, :], mask=m_w[None, :], other=0.)
    tl.debug_barrier()   # the committed window is read whole before it is moved
    # [window | new inputs] to the front of the buffer, as conv_update does
    tl.store(p_buf[:, None] + o_w[None, :], b_win, mask=m_w[None, :])
    tl.store(p_buf[:, None] + KC - 1 + o_t[None, :], b_y.to(buf.dtype.element_ty), mask=m_t[None, :])
    tl.debug_barrier()   # ... and written before the taps read it back
    b_c = tl.zeros(b_y.shape, dtype=tl.float32)
    for j in tl.static_range(KC):
        b_in = tl.load(p_buf[:, None] + o_t[None, :] + j, mask=m_t[None, :], other=0.).to(tl.float32)
        b_c += tl.load(cw + o_n * KC + j).to(tl.float32)[:, None] * b_in
    b_c = b_c * tl.sigmoid(b_c)
    tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_c.to(dtype), mask=m_t[None, :])


@triton.jit(do_not_specialize=["T"])
def _matvec_kernel(x, w, y, T, N, K, s_x, s_w, s_y,
                   r, h, nw, z, s_r, s_h, s_z, eps, buf, off, cw, C, s_buf,
                   BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr,
                   GROUP: tl.constexpr, KC: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    # the weights do not depend on the kernels before: start fetching them, then wait for x
    pdl_release(PDL)
    prefetch_rows(w, tl.minimum(o_n, N - 1), s_w, PF)
    pdl_wait(PDL)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < N, o_t < T
    b_rstd = tl.zeros([BT], dtype=tl.float32)
    if NORM == 1 or NORM == 2:
        b_rstd = _norm_rstd(x, r, h, T, K, s_x, s_r, s_h, eps, i_n == 0, NORM, BT, BK)
    b_y = tl.zeros([BN, BT], dtype=tl.float32)
    for k in range(0, K, BK):
        o_k = k + tl.arange(0, BK)
        m_k = o_k < K
        b_w = tl.load(w + o_n[:, None] * s_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
        b_x = _x_tile(x, r, nw, z, o_t, o_k, m_t, m_k, b_rstd, s_x, s_r, s_z, eps, NORM, GROUP, BT, BK)
        # "ieee" keeps float32 inputs exact (no tf32); bf16 inputs take the tensor cores regardless
        b_y = tl.dot(b_w, tl.trans(b_x), b_y, input_precision="ieee")
    b_y = b_y.to(y.dtype.element_ty).to(tl.float32)      # the product as the model's dtype holds it
    if KC > 0:
        if i_n * BN < C:
            _conv_epilogue(b_y, y, buf, off, cw, o_n, T, s_y, s_buf, KC, BT, BW)
        else:
            tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_y.to(y.dtype.element_ty), mask=m_n[:, None] & m_t[None, :])
    else:
        tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_y.to(y.dtype.element_ty), mask=m_n[:, None] & m_t[None, :])


@triton.jit(do_not_specialize=["T"])
def _matvec_swiglu_kernel(x, w, y, T, N, K, s_x, s_w, s_y, r, h, nw, s_r, s_h, eps,
                          BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr,
                          PDL: tl.constexpr, PF: tl.constexpr):
    # The program for output columns n reads the gate rows n and the up rows N + n of w together.
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    pdl_release(PDL)
    prefetch_rows(w, tl.minimum(o_n, N - 1), s_w, PF)
    prefetch_rows(w, tl.minimum(o_n, N - 1) + N, s_w, PF)
    pdl_wait(PDL)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < N, o_t < T
    b_rstd = tl.zeros([BT], dtype=tl.float32)
    if NORM == 1 or NORM == 2:
        b_rstd = _norm_rstd(x, r, h, T, K, s_x, s_r, s_h, eps, i_n == 0, NORM, BT, BK)
    b_g = tl.zeros([BN, BT], dtype=tl.float32)
    b_u = tl.zeros([BN, BT], dtype=tl.float32)
    for k in range(0, K, BK):
        o_k = k + tl.arange(0, BK)
        m_k = o_k < K
        m_w = m_n[:, None] & m_k[None, :]
        p_w = w + o_n[:, None] * s_w + o_k[None, :]
        b_x = tl.trans(_x_tile(x, r, nw, x, o_t, o_k, m_t, m_k, b_rstd, s_x, s_r, s_x, eps, NORM, 1, BT, BK))
        b_g = tl.dot(tl.load(p_w, mask=m_w, other=0.), b_x, b_g, input_precision="ieee")
        b_u = tl.dot(tl.load(p_w + N * s_w, mask=m_w, other=0.), b_x, b_u, input_precision="ieee")
    # torch's steps, each rounded to the model dtype: the two products, silu(gate), the multiplication
    dtype = y.dtype.element_ty
    b_g = b_g.to(dtype).to(tl.float32)
    b_s = (b_g * tl.sigmoid(b_g)).to(dtype).to(tl.float32)
    b_y = b_s * b_u.to(dtype).to(tl.float32)
    tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_y.to(dtype), mask=m_n[:, None] & m_t[None, :])


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up [T, I], each step rounded to the input's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(gu, y, N, s_gu, s_y, BN: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
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
    BN, on = 1024, pdl(gate_up)
    _silu_mul_kernel[(T, triton.cdiv(N, BN))](gate_up, y, N, gate_up.stride(0), y.stride(0), BN=BN, PDL=on,
                                               num_warps=4, launch_pdl=on)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP's gating after a batched gate|up product (prefill): one pass instead of torch's two
    over strided halves; the reference otherwise."""
    return silu_mul_triton(gate_up) if use_triton(gate_up) else silu_mul_ref(gate_up)


def _config(N: int, K: int, itemsize: int) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages): never a function of T. One tile suits every 27B decode matrix in
    bf16: on an H100 it was the fastest or within 1% of it for each (bench_kernels.py --sweep-matvec).
    float32 tiles take half the K to fit the same shared memory."""
    return 64, 512 // itemsize, 4, 4


def _check(x: torch.Tensor, w: torch.Tensor, K: int):
    T = x.shape[0]
    assert 1 <= T <= MAX_ROWS, f"matvec takes 1..{MAX_ROWS} rows, got {T}"
    assert x.shape[1] == K == w.shape[1], f"x [T, K] and w [N, K] disagree: {tuple(x.shape)}, {tuple(w.shape)}"
    assert w.stride(1) == 1 and x.stride(1) == 1, "x and w rows must be contiguous"
    assert x.dtype == w.dtype, "x and w must share a dtype"


def _norm_args(x, residual, weight, eps):
    """(mode, r, h, weight) for a product that normalises x (+ residual) on its way in; h is the
    residual stream after the add (x itself without a residual)."""
    D = x.shape[1]
    assert weight.shape == (D,) and weight.is_contiguous(), f"the norm weight must be [{D}] contiguous"
    if residual is None:
        return NORM_RMS, x, x, weight
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1, "residual must match x"
    return NORM_ADD_RMS, residual, torch.empty_like(x, memory_format=torch.contiguous_format), weight


def _matvec_launch(x, w, norm=NORM_NONE, r=None, h=None, nw=None, z=None, eps=0.0, conv=None):
    N, K = w.shape
    _check(x, w, K)
    T = x.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    BN, BK, warps, stages = _config(N, K, x.element_size())
    group = KC = C = 0
    buf = off = cw = x
    if norm == NORM_GATED:
        group = nw.shape[0]
        assert K % group == 0 and BK % group == 0, f"gated norm groups of {group} must tile K and {BK} columns"
    if conv is not None:
        buf, off, cw = conv
        C, KC = cw.shape
        assert C % BN == 0 and C <= N, f"the conv channels ({C}) must be whole blocks of {BN} outputs"
        assert buf.shape[0] == C and buf.stride(1) == 1 and KC - 1 + T <= buf.shape[1], "conv window too narrow"
        assert cw.is_contiguous() and off.numel() == 1 and off.dtype == torch.long, "conv weight [C, K], off [1]"
    r, h, nw, z = (t if t is not None else x for t in (r, h, nw, z))
    on = pdl(x)
    _matvec_kernel[(triton.cdiv(N, BN),)](
        x, w, y, T, N, K, x.stride(0), w.stride(0), y.stride(0), r, h, nw, z, r.stride(0), h.stride(0),
        z.stride(0), eps, buf, off, cw, C, buf.stride(0), BT=MAX_ROWS, BN=BN, BK=BK, NORM=norm, GROUP=group,
        KC=KC, BW=triton.next_power_of_2(max(KC - 1, 1)), PDL=on, PF=prefetch_bytes(w),
        num_warps=warps, num_stages=stages, launch_pdl=on)
    return y


def _swiglu_launch(x, w, norm=NORM_NONE, r=None, h=None, nw=None, eps=0.0):
    N2, K = w.shape
    _check(x, w, K)
    assert N2 % 2 == 0, "w must stack the gate and up rows"
    N = N2 // 2
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    BN, BK, warps, stages = _config(N, K, x.element_size())
    # two w tiles of half the rows per step; bf16 takes a deeper pipeline: 122.9 us for the 27B
    # gate|up on an H100, against 119.8 for the plain product and 124.8 with silu * up apart
    BN, stages = BN // 2, 6 if x.element_size() == 2 else stages
    r, h, nw = (t if t is not None else x for t in (r, h, nw))
    on = pdl(x)
    _matvec_swiglu_kernel[(triton.cdiv(N, BN),)](
        x, w, y, x.shape[0], N, K, x.stride(0), w.stride(0), y.stride(0), r, h, nw, r.stride(0), h.stride(0), eps,
        BT=MAX_ROWS, BN=BN, BK=BK, NORM=norm, PDL=on, PF=prefetch_bytes(w),
        num_warps=warps, num_stages=stages, launch_pdl=on)
    return y


def matvec_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _matvec_launch(x, w)


def matvec_swiglu_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _swiglu_launch(x, w)


def norm_matvec_triton(x, residual, weight, eps, w, conv=None):
    mode, r, h, nw = _norm_args(x, residual, weight, eps)
    return _matvec_launch(x, w, mode, r, h, nw, eps=eps, conv=conv), h


def norm_matvec_swiglu_triton(x, residual, weight, eps, w):
    mode, r, h, nw = _norm_args(x, residual, weight, eps)
    return _swiglu_launch(x, w, mode, r, h, nw, eps), h


def gated_matvec_triton(o, z, weight, eps, w):
    assert z.shape == o.shape and z.stride(1) == 1 and o.stride(1) == 1, "o and z must be [T, K] with contiguous rows"
    assert weight.is_contiguous() and weight.dtype == o.dtype, "the gated norm's weight must have o's dtype"
    return _matvec_launch(o, w, NORM_GATED, nw=weight, z=z, eps=eps)


# --- references (float32 products; the norms and the conv as kernels/norm.py and conv.py define them)

def norm_matvec_ref(x, residual, weight, eps, w, conv=None):
    """(rmsnorm(x + residual) @ wᵀ, x + residual); with conv = (buf, off, conv weight) the first C
    output columns also go through conv_update (its window advanced)."""
    normed, h = (rmsnorm_ref(x, weight, eps), x) if residual is None else add_rmsnorm_ref(x, residual, weight, eps)
    y = matvec_ref(normed, w)
    if conv is not None:
        buf, off, cw = conv
        y[:, :cw.shape[0]] = conv_update_ref(y[:, :cw.shape[0]], buf, off, cw)
    return y, h


def norm_matvec_swiglu_ref(x, residual, weight, eps, w):
    normed, h = (rmsnorm_ref(x, weight, eps), x) if residual is None else add_rmsnorm_ref(x, residual, weight, eps)
    return matvec_swiglu_ref(normed, w), h


def gated_matvec_ref(o, z, weight, eps, w):
    """o, z [T, K] in heads of weight's size: gated_rmsnorm per head, then @ wᵀ."""
    D = weight.shape[0]
    T, K = o.shape
    return matvec_ref(gated_rmsnorm_ref(o.view(T, K // D, D), z.reshape(T, K // D, D), weight, eps).view(T, K), w)


# --- dispatchers: the kernels for CUDA tensors, the references otherwise

def matvec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ: the Triton kernel for CUDA tensors, the float32 reference otherwise."""
    return matvec_triton(x, w) if use_triton(x, w) else matvec_ref(x, w)


def matvec_swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x @ w_gateᵀ) * (x @ w_upᵀ) for w = [w_gate | w_up]: one kernel on CUDA, the reference otherwise."""
    return matvec_swiglu_triton(x, w) if use_triton(x, w) else matvec_swiglu_ref(x, w)


def norm_matvec(x, residual, weight, eps, w, conv=None):
    """norm_matvec_ref's contract: the norm (and the conv) inside the product on CUDA."""
    if use_triton(x, w):
        return norm_matvec_triton(x, residual, weight, eps, w, conv)
    return norm_matvec_ref(x, residual, weight, eps, w, conv)


def norm_matvec_swiglu(x, residual, weight, eps, w):
    """(the MLP's gated product of rmsnorm(x + residual), x + residual): one kernel on CUDA."""
    if use_triton(x, w):
        return norm_matvec_swiglu_triton(x, residual, weight, eps, w)
    return norm_matvec_swiglu_ref(x, residual, weight, eps, w)


def gated_matvec(o, z, weight, eps, w):
    """gated_matvec_ref's contract: the GDN output norm inside the product on CUDA."""
    return gated_matvec_triton(o, z, weight, eps, w) if use_triton(o, w) else gated_matvec_ref(o, z, weight, eps, w)
