"""Kernel micro-benchmarks on a GPU at the Qwen3.6-27B shapes, against the bandwidth floor.

    python tests/bench/bench_kernels.py [--sweep] [--sweep-matvec] [--sweep-attention] [--only matvec,...]
                                          [--json out.json]

Every kernel is timed the way a decode step runs it: once per layer over that layer's own buffers
(so nothing stays in L2 between calls), inside a CUDA graph (no launch gaps), time / layers. The
floor is the bytes each call must move over the device-to-device copy bandwidth measured in the
same run. The sweeps time the tile configurations the kernels' defaults were chosen from.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from mtpchat.kernels import attention, conv, gdn, gdn_chunk, matvec, norm
from mtpchat.kernels._triton import triton
from mtpchat.kernels.plan import ProductPlan, default_products

H, I, VOCAB = 5120, 17408, 248320
HK, HV, DK, DV, CONV = 16, 48, 128, 128, 10240
HQ, HKV, HD = 24, 4, 256
GDN_LAYERS, ATTN_LAYERS = 48, 16
SHAPES = {"gdn_in": (CONV + HV * DV + 2 * HV, H), "gdn_out": (H, HV * DV), "attn_qkv": (2 * HQ * HD + 2 * HKV * HD, H),
          "attn_o": (H, HQ * HD), "mlp_gate_up": (2 * I, H), "mlp_down": (H, I), "lm_head": (VOCAB, H)}
COUNT = {"gdn_in": GDN_LAYERS, "gdn_out": GDN_LAYERS, "attn_qkv": ATTN_LAYERS, "attn_o": ATTN_LAYERS,
         "mlp_gate_up": 64, "mlp_down": 64, "lm_head": 1}
results: dict = {}


def graph_ms(fn, reps=7) -> float:
    """Median time of one replay of a graph holding fn's launches."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    del g
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second by the faster of a memcpy and a copy kernel, 2 GiB each way."""
    src = torch.empty(1 << 29, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    memcpy = graph_ms(lambda: [dst.copy_(src) for _ in range(5)]) / 5
    kernel = graph_ms(lambda: [torch.mul(src, 1.0, out=dst) for _ in range(5)]) / 5
    read = graph_ms(lambda: [src.sum() for _ in range(5)]) / 5
    nbytes = src.numel() * 4
    tbps = lambda n, ms: n / ms / 1e9
    print(f"memcpy {tbps(2 * nbytes, memcpy):.3f} TB/s, copy kernel {tbps(2 * nbytes, kernel):.3f} TB/s, "
          f"read-only (sum) {tbps(nbytes, read):.3f} TB/s")
    results.update(memcpy_TBps=tbps(2 * nbytes, memcpy), copy_kernel_TBps=tbps(2 * nbytes, kernel),
                   read_TBps=tbps(nbytes, read))
    del src, dst
    return 2 * nbytes / min(memcpy, kernel) / 1e-3


def row(name, ms, nbytes, bw, peer_ms=None, peer="peer"):
    floor = nbytes / bw * 1e3
    results[name] = {"us": ms * 1e3, "floor_us": floor * 1e3, "x_floor": ms / floor, "GBps": nbytes / ms / 1e6}
    extra = ""
    if peer_ms is not None:
        results[name][peer + "_us"] = peer_ms * 1e3
        extra = f"  {peer} {peer_ms * 1e3:9.1f} us ({nbytes / peer_ms / 1e9:6.2f} TB/s)"
    print(f"{name:34s} {ms * 1e3:9.1f} us  floor {floor * 1e3:8.1f} us  x{ms / floor:5.2f}  "
          f"{nbytes / ms / 1e9:6.2f} TB/s{extra}", flush=True)


def tile_plan(cfg, swiglu=False) -> ProductPlan:
    """The device's measured ProductPlan with a tile rule giving `cfg` (BN, BK, warps, stages) to the
    plain or the SwiGLU products."""
    def tiles(N, K, itemsize, glu=False, fp8=False):
        return cfg if glu == swiglu else None
    tiles.__name__ = "{}:{}x{}w{}s{}".format("swiglu" if swiglu else "plain", *cfg)
    return dataclasses.replace(default_products("cuda"), tiles=tiles)


def matvec_launch(x, w, plan):
    return matvec.matvec(x, w, plan=plan)


MATVEC_CONFIGS = [(bn, bk, wp, st) for bn in (16, 32, 64) for bk in (128, 256, 512) for wp in (4, 8) for st in (3, 4)
                  if bn * bk * 2 * st <= 160 * 1024] + [(128, 128, 4, 4), (128, 64, 4, 6), (32, 128, 4, 6), (16, 256, 4, 6)]


def bench_matvec(bw, sweep, sweep_swiglu=False):
    print("\n== matvec: per call, weights streamed cold ==")
    weights = {k: [torch.empty(n, kk, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(COUNT[k])]
               for k, (n, kk) in SHAPES.items()}
    best = {}
    for k, ws in weights.items():
        N, K = SHAPES[k]
        use = ws[:16]
        for T in (1, 4):
            x = torch.randn(T, K, dtype=torch.bfloat16, device="cuda")
            ours = graph_ms(lambda: [matvec.matvec(x, w) for w in use]) / len(use)
            cublas = graph_ms(lambda: [F.linear(x, w) for w in use]) / len(use)
            row(f"matvec {k} {N}x{K} T={T}", ours, N * K * 2, bw, cublas, "cublas")
        if sweep:
            x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
            timed = []
            for cfg in MATVEC_CONFIGS:
                plan = tile_plan(cfg)
                try:
                    timed.append((graph_ms(lambda: [matvec_launch(x, w, plan) for w in use], reps=3) / len(use), cfg))
                except Exception as e:   # out of shared memory and the like
                    print(f"  {cfg}: {type(e).__name__}", flush=True)
            timed.sort()
            best[k] = timed[0][1]
            print(f"  sweep {k}: " + ", ".join(f"{c}={N * K * 2 / t / 1e9:.2f}TB/s" for t, c in timed[:6]), flush=True)
            results[f"sweep {k}"] = [[list(c), t * 1e3] for t, c in timed]
    for T in (1, 4):
        x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
        ups = weights["mlp_gate_up"][:16]
        fused = graph_ms(lambda: [matvec.matvec_swiglu(x, w) for w in ups]) / len(ups)
        apart = graph_ms(lambda: [(lambda g, u: F.silu(g) * u)(*matvec.matvec(x, w).chunk(2, -1)) for w in ups]) / len(ups)
        row(f"matvec_swiglu mlp_gate_up T={T}", fused, 2 * I * H * 2, bw, apart, "matvec+silu*up")
    if sweep_swiglu:
        x = torch.randn(1, H, dtype=torch.bfloat16, device="cuda")
        ups = weights["mlp_gate_up"][:16]
        ref = matvec.matvec_swiglu_ref(x, ups[0])
        for BN, BK, warps, stages in ((32, 256, 4, 4), (64, 256, 4, 2), (64, 256, 8, 2), (32, 256, 4, 6),
                                      (32, 512, 4, 3), (64, 128, 4, 4), (16, 512, 4, 4), (32, 128, 4, 6)):
            def launch(w, plan=tile_plan((BN, BK, warps, stages), swiglu=True)):
                return matvec.matvec_swiglu(x, w, plan=plan)
            try:
                err = ((launch(ups[0]).float() - ref.float()).norm() / ref.float().norm()).item()
                t = graph_ms(lambda: [launch(w) for w in ups], reps=3) / len(ups)
                print(f"  swiglu BN={BN} BK={BK} w={warps} st={stages}: {t * 1e3:.1f} us err {err:.1e}", flush=True)
            except Exception as e:
                print(f"  swiglu BN={BN} BK={BK} w={warps} st={stages}: {type(e).__name__}", flush=True)
    # one decode step's worth of products: every layer's matrices and the lm_head
    layers = []
    for i in range(64):
        kinds = ("attn_qkv", "attn_o") if (i + 1) % 4 == 0 else ("gdn_in", "gdn_out")
        j = i // 4 if (i + 1) % 4 == 0 else i - i // 4
        layers += [weights[kinds[0]][j], weights[kinds[1]][j], weights["mlp_gate_up"][i], weights["mlp_down"][i]]
    layers.append(weights["lm_head"][0])
    total = sum(w.numel() * 2 for w in layers)
    for T in (1, 4):
        xs = {K: torch.randn(T, K, dtype=torch.bfloat16, device="cuda") for K in {w.shape[1] for w in layers}}
        ours = graph_ms(lambda: [matvec.matvec(xs[w.shape[1]], w) for w in layers], reps=5)
        cublas = graph_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in layers], reps=5)
        row(f"all decode matvecs ({total / 1e9:.1f} GB) T={T}", ours, total, bw, cublas, "cublas")
        if sweep and best:
            plans = {k: tile_plan(cfg) for k, cfg in best.items()}
            tuned = graph_ms(lambda: [matvec_launch(xs[w.shape[1]], w, plans[next(k for k, s in SHAPES.items()
                                                                              if s == tuple(w.shape))]) for w in layers], reps=5)
            row(f"all decode matvecs, per-shape best T={T}", tuned, total, bw)
    results["matvec_best"] = {k: list(v) for k, v in best.items()}
    del weights, layers


def bench_gdn(bw, sweep):
    print("\n== GDN recurrent step (per layer; 48 layers' states, the last step's tokens folded in) ==")
    states = [torch.randn(HV, DK, DV, device="cuda") * 0.1 for _ in range(GDN_LAYERS)]
    pends = [torch.rand(2, 5, HV, gdn.pending_width(DK, DV), device="cuda") * 0.1 for _ in range(GDN_LAYERS)]
    A_log, dt_bias = torch.randn(HV, device="cuda").bfloat16(), torch.randn(HV, device="cuda").bfloat16()
    parity = torch.tensor([0], device="cuda")
    for T in (1, 4, 5):
        fold = torch.tensor([min(T, 3)], device="cuda")       # what a step before it accepted
        mixed = torch.randn(T, CONV, dtype=torch.bfloat16, device="cuda")
        q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], -1)
        q, k, v = q.view(T, HK, DK), k.view(T, HK, DK), v.view(T, HV, DV)
        a, b = torch.randn(T, HV, dtype=torch.bfloat16, device="cuda"), torch.randn(T, HV, dtype=torch.bfloat16, device="cuda")
        layers = list(zip(states, pends))
        ms = graph_ms(lambda: [gdn.recurrent(q, k, v, a, b, A_log, dt_bias, st, pe, fold, parity)
                               for st, pe in layers]) / len(layers)
        nbytes = HV * DK * DV * 4 * 2 + T * (CONV + HV * DV) * 2
        row(f"gdn recurrent T={T}", ms, nbytes, bw)
        if sweep:
            for BV in (8, 16, 32):
                for warps in (1, 2):
                    def launch(st, pe):
                        o = torch.empty(T, HV, DV, dtype=v.dtype, device="cuda")
                        gdn._recurrent_kernel[(HV, DV // BV)](
                            q, k, v, a, b, A_log, dt_bias, st, pe, fold, parity, fold, o, T, DK ** -0.5,
                            q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), o.stride(0),
                            pe.stride(0), pe.stride(1), GROUP=HV // HK, DK=DK, DV=DV, BV=BV, HAS_LIVE=False,
                            PDL=False, num_warps=warps)
                    try:
                        t = graph_ms(lambda: [launch(st, pe) for st, pe in layers], reps=3) / len(layers)
                        print(f"  BV={BV} warps={warps}: {t * 1e3:.1f} us", flush=True)
                        results[f"sweep gdn T={T} BV={BV} w={warps}"] = t * 1e3
                    except Exception as e:
                        print(f"  BV={BV} warps={warps}: {type(e).__name__}", flush=True)
    del states, pends


def bench_conv(bw):
    print("\n== conv window update (per layer) ==")
    bufs = [torch.randn(CONV, 3 + 5, device="cuda").bfloat16() for _ in range(GDN_LAYERS)]
    w = torch.randn(CONV, 4, device="cuda").bfloat16()
    off = torch.tensor([1], device="cuda")
    for T in (1, 4):
        x = torch.randn(T, CONV, dtype=torch.bfloat16, device="cuda")
        ms = graph_ms(lambda: [conv.conv_update(x, b, off, w) for b in bufs]) / len(bufs)
        row(f"conv update T={T}", ms, CONV * 2 * (3 + 3 + T + 2 * T + 4), bw)
    x = torch.randn(8192, CONV, dtype=torch.bfloat16, device="cuda")
    ms = graph_ms(lambda: [conv.conv_update(x, b, off, w) for b in bufs[:8]]) / 8
    row("conv update T=8192 (prefill)", ms, CONV * 2 * 8192 * 2, bw)


def bench_attention(bw, sweep):
    print("\n== decode/verify attention (per layer; 16 layers' caches) ==")
    L = 32768
    caches = [(torch.randn(L, HKV, HD, device="cuda").bfloat16(), torch.randn(L, HKV, HD, device="cuda").bfloat16())
              for _ in range(ATTN_LAYERS)]
    if sweep:
        for cap, ctx in ((4096, 1024), (32768, 1024), (32768, 4096), (32768, 32000)):
            q = torch.randn(1, HQ, HD, dtype=torch.bfloat16, device="cuda")
            start = torch.tensor([ctx], device="cuda")
            small = [(kc[:cap], vc[:cap]) for kc, vc in caches]
            line = []
            for spans in (16, 32, 64, 128):
                for BN, warps, stages in ((64, 4, 2), (64, 4, 3), (32, 4, 2), (32, 4, 3), (64, 8, 2), (32, 2, 2)):
                    cfg = (attention._config(cap)[0], max(2 * BN, triton.next_power_of_2(triton.cdiv(cap, spans))),
                           BN, warps, stages)
                    try:
                        t = graph_ms(lambda: [attention.decode_attention_triton(q, kc, vc, start, HD ** -0.5, config=cfg)
                                              for kc, vc in small], reps=3) / len(small)
                        line.append((t * 1e3, spans, BN, warps, stages))
                    except Exception as e:
                        print(f"  {cfg}: {type(e).__name__}", flush=True)
            line.sort()
            results[f"sweep attention cap={cap} ctx={ctx}"] = line
            print(f"  sweep cap={cap} ctx={ctx}: " + ", ".join(f"{t:.1f}us spans={sp} BN={bn} w={w} st={st}"
                                                              for t, sp, bn, w, st in line[:5]), flush=True)
    for ctx in (1024, 4096, 32000):
        for T in (1, 4):
            q = torch.randn(T, HQ, HD, dtype=torch.bfloat16, device="cuda")
            start = torch.tensor([ctx], device="cuda")
            ms = graph_ms(lambda: [attention.decode_attention(q, kc, vc, start, HD ** -0.5) for kc, vc in caches]) / len(caches)
            n = ctx + T
            mask = torch.arange(n, device="cuda")[None] <= torch.arange(ctx, n, device="cuda")[:, None]
            sdpa = graph_ms(lambda: [F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], kc[:n].transpose(0, 1)[None], vc[:n].transpose(0, 1)[None],
                attn_mask=mask, scale=HD ** -0.5, enable_gqa=True) for kc, vc in caches]) / len(caches)
            row(f"attention ctx={ctx} T={T}", ms, n * HKV * HD * 2 * 2, bw, sdpa, "sdpa")


def bench_chunk(bw, sweep):
    print("\n== chunked GDN prefill, 8192 tokens (per layer) ==")
    T = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    mixed = torch.randn(T, CONV, dtype=torch.bfloat16, device="cuda", generator=g)
    q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], -1)
    q, k, v = q.view(T, HK, DK), k.view(T, HK, DK), v.view(T, HV, DV)
    ab = torch.randn(T, 2 * HV, dtype=torch.bfloat16, device="cuda", generator=g)
    a, b = ab[:, :HV], ab[:, HV:]
    A_log, dt_bias = torch.randn(HV, device="cuda").bfloat16() * 0.5, torch.randn(HV, device="cuda").bfloat16()
    state = torch.randn(HV, DK, DV, device="cuda") * 0.1
    nbytes = T * (CONV * 2 + HV * DV * 2) + 2 * HV * DK * DV * 4
    configs = [{}] + ([dict(scan_bv=64), dict(scan_bv=64, scan_warps=8), dict(prep_warps=2), dict(prep_warps=8),
                       dict(scan_bv=64, out_bv=128, out_warps=8), dict(dot="tf32x3")] if sweep else [])
    for cfg in configs:
        try:
            ms = graph_ms(lambda: gdn_chunk.chunk_triton(q, k, v, a, b, A_log, dt_bias, state, config=cfg), reps=5)
            row(f"gdn chunk T=8192 {cfg}", ms, nbytes, bw)
        except Exception as e:
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            if "illegal" in str(e):
                return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gdn_chunk.chunk_triton(q, k, v, a, b, A_log, dt_bias, state)
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        if "chunk" in ev.key:
            print(f"  {ev.key}: {getattr(ev, 'device_time_total', 0):.0f} us")
    o, s = gdn_chunk.chunk(q, k, v, a, b, A_log, dt_bias, state)
    o_ref, s_ref = gdn_chunk.chunk_ref(q, k, v, a, b, A_log, dt_bias, state)
    err = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()
    print(f"  vs chunk_ref: output rel err {err(o, o_ref):.2e}, state {err(s, s_ref):.2e}")
    results["chunk_err"] = [err(o, o_ref), err(s, s_ref)]
    gdn_chunk.chunk_ref(q, k, v, a, b, A_log, dt_bias, state)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    gdn_chunk.chunk_ref(q, k, v, a, b, A_log, dt_bias, state)
    e1.record()
    torch.cuda.synchronize()
    ref_ms = e0.elapsed_time(e1)
    print(f"  chunk_ref (torch, float32) {ref_ms:.2f} ms")
    results["chunk_ref_ms"] = ref_ms


def bench_norms(bw):
    print("\n== norms (per call) ==")
    xs = [torch.randn(4, H, device="cuda").bfloat16() for _ in range(64)]
    w = torch.randn(H, device="cuda").bfloat16()
    for T in (1, 4):
        ms = graph_ms(lambda: [norm.add_rmsnorm(x[:T], x[:T], w, 1e-6) for x in xs]) / len(xs)
        row(f"add_rmsnorm 5120 T={T}", ms, T * H * 2 * 4, bw)
        o = [torch.randn(T, HV, DV, device="cuda").bfloat16() for _ in range(48)]
        wn = torch.randn(DV, device="cuda").bfloat16()
        ms = graph_ms(lambda: [norm.gated_rmsnorm(t, t, wn, 1e-6) for t in o]) / len(o)
        row(f"gated_rmsnorm 48x128 T={T}", ms, T * HV * DV * 2 * 3, bw)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="tile sweeps of the small kernels")
    p.add_argument("--sweep-matvec", action="store_true", help="the matvec tile sweep (long)")
    p.add_argument("--sweep-attention", action="store_true", help="the attention span and tile sweep (long)")
    p.add_argument("--json")
    p.add_argument("--only", default="matvec,gdn,conv,attention,chunk,norms")
    args = p.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    bw = copy_bandwidth()
    results["copy_TBps"] = bw / 1e12
    print(f"device-to-device copy: {bw / 1e12:.3f} TB/s (bytes read + written)")
    for name in args.only.split(","):
        try:
            {"matvec": lambda: bench_matvec(bw, args.sweep_matvec, args.sweep), "gdn": lambda: bench_gdn(bw, args.sweep),
             "conv": lambda: bench_conv(bw), "attention": lambda: bench_attention(bw, args.sweep_attention),
             "chunk": lambda: bench_chunk(bw, args.sweep), "norms": lambda: bench_norms(bw)}[name]()
        except Exception as e:
            print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
