"""What an attention layer does between its q|k|v projection and attention, in one kernel: the
per-head RMSNorm (1+w) of q and k with partial NeoX-style RoPE, k written straight into the KV
cache, v copied beside it. The float32 torch references, the Triton kernel, and `qkv_norm_rope`,
which takes the kernel for CUDA tensors and the reference otherwise.

q [T, Hq, D], k and v [T, Hkv, D] (rows of heads may be strided views into the fused projection);
weights [D]; positions [T] long (also the cache rows), or [1] long: the first of T consecutive
positions (a step's, with no kernel to spell them out); inv_freq [R/2] float32 with R the rotary
dims. Per head: y = rmsnorm(x) cast to x's dtype, then on its first R dims, with
a = position * inv_freq_i and halves y1, y2:
    out[i] = y1[i] cos a_i - y2[i] sin a_i,  out[R/2 + i] = y2[i] cos a_i + y1[i] sin a_i
computed in float32 and cast back; dims R..D pass through.
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import pdl, pdl_start, tl, triton, use_triton
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


def qkv_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """An attention layer's q/k/v after its projection: q normalised and rotated (returned, [T, Hq, D]
    contiguous), k normalised and rotated into k_cache rows `positions`, v copied to v_cache rows."""
    positions = _spelled_out(positions, q.shape[0])
    out = norm_rope_ref(q, q_weight, positions, inv_freq, eps)
    norm_rope_ref(k, k_weight, positions, inv_freq, eps, out=k_cache, rows=positions)
    v_cache.index_copy_(0, positions, v)
    return out


@triton.jit
def _norm_rope_rows(p_x, w, p_o, m_r, b_pos, inv_freq, eps,
                    D: tl.constexpr, HALF: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr):
    """One head of rows whose starts are p_x [BR] (those of m_r): rmsnorm (1+w) over D, RoPE on the
    first 2 * HALF dims at positions b_pos [BR], stored from p_o [BR]."""
    o_d = tl.arange(0, BD)
    m_d = m_r[:, None] & (o_d < D)[None, :]
    b_x = tl.load(p_x[:, None] + o_d[None, :], mask=m_d, other=0.).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)[:, None]
    b_w = tl.load(w + o_d, mask=o_d < D, other=0.).to(tl.float32)[None, :]
    b_y = (b_x * b_rstd * (1. + b_w)).to(p_o.dtype.element_ty)
    tl.store(p_o[:, None] + o_d[None, :], b_y, mask=m_d & (o_d >= 2 * HALF)[None, :])   # dims past the rotary ones
    # the two rotary halves, normalised the same way
    o_h = tl.arange(0, BH)
    m_h = m_r[:, None] & (o_h < HALF)[None, :]
    b_1 = tl.load(p_x[:, None] + o_h[None, :], mask=m_h, other=0.).to(tl.float32)
    b_2 = tl.load(p_x[:, None] + HALF + o_h[None, :], mask=m_h, other=0.).to(tl.float32)
    b_w1 = tl.load(w + o_h, mask=o_h < HALF, other=0.).to(tl.float32)[None, :]
    b_w2 = tl.load(w + HALF + o_h, mask=o_h < HALF, other=0.).to(tl.float32)[None, :]
    b_1 = (b_1 * b_rstd * (1. + b_w1)).to(p_o.dtype.element_ty).to(tl.float32)
    b_2 = (b_2 * b_rstd * (1. + b_w2)).to(p_o.dtype.element_ty).to(tl.float32)
    b_a = b_pos.to(tl.float32)[:, None] * tl.load(inv_freq + o_h, mask=o_h < HALF, other=0.)[None, :]
    b_cos, b_sin = tl.cos(b_a), tl.sin(b_a)
    tl.store(p_o[:, None] + o_h[None, :], (b_1 * b_cos - b_2 * b_sin).to(p_o.dtype.element_ty), mask=m_h)
    tl.store(p_o[:, None] + HALF + o_h[None, :], (b_2 * b_cos + b_1 * b_sin).to(p_o.dtype.element_ty), mask=m_h)


def _spelled_out(positions: torch.Tensor, T: int) -> torch.Tensor:
    """[T] positions from positions [T] or [1] (the first of T consecutive ones)."""
    if positions.numel() == 1 and T > 1:
        return positions + torch.arange(T, device=positions.device)
    return positions


@triton.jit
def _qkv_norm_rope_kernel(q, k, v, q_w, k_w, pos, inv_freq, q_out, k_cache, v_cache, eps, T, s_pos, inc,
                          s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_kc, s_kch, s_vc, s_vch,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                          BD: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
    # One program per (BT tokens, head) over the q heads, then the k heads, then the v heads.
    pdl_start(PDL)
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_pos = tl.load(pos + o_t * s_pos, mask=m_t, other=0) + o_t * inc      # inc 1: consecutive from pos[0]
    if i_h < HQ:
        _norm_rope_rows(q + o_t * s_qt + i_h * s_qh, q_w, q_out + o_t * s_ot + i_h * s_oh, m_t, b_pos, inv_freq,
                        eps, D, HALF, BD, BH)
    elif i_h < HQ + HKV:
        _norm_rope_rows(k + o_t * s_kt + (i_h - HQ) * s_kh, k_w, k_cache + b_pos * s_kc + (i_h - HQ) * s_kch, m_t,
                        b_pos, inv_freq, eps, D, HALF, BD, BH)
    else:
        o_d = tl.arange(0, BD)
        m_d = m_t[:, None] & (o_d < D)[None, :]
        i_v = i_h - HQ - HKV
        b_v = tl.load((v + o_t * s_vt + i_v * s_vh)[:, None] + o_d[None, :], mask=m_d)
        tl.store((v_cache + b_pos * s_vc + i_v * s_vch)[:, None] + o_d[None, :], b_v, mask=m_d)


def qkv_norm_rope_triton(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache,
                         rows: int = 1) -> torch.Tensor:
    """qkv_norm_rope_ref's contract, `rows` tokens a program (of one head): 1 in a step, more in a
    prefill (KernelPlan.prefill_rows). For a given `rows`, a token's values do not depend on how
    many tokens the call holds."""
    T, Hq, D = q.shape
    Hkv, half = k.shape[1], inv_freq.shape[0]
    assert k.shape == v.shape == (T, Hkv, D), f"k, v must be [{T}, Hkv, {D}]"
    assert k_cache.shape[1:] == v_cache.shape[1:] == (Hkv, D), "caches must be [L, Hkv, D]"
    for t in (q, k, v, k_cache, v_cache):
        assert t.stride(2) == 1 and t.dtype == q.dtype, "head dims contiguous, one dtype throughout"
    for w in (q_weight, k_weight):
        assert w.shape == (D,) and w.is_contiguous(), f"norm weights must be [{D}] contiguous"
    assert positions.shape in ((T,), (1,)) and positions.dtype == torch.long, "positions must be [T] or [1] long"
    assert rows >= 1 and rows & (rows - 1) == 0, f"tokens a program must be a power of two, got {rows}"
    consecutive = positions.numel() == 1
    assert inv_freq.dtype == torch.float32 and 2 * half <= D, "inv_freq [R/2] float32 with R <= D"
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    BD = triton.next_power_of_2(D)
    _qkv_norm_rope_kernel[(triton.cdiv(T, rows), Hq + 2 * Hkv)](
        q, k, v, q_weight, k_weight, positions, inv_freq, out, k_cache, v_cache, eps, T,
        0 if consecutive else positions.stride(0), 1 if consecutive else 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HQ=Hq, HKV=Hkv, D=D, HALF=half, BD=BD, BH=triton.next_power_of_2(half), BT=rows,
        num_warps=(1 if D <= 256 else 2) if rows == 1 else min(8, max(1, rows * BD // 1024)), **pdl(q))
    return out


def qkv_norm_rope(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache, rows: int = 1) -> torch.Tensor:
    """qkv_norm_rope_ref's contract: one Triton kernel for CUDA tensors (`rows` tokens a program),
    the reference otherwise."""
    if use_triton(q, k, v, q_weight):
        return qkv_norm_rope_triton(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache, rows)
    return qkv_norm_rope_ref(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache)
