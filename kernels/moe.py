"""The sparse MLP of the Qwen3.5 / Qwen3.6 MoE models, in four pieces: routing (kernels/moe_routing.py),
the block layout (kernels/moe_layout.py), the expert products and the combine (here). Float32
torch references, the Triton kernels beside them, and dispatchers that take the kernels for CUDA
tensors.

    route    : the top k of the router's E logits, weighted (kernels/moe_routing.py)
    layout   : the (row, choice) pairs p = row * k + j grouped by expert into blocks (moe_layout.py)
    swiglu   : h[p] = silu(x[row] @ W_gate[e]ᵀ) * (x[row] @ W_up[e]ᵀ), over each block's pairs
    down     : y[p] = h[p] @ W_down[e]ᵀ
    combine  : out[row] = Σ_j weight[row, j] * y[row * k + j] + gate[row] * shared[row]

A block reads its expert's weights once for all the pairs in it. In a step (a few rows: decode,
verify, draft) every distinct expert the rows chose is one block, so its weights are read once
per step however many rows chose it: the routing kernel writes that layout on the device (or,
under a plan without routed_layout, the expert kernels derive it; moe_layout.py), the expert
kernels launched for the worst case so the step can be a CUDA graph. Each pair's products
are accumulated in the same order whatever shares its block, and the combine sums a row's k
choices in order, so a row's result does not depend on the other rows (greedy MTP on == off).
A prefill's blocks take 16, 32 or 64 pairs by its chunk's size (ProductPlan.prefill_block_rows),
with tiles to match over 4-bit experts: its results may depend on the chunk's size, as a
prefill's do through its chunking anyway, never on its routing.

Three forms of a step (engine/plan.py: moe_normed, a default over bf16 and FP8 experts,
combine_normed, a default on a GPU, and moe_fold, a candidate): the SwiGLU may read x as a Normed (the norm before the
layer in two pieces, kernels/matvec.py), scaling each pair by its row's 1 / rms; the down kernel
may finish the layer (`Fold`, _down_fold_kernel): each column block's last program combines, adds
the residual and writes the next norm's two pieces, its rows one tile of STEP_ROWS whatever the
step's T, so that a row's sums of squares reduce the same way in every step; or the combine
kernel may (the same `Fold`): each of its programs, one row's block of columns, adds the residual
and writes the block's share of the two pieces, so the norm kernel after it goes and no program
waits for another.

Experts are stored stacked: W_gate_up [E * 2F, H] (expert e's gate rows, then its up rows),
W_down [E * H, F]; either may be a BlockFP8 (kernels/fp8.py) whose 128-row blocks never straddle
two experts, or a GroupInt4 (kernels/int4.py) with a perm [E, K] where each expert has its own,
or interleaved (no perm; the shared expert then interleaved too).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mtpchat.kernels._triton import pdl, pdl_start, tl, triton, use_triton
from mtpchat.kernels.forms import dense_ref, values_of
from mtpchat.kernels.fp8 import BLOCK, BlockFP8, fp8_fit, fp8_run, widen, widen_args
from mtpchat.kernels.int4 import GroupInt4, check_int4, dot_int4, form_args, form_of, interleaved_args, measured
from mtpchat.kernels.matvec import Normed, _scale_args, arrival_counts, fit_int4, int4_buffer, int4_widened
from mtpchat.kernels.plan import ProductPlan, default_products
from mtpchat.kernels.moe_layout import PREFILL_ROWS, STEP_ROWS, Layout, StepLayout, _block, _layout_args, count_reads


# --- float32 references ------------------------------------------------------------------------

def _blocks_of(layout: Layout):
    """(expert, pair ids) of each non-empty block, on the host."""
    for e, pairs in zip(layout.expert.tolist(), layout.pairs.tolist()):
        if e >= 0:
            yield e, [p for p in pairs if p >= 0]


def _product(a: torch.Tensor, w: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """a [M, K] @ w [N, K]ᵀ in float32; `rowwise`: one product per row, so a row's result does not
    depend on the rows beside it (the CPU's batched product may order its sums by M)."""
    if rowwise and a.shape[0] > 1:
        return torch.cat([F.linear(a[i:i + 1], w) for i in range(a.shape[0])])
    return F.linear(a, w)


def _with_shared(w, shared) -> torch.Tensor:
    """The stacked experts in float32, the shared expert's weight after them as expert E."""
    W = dense_ref(w)
    return W if shared is None else torch.cat([W, dense_ref(shared)])


def expert_swiglu_ref(x: torch.Tensor, w_gate_up, layout: Layout, top_k: int, n_experts: int,
                      rowwise: bool = True, shared=None) -> torch.Tensor:
    """x [T, H], w_gate_up [E * 2F, H] -> h [T * k, F] in x's dtype (a pair in no block: zero);
    `shared` [2F, H]: expert E."""
    W = _with_shared(w_gate_up, shared)
    F2 = values_of(w_gate_up).shape[0] // n_experts
    h = torch.zeros(x.shape[0] * top_k, F2 // 2, dtype=torch.float32, device=x.device)
    for e, pairs in _blocks_of(layout):
        idx = torch.tensor(pairs, device=x.device)
        g, u = _product(x[idx // top_k].float(), W[e * F2:(e + 1) * F2], rowwise).chunk(2, dim=-1)
        h[idx] = F.silu(g) * u
    return h.to(x.dtype)


def expert_down_ref(h: torch.Tensor, w_down, layout: Layout, n_experts: int, rowwise: bool = True,
                    shared=None) -> torch.Tensor:
    """h [P, F], w_down [E * H, F] -> y [P, H] float32 (a pair in no block: zero); `shared` [H, F]:
    expert E."""
    W = _with_shared(w_down, shared)
    H = values_of(w_down).shape[0] // n_experts
    y = torch.zeros(h.shape[0], H, dtype=torch.float32, device=h.device)
    for e, pairs in _blocks_of(layout):
        idx = torch.tensor(pairs, device=h.device)
        y[idx] = _product(h[idx].float(), W[e * H:(e + 1) * H], rowwise)
    return y


def combine_ref(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
                gate: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [T * k, H] float32, weights [T, k] -> [T, H] in dtype: each row's k expert outputs summed
    in order of choice, then the shared expert's output times its gate."""
    T, k = weights.shape
    y = y.view(T, k, -1)
    out = torch.zeros(T, y.shape[-1], dtype=torch.float32, device=y.device)
    for j in range(k):
        out = out + weights[:, j, None] * y[:, j]
    if shared is not None:
        out = out + gate[:, None] * shared.float()
    return out.to(dtype)


class Fold(NamedTuple):
    """What finishes a step's MoE layer in its down kernel (expert_down) or its combine (combine):
    the combine's inputs (the routing's weights [T, k]; the shared expert's output [T, H] and gate
    [T], or None where it is expert E), the residual stream r [T, H] the layer's value is added to,
    and the next norm's weight [H] and eps."""
    weights: torch.Tensor
    shared: torch.Tensor | None
    gate: torch.Tensor | None
    residual: torch.Tensor
    norm_weight: torch.Tensor
    eps: float


def fold_ref(y: torch.Tensor, fold: Fold) -> tuple[Normed, torch.Tensor]:
    """(Normed, h) from the pairs' down products y [T * k, H]: h = the combine (rounded to the
    residual's dtype) + the residual, rounded; the Normed holds h * (1 + norm_weight), rounded, and
    the sums of h² (one block: a Normed's reader needs only their sum)."""
    r = fold.residual
    h = (combine_ref(y, fold.weights, fold.shared, fold.gate, r.dtype).float() + r.float()).to(r.dtype)
    xn = (h.float() * (1. + fold.norm_weight.float())).to(r.dtype)
    return Normed(xn, h.float().square().sum(-1, keepdim=True), fold.eps), h


# --- Triton kernels ----------------------------------------------------------------------------

@triton.jit
def _expert_ptr(p, offset, p2, e, E, SHARED: tl.constexpr):
    """p + offset: expert e's part of a stack; with SHARED, p2 (the shared expert's own) for e == E.
    Called for each of a 4-bit expert's pointers that exists (the zeros and perm may be None: a
    Triton function returns no None among tensors)."""
    q = p + offset
    if SHARED:
        if e == E:
            q = p2
    return q


@triton.jit
def _swiglu_int4(x, w, ws, zw, perm, w2, ws2, zw2, perm2, e, p, h, E, H, F, s_x, s_h, s_ws, s_w, i_n,
                 ss, s_ss, NB, eps, TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SHARED: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, UNPACK: tl.constexpr,
                 NBP: tl.constexpr, STACKED: tl.constexpr):
    # expert e's words, scales, zeros and perm (None where the stack has none); E the shared one.
    # STACKED: the tile's gate rows over its up rows, one dot a group (as _swiglu_stacked), each
    # row's sums those of the two dots apart
    w_e = _expert_ptr(w, e * 2 * F * s_w, w2, e, E, SHARED)
    s_e = _expert_ptr(ws, e * 2 * F * s_ws, ws2, e, E, SHARED)
    z_e = zw if zw is None else _expert_ptr(zw, e * 2 * F * s_ws, zw2, e, E, SHARED)
    q_e = perm if perm is None else _expert_ptr(perm, e * H, perm2, e, E, SHARED)
    m_p = p >= 0
    p_x = x + tl.where(m_p, p // TOPK, 0)[None, :] * s_x
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < F
    if STACKED:
        o_r = tl.arange(0, 2 * BN)
        o_c = i_n * BN + o_r % BN                   # the tile's columns of F, twice
        o_w = o_c + tl.where(o_r >= BN, F, 0)       # rows of the expert's gate|up
        acc = tl.zeros([2 * BN, BM], dtype=tl.float32)
        for k in range(0, H, BK):      # p_x's rows all lie in x (dot_int4)
            acc = dot_int4(acc, w_e, s_e, z_e, q_e, o_w, o_c < F, s_w, s_ws, p_x, m_p, k, H, BK, G, BG, UNPACK)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [2, BN, BM]), [1, 2, 0]))
    else:
        acc_g = tl.zeros([BN, BM], dtype=tl.float32)
        acc_u = tl.zeros([BN, BM], dtype=tl.float32)
        for k in range(0, H, BK):      # p_x's rows all lie in x (dot_int4)
            acc_g = dot_int4(acc_g, w_e, s_e, z_e, q_e, o_n, m_n, s_w, s_ws, p_x, m_p, k, H, BK, G, BG, UNPACK)
            acc_u = dot_int4(acc_u, w_e, s_e, z_e, q_e, F + o_n, m_n, s_w, s_ws, p_x, m_p, k, H, BK, G, BG, UNPACK)
    _swiglu_out(acc_g, acc_u, h, p, m_p, o_n, m_n, s_h, ss, s_ss, NB, H, eps, TOPK, NBP)


@triton.jit
def _swiglu_out(acc_g, acc_u, h, p, m_p, o_n, m_n, s_h, ss, s_ss, NB, H, eps, TOPK: tl.constexpr,
                NBP: tl.constexpr):
    """silu(gate) * up of a block's pairs p [BM] (columns o_n) from their sums [BN, BM], into h;
    NBP > 0: x was a Normed (its NB sums of squares a row in ss), each pair's sums first scaled by
    its row's 1 / rms. The sums of squares are added in block order, each pair its own row's, one
    load a block (not matvec._row_scale's [BM, NBP] tile: over the layout the kernel derives, at
    64 pairs, that tile took a verify step's SwiGLU from 127 registers to 143 on sm_90, 3
    programs an SM where 4 fit; this form keeps 128)."""
    if NBP > 0:
        rows = tl.where(m_p, p // TOPK, 0)
        b_sum = tl.zeros(p.shape, tl.float32)
        for i_b in tl.static_range(NBP):
            b_sum += tl.load(ss + rows * s_ss + i_b, mask=m_p & (tl.full(p.shape, i_b, tl.int32) < NB), other=0.)
        b_rstd = tl.rsqrt(b_sum / H + eps)
        acc_g = acc_g * b_rstd[None, :]
        acc_u = acc_u * b_rstd[None, :]
    out = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h + p[None, :] * s_h + o_n[:, None], out.to(h.dtype.element_ty), mask=m_n[:, None] & m_p[None, :])


@triton.jit
def _swiglu_kernel(x, w, ws, w2, ws2, expert, pairs, reads, h, P, E, H, F, s_x, s_h, s_ws,
                   TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   STEP: tl.constexpr, BP: tl.constexpr, COUNT: tl.constexpr, SHARED: tl.constexpr,
                   FP8: tl.constexpr, PDL: tl.constexpr, BITS: tl.constexpr = 0, G: tl.constexpr = 0,
                   BG: tl.constexpr = 0, s_w=0, zw=None, perm=None, zw2=None, perm2=None,
                   UNPACK: tl.constexpr = False, RUN: tl.constexpr = 1, STACKED: tl.constexpr = False,
                   LAID: tl.constexpr = False, ss=None, s_ss=0, NB=0, eps=0., NBP: tl.constexpr = 0):
    # One program per (block, BN of the F columns): the expert's gate and up tiles, multiplied
    # with the block's rows of x, weights first ([BN, BK] @ [BK, BM]) as in matvec.py. With
    # SHARED, expert E is the shared expert, whose weights (w2, ws2) are a tensor of their own.
    # G > 0: 4-bit experts (kernels/int4.py), rows of s_w words, zeros zw and perm [E, H] (or None).
    # RUN: a K step takes RUN tiles of BK / RUN columns one after another (fp8.fp8_run).
    # STACKED: the gate and up tiles as one [2 BN, BK] tile, one dot a K step (4-bit: a group).
    # LAID: a step's layout as the routing kernel wrote it (moe_layout._block). NBP > 0: x is a
    # Normed's x, its rows' sums of squares in ss (_swiglu_out).
    pdl_start(PDL)
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e, p = _block(expert, pairs, reads, P, i_b, i_n, BM, STEP, BP, COUNT, SHARED, LAID)
    if e < 0:
        return
    if G > 0:
        _swiglu_int4(x, w, ws, zw, perm, w2, ws2, zw2, perm2, e, p, h, E, H, F, s_x, s_h, s_ws, s_w, i_n,
                     ss, s_ss, NB, eps, TOPK, BM, BN, BK, SHARED, G, BG, UNPACK, NBP, STACKED)
    else:   # not a return in `if G > 0`: Triton compiles the code after a constexpr if's return
        w_e = w + e * 2 * F * H
        s_e = ws + e * 2 * F // 128 * s_ws
        if SHARED:
            if e == E:
                w_e = w2
                s_e = ws2
        m_p = p >= 0
        rows = tl.where(m_p, p // TOPK, 0)
        o_n = i_n * BN + tl.arange(0, BN)
        m_n = o_n < F
        if STACKED:
            acc_g, acc_u = _swiglu_stacked(x, w_e, s_e, rows, m_p, i_n, H, F, s_x, s_ws, BM, BN, BK, FP8, BITS, RUN)
        else:
            acc_g = tl.zeros([BN, BM], dtype=tl.float32)
            acc_u = tl.zeros([BN, BM], dtype=tl.float32)
            for k in range(0, H, BK):
                for u in tl.static_range(RUN):
                    k_u = k + u * (BK // RUN)
                    o_k = k_u + tl.arange(0, BK // RUN)
                    m_k = o_k < H
                    b_x = tl.load(x + rows[None, :] * s_x + o_k[:, None], mask=m_k[:, None] & m_p[None, :], other=0.)
                    m_w = m_n[:, None] & m_k[None, :]
                    b_g = tl.load(w_e + o_n[:, None] * H + o_k[None, :], mask=m_w, other=0.)
                    b_u = tl.load(w_e + (o_n + F)[:, None] * H + o_k[None, :], mask=m_w, other=0.)
                    if FP8:
                        s_g = tl.load(s_e + (i_n * BN) // 128 * s_ws + k_u // 128)
                        s_u = tl.load(s_e + (F + i_n * BN) // 128 * s_ws + k_u // 128)
                        acc_g += s_g * tl.dot(widen(b_g, b_x, BITS), b_x, input_precision="ieee")
                        acc_u += s_u * tl.dot(widen(b_u, b_x, BITS), b_x, input_precision="ieee")
                    else:
                        acc_g = tl.dot(b_g, b_x, acc_g, input_precision="ieee")
                        acc_u = tl.dot(b_u, b_x, acc_u, input_precision="ieee")
        _swiglu_out(acc_g, acc_u, h, p, m_p, o_n, m_n, s_h, ss, s_ss, NB, H, eps, TOPK, NBP)


@triton.jit
def _swiglu_stacked(x, w_e, s_e, rows, m_p, i_n, H, F, s_x, s_ws, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, FP8: tl.constexpr, BITS: tl.constexpr, RUN: tl.constexpr):
    """(gate, up) sums [BN, BM] of column tile i_n from one tile of 2 BN weight rows a K step, the
    tile's gate rows over its up rows: one dot (one chain of matrix instructions where the two
    made two, each waited for before the next; with 8 warps the halves on two warpgroups at once),
    each row's sums those of the separate dots (an FP8 row's block scale the gate's or the up's)."""
    o_r = tl.arange(0, 2 * BN)
    up = o_r >= BN
    o_c = i_n * BN + o_r % BN                       # the tile's columns of F, twice
    m_r = o_c < F
    o_w = o_c + tl.where(up, F, 0)                  # rows of the expert's gate|up
    acc = tl.zeros([2 * BN, BM], dtype=tl.float32)
    for k in range(0, H, BK):
        for u in tl.static_range(RUN):
            k_u = k + u * (BK // RUN)
            o_k = k_u + tl.arange(0, BK // RUN)
            m_k = o_k < H
            b_x = tl.load(x + rows[None, :] * s_x + o_k[:, None], mask=m_k[:, None] & m_p[None, :], other=0.)
            b_w = tl.load(w_e + o_w[:, None] * H + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.)
            if FP8:
                s_g = tl.load(s_e + (i_n * BN) // 128 * s_ws + k_u // 128)
                s_u = tl.load(s_e + (F + i_n * BN) // 128 * s_ws + k_u // 128)
                acc += tl.where(up, s_u, s_g)[:, None] * tl.dot(widen(b_w, b_x, BITS), b_x, input_precision="ieee")
            else:
                acc = tl.dot(b_w, b_x, acc, input_precision="ieee")
    return tl.split(tl.permute(tl.reshape(acc, [2, BN, BM]), [1, 2, 0]))


@triton.jit
def _down_kernel(hin, w, ws, w2, ws2, expert, pairs, y, P, E, H, F, s_h, s_y, s_ws,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEP: tl.constexpr, BP: tl.constexpr,
                 SHARED: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr, BITS: tl.constexpr = 0,
                 G: tl.constexpr = 0, BG: tl.constexpr = 0, s_w=0, zw=None, perm=None, zw2=None, perm2=None,
                 UNPACK: tl.constexpr = False, RUN: tl.constexpr = 1, LAID: tl.constexpr = False):
    # One program per (block, BN of the H output columns), over the expert's F inputs (G > 0: 4-bit
    # experts, RUN, LAID: as in _swiglu_kernel).
    pdl_start(PDL)
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e, p = _block(expert, pairs, y, P, i_b, i_n, BM, STEP, BP, False, SHARED, LAID)
    if e < 0:
        return
    _down_tile(hin, w, ws, w2, ws2, y, e, p, i_n, E, H, F, s_h, s_y, s_ws, BM, BN, BK, SHARED, FP8, BITS,
               G, BG, s_w, zw, perm, zw2, perm2, UNPACK, RUN)


@triton.jit
def _down_fold_kernel(hin, w, ws, w2, ws2, expert, pairs, y, P, E, H, F, s_h, s_y, s_ws,
                      weights, shared, gate, r, nw, xn, hout, ss, count, T, s_s, s_r, s_xn, s_hout, s_ss,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEP: tl.constexpr, BP: tl.constexpr,
                      SHARED: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr, TOPK: tl.constexpr,
                      HAS_SHARED: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr = 0,
                      G: tl.constexpr = 0, BG: tl.constexpr = 0, s_w=0, zw=None, perm=None, zw2=None, perm2=None,
                      UNPACK: tl.constexpr = False, RUN: tl.constexpr = 1, LAID: tl.constexpr = False):
    # _down_kernel, then the last of a column block's programs to end finishes the layer there
    # (_fold_columns); every program counts, an empty block's too.
    pdl_start(PDL)
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e, p = _block(expert, pairs, y, P, i_b, i_n, BM, STEP, BP, False, SHARED, LAID)
    if e >= 0:
        _down_tile(hin, w, ws, w2, ws2, y, e, p, i_n, E, H, F, s_h, s_y, s_ws, BM, BN, BK, SHARED, FP8, BITS,
                   G, BG, s_w, zw, perm, zw2, perm2, UNPACK, RUN)
    _fold_columns(y, weights, shared, gate, r, nw, xn, hout, ss, count, i_n, T, H, tl.num_programs(0),
                  s_y, s_s, s_r, s_xn, s_hout, s_ss, BN, TOPK, HAS_SHARED, BT)


@triton.jit
def _down_tile(hin, w, ws, w2, ws2, y, e, p, i_n, E, H, F, s_h, s_y, s_ws,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SHARED: tl.constexpr, FP8: tl.constexpr,
               BITS: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, s_w, zw, perm, zw2, perm2,
               UNPACK: tl.constexpr, RUN: tl.constexpr):
    """Block (expert e, pairs p [BM]) times the H output columns i_n * BN .. of its down weight,
    float32 into y's pair rows."""
    m_p = p >= 0
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    if G > 0:
        w_e = _expert_ptr(w, e * H * s_w, w2, e, E, SHARED)            # as in _swiglu_int4
        s_e = _expert_ptr(ws, e * H * s_ws, ws2, e, E, SHARED)
        z_e = zw if zw is None else _expert_ptr(zw, e * H * s_ws, zw2, e, E, SHARED)
        q_e = perm if perm is None else _expert_ptr(perm, e * F, perm2, e, E, SHARED)
        p_h = hin + tl.where(m_p, p, 0)[None, :] * s_h      # every row's pointer in hin (dot_int4)
        for k in range(0, F, BK):
            acc = dot_int4(acc, w_e, s_e, z_e, q_e, o_n, m_n, s_w, s_ws, p_h, m_p, k, F, BK, G, BG, UNPACK)
    else:
        w_e = w + e * H * F
        s_e = ws + e * H // 128 * s_ws
        if SHARED:
            if e == E:
                w_e = w2
                s_e = ws2
        for k in range(0, F, BK):
            for u in tl.static_range(RUN):
                k_u = k + u * (BK // RUN)
                o_k = k_u + tl.arange(0, BK // RUN)
                m_k = o_k < F
                b_h = tl.load(hin + p[None, :] * s_h + o_k[:, None], mask=m_k[:, None] & m_p[None, :], other=0.)
                b_w = tl.load(w_e + o_n[:, None] * F + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
                if FP8:
                    s = tl.load(s_e + (i_n * BN) // 128 * s_ws + k_u // 128)
                    acc += s * tl.dot(widen(b_w, b_h, BITS), b_h, input_precision="ieee")
                else:
                    acc = tl.dot(b_w, b_h, acc, input_precision="ieee")
    tl.store(y + p[None, :] * s_y + o_n[:, None], acc, mask=m_n[:, None] & m_p[None, :])


@triton.jit
def _fold_columns(y, weights, shared, gate, r, nw, xn, hout, ss, count, i_n, T, H, NBLK, s_y, s_s, s_r, s_xn,
                  s_hout, s_ss, BN: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BT: tl.constexpr):
    """The MoE layer finished in the down kernel, column block i_n of H at a time: the last of the
    block's NBLK programs to end combines the T rows' expert outputs there (as combine_row, all BT
    rows at once, from L2), adds the residual r (hout = the block's value, as the combine and the
    norm after it round it), and writes the next product's input as a Normed's share: xn = hout *
    (1 + nw) and the block's sums of hout² (ss[:, i_n]); then sets the block's count back to 0.
    Its acq_rel add, after every thread of the program has stored, orders the other programs' y
    before its reads. BT is the same for every step (STEP_ROWS), never a function of T: the sums of
    squares reduce over the tile's layout, and a row's bits must not depend on how many share it."""
    tl.debug_barrier()
    if tl.atomic_add(count + i_n, 1, sem="acq_rel", scope="gpu") == NBLK - 1:
        o_n = i_n * BN + tl.arange(0, BN)
        o_t = tl.arange(0, BT)
        m_n, m_t = o_n < H, o_t < T
        m = m_t[:, None] & m_n[None, :]
        acc = tl.zeros([BT, BN], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            b_w = tl.load(weights + o_t * TOPK + j, mask=m_t, other=0.)
            b_y = tl.load(y + (o_t * TOPK + j)[:, None] * s_y + o_n[None, :], mask=m, other=0., cache_modifier=".cg")
            acc += b_w[:, None] * b_y
        if HAS_SHARED:
            b_s = tl.load(shared + o_t[:, None] * s_s + o_n[None, :], mask=m, other=0.).to(tl.float32)
            acc += tl.load(gate + o_t, mask=m_t, other=0.)[:, None] * b_s
        b_h = finish_block(acc, r + o_t[:, None] * s_r + o_n[None, :], hout + o_t[:, None] * s_hout + o_n[None, :],
                           xn + o_t[:, None] * s_xn + o_n[None, :], nw + o_n[None, :], m, m_n[None, :])
        tl.store(ss + o_t * s_ss + i_n, tl.sum(b_h * b_h, axis=1), mask=m_t)
        tl.atomic_xchg(count + i_n, 0)


@triton.jit
def finish_block(acc, p_r, p_h, p_xn, p_nw, m, m_nw):
    """A block of the MoE layer's combined rows `acc` (float32) finished for the next norm, as the
    combine and the norm after it round it: h = acc rounded to the model dtype + the residual
    (p_r), rounded, stored at p_h; x = h * (1 + the norm's weight at p_nw) at p_xn (a Normed's
    rows); returns h in float32 for the block's sums of h². The pointers' shapes are acc's (p_nw's
    broadcast to it, masked by m_nw)."""
    dtype = p_h.dtype.element_ty
    b_h = (acc.to(dtype).to(tl.float32) + tl.load(p_r, mask=m, other=0.).to(tl.float32)).to(dtype)
    tl.store(p_h, b_h, mask=m)
    b_h = b_h.to(tl.float32)
    b_nw = 1. + tl.load(p_nw, mask=m_nw, other=0.).to(tl.float32)
    tl.store(p_xn, (b_h * b_nw).to(dtype), mask=m)
    return b_h


@triton.jit
def combine_row(y, weights, shared, gate, r, o_h, m_h, s_y, s_s,
                BH: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr):
    """Row r's combine over the columns o_h [BH], float32: its TOPK expert outputs times their
    weights in order of choice, then the shared expert's output times its gate."""
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(weights + r * TOPK + j) * tl.load(y + (r * TOPK + j) * s_y + o_h, mask=m_h, other=0.)
    if HAS_SHARED:
        acc += tl.load(gate + r) * tl.load(shared + r * s_s + o_h, mask=m_h, other=0.).to(tl.float32)
    return acc


@triton.jit
def _combine_kernel(y, weights, shared, gate, out, H, s_y, s_s, s_o,
                    TOPK: tl.constexpr, BH: tl.constexpr, HAS_SHARED: tl.constexpr, PDL: tl.constexpr,
                    NORM: tl.constexpr = False, res=None, nw=None, xn=None, ss=None, s_r=0, s_xn=0, s_ss=0):
    # program (row, i_h): the row's columns i_h*BH.. . NORM (a Fold): out is h = the combine rounded
    # + the residual, rounded, and the block's share of the next norm as a Normed: x = h * (1 + w)
    # and the block's sum of h² (kernels/matvec.py); each program its own block, no count
    pdl_start(PDL)
    r, i_h = tl.program_id(0), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < H
    acc = combine_row(y, weights, shared, gate, r, o_h, m_h, s_y, s_s, BH, TOPK, HAS_SHARED)
    if NORM:
        b_h = finish_block(acc, res + r * s_r + o_h, out + r * s_o + o_h, xn + r * s_xn + o_h, nw + o_h, m_h, m_h)
        tl.store(ss + r * s_ss + i_h, tl.sum(b_h * b_h, axis=0))
    else:
        tl.store(out + r * s_o + o_h, acc.to(out.dtype.element_ty), mask=m_h)


def tiles(product: str, step: bool, fp8: bool, itemsize: int = 2, plan: ProductPlan | None = None,
          int4: tuple[int, int, int] | None = None, interleaved: bool = False,
          rows: int = PREFILL_ROWS) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages) of an expert product: the plan's expert_tiles rule where it gives one,
    else a function of the product, the phase, the weight format and the activations' width, in a
    step never of the number of rows (a 4-bit prefill's: of its blocks' `rows`). tests/bench/
    bench_moe.py measured the step's at the 35B-A3B's shapes on an H100. FP8 tiles lie inside one
    128 x 128 block of scales, or span two along K (BK 256, taken a block at a time: fp8.fp8_run; a
    rule's only); float32 tiles are smaller, to fit in shared memory. 4-bit experts, int4 = (N, K,
    group) of one expert's product: the plan's int4_tiles rule ("expert_swiglu", "expert_down"),
    else in a step the measured tile (int4.measured; interleaved experts: their own) and in a
    prefill one for its blocks of `rows` pairs (ProductPlan.prefill_block_rows): blocks of 16 the
    SwiGLU 64 x 256 and the down 64 x 128 weights, 4 warps; of 32 or 64 both 128 x 128, 8 warps
    (tests/bench/probe_moe_prefill.py, the 35B-A3B on an H200: a 128-token chunk's two products 153
    us against 1,600 for 64 x 128 over blocks of 64; a 2,048-token one's 550 against 1,046), the
    depth cut by an estimate of what a stage takes (ProductPlan.depth; an unpack form's own buffers
    are not counted), with float32 rows a dot's widened weights beside it (matvec.int4_widened; the
    columns halved where even 2 deep would not fit, a step's measured tiles alike: matvec.fit_int4).
    A step's FP8 SwiGLU stacked (ProductPlan.expert_stacked) takes 32 columns (bench_moe.py
    --stacked both, H100, 2026-11-27, a decode's 8 experts: 16.6 us against 16.9 for the 64 apart,
    22.8 for 32 apart; a verify's 30: 28.6 against 32.1), on an H200 16 columns, 2 warps
    (ProductPlan.fp8_expert_glu_tile)."""
    if int4 is not None:
        rule4 = plan.int4_tiles if plan is not None else None
        chosen = rule4("expert_" + product, *int4) if rule4 is not None else None
        if chosen is None and not step:
            # (the step's down tile, BK 512, would take 3 x 64 KB of x's loads alone over 64 rows).
            # The SwiGLU's K tile of 256 only where the group is at most 128, so a dot's width (the
            # lesser of BK and the group: int4.sub_tile) and with it a row's sums are the same at any
            # block size; a stage counted with x's tile once per dot (the SwiGLU's two take it twice).
            # Float32 rows keep a dot's weights widened beside (int4_widened): where a tile would not
            # fit even 2 deep (a 99 KB GPU, blocks of 32 or 64 pairs) it takes half the columns
            wide = product == "swiglu" and rows <= 16 and int4[2] <= 128
            BN, BK, warps = (64, 256 if wide else 128, 4) if rows <= 16 else (128, 128, 8)
            dots = 2 if product == "swiglu" else 1
            BN, stages = fit_int4(BN, 3, lambda BN: dots * int4_buffer(BN, BK, rows, itemsize),
                                  lambda BN: int4_widened(BN, BK, int4[2], itemsize), plan or ProductPlan(programs=1))
            return BN, BK, warps, stages
        if chosen is not None:
            return chosen
        # a step's measured tile, fitted where float32 rows' widened weights sit beside its buffers (a
        # 99 KB GPU: the stacked SwiGLU 4 deep took 106,496 bytes): its columns halved where even 2
        # deep would not fit, else its depth cut (the same sums at any depth or column count). A
        # SwiGLU program reads gate and up rows, 2 BN: stacked in one dot, apart in two, each with x's tile
        BN, BK, warps, stages = measured("expert_" + product, *int4[:2], interleaved)[0]
        plan = plan or ProductPlan(programs=1)
        stacked = product == "swiglu" and interleaved and plan.int4_expert_stacked
        tall, dots = (2, 1) if stacked else (1, 2 if product == "swiglu" else 1)    # a dot's rows (x BN), dots
        BN, stages = fit_int4(BN, stages, lambda BN: dots * int4_buffer(tall * BN, BK, STEP_ROWS, itemsize),
                              lambda BN: int4_widened(tall * BN, BK, int4[2], itemsize), plan)
        return BN, BK, warps, stages
    rule = plan.expert_tiles if plan is not None else None
    chosen = rule(product, step, fp8, itemsize) if rule is not None else None
    if chosen is not None:
        return chosen
    if fp8:
        # a step's SwiGLU stacked on the plan's fp8_expert_glu_tile (32 columns, 144 programs for a decode's
        # 9 experts; an H200's 16, 288), one chain of matrix instructions a K step each (apart, the
        # 64-column tile is the faster)
        stacked = product == "swiglu" and step and (plan or ProductPlan).expert_stacked    # (the class: the default)
        return (plan or ProductPlan).fp8_expert_glu_tile if stacked else (64, 128, 4, 3)
    if itemsize > 2:
        return 32, 64, 4, 3
    if step:
        # the SwiGLU's gate and up tiles of 64 x 256 bf16, 3 deep: 147,456 bytes a program, over the
        # 101,376 of an RTX 4090 or an L40S, where it runs 2 deep (ProductPlan.depth; the same sums)
        BN, BK = (64, 256) if product == "swiglu" else (64, 128)
        stage = (2 if product == "swiglu" else 1) * BN * BK * itemsize + BK * STEP_ROWS * itemsize
        return BN, BK, 4, (plan or ProductPlan(programs=1)).depth(3, stage)
    return 64, 64, 4, 3


def _fp8_ok(w, rows_per_expert: int) -> bool:
    return not isinstance(w, BlockFP8) or rows_per_expert % BLOCK == 0


def _shared_args(w, shared, rows: int, K: int) -> tuple:
    """(values, scales) of the shared expert's weight, or the experts' own again (never read)."""
    if shared is None:
        return (values_of(w), w.scale if isinstance(w, (BlockFP8, GroupInt4)) else values_of(w))
    assert isinstance(shared, BlockFP8) == isinstance(w, BlockFP8) and \
        isinstance(shared, GroupInt4) == isinstance(w, GroupInt4), "the shared expert must share the experts' format"
    v = values_of(shared)
    assert shared.shape == (rows, K) and v.is_contiguous(), f"the shared expert's weight must be [{rows}, {K}]"
    if isinstance(shared, (BlockFP8, GroupInt4)):
        assert shared.scale.stride(0) == w.scale.stride(0) and shared.scale.dtype == w.scale.dtype
        return v, shared.scale
    return v, v


_identity: dict = {}


def _int4_args(w, shared, n_experts: int, rows: int, K: int, BK: int, form: str) -> dict:
    """The launch arguments of 4-bit experts (kernels/int4.py), the experts' stack w of
    n_experts x rows and the shared expert (or None) alike in group and zeros; where only one of
    them has a perm, the other reads x through the identity (made once per size and device)."""
    if not isinstance(w, GroupInt4):
        return {}
    check_int4(w, K, interleaved=True)
    assert w.perm is None or w.perm.shape == (n_experts, K), f"stacked experts' perm must be [{n_experts}, {K}]"
    perm, zw2, perm2 = w.perm, w.zero, None
    if shared is not None:
        check_int4(shared, K, interleaved=True)
        assert shared.group == w.group and (shared.zero is None) == (w.zero is None), \
            "the shared expert must share the experts' group and zeros"
        assert shared.interleaved == w.interleaved, "the shared expert must share the experts' layout (interleaved or not)"
        assert shared.perm is None or shared.perm.shape == (K,), f"the shared expert's perm must be [{K}]"
        zw2, perm2 = shared.zero, shared.perm
        if (perm is None) != (perm2 is None):
            key = (w.device, n_experts, K)
            if key not in _identity:
                _identity[key] = torch.arange(K, dtype=torch.int32, device=w.device).repeat(n_experts, 1)
            identity = _identity[key]
            perm = identity if perm is None else perm
            perm2 = identity[0] if perm2 is None else perm2
    if w.interleaved:
        return dict(G=w.group, s_w=K // 4, zw=w.zero, perm=None, zw2=zw2, perm2=None, **interleaved_args(BK, w.group))
    return dict(G=w.group, s_w=K // 8, zw=w.zero, perm=perm, zw2=zw2, perm2=perm2, **form_args(BK, w.group, form))


def _widen(x, warps: int, BN: int, plan: ProductPlan) -> dict:
    return widen_args(x, warps, BN, plan.widen_bits, plan.widen_group)


def swiglu_stacked(w_gate_up, step: bool, plan: ProductPlan) -> bool:
    """Whether a step's expert SwiGLU takes each tile's gate and up rows as one tile: bf16 and FP8
    experts under the plan's expert_stacked, 4-bit ones under int4_expert_stacked where measured,
    interleaved (natural words keep their tiles apart); a prefill's never."""
    if isinstance(w_gate_up, GroupInt4):
        return step and plan.int4_expert_stacked and w_gate_up.interleaved
    return step and plan.expert_stacked


def expert_swiglu_triton(x, w_gate_up, layout, top_k: int, n_experts: int,
                         reads: torch.Tensor | None = None, shared=None, plan: ProductPlan | None = None) -> torch.Tensor:
    """`reads` (a step's layout only): the step's distinct routed experts are added to it.
    `shared`: the shared expert's gate|up [2F, H], taken as expert `n_experts` (route(shared=True)).
    x may be a Normed (kernels/matvec.py): each pair's sums scaled by its row's 1 / rms."""
    x, normed = _scale_args(x, x.shape[1])
    T, H = x.shape
    wv = values_of(w_gate_up)
    Fi = w_gate_up.shape[0] // (2 * n_experts)
    fp8 = isinstance(w_gate_up, BlockFP8)
    assert w_gate_up.shape == (n_experts * 2 * Fi, H) and wv.is_contiguous() and x.stride(1) == 1
    assert _fp8_ok(w_gate_up, Fi), "FP8 experts need 128-row aligned gate and up parts"
    expert, pairs, P, bm, blocks, step, bp, laid = _layout_args(layout)
    plan = plan or default_products(x.device)
    int4 = (2 * Fi, H, w_gate_up.group) if isinstance(w_gate_up, GroupInt4) else None
    BN, BK, warps, stages = tiles("swiglu", step, fp8, x.element_size(), plan, int4,
                                  int4 is not None and w_gate_up.interleaved, bm)
    if fp8:
        BN, BK, warps, stages = fp8_fit((BN, BK, warps, stages), H)
    h = torch.empty(T * top_k, Fi, dtype=x.dtype, device=x.device)
    stacked = swiglu_stacked(w_gate_up, step, plan)
    w2, ws2 = _shared_args(w_gate_up, shared, 2 * Fi, H)
    ws = w_gate_up.scale if isinstance(w_gate_up, (BlockFP8, GroupInt4)) else wv
    _swiglu_kernel[(blocks, triton.cdiv(Fi, BN))](
        x, wv, ws, w2, ws2, expert, pairs, reads if reads is not None else h, h, P, n_experts, H, Fi,
        x.stride(0), h.stride(0), ws.stride(0), TOPK=top_k, BM=bm, BN=BN, BK=BK, STEP=step, BP=bp,
        COUNT=step and reads is not None, SHARED=shared is not None, FP8=fp8, num_warps=warps, num_stages=stages,
        STACKED=stacked, LAID=laid, **normed, **pdl(x),
        **(_widen(x, warps, 2 * BN if stacked else BN, plan) if fp8 else {}),
        **fp8_run(BK, fp8),
        **_int4_args(w_gate_up, shared, n_experts, 2 * Fi, H, BK,
                     form_of(plan.int4_form, "expert_swiglu", 2 * Fi, H)))
    return h


def expert_down_triton(h, w_down, layout, n_experts: int, shared=None, plan: ProductPlan | None = None,
                       fold: Fold | None = None):
    """y [P, H] float32, the pairs' down products; with `fold` (a step's layout), (Normed, h) of
    the layer finished in the kernel (expert_down)."""
    P_, Fi = h.shape
    wv = values_of(w_down)
    H = w_down.shape[0] // n_experts
    fp8 = isinstance(w_down, BlockFP8)
    assert w_down.shape == (n_experts * H, Fi) and wv.is_contiguous() and h.stride(1) == 1
    assert _fp8_ok(w_down, H), "FP8 experts need 128-row aligned down parts"
    expert, pairs, P, bm, blocks, step, bp, laid = _layout_args(layout)
    plan = plan or default_products(h.device)
    int4 = (H, Fi, w_down.group) if isinstance(w_down, GroupInt4) else None
    BN, BK, warps, stages = tiles("down", step, fp8, h.element_size(), plan, int4, int4 is not None and w_down.interleaved,
                                  bm)
    if fp8:
        BN, BK, warps, stages = fp8_fit((BN, BK, warps, stages), Fi)
    y = torch.empty(P_, H, dtype=torch.float32, device=h.device)
    ws = w_down.scale if isinstance(w_down, (BlockFP8, GroupInt4)) else wv
    w2, ws2 = _shared_args(w_down, shared, H, Fi)
    kernel, folded, out = _down_kernel, {}, y
    if fold is not None:
        assert step, "the down kernel finishes the layer in a step only (a step's few rows)"
        kernel = _down_fold_kernel
        folded, out = _fold_args(fold, y, triton.cdiv(H, BN))
    kernel[(blocks, triton.cdiv(H, BN))](
        h, wv, ws, w2, ws2, expert, pairs, y, P, n_experts, H, Fi, h.stride(0), y.stride(0), ws.stride(0), **folded,
        BM=bm, BN=BN, BK=BK, STEP=step, BP=bp, SHARED=shared is not None, FP8=fp8, num_warps=warps,
        num_stages=stages, LAID=laid, **pdl(h), **(_widen(h, warps, BN, plan) if fp8 else {}), **fp8_run(BK, fp8),
        **_int4_args(w_down, shared, n_experts, H, Fi, BK, form_of(plan.int4_form, "expert_down", H, Fi)))
    return out


def _fold_args(fold: Fold, y: torch.Tensor, blocks: int) -> tuple[dict, tuple]:
    """_down_fold_kernel's arguments to finish the layer over `blocks` column blocks, and what it
    returns: (Normed, h), made here."""
    weights, shared, gate, r, nw, eps = fold
    check_combine(y, weights, shared, gate)
    T, H = r.shape
    assert weights.shape[0] == T and r.stride(1) == 1, f"the residual must be [{T}, {H}], rows contiguous"
    assert T <= STEP_ROWS, f"the down kernel finishes at most {STEP_ROWS} rows (a step's), got {T}"
    assert nw.shape == (H,) and nw.is_contiguous(), f"the norm's weight must be [{H}] contiguous"
    xn, h = (torch.empty(T, H, dtype=r.dtype, device=r.device) for _ in range(2))
    ss = torch.empty(T, blocks, dtype=torch.float32, device=r.device)
    args = dict(weights=weights, shared=shared if shared is not None else r, gate=gate if gate is not None else weights,
                r=r, nw=nw, xn=xn, hout=h, ss=ss,
                count=fold_count(r.device, blocks), T=T, s_s=shared.stride(0) if shared is not None else 0,
                s_r=r.stride(0), s_xn=xn.stride(0), s_hout=h.stride(0), s_ss=ss.stride(0),
                TOPK=weights.shape[1], HAS_SHARED=shared is not None, BT=STEP_ROWS)
    return args, (Normed(xn, ss, eps), h)


def fold_count(device: torch.device, blocks: int) -> torch.Tensor:
    """The folded down kernel's arrival counts on a device (int32, one a column block, left at 0 by
    every launch), apart from the split products' and the routing's (matvec.arrival_counts)."""
    return arrival_counts(device, blocks, "fold")


def check_combine(y, weights, shared, gate):
    """The combine's layout contract: y [T * k, H] float32 (rows contiguous), weights [T, k] and
    gate [T] float32 contiguous, shared [T, H] (rows contiguous)."""
    T, k = weights.shape
    H = y.shape[1]
    assert y.shape[0] == T * k and y.dtype == torch.float32 and y.stride(1) == 1, \
        f"combine: y {tuple(y.shape)} {y.dtype} must be float32 [{T} * {k}, H], rows contiguous"
    assert weights.dtype == torch.float32 and weights.is_contiguous(), "combine: weights must be float32 contiguous"
    assert (shared is None) == (gate is None), "combine: the shared expert's output comes with its gate"
    if shared is not None:
        assert shared.shape == (T, H) and shared.stride(1) == 1, \
            f"combine: shared {tuple(shared.shape)} must be [{T}, {H}]"
        assert gate.shape == (T,) and gate.dtype == torch.float32 and gate.is_contiguous(), \
            f"combine: gate {tuple(gate.shape)} must be float32 [{T}]"


COMBINE_COLUMNS = 512     # the combine kernel's columns a program (BH)


def combine_triton(y, weights, shared=None, gate=None, dtype=torch.bfloat16, fold: Fold | None = None):
    """The combine [T, H] in dtype; with `fold` (its weights, shared and gate stand for the
    arguments), the layer finished: (Normed, h), h in the residual's dtype, the Normed's sums of h²
    one a block of COMBINE_COLUMNS columns (combine)."""
    if fold is not None:
        weights, shared, gate = fold.weights, fold.shared, fold.gate
    check_combine(y, weights, shared, gate)
    T, k = weights.shape
    H = y.shape[1]
    BH = COMBINE_COLUMNS
    blocks = triton.cdiv(H, BH)
    normed = {}
    if fold is not None:
        r, nw, eps = fold.residual, fold.norm_weight, fold.eps
        assert r.shape == (T, H) and r.stride(1) == 1, f"the residual must be [{T}, {H}], rows contiguous"
        assert nw.shape == (H,) and nw.is_contiguous(), f"the norm's weight must be [{H}] contiguous"
        dtype = r.dtype
        xn = torch.empty(T, H, dtype=dtype, device=y.device)
        ss = torch.empty(T, blocks, dtype=torch.float32, device=y.device)
        normed = dict(NORM=True, res=r, nw=nw, xn=xn, ss=ss, s_r=r.stride(0), s_xn=xn.stride(0), s_ss=ss.stride(0))
    out = torch.empty(T, H, dtype=dtype, device=y.device)
    _combine_kernel[(T, blocks)](
        y, weights, shared if shared is not None else y, gate if gate is not None else weights, out, H,
        y.stride(0), shared.stride(0) if shared is not None else 0, out.stride(0),
        TOPK=k, BH=BH, HAS_SHARED=shared is not None, num_warps=4, **pdl(y), **normed)
    return out if fold is None else (Normed(normed["xn"], normed["ss"], fold.eps), out)


# --- dispatch ----------------------------------------------------------------------------------

def expert_swiglu(x, w_gate_up, layout, top_k: int, n_experts: int, rowwise: bool,
                  reads: torch.Tensor | None = None, shared=None, plan: ProductPlan | None = None) -> torch.Tensor:
    """`reads`: in a step, the distinct routed experts read are added to it. `shared`: the shared
    expert's gate|up, as expert n_experts. `plan`: the tiles and how FP8 tiles widen (kernels/plan.py).
    x: rows, or on the GPU a Normed (a step's norm before the layer left in two pieces)."""
    if isinstance(x, Normed) or use_triton(x, values_of(w_gate_up)):
        return expert_swiglu_triton(x, w_gate_up, layout, top_k, n_experts, reads, shared, plan)
    layout = layout.expand(n_experts + (shared is not None)) if isinstance(layout, StepLayout) else layout
    if reads is not None and rowwise:
        count_reads(layout, reads, n_experts)
    return expert_swiglu_ref(x, w_gate_up, layout, top_k, n_experts, rowwise, shared)


def expert_down(h, w_down, layout, n_experts: int, rowwise: bool, shared=None,
                plan: ProductPlan | None = None, fold: Fold | None = None):
    """y [P, H] float32; with `fold`, the layer finished: the combine, the residual add and the
    norm's two pieces for the next product (Normed, h), in the down kernel on the GPU (fold_ref
    otherwise)."""
    if use_triton(h, values_of(w_down)):
        return expert_down_triton(h, w_down, layout, n_experts, shared, plan, fold)
    layout = layout.expand(n_experts + (shared is not None)) if isinstance(layout, StepLayout) else layout
    y = expert_down_ref(h, w_down, layout, n_experts, rowwise, shared)
    return y if fold is None else fold_ref(y, fold)


def combine(y, weights, shared=None, gate=None, dtype=torch.float32, fold: Fold | None = None):
    """The combine [T, H] in dtype; with `fold`, the layer finished there: (Normed, h) (the plan's
    combine_normed; fold_ref on a CPU)."""
    if use_triton(y):
        return combine_triton(y, weights, shared, gate, dtype, fold)
    if fold is not None:
        return fold_ref(y, fold)
    return combine_ref(y, weights, shared, gate, dtype)
