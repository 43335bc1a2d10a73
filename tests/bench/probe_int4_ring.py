"""The register-direct 4-bit product of probe_int4_gluon.py with its words and x's tile staged
through a ring in shared memory: each thread copies its own 16-byte runs of words (`cp.async`) into
a ring DEPTH steps deep, and after the copy group's wait reads them back in the mma operand's
order (no `ldmatrix`, no layout change); x's tile comes through the same ring, the rows' scales a
step ahead in registers. The lead docs/PERFORMANCE.md named after the register-direct form was
dropped (2026-11-28, eighth): there the bytes in flight lived in registers and bounded the warps an
SM holds; here they live in shared memory, as in the engine's Triton products, whose unpacking
takes another path (`ldmatrix` of the words, then a layout change into the operand).

    cd tests/bench && python3 probe_int4_ring.py [--variants 4x4d4/32,...]   # GPU: against float32, timed
    cd tests/bench && python3 probe_int4_ring.py --compile-only             # no GPU: sm_90 and sm_80

A variant is W x R [m MT] [g NG] d DEPTH [/ warps an SM a split over K aims at]: W warps a
program, MT tiles of 16 rows a warp, steps of NG groups of 32 R columns (R = 4: a group of 128),
DEPTH steps in the ring (a power of two).
Checked on the GPU as probe_int4_gluon.py checks (float32 of the dequantized weight; row 0's bits
at T = 1 and 8), timed beside the engine's product of each shape.
"""
from __future__ import annotations

import sys

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError as e:            # a Triton without Gluon (before 3.5)
    sys.exit(f"this probe needs Triton's Gluon (triton.experimental.gluon): {e}")

from gluon_gemv import SIGNATURE, _finish, _part, _tiles, compile_variants, parse_args, programs
from probe_int4_gluon import GROUP, ROWS, G, layouts, time_shapes, _mma_step

# the copy into shared memory: async_load from Triton 3.7, async_copy_global_to_shared before
_copy = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier      # (renamed in Triton 3.7)


def ring_layouts(W: int, R: int, MT: int = 1):
    """probe_int4_gluon.layouts', and the rings': the words' [DEPTH, MT, W, 8, R, 4] with a thread's R
    words contiguous (16 bytes), x's [DEPTH, 8, 4, 32] row-major, and the layout x's copy takes
    (each thread 16 bytes of the tile: 8 columns)."""
    mma, a, b, lx, lw = layouts(W, R, MT)
    words = gl.SwizzledSharedLayout(4, 1, 1, order=[3, 4, 2, 1, 0])       # a slot's; the ring's slots outermost
    xs = gl.SwizzledSharedLayout(8, 1, 1, order=[2, 1, 0])
    lxc = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[2, 4, 4], warps_per_cta=[W, 1, 1],
                           order=[2, 1, 0])
    return mma, a, b, lx, lw, words, xs, lxc


