"""Tiles of the few-row FP8 products on the 27B's shapes: achieved bandwidth under each.

    cd tests/bench && python3 bench_fp8.py

Each product (3 rows, bf16 activations, FP8 weights with their scales) is timed with CUDA events
over rotating weight copies (more bytes than L2 holds), under the default tile and a few others,
each widening its FP8 tiles by Triton's conversion and by moving bits (kernels/fp8.py widen, the
two checked bit for bit); the bf16 product of the same shape is timed beside it. Prints bytes
read / time in TB/s.
"""
from __future__ import annotations

import torch

from probe_fp8 import graph_time

from mtpchat.kernels import fp8, matvec, matvec_parts

SHAPES = [("GDN in_proj [qkv|z]", 16384, 5120, "plain"), ("attention q|gate|k|v", 14336, 5120, "plain"),
          ("MLP gate|up", 34816, 5120, "swiglu"), ("GDN out_proj", 5120, 6144, "parts"),
          ("MLP down", 5120, 17408, "parts")]
TILES = {"plain": [(64, 128, 4, 8), (32, 128, 2, 4), (32, 128, 2, 3), (32, 128, 2, 6), (16, 128, 1, 4),
                   (64, 128, 2, 4)],
         "swiglu": [(64, 128, 4, 6), (32, 128, 2, 4), (32, 128, 2, 3), (16, 128, 1, 4), (64, 128, 2, 4)],
         "parts": [(8, 4), (4, 2), (3, 2), (6, 2)]}                  # (stages, warps)


def timed(fn) -> float:
    """ms a launch, from CUDA graphs of 20 launches (probe_fp8.graph_time)."""
    return graph_time(fn, 3) / 1e3


def split_warps(split_config, warps: int):
    """matvec_parts._split_config with its warps replaced."""
    def config(N, K, itemsize):
        S, BN, BK, _, stages = split_config(N, K, itemsize)
        return S, BN, BK, warps, stages
    return config


def main():
    x = torch.randn(3, 17408, device="cuda", dtype=torch.bfloat16)
    kept_config, kept_stages, kept_split = matvec._config, matvec_parts.FP8_STAGES, matvec_parts._split_config
    for name, N, K, kind in SHAPES:
        ws = [fp8.quantize_ref(torch.randn(N, K, device="cuda") / K ** 0.5) for _ in range(3)]
        bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        xk = x[:, :K]
        run = {"plain": lambda w: matvec.matvec(xk, w), "swiglu": lambda w: matvec.matvec_swiglu(xk, w),
               "parts": lambda w: matvec_parts.matvec_parts(xk, w)}[kind]
        fp8_bytes, bf_bytes = ws[0].nbytes(), bf[0].numel() * 2
        want, _ = run(ws[0]).float(), run(bf[0])
        t_bf = timed(lambda i: run(bf[i % 3]))

        print(f"{name} [{N} x {K}] bf16: {t_bf * 1e3:.1f} us, {bf_bytes / t_bf / 1e9:.2f} TB/s")
        for tile in TILES[kind]:
            if kind == "parts":
                matvec_parts.FP8_STAGES = tile[0]
                matvec_parts._split_config = split_warps(kept_split, tile[1])
            else:
                matvec._config = (lambda t: lambda N, K, itemsize, swiglu=False, fp8=False:
                                  t if fp8 else kept_config(N, K, itemsize, swiglu, fp8))(tile)
            err = ((run(ws[0]).float() - want).norm() / want.norm()).item()     # against the default tile
            line = []
            for bits in (False, True):
                fp8.WIDEN_BITS = bits
                out = run(ws[0])
                t = timed(lambda i: run(ws[i % 3]))
                line.append(f"{'bits' if bits else 'cvt'} {t * 1e3:6.1f} us {fp8_bytes / t / 1e9:.2f} TB/s "
                            f"({t / t_bf:.3f} x bf16)")
            fp8.WIDEN_BITS = False
            same = torch.equal(out, run(ws[0]))
            print(f"  FP8 {tile}: {';  '.join(line)};  bits == cvt: {same}; differs from the default tile by {err:.1e}")
            matvec._config, matvec_parts.FP8_STAGES, matvec_parts._split_config = kept_config, kept_stages, kept_split


if __name__ == "__main__":
    main()
