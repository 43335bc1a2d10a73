"""probe_int4_gluon.py's form for block-scaled FP8 weights (kernels/fp8.py BlockFP8): an FP8 product
of a few rows in Gluon whose weight bytes load straight into the registers of mma.m16n8k16's A
operand, widened there to bf16 by the engine's bit form (kernels/fp8.py: sign to bit 15, exponent
and mantissa to bits 4..10, times 2^120), with no shared memory. The lead of docs/PERFORMANCE.md's
FP8 sections: the engine's Triton FP8 products run at 1.2-1.6 x their bytes on the 27B.

The words (`pack`): lane (g, q) of a warp holds, for each 32-wide span of K, the bytes of rows g
and g + 8 of its 16 at k = 2q + j0 + 8 j1 + 16 j2, four words: word (j2, j1) holds bytes (row g,
k), (row g, k + 1), (row g + 8, k), (row g + 8, k + 1), which are the operand's a0 a1 / a2 a3
registers. R = 4 spans a step (128 columns: one scale block) are 64 contiguous bytes a thread,
the columns in gluon_gemv.slots order. The programs, the split, the steps in flight and
the variants are the 4-bit probe's; each step's sum is scaled once in float32 by each row's block
scale.

    cd tests/bench && python3 probe_fp8_gluon.py                  # GPU: against float32, then timed
    cd tests/bench && python3 probe_fp8_gluon.py --compile-only   # no GPU: shared memory, PTX counts

Checked on the GPU as the 4-bit probe checks (float32 of the dequantized weight; row 0's bits at T
= 1 and 8), timed beside the engine's FP8 product of each of the 27B's shapes. Measured on an H200
(docs/PERFORMANCE.md, 2026-11-28 (eighth)): its best variants 1.2-1.7 x the engine's time at
every shape; kept as the record of that form.
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

BLOCK = 128      # the scale block, and the K of a step
SCALE_BLOCK = gl.constexpr(BLOCK)
ROWS = 8         # the most tokens (mma's N)


def layouts(W: int, R: int, MT: int = 1):
    """The MMA accumulator, its operands, x's tile as loaded (gluon_gemv.x_layout) and the words'
    layout [MT, W, 8, R, 4 (q), 4 (j2 j1)]: the four words of a span, the R spans and a warp's MT
    tiles of 16 rows (tile r W + w for warp w) in a thread's registers, lanes (q, g)."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    a = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 2]] + [[0, 0, 0, 1 << i, 0, 0] for i in range((R - 1).bit_length())]
        + [[1 << i, 0, 0, 0, 0, 0] for i in range((MT - 1).bit_length())],
        lane_bases=[[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 2, 0], [0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0], [0, 0, 4, 0, 0, 0]],
        warp_bases=[[0, 1 << i, 0, 0, 0, 0] for i in range((W - 1).bit_length())], block_bases=[],
        shape=[MT, W, 8, R, 4, 4])
    return mma, a, b, x_layout(W), words


