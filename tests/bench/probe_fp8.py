"""Probes for the FP8 paths on the GPU, each against the bf16 path of the same shape, in one process:

    cd tests/bench && python3 probe_fp8.py

1. Few-row products (decode): forms of the K loop over FP8 weights, as small kernels of their own,
   timed in CUDA graphs of 20 launches over rotating weights: the dot on the weights widened to
   bf16 then scaled (the production form), the rows pre-scaled by the block's scale so the dots
   chain, the dot in fp16, and a dot-free multiply-and-sum for one row; with the PTX's counts of
   conversions and matrix instructions.
2. Prefill products: torch._scaled_mm with DeepSeek-style block scales (1 x 128 activations,
   128 x 128 weights) in the scale layouts it might take, checked against the reference, and
   timed against kernels/fp8_gemm.py and bf16 cuBLAS.
"""
from __future__ import annotations

import re

import torch

from graph_timing import graph_time
from mtpchat.kernels import fp8, fp8_gemm
from mtpchat.kernels._triton import tl, triton


@triton.jit
def _probe_kernel(x, w, sw, y, K, s_w, s_sw, FORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  BT: tl.constexpr):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_t = tl.arange(0, BT)
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    acc1 = tl.zeros([BN], dtype=tl.float32)
    for k in range(0, K, BK):
        o_k = k + tl.arange(0, BK)
        b_x = tl.trans(tl.load(x + o_t[:, None] * K + o_k[None, :]))          # [BK, BT] bf16
        b_w = tl.load(w + o_n[:, None] * s_w + o_k[None, :])
        if FORM == 0:       # bf16 weights
            acc = tl.dot(b_w, b_x, acc)
        elif FORM == 8:     # bf16 weights, operands swapped
            acc += tl.trans(tl.dot(tl.trans(b_x), tl.trans(b_w)))
        else:
            b_s = tl.load(sw + (i_n * BN // 128) * s_sw + k // 128)
            if FORM == 1:   # widened to bf16, dot, scaled
                acc += b_s * tl.dot(b_w.to(tl.bfloat16), b_x)
            elif FORM == 2:  # rows pre-scaled: the dots chain
                acc = tl.dot(b_w.to(tl.bfloat16), (b_x.to(tl.float32) * b_s).to(tl.bfloat16), acc)
            elif FORM == 3:  # fp16 dot
                acc += b_s * tl.dot(b_w.to(tl.float16), b_x.to(tl.float16))
            elif FORM == 7:  # operands swapped: the rows [BT, BK] times the widened weights' transpose
                acc7 = tl.dot(tl.trans(b_x), tl.trans(b_w.to(tl.bfloat16)))
                acc += b_s * tl.trans(acc7)
            elif FORM == 5 or FORM == 6:
                # e4m3 bits moved into an fp16's (the value times 2^-8, subnormals too) by integer ops,
                # no conversion instructions; weights passed as uint8. FORM 6: rows already fp16
                b_u = b_w.to(tl.uint16)
                b_h = (((b_u & 0x80) << 8) | ((b_u & 0x7F) << 7)).to(tl.float16, bitcast=True)
                acc += (b_s * 256.0) * tl.dot(b_h, b_x.to(tl.float16))
            else:           # one row, no dot
                b_x1 = tl.load(x + o_k).to(tl.float32)
                acc1 += b_s * tl.sum(b_w.to(tl.float32) * b_x1[None, :], axis=1)
    if FORM == 4:
        tl.store(y + o_n, acc1)
    else:
        tl.store(y + o_t[None, :] * 65536 + o_n[:, None], acc)


def decode_forms():
    N, K, BT = 16384, 5120, 16
    x = torch.randn(BT, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(BT, 65536, device="cuda")
    bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q = [fp8.quantize_ref(torch.randn(N, K, device="cuda")) for _ in range(3)]
    names = {0: "bf16 weights", 1: "fp8 -> bf16, dot, scale", 2: "fp8, rows pre-scaled, chained dots",
             3: "fp8 -> fp16 dot", 4: "fp8, one row, no dot", 5: "fp8 bits -> fp16 bits, fp16 dot",
             6: "the same, rows given in fp16", 7: "fp8 -> bf16, operands swapped", 8: "bf16, operands swapped"}
    x16 = x.half()
    base = None
    for form, (BN, BK, warps, stages) in [(0, (64, 256, 4, 4)), (1, (64, 128, 4, 8)), (8, (64, 256, 4, 4)),
                                          (7, (64, 128, 4, 8)), (7, (128, 128, 4, 6)), (7, (64, 128, 4, 4)),
                                          (7, (128, 128, 8, 8)), (7, (256, 128, 8, 4))]:
        def run(i, form=form, BN=BN, BK=BK, warps=warps, stages=stages):
            w, sw = (bf[i], bf[i]) if form in (0, 8) else (q[i].w, q[i].scale)
            w = w.view(torch.uint8) if form in (5, 6) else w
            if BK == 256 and form:       # two scale blocks a tile: one scale for both (timing only)
                pass
            return _probe_kernel[(N // BN,)](x16 if form == 6 else x, w, sw, y, K, w.stride(0), sw.stride(0),
                                             FORM=form, BN=BN, BK=BK, BT=BT, num_warps=warps, num_stages=stages)
        kernel = run(0)
        us = graph_time(run, 3)
        nbytes = N * K * (2 if form in (0, 8) else 1)
        base = base or us
        ptx = kernel.asm.get("ptx", "")
        counts = {k: len(re.findall(p, ptx)) for k, p in
                  (("cvt", r"\bcvt\."), ("wgmma", r"wgmma\.mma_async"), ("mma", r"\bmma\.sync"),
                   ("ldmatrix", r"ldmatrix"), ("cp.async", r"cp\.async"))}
        print(f"decode {names[form]:<38} tile {BN}x{BK} w{warps} s{stages}: {us:7.1f} us "
              f"{nbytes / us / 1e6:5.2f} TB/s ({us / base:.3f} x bf16) ptx {counts}")


def cublas_shapes():
    """Which shapes torch._scaled_mm's block-scaled product computes right (some come back wrong
    without an error)."""
    for M, N, K in ((300, 640, 384), (2048, 640, 384), (300, 16384, 5120), (2048, 16384, 5120), (2000, 16384, 5120),
                    (1920, 16384, 5120), (256, 16384, 5120), (130, 16384, 5120), (2048, 200, 384), (2048, 16384, 300),
                    (64, 16384, 5120), (16, 16384, 5120), (1, 16384, 5120)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        q = fp8.quantize_ref(torch.randn(N, K, device="cuda") / K ** 0.5)
        xq, xs = fp8_gemm.quantize_rows(x)
        want = fp8_gemm.gemm_ref(xq, xs, q, torch.float32)
        try:
            y = fp8_gemm.gemm_cublas(xq, xs, q, torch.bfloat16)
            print(f"cublas [{M} x {N} x {K}]: error {((y.float() - want).norm() / want.norm()).item():.2e}")
        except Exception as e:       # noqa: BLE001
            print(f"cublas [{M} x {N} x {K}]: refused: {str(e).splitlines()[0][:100]}")


def prefill():
    M = 2048
    for N, K in ((34816, 5120), (5120, 17408), (16384, 5120)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        q = fp8.quantize_ref(torch.randn(N, K, device="cuda") / K ** 0.5)
        xq, xs = fp8_gemm.quantize_rows(x)
        want = fp8_gemm.gemm_ref(xq, xs, q, torch.float32)
        wbf = fp8.dequantize_ref(q, torch.bfloat16)
        t_bf = graph_time(lambda i: x @ wbf.T, 1, 5)
        t_tr = graph_time(lambda i: fp8_gemm.gemm(x, q), 1, 5)
        print(f"prefill [{M} x {N} x {K}]: bf16 cuBLAS {t_bf:.0f} us, fp8_gemm (Triton) {t_tr:.0f} us "
              f"({t_tr / t_bf:.2f} x)")
        layouts = {"xs [M, KB] M-major, ws [NB, KB]": (xs, q.scale),
                   "xs [M, KB] contiguous, ws [NB, KB]": (xs.contiguous(), q.scale),
                   "xs [M, KB] M-major, ws [KB, NB]": (xs, q.scale.T),
                   "xs [M, KB] M-major, ws [KB, NB] contiguous": (xs, q.scale.T.contiguous())}
        for name, (sa, sb) in layouts.items():
            try:
                y = torch._scaled_mm(xq, q.w.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            except Exception as e:       # noqa: BLE001 (a probe: every refusal is a finding)
                print(f"  _scaled_mm {name}: refused: {str(e).splitlines()[0][:150]}")
                continue
            err = ((y.float() - want).norm() / want.norm()).item()
            t = graph_time(lambda i: torch._scaled_mm(xq, q.w.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                           1, 5)
            print(f"  _scaled_mm {name}: error {err:.2e}, {t:.0f} us ({t / t_bf:.2f} x bf16)")


if __name__ == "__main__":
    print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())
    decode_forms()
