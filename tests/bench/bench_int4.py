"""The few-row products over 4-bit weights (kernels/int4.py) on the 27B's and the 35B-A3B's expert
shapes, at T = 1 and 4 rows: time against the bf16 and FP8 products of the same shape, GB/s, and
the fraction of the device's copy bandwidth the 4-bit bytes were read at; a few candidate tiles
for each 4-bit product in each unpack form (ProductPlan.int4_form: "reshape", "slices", "pairs";
kernels/int4.py form_args), so one run tells which tile rule (int4_tiles) and form to choose; and
the words alone streamed by the default tile's programs (no unpacking, no dot): what the tile's
reads allow, so a product's distance from the bandwidth splits into reading and computing.

    python tests/bench/bench_int4.py [--json results.json] [--quick]

Each variant is a ProductPlan handed to the products (the device's measured plan, with an
int4_tiles rule for the candidates). Times are CUDA graphs of 20 launches over rotating weight
copies (more bytes than L2 holds), the median of 5 replays; "copy" is torch's device-to-device
copy of 1 GiB, (read + written bytes) / time. Weights are random: groups of 128, symmetric, no
perm for the candidates; the default tile also with zeros and a perm (GPTQ desc_act) and with
groups of 32. Candidates at T = 1 only (T = 4 measured within 2% of T = 1 on an H100). Checks
each 4-bit output against the float32 reference before timing it. About 2 minutes on an H100.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

import triton
import triton.language as tl
from graph_timing import graph_time
from mtpchat.engine.bench import copy_bandwidth
from mtpchat.kernels import fp8, int4, int4_gemm, matvec, matvec_parts, moe, moe_routing
from mtpchat.kernels.plan import ProductPlan, default_products


@triton.jit
def _stream_kernel(w, y, K8, s_w, BN: tl.constexpr, BW: tl.constexpr):
    # program i reads rows i BN .. i BN + BN of the words, BW words a step, and xors them together
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros([BN, BW], dtype=tl.int32)
    for k in range(0, K8, BW):
        acc ^= tl.load(w + o_n[:, None] * s_w + k + tl.arange(0, BW)[None, :])
    tl.store(y + o_n, tl.xor_sum(acc, axis=1))


def stream(q: int4.GroupInt4, y: torch.Tensor, tile) -> None:
    """The words of q read as a product with `tile` (BN, BK, warps, stages) reads them (N a
    multiple of BN, K of BK)."""
    BN, BK, warps, stages = tile
    N, K8 = q.w.shape
    _stream_kernel[(N // BN,)](q.w, y, K8, q.w.stride(0), BN=BN, BW=BK // 8, num_warps=warps, num_stages=stages)

# the 27B (hidden 5120, intermediate 17408; GDN in_proj: conv_dim 10240 + value_dim 6144 rows;
# attention 24 q heads and their gates, 4 kv heads of 256)
SHAPES = [("GDN in_proj [qkv|z]", 16384, 5120, "plain"), ("attention q|gate|k|v", 14336, 5120, "plain"),
          ("MLP gate|up", 34816, 5120, "swiglu"), ("GDN out_proj, attention o_proj", 5120, 6144, "split"),
          ("MLP down", 5120, 17408, "split")]
E, TOPK, F_E, H_E = 256, 8, 512, 2048          # the 35B-A3B's experts
# (BN, BK, warps, stages), BK in weights (2 a byte); the first of each is the default tile
CANDIDATES = {"plain": [(64, 512, 4, 3), (64, 256, 4, 4), (64, 1024, 4, 2), (32, 512, 4, 4), (128, 512, 8, 3),
                        (32, 1024, 4, 3), (16, 512, 2, 4)],
              "swiglu": [(64, 256, 4, 4), (32, 256, 4, 4), (64, 512, 4, 3), (32, 512, 4, 4), (64, 256, 4, 5),
                         (32, 256, 2, 4)],
              "split": [(64, 512, 4, 3), (64, 256, 4, 4), (64, 1024, 4, 2), (32, 512, 4, 4), (32, 1024, 4, 3),
                        (16, 512, 2, 4), (32, 512, 4, 3)],
              "expert": [(64, 512, 4, 3), (64, 256, 4, 3), (32, 512, 4, 4), (128, 256, 8, 3), (32, 256, 4, 4)]}
# the interleaved form's own candidates (whole groups a tile: BK a multiple of 128); a split tile of
# five is (S parts, BN, BK, warps, stages), of four takes the split rule's parts
INTERLEAVED_CANDIDATES = {
    "plain": [(32, 512, 2, 4), (64, 512, 4, 3), (64, 1024, 4, 2), (64, 256, 4, 4), (64, 512, 4, 4), (64, 256, 4, 6),
              (32, 1024, 2, 3), (32, 256, 2, 6), (128, 512, 8, 3), (128, 256, 8, 4), (16, 1024, 1, 3), (64, 128, 4, 8),
              (32, 512, 2, 3), (32, 512, 2, 5), (32, 512, 2, 6), (32, 256, 2, 8), (32, 1024, 2, 2), (32, 256, 2, 4),
              (64, 512, 2, 4), (16, 512, 1, 6)],
    "swiglu": [(32, 512, 2, 3), (64, 256, 4, 4), (32, 256, 2, 4), (64, 512, 4, 3), (64, 128, 4, 6), (32, 128, 2, 6),
               (128, 256, 8, 3), (32, 256, 2, 6), (16, 512, 1, 4), (32, 512, 2, 4), (32, 512, 2, 2), (32, 1024, 2, 2),
               (32, 256, 2, 5), (16, 512, 1, 3), (32, 512, 4, 3)],
    "split": [(32, 512, 2, 4), (64, 1024, 4, 2), (64, 512, 4, 3), (64, 256, 4, 4), (32, 1024, 2, 3),
              (4, 64, 512, 4, 3), (6, 64, 256, 4, 4), (8, 64, 256, 4, 3), (3, 32, 512, 2, 4), (4, 32, 512, 2, 4),
              (6, 32, 256, 2, 6), (2, 32, 1024, 2, 3), (4, 128, 256, 8, 4), (12, 64, 128, 4, 6), (2, 32, 512, 2, 4),
              (3, 32, 512, 2, 3), (3, 32, 512, 2, 5), (3, 32, 256, 2, 6), (4, 32, 256, 2, 6), (5, 32, 512, 2, 4),
              (3, 16, 512, 1, 4), (6, 16, 512, 1, 4), (4, 32, 512, 2, 3), (6, 32, 512, 2, 3), (2, 32, 512, 2, 6),
              (3, 32, 1024, 2, 2), (4, 32, 1024, 2, 2)],
    "expert": [(32, 512, 2, 2), (32, 256, 4, 4), (64, 512, 4, 3), (32, 512, 2, 4), (64, 256, 4, 4), (16, 512, 1, 2),
               (32, 256, 2, 4), (32, 1024, 2, 2), (128, 512, 8, 2), (16, 256, 1, 4), (64, 512, 4, 1),
               (64, 512, 4, 2), (32, 512, 2, 1), (128, 512, 8, 1), (64, 256, 4, 2), (128, 256, 8, 2)]}


def copies_for(nbytes: int) -> int:
    return max(2, -(-160 * 2 ** 20 // nbytes))          # more than the 50 MB of an H100's L2


def rule(kind: str, tile, interleaved: bool = False):
    """A ProductPlan int4_tiles rule: `tile` for the `kind` products, the default for the others; a
    split tile of four takes the split rule's parts (for `interleaved` weights, theirs)."""
    def int4_tiles(product, N, K, group):
        if kind == "split" and product == "split":
            if len(tile) == 5:
                return tuple(tile)
            S = matvec_parts.split_config(N, K, 2, default_products("cuda"), group, interleaved)[0]
            return (S,) + tuple(tile)
        if product == kind or (kind == "expert" and product.startswith("expert")):
            return tuple(tile)
        return None
    int4_tiles.__name__ = "int4:" + ("{}x{}x{}w{}s{}" if len(tile) == 5 else "{}x{}w{}s{}").format(*tile)
    return int4_tiles


