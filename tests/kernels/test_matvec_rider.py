"""A small product riding in another's launch (matvec.matvec_rider): the product's outputs bit for
bit those of its own launch, the rider's against its float32 reference, over bf16 or float32,
FP8 and 4-bit (interleaved) products, plain and Normed rows; a rider's row i of a T-row call bit
for bit the 1-row call (GPU); rows past the row tile in pieces; what may not ride."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, int4_weight, normed, product_weight, randn

from mtpchat.kernels import fp8, matvec
from mtpchat.kernels.plan import default_products

# numpy's matmul treats Triton's bf16 as integers in the interpreter: bf16 rows on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["tensor", "fp8", "int4"])
@pytest.mark.parametrize("T,N,N2,K", [(1, 200, 40, 384), (3, 96, 96, 256), (5, 300, 17, 640), (2, 448, 24, 512)])
@pytest.mark.parametrize("is_normed", [False, True])
def test_a_rider_and_its_product(device, dtype, form, T, N, N2, K, is_normed):
    # N2 of 17 and 40: a last rider block of 1 and 8 rows; 300 rows of FP8: a partial scale block;
    # 448 float32 rows on the interpreter's 6 "SMs": 7 blocks of 64, the last split over K in 2
    # parts (matvec.tail_split) after the rider's programs
    g = torch.Generator().manual_seed(T * N2 + K)
    x = normed(T, K, dtype, device, g) if is_normed else randn(T, K, dtype=dtype, device=device, gen=g)
    w = product_weight(form, N, K, dtype, device, seed=N + K)
    w2 = randn(N2, K, dtype=dtype, device=device, gen=g, scale=K ** -0.5)
    plan = default_products(device)
    y, y2 = matvec.matvec_rider_triton(x, w, w2, plan=plan)
    assert torch.equal(y, matvec.matvec_triton(x, w, plan=plan)), "the ridden product's outputs moved"
    check(y2, matvec.matvec_ref(x, w2), TOL[dtype], "rider")
    check(y, matvec.matvec_ref(x, w), TOL[dtype] if form == "tensor" else 2e-2, "product")


def test_rows_past_the_row_tile_run_in_pieces(device):
    # a 4-bit product's row tile is 8 rows: 11 rows run as 8 + 3, the rider's with them
    g = torch.Generator().manual_seed(11)
    x = randn(11, 256, device=device, gen=g)
    w, w2 = product_weight("int4", 64, 256, torch.float32, device, 3), randn(24, 256, device=device, gen=g)
    plan = default_products(device)
    y, y2 = matvec.matvec_rider_triton(x, w, w2, plan=plan)
    assert torch.equal(y, matvec.matvec_triton(x, w, plan=plan))
    check(y2, matvec.matvec_ref(x, w2), TOL[torch.float32], "rider")


def test_what_may_not_ride(device):
    x = randn(2, 256, device=device, seed=1)
    w = randn(64, 256, device=device, seed=2)
    assert matvec.rides(x, w, randn(16, 256, device=device, seed=3))
    assert not matvec.rides(x, w, randn(16, 128, device=device, seed=3)), "another K"
    assert not matvec.rides(x, w, randn(16, 256, device=device, seed=3, dtype=torch.float16)), "another dtype"
    assert not matvec.rides(x, w, fp8.quantize_ref(randn(128, 256, device=device, seed=3))), "not a tensor"
    permuted = int4_weight(64, 256, device, 5, perm=True)
    assert not matvec.rides(x, permuted, randn(16, 256, device=device, seed=3)), "x permuted for the product"
    with pytest.raises(AssertionError, match="rider"):
        matvec.matvec_rider_triton(x, permuted, randn(16, 256, device=device, seed=3))


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["tensor", "fp8", "int4"])
@pytest.mark.parametrize("N,N2,K", [(16384, 96, 5120), (12288, 64, 2048)])
def test_rider_rows_do_not_depend_on_T(form, N, N2, K):
    # the 27B's and the 35B-A3B's GDN in_proj with its b|a rows riding
    g = torch.Generator().manual_seed(N2)
    x = randn(matvec.MAX_ROWS, K, dtype=torch.bfloat16, device="cuda", gen=g)
    w = product_weight(form, N, K, torch.bfloat16, "cuda", seed=K)
    w2 = randn(N2, K, dtype=torch.bfloat16, device="cuda", gen=g, scale=K ** -0.5)
    plan = default_products("cuda")
    y, y2 = matvec.matvec_rider_triton(x, w, w2, plan=plan)
    for i in range(x.shape[0]):
        yi, y2i = matvec.matvec_rider_triton(x[i:i + 1], w, w2, plan=plan)
        assert torch.equal(y2[i:i + 1], y2i), f"rider row {i} of {x.shape[0]} differs from its 1-row call"
        assert torch.equal(y[i:i + 1], yi), f"product row {i} of {x.shape[0]} differs from its 1-row call"
    assert torch.equal(y, matvec.matvec_triton(x, w, plan=plan))
    check(y2, matvec.matvec_ref(x, w2), 1e-2, "rider")
