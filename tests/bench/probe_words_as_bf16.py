"""Is it the unpacking or the way the bytes travel? The 27B's 4-bit weights' bytes (in_proj
[16384 x 5120], MLP gate|up [34816 x 5120]) read by the bf16 products as if they were bf16 weights
of a quarter of the columns ([N, K / 4]): the same bytes through the same path (cp.async copies into
shared memory, ldmatrix, the matrix instructions), on the 4-bit products' own tile (32 rows, 256
bytes a row a step, 2 warps) and on others, with no unpacking and a quarter of the matrix
instructions. Against the 4-bit products on the same bytes, in one process (us at T = 1 and 4).

    cd tests/bench && python3 probe_words_as_bf16.py"""
from __future__ import annotations

import dataclasses

import torch
from graph_timing import graph_time
from mtpchat.engine.bench import copy_bandwidth
from mtpchat.kernels import int4, matvec
from mtpchat.kernels.plan import default_products

SHAPES = [("in_proj", 16384, 5120, False), ("gate_up", 34816, 5120, True)]
# (BN, BK in bf16 columns, warps, stages): the 4-bit tiles' bytes a step (32 x 512 weights = 32 x 128 bf16)
TILES = [(32, 128, 2, 2), (32, 128, 2, 3), (32, 128, 2, 4), (32, 256, 2, 4), (64, 128, 4, 4), (64, 256, 4, 4)]


def main():
    bw = copy_bandwidth("cuda")
    print(f"copy {bw / 1e12:.3f} TB/s  {torch.cuda.get_device_name()}", flush=True)
    base = default_products("cuda")
    with torch.inference_mode():
        for name, N, K, swiglu in SHAPES:
            q = int4.interleave_ref(int4.quantize_ref(torch.randn(N, K, device="cuda") / K ** 0.5))
            copies = max(2, -(-160 * 2 ** 20 // q.nbytes()))
            ws = [q] + [int4.GroupInt4(torch.randint_like(q.w, -2 ** 15, 2 ** 15), q.scale.clone()) for _ in range(copies - 1)]
            # the words as bf16 values: random bits, so keep them finite (exponent below all ones)
            words = [(w.w & 0x7EFF).view(torch.bfloat16) for w in ws]
            runs = {"4-bit product": (lambda x, i, plan=base: (matvec.matvec_swiglu if swiglu else
                                                                matvec.matvec)(x, ws[i], plan=plan), K)}
            for tile in TILES:
                plan = dataclasses.replace(base, tiles=lambda N_, K_, itemsize, sw, fp8, tile=tile: tile)
                runs[f"words as bf16 {tile}"] = (lambda x, i, plan=plan: (matvec.matvec_swiglu if swiglu else
                                                                           matvec.matvec)(x, words[i], plan=plan), K // 4)
            plan = dataclasses.replace(base, tiles=None)
            runs["words as bf16, bf16's tile"] = (lambda x, i, plan=plan: (matvec.matvec_swiglu if swiglu else
                                                                           matvec.matvec)(x, words[i], plan=plan), K // 4)
            nbytes = ws[0].w.nbytes
            for label, (f, k) in runs.items():
                for T in (1, 4):
                    x = torch.randn(T, k, device="cuda", dtype=torch.bfloat16)
                    try:
                        t = min(graph_time(lambda i: f(x, i % copies), copies) for _ in range(3))
                    except Exception as e:          # a tile whose stages do not fit in shared memory
                        print(f"{name:8s} {label:34s} T={T}: {type(e).__name__}", flush=True)
                        continue
                    print(f"{name:8s} {label:34s} T={T}: {t:7.2f} us  words {nbytes / t / 1e6:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
