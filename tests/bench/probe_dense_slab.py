"""Prefill's dense 4-bit form (kernels/int4_gemm.py dense_gemm) with each slab's product written
straight into its columns of the output, as it now is, against the form it replaced: the slab's
product made apart, then copied into place. Both give the same bits (checked); times in us.

    cd tests/bench && python3 probe_dense_slab.py
"""
from __future__ import annotations

import torch
from graph_timing import graph_time

from mtpchat.kernels import int4, int4_gemm

SHAPES = [("in_proj", 16384, 5120), ("gate_up", 34816, 5120), ("down", 5120, 17408), ("out_proj", 5120, 6144)]


def copied(x: torch.Tensor, w: int4.GroupInt4, slab_bytes: int = int4_gemm.SLAB_BYTES) -> torch.Tensor:
    """The earlier dense form: each slab's product, then copied into its columns."""
    T, K = x.shape
    N = w.shape[0]
    rows = int4_gemm._slab_rows(K, x.element_size(), slab_bytes)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    slab = torch.empty(rows, K, dtype=x.dtype, device=x.device)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        y[:, n0:n1] = x @ int4_gemm.dequantize_triton(w, x.dtype, (n0, n1), slab[:n1 - n0]).T
    return y


def main():
    torch.manual_seed(0)
    for T in (2048, 8192):
        for name, N, K in SHAPES:
            w = int4.quantize_ref(torch.randn(N, K, device="cuda") * 0.02)
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(copied(x, w), int4_gemm.dense_gemm(x, w))
            print(f"{name} [{N} x {K}] T={T}: copied {graph_time(lambda i: copied(x, w), 1, 5):.0f} us, in place "
                  f"{graph_time(lambda i: int4_gemm.dense_gemm(x, w), 1, 5):.0f} us", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