def quantized(N: int, K: int, group: int = 128, symmetric: bool = True, perm: bool = False, experts: int = 0):
    w = torch.randn(N, K, device="cuda") / K ** 0.5
    q = int4.quantize_ref(w, group, symmetric)
    if perm:
        p = torch.stack([torch.randperm(K, device="cuda") for _ in range(max(experts, 1))]).to(torch.int32)
        q = q._replace(perm=p if experts else p[0].contiguous())
    return q


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def candidates(kind: str, base: ProductPlan, quick: bool, interleaved_only: bool = False):
    """(label, plan, interleaved) of each candidate tile in each unpack form, and over interleaved
    weights (kernels/int4.py interleave_ref: one form of their own, its own candidates); the
    default tile alone with --quick; the interleaved ones alone with --interleaved-only."""
    if not interleaved_only:
        for tile in CANDIDATES[kind][:1] if quick else CANDIDATES[kind]:
            for form in int4.FORMS:
                yield f"{tile} {form}", dataclasses.replace(base, int4_tiles=rule(kind, tile), int4_form=form), False
    for tile in INTERLEAVED_CANDIDATES[kind][:1] if quick else INTERLEAVED_CANDIDATES[kind]:
        yield f"{tile} interleaved", dataclasses.replace(base, int4_tiles=rule(kind, tile, True)), True