@gluon.jit
def _widen(z):
    # a pair of equal words -> bf16x2 of its bytes 0 and 1 (kernels/fp8.py's bit form, as its _x2)
    return gl.inline_asm_elementwise(
        "{ .reg .b32 a, b, k, z; mov.b32 k, 0x7B807B80; mov.b32 z, 0x80008000; "
        "prmt.b32 a, $1, 0, 0x1404; and.b32 b, a, 0x7FFF7FFF; shr.b32 b, b, 4; "
        "lop3.b32 b, b, 0x80008000, a, 0xF8; fma.rn.bf16x2 $0, b, k, z; }",
        "=r,r,r", [z], dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def _operand(words, W: gl.constexpr, R: gl.constexpr, MT: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
             LA: gl.constexpr):
    m = gl.join(words, words >> 16)                           # [MT, W, 8, R, 4, (j2 j1), m3]: rows g, g + 8
    z = _widen(gl.join(m, m))                                 # [..., m3, j0]
    z = gl.reshape(z, [MT, W, 8, R, 4, 2, 2, 2, 2])           # (j2 j1) -> j2, j1
    z = gl.permute(z, (0, 1, 7, 2, 3, 5, 6, 4, 8))            # [MT, W, m3, 8, R, j2, j1, 4, j0]
    return gl.convert_layout(gl.reshape(z, [BM, BK]), LA, assert_trivial=True)


@gluon.jit
def _step(p_w, p_x, m_x, p_s, k, R: gl.constexpr):
    # a step's operands at column k: the words, x's tile (the B operand) and the rows' scales
    return (gl.load(p_w + gl.multiple_of(k // 32 * 4, 4 * R)), gl.load(p_x + gl.multiple_of(k, 128), mask=m_x, other=0.),
            gl.load(p_s + k // SCALE_BLOCK))


@gluon.jit
def _mma_step(acc, words, b, sc, W: gl.constexpr, R: gl.constexpr, MT: gl.constexpr, BM: gl.constexpr,
              BK: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr):
    part = mma_v2(_operand(words, W, R, MT, BM, BK, LA), _x_operand(b, BK, LB), gl.zeros([BM, 8], gl.float32, MMA))
    return acc + part * sc[:, None]


@gluon.jit
def fp8_gemv(x, w, s, y, ws, count, T, N, K, KC, KS, s_x, s_y, s_s, W: gl.constexpr, R: gl.constexpr,
             MT: gl.constexpr, DEPTH: gl.constexpr, S: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr,
             LB: gl.constexpr, LX: gl.constexpr, LW: gl.constexpr):
    # the programs, the split and the steps in flight as probe_int4_gluon.w4_gemv's
    BM: gl.constexpr = 16 * W * MT
    BK: gl.constexpr = 32 * R
    pid, i_n, k_lo, k_hi, last = _part(K, KS, S, BK)
    # pack()'s P[nt, g, q, kc, (j2 j1)]
    L5: gl.constexpr = gl.SliceLayout(5, LW)
    L4: gl.constexpr = gl.SliceLayout(4, L5)
    qi = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L5)))))
    ji = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LW))))))
    nt, gi, ri = _tiles(i_n, L4, MT, W, R)                                        # nt [MT, W]
    row = (nt[:, :, None] * 8 + gi[None, None, :]) * 4                                # [MT, W, 8]
    o_w = (row[:, :, :, None] * (KC * 4) + ri[None, None, None, :] * 4)[:, :, :, :, None] + qi[None, None, None, None, :] * (KC * 4)
    p_w = w + o_w[:, :, :, :, :, None] + ji[None, None, None, None, None, :]
    # x's tile, a lane's 32 columns contiguous (gluon_gemv.x_layout)
    p_x, m_x = _x_pointers(x, T, s_x, LX)
    ns = i_n * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    p_s = s + (ns // SCALE_BLOCK) * s_s
    acc = gl.zeros([BM, 8], gl.float32, MMA)
    if DEPTH == 0:
        for k0 in range(k_lo, k_hi, BK):
            words, b, sc = _step(p_w, p_x, m_x, p_s, k0, R)
            acc = _mma_step(acc, words, b, sc, W, R, MT, BM, BK, MMA, LA, LB)
    elif DEPTH == 1:
        words, b, sc = _step(p_w, p_x, m_x, p_s, k_lo, R)
        for k0 in range(k_lo, k_hi, BK):
            words1, b1, sc1 = _step(p_w, p_x, m_x, p_s, gl.minimum(k0 + BK, last), R)
            acc = _mma_step(acc, words, b, sc, W, R, MT, BM, BK, MMA, LA, LB)
            words, b, sc = words1, b1, sc1
    else:
        words, b, sc = _step(p_w, p_x, m_x, p_s, k_lo, R)
        words1, b1, sc1 = _step(p_w, p_x, m_x, p_s, gl.minimum(k_lo + BK, last), R)
        for k0 in range(k_lo, k_hi, BK):
            words2, b2, sc2 = _step(p_w, p_x, m_x, p_s, gl.minimum(k0 + 2 * BK, last), R)
            acc = _mma_step(acc, words, b, sc, W, R, MT, BM, BK, MMA, LA, LB)
            words, b, sc = words1, b1, sc1
            words1, b1, sc1 = words2, b2, sc2
    _finish(acc, y, ws, count, pid, i_n, T, N, s_y, ns, BM, S, MMA)


def pack(w8: torch.Tensor) -> torch.Tensor:
    """e4m3 weights [N, K] -> the words P [N/16, 8, 4, K/32, 4] int32: byte 2 h + j0 of word
    [nt, g, q, kc, 2 j2 + j1] is row 16 nt + 8 h + g, slot k = 32 kc + 16 j2 + 8 j1 + 2 q + j0, which
    holds column slots(K)[k] (gluon_gemv.slots: a lane's x columns contiguous)."""
    N, K = w8.shape
    assert N % 16 == 0 and K % BLOCK == 0, "N a multiple of 16, K of 128"
    b = w8.view(torch.uint8)[:, slots(K, w8.device)].reshape(N // 16, 2, 8, K // 32, 2, 2, 4, 2)      # nt, h, g, kc, j2, j1, q, j0
    b = b.permute(0, 2, 6, 3, 4, 5, 1, 7).contiguous()                      # nt, g, q, kc, j2, j1, h, j0
    return b.view(N // 16, 8, 4, K // 32, 4, 4).view(torch.int32).view(N // 16, 8, 4, K // 32, 4)


def unpack(P: torch.Tensor) -> torch.Tensor:
    """pack's inverse: the bytes [N, K] as uint8."""
    NT, _, _, KC, _ = P.shape
    b = P.contiguous().view(torch.uint8).view(NT, 8, 4, KC, 2, 2, 2, 2)    # nt, g, q, kc, j2, j1, h, j0
    return unslot(b.permute(0, 6, 1, 3, 4, 5, 2, 7).reshape(NT * 16, KC * 32))


def run(x: torch.Tensor, P: torch.Tensor, scale: torch.Tensor, variant: tuple, out: torch.Tensor | None = None
        ) -> torch.Tensor:
    W, R, MT, depth, _ = variant
    T, K = x.shape
    N = P.shape[0] * 16
    assert T <= ROWS and R * 32 == BLOCK and K % BLOCK == 0 and N % (16 * W * MT) == 0
    assert x.stride(1) == 1 and scale.stride(1) == 1
    y = out if out is not None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    grid, S, KS, ws, count = programs(N, K, variant, x.device)
    mma, a, b, lx, lw = layouts(W, R, MT)
    fp8_gemv[grid](x, P, scale, y, ws, count, T, N, K, K // 32, KS, x.stride(0), y.stride(0), scale.stride(0), W=W,
                   R=R, MT=MT, DEPTH=depth, S=S, MMA=mma, LA=a, LB=b, LX=lx, LW=lw, num_warps=W)
    return y


def main():
    compile_only, variants = parse_args()
    if compile_only:
        return compile_variants(fp8_gemv, layouts, {**SIGNATURE, "s_s": "i32"},
                                ("x", "w", "s", "y", "ws", "KC", "KS", "s_x", "s_y", "s_s"), (90, 89),
                                ("ld.global.v4", "ld.global.b32", "prmt.b32", "fma.rn.bf16x2", "mma.sync", "ld.shared",
                                 "shfl", "atom"), variants)
    from probe_int4_libraries import SHAPES, copies_for
    from mtpchat.kernels import fp8
    bw, plan, gen = gpu_setup()
    for name, N, K, kind in SHAPES:
        q = fp8.quantize_ref(torch.randn(N, K, device="cuda", generator=gen) * 0.02)
        P = pack(q.w)
        assert torch.equal(unpack(P), q.w.view(torch.uint8)), "pack / unpack"
        x = torch.randn(ROWS, K, device="cuda", generator=gen).to(torch.bfloat16)
        nbytes = P.nbytes + q.scale.nbytes
        copies = copies_for(nbytes)
        Ps = [P] + [torch.randint_like(P, -2 ** 31, 2 ** 31 - 1) & 0x7E7E7E7E for _ in range(copies - 1)]   # no NaN bytes
        Ss = [q.scale] + [q.scale.clone() for _ in range(copies - 1)]
        ws = [q] + [fp8.BlockFP8(Pi.view(torch.uint8).view(N, K).view(fp8.FP8), Si) for Pi, Si in zip(Ps[1:], Ss[1:])]
        product = engine_product(kind, plan)
        time_shape(f"{name} [{N} x {K}] (ours: {kind})", nbytes / bw * 1e6, lambda xt, i: product(xt, ws[i]),
                   lambda xt, i, v: run(xt, Ps[i], Ss[i], v), x.float() @ fp8.dequantize_ref(q).T, x, copies, variants)


if __name__ == "__main__":
    main()
