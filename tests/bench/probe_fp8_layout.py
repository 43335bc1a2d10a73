"""Where the few-row FP8 products lose their bandwidth: the weights' layout and the K loop's step.

    cd tests/bench && python3 probe_fp8_layout.py            # on the GPU (--sweep: tiles; --bits: widening;
                                                              # --long: several scale blocks a step, narrow tiles)
    TRITON_INTERPRET=1 python3 probe_fp8_layout.py --check     # the forms' values, small, on the CPU

Every FP8 form probe_fp8.py tried (widened dot, chained dots, fp16, integer widening, no dot) landed
near 2.0 TB/s where bf16 reaches 2.85, and every one walked K 128 bytes a row at a time (one scale
block) over a row-major [N, K] weight. This probe varies just that, on one 16384 x 5120 product:

- the layout: row-major, or tiled (each program's [BN, BK] tile one contiguous run of bytes, the
  tiles of a column block one after another along K), as a load could re-lay the weights once;
- U: scale blocks a loop step (each its own tile load, dot and scale), so a step moves U x 8 KB;
- what is done with the bytes: the production dot, or only a running xor (what the loads alone cost).

Each form is timed for 1 and 4 rows (rows past T masked, as the engine's kernels do) in CUDA graphs of
20 launches over three weight copies (more than L2), against the bf16 product and a plain copy.
"""
from __future__ import annotations

import argparse

import torch
from graph_timing import graph_time

from mtpchat.engine.bench import copy_bandwidth
from mtpchat.kernels import fp8, matvec
from mtpchat.kernels._triton import tl, triton