@gluon.jit
def _issue(lo_s, hi_s, x_s, slot, p_lo, p_hi, p_xc, m_xc, k, R: gl.constexpr, NG: gl.constexpr):
    # the NG groups from column k on, their words (each thread its own 16-byte runs) and x's tiles,
    # into the ring's `slot` (its NG entries), as one copy group
    for g in gl.static_range(NG):
        kc = gl.multiple_of((k + g * GROUP) // 32, R)
        _copy(lo_s.index(slot * NG + g), p_lo + kc)
        _copy(hi_s.index(slot * NG + g), p_hi + kc)
        _copy(x_s.index(slot * NG + g), p_xc + gl.multiple_of(k + g * GROUP, 128), mask=m_xc)
    async_copy.commit_group()


@gluon.jit
def _scales(p_s, k, NG: gl.constexpr):
    # the rows' scales of the NG (<= 4) groups from column k on (past NG: the last one again)
    g = k // GROUP
    return (gl.load(p_s + g), gl.load(p_s + g + min(1, NG - 1)), gl.load(p_s + g + min(2, NG - 1)),
            gl.load(p_s + g + min(3, NG - 1)))


@gluon.jit
def w4_ring(x, w, s, y, ws, count, T, N, K, KC, KS, s_x, s_y, W: gl.constexpr, R: gl.constexpr,
            MT: gl.constexpr, DEPTH: gl.constexpr, S: gl.constexpr, MMA: gl.constexpr, LA: gl.constexpr,
            LB: gl.constexpr, LX: gl.constexpr, LW: gl.constexpr, SW: gl.constexpr, SX: gl.constexpr,
            LXC: gl.constexpr, NG: gl.constexpr):
    # program pid: rows of block pid // S, K from (pid % S) KS on (gluon_gemv._part); the ring holds
    # DEPTH steps, DEPTH - 1 of them in flight while one is multiplied; the parts as w4_gemv's
    BM: gl.constexpr = 16 * W * MT
    BK: gl.constexpr = 32 * R * NG
    pid, i_n, k_lo, k_hi, last = _part(K, KS, S, BK)
    L4: gl.constexpr = gl.SliceLayout(4, LW)
    qi = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LW)))))
    nt, gi, ri = _tiles(i_n, L4, MT, W, R)
    row = (nt[:, :, None] * 16 + gi[None, None, :]) * 4
    p_lo = w + (row[:, :, :, None] * KC + ri[None, None, None, :])[:, :, :, :, None] + qi[None, None, None, None, :] * KC
    p_hi = p_lo + 32 * KC
    # x's tile as the copy takes it: thread (row, q, c) 8 columns 32 q + 8 c of row `row`, rows past T zero
    tc = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, LXC)))
    qc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LXC)))
    ic = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, LXC)))
    p_xc = x + (tc[:, None] * s_x + qc[None, :] * 32)[:, :, None] + ic[None, None, :]
    m_xc = tc[:, None, None] < T                       # (broadcast by the copy: one value a 16-byte run)
    ns = i_n * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    p_s = s + ns * (K // GROUP)
    lo_s = gl.allocate_shared_memory(gl.int32, [DEPTH * NG, MT, W, 8, R, 4], SW)
    hi_s = gl.allocate_shared_memory(gl.int32, [DEPTH * NG, MT, W, 8, R, 4], SW)
    x_s = gl.allocate_shared_memory(x.dtype.element_ty, [DEPTH * NG, 8, 4, 32], SX)
    for i in gl.static_range(DEPTH - 1):
        _issue(lo_s, hi_s, x_s, i, p_lo, p_hi, p_xc, m_xc, gl.minimum(k_lo + i * BK, last), R, NG)
    s0, s1, s2, s3 = _scales(p_s, k_lo, NG)
    acc = gl.zeros([BM, 8], gl.float32, MMA)
    steps = (k_hi - k_lo) // BK
    for it in range(steps):
        k0 = k_lo + it * BK
        # the step DEPTH - 1 ahead into the slot the step before this one was read from (past the
        # part's end: its last step again, never read)
        _issue(lo_s, hi_s, x_s, (it + DEPTH - 1) % DEPTH, p_lo, p_hi, p_xc, m_xc,
               gl.minimum(k0 + (DEPTH - 1) * BK, last), R, NG)
        n0, n1, n2, n3 = _scales(p_s, gl.minimum(k0 + BK, last), NG)      # the next step's, ahead
        async_copy.wait_group(DEPTH - 1)
        _barrier()          # x's tile was copied by other threads than read it
        slot = it % DEPTH
        for g in gl.static_range(NG):
            lo = lo_s.index(slot * NG + g).load(LW)
            hi = hi_s.index(slot * NG + g).load(LW)
            b = x_s.index(slot * NG + g).load(LX)
            if g == 0:
                sc = s0
            elif g == 1:
                sc = s1
            elif g == 2:
                sc = s2
            else:
                sc = s3
            acc = _mma_step(acc, lo, hi, b, sc, BM, GROUP, MMA, LA, LB)
        s0, s1, s2, s3 = n0, n1, n2, n3
        _barrier()          # every thread's reads of the slot done before it is copied into again
    async_copy.wait_group(0)
    _finish(acc, y, ws, count, pid, i_n, T, N, s_y, ns, BM, S, MMA)


def run(x: torch.Tensor, P: torch.Tensor, scale: torch.Tensor, variant: tuple, out: torch.Tensor | None = None
        ) -> torch.Tensor:
    W, R, MT, depth, _, NG = variant
    T, K = x.shape
    N = P.shape[0] * 16
    assert T <= ROWS and K % (32 * R * NG) == 0 and R * 32 == G and N % (16 * W * MT) == 0 and x.stride(1) == 1
    y = out if out is not None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    grid, S, KS, ws, count = programs(N, K // NG, variant[:5], x.device)    # (its steps: NG groups)
    KS *= NG
    mma, a, b, lx, lw, sw, sx, lxc = ring_layouts(W, R, MT)
    w4_ring[grid](x, P, scale, y, ws, count, T, N, K, K // 32, KS, x.stride(0), y.stride(0), W=W, R=R, MT=MT,
                  DEPTH=depth, S=S, MMA=mma, LA=a, LB=b, LX=lx, LW=lw, SW=sw, SX=sx, LXC=lxc, NG=NG, num_warps=W)
    return y


def compile_only(variants):
    """Each variant compiled for sm_90 and sm_80 without a GPU: shared memory, registers, PTX counts."""
    def more(variant):
        _, _, _, _, _, sw, sx, lxc = ring_layouts(*variant[:3])
        return {"SW": sw, "SX": sx, "LXC": lxc, "NG": variant[5]}
    compile_variants(w4_ring, layouts, SIGNATURE, ("x", "w", "s", "y", "ws", "K", "KC", "KS", "s_x"), (90, 80),
                     ("cp.async", "ld.shared.v4", "ld.shared", "bar.sync", "lop3.b32", "mma.sync", "ld.global"), variants,
                     more)


def main():
    only, variants = parse_args("4x4g4d2/32,4x4g4d4/32,2x4g4d4/32,2x4g2d4/32,4x4m2g4d2/32,8x4g2d4/32", ring=True)
    if only:
        return compile_only(variants)
    time_shapes(run, variants)

if __name__ == "__main__":
    main()
