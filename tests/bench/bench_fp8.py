"""Tiles of the few-row FP8 products on the 27B's shapes: achieved bandwidth under each.

    cd tests/bench && python3 bench_fp8.py
    cd tests/bench && python3 bench_fp8.py --sweep --json fp8_tiles.json   # the bit form under many tiles

Each product (3 rows, bf16 activations, FP8 weights with their scales) is timed with CUDA events
over rotating weight copies (more bytes than L2 holds), under the default tile and a few others,
each widening its FP8 tiles by Triton's conversion and by moving bits (kernels/fp8.py widen, the
two checked bit for bit); the bf16 product of the same shape is timed beside it. Prints bytes
read / time in TB/s. Each variant is a ProductPlan (kernels/plan.py) handed to the products: the
device's measured plan with a tile rule for the FP8 products, or a split rule for the split ones,
and widen_bits off or on.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from graph_timing import graph_time

from mtpchat.kernels import fp8, matvec, matvec_parts
from mtpchat.kernels.plan import ProductPlan, default_products

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


def fp8_tiles(tile):
    """A ProductPlan tile rule: `tile` (BN, BK, warps, stages) for the FP8 products, the measured
    tile for the others."""
    def tiles(N, K, itemsize, swiglu=False, fp8=False):
        return tile if fp8 else None
    tiles.__name__ = "fp8:{}x{}w{}s{}".format(*tile)
    return tiles


def split_stages_warps(base: ProductPlan, stages: int, warps: int):
    """A ProductPlan split rule: the base plan's split (matvec_parts.split_config) with its warps
    and its pipeline depth replaced (the benchmark runs it on FP8 weights only: a split rule's
    stages stand in for the plan's split_fp8_stages)."""
    def split(N, K, itemsize):
        S, BN, BK, _, _ = matvec_parts.split_config(N, K, itemsize, base)
        return S, BN, BK, warps, stages
    split.__name__ = f"split:w{warps}s{stages}"
    return split


# --sweep: the bit form (the default widening) under many tiles, 1 and 4 rows (a decode step and a
# verify of 3 drafts). A tile spans one scale block of K (BK 128 or 64) and BN divides 128.
SWEEP = {"plain": [(64, 128, 4, 8), (64, 128, 4, 6), (64, 128, 4, 10), (64, 128, 4, 12), (128, 128, 4, 4),
                   (128, 128, 4, 6), (128, 128, 8, 4), (128, 128, 8, 6), (32, 128, 2, 6), (32, 128, 2, 8),
                   (64, 128, 8, 8), (64, 64, 4, 12), (64, 64, 4, 16), (128, 64, 4, 8)],
         "swiglu": [(32, 128, 2, 3), (32, 128, 2, 4), (32, 128, 2, 5), (32, 128, 4, 3), (32, 128, 4, 4),
                    (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6), (16, 128, 1, 4), (32, 64, 2, 6),
                    (64, 128, 8, 4)],
         "parts": [(3, 64, 128, 4, 8), (3, 64, 128, 4, 4), (3, 64, 128, 4, 6), (2, 64, 128, 4, 8),
                   (4, 64, 128, 4, 6), (4, 64, 128, 4, 8), (6, 64, 128, 4, 4), (6, 64, 128, 4, 8),
                   (3, 64, 128, 8, 8), (2, 32, 128, 2, 8), (3, 32, 128, 2, 6), (1, 32, 128, 2, 8),
                   (3, 128, 128, 8, 4), (6, 128, 128, 8, 4), (3, 128, 128, 4, 6), (3, 64, 64, 4, 12)]}


def split_rule(cfg):
    """A ProductPlan split rule: (S, BN, BK, warps, stages) for every split product."""
    def split(N, K, itemsize):
        return cfg
    split.__name__ = "split:S{}x{}x{}w{}s{}".format(*cfg)
    return split


def sweep(json_path: str | None) -> None:
    """Each product of SHAPES under each tile of SWEEP (bit form), 1 and 4 rows; prints the times
    and the best tile of each product (the least time over both row counts), and writes them."""
    base = default_products("cuda")
    out = {"device": torch.cuda.get_device_name(), "plan": base.describe(), "us": {}, "best": {}}
    for name, N, K, kind in SHAPES:
        ws = [fp8.quantize_ref(torch.randn(N, K, device="cuda") / K ** 0.5) for _ in range(3)]
        nbytes = ws[0].nbytes()
        times = {}
        for T in (1, 4):
            xk = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            run = {"plain": lambda w, plan: matvec.matvec(xk, w, plan=plan),
                   "swiglu": lambda w, plan: matvec.matvec_swiglu(xk, w, plan=plan),
                   "parts": lambda w, plan: matvec_parts.matvec_parts(xk, w, plan=plan)}[kind]
            value = lambda y: (y.sum(0) if kind == "parts" else y).float()      # parts: S of them, S per tile
            want = value(run(ws[0], base))
            t_default = timed(lambda i: run(ws[i % 3], base))
            times.setdefault("default", []).append(t_default)
            for tile in SWEEP[kind]:
                plan = dataclasses.replace(base, **({"split_tiles": split_rule(tile)} if kind == "parts"
                                                     else {"tiles": fp8_tiles(tile)}))
                try:
                    err = ((value(run(ws[0], plan)) - want).norm() / want.norm()).item()
                    t = timed(lambda i: run(ws[i % 3], plan))
                except Exception as e:           # a tile that does not fit
                    print(f"  {name} {tile}: {type(e).__name__} {str(e)[:120]}", flush=True)
                    continue
                if err > 1e-2:
                    print(f"  {name} {tile}: wrong, {err:.1e} off the default tile", flush=True)
                    continue
                times.setdefault(tile, []).append(t)
        times = {k: v for k, v in times.items() if len(v) == 2}
        best = min(times, key=lambda k: sum(times[k]))
        line = "  ".join(f"{k}: {v[0] * 1e3:.1f}/{v[1] * 1e3:.1f}" for k, v in sorted(times.items(), key=lambda kv: sum(kv[1])))
        print(f"{name} [{N} x {K}] ({kind}) us at 1/4 rows, fastest first: {line}", flush=True)
        d, b = times["default"], times[best]
        print(f"  best {best}: {nbytes / b[0] / 1e9:.2f} TB/s at 1 row; {b[0] / d[0]:.3f} / {b[1] / d[1]:.3f} x "
              "the default tile", flush=True)
        out["us"][name] = {str(k): [t * 1e3 for t in v] for k, v in times.items()}
        out["best"][name] = {"N": N, "K": K, "kind": kind, "tile": None if best == "default" else list(best),
                             "ratio": [b[0] / d[0], b[1] / d[1]]}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="the bit form under many tiles, 1 and 4 rows")
    p.add_argument("--json", metavar="FILE", help="with --sweep: write the times and each product's best tile")
    a = p.parse_args()
    if a.sweep:
        return sweep(a.json)
    x = torch.randn(3, 17408, device="cuda", dtype=torch.bfloat16)
    base = dataclasses.replace(default_products("cuda"), widen_bits=False)
    for name, N, K, kind in SHAPES:
        ws = [fp8.quantize_ref(torch.randn(N, K, device="cuda") / K ** 0.5) for _ in range(3)]
        bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        xk = x[:, :K]
        run = {"plain": lambda w, plan=base: matvec.matvec(xk, w, plan=plan),
               "swiglu": lambda w, plan=base: matvec.matvec_swiglu(xk, w, plan=plan),
               "parts": lambda w, plan=base: matvec_parts.matvec_parts(xk, w, plan=plan)}[kind]
        fp8_bytes, bf_bytes = ws[0].nbytes(), bf[0].numel() * 2
        want, _ = run(ws[0]).float(), run(bf[0])
        t_bf = timed(lambda i: run(bf[i % 3]))

        print(f"{name} [{N} x {K}] bf16: {t_bf * 1e3:.1f} us, {bf_bytes / t_bf / 1e9:.2f} TB/s")
        for tile in TILES[kind]:
            if kind == "parts":
                plan = dataclasses.replace(base, split_tiles=split_stages_warps(base, *tile))
            else:
                plan = dataclasses.replace(base, tiles=fp8_tiles(tile))
            err = ((run(ws[0], plan).float() - want).norm() / want.norm()).item()     # against the default tile
            line = []
            for bits in (False, True):
                form = dataclasses.replace(plan, widen_bits=bits)
                out = run(ws[0], form)
                t = timed(lambda i: run(ws[i % 3], form))
                line.append(f"{'bits' if bits else 'cvt'} {t * 1e3:6.1f} us {fp8_bytes / t / 1e9:.2f} TB/s "
                            f"({t / t_bf:.3f} x bf16)")
            same = torch.equal(out, run(ws[0], plan))
            print(f"  FP8 {tile}: {';  '.join(line)};  bits == cvt: {same}; differs from the default tile by {err:.1e}")


if __name__ == "__main__":
    main()
