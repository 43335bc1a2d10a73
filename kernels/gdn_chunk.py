"""Gated DeltaNet in chunked form (prefill): a float32 torch reference, the Triton kernels beside it,
and a dispatcher that takes the kernels for CUDA tensors and the reference otherwise. The model,
its shapes and the recurrence it computes: gdn.py.
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import interpreting, tl, triton, use_triton
from mtpchat.kernels.gdn import gates, l2norm
from mtpchat.kernels.plan import default_products


def _prepare(q, k, v, a, b, A_log, dt_bias):
    """Normalise q/k, expand them to the value heads and compute the gates; all float32, heads first."""
    group = v.shape[1] // k.shape[1]
    q = l2norm(q).repeat_interleave(group, dim=1) * q.shape[-1] ** -0.5   # [T, Hv, dk]
    k = l2norm(k).repeat_interleave(group, dim=1)                          # [T, Hv, dk]
    g, beta = gates(a, b, A_log, dt_bias)                                   # [T, Hv]
    return q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1), g.T, beta.T


def chunk_ref(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor, chunk: int = 64):
    """The same recurrence over a long sequence, `chunk` tokens at a time in closed (WY) form.

    state [Hv, dk, dv] float32 is the initial state. Returns (o [T, Hv, dv] in v's dtype, final state).
    Within a chunk with cumulative log decay G_t and start state S0, the delta-rule writes w_j solve
        w_j + sum_{i<j} beta_j e^{G_j-G_i} (k_j·k_i) w_i = beta_j (v_j - e^{G_j} S0ᵀ k_j)
    (a unit lower-triangular system), then o_t = e^{G_t} S0ᵀ q_t + sum_{j<=t} e^{G_t-G_j} (q_t·k_j) w_j
    and S_end = e^{G_C} S0 + sum_j e^{G_C-G_j} k_j w_jᵀ.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias)   # [Hv, T, *]
    T = q.shape[1]
    S = state.float()
    outs = []
    for s in range(0, T, chunk):
        qc, kc, vc = q[:, s:s + chunk], k[:, s:s + chunk], v[:, s:s + chunk]
        G = g[:, s:s + chunk].cumsum(-1)                                   # [Hv, C]
        C = G.shape[1]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # e^{G_t - G_j} for j <= t, 0 above the diagonal (masked before exp: the exponent is > 0 there)
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()   # [Hv, C, C]
        kk = kc @ kc.transpose(-1, -2)                                     # [Hv, C, C]
        lower = (beta[:, s:s + chunk, None] * kk * decay).tril(-1)
        eye = torch.eye(C, device=q.device)
        rhs = beta[:, s:s + chunk, None] * (vc - G.exp()[..., None] * (kc @ S))
        w = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)  # [Hv, C, dv]
        o = G.exp()[..., None] * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * decay) @ w
        outs.append(o)
        tail = (G[:, -1:] - G).exp()                                       # e^{G_C - G_j}, [Hv, C]
        S = G[:, -1].exp()[:, None, None] * S + (kc * tail[..., None]).transpose(-1, -2) @ w
    o = torch.cat(outs, dim=1).transpose(0, 1)                             # [T, Hv, dv]
    return o.to(out_dtype), S


# Chunked prefill in three kernels, the way fla splits it.
# _chunk_prep_kernel, one program per (chunk, value head), all in parallel: G = cumsum(g), the
#   strictly lower A[r, c] = beta_r e^{G_r-G_c} (k_r·k_c), then u = (I + A)^-1 (beta v) and
#   w = (I + A)^-1 (beta e^G k) by blocked forward substitution (16-row blocks: the diagonal
#   blocks inverted row by row, the rest as small products), so that the chunk's state writes
#   are u - w S0 for any start state S0. (Building (I + A)^-1 whole from the diagonal blocks'
#   inverses and taking u and w as two 64-row products was tried: 1.07-1.10 x the time at 255
#   registers and spills on an H100, docs/PERFORMANCE.md 2026-11-26. Nor did one kernel with all
#   of it in registers, four 16-token pieces of unit keys held whole, A as its ten blocks: 328 us
#   a 2,048-token chunk of the 27B in tf32 against 153, 158 with bf16 products; 2026-11-28. Nor
#   did it split in two as fla's is, (I + A)^-1 in registers from the keys' products summed over
#   32 columns at a time, then w and u as two products: 265-278 us for the chunk with bf16
#   products against this prep's 256, fused or not, at the best of 1, 2 and 4 warps; 2026-11-28.)
# _chunk_scan_kernel, one program per (value head, block of value columns), walks the chunks in
#   order with its slice of the state in registers: it saves each chunk's start state S0 and
#   writes u - w S0, then moves the state to the chunk's end. Two products per chunk.
# _chunk_out_kernel, one program per (chunk, value head, value block), in parallel again:
#   o = (e^G q) S0 + (q kᵀ ∘ decay) (u - w S0).
# The fused form (config "fused_out"; KernelPlan.chunk_fused_out) writes the output in the scan
# instead, from the state in its registers: the prep also keeps each chunk's q kᵀ ∘ decay, and
# neither the start states S0 nor the writes u - w S0 go through memory (float32, 2.5 times the
# bytes of the output at the 27B's shapes), nor is there a third kernel.

