"""A 4-bit product of a few rows written in Gluon (Triton's layout-explicit language), where the
words go from global memory straight into the registers of the matrix instruction's operand: no
shared memory, no `ldmatrix`, no layout conversion, so the unpacking of one step overlaps the
loads of the others through the warps an SM holds rather than through a copy pipeline. A probe of
the lead named in docs/PERFORMANCE.md (2026-11-27 (late), "Where the SwiGLU waits"): the
engine's Triton products spend their time with the copies and the unpacking in turn.

The form (`w4_gemv`): y [T, N] = x [T, K] @ w [N, K]ᵀ for T <= 8, w symmetric 4-bit in groups of
128 with float32 scales. A warp takes MT tiles of 16 weight rows (the M of mma.m16n8k16), the
tokens are its N (8), and a program of W warps loops over its part of K (a split over S parts, the
last to arrive adding them in order) in steps of 128 (one group: each step's sum is scaled once in
float32), DEPTH steps' operands in flight ahead. The words are stored in the operand's order
(`pack`): lane (g, q) of a warp holds, for rows g and g + 8 of a tile, the eight k of a 32-wide span
that mma's A operand gives it (2q, 2q + 1, 2q + 8, 2q + 9, 2q + 16, ...), a nibble pair (k, k + 1)
at bits s and s + 16 of one word, so two instructions (a lop3 into the mantissa of 128.0, an fma
taking 136 away) widen a pair to bf16x2; the columns are packed in the order (`slots`) that makes a
lane's 32 columns of x contiguous, so x's tile comes in 16-byte loads too. Gluon checks that the
unpacked tile is already in the operand's layout (assert_trivial). Variants: W x R [m MT] [p | pp]
[/ the warps an SM a split aims at].

Measured on an H200 (docs/PERFORMANCE.md, 2026-11-28 (eighth)): its best variants 1.5-1.8 x the
time of the engine's Triton products at every shape of the 27B, the wide products included; the bytes in
flight live in registers (97-168 a thread), which bounds the warps an SM holds. Kept as the record
of that form.
    cd tests/bench && python3 probe_int4_gluon.py                  # GPU: against float32, then timed
    cd tests/bench && python3 probe_int4_gluon.py --compile-only   # no GPU: shared memory and PTX counts, sm_90 and sm_80

Checked on the GPU: the product against float32 of the dequantized weight, and row 0's bits the
same at T = 1 and T = 8 (MTP's exactness needs a row's result independent of the rows beside it).
Timed as probe_int4_libraries.py times (graph replays over weights rotated past L2), beside the
engine's product of each shape (plain, SwiGLU or split) and the copy rate's floor.
"""
from __future__ import annotations

import sys

import torch
from gluon_gemv import (SIGNATURE, _finish, _part, _tiles, _x_operand, _x_pointers, compile_variants, engine_product,
                        gpu_setup, parse_args, programs, slots, time_shape, unslot, x_layout)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError as e:            # a Triton without Gluon (before 3.5)
    sys.exit(f"this probe needs Triton's Gluon (triton.experimental.gluon): {e}")

G = 128          # the group, and the K of a step
GROUP = gl.constexpr(G)
ROWS = 8         # the most tokens (mma's N)


