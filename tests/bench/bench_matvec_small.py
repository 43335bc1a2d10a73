"""The few-row products at a narrow model's shapes (the 35B-A3B's: hidden 2048), over tile choices:
each product timed once per layer over that layer's own weight (nothing stays in L2), in a CUDA
graph, against the bytes it reads at the copy bandwidth measured in the same run. Each tile is a
ProductPlan (kernels/plan.py): the device's measured plan with a tile rule, handed to the products.

    python tests/bench/bench_matvec_small.py [--rows 1]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

from mtpchat.engine.bench import copy_bandwidth
from mtpchat.kernels import matvec
from mtpchat.kernels.plan import default_products

SHAPES = {"gdn_in": (12352, 2048, 30), "attn_qkv": (9216, 2048, 10), "router": (257, 2048, 40),
          "lm_head": (248320, 2048, 1), "shared_gate_up": (1024, 2048, 40)}


def timed(fn, reps: int = 10) -> float:
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def every_product(cfg):
    """A ProductPlan tile rule giving `cfg` (BN, BK, warps, stages) to every product."""
    def tiles(N, K, itemsize, swiglu=False, fp8=False):
        return cfg
    tiles.__name__ = "all:{}x{}w{}s{}".format(*cfg)
    return tiles


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1)
    a = p.parse_args()
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s, {a.rows} row(s)")
    default = default_products("cuda")
    for name, (N, K, layers) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(layers)]
        x = torch.randn(a.rows, K, device="cuda", dtype=torch.bfloat16)
        floor = N * K * 2 / bw * 1e6
        run = lambda plan: [matvec.matvec(x, w, plan=plan) for w in ws]
        base = timed(lambda: run(default)) / layers
        print(f"{name} [{N}, {K}] x{layers}: default {base:.2f} us ({base / floor:.2f} x floor {floor:.2f})")
        for BN, BK, stages in itertools.product((16, 32, 64, 128), (128, 256, 512), (3, 4, 6)):
            plan = dataclasses.replace(default, tiles=every_product((BN, BK, 4, stages)))
            try:
                t = timed(lambda: run(plan)) / layers
            except Exception as e:
                continue
            if t < base * 0.97:
                print(f"  BN {BN:>3} BK {BK:>3} stages {stages}: {t:.2f} us ({t / floor:.2f} x)")
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