@triton.jit(do_not_specialize=["T"])
def _probe(x, w, sw, y, T, K, s_sw, TILED: tl.constexpr, U: tl.constexpr, LOADS_ONLY: tl.constexpr,
           BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr = False):
    i_n = tl.program_id(0)
    KT = K // BK
    o_r, o_c, o_t = tl.arange(0, BN), tl.arange(0, BK), tl.arange(0, BT)
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    bits = tl.zeros([BN, BK], dtype=tl.int32)
    for k0 in range(0, K, U * BK):
        for u in tl.static_range(U):
            k = k0 + u * BK
            if TILED:
                p_w = w + ((i_n * KT + k // BK) * BN + o_r[:, None]) * BK + o_c[None, :]
            else:
                p_w = w + (i_n * BN + o_r[:, None]) * K + k + o_c[None, :]
            b_w = tl.load(p_w)
            if LOADS_ONLY:
                bits ^= b_w.to(tl.uint8, bitcast=True).to(tl.int32)
            else:
                b_x = tl.trans(tl.load(x + o_t[:, None] * K + k + o_c[None, :], mask=(o_t < T)[:, None], other=0.))
                b_s = tl.load(sw + (i_n * BN // 128) * s_sw + k // BK)
                b_v = fp8.widen(b_w, b_x, 4 if BITS else 0)         # BITS: the bit form, groups of 4
                acc += b_s * tl.dot(b_v, b_x, input_precision="ieee")
    if LOADS_ONLY:
        acc += tl.sum(bits, axis=1).to(tl.float32)[:, None]
    tl.store(y + o_t[None, :] * (tl.num_programs(0) * BN) + i_n * BN + o_r[:, None], acc, mask=(o_t < T)[None, :])


def tiled(w: torch.Tensor, BN: int, BK: int) -> torch.Tensor:
    N, K = w.shape
    return w.view(N // BN, BN, K // BK, BK).permute(0, 2, 1, 3).contiguous().view(N, K)


def launch(x, q: fp8.BlockFP8, w, y, T: int, TILED: bool, U: int, LOADS_ONLY: bool, stages: int, BN: int = 64,
           warps: int = 4, bits: bool = False):
    N, K = q.shape
    return _probe[(N // BN,)](x, w, q.scale, y, T, K, q.scale.stride(0), TILED=TILED, U=U, LOADS_ONLY=LOADS_ONLY,
                              BN=BN, BK=fp8.BLOCK, BT=16, BITS=bits, num_warps=warps, num_stages=stages)


def check(device: str, N: int = 256, K: int = 640):
    """Every dot form's values against the dequantized float32 product (fresh random inputs)."""
    g = torch.Generator().manual_seed(1)
    q = fp8.quantize_ref(torch.randn(N, K, generator=g))
    q = fp8.BlockFP8(q.w.to(device), q.scale.to(device))
    x = torch.randn(16, K, generator=g).to(device)      # float32: the interpreter's bf16 dot is not bf16's
    want = x.float() @ fp8.dequantize_ref(q).T
    for TILED in (False, True):
        for U in (1, 5):
            for T in (1, 4):
                y = torch.full((16, N), float("nan"), device=device)
                launch(x, q, tiled(q.w, 64, 128) if TILED else q.w, y, T, TILED, U, False, 2)
                err = ((y[:T] - want[:T]).norm() / want[:T].norm()).item()
                assert err < 1e-5, (TILED, U, T, err)
    print("check: every dot form equals the dequantized product")


def sweep(x, y, qs, N: int, K: int):
    """The production form (row-major, one scale block a step) under other tiles, warps and depths."""
    for BN in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (2, 3, 4, 6):
                def run(i, BN=BN, warps=warps, stages=stages):
                    return launch(x, qs[i], qs[i].w, y, 1, False, 1, False, stages, BN, warps)
                try:
                    us = graph_time(run, 3)
                except Exception as e:       # noqa: BLE001
                    print(f"BN={BN} w{warps} s{stages}: {str(e).splitlines()[0][:100]}")
                    continue
                print(f"sweep BN={BN:3d} w{warps} s{stages}: {us:6.1f} us {N * K / us / 1e6:.2f} TB/s", flush=True)


def bits_forms(x, y, qs, N: int, K: int):
    """The weights widened by moving bits (fp8.widen, groups of 4) against Triton's conversion: the same
    outputs bit for bit (the same bf16 values reach the same dot), then both timed under tiles."""
    for T in (1, 4):
        y2 = torch.full_like(y, float("nan"))
        launch(x, qs[0], qs[0].w, y, T, False, 1, False, 4)
        launch(x, qs[0], qs[0].w, y2, T, False, 1, False, 4, bits=True)
        want = x[:T].float() @ fp8.dequantize_ref(qs[0]).T
        err = ((y2[:T] - want).norm() / want.norm()).item()
        print(f"bits T={T}: equal to the converted form {torch.equal(y[:T], y2[:T])}, error against the "
              f"dequantized product {err:.1e}", flush=True)
        assert torch.equal(y[:T], y2[:T]) and err < 1e-2
    for BN, warps, stages in ((64, 4, 8), (64, 4, 4), (64, 4, 3), (32, 2, 4), (32, 2, 3), (128, 8, 4), (128, 4, 4)):
        for bits in (False, True):
            def run(i, BN=BN, warps=warps, stages=stages, bits=bits):
                return launch(x, qs[i], qs[i].w, y, 1, False, 1, False, stages, BN, warps, bits)
            us = graph_time(run, 3)
            print(f"{'bits' if bits else 'cvt '} BN={BN:3d} w{warps} s{stages}: {us:6.1f} us "
                  f"{N * K / us / 1e6:.2f} TB/s", flush=True)


def long_runs(x, y, qs, N: int, K: int):
    """The bit form taking U scale blocks of a row a step (runs of U x 128 bytes) on narrow tiles, so
    that a step's U tiles hold no more weights than one 64 x 128 tile: does the longer run of each
    row, which lifted the loads alone from 2.18 to 2.66 TB/s, survive the dots at 16 or 32 rows?"""
    forms = [(BN, warps, U, stages) for BN, warps in ((16, 1), (32, 1), (32, 2), (64, 4))
             for U in (1, 2, 4) for stages in (2, 3, 4, 6, 8) if BN * U <= 128]
    for BN, warps, U, stages in forms:
        for loads in (True, False):
            def run(i, BN=BN, warps=warps, U=U, stages=stages, loads=loads):
                return launch(x, qs[i], qs[i].w, y, 1, False, U, loads, stages, BN, warps, bits=True)
            try:
                us = graph_time(run, 3)
            except Exception as e:       # noqa: BLE001 (a probe: a refused form is a finding)
                print(f"long BN={BN} w{warps} U={U} s{stages}: {str(e).splitlines()[0][:100]}", flush=True)
                continue
            print(f"long {'loads' if loads else 'dot  '} BN={BN:3d} w{warps} U={U} s{stages}: {us:6.1f} us "
                  f"{N * K / us / 1e6:.2f} TB/s", flush=True)


def main(only_sweep: bool = False, bits: bool = False, long: bool = False):
    N, K = 16384, 5120
    x = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(16, N, device="cuda")
    qs = [fp8.quantize_ref(torch.randn(N, K, device="cuda")) for _ in range(3)]
    tiles = [tiled(q.w, 64, 128) for q in qs]
    bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    print(f"copy: {copy_bandwidth('cuda') / 1e12:.2f} TB/s (read + written)")
    if only_sweep:
        return sweep(x, y, qs, N, K)
    if bits:
        return bits_forms(x, y, qs, N, K)
    if long:
        t_pr = graph_time(lambda i: matvec.matvec(x[:1], qs[i]), 3)
        print(f"FP8 matvec (production) {t_pr:6.1f} us {N * K / t_pr / 1e6:.2f} TB/s", flush=True)
        return long_runs(x, y, qs, N, K)
    for T in (1, 4):
        t_bf = graph_time(lambda i: matvec.matvec(x[:T], bf[i]), 3)
        t_pr = graph_time(lambda i: matvec.matvec(x[:T], qs[i]), 3)
        print(f"T={T} bf16 matvec {t_bf:6.1f} us {N * K * 2 / t_bf / 1e6:.2f} TB/s | FP8 matvec (production) "
              f"{t_pr:6.1f} us {N * K / t_pr / 1e6:.2f} TB/s")
    rows = []
    for LOADS_ONLY in (True, False):
        for TILED in (False, True):
            for U, stages in ((1, 8), (1, 4), (2, 4), (4, 3), (4, 2), (8, 2)):
                for T in ((1,) if LOADS_ONLY else (1, 4)):
                    def run(i, T=T, TILED=TILED, U=U, LOADS_ONLY=LOADS_ONLY, stages=stages):
                        w = tiles[i] if TILED else qs[i].w
                        return launch(x, qs[i], w, y, T, TILED, U, LOADS_ONLY, stages)
                    try:
                        us = graph_time(run, 3)
                    except Exception as e:       # noqa: BLE001 (a probe: a refused form is a finding)
                        print(f"{'tiled' if TILED else 'rows'} U={U} s{stages}: {str(e).splitlines()[0][:120]}")
                        continue
                    tbs = N * K / us / 1e6
                    rows.append((LOADS_ONLY, TILED, U, stages, T, us, tbs))
                    print(f"{'loads' if LOADS_ONLY else 'dot  '} {'tiled' if TILED else 'rows '} U={U} s{stages} "
                          f"T={T}: {us:6.1f} us {tbs:.2f} TB/s", flush=True)
    best = max((r for r in rows if not r[0]), key=lambda r: r[-1])
    print(f"best dot form: {'tiled' if best[1] else 'rows'} U={best[2]} s{best[3]} T={best[4]}: {best[-1]:.2f} TB/s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="the dot forms' values only (CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--sweep", action="store_true", help="the production form under tiles, warps and depths")
    ap.add_argument("--bits", action="store_true",
                    help="the weights widened by moving bits, against Triton's conversion")
    ap.add_argument("--long", action="store_true",
                    help="the bit form taking several scale blocks of a row a step, on narrow tiles")
    args = ap.parse_args()
    if args.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
    else:
        print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
        check("cuda")
        main(args.sweep, args.bits, args.long)