def layouts(W: int, R: int, MT: int = 1):
    """The MMA accumulator, its A and B operands, and the words' layout [MT, W, 8, R, 4]: lanes (q,
    g), the R spans of a row half and a warp's MT tiles of 16 rows (tile r W + w for warp w) in a
    thread's registers."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    return mma, a, b, x_layout(W), gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1 << i, 0] for i in range((R - 1).bit_length())]
        + [[1 << i, 0, 0, 0, 0] for i in range((MT - 1).bit_length())],
        lane_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 0, 4, 0, 0]],
        warp_bases=[[0, 1 << i, 0, 0, 0] for i in range((W - 1).bit_length())], block_bases=[],
        shape=[MT, W, 8, R, 4])


@gluon.jit
def _half(words):
    # bits 16 j0 + 4 (j1 + 2 j2) of a word hold k = 2q + j0 + 8 j1 + 16 j2 of its span: shifted so
    # that a pair's nibbles sit at bits 0 and 16, joined over j2 then j1 (the pair joins last)
    return gl.join(gl.join(words, words >> 8), gl.join(words >> 4, words >> 12))     # [..., j2, j1]


@gluon.jit
def _widen(z):
    # a pair of equal words -> bf16x2 (n0 - 8, n1 - 8) of the nibbles at bits 0 and 16: or-ed into
    # the mantissa of 128.0, then 136 taken away, exact in bf16 (fma.rn.bf16x2: sm_80 and later)
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t, one, c; mov.b32 one, 0x3F803F80; mov.b32 c, 0xC308C308; "
        "lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 $0, t, one, c; }",
        "=r,r,r", [z], dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def _operand(lo, hi, BM: gl.constexpr, BK: gl.constexpr, LA: gl.constexpr):
    m = gl.join(_half(lo), _half(hi))                        # [MT, W, 8, R, 4, j2, j1, m3]
    z = _widen(gl.join(m, m))                                 # [..., m3, j0]
    z = gl.permute(z, (0, 1, 7, 2, 3, 5, 6, 4, 8))            # [MT, W, m3, 8, R, j2, j1, 4, j0]
    return gl.convert_layout(gl.reshape(z, [BM, BK]), LA, assert_trivial=True)


@gluon.jit
def _step(p_lo, p_hi, p_x, m_x, p_s, k, R: gl.constexpr):
    # a step's operands at column k: the words, x's tile and the rows' scales
    kc = gl.multiple_of(k // 32, R)                                   # (keeps the 16-byte loads)
    return (gl.load(p_lo + kc), gl.load(p_hi + kc), gl.load(p_x + gl.multiple_of(k, 128), mask=m_x, other=0.),
            gl.load(p_s + k // GROUP))


@gluon.jit
def _mma_step(acc, lo, hi, b, sc, BM: gl.constexpr, BK: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr,
              LB: gl.constexpr):
    part = mma_v2(_operand(lo, hi, BM, BK, LA), _x_operand(b, BK, LB), gl.zeros([BM, 8], gl.float32, MMA))
    return acc + part * sc[:, None]


@gluon.jit
def w4_gemv(x, w, s, y, ws, count, T, N, K, KC, KS, s_x, s_y, W: gl.constexpr, R: gl.constexpr,
            MT: gl.constexpr, DEPTH: gl.constexpr, S: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr,
            LB: gl.constexpr, LX: gl.constexpr, LW: gl.constexpr):
    # program pid: rows of block pid // S, K from (pid % S) KS to the lesser of that + KS and K; a
    # warp MT tiles of 16 rows beside one x tile; DEPTH steps' operands (words, x, scales) in flight
    # ahead of the one multiplied; with S > 1 each part leaves its float32 sums in ws[pid] and the
    # last of a block's S parts to arrive adds them in order (its acq_rel add, after every thread
    # has stored, orders the parts before its reads: _finish)
    BM: gl.constexpr = 16 * W * MT
    BK: gl.constexpr = 32 * R
    pid, i_n, k_lo, k_hi, last = _part(K, KS, S, BK)
    # the words, pack()'s P[nt, h, g, q, kc]: a tile's rows 0..7 (h 0) and 8..15 (h 1)
    L4: gl.constexpr = gl.SliceLayout(4, LW)
    qi = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LW)))))
    nt, gi, ri = _tiles(i_n, L4, MT, W, R)                                        # nt [MT, W]
    row = (nt[:, :, None] * 16 + gi[None, None, :]) * 4                               # [MT, W, 8]
    p_lo = w + (row[:, :, :, None] * KC + ri[None, None, None, :])[:, :, :, :, None] + qi[None, None, None, None, :] * KC
    p_hi = p_lo + 32 * KC
    # x's tile, a lane's 32 columns contiguous (x_layout)
    p_x, m_x = _x_pointers(x, T, s_x, LX)
    ns = i_n * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    p_s = s + ns * (K // GROUP)
    acc = gl.zeros([BM, 8], gl.float32, MMA)
    if DEPTH == 0:
        for k0 in range(k_lo, k_hi, BK):
            lo, hi, b, sc = _step(p_lo, p_hi, p_x, m_x, p_s, k0, R)
            acc = _mma_step(acc, lo, hi, b, sc, BM, BK, MMA, LA, LB)
    elif DEPTH == 1:
        lo, hi, b, sc = _step(p_lo, p_hi, p_x, m_x, p_s, k_lo, R)
        for k0 in range(k_lo, k_hi, BK):
            lo1, hi1, b1, sc1 = _step(p_lo, p_hi, p_x, m_x, p_s, gl.minimum(k0 + BK, last), R)
            acc = _mma_step(acc, lo, hi, b, sc, BM, BK, MMA, LA, LB)
            lo, hi, b, sc = lo1, hi1, b1, sc1
    else:
        lo, hi, b, sc = _step(p_lo, p_hi, p_x, m_x, p_s, k_lo, R)
        lo1, hi1, b1, sc1 = _step(p_lo, p_hi, p_x, m_x, p_s, gl.minimum(k_lo + BK, last), R)
        for k0 in range(k_lo, k_hi, BK):
            lo2, hi2, b2, sc2 = _step(p_lo, p_hi, p_x, m_x, p_s, gl.minimum(k0 + 2 * BK, last), R)
            acc = _mma_step(acc, lo, hi, b, sc, BM, BK, MMA, LA, LB)
            lo, hi, b, sc = lo1, hi1, b1, sc1
            lo1, hi1, b1, sc1 = lo2, hi2, b2, sc2
    _finish(acc, y, ws, count, pid, i_n, T, N, s_y, ns, BM, S, MMA)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Values q [N, K] in 0..15 (weight = (q - 8) * scale) -> the words P [N/16, 2, 8, 4, K/32] int32
    in the operand's order: row n = 16 nt + 8 h + g, slot k = 32 kc + 16 j2 + 8 j1 + 2 q + j0 at bits
    16 j0 + 4 (j1 + 2 j2) of word [nt, h, g, q, kc]; slot k holds column slots(K)[k]."""
    N, K = q.shape
    assert N % 16 == 0 and K % G == 0, "N a multiple of 16, K of 128"
    v = q[:, slots(K, q.device)].to(torch.int64).view(N // 16, 2, 8, K // 32, 2, 2, 4, 2)        # nt, h, g, kc, j2, j1, q, j0
    v = v.permute(0, 1, 2, 6, 3, 7, 4, 5)                                  # nt, h, g, q, kc, j0, j2, j1
    shifts = 4 * torch.arange(8, device=q.device)                           # slot 4 j0 + 2 j2 + j1
    words = (v.reshape(*v.shape[:5], 8) << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).contiguous()


def unpack(P: torch.Tensor) -> torch.Tensor:
    """pack's inverse: [N, K] values."""
    NT, _, _, _, KC = P.shape
    shifts = 4 * torch.arange(8, device=P.device)
    v = (P.to(torch.int64)[..., None] >> shifts) & 15                       # nt, h, g, q, kc, slot
    v = v.view(NT, 2, 8, 4, KC, 2, 2, 2).permute(0, 1, 2, 4, 6, 7, 3, 5)   # nt, h, g, kc, j2, j1, q, j0
    return unslot(v.reshape(NT * 16, KC * 32))


def run(x: torch.Tensor, P: torch.Tensor, scale: torch.Tensor, variant: tuple, out: torch.Tensor | None = None
        ) -> torch.Tensor:
    W, R, MT, depth, _ = variant
    T, K = x.shape
    N = P.shape[0] * 16
    assert T <= ROWS and K % (32 * R) == 0 and R * 32 == G and N % (16 * W * MT) == 0 and x.stride(1) == 1
    y = out if out is not None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    grid, S, KS, ws, count = programs(N, K, variant, x.device)
    mma, a, b, lx, lw = layouts(W, R, MT)
    w4_gemv[grid](x, P, scale, y, ws, count, T, N, K, K // 32, KS, x.stride(0), y.stride(0), W=W, R=R, MT=MT,
                  DEPTH=depth, S=S, MMA=mma, LA=a, LB=b, LX=lx, LW=lw, num_warps=W)
    return y


def main():
    compile_only, variants = parse_args()
    if compile_only:
        return compile_variants(w4_gemv, layouts, SIGNATURE, ("x", "w", "s", "y", "ws", "KC", "KS", "s_x"), (90, 80),
                                ("ld.global.v4", "ld.global.b32", "lop3.b32", "fma.rn.bf16x2", "mma.sync", "ld.shared",
                                 "shfl", "atom"), variants)
    time_shapes(run, variants)


def time_shapes(run_variant, variants):
    """The 27B's four 4-bit shapes (probe_int4_libraries.SHAPES): random weights in pack()'s words,
    each variant `run_variant(x, P, scale, variant)` timed beside the engine's product of the same
    values (gluon_gemv.time_shape); a shared harness of the probes of this form."""
    from probe_int4_libraries import SHAPES, copies_for
    from mtpchat.kernels import int4
    bw, plan, gen = gpu_setup()
    for name, N, K, kind in SHAPES:
        q = torch.randint(0, 16, (N, K), device="cuda", generator=gen, dtype=torch.int32)
        scale = torch.rand(N, K // G, device="cuda", generator=gen) * 0.02 + 0.005
        P = pack(q)
        assert torch.equal(unpack(P), q.to(torch.int64)), "pack / unpack"
        dense = ((q - 8).float().view(N, K // G, G) * scale[..., None]).view(N, K)
        x = torch.randn(ROWS, K, device="cuda", generator=gen).to(torch.bfloat16)
        nbytes = P.nbytes + scale.nbytes
        copies = copies_for(nbytes)
        Ps = [P] + [torch.randint_like(P, -2 ** 31, 2 ** 31 - 1) for _ in range(copies - 1)]
        Ss = [scale] + [scale.clone() for _ in range(copies - 1)]       # the scales past L2 too
        ours = int4.interleave_ref(int4.quantize_ref(dense))
        wq = [ours] + [int4.GroupInt4(torch.randint_like(ours.w, -2 ** 15, 2 ** 15), ours.scale.clone(), *ours[2:])
                       for _ in range(copies - 1)]
        product = engine_product(kind, plan)
        time_shape(f"{name} [{N} x {K}] (ours: {kind})", nbytes / bw * 1e6, lambda xt, i: product(xt, wq[i]),
                   lambda xt, i, v: run_variant(xt, Ps[i], Ss[i], v), x.float() @ dense.T, x, copies, variants)

if __name__ == "__main__":
    main()
