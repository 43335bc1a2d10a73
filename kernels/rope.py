"""The per-head RMSNorm (1+w) of q and k fused with partial NeoX-style RoPE, optionally writing
straight into the KV cache. The float32 torch reference, the Triton kernel beside it, and
`norm_rope`, which takes the kernel for CUDA tensors and the reference otherwise.

x [T, H, D] (rows of heads may be strided views into a fused projection); weight [D]; positions
[T] long; inv_freq [R/2] float32 with R the rotary dims. Per head: y = rmsnorm(x) cast to x's
dtype, then on its first R dims, with a = position * inv_freq_i and halves y1, y2:
    out[i] = y1[i] cos a_i - y2[i] sin a_i,  out[R/2 + i] = y2[i] cos a_i + y1[i] sin a_i
computed in float32 and cast back; dims R..D pass through. Row t goes to out[rows[t]].
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import tl, triton, use_triton
from mtpchat.kernels.norm import rmsnorm_ref


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  eps: float, out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    y = rmsnorm_ref(x, weight, eps)
    R = 2 * inv_freq.shape[0]
    ang = positions.float()[:, None] * inv_freq.float()                    # [T, R/2]
    cos, sin = ang.cos().repeat(1, 2)[:, None], ang.sin().repeat(1, 2)[:, None]
    rot = y[..., :R].float()
    rotated = torch.cat([-rot[..., R // 2:], rot[..., :R // 2]], dim=-1)
    y = torch.cat([(rot * cos + rotated * sin).to(x.dtype), y[..., R:]], dim=-1)
    if out is None:
        return y
    out.index_copy_(0, rows if rows is not None else torch.arange(x.shape[0], device=x.device), y)
    return out


@triton.jit
def _norm_rope_kernel(x, w, pos, inv_freq, out, rows, H, eps, s_xt, s_xh, s_ot, s_oh,
                      D: tl.constexpr, HALF: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    p_x = x + i_t * s_xt + i_h * s_xh
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(p_x + o_d, mask=m_d, other=0.).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    b_w = tl.load(w + o_d, mask=m_d, other=0.).to(tl.float32)
    b_y = (b_x * b_rstd * (1. + b_w)).to(x.dtype.element_ty)
    i_row = tl.load(rows + i_t)
    p_o = out + i_row * s_ot + i_h * s_oh
    tl.store(p_o + o_d, b_y, mask=m_d & (o_d >= 2 * HALF))                  # dims past the rotary ones
    # the two rotary halves, normalised the same way
    o_r = tl.arange(0, BH)
    m_r = o_r < HALF
    b_1 = tl.load(p_x + o_r, mask=m_r, other=0.).to(tl.float32)
    b_2 = tl.load(p_x + HALF + o_r, mask=m_r, other=0.).to(tl.float32)
    b_w1 = tl.load(w + o_r, mask=m_r, other=0.).to(tl.float32)
    b_w2 = tl.load(w + HALF + o_r, mask=m_r, other=0.).to(tl.float32)
    b_1 = (b_1 * b_rstd * (1. + b_w1)).to(x.dtype.element_ty).to(tl.float32)
    b_2 = (b_2 * b_rstd * (1. + b_w2)).to(x.dtype.element_ty).to(tl.float32)
    b_a = tl.load(pos + i_t).to(tl.float32) * tl.load(inv_freq + o_r, mask=m_r, other=0.)
    b_cos, b_sin = tl.cos(b_a), tl.sin(b_a)
    tl.store(p_o + o_r, (b_1 * b_cos - b_2 * b_sin).to(out.dtype.element_ty), mask=m_r)
    tl.store(p_o + HALF + o_r, (b_2 * b_cos + b_1 * b_sin).to(out.dtype.element_ty), mask=m_r)


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     eps: float, out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    T, H, D = x.shape
    half = inv_freq.shape[0]
    assert x.stride(2) == 1 and weight.shape == (D,) and weight.is_contiguous(), "x [T, H, D] rows contiguous, weight [D]"
    assert positions.shape == (T,) and positions.dtype == torch.long, "positions must be [T] long"
    assert inv_freq.dtype == torch.float32 and 2 * half <= D, "inv_freq [R/2] float32 with R <= D"
    if out is None:
        out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if rows is None:
        rows = torch.arange(T, device=x.device)
    assert out.shape[1:] == (H, D) and out.stride(2) == 1 and out.dtype == x.dtype, "out [N, H, D] like x"
    _norm_rope_kernel[(T, H)](x, weight, positions, inv_freq, out, rows, H, eps, x.stride(0), x.stride(1),
                              out.stride(0), out.stride(1), D=D, HALF=half, BD=triton.next_power_of_2(D),
                              BH=triton.next_power_of_2(half), num_warps=1 if D <= 256 else 2)
    return out


def norm_rope(x, weight, positions, inv_freq, eps, out=None, rows=None) -> torch.Tensor:
    """norm_rope_ref's contract: the Triton kernel for CUDA tensors, the reference otherwise."""
    if use_triton(x, weight):
        return norm_rope_triton(x, weight, positions, inv_freq, eps, out, rows)
    return norm_rope_ref(x, weight, positions, inv_freq, eps, out, rows)