def time_candidates(kind, call, check, copies: int, base: ProductPlan, quick: bool,
                    interleaved_only: bool = False) -> dict:
    """us of each candidate (check(plan, interleaved) asserts its output first), or why it failed;
    call(i, plan, interleaved)."""
    got = {}
    for label, plan, il in candidates(kind, base, quick, interleaved_only):
        try:
            check(plan, il)
            got[label] = graph_time(lambda i: call(i, plan, il), copies)
        except AssertionError:
            raise
        except Exception as e:          # a tile past the shared memory, registers: say so, go on
            got[label] = f"failed: {type(e).__name__}"
    return got


def show(tiles: dict) -> None:
    for form in int4.FORMS + ("interleaved",):
        line = "  ".join(f"{k.rsplit(' ', 1)[0]}: {v:.1f}" if isinstance(v, float) else f"{k.rsplit(' ', 1)[0]}: {v}"
                         for k, v in tiles.items() if k.endswith(form))
        if line:
            print(f"    int4 {form} (BN, BK, warps, stages) us: {line}", flush=True)


def bench_product(name, N, K, kind, Ts, base: ProductPlan, bw: float, quick: bool, out: list,
                  interleaved_only: bool = False):
    run = {"plain": lambda x, w, plan: matvec.matvec(x, w, plan=plan),
           "swiglu": lambda x, w, plan: matvec.matvec_swiglu(x, w, plan=plan),
           "split": lambda x, w, plan: matvec_parts.matvec_parts(x, w, plan=plan)}[kind]
    ref = {"plain": matvec.matvec_ref, "swiglu": matvec.matvec_swiglu_ref,
           "split": lambda x, w: matvec_parts.matvec_parts_ref(x, w)}[kind]
    forms = {"g128": dict(), "g128 zeros+perm": dict(symmetric=False, perm=True), "g32": dict(group=32)}
    q4 = {f: quantized(N, K, **kw) for f, kw in forms.items()}
    n4 = q4["g128"].nbytes()
    c4 = copies_for(n4)
    ws4 = [q4["g128"]] + [quantized(N, K) for _ in range(c4 - 1)]
    il4 = [int4.interleave_ref(q) for q in ws4]
    bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(N * K * 2))]
    f8 = [fp8.quantize_ref(torch.randn(N, K, device="cuda")) for _ in range(copies_for(N * K))]
    # a perm read in every tile, or applied to x once per call (ProductPlan.permute_x)
    tiled, once = (dataclasses.replace(base, permute_x=p) for p in (False, True))
    for T in Ts:
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        t_bf = graph_time(lambda i: run(x, bf[i % len(bf)], base), len(bf))
        t_f8 = graph_time(lambda i: run(x, f8[i % len(f8)], base), len(f8))
        row = dict(product=name, N=N, K=K, kind=kind, T=T, bf16_us=t_bf, fp8_us=t_f8, int4_bytes=n4,
                   int4={}, tiles={})
        for form, q in q4.items():
            err = rel(run(x, q, base), ref(x, q))
            assert err < 2e-2, f"{name} {form}: relative error {err:.1e}"
            ws = [q] + ws4[1:] if form == "g128" else [q]
            t = graph_time(lambda i: run(x, ws[i % len(ws)], tiled), len(ws))
            row["int4"][form] = dict(us=t, err=err, l2_resident=len(ws) == 1 and q.nbytes() < 40e6)
            if q.perm is not None:
                row["int4"][form + ", x permuted once"] = dict(us=graph_time(lambda i: run(x, q, once), 1))
        row["int4"]["g128 interleaved"] = dict(us=graph_time(lambda i: run(x, il4[i % c4], base), c4))
        t4 = row["int4"]["g128"]["us"]
        row.update(int4_us=t4, gbps=n4 / t4 / 1e3, of_copy_bw=(n4 / bw * 1e6) / t4)
        if T == Ts[0] and kind != "split":
            tile = matvec.tiles(N, K, 2, kind == "swiglu", plan=base, group=128)
            tile = (2 * tile[0],) + tile[1:] if kind == "swiglu" else tile      # a SwiGLU block reads 2 BN rows
            y = torch.empty(N, dtype=torch.int32, device="cuda")
            t_s = graph_time(lambda i: stream(ws4[i % c4], y, tile), c4)
            row["stream_us"] = t_s
            print(f"    the words alone, streamed with tile {tile}: {t_s:.1f} us "
                  f"({q4['g128'].w.numel() * 4 / t_s / 1e3:.0f} GB/s)", flush=True)
        if T == Ts[0]:
            want = ref(x, ws4[0])

            def check(plan, il):
                # a split product's parts follow its tile (the K ranges round to BK): their sum
                got = run(x, (il4 if il else ws4)[0], plan)
                err = rel(got.sum(0), want.sum(0)) if kind == "split" else rel(got, want)
                assert err < 2e-2, f"{name} {plan.int4_form} {plan.int4_tiles.__name__}: relative error {err:.1e}"
            row["tiles"] = time_candidates(kind, lambda i, plan, il: run(x, (il4 if il else ws4)[i % c4], plan), check,
                                           c4, base, quick, interleaved_only)
        out.append(row)
        print(f"{name} [{N} x {K}] T={T}: bf16 {t_bf:.1f} us, fp8 {t_f8:.1f} us, int4 {t4:.1f} us "
              f"({row['gbps']:.0f} GB/s, {row['of_copy_bw']:.2f} of copy bw; {t4 / t_bf:.2f} x bf16, "
              f"{t4 / t_f8:.2f} x fp8); zeros+perm {row['int4']['g128 zeros+perm']['us']:.1f} us "
              f"({row['int4']['g128 zeros+perm, x permuted once']['us']:.1f} with x permuted once), "
              f"g32 {row['int4']['g32']['us']:.1f} us (one copy each); interleaved "
              f"{row['int4']['g128 interleaved']['us']:.1f} us", flush=True)
        show(row["tiles"])