@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """a @ b, float32: DOT "bf16" takes both operands in bf16 (as fla's products); "bf16ieee" the
    same under Triton's interpreter, whose bf16 arithmetic works on the raw bits (the operands
    rounded to bf16, then multiplied and summed in float32: the products exact, as the GPU's);
    else float32 operands at DOT's precision ("tf32", "tf32x3", "ieee")."""
    if DOT == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif DOT == "bf16ieee":
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT)


@triton.jit
def _unit_rows(p, scale):
    """float32 rows of q or k [BC, DK] l2-normalised, times scale."""
    return p * (tl.rsqrt(tl.sum(p * p, axis=1) + 1e-6) * scale)[:, None]


@triton.jit
def _rows_piece(p, o_t, m_t, s_p, o_k):
    """Token rows o_t (m_t) of a head's columns o_k, float32 [len(o_t), len(o_k)]."""
    return tl.load(p + o_t[:, None] * s_p + o_k[None, :], mask=m_t[:, None], other=0.).to(tl.float32)


@triton.jit
def _head_rows_out(ws, o_t, m_t, i_kh, b_x, HK: tl.constexpr, DK: tl.constexpr):
    """Rows b_x of key head i_kh at tokens o_t (m_t) into ws [T, HK, DK] (the unit rows the prep writes)."""
    o_k = tl.arange(0, DK)
    tl.store(ws + (o_t[:, None] * HK + i_kh) * DK + o_k[None, :], b_x.to(ws.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _unit_keys(k, ws_k, o_t, m_t, o_k, s_k, i_kh, HK: tl.constexpr, DK: tl.constexpr, NORMED: tl.constexpr):
    """float32 unit rows of key head i_kh's k at tokens o_t [BC, DK]: as the prep wrote them
    (NORMED), else normalised here."""
    if NORMED:
        return _rows_piece(ws_k + i_kh * DK, o_t, m_t, HK * DK, o_k)
    else:
        return _unit_rows(_rows_piece(k + i_kh * DK, o_t, m_t, s_k, o_k), 1.)


@triton.jit
def _unit_queries(q, ws_q, o_t, m_t, o_k, s_q, i_kh, HK: tl.constexpr, DK: tl.constexpr, scale, NORMED: tl.constexpr):
    """float32 unit rows of key head i_kh's q at tokens o_t, times scale: as the prep wrote them
    (NORMED), else normalised here."""
    if NORMED:
        return _rows_piece(ws_q + i_kh * DK, o_t, m_t, HK * DK, o_k)
    else:
        return _unit_rows(_rows_piece(q + i_kh * DK, o_t, m_t, s_q, o_k), scale)


@triton.jit
def _gates(a, b, A_log, dt_bias, o_t, m_t, s_a, s_b, i_h):
    """Value head i_h's decay logs g and write strengths beta at tokens o_t, float32; tokens past T
    (m_t false) get g = 0 and beta = 0: they neither decay nor write the state."""
    b_x = tl.load(a + o_t * s_a + i_h, mask=m_t, other=0.).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    b_softplus = tl.where(b_x > 20., b_x, tl.log(1. + tl.exp(b_x)))
    b_g = tl.where(m_t, -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * b_softplus, 0.)
    b_beta = tl.where(m_t, tl.sigmoid(tl.load(b + o_t * s_b + i_h, mask=m_t, other=0.).to(tl.float32)), 0.)
    return b_g, b_beta


@triton.jit
def _causal_scores(b_q, b_k, b_G, DOT: tl.constexpr):
    """The chunk's (q kᵀ ∘ decay)[t, j] = e^{G_t - G_j} (q_t·k_j) for j <= t, 0 above: [BC, BC]
    (the exponent masked before exp: > 0 above)."""
    o_r = tl.arange(0, b_G.shape[0])
    m_causal = o_r[:, None] >= o_r[None, :]
    b_decay = tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.))
    return tl.where(m_causal, _mm(b_q, tl.trans(b_k), DOT) * b_decay, 0.)


