"""Times the MoE step kernels at the 35B-A3B's shapes (H 2048, 256 experts of 512, 8 a token) for a
decode row and a verify step, against the bytes of the experts they read, over a few tile choices;
FP8 experts widened by Triton's conversion and by moving bits (kernels/fp8.py widen) both. Each
variant is a ProductPlan (kernels/plan.py) handed to the expert kernels: the device's measured plan
with an expert_tiles rule and widen_bits off or on.

    python tests/bench/bench_moe.py [--weights fp8] [--bits on] [--stacked both] [--tiles "32,128,2,3 ..."]

`--bits on`: FP8 tiles widened by moving bits only (the plan's default form); `--stacked`: the
SwiGLU's gate and up tiles as one tile, one dot a K step (ProductPlan.expert_stacked), or apart
(the default), or both; `--tiles`: these tiles instead of the grid.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

from mtpchat.kernels import fp8, moe, moe_routing
from mtpchat.kernels.plan import ProductPlan, default_products


STACKED = {"off": (False,), "on": (True,), "both": (False, True)}


def tile_plan(base: ProductPlan, cfg, bits: bool, stacked: bool = False) -> ProductPlan:
    """The base plan with every expert product on `cfg` (BN, BK, warps, stages), its FP8 tiles
    widened by moving bits or by Triton's conversion, the SwiGLU's gate and up tiles stacked or
    not (ProductPlan.expert_stacked)."""
    def expert_tiles(product, step, fp8_, itemsize=2):
        return cfg
    expert_tiles.__name__ = "experts:{}x{}w{}s{}".format(*cfg)
    return dataclasses.replace(base, expert_tiles=expert_tiles, widen_bits=bits, expert_stacked=stacked)


def timed(fn, reps=200) -> float:
    for _ in range(5):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps // 20):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3      # us a call


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--weights", choices=("fp8", "bf16", "both"), default="both")
    p.add_argument("--bits", choices=("both", "on"), default="both")
    p.add_argument("--stacked", choices=tuple(STACKED), default="off",
                   help="the SwiGLU's gate and up tiles as one (ProductPlan.expert_stacked)")
    p.add_argument("--tiles", help='tiles to time instead of the grid: "BN,BK,warps,stages ..."')
    a = p.parse_args()
    E, k, F, H = 256, 8, 512, 2048
    bw = 3.0e12
    base = default_products("cuda")
    for weights in ("fp8", "bf16") if a.weights == "both" else (a.weights,):
        gu = torch.randn(E * 2 * F, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        down = torch.randn(E * H, F, device="cuda", dtype=torch.bfloat16) / F ** 0.5
        if weights == "fp8":
            gu, down = fp8.quantize_ref(gu), fp8.quantize_ref(down)
        per_expert = (fp8.BlockFP8.nbytes(gu) if weights == "fp8" else gu.numel() * 2) // E, \
                     (fp8.BlockFP8.nbytes(down) if weights == "fp8" else down.numel() * 2) // E
        for T in (1, 4):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(T, E + 1, device="cuda", dtype=torch.bfloat16) * 3
            ids, w, g, lay = moe_routing.route_step(logits, k, E)
            n = len(set(ids.flatten().tolist()))
            h = moe.expert_swiglu_triton(x, gu, lay, k, E, plan=base)
            y = moe.expert_down_triton(h, down, lay, E, plan=base)
            shared = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            t_route = timed(lambda: moe_routing.route_step(logits, k, E))
            t_comb = timed(lambda: moe.combine_triton(y, w, shared, g, torch.bfloat16))
            print(f"{weights} T={T}: {n} experts; route {t_route:.1f} us, combine {t_comb:.1f} us")
            grid = itertools.product((32, 64, 128), (128,), (2, 4, 8), (2, 3, 4, 6)) if weights == "fp8" else \
                itertools.product((32, 64), (128, 256), (4,), (3, 4))
            if a.tiles:
                grid = [tuple(int(v) for v in t.split(",")) for t in a.tiles.split()]
            for BN, BK, warps, stages in grid:
                f1, f2 = n * per_expert[0] / bw * 1e6, n * per_expert[1] / bw * 1e6
                line = []
                for bits in ((False, True) if a.bits == "both" else (True,)) if weights == "fp8" else (False,):
                    for stacked in STACKED[a.stacked]:
                        plan = tile_plan(base, (BN, BK, warps, stages), bits, stacked)
                        try:
                            t1 = timed(lambda: moe.expert_swiglu_triton(x, gu, lay, k, E, plan=plan))
                            t2 = timed(lambda: moe.expert_down_triton(h, down, lay, E, plan=plan))
                        except Exception as e:      # a tile that does not compile (shared memory)
                            line.append(type(e).__name__)
                            continue
                        line.append(f"{'bits ' if bits else ''}{'stacked ' if stacked else ''}swiglu {t1:6.1f} us "
                                    f"({t1 / f1:.2f} x)  down {t2:6.1f} us ({t2 / f2:.2f} x)")
                print(f"  BN {BN:>3} BK {BK:>3} warps {warps} stages {stages}: " + ";  ".join(line))


if __name__ == "__main__":
    main()
