"""Times the MoE step kernels at the 35B-A3B's shapes (H 2048, 256 experts of 512, 8 a token, the
shared expert taken as expert 256 as the engine takes it) for a decode row and a verify step,
against the bytes of the experts they read, over a few tile choices; FP8 experts widened by
Triton's conversion and by moving bits (kernels/fp8.py widen) both. Each variant is a ProductPlan
(kernels/plan.py) handed to the expert kernels: the device's measured plan with an expert_tiles
rule and widen_bits off or on.

    python tests/bench/bench_moe.py [--weights fp8] [--bits on] [--stacked both] [--tiles "32,128,2,3 ..."]

The 20 calls of a timed graph each take another routing (ROUTINGS of them, drawn at random), so
each reads routed experts the calls before it mostly did not, as a step's next layer does (the
shared expert, one of the 9, is the same in every call and stays in L2): with one routing the
9 experts' 28 MB (FP8) stay in L2 from one call to the next, which flattered the deeper and wider
tiles. `--bits on`: FP8 tiles widened by moving bits only (the plan's default form); `--stacked`:
the SwiGLU's gate and up tiles as one tile, one dot a K step (ProductPlan.expert_stacked), or apart,
or both; `--tiles`: these tiles instead of the grid; `--json`: the times by tile, and each product's
fastest.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from mtpchat.engine.bench import copy_bandwidth
from mtpchat.kernels import fp8, moe, moe_routing
from mtpchat.kernels.plan import ProductPlan, default_products


STACKED = {"off": (False,), "on": (True,), "both": (False, True)}
ROUTINGS = 20           # a graph's calls, each over its own routing


def tile_plan(base: ProductPlan, cfg, bits: bool, stacked: bool = False) -> ProductPlan:
    """The base plan with every expert product on `cfg` (BN, BK, warps, stages), its FP8 tiles
    widened by moving bits or by Triton's conversion, the SwiGLU's gate and up tiles stacked or
    not (ProductPlan.expert_stacked)."""
    def expert_tiles(product, step, fp8_, itemsize=2):
        return cfg
    expert_tiles.__name__ = "experts:{}x{}w{}s{}".format(*cfg)
    return dataclasses.replace(base, expert_tiles=expert_tiles, widen_bits=bits, expert_stacked=stacked)


def timed(fn, reps=200) -> float:
    """us a call of fn(i), i = 0 .. ROUTINGS - 1 in a graph of ROUTINGS calls."""
    for i in range(5):
        fn(i)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(ROUTINGS):
            fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps // ROUTINGS):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (reps // ROUTINGS * ROUTINGS) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--weights", choices=("fp8", "bf16", "both"), default="both")
    p.add_argument("--bits", choices=("both", "on"), default="both")
    p.add_argument("--stacked", choices=tuple(STACKED), default="off",
                   help="the SwiGLU's gate and up tiles as one (ProductPlan.expert_stacked)")
    p.add_argument("--tiles", help='tiles to time instead of the grid: "BN,BK,warps,stages ..."')
    p.add_argument("--json", metavar="FILE", help="write the times and each product's fastest tile there")
    a = p.parse_args()
    E, k, F, H = 256, 8, 512, 2048
    bw = copy_bandwidth("cuda")             # the floors' rate: (read + written) / time of a copy
    base = default_products("cuda")
    out = {"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "us": {}, "best": {}}
    torch.manual_seed(0)
    for weights in ("fp8", "bf16") if a.weights == "both" else (a.weights,):
        gu = torch.randn(E * 2 * F, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        down = torch.randn(E * H, F, device="cuda", dtype=torch.bfloat16) / F ** 0.5
        sgu = torch.randn(2 * F, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        sdown = torch.randn(H, F, device="cuda", dtype=torch.bfloat16) / F ** 0.5
        if weights == "fp8":
            gu, down, sgu, sdown = (fp8.quantize_ref(t) for t in (gu, down, sgu, sdown))
        nbytes = fp8.BlockFP8.nbytes if weights == "fp8" else (lambda t: t.numel() * 2)
        per_expert = nbytes(gu) // E, nbytes(down) // E
        for T in (1, 4):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            routes = [moe_routing.route_step(torch.randn(T, E + 1, device="cuda", dtype=torch.bfloat16) * 3, k, E,
                                             shared=True, layout=base.routed_layout) for _ in range(ROUTINGS)]
            lays = [r[3] for r in routes]
            n = sum(len(set(r[0].flatten().tolist())) for r in routes) / ROUTINGS    # the shared one among them
            hs = [moe.expert_swiglu_triton(x, gu, lay, k + 1, E, shared=sgu, plan=base) for lay in lays]
            print(f"{weights} T={T}: {n:.1f} experts a call (the shared one too), "
                  f"floor swiglu {n * per_expert[0] / bw * 1e6:.1f} us, down {n * per_expert[1] / bw * 1e6:.1f} us")
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
                            t1 = timed(lambda i: moe.expert_swiglu_triton(x, gu, lays[i], k + 1, E, shared=sgu,
                                                                          plan=plan))
                            t2 = timed(lambda i: moe.expert_down_triton(hs[i], down, lays[i], E, shared=sdown,
                                                                        plan=plan))
                        except Exception as e:      # a tile that does not compile (shared memory)
                            line.append(type(e).__name__)
                            continue
                        key = f"{weights} T={T}{' bits' if bits else ''}{' stacked' if stacked else ''}"
                        for product, t in (("swiglu", t1), ("down", t2)):
                            out["us"].setdefault(f"{key} {product}", {})[f"{BN},{BK},{warps},{stages}"] = t
                        line.append(f"{'bits ' if bits else ''}{'stacked ' if stacked else ''}swiglu {t1:6.1f} us "
                                    f"({t1 / f1:.2f} x)  down {t2:6.1f} us ({t2 / f2:.2f} x)")
                print(f"  BN {BN:>3} BK {BK:>3} warps {warps} stages {stages}: " + ";  ".join(line), flush=True)
    for key, times in out["us"].items():
        best = min(times, key=times.get)
        out["best"][key] = [int(v) for v in best.split(",")]
        print(f"{key}: fastest {best} {times[best]:.1f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
