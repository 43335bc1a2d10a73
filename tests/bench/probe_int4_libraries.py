"""The 27B's 4-bit products (in_proj, MLP gate|up, out_proj, MLP down, group 128) under our kernels
and under the maintained W4A16 kernels that load here, at T = 1 and 4, each against the bytes it
reads at the copy rate measured in the same run. Which kernels:

- ours: the engine's product for that weight (the plain product, the SwiGLU over gate|up, the split
  product for out_proj and down), on interleaved words, and the plain product over gate|up too;
- torch's own (`aten._weight_int4pack_mm`, the tinygemm kernel gpt-fast and torchao use): bf16
  scales and zeros, 4-bit words in its tile order;
- GemLite (Triton, `pip install gemlite`) where it imports: bf16 x and scales, zero 8;
- Marlin (fp16 only, CUDA) where MARLIN_SRC names a folder holding its `marlin_cuda.cpp` and
  `marlin_cuda_kernel.cu`: built here with torch's extension loader for this GPU.

A library's product over gate|up is the plain product of the two stacked (the SwiGLU would be one
more small kernel after it). Weights rotate over copies of more bytes than L2 holds; a launch's time
is the median of graph replays (graph_timing). Speed only: the words are random, and the libraries'
outputs are not compared with ours (their sums run in their own orders; GemLite's few-row product
adds its parts with atomics, so its bits change from run to run).

    cd tests/bench && python3 probe_int4_libraries.py [KERNEL ...]      # all that load, or those named
    cd tests/bench && MARLIN_SRC=/path/to/marlin/marlin python3 probe_int4_libraries.py marlin

One process a kernel is the safer way: a library's fault (an illegal instruction, say) is reported
at some later call and ends the process's CUDA context."""
from __future__ import annotations

import os
import sys

import torch
from graph_timing import graph_time
from mtpchat.engine.bench import copy_bandwidth
from mtpchat.kernels import int4, matvec, matvec_parts
from mtpchat.kernels.plan import default_products

G = 128
SHAPES = [("in_proj", 16384, 5120, "plain"), ("gate_up", 34816, 5120, "swiglu"), ("out_proj", 5120, 6144, "split"),
          ("down", 5120, 17408, "split")]
ROWS = (1, 4)
L2_BYTES = 160 * 2 ** 20


def copies_for(nbytes: int) -> int:
    return max(2, -(-L2_BYTES // nbytes))


def ours(N, K, kind):
    plan = default_products("cuda")
    run = {"plain": lambda x, w: matvec.matvec(x, w, plan=plan), "swiglu": lambda x, w: matvec.matvec_swiglu(x, w, plan),
           "split": lambda x, w: matvec_parts.matvec_parts(x, w, plan)}[kind]
    w = int4.interleave_ref(int4.quantize_ref(torch.randn(N, K, device="cuda")))
    nbytes = w.w.nbytes + w.scale.nbytes
    ws = [w] + [int4.GroupInt4(torch.randint_like(w.w, -2 ** 15, 2 ** 15), w.scale.clone(), *w[2:])
                for _ in range(copies_for(nbytes) - 1)]
    return run, ws, torch.bfloat16, nbytes


def tinygemm(N, K):
    def one():
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
        packed = torch.ops.aten._convert_weight_to_int4pack(q, 8)
        sz = torch.stack([torch.rand(K // G, N, device="cuda") / 64, torch.zeros(K // G, N, device="cuda")], -1)
        return packed, sz.to(torch.bfloat16).contiguous()
    first = one()
    nbytes = first[0].nbytes + first[1].nbytes
    ws = [first] + [one() for _ in range(copies_for(nbytes) - 1)]
    return (lambda x, w: torch.ops.aten._weight_int4pack_mm(x, w[0], G, w[1])), ws, torch.bfloat16, nbytes


def gemlite_linear(N, K):
    import gemlite
    from gemlite import DType, GemLiteLinear

    def one():
        layer = GemLiteLinear(4, group_size=G, in_features=K, out_features=N, input_dtype=DType.BF16,
                              output_dtype=DType.BF16)
        layer.pack(torch.randint(0, 16, (N, K), dtype=torch.uint8, device="cuda"),
                   (torch.rand(N, K // G, device="cuda") / 64).to(torch.bfloat16), 8)
        return layer
    first = one()
    nbytes = first.W_q.nbytes + first.scales.nbytes
    ws = [first] + [one() for _ in range(copies_for(nbytes) - 1)]
    return (lambda x, w: w(x)), ws, torch.bfloat16, nbytes


def marlin(N, K, src):
    from torch.utils.cpp_extension import load
    mod = load("marlin_cuda", [os.path.join(src, "marlin_cuda.cpp"), os.path.join(src, "marlin_cuda_kernel.cu")],
               extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)

    def one():
        B = torch.randint(-2 ** 31, 2 ** 31 - 1, (K // 16, N * 16 // 8), dtype=torch.int32, device="cuda")
        s = (torch.rand(K // G, N, device="cuda") / 64).half()
        return B, s, torch.zeros(N // 128 * 16, dtype=torch.int32, device="cuda")
    first = one()
    nbytes = first[0].nbytes + first[1].nbytes
    ws = [first] + [one() for _ in range(copies_for(nbytes) - 1)]
    outs = {}

    def run(x, w):
        if x.shape[0] not in outs:        # allocated once a row count, not in the timed launches
            outs[x.shape[0]] = torch.empty(x.shape[0], N, dtype=torch.half, device="cuda")
        y = outs[x.shape[0]]
        mod.mul(x, w[0], y, w[1], w[2], -1, -1, -1, 16)
        return y
    return run, ws, torch.float16, nbytes


def main():
    bw = copy_bandwidth("cuda")
    print(f"copy {bw / 1e12:.3f} TB/s  {torch.cuda.get_device_name()}", flush=True)
    kernels = {"ours": None, "ours plain": None, "torch tinygemm": tinygemm}
    try:
        import gemlite  # noqa: F401
        kernels["gemlite"] = gemlite_linear
    except ImportError as e:
        print(f"gemlite: not importable ({e})")
    if os.environ.get("MARLIN_SRC"):
        kernels["marlin"] = lambda N, K: marlin(N, K, os.environ["MARLIN_SRC"])
    if sys.argv[1:]:
        kernels = {k: v for k, v in kernels.items() if k in sys.argv[1:]}
    with torch.inference_mode():
        for name, N, K, kind in SHAPES:
            for lib, make in kernels.items():
                try:
                    if lib == "ours":
                        f, ws, dtype, nbytes = ours(N, K, kind)
                    elif lib == "ours plain":
                        if kind == "plain":
                            continue
                        f, ws, dtype, nbytes = ours(N, K, "plain")
                    else:
                        f, ws, dtype, nbytes = make(N, K)
                except Exception as e:           # a library that does not build or take this shape
                    print(f"{name} {lib}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
                    continue
                floor = nbytes / bw * 1e6
                for T in ROWS:
                    x = torch.randn(T, K, device="cuda", dtype=dtype)
                    try:
                        t = min(graph_time(lambda i: f(x, ws[i % len(ws)]), len(ws)) for _ in range(3))
                    except Exception as e:
                        print(f"{name} {lib} T={T}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
                        continue
                    print(f"{name:8s} {lib:15s} T={T}: {t:7.2f} us  {nbytes / t / 1e6:5.2f} TB/s  "
                          f"{t / floor:4.2f} x its bytes at the copy rate ({floor:.1f} us)", flush=True)
                del ws
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
