"""Gated DeltaNet's recurrence (decode / verify, the accepted tokens of a step folded into the
state at the next); the chunked form (prefill) is in gdn_chunk.py. Float32 torch references, the
Triton kernel beside them, and dispatchers that take the kernel for CUDA tensors and the
reference otherwise.

Shapes (one sequence): q, k [T, Hk, dk]; v [T, Hv, dv]; a, b [T, Hv]; A_log, dt_bias [Hv];
states [Hv, dk, dv] float32 (the dk x dv layout of transformers and fla). V head j reads Q/K head
j // (Hv // Hk). Per token, with g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b):
    S = exp(g) * S ;  S = S + k ⊗ beta * (v - Sᵀk) ;  o = Sᵀ q        (q, k l2-normalised, q * dk^-0.5)

A step may also hand the kernel q, k and v before the causal conv (`conv_recurrent`): each program
then first computes the conv and silu of the channels it reads, for the step's tokens, as
kernels/conv.py's kernel does (the same sums, the same rounding), writes them into the rows it then
reads as the plain kernel reads them, and writes the step's inputs into the conv's window: one
kernel a GDN layer fewer in every step, and the same loop, so the same bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtpchat.kernels import conv
from mtpchat.kernels._triton import pdl, pdl_start, tl, triton, use_triton


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """[T, Hv] a, b -> (g, beta) float32; g <= 0 is the log decay, beta in (0, 1) the write strength."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def pending_width(dk: int, dv: int) -> int:
    """Floats kept per value head for each token of a step: its raw k, v, a and b."""
    return dk + dv + 2


def _delta_rule(S, k, v, decay, beta):
    """One token into states S [Hv, dk, dv] with k [Hv, dk], v [Hv, dv], decay and beta [Hv]."""
    S = S * decay[:, None, None]
    pred = torch.einsum("hkv,hk->hv", S, k)                       # what the state recalls for k
    return S + k[:, :, None] * (beta[:, None] * (v - pred))[:, None, :]