def bench_experts(Ts, base: ProductPlan, bw: float, quick: bool, out: list, interleaved_only: bool = False):
    gu4, d4 = quantized(E * 2 * F_E, H_E, experts=E), quantized(E * H_E, F_E, experts=E)
    gu8, d8 = fp8.quantize_ref(torch.randn(E * 2 * F_E, H_E, device="cuda") / H_E ** 0.5), \
        fp8.quantize_ref(torch.randn(E * H_E, F_E, device="cuda") / F_E ** 0.5)
    gub = torch.randn(E * 2 * F_E, H_E, device="cuda", dtype=torch.bfloat16) / H_E ** 0.5
    db = torch.randn(E * H_E, F_E, device="cuda", dtype=torch.bfloat16) / F_E ** 0.5
    for T in Ts:
        x = torch.randn(T, H_E, device="cuda", dtype=torch.bfloat16)
        ids, w, g, lay = moe_routing.route_step(torch.randn(T, E, device="cuda") * 3, TOPK, E)
        n = len(set(ids.flatten().tolist()))
        h = moe.expert_swiglu_triton(x, gub, lay, TOPK, E, plan=base)
        full = lay.expand(E)
        refs = {"expert_swiglu": lambda: moe.expert_swiglu_ref(x.float(), gu4, full, TOPK, E),
                "expert_down": lambda: moe.expert_down_ref(h.float(), d4, full, E)}
        for product, ws, fn in (("expert_swiglu", (gub, gu8, gu4), lambda w, plan: moe.expert_swiglu_triton(x, w, lay, TOPK, E, plan=plan)),
                                ("expert_down", (db, d8, d4), lambda w, plan: moe.expert_down_triton(h, w, lay, E, plan=plan))):
            t_bf, t_f8, t4 = (graph_time(lambda i: fn(w_, base), 1) for w_ in ws)
            il = int4.interleave_ref(ws[2])
            t_il = graph_time(lambda i: fn(il, base), 1)
            n4 = n * ws[2].nbytes() // E
            N, K = (2 * F_E, H_E) if product == "expert_swiglu" else (H_E, F_E)     # one expert's, as the rules take it
            row = dict(product=product, kind=product, N=N, K=K, experts_read=n, T=T, bf16_us=t_bf, fp8_us=t_f8,
                       int4_us=t4, int4_bytes=n4,
                       int4_interleaved_us=t_il,
                       gbps=n4 / t4 / 1e3, of_copy_bw=(n4 / bw * 1e6) / t4, tiles={},
                       note="one copy of the experts: the step's few experts may sit in L2 across launches")
            if T == Ts[0]:
                want = refs[product]()                 # float32, the experts dequantized on the GPU

                def check(plan, interleaved, fn=fn, ws=ws, il=il, want=want):
                    err = rel(fn(il if interleaved else ws[2], plan), want)
                    assert err < 2e-2, f"{product} {plan.int4_form} {plan.int4_tiles.__name__}: relative error {err:.1e}"
                row["tiles"] = time_candidates("expert", lambda i, plan, interleaved: fn(il if interleaved else ws[2], plan),
                                               check, 1, base, quick, interleaved_only)
                del want
            out.append(row)
            print(f"35B-A3B {product} T={T} ({n} experts): bf16 {t_bf:.1f} us, fp8 {t_f8:.1f} us, int4 {t4:.1f} us "
                  f"({row['gbps']:.0f} GB/s, {row['of_copy_bw']:.2f} of copy bw), interleaved {t_il:.1f} us", flush=True)
            show(row["tiles"])


