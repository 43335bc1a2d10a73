"""Prefill's product over 4-bit weights (kernels/int4_gemm.py) against its float32 reference: odd
row and column counts, groups of 32 and 128, symmetric and with zeros, with and without perm; the
27B's shapes (GPU)."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, int4_weight, randn

from mtpchat.kernels import int4_gemm
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
    check(int4_gemm.gemm(x, w), int4_gemm.gemm_ref(x, w), 1e-2)
