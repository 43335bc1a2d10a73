"""Prefill's product over 4-bit weights (kernels/int4_gemm.py) against its float32 reference: odd
row and column counts, groups of 32 and 128, symmetric and with zeros, with and without perm; the
27B's shapes (GPU)."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, int4_weight, randn

from mtpchat.kernels import fp8, fp8_gemm, int4, int4_gemm
from mtpchat.kernels.plan import ProductPlan

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
SMALL = (32, 32, 256, 4, 2)          # tiles small enough for the interpreter, still 2 x 2 programs and 2 K tiles


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K,group,symmetric,perm", [
    (37, 50, 384, 32, True, False), (5, 64, 256, 128, False, True), (70, 45, 512, 128, True, True)])
def test_int4_gemm(device, dtype, T, N, K, group, symmetric, perm):
    w = int4_weight(N, K, device, T, group, symmetric, perm)
    x = randn(T, K, dtype=dtype, device=device, seed=N)
    check(int4_gemm.gemm_triton(x, w, SMALL), int4_gemm.gemm_ref(x, w), TOL[dtype])


def test_int4_gemm_slices_form(device):
    # groups of 128, tiles of 128 columns: 8 dots of 16 words a group (int4.form_args)
    w = int4_weight(45, 384, device, 3, 128, False, True)
    x = randn(37, 384, device=device, seed=4)
    plan = ProductPlan(programs=6, int4_form="slices")
    check(int4_gemm.gemm_triton(x, w, (32, 32, 128, 4, 2), plan=plan), int4_gemm.gemm_ref(x, w), TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(34816, 5120), (5120, 17408), (16384, 5120)])
def test_int4_gemm_27b_shapes(N, K):
    w = int4_weight(N, K, "cuda", 1, 128, False, True)
    x = randn(300, K, dtype=torch.bfloat16, device="cuda", seed=2)
    check(int4_gemm.gemm_triton(x, w), int4_gemm.gemm_ref(x, w), 1e-2)
    check(int4_gemm.dense_gemm(x, w), int4_gemm.gemm_ref(x, w), 1e-2)
    assert torch.equal(int4_gemm.gemm(x, w), int4_gemm.dense_gemm(x, w))        # the default plan's form
    assert torch.equal(int4_gemm.gemm(x, w, ProductPlan(programs=132, int4_prefill="fused")), int4_gemm.gemm_triton(x, w))
    assert torch.equal(int4_gemm.dequantize_triton(w, torch.bfloat16, (5, 300)),
                       int4.dequantize_ref(w._replace(perm=None), torch.bfloat16)[5:300])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,group,symmetric,perm", [(50, 384, 32, True, False), (45, 1152, 128, False, True),
                                                      (33, 256, 64, False, False)])
def test_int4_dequantize_equals_its_reference_bit_for_bit(device, dtype, N, K, group, symmetric, perm):
    # the weight's own column order (perm not applied); rows 7 .. 40 alone as a slab writes them
    w = int4_weight(N, K, device, N + K, group, symmetric, perm)
    want = int4.dequantize_ref(w._replace(perm=None), dtype)
    assert torch.equal(int4_gemm.dequantize_triton(w, dtype), want)
    out = torch.full((33, K), 7., dtype=dtype, device=device)
    int4_gemm.dequantize_triton(w, dtype, (7, min(40, N)), out[:min(40, N) - 7])
    assert torch.equal(out[:min(40, N) - 7], want[7:min(40, N)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,group,symmetric", [(50, 1152, 128, True), (33, 384, 64, False), (21, 2560, 1280, False)])
def test_interleaved_weights_in_prefill(device, dtype, N, K, group, symmetric):
    """An interleaved weight (int4.interleave_ref) dequantizes to the same bits as the weight it
    came from, and prefill's dense product takes it; the fused form refuses it."""
    w = int4_weight(N, K, device, N, group, symmetric)
    il = int4.interleave_ref(w)
    assert torch.equal(int4_gemm.dequantize_triton(il, dtype), int4.dequantize_ref(w, dtype))
    x = randn(37, K, dtype=dtype, device=device, seed=3)
    check(int4_gemm.dense_gemm(x, il, slab_bytes=16 * K * x.element_size()),
          (x.float() @ int4.dequantize_ref(w, dtype).float().T).to(dtype), TOL[dtype])
    with pytest.raises(AssertionError, match="interleaved"):
        int4_gemm.gemm_triton(x, il)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K,group,symmetric,perm", [(37, 50, 384, 32, True, False), (70, 45, 512, 128, False, True)])
def test_int4_dense_prefill(device, dtype, T, N, K, group, symmetric, perm):
    # slabs of 16 rows (the dequantize tile's): 4 and 3 of them, the last partial
    w = int4_weight(N, K, device, T + 1, group, symmetric, perm)
    x = randn(T, K, dtype=dtype, device=device, seed=N + 1)
    want = (x.float() @ int4.dequantize_ref(w, dtype).float().T).to(dtype)    # the weight rounded to x's dtype
    check(int4_gemm.dense_gemm(x, w, slab_bytes=16 * K * x.element_size()), want, TOL[dtype])
    check(int4_gemm.dense_gemm(x, w), want, TOL[dtype])


@pytest.mark.parametrize("N,K,symmetric,interleave", [(256, 384, True, False), (384, 1152, False, True),
                                                     (200, 256, False, False)])