def bench_prefill(T: int, out: list):
    """Prefill's products at T rows: bf16's torch matmul against the 4-bit forms (ProductPlan
    int4_prefill): "fused" (kernels/int4_gemm.py's kernel), "dense" (dequantized slabs, then
    torch's matmul) and "fp8" (slabs of the integers, x's rows in FP8, cuBLAS's block-scaled
    product), the dense and fp8 forms over the natural and the interleaved layouts."""
    for name, N, K, _ in SHAPES:
        q = quantized(N, K)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        want, want_fp8 = int4_gemm.gemm_ref(x, q), int4_gemm.fp8_gemm_ref(x, q)
        row = dict(product=name, N=N, K=K, T=T, prefill=True)
        il = int4.interleave_ref(q)
        for form, fn in (("bf16", lambda: x @ wb.T), ("fused", lambda: int4_gemm.gemm_triton(x, q)),
                         ("dense", lambda: int4_gemm.dense_gemm(x, q)),
                         ("dense interleaved", lambda: int4_gemm.dense_gemm(x, il)),
                         ("fp8", lambda: int4_gemm.requantized_gemm(x, q)),
                         ("fp8 interleaved", lambda: int4_gemm.requantized_gemm(x, il))):
            if form != "bf16":
                err = rel(fn(), want_fp8 if form.startswith("fp8") else want)
                assert err < 2e-2, f"prefill {name} {form}: relative error {err:.1e}"
            row[form + "_us"] = graph_time(lambda i: fn(), 1, 5)
        row["fp8_error_to_exact"] = rel(int4_gemm.requantized_gemm(x, q), want)
        row["dequantize_us"] = graph_time(lambda i: int4_gemm.dequantize_triton(q, torch.bfloat16, (0, min(N, 12800))), 1, 5)
        row["dequantize_interleaved_us"] = graph_time(
            lambda i: int4_gemm.dequantize_triton(il, torch.bfloat16, (0, min(N, 12800))), 1, 5)
        out.append(row)
        print(f"prefill {name} [{N} x {K}] T={T}: bf16 {row['bf16_us']:.0f} us, 4-bit fused {row['fused_us']:.0f} us, "
              f"dense {row['dense_us']:.0f} us, interleaved {row['dense interleaved_us']:.0f} us, fp8 "
              f"{row['fp8_us']:.0f} us, interleaved {row['fp8 interleaved_us']:.0f} us (fp8 off the exact product by "
              f"{row['fp8_error_to_exact']:.1e}; one slab's dequantizing {row['dequantize_us']:.0f} us, interleaved "
              f"{row['dequantize_interleaved_us']:.0f})", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="FILE", help="write the results there as JSON")
    p.add_argument("--quick", action="store_true", help="the default tiles only")
    p.add_argument("--prefill", type=int, default=2048, metavar="T", help="rows of the prefill products (0: none)")
    p.add_argument("--prefill-only", action="store_true", help="only prefill's products")
    p.add_argument("--rows", type=int, default=0, help="the plan's row tile (ProductPlan.rows; 0: its default)")
    p.add_argument("--no-experts", action="store_true", help="the 27B's products only")
    p.add_argument("--interleaved-only", action="store_true", help="only the interleaved form's candidate tiles")
    p.add_argument("--experts-only", action="store_true", help="the 35B-A3B's experts only")
    p.add_argument("--kinds", default="plain,swiglu,split", help="the 27B's products of these kinds only")
    p.add_argument("--rows-timed", default="1,4", help="the row counts to time (the tiles at the first)")
    a = p.parse_args()
    kinds, Ts = a.kinds.split(","), tuple(int(t) for t in a.rows_timed.split(","))
    start = time.time()
    torch.manual_seed(0)
    base = default_products("cuda")
    if a.rows:
        base = dataclasses.replace(base, rows=a.rows)
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s (read + written); plan {base.describe()}")
    out: list = []
    with torch.inference_mode():
        if a.prefill:
            bench_prefill(a.prefill, out)
        if not a.prefill_only:
            for name, N, K, kind in SHAPES if not a.experts_only else ():
                if kind in kinds:
                    bench_product(name, N, K, kind, Ts, base, bw, a.quick, out, a.interleaved_only)
            if not a.no_experts:
                bench_experts(Ts, base, bw, a.quick, out, a.interleaved_only)
    print(f"{time.time() - start:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbps=bw / 1e9, torch=torch.__version__,
                           results=out), f, indent=1)


if __name__ == "__main__":
    main()