def _raw_rows(k, v, a, b, Hv):
    """A step's inputs [T, ...] -> the rows it keeps [T, Hv, dk + dv + 2] float32 (k per value head)."""
    kr = k.float().repeat_interleave(Hv // k.shape[1], dim=1)
    return torch.cat([kr, v.float(), a.float()[..., None], b.float()[..., None]], dim=-1)


def _run_row(S, row, A_log, dt_bias):
    """One kept row [Hv, dk + dv + 2] into S: the same code for a token run now or folded in later."""
    dk = S.shape[1]
    kr, vr, ar, br = row.split([dk, S.shape[2], 1, 1], dim=-1)
    g, beta = gates(ar[:, 0], br[:, 0], A_log, dt_bias)
    return _delta_rule(S, l2norm(kr), vr, g.exp(), beta)


def _fold(state, pend, fold, parity, A_log, dt_bias):
    """The state with the first `fold` rows of pend[parity] run in (a new tensor; no host sync)."""
    rows = pend.index_select(0, parity)[0]                         # [R, Hv, dk + dv + 2]
    S = state
    for j in range(rows.shape[0]):
        S = torch.where(j < fold, _run_row(S, rows[j], A_log, dt_bias), S)
    return S


def recurrent_ref(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor, pend: torch.Tensor,
                  fold: torch.Tensor, parity: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
    """T = 1..R tokens through the recurrence, the last step's accepted tokens folded in first.

    state [Hv, dk, dv] float32: the state before the last step's tokens. pend [2, R, Hv, dk+dv+2]
    float32: each token of a step as it came in (k of the value head's key head, v, a, b), the
    last step's in half `parity`; `fold` of them were accepted. This call runs those into the
    state and writes it back (when fold > 0), runs its own T tokens from there, and keeps them in
    half 1 - parity: a verify writes one state, whatever T, and accepting n tokens commits them as
    (fold n, parity flipped) with no copy. A one-token step (a decode, always accepted) writes the
    state after its token instead and keeps nothing: it commits as fold 0. A token folded in later
    goes through the same code as when its step ran it, so the state has the same bits whatever
    steps built it. fold, parity: 1-element long tensors. `live` (optional 1-element long tensor): when 0, nothing is written (a
    step launched after its generation ended must not touch the state). Returns o [T, Hv, dv] in
    v's dtype.
    """
    T, R, Hv = q.shape[0], pend.shape[1], v.shape[1]
    assert state.dtype == pend.dtype == torch.float32 and T <= R, "float32 state and pend with >= T rows"
    on = torch.ones_like(fold, dtype=torch.bool) if live is None else live > 0
    S = _fold(state, pend, fold, parity, A_log, dt_bias)
    if T > 1:
        state.copy_(torch.where((fold > 0) & on, S, state))
    new = _raw_rows(k, v, a, b, Hv)                                 # [T, Hv, dk + dv + 2]
    qn = l2norm(q).repeat_interleave(Hv // q.shape[1], dim=1) * q.shape[-1] ** -0.5
    out = []
    for t in range(T):
        S = _run_row(S, new[t], A_log, dt_bias)
        out.append(torch.einsum("hkv,hk->hv", S, qn[t]))
    if T == 1:
        # a one-token step (a decode) always commits its token: the state takes it at once
        state.copy_(torch.where(on, S, state))
    else:
        kept = pend.index_select(0, 1 - parity)[0]
        pend.index_copy_(0, 1 - parity, torch.where(on, torch.cat([new, kept[T:]]), kept)[None])
    return torch.stack(out).to(v.dtype if v.dtype != torch.float32 else torch.float32)


def fold_pending_ref(state: torch.Tensor, pend: torch.Tensor, fold: torch.Tensor, parity: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Run the last step's `fold` accepted tokens into state in place (before a prefill)."""
    state.copy_(_fold(state, pend, fold, parity, A_log, dt_bias))


def conv_recurrent_ref(x, buf, off, weight, a, b, A_log, dt_bias, state: torch.Tensor, pend: torch.Tensor,
                       fold: torch.Tensor, parity: torch.Tensor, live: torch.Tensor | None = None,
                       key_heads: int = 1) -> torch.Tensor:
    """The causal conv of a step's inputs x [T, 2 Hk dk + Hv dv] (q | k | v before the conv; buf, off
    and weight as kernels/conv.py takes them, `key_heads` = Hk), then the recurrence of its output
    (recurrent_ref's contract for the rest). Returns o [T, Hv, dv]."""
    T, (Hv, dk, dv) = x.shape[0], state.shape
    y = conv.conv_update_ref(x, buf, off, weight, live)
    q, k, v = y.split([key_heads * dk, key_heads * dk, Hv * dv], dim=-1)
    return recurrent_ref(q.view(T, key_heads, dk), k.view(T, key_heads, dk), v.view(T, Hv, dv), a, b, A_log,
                         dt_bias, state, pend, fold, parity, live)


@triton.jit
def _conv_rows(x, buf, cw, y, o_c, m_c, own, T, s_x, s_y, s_buf, i_off, WIDTH, KC: tl.constexpr,
               TP: tl.constexpr, N: tl.constexpr):
    """silu(causal conv) of the N channels o_c for a step's T (<= TP) tokens into y's rows, each
    value as conv.py's kernel computes it (window column or input, times the tap, tap by tap; the
    same rounding), four tokens at a time (eight spill registers at the 27B's shapes); where `own`,
    the step's inputs of these channels into the window's ring, at columns no token of the step
    reads (a step holds at most WIDTH - (KC-1) tokens)."""
    TB: tl.constexpr = 4 if TP > 4 else TP
    for t0 in tl.static_range(0, TP, TB):
        o_t = t0 + tl.arange(0, TB)
        b_y = tl.zeros([TB, N], dtype=tl.float32)
        for j in tl.static_range(KC):
            o_src = o_t + j - (KC - 1)
            m_x = (o_src >= 0)[:, None] & (o_src < T)[:, None] & m_c[None, :]
            b_in = tl.load(x + o_src[:, None] * s_x + o_c[None, :], mask=m_x, other=0.).to(buf.dtype.element_ty)
            b_x = b_in.to(tl.float32)
            m_w = (o_src < 0)[:, None] & m_c[None, :]
            b_x += tl.load(buf + o_c[None, :] * s_buf + (i_off + KC - 1 + o_src)[:, None] % WIDTH, mask=m_w,
                           other=0.).to(tl.float32)
            b_y += tl.load(cw + o_c * KC + j, mask=m_c, other=0.).to(tl.float32)[None, :] * b_x
        b_y = b_y * tl.sigmoid(b_y)
        m_y = (o_t < T)[:, None] & m_c[None, :]
        tl.store(y + o_t[:, None] * s_y + o_c[None, :], b_y.to(y.dtype.element_ty), mask=m_y)
        # b_in is the last tap's: the tokens' own inputs
        tl.store(buf + o_c[None, :] * s_buf + ((i_off + KC - 1 + o_t) % WIDTH)[:, None], b_in,
                 mask=m_y & ((tl.zeros([TB, N], dtype=tl.int64) + own) > 0))


@triton.jit
def _run_layer(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, live, o, T, scale, s_q, s_k, s_v, s_a, s_b,
               s_o, s_pp, s_pt, i_h, i_v, i_kh, o_k, o_v, m_v, m_s, o_s, o_g, DK: tl.constexpr, DV: tl.constexpr,
               BV: tl.constexpr, HAS_LIVE: tl.constexpr):
    # one layer's program: its slice of the state through the fold and the step's T tokens (the
    # kernel's comment below)
    b_S = tl.load(state + o_s, mask=m_s, other=0.)
    # what this program may write, as integers (scalar booleans do not make masks everywhere)
    b_live = tl.full([], 1, tl.int64)
    if HAS_LIVE:
        b_live = tl.minimum(tl.maximum(tl.load(live), 0), 1)
    b_head = b_live * (1 - tl.minimum(i_v, 1))                           # k, a, b: program 0 only
    b_par, b_fold = tl.load(parity), tl.load(fold)
    W: tl.constexpr = DK + DV + 2
    p_in = pend + b_par * s_pp + i_h * W
    p_out = pend + (1 - b_par) * s_pp + i_h * W
    b_A = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_dt = tl.load(dt_bias + i_h).to(tl.float32)
    for j in range(b_fold + T):
        t = j - b_fold                                                   # < 0: a token folded in
        if j < b_fold:
            b_k = tl.load(p_in + j * s_pt + o_k)
            b_v = tl.load(p_in + j * s_pt + DK + o_v, mask=m_v, other=0.)
            b_ab = tl.load(p_in + j * s_pt + DK + DV + o_g)
            b_q = b_k                                                    # its output is not kept
        else:
            b_k = tl.load(k + t * s_k + i_kh * DK + o_k).to(tl.float32)
            b_v = tl.load(v + t * s_v + i_h * DV + o_v, mask=m_v, other=0.).to(tl.float32)
            b_ab = tl.where(o_g == 0, tl.load(a + t * s_a + i_h), tl.load(b + t * s_b + i_h)).to(tl.float32)
            b_q = tl.load(q + t * s_q + i_kh * DK + o_k).to(tl.float32)
        b_x = tl.sum(tl.where(o_g == 0, b_ab, 0.)) + b_dt
        b_softplus = tl.where(b_x > 20., b_x, tl.log(1. + tl.exp(b_x)))      # torch's threshold 20
        b_beta = tl.sigmoid(tl.sum(tl.where(o_g == 1, b_ab, 0.)))
        b_kn = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_S = b_S * tl.exp(-b_A * b_softplus)
        b_delta = b_beta * (b_v - tl.sum(b_S * b_kn[:, None], axis=0))      # [BV]
        b_S = b_S + b_kn[:, None] * b_delta[None, :]
        # the state is written once: when the fold is done, or, in a one-token step (a decode,
        # whose token is always committed), after its token, which is then not kept
        b_last = tl.where(j == tl.where(T == 1, b_fold, b_fold - 1), 1, 0)
        tl.store(state + o_s, b_S, mask=m_s & ((tl.zeros([BV], dtype=tl.int64) + b_live * b_last) > 0)[None, :])
        b_new = tl.where(t >= 0, 1, 0)                                   # one of this step's tokens
        b_keep = b_new * tl.where(T == 1, 0, 1)
        b_o = tl.sum(b_S * (b_q * (tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale))[:, None], axis=0)
        tl.store(o + t * s_o + i_h * DV + o_v, b_o.to(o.dtype.element_ty),
                 mask=m_v & ((tl.zeros([BV], dtype=tl.int64) + b_new) > 0))
        tl.store(p_out + t * s_pt + DK + o_v, b_v, mask=m_v & ((tl.zeros([BV], dtype=tl.int64) + b_live * b_keep) > 0))
        tl.store(p_out + t * s_pt + o_k, b_k, mask=(tl.zeros([DK], dtype=tl.int64) + b_head * b_keep) > 0)
        tl.store(p_out + t * s_pt + DK + DV + o_g, b_ab, mask=(tl.zeros([2], dtype=tl.int64) + b_head * b_keep) > 0)


@triton.jit(do_not_specialize=["T"])
def _recurrent_kernel(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, live, o, T, scale,
                      s_q, s_k, s_v, s_a, s_b, s_o, s_pp, s_pt,
                      GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                      HAS_LIVE: tl.constexpr, PDL: tl.constexpr, xc=None, buf=None, off=None, cw=None, s_xc=0,
                      s_buf=0, WIDTH=1, KEY=0, KC: tl.constexpr = 0, TP: tl.constexpr = 1, LAYERED: tl.constexpr = False,
                      NL=1, LG=1, s_ls=0, s_lp=0, s_lg=0):
    # One program per (value head, block of BV value columns): its [DK, BV] slice of the state
    # stays in registers through the last step's accepted tokens (read back from pend) and this
    # step's T; one loop body runs both, so a token gives the same bits folded in later as when
    # its step ran it. The gates and the q/k l2norm are computed here. Each program reads and
    # writes only its own slice of the state and of v in pend (k, a and b are written by the
    # head's first program); pend's halves alternate, so no program reads what another writes.
    # LAYERED (a fold of every layer at once, fold_pending_layers): grid axis 2 takes LG layers of NL.
    pdl_start(PDL)
    i_h, i_v, i_g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_kh = i_h // GROUP
    o_k = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    m_s = (o_k < DK)[:, None] & m_v[None, :]
    o_s = i_h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    o_g = tl.arange(0, 2)
    if KC > 0:
        # the conv form: xc [T, 2 KEY + Hv DV] holds q | k | v before a conv of KC taps (buf, off and
        # cw: its window, offset and weight, as kernels/conv.py takes them), and q points at the
        # rows [T, 2 KEY + Hv DV] that k and v are views of, still to be written. This program
        # writes the conv of the channels it reads there (its key head's q and k, which the head's
        # other programs write alike, and its own v columns), then reads them below as the plain
        # kernel does. The window takes the step's inputs from the programs that own the channels:
        # q and k from a key head's first value head's program 0, v from each program its own.
        b_own = tl.full([], 1, tl.int64)
        if HAS_LIVE:
            b_own = tl.minimum(tl.maximum(tl.load(live), 0), 1)
        b_qk = b_own * (1 - tl.minimum(i_v, 1)) * tl.where(i_h % GROUP == 0, 1, 0)
        b_off = tl.load(off)
        o_q = i_kh * DK + o_k
        _conv_rows(xc, buf, cw, q, o_q, o_q < KEY, b_qk, T, s_xc, s_q, s_buf, b_off, WIDTH, KC, TP, DK)
        _conv_rows(xc, buf, cw, q, KEY + o_q, o_q < KEY, b_qk, T, s_xc, s_q, s_buf, b_off, WIDTH, KC, TP, DK)
        _conv_rows(xc, buf, cw, q, 2 * KEY + i_h * DV + o_v, m_v, b_own, T, s_xc, s_q, s_buf, b_off, WIDTH, KC, TP, BV)
        tl.debug_barrier()   # the rows written above, before any thread of the program reads them
    if LAYERED:
        # a fold of every layer at once (fold_pending_layers; T = 0): program (i_h, i_v, i_g) takes
        # layers i_g LG .. i_g LG + LG - 1 of NL in turn, each layer's state, pend and gates s_ls,
        # s_lp and s_lg elements on from the last's, through the very code a step runs
        for i_l in range(i_g * LG, tl.minimum(i_g * LG + LG, NL)):
            _run_layer(q, k, v, a, b, A_log + i_l * s_lg, dt_bias + i_l * s_lg, state + i_l * s_ls,
                       pend + i_l * s_lp, fold, parity, live, o, T, scale, s_q, s_k, s_v, s_a, s_b, s_o, s_pp, s_pt,
                       i_h, i_v, i_kh, o_k, o_v, m_v, m_s, o_s, o_g, DK, DV, BV, HAS_LIVE)
    else:
        _run_layer(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, live, o, T, scale, s_q, s_k, s_v, s_a, s_b,
                   s_o, s_pp, s_pt, i_h, i_v, i_kh, o_k, o_v, m_v, m_s, o_s, o_g, DK, DV, BV, HAS_LIVE)


# Triton compiles a launch's integer arguments into it where they are multiples of 16, and a
# one-token step's q | k | v views have another row stride than a longer step's where they are
# views of a wider row (the in_proj's output, under KernelPlan.conv_in_product: at T = 1 torch gives
# the heads' width, at T > 1 the row's): two compiled forms, which at dk = 64 laid q and k out two a
# lane against one and summed their squares in another order, so a decode's token took other bits
# than the same token in a verify (greedy MTP on != off). The form that takes no stride into its
# code is one for every step and fold; the engine takes it with the product's conv (`any_stride`).
_ROW_STRIDES = ("s_q", "s_k", "s_v", "s_a", "s_b", "s_o", "s_xc")
_recurrent_kernel_any_stride = triton.jit(getattr(_recurrent_kernel, "fn", _recurrent_kernel),    # (no Triton: a function)
                                          do_not_specialize=["T", *_ROW_STRIDES])


def _kernel(any_stride: bool):
    return _recurrent_kernel_any_stride if any_stride else _recurrent_kernel


def _tile(DV: int) -> tuple[int, int]:
    """(BV, warps): value columns a program and its warps, the same for a step and a prefill's
    fold (so both give the state the same bits). Small programs win: at T = 4 on an H100, BV 16
    with one warp took 9.3 us, BV 32 with four 11.8."""
    return min(16, triton.next_power_of_2(DV)), 1


def _check_state(state, pend, fold, parity, Hv, DK, DV):
    assert state.dtype == torch.float32 and state.is_contiguous() and state.shape == (Hv, DK, DV), \
        f"state must be contiguous float32 [{Hv}, {DK}, {DV}]"
    assert pend.dtype == torch.float32 and pend.is_contiguous() and pend.shape[0] == 2 \
        and pend.shape[2:] == (Hv, pending_width(DK, DV)), f"pend must be contiguous float32 [2, R, {Hv}, dk+dv+2]"
    for t in (fold, parity):
        assert t.numel() == 1 and t.dtype == torch.long, "fold and parity must be 1-element long tensors"


def recurrent_triton(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor, pend: torch.Tensor,
                     fold: torch.Tensor, parity: torch.Tensor, live: torch.Tensor | None = None,
                     any_stride: bool = False) -> torch.Tensor:
    """recurrent_ref's contract. q, k, v may be row-strided views (of the conv output) with each
    token's heads contiguous; a, b likewise [T, Hv] views. `any_stride`: the kernel's form that
    takes no row stride into its code (_ROW_STRIDES), one for every T."""
    return _step(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, live, {}, any_stride)


def conv_recurrent_triton(x, buf, off, weight, a, b, A_log, dt_bias, state: torch.Tensor, pend: torch.Tensor,
                          fold: torch.Tensor, parity: torch.Tensor, live: torch.Tensor | None = None,
                          key_heads: int = 1, any_stride: bool = False) -> torch.Tensor:
    """conv_recurrent_ref's contract in one kernel: the recurrence's, each program first computing
    the conv of the channels it reads. x [T, C] may be a row-strided view (of the in_proj output).
    `any_stride` as recurrent_triton's."""
    T, C = x.shape
    Hv, DK, DV = state.shape
    KC, WIDTH = weight.shape[1], buf.shape[1]
    KEY = key_heads * DK
    assert C == 2 * KEY + Hv * DV and x.stride(1) == 1, f"x must be [T, {2 * KEY + Hv * DV}] with contiguous rows"
    assert buf.shape[0] == C and buf.stride(1) == 1 and weight.shape == (C, KC) and weight.is_contiguous(), \
        f"buf must be [{C}, W] with contiguous rows, the conv weight [{C}, K] contiguous"
    assert T <= WIDTH - (KC - 1), f"a step of {T} tokens would write the window it reads (W = {WIDTH})"
    assert off.numel() == 1 and off.dtype == torch.long, "off must be a 1-element long tensor"
    # the conv's output rows, which the kernel writes and then reads as the plain kernel reads conv.py's
    q, k, v = torch.empty(T, C, dtype=x.dtype, device=x.device).split([KEY, KEY, Hv * DV], dim=-1)
    return _step(q.view(T, key_heads, DK), k.view(T, key_heads, DK), v.view(T, Hv, DV), a, b, A_log, dt_bias, state,
                 pend, fold, parity, live, dict(xc=x, buf=buf, off=off, cw=weight, s_xc=x.stride(0), s_buf=buf.stride(0),
                                                WIDTH=WIDTH, KEY=KEY, KC=KC, TP=triton.next_power_of_2(T)), any_stride)


def _step(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, live, conv_args: dict,
          any_stride: bool = False) -> torch.Tensor:
    """A step's launch of the recurrence kernel (conv_args: the conv form's, or none; any_stride:
    recurrent_triton's)."""
    T, Hk, DK = q.shape
    Hv, DV = v.shape[1], v.shape[2]
    assert k.shape == q.shape and v.shape[0] == T and Hv % Hk == 0, "q, k [T, Hk, dk], v [T, Hv, dv]"
    assert DK & (DK - 1) == 0, "dk must be a power of two"
    for t, hs in ((q, DK), (k, DK), (v, DV)):
        assert t.stride(2) == 1 and t.stride(1) == hs, "each token's heads must be contiguous"
    assert a.shape == b.shape == (T, Hv) and a.stride(1) == 1 and b.stride(1) == 1, "a, b must be [T, Hv]"
    assert A_log.shape == dt_bias.shape == (Hv,), "A_log, dt_bias must be [Hv]"
    _check_state(state, pend, fold, parity, Hv, DK, DV)
    assert T <= pend.shape[1], f"pend holds {pend.shape[1]} tokens a step, got {T}"
    assert live is None or (live.numel() == 1 and live.dtype == torch.long), "live must be a 1-element long tensor"
    o = torch.empty(T, Hv, DV, dtype=v.dtype, device=v.device)
    BV, warps = _tile(DV)
    _kernel(any_stride)[(Hv, triton.cdiv(DV, BV))](
        q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, live if live is not None else fold, o, T,
        DK ** -0.5, q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), o.stride(0),
        pend.stride(0), pend.stride(1), GROUP=Hv // Hk, DK=DK, DV=DV, BV=BV,
        HAS_LIVE=live is not None, num_warps=warps, **pdl(q), **conv_args)
    return o


def fold_pending_triton(state: torch.Tensor, pend: torch.Tensor, fold: torch.Tensor, parity: torch.Tensor,
                        A_log: torch.Tensor, dt_bias: torch.Tensor, any_stride: bool = False):
    """fold_pending_ref's contract: the recurrent kernel with no tokens of its own (in the steps'
    form: `any_stride` as theirs)."""
    Hv, DK, DV = state.shape
    _check_state(state, pend, fold, parity, Hv, DK, DV)
    BV, warps = _tile(DV)
    _kernel(any_stride)[(Hv, triton.cdiv(DV, BV))](
        state, state, state, state, state, A_log, dt_bias, state, pend, fold, parity, fold, state, 0, 1.,
        0, 0, 0, 0, 0, 0, pend.stride(0), pend.stride(1), GROUP=1, DK=DK, DV=DV, BV=BV,
        HAS_LIVE=False, num_warps=warps, **pdl(state))


def fold_pending_layers_ref(states: torch.Tensor, pends: torch.Tensor, fold: torch.Tensor, parity: torch.Tensor,
                            A_logs: torch.Tensor, dt_biases: torch.Tensor):
    """fold_pending_ref over L layers at once: states [L, Hv, dk, dv], pends [L, 2, R, Hv, dk+dv+2],
    A_logs and dt_biases [L, Hv], one fold and parity for all."""
    for state, pend, A_log, dt_bias in zip(states, pends, A_logs, dt_biases):
        fold_pending_ref(state, pend, fold, parity, A_log, dt_bias)


def fold_pending_layers_triton(states: torch.Tensor, pends: torch.Tensor, fold: torch.Tensor, parity: torch.Tensor,
                               A_logs: torch.Tensor, dt_biases: torch.Tensor, any_stride: bool = False,
                               layers: int = 1):
    """fold_pending_layers_ref's contract in one launch: fold_pending_triton's programs for each
    layer, each program taking `layers` layers in turn (KernelPlan.fold_beside_draft), each layer's
    state the bits its own launch gives. A layer's state and pend
    are contiguous; the layers may lie further apart, the same distance for every layer, in
    multiples of 16 floats from 16-byte aligned starts (engine/state.py pads them so): a kernel
    compiled for other alignments may sum in another order."""
    L, Hv, DK, DV = states.shape
    assert pends.shape[0] == L and A_logs.shape == dt_biases.shape == (L, Hv), \
        f"pends [{L}, 2, R, {Hv}, dk+dv+2], A_logs and dt_biases [{L}, {Hv}]"
    assert A_logs.is_contiguous() and dt_biases.is_contiguous(), "A_logs and dt_biases must be contiguous"
    _check_state(states[0], pends[0], fold, parity, Hv, DK, DV)
    assert states.stride(0) % 16 == 0 and pends.stride(0) % 16 == 0 and states.data_ptr() % 16 == 0 \
        and pends.data_ptr() % 16 == 0, "the layers' rows must start 16-byte aligned, 16 floats apart"
    BV, warps = _tile(DV)
    _kernel(any_stride)[(Hv, triton.cdiv(DV, BV), triton.cdiv(L, layers))](
        states, states, states, states, states, A_logs, dt_biases, states, pends, fold, parity, fold, states, 0, 1.,
        0, 0, 0, 0, 0, 0, pends.stride(1), pends.stride(2), GROUP=1, DK=DK, DV=DV, BV=BV,
        HAS_LIVE=False, num_warps=warps, LAYERED=True, NL=L, LG=layers, s_ls=states.stride(0),
        s_lp=pends.stride(0), s_lg=A_logs.stride(0), **pdl(states))


def fold_pending_layers(states: torch.Tensor, pends: torch.Tensor, fold: torch.Tensor, parity: torch.Tensor,
                        A_logs: torch.Tensor, dt_biases: torch.Tensor, any_stride: bool = False, layers: int = 1):
    """fold_pending_layers_ref's contract; the one launch for CUDA tensors (any_stride as the steps',
    `layers` a program: fold_pending_layers_triton's)."""
    if use_triton(states):
        fold_pending_layers_triton(states, pends, fold, parity, A_logs, dt_biases, any_stride, layers)
    else:
        fold_pending_layers_ref(states, pends, fold, parity, A_logs, dt_biases)


def recurrent(q, k, v, a, b, A_log, dt_bias, state: torch.Tensor, pend: torch.Tensor, fold: torch.Tensor,
              parity: torch.Tensor, live: torch.Tensor | None = None, any_stride: bool = False) -> torch.Tensor:
    """recurrent_ref's contract; the Triton kernel for CUDA tensors (any_stride: recurrent_triton's)."""
    if use_triton(q, k, v, a, b):
        return recurrent_triton(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, live, any_stride)
    return recurrent_ref(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, live)


def conv_recurrent(x, buf, off, weight, a, b, A_log, dt_bias, state: torch.Tensor, pend: torch.Tensor,
                   fold: torch.Tensor, parity: torch.Tensor, live: torch.Tensor | None = None,
                   key_heads: int = 1, any_stride: bool = False) -> torch.Tensor:
    """conv_recurrent_ref's contract; the one kernel for CUDA tensors (any_stride: recurrent_triton's)."""
    if use_triton(x, a, b):
        return conv_recurrent_triton(x, buf, off, weight, a, b, A_log, dt_bias, state, pend, fold, parity, live,
                                     key_heads, any_stride)
    return conv_recurrent_ref(x, buf, off, weight, a, b, A_log, dt_bias, state, pend, fold, parity, live, key_heads)


def fold_pending(state: torch.Tensor, pend: torch.Tensor, fold: torch.Tensor, parity: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, any_stride: bool = False):
    """fold_pending_ref's contract; the Triton kernel for CUDA tensors (in the steps' form:
    any_stride as theirs)."""
    if use_triton(state):
        fold_pending_triton(state, pend, fold, parity, A_log, dt_bias, any_stride)
    else:
        fold_pending_ref(state, pend, fold, parity, A_log, dt_bias)