def test_int4_requantize_equals_its_reference_bit_for_bit(device, N, K, symmetric, interleave):
    """The fp8 form's slab: the 4-bit weight dequantized in float32 and quantized to FP8 blocks of
    128 x 128 by fp8.quantize_ref's rule; rows 128 .. 256 alone as a slab writes them; a partial
    last block of rows."""
    w = int4_weight(N, K, device, N + 3, 128, symmetric)
    if interleave:
        w = int4.interleave_ref(w)
    want = int4_gemm.requantize_ref(w)
    got = int4_gemm.requantize_triton(w)
    assert torch.equal(got.scale, want.scale)
    assert torch.equal(got.w.view(torch.uint8), want.w.view(torch.uint8))
    part = int4_gemm.requantize_triton(w, (128, min(256, N)))
    assert torch.equal(part.w.view(torch.uint8), want.w[128:min(256, N)].view(torch.uint8))
    assert torch.equal(part.scale, want.scale[1:2])
    many = int4_gemm.requantize_triton(w, tile=(4, 4))          # 4 groups a program, the last program's partly past K
    assert torch.equal(many.w.view(torch.uint8), want.w.view(torch.uint8)) and torch.equal(many.scale, want.scale)


@pytest.mark.parametrize("interleave", [False, True])
def test_fp8_form_takes_quantized_rows(device, interleave):
    # rows handed over quantized (a fused producer's) give the fp8 form's product bit for bit
    w = int4_weight(256, 384, device, 10, 128, True)
    w = int4.interleave_ref(w) if interleave else w
    x = randn(37, 384, dtype=torch.bfloat16, device=device, seed=11)
    xq, xs = fp8_gemm.quantize_rows_triton(x, fp8_gemm.CUBLAS_ROWS)
    got = int4_gemm.gemm(fp8_gemm.QuantizedRows(xq, xs, 37, x.dtype), w)
    assert got.shape == (37, 256) and torch.equal(got, int4_gemm.requantized_gemm(x, w))
    check(got, int4_gemm.fp8_gemm_ref(x, w), 1e-2)


def test_fp8_form_reference_is_quantized_rows_times_the_weight(device):
    # with a perm: x's columns in the weight's order are what is quantized in groups of 128
    w = int4_weight(40, 512, device, 9, 128, False, True)
    x = randn(7, 512, device=device, seed=8)
    xp = x[:, w.perm.long()]
    xq, xs = fp8_gemm.quantize_rows_ref(xp)
    wq = int4_gemm.requantize_ref(w)
    assert wq.scale.shape == (1, 4)
    check(fp8.dequantize_ref(wq), int4.dequantize_ref(w._replace(perm=None)), 3e-2)   # e4m3's rounding of the weights
    want = (xq.float() * xs.repeat_interleave(128, dim=1)) @ fp8.dequantize_ref(wq).T
    check(int4_gemm.fp8_gemm_ref(x, w), want, 1e-6)
    # the activations' rounding is all that moves it off the exact product: a few percent at most
    check(int4_gemm.fp8_gemm_ref(x, w), int4_gemm.gemm_ref(x, w), 5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,T,symmetric,layout", [(16384, 5120, 300, True, "interleaved"),
                                                    (5120, 17408, 2048, False, "perm"),
                                                    (34816, 5120, 257, True, "interleaved")])
def test_int4_fp8_prefill_27b_shapes(N, K, T, symmetric, layout):
    """The fp8 form on the 27B's shapes (several slabs and a partial last one where the weight is
    larger than a slab; interleaved words, and natural ones with a perm) against what it computes
    in float32, and the plan's dispatch to it."""
    w = int4_weight(N, K, "cuda", 4, 128, symmetric, layout == "perm")
    if layout == "interleaved":
        w = int4.interleave_ref(w)
    x = randn(T, K, dtype=torch.bfloat16, device="cuda", seed=5)
    assert int4_gemm.fp8_serves(x, w)
    want = int4_gemm.fp8_gemm_ref(x, w)
    got = int4_gemm.requantized_gemm(x, w)
    check(got, want, 1e-2)
    check(got, int4_gemm.gemm_ref(x, w), 5e-2)
    small = int4_gemm.requantized_gemm(x, w, slab_bytes=3000 * K * 2)     # slabs of 2,944 rows
    check(small, want, 1e-2)
    assert torch.equal(int4_gemm.gemm(x, w, ProductPlan(programs=132, int4_prefill="fp8")), got)


@pytest.mark.gpu
def test_int4_fp8_prefill_falls_back_to_dense():
    """Where the fp8 form does not serve (fewer rows than cuBLAS takes, weights of rows not in whole
    128-row blocks, groups other than 128) the plan's fp8 form is the dense one, bit for bit."""
    plan = ProductPlan(programs=132, int4_prefill="fp8")
    w = int4_weight(1024, 2048, "cuda", 6, 128, True)
    x = randn(100, 2048, dtype=torch.bfloat16, device="cuda", seed=6)
    assert not int4_gemm.fp8_serves(x, w)
    assert torch.equal(int4_gemm.gemm(x, w, plan), int4_gemm.dense_gemm(x, w))
    rows = int4_weight(1000, 2048, "cuda", 8, 128, True)               # not whole 128-row blocks
    x = randn(512, 2048, dtype=torch.bfloat16, device="cuda", seed=8)
    assert not int4_gemm.fp8_serves(x, rows) and int4_gemm.fp8_serves(x, int4_weight(1024, 2048, "cuda", 8))
    assert torch.equal(int4_gemm.gemm(x, rows, plan), int4_gemm.dense_gemm(x, rows))
    w64 = int4_weight(1024, 2048, "cuda", 7, 64, False)
    x = randn(512, 2048, dtype=torch.bfloat16, device="cuda", seed=7)
    assert not int4_gemm.fp8_serves(x, w64)
    assert torch.equal(int4_gemm.gemm(x, w64, plan), int4_gemm.dense_gemm(x, w64))
