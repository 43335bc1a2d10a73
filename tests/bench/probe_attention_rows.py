"""The step attention's split kernel on other tiles: the query rows a program takes (BM: 16, 32, 64
of a kv head's token x head rows; the 27B's decode has 6, a verify of 3 drafts 24), its warps and
its depth, at the 27B's shapes (24 query heads, 4 kv heads, head_dim 256), in a cache of the
bench's 8,329 rows and of 32,777, at 1K and 4K of context, 1 and 4 rows. Each form's time a layer
(16 layers' caches in one CUDA graph, as graph_ms in bench_kernels.py) and, on the GPU, whether a
verify's rows take the bits of one-row calls (MTP's exactness rests on it).

    cd tests/bench && python3 probe_attention_rows.py
"""
from __future__ import annotations

import itertools

import torch

from bench_kernels import graph_ms
from mtpchat.kernels import attention

HQ, HKV, HD, LAYERS = 24, 4, 256, 16


def main():
    torch.manual_seed(0)
    for cap in (8329, 32777):
        caches = [(torch.randn(cap, HKV, HD, device="cuda").bfloat16(), torch.randn(cap, HKV, HD, device="cuda").bfloat16())
                  for _ in range(LAYERS)]
        first, split, BN, warps0, stages0 = attention._config(cap)
        for ctx, T in itertools.product((1024, 4000), (1, 4)):
            q = torch.randn(T, HQ, HD, device="cuda").bfloat16()
            gate = torch.randn(T, HQ, HD, device="cuda").bfloat16()
            start = torch.tensor([ctx], device="cuda")
            line = []
            for BM, warps, stages in itertools.product((16, 32, 64), (4, 8), (2, 3)):
                cfg = (first, split, BN, warps, stages)
                run = lambda: [attention.decode_attention_triton(q, kc, vc, start, HD ** -0.5, gate, config=cfg, rows=BM)
                               for kc, vc in caches]
                try:
                    us = graph_ms(run) / LAYERS * 1e3
                except Exception as e:          # a tile over the shared memory
                    print(f"  cap={cap} BM={BM} warps={warps} stages={stages}: {type(e).__name__}")
                    continue
                kc, vc = caches[0]
                got = attention.decode_attention_triton(q, kc, vc, start, HD ** -0.5, gate, config=cfg, rows=BM)
                rows = torch.cat([attention.decode_attention_triton(q[t:t + 1], kc, vc, start + t, HD ** -0.5,
                                                                    gate[t:t + 1], config=cfg, rows=BM) for t in range(T)])
                ref = attention.decode_attention_ref(q.float(), kc.float(), vc.float(), ctx, HD ** -0.5, gate.float())
                err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                mark = " (now)" if (BM, warps, stages) == (32, warps0, stages0) else ""
                line.append((us, f"BM={BM} warps={warps} stages={stages}{mark} {us:.2f} us"
                                 f" rows{'=' if torch.equal(got, rows) else '!='}one-row err {err:.1e}"))
            line.sort()
            print(f"cap={cap} ctx={ctx} T={T}: " + " | ".join(t for _, t in line[:6]), flush=True)
            now = [t for _, t in line if "(now)" in t]
            print(f"    now: {now[0] if now else '-'}", flush=True)


if __name__ == "__main__":
    main()
