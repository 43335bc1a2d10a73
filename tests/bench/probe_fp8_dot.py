"""Few-row products over FP8 weights without widening: the weights straight into fp8 x fp8 tensor-core
dots, the rows quantized per token and 128 columns (as fp8_gemm.py does for prefill, the official
checkpoints' `activation_scheme: dynamic`), and the weights' tiles brought in by the tensor memory
accelerator (TMA descriptors) or by plain loads.

    cd tests/bench && python3 probe_fp8_dot.py                     # on the GPU
    TRITON_INTERPRET=1 python3 probe_fp8_dot.py --check              # the forms' values, small, on the CPU

The production FP8 products widen each weight to bf16 in registers before a bf16 dot, and run at
1.6-2.2 TB/s where bf16's reach 2.9 (docs/PERFORMANCE.md): the widened tile goes shared memory ->
registers -> widening -> the matrix instructions. An fp8 x fp8 dot reads the weights' tile from
shared memory as it landed. Forms, on one product (N x K, 1 and 4 rows):

- "widen": the production arithmetic (bit-form widening, bf16 dot, the block scale after);
- "fp8 dot": each row's 128 columns quantized in the program (amax / 448, round to e4m3), one fp8
  dot a scale block, scaled by the weight's block scale and the rows' scales;
- "fp8 dot, rows quantized before": the same with the rows quantized once by their own kernel
  (what in-program quantizing costs);
- "words": the tile's bytes only, xor'ed as 32-bit words (what its loads allow);
each with plain loads (cp.async) and with TMA, under a few tiles.
"""
from __future__ import annotations

import argparse

import torch
from graph_timing import graph_time

from mtpchat.engine.bench import copy_bandwidth
from mtpchat.kernels import fp8, fp8_gemm
from mtpchat.kernels._triton import interpreting, tl, triton

WIDEN, FP8_DOT, FP8_DOT_PRE, WORDS, FP8_DOT_RCP = 0, 1, 2, 3, 4
NAMES = {WIDEN: "widen", FP8_DOT: "fp8 dot", FP8_DOT_PRE: "fp8 dot, rows quantized before", WORDS: "words",
         FP8_DOT_RCP: "fp8 dot, x times 448 / amax"}


