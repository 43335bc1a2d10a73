"""Prefill's product over 4-bit weights (kernels/int4_gemm.py) against its float32 reference: odd
row and column counts, groups of 32 and 128, symmetric and with zeros, with and without perm; the
27B's shapes (GPU)."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, int4_weight, randn

from mtpchat.kernels import int4, int4_gemm
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
