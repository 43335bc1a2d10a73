"""The prefill product for a few rows (a short prefill chunk's 8-64 tokens), on the 27B's shapes.
FP8 weights: tiles of kernels/fp8_gemm.py against the wide tile the long prompts take, cuBLAS's
block-scaled product, and the few-row product the decode steps run (matvec, bf16 rows, rows in
pieces of the plan's row tile). 4-bit weights (--weights int4; interleaved as the engine stores
them, groups of 128): the slab forms of kernels/int4_gemm.py (dense, fp8) against the few-row
kernel (matvec_prefill, ProductPlan.int4_prefill_rows) on several tiles, and the decode steps'
products in pieces of 8 rows.

    cd tests/bench && python3 probe_small_gemm.py [--rows 8,16,32,64] [--weights int4] [--json FILE]

Each product is timed in CUDA graphs over rotating weight copies (more bytes than L2 holds), us a
launch, with the weight bytes it reads over that time; each result is checked against the float32
reference (relative error). The last lines weigh each form over one chunk of the 27B: 48 GDN
layers (in_proj, out_proj), 16 attention layers (q|gate|k|v, o_proj), 64 MLPs (gate|up, down).
"""
from __future__ import annotations

import argparse
import json

import torch

from graph_timing import graph_time

import dataclasses

from mtpchat.kernels import fp8, fp8_gemm, int4, int4_gemm, matvec
from mtpchat.kernels.fp8_gemm import GemmTiles
from mtpchat.kernels.plan import default_products

SHAPES = [("GDN in_proj", 16384, 5120, 48), ("GDN out_proj", 5120, 6144, 48),
          ("attention q|gate|k|v", 14336, 5120, 16), ("attention o_proj", 5120, 6144, 16),
          ("MLP gate|up", 34816, 5120, 64), ("MLP down", 5120, 17408, 64)]

TILES = {
    "plain 64 w4 s4 BM64": GemmTiles(64, 64, 4, 4),
    "wide 128x128 w8 s4": fp8_gemm.WIDE,
    "plain 64 w4 s4": GemmTiles(64, 64, 4, 4),
    "plain 64 w4 s6": GemmTiles(64, 64, 4, 6),
    "plain 32 w4 s6": GemmTiles(64, 32, 4, 6),
    "plain 32 w2 s6": GemmTiles(64, 32, 2, 6),
}


# matvec_prefill's tiles over 4-bit weights: BN, BK (weights), warps, stages
INT4_TILES = [(64, 128, 4, 4), (32, 128, 2, 4), (64, 256, 4, 3), (128, 128, 4, 3), (32, 256, 4, 4)]


def int4_forms(x: torch.Tensor, ws: list, products) -> dict:
    """name -> fn(i) over weight copy i: the 4-bit prefill forms for x's rows."""
    forms = {"dense slab (int4_gemm.dense_gemm)": lambda i: int4_gemm.dense_gemm(x, ws[i])}
    if int4_gemm.fp8_form_runs_on(x.device):
        forms["fp8 slab + cuBLAS (requantized_gemm)"] = lambda i: int4_gemm.requantized_gemm(x, ws[i])
    for tile in INT4_TILES:
        plan = dataclasses.replace(products, int4_prefill_tile=tile)
        forms[f"matvec_prefill {tile}"] = lambda i, plan=plan: matvec.matvec_prefill(x, ws[i], plan)
    forms["decode matvec, pieces of 8"] = lambda i: torch.cat(
        [matvec.matvec(x[a:a + 8], ws[i], plan=products) for a in range(0, x.shape[0], 8)])
    return forms


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,16,32,48,64")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--forms", default="", help="only the forms whose names contain one of these, ','-separated")
    p.add_argument("--weights", default="fp8", choices=["fp8", "int4"])
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    products = default_products("cuda")
    print(torch.cuda.get_device_name(), "rows", rows)
    out, total = [], {}
    for name, N, K, layers in SHAPES:
        if a.weights == "int4":
            wbytes = N * K // 2 + N * (K // 128) * 2
        else:
            wbytes = N * K + fp8.scale_shape(N, K)[0] * fp8.scale_shape(N, K)[1] * 4
        copies = max(2, -(-300_000_000 // wbytes))
        ws = []
        for seed in range(copies):
            g = torch.Generator(device="cuda").manual_seed(seed)
            w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
            ws.append(int4.interleave_ref(int4.quantize_ref(w)) if a.weights == "int4" else fp8.quantize_ref(w))
        for M in rows:
            g = torch.Generator(device="cuda").manual_seed(100 + M)
            x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
            if a.weights == "int4":
                exact = x.float() @ int4.dequantize_ref(ws[0]).float().T
                forms = {f: (fn, exact) for f, fn in int4_forms(x, ws, products).items()}
            else:
                forms = fp8_forms(x, ws, products)
            for fname, (fn, ref) in forms.items():
                if a.forms and not any(f in fname for f in a.forms.split(",")):
                    continue
                try:
                    got = fn(0)[:M].float()
                    err = float((got - ref).norm() / ref.norm())
                    us = graph_time(fn, copies)
                except Exception as e:          # a form a shape or row count cannot take
                    print(f"  {name:22s} M={M:3d} {fname:28s} failed: {type(e).__name__}: {str(e)[:80]}")
                    continue
                tbs = wbytes / us / 1e6
                print(f"  {name:22s} M={M:3d} {fname:28s} {us:8.1f} us  {tbs:5.2f} TB/s  rel err {err:.1e}")
                out.append(dict(shape=name, N=N, K=K, M=M, form=fname, us=us, tbs=tbs, err=err))
                total[(M, fname)] = total.get((M, fname), 0.) + us * layers
        del ws
        torch.cuda.empty_cache()
    print("one chunk of the 27B's products, ms:")
    for M in rows:
        line = sorted((v / 1e3, f) for (m, f), v in total.items() if m == M)
        print(f"  M={M}: " + "; ".join(f"{f} {ms:.2f}" for ms, f in line))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


def fp8_forms(x: torch.Tensor, ws: list, products) -> dict:
    """name -> (fn(i) over weight copy i, the reference it is held to): the FP8 prefill forms."""
    M = x.shape[0]
    xq, xs = fp8_gemm.quantize_rows_triton(x)
    want = fp8_gemm.gemm_ref(xq, xs, ws[0], torch.float32)
    exact = x.float() @ fp8.dequantize_ref(ws[0]).float().T
    forms = {}
    for tname, tiles in TILES.items():
        t = tiles if tname.startswith("wide") or tname.endswith("BM64") else tiles._replace(
            BM=min(tiles.BM, max(16, 1 << (M - 1).bit_length())))
        forms[tname] = (lambda i, t=t: fp8_gemm.gemm_quantized_triton(xq, xs, ws[i], torch.bfloat16, t), want)
    xq16, xs16 = fp8_gemm.quantize_rows_triton(x, fp8_gemm.CUBLAS_ROWS)
    forms["cuBLAS (rows padded to 16)"] = (lambda i: fp8_gemm.gemm_cublas(xq16, xs16, ws[i], torch.bfloat16), want)
    forms["few-row matvec (bf16 rows)"] = (lambda i: matvec.matvec(x, ws[i], plan=products), exact)
    return forms


if __name__ == "__main__":
    main()