@triton.jit(do_not_specialize=["T"])
def _probe(x, xq, xs, w, w_desc, wi, wi_desc, sw, y, T, K, s_sw, s_xs,
           FORM: tl.constexpr, TMA: tl.constexpr, BN: tl.constexpr, U: tl.constexpr, BT: tl.constexpr,
           BITS: tl.constexpr, INTERPRET: tl.constexpr):
    i_n = tl.program_id(0)
    o_r = i_n * BN + tl.arange(0, BN)
    o_c, o_t = tl.arange(0, 128), tl.arange(0, BT)
    m_t = o_t < T
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    bits = tl.zeros([BN, 32], dtype=tl.int32)
    for k0 in range(0, K, U * 128):
        for u in tl.static_range(U):
            k = k0 + u * 128
            if FORM == 3:
                if TMA:
                    b_i = wi_desc.load([i_n * BN, k // 4])
                else:
                    b_i = tl.load(wi + o_r[:, None] * (K // 4) + k // 4 + tl.arange(0, 32)[None, :])
                bits ^= b_i
            else:
                if TMA:
                    b_w = w_desc.load([i_n * BN, k])
                else:
                    b_w = tl.load(w + o_r[:, None] * K + k + o_c[None, :])
                b_s = tl.load(sw + (i_n * BN // 128) * s_sw + k // 128)
                if FORM == 0:
                    b_x = tl.trans(tl.load(x + o_t[:, None] * K + k + o_c[None, :], mask=m_t[:, None], other=0.))
                    acc += b_s * tl.dot(fp8.widen(b_w, b_x, BITS), b_x, input_precision="ieee")
                elif FORM == 1 or FORM == 4:
                    b_x = tl.load(x + o_t[:, None] * K + k + o_c[None, :], mask=m_t[:, None], other=0.).to(tl.float32)
                    b_amax = tl.max(tl.abs(b_x), axis=1)
                    b_xs = tl.where(b_amax > 0, tl.math.div_rn(b_amax, tl.full([BT], 448., tl.float32)), 1.)
                    if FORM == 1:
                        b_v = tl.math.div_rn(b_x, tl.broadcast_to(b_xs[:, None], [BT, 128]))
                    else:
                        b_r = tl.where(b_amax > 0, tl.math.div_rn(tl.full([BT], 448., tl.float32), b_amax), 1.)
                        b_v = b_x * b_r[:, None]
                    b_v = tl.minimum(tl.maximum(b_v, -448.), 448.)
                    if INTERPRET:
                        b_v = fp8_gemm._round_e4m3(b_v)
                    b_q = b_v.to(tl.float8e4nv)
                    acc += tl.dot(b_w, tl.trans(b_q)) * (b_s * b_xs)[None, :]
                else:
                    b_q = tl.load(xq + o_t[:, None] * K + k + o_c[None, :], mask=m_t[:, None], other=0.)
                    b_xs = tl.load(xs + o_t * s_xs + k // 128, mask=m_t, other=0.)
                    acc += tl.dot(b_w, tl.trans(b_q)) * (b_s * b_xs)[None, :]
    if FORM == 3:
        acc += tl.sum(bits, axis=1).to(tl.float32)[:, None]
    tl.store(y + o_t[None, :] * (tl.num_programs(0) * BN) + o_r[:, None], acc, mask=m_t[None, :])


def launch(form: int, tma: bool, x, pre, q: fp8.BlockFP8, y, T: int, BN: int = 64, U: int = 1, warps: int = 4,
           stages: int = 4):
    N, K = q.shape
    wi = q.w.view(torch.int32)
    w_desc = wi_desc = None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        w_desc = TensorDescriptor.from_tensor(q.w, [BN, 128])
        wi_desc = TensorDescriptor.from_tensor(wi, [BN, 32])
    xq, xs = pre
    bits = 2 if BN >= 64 and warps % 4 == 0 else 4
    if interpreting() or not x.is_cuda or x.dtype != torch.bfloat16:
        bits = 0
    return _probe[(N // BN,)](x, xq, xs, q.w, w_desc, wi, wi_desc, q.scale, y, T, K, q.scale.stride(0), xs.stride(0),
                              FORM=form, TMA=tma, BN=BN, U=U, BT=16, BITS=bits, INTERPRET=interpreting(),
                              num_warps=warps, num_stages=stages)


def quantize_rcp_ref(x: torch.Tensor):
    """As fp8_gemm.quantize_rows_ref, but each group times 448 / amax rather than divided by amax / 448."""
    M, K = x.shape
    b = x.float().view(M, K // 128, 128)
    amax = b.abs().amax(dim=-1)
    xs = torch.where(amax > 0, amax / 448., torch.ones_like(amax))
    r = torch.where(amax > 0, 448. / amax, torch.ones_like(amax))
    xq = (b * r[:, :, None]).clamp(-448., 448.).to(fp8.FP8)
    return xq.view(M, K), xs


def check(device: str, N: int = 256, K: int = 640):
    """Each dot form against its float32 reference (fresh random inputs, 1 and 3 rows)."""
    g = torch.Generator().manual_seed(1)
    q = fp8.quantize_ref(torch.randn(N, K, generator=g))
    q = fp8.BlockFP8(q.w.to(device), q.scale.to(device))
    x = (torch.randn(16, K, generator=g) * torch.rand(16, 1, generator=g) * 4).to(device)
    xq, xs = fp8_gemm.quantize_rows_ref(x.cpu())
    xq, xs = xq.to(device), xs.to(device)
    y = torch.empty(16, N, device=device)
    for T in (1, 3):
        want_w = x[:T].float() @ fp8.dequantize_ref(q).T
        want_q = fp8_gemm.gemm_ref(xq[:T], xs[:T], q, torch.float32)
        want_r = fp8_gemm.gemm_ref(*[t.to(device) for t in quantize_rcp_ref(x[:T].cpu())], q, torch.float32)
        for form, want in ((WIDEN, want_w), (FP8_DOT, want_q), (FP8_DOT_PRE, want_q), (FP8_DOT_RCP, want_r)):
            for U in (1, 5):
                y.fill_(float("nan"))
                launch(form, False, x, (xq, xs), q, y, T, U=U, stages=2)
                err = ((y[:T] - want).norm() / want.norm()).item()
                # Hopper's fp8 tensor cores add a 128-long dot with a shorter mantissa than float32's
                assert err < (1e-5 if form == WIDEN or not x.is_cuda else 1e-3), (NAMES[form], U, T, err)
        print(f"T={T}: every form equals its reference; the quantized rows' product against the unquantized "
              f"one: {((want_q - want_w).norm() / want_w.norm()).item():.1e}")


def main(N: int, K: int):
    x = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
    pre = fp8_gemm.quantize_rows(x)
    y = torch.empty(16, N, device="cuda")
    qs = [fp8.quantize_ref(torch.randn(N, K, device="cuda")) for _ in range(3)]
    bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    print(f"{N} x {K}; copy: {copy_bandwidth('cuda') / 1e12:.2f} TB/s (read + written)")
    from mtpchat.kernels import matvec
    for T in (1, 4):
        t_bf = graph_time(lambda i: matvec.matvec(x[:T], bf[i]), 3)
        t_pr = graph_time(lambda i: matvec.matvec(x[:T], qs[i]), 3)
        print(f"T={T} bf16 matvec {t_bf:6.1f} us {N * K * 2 / t_bf / 1e6:.2f} TB/s | FP8 matvec (production) "
              f"{t_pr:6.1f} us {N * K / t_pr / 1e6:.2f} TB/s", flush=True)
    # agreement on the GPU: each form's 4 rows against the references
    want_w = x[:4].float() @ fp8.dequantize_ref(qs[0]).T
    want_q = fp8_gemm.gemm_ref(pre[0][:4], pre[1][:4], qs[0], torch.float32)
    want_r = fp8_gemm.gemm_ref(*quantize_rcp_ref(x[:4]), qs[0], torch.float32)
    for form, want in ((WIDEN, want_w), (FP8_DOT, want_q), (FP8_DOT_PRE, want_q), (FP8_DOT_RCP, want_r)):
        for tma in (False, True):
            launch(form, tma, x, pre, qs[0], y, 4)
            print(f"{NAMES[form]}{' TMA' if tma else ''}: error {((y[:4] - want).norm() / want.norm()).item():.1e}")
    print(f"the quantized rows' product against the unquantized one: "
          f"{((want_q - want_w).norm() / want_w.norm()).item():.1e}")
    for form in (WORDS, WIDEN, FP8_DOT_PRE, FP8_DOT_RCP, FP8_DOT):
        for tma in (False, True):
            for BN, U, warps, stages in ((64, 1, 4, 4), (64, 1, 4, 8), (32, 1, 2, 8), (64, 2, 4, 4), (128, 1, 4, 4),
                                         (128, 1, 8, 4)):
                for T in (1,):
                    def run(i, form=form, tma=tma, BN=BN, U=U, warps=warps, stages=stages, T=T):
                        return launch(form, tma, x, pre, qs[i], y, T, BN, U, warps, stages)
                    label = f"{NAMES[form]:>30}{' TMA' if tma else '    '} {BN:3d} x {128 * U} w{warps} s{stages} T={T}"
                    try:
                        us = graph_time(run, 3)
                    except Exception as e:       # noqa: BLE001 (a probe: a refused form is a finding)
                        print(f"{label}: {type(e).__name__} {str(e).splitlines()[0][:100] if str(e) else ''}")
                        continue
                    print(f"{label}: {us:6.1f} us {N * K / us / 1e6:.2f} TB/s", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="the forms' values only (CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--shape", default="16384x5120", help="N x K of the product")
    args = ap.parse_args()
    if args.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
    else:
        print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        check("cuda")
        main(*map(int, args.shape.split("x")))