@triton.jit(do_not_specialize=["T"])
def _chunk_prep_kernel(q, k, v, a, b, A_log, dt_bias, ws_a, ws_w, ws_u, ws_g, ws_p, ws_q, ws_k, T, scale, s_q, s_k,
                       s_v, s_a, s_b,
                       HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BDV: tl.constexpr, BC: tl.constexpr, SB: tl.constexpr, NB: tl.constexpr,
                       DOT: tl.constexpr, FUSED: tl.constexpr, NORMED: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    o_r = tl.arange(0, BC)
    o_t = i_c * BC + o_r
    m_t = o_t < T
    o_k, o_v = tl.arange(0, DK), tl.arange(0, BDV)
    m_v = o_v < DV
    HK: tl.constexpr = HV // GROUP
    i_kh = i_h // GROUP
    b_k = _unit_keys(k, ws_k, o_t, m_t, o_k, s_k, i_kh, HK, DK, False)
    b_g, b_beta = _gates(a, b, A_log, dt_bias, o_t, m_t, s_a, s_b, i_h)
    b_G = tl.cumsum(b_g, axis=0)
    m_low = o_r[:, None] > o_r[None, :]
    b_decay = tl.exp(tl.where(m_low, b_G[:, None] - b_G[None, :], 0.))      # masked before exp: > 0 above
    b_A = tl.where(m_low, b_beta[:, None] * b_decay * _mm(b_k, tl.trans(b_k), DOT), 0.)
    o_ws = i_c * HV + i_h
    p_a, p_u, p_w = ws_a + o_ws * BC * BC, ws_u + o_ws * BC * DV, ws_w + o_ws * BC * DK
    b_v = tl.load(v + o_t[:, None] * s_v + i_h * DV + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
    tl.store(p_a + o_r[:, None] * BC + o_r[None, :], b_A)
    # the right-hand sides beta v and beta e^G k, solved below into u and w in place
    tl.store(p_u + o_r[:, None] * DV + o_v[None, :], b_v.to(tl.float32) * b_beta[:, None], mask=m_v[None, :])
    tl.store(p_w + o_r[:, None] * DK + o_k[None, :], b_k * (b_beta * tl.exp(b_G))[:, None])
    tl.store(ws_g + o_ws * BC + o_r, b_G)
    mine = NORMED and i_h % GROUP == 0          # the value head that writes its key head's unit rows
    if FUSED or mine:
        b_q = _unit_queries(q, ws_q, o_t, m_t, o_k, s_q, i_kh, HK, DK, scale, False)
        if FUSED:
            # the output's intra-chunk scores, for the scan that writes the output (_chunk_scan_kernel)
            tl.store(ws_p + o_ws * BC * BC + o_r[:, None] * BC + o_r[None, :], _causal_scores(b_q, b_k, b_G, DOT))
        if mine:
            # the key head's unit rows of k, and of q times the scale, once for the later kernels
            _head_rows_out(ws_k, o_t, m_t, i_kh, b_k, HK, DK)
            _head_rows_out(ws_q, o_t, m_t, i_kh, b_q, HK, DK)
    tl.debug_barrier()   # what was stored is read back below by other threads
    # inverses of the NB diagonal SB x SB blocks at once, by forward substitution:
    # Y[d] = (I + A_dd)^-1 - I, whose row i is -A_dd[i] - sum_{j<i} A_dd[i, j] Y[d][j]
    o_d, o_i = tl.arange(0, NB), tl.arange(0, SB)
    b_Y = tl.zeros([NB, SB, SB], tl.float32)
    for i in range(1, SB):
        b_row = -tl.load(p_a + (o_d[:, None] * SB + i) * BC + o_d[:, None] * SB + o_i[None, :])   # [NB, SB]
        b_row += tl.sum(b_row[:, :, None] * b_Y, axis=1)
        b_Y = tl.where((o_i == i)[None, :, None], b_row[:, None, :], b_Y)
    b_Xd = b_Y + tl.where(o_i[:, None] == o_i[None, :], 1., 0.)[None, :, :]
    # block forward substitution, in place: Z_i = X_ii (R_i - sum_{j<i} A_ij Z_j)
    for i in tl.static_range(NB):
        o_ri = i * SB + o_i
        b_rv = tl.load(p_u + o_ri[:, None] * DV + o_v[None, :], mask=m_v[None, :], other=0.).to(tl.float32)
        b_rk = tl.load(p_w + o_ri[:, None] * DK + o_k[None, :]).to(tl.float32)
        for j in tl.static_range(i):
            o_rj = j * SB + o_i
            b_Aij = tl.load(p_a + o_ri[:, None] * BC + o_rj[None, :])
            b_zv = tl.load(p_u + o_rj[:, None] * DV + o_v[None, :], mask=m_v[None, :], other=0.).to(tl.float32)
            b_rv -= _mm(b_Aij, b_zv, DOT)
            b_zk = tl.load(p_w + o_rj[:, None] * DK + o_k[None, :]).to(tl.float32)
            b_rk -= _mm(b_Aij, b_zk, DOT)
        b_Xii = tl.sum(tl.where((o_d == i)[:, None, None], b_Xd, 0.), axis=0)
        tl.store(p_u + o_ri[:, None] * DV + o_v[None, :], _mm(b_Xii, b_rv, DOT), mask=m_v[None, :])
        tl.store(p_w + o_ri[:, None] * DK + o_k[None, :], _mm(b_Xii, b_rk, DOT))
        tl.debug_barrier()   # block i is read by the blocks below it


@triton.jit(do_not_specialize=["T"])
def _chunk_scan_kernel(q, k, ws_w, ws_u, ws_g, ws_h, ws_v, ws_p, ws_q, ws_k, o, state, s_out, T, scale, s_q, s_k, s_o,
                       HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BV: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr, FUSED: tl.constexpr,
                       NORMED: tl.constexpr):
    i_h, i_v = tl.program_id(0), tl.program_id(1)
    o_r, o_k = tl.arange(0, BC), tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    o_s = o_k[:, None] * DV + o_v[None, :]
    b_S = tl.load(state + i_h * DK * DV + o_s, mask=m_v[None, :], other=0.)
    for i_c in range(tl.cdiv(T, BC)):
        o_ws = i_c * HV + i_h
        if not FUSED:
            tl.store(ws_h + o_ws * DK * DV + o_s, b_S, mask=m_v[None, :])  # the state the chunk starts from
        o_t = i_c * BC + o_r
        m_t = o_t < T
        b_k = _unit_keys(k, ws_k, o_t, m_t, o_k, s_k, i_h // GROUP, HV // GROUP, DK, NORMED)
        b_G = tl.load(ws_g + o_ws * BC + o_r)
        b_last = tl.load(ws_g + o_ws * BC + BC - 1)                  # G at the chunk's end (padding adds 0)
        b_w = tl.load(ws_w + (o_ws * BC + o_r[:, None]) * DK + o_k[None, :]).to(tl.float32)
        b_u = tl.load(ws_u + (o_ws * BC + o_r[:, None]) * DV + o_v[None, :], mask=m_v[None, :], other=0.)
        b_u = b_u.to(tl.float32)
        b_new = b_u - _mm(b_w, b_S, DOT)                                     # the chunk's writes
        if FUSED:
            # the chunk's output from the state it starts from, here rather than in _chunk_out_kernel
            b_q = _unit_queries(q, ws_q, o_t, m_t, o_k, s_q, i_h // GROUP, HV // GROUP, DK, scale, NORMED)
            b_p = tl.load(ws_p + o_ws * BC * BC + o_r[:, None] * BC + o_r[None, :]).to(tl.float32)
            b_o = _mm(b_q * tl.exp(b_G)[:, None], b_S, DOT) + _mm(b_p, b_new, DOT)
            tl.store(o + o_t[:, None] * s_o + i_h * DV + o_v[None, :], b_o.to(o.dtype.element_ty),
                     mask=m_t[:, None] & m_v[None, :])
        else:
            tl.store(ws_v + (o_ws * BC + o_r[:, None]) * DV + o_v[None, :], b_new, mask=m_v[None, :])
        b_k_tail = b_k * tl.exp(b_last - b_G)[:, None]                       # e^{G_C - G_j} k_j
        b_S = b_S * tl.exp(b_last) + _mm(tl.trans(b_k_tail), b_new, DOT)
    tl.store(s_out + i_h * DK * DV + o_s, b_S, mask=m_v[None, :])


@triton.jit(do_not_specialize=["T"])
def _chunk_out_kernel(q, k, ws_g, ws_h, ws_v, ws_q, ws_k, o, T, scale, s_q, s_k, s_o,
                      HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BV: tl.constexpr, BC: tl.constexpr, DOT: tl.constexpr, NORMED: tl.constexpr):
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // GROUP
    o_r, o_k = tl.arange(0, BC), tl.arange(0, DK)
    o_t = i_c * BC + o_r
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    b_q = _unit_queries(q, ws_q, o_t, m_t, o_k, s_q, i_kh, HV // GROUP, DK, scale, NORMED)
    b_k = _unit_keys(k, ws_k, o_t, m_t, o_k, s_k, i_kh, HV // GROUP, DK, NORMED)
    o_ws = i_c * HV + i_h
    b_G = tl.load(ws_g + o_ws * BC + o_r)
    b_S = tl.load(ws_h + o_ws * DK * DV + o_k[:, None] * DV + o_v[None, :], mask=m_v[None, :], other=0.)
    b_S = b_S.to(tl.float32)
    b_new = tl.load(ws_v + (o_ws * BC + o_r[:, None]) * DV + o_v[None, :], mask=m_v[None, :], other=0.)
    b_new = b_new.to(tl.float32)
    b_qk = _causal_scores(b_q, b_k, b_G, DOT)
    b_o = _mm(b_q * tl.exp(b_G)[:, None], b_S, DOT) + _mm(b_qk, b_new, DOT)
    tl.store(o + o_t[:, None] * s_o + i_h * DV + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])


# The kernels' own defaults: float32 between them and tf32 products (fla's bf16 ones with three
# more mantissa bits; "tf32x3" gives float32 accuracy at 2.6 times the time), what a float32
# model takes. The engine's plan asks for the bf16 forms (engine/plan.py chunk_*; gdn_chunk.chunk).
# On an H100, 27B shapes, 8192 tokens, these defaults: 1.76 ms per layer (prep 0.68, scan 0.57,
# output 0.51); tests/bench/bench_kernels.py --sweep --only chunk.
CHUNK_CONFIG = dict(prep_warps=4, scan_bv=64, scan_warps=8, scan_stages=2, out_bv=64, out_warps=4, dot="tf32",
                    state_dot=None, normed=False, fused_out=False, solved="float32", terms="float32")
# The scan's and the output kernel's tiles where their products take bf16 operands: the state in
# slices of 32 value columns on 4 warps (192 programs for the 27B's 48 heads, where 64 columns on
# 8 warps made 96), the output 128 columns a program. One 2,048-token chunk of the 27B on an H100,
# with w, u and the terms in bf16 and the unit rows from the prep (probe_prefill_kernels.py,
# 2026-11-28): the scan 97.8 -> 83.0 us, the output 64.7 -> 54.1 us.
BF16_TILES = dict(scan_bv=32, scan_warps=4, out_bv=128)


# Shared memory a block may take on an H100 (227 KB), which the float32 forms' tiles need; an A100
# gives 163 KB, the others (RTX 30 and 40, A10, L4: sm_86 and sm_89; RTX 50) 99 KB. Compiled with
# Triton 3.6 and 3.9 (tests/kernels/test_gdn_chunk_compile.py), its strides 16-divisible as a launch
# has them: a float32 model's tf32x3 kernels take 131-197 KB at any tile, so a float32 model below
# ROOMY runs the torch reference (chunk()); the tf32 forms' scan on CHUNK_CONFIG's 64 value columns
# took 180 KB (A100 included), so below ROOMY they take SMALL_TILES (the scan on 32 columns, not
# pipelined: 41-74 KB on sm_86; the output on 32); the bf16 forms at their tiles take 33-82 KB. A
# float32 model's scan takes WIDE_TILES.
ROOMY = 200 * 1024
SMALL_TILES = dict(scan_bv=32, scan_warps=4, scan_stages=1, out_bv=32)
WIDE_TILES = dict(scan_bv=32, scan_warps=4, out_bv=32)


def roomy(device: torch.device) -> bool:
    """Whether a block of the chunk kernels may take ROOMY bytes of shared memory on `device` (the
    CPU under Triton's interpreter: yes)."""
    return device.type != "cuda" or interpreting() or default_products(device).shared_memory >= ROOMY


def chunk_config(config: dict | None, wide: bool, room: bool = True) -> dict:
    """The kernels' configuration chunk_triton launches (its docstring) for `config`, a float32
    model's (`wide`: float32 between the kernels and tf32x3 products whatever `config` asks) or
    not, on a device with ROOMY shared memory a block or less (`room`: the tf32 forms' tiles shrink
    to SMALL_TILES where `config` names none; a float32 model's take WIDE_TILES)."""
    config = config or {}
    low = config.get("state_dot") == "bf16" and not wide
    tiles = BF16_TILES if low else WIDE_TILES if wide else {} if room else SMALL_TILES
    return {**CHUNK_CONFIG, **({"dot": "tf32x3"} if wide else {}), **tiles, **config,
            **({"solved": "float32", "terms": "float32", "dot": "tf32x3", "state_dot": "tf32x3"} if wide else {})}


def chunk_triton(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor, chunk: int = 64, config: dict | None = None,
                 out: torch.Tensor | None = None):
    """chunk_ref's contract (chunk 64), with q, k, v, a, b as row-strided views like recurrent_triton's.
    The final state goes into `out` when given (the start state itself may be it: each program of
    the scan reads its slice of the start state before it writes that slice of the end state).
    `config` overrides entries of CHUNK_CONFIG: "fused_out" the fused form (the output written by
    the scan); "solved" and "terms" the dtype of what the kernels hand each other ("float32" or
    "bfloat16", as fla keeps them; float32 for float32 inputs): w and u, from which the scan
    builds the state, and the output's terms (start states and writes, or the scores), which the
    state never sees; "state_dot" the precision of the scan's and the output kernel's products
    (None: the prep's "dot"; "bf16": operands rounded to bf16, as fla's), "normed" the unit rows
    of q and k written once by the prep (k in the "solved" dtype, q in the "terms" one) rather
    than normalised again by the scan and the output kernel; "dot" the precision of the prep's
    products ("tf32", "bf16", "tf32x3"); the rest tiles, for tuning (bf16 products take
    BF16_TILES where `config` names none; on a device without ROOMY shared memory a block the tf32
    forms take SMALL_TILES).
    A float32 model (float32 v) keeps float32 between the kernels and tf32x3 products whatever
    `config` asks (chunk_config)."""
    T, Hk, DK = q.shape
    Hv, DV = v.shape[1], v.shape[2]
    assert chunk == 64, "the chunk kernels work on 64 tokens at a time"
    assert k.shape == q.shape and v.shape[0] == T and Hv % Hk == 0, "q, k [T, Hk, dk], v [T, Hv, dv]"
    assert DK & (DK - 1) == 0 and DK >= 16, "dk must be a power of two >= 16"
    for t, hs in ((q, DK), (k, DK), (v, DV)):
        assert t.stride(2) == 1 and t.stride(1) == hs, "each token's heads must be contiguous"
    assert a.shape == b.shape == (T, Hv) and a.stride(1) == 1 and b.stride(1) == 1, "a, b must be [T, Hv]"
    assert state.dtype == torch.float32 and state.is_contiguous() and state.shape == (Hv, DK, DV), \
        "state must be contiguous float32 [Hv, dk, dv]"
    cfg = chunk_config(config, v.dtype == torch.float32, roomy(q.device))
    # Triton's interpreter takes bf16 products as float32 ones over operands rounded to bf16 (_mm)
    dot, state_dot = ("bf16ieee" if d == "bf16" and interpreting() else d
                      for d in (cfg["dot"], cfg["state_dot"] or cfg["dot"]))
    NT, dev, G = triton.cdiv(T, chunk), q.device, Hv // Hk
    # what passes between the kernels: w and u (the prep's solve, which the scan builds the state
    # from) in cfg["solved"], the start states, writes and scores (the output's terms) in cfg["terms"]
    new = lambda dtype, *shape: torch.empty(*shape, dtype=getattr(torch, dtype), device=dev)
    solved, terms = cfg["solved"], cfg["terms"]
    fused = bool(cfg["fused_out"])
    ws_g = new("float32", NT, Hv, chunk)
    unused = ws_g                     # for a kernel's pointer this form does not read
    ws_a = new("float32", NT, Hv, chunk, chunk)
    ws_w, ws_u = new(solved, NT, Hv, chunk, DK), new(solved, NT, Hv, chunk, DV)
    if fused:      # the chunks' scores for the scan; no start states or writes kept
        ws_p, ws_h, ws_v = new(terms, NT, Hv, chunk, chunk), unused, unused
    else:
        ws_p, ws_h, ws_v = unused, new(terms, NT, Hv, DK, DV), new(terms, NT, Hv, chunk, DV)
    normed = bool(cfg["normed"])
    ws_q, ws_k = (new(terms, T, Hk, DK), new(solved, T, Hk, DK)) if normed else (unused, unused)
    if out is not None:
        assert out.shape == state.shape and out.dtype == torch.float32 and out.is_contiguous(), "out must be like state"
    s_out = out if out is not None else torch.empty_like(state)
    o = torch.empty(T, Hv, DV, dtype=v.dtype, device=dev)
    scale = DK ** -0.5
    _chunk_prep_kernel[(NT, Hv)](q, k, v, a, b, A_log, dt_bias, ws_a, ws_w, ws_u, ws_g, ws_p, ws_q, ws_k, T,
                                 scale, q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), HV=Hv,
                                 GROUP=G, DK=DK, DV=DV, BDV=triton.next_power_of_2(DV), BC=chunk, SB=16,
                                 NB=chunk // 16, DOT=dot, FUSED=fused, NORMED=normed, num_warps=cfg["prep_warps"])
    BV = min(cfg["scan_bv"], triton.next_power_of_2(DV))
    _chunk_scan_kernel[(Hv, triton.cdiv(DV, BV))](q, k, ws_w, ws_u, ws_g, ws_h, ws_v, ws_p, ws_q, ws_k, o, state,
                                                   s_out, T, scale, q.stride(0), k.stride(0), o.stride(0), HV=Hv,
                                                   GROUP=G, DK=DK, DV=DV, BV=BV, BC=chunk, DOT=state_dot,
                                                   FUSED=fused, NORMED=normed, num_warps=cfg["scan_warps"],
                                                   num_stages=cfg["scan_stages"])
    if fused:
        return o, s_out
    BV = min(cfg["out_bv"], triton.next_power_of_2(DV))
    _chunk_out_kernel[(NT, Hv, triton.cdiv(DV, BV))](q, k, ws_g, ws_h, ws_v, ws_q, ws_k, o, T, scale, q.stride(0),
                                                      k.stride(0), o.stride(0), HV=Hv, GROUP=G, DK=DK, DV=DV,
                                                      BV=BV, BC=chunk, DOT=state_dot, NORMED=normed,
                                                      num_warps=cfg["out_warps"])
    return o, s_out


def plan_config(fused_out: bool, solved: str, terms: str, products: str, normed: bool, prep_products: str) -> dict:
    """chunk_triton's `config` for the plan's forms (chunk's arguments, KernelPlan.chunk_*)."""
    return {"fused_out": fused_out, "solved": solved, "terms": terms, "normed": normed, "state_dot": products,
            "dot": prep_products}


def chunk(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor, chunk: int = 64, fused_out: bool = False,
          out: torch.Tensor | None = None, solved: str = "float32", terms: str = "float32", products: str = "tf32",
          normed: bool = False, prep_products: str = "tf32"):
    """chunk_ref's contract; the Triton kernels for CUDA tensors (the fused form with `fused_out`,
    what they hand each other in the dtypes `solved` and `terms`, the scan's and the output's
    products on `products` ("tf32" or "bf16") operands, the unit rows of q and k written once by
    the prep where `normed`, the prep's products (A, its solve, w and u, the scores) on
    `prep_products` operands:
    chunk_triton; a float32 model only where the device is roomy), the final state into `out`
    where given: the reference returns a new tensor, which the caller copies where it wants it,
    and starts from a copy of the start state then, which a training forward's gradients may
    still need."""
    for name, form in (("products", products), ("prep_products", prep_products)):
        assert form in ("tf32", "bf16"), f"the chunk's {name} take tf32 or bf16, not {form!r}"
    # a float32 model's kernels need ROOMY shared memory a block; elsewhere it takes the reference
    if use_triton(q, k, v, a, b) and (v.dtype != torch.float32 or roomy(q.device)):
        return chunk_triton(q, k, v, a, b, A_log, dt_bias, state, chunk,
                            plan_config(fused_out, solved, terms, products, normed, prep_products), out)
    return chunk_ref(q, k, v, a, b, A_log, dt_bias, state if out is None else state.clone(), chunk)
