"""Requantizing 4-bit weights to FP8 blocks for prefill's fp8 form (kernels/int4_gemm.py
requantize_triton) under several tiles (groups a program, warps), natural and interleaved words,
against dequantizing the same rows to bf16; then the fp8 form's product against the dense form's.
Each tile's FP8 weights are checked equal to the default tile's first.

    cd tests/bench && python3 probe_requantize.py
"""
from __future__ import annotations

import torch
from graph_timing import graph_time

from mtpchat.kernels import int4, int4_gemm

TILES = [(1, 8), (1, 4), (2, 4), (2, 8), (4, 8), (8, 8)]


def main():
    torch.manual_seed(0)
    for name, N, K in [("in_proj", 16384, 5120), ("down", 5120, 17408)]:
        q = int4.quantize_ref(torch.randn(N, K, device="cuda") * 0.02)
        rows = min(N, 12800)                     # a slab of the dense form's 128 MB of bf16
        for label, w in (("natural", q), ("interleaved", int4.interleave_ref(q))):
            deq = graph_time(lambda i: int4_gemm.dequantize_triton(w, torch.bfloat16, (0, rows)), 1, 5)
            want = int4_gemm.requantize_triton(w, (0, rows))
            res = []
            for t in TILES:
                got = int4_gemm.requantize_triton(w, (0, rows), tile=t)
                assert torch.equal(got.w.view(torch.uint8), want.w.view(torch.uint8))
                res.append(f"{t}: {graph_time(lambda i: int4_gemm.requantize_triton(w, (0, rows), tile=t), 1, 5):.0f}")
            print(f"{name} {label}, {rows} rows: dequantize {deq:.0f} us; requantize " + ", ".join(res), flush=True)
    x = torch.randn(2048, 5120, device="cuda", dtype=torch.bfloat16)
    q = int4.interleave_ref(int4.quantize_ref(torch.randn(16384, 5120, device="cuda") * 0.02))
    fp8_us = graph_time(lambda i: int4_gemm.requantized_gemm(x, q), 1, 5)
    dense_us = graph_time(lambda i: int4_gemm.dense_gemm(x, q), 1, 5)
    print(f"in_proj at 2,048 rows, interleaved: fp8 form {fp8_us:.0f} us, dense form {dense_us:.0f} us")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
