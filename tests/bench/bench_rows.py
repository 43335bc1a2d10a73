"""The few-row products' row tile (ProductPlan.rows, the BT their dots pad the rows to): 16 against
8, on the 27B's products in bf16, FP8 and 4 bits, at 1 and 4 rows.

    cd tests/bench && python3 bench_rows.py [--json FILE]

A product pads its rows to the plan's row tile in its dots, so with 8 the tensor cores take half
the padding, x's tile is half as large and the sums take half the registers. Each product is timed
(us a launch, CUDA graphs over rotating weight copies: more bytes than L2 holds) under both plans,
and its outputs under the two are compared bit for bit: a row's result must not depend on the row
tile either, or an engine's rows could not be chosen from its largest step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from graph_timing import graph_time

from mtpchat.kernels import fp8, int4, matvec, matvec_parts
from mtpchat.kernels.plan import default_products

SHAPES = [("GDN in_proj [qkv|z]", 16384, 5120, "plain"), ("attention q|gate|k|v", 14336, 5120, "plain"),
          ("MLP gate|up", 34816, 5120, "swiglu"), ("GDN out_proj", 5120, 6144, "parts"),
          ("MLP down", 5120, 17408, "parts")]
COPIES = 3


def weights(fmt: str, N: int, K: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    if fmt == "fp8":
        return fp8.quantize_ref(w)
    if fmt == "int4":
        return int4.quantize_ref(w)
    return w.to(torch.bfloat16)


def nbytes(w) -> int:
    return w.nbytes() if hasattr(w, "nbytes") and callable(w.nbytes) else w.numel() * w.element_size()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--formats", default="bf16,fp8,int4")
    a = p.parse_args()
    base = default_products("cuda")
    plans = {16: dataclasses.replace(base, rows=16), 8: dataclasses.replace(base, rows=8)}
    out = []
    for fmt in a.formats.split(","):
        for name, N, K, kind in SHAPES:
            ws = [weights(fmt, N, K, seed) for seed in range(COPIES)]
            x = torch.randn(4, K, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(4, N, device="cuda", dtype=torch.bfloat16)
            nw = torch.randn(N, device="cuda", dtype=torch.bfloat16) * 0.1

            def run(xt, w, plan):
                if kind == "plain":
                    return matvec.matvec(xt, w, plan=plan)
                if kind == "swiglu":
                    return matvec.matvec_swiglu(xt, w, plan=plan)
                normed, h = matvec_parts.matvec_parts_triton(xt, w, norm=(r[:xt.shape[0]], nw, 1e-6), plan=plan)
                return torch.cat([normed.x, h], 1)

            for T in (1, 4):
                xt = x[:T]
                got = {rows: run(xt, ws[0], plan) for rows, plan in plans.items()}
                us = {rows: graph_time(lambda i, plan=plan: run(xt, ws[i % COPIES], plan), COPIES)
                      for rows, plan in plans.items()}
                same = bool(torch.equal(got[16], got[8]))
                tb = {rows: nbytes(ws[0]) / t / 1e6 for rows, t in us.items()}
                print(f"{fmt:>4} {name:<22} T={T}: rows 16 {us[16]:7.1f} us ({tb[16]:.2f} TB/s), rows 8 {us[8]:7.1f} us "
                      f"({tb[8]:.2f} TB/s), 8/16 {us[8] / us[16]:.3f}; same bits: {same}", flush=True)
                out.append(dict(format=fmt, product=name, N=N, K=K, T=T, us16=us[16], us8=us[8], same=same))
            del ws
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
