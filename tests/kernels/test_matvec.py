"""Few-row matrix-vector products against matvec_ref, and their row invariance: row i of a T-row
call is bit for bit the 1-row call (GPU)."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import matvec

# numpy's matmul treats Triton's bf16 as integers in the interpreter: bf16 runs on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 5])
@pytest.mark.parametrize("N,K", [(100, 300), (77, 520), (64, 256)])
def test_matvec(device, dtype, T, N, K):
    g = torch.Generator().manual_seed(T * N + K)
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(N, K, dtype=dtype, device=device, gen=g)
    check(matvec.matvec_triton(x, w), matvec.matvec_ref(x, w), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("N,K", [(70, 300), (64, 512)])
def test_matvec_swiglu(device, dtype, T, N, K):
    g = torch.Generator().manual_seed(T + N)
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(2 * N, K, dtype=dtype, device=device, gen=g, scale=0.1)
    check(matvec.matvec_swiglu_triton(x, w), matvec.matvec_swiglu_ref(x, w), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,I", [(1, 100), (7, 1500)])
def test_silu_mul(device, dtype, T, I):
    gu = randn(T, 2 * I, dtype=dtype, device=device, seed=T + I, scale=3.0)
    check(matvec.silu_mul_triton(gu), matvec.silu_mul_ref(gu), TOL[dtype])


def test_matvec_unaligned_rows(device):
    # 37 float32 columns: rows 148 bytes apart, no tile divides them
    g = torch.Generator().manual_seed(5)
    x, w = randn(2, 37, device=device, gen=g), randn(45, 37, device=device, gen=g)
    check(matvec.matvec_triton(x, w), matvec.matvec_ref(x, w), TOL[torch.float32])
    check(matvec.matvec_swiglu_triton(x, w[:44]), matvec.matvec_swiglu_ref(x, w[:44]), TOL[torch.float32])


def test_matvec_strided_rows(device):
    x = randn(3, 400, device=device, seed=1)[:, :300]
    w = randn(50, 300, device=device, seed=2)
    check(matvec.matvec_triton(x, w), matvec.matvec_ref(x, w), TOL[torch.float32])


def test_matvec_row_limit(device):
    with pytest.raises(AssertionError, match="rows"):
        matvec.matvec_triton(randn(matvec.MAX_ROWS + 1, 32, device=device), randn(16, 32, device=device))


# the 27B decode matrices: MLP down, MLP gate|up, GDN in_proj, attention q|gate|k|v, o_proj, lm_head
SHAPES_27B = [(5120, 17408), (34816, 5120), (16480, 5120), (14336, 5120), (5120, 6144), (248320, 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_27B)
def test_matvec_27b_shapes(N, K):
    g = torch.Generator().manual_seed(N)
    x, w = randn(5, K, dtype=torch.bfloat16, device="cuda", gen=g), randn(N, K, dtype=torch.bfloat16, device="cuda", gen=g)
    check(matvec.matvec(x, w), matvec.matvec_ref(x, w), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_27B[:3] + [(1000, 1000)])
def test_matvec_rows_do_not_depend_on_T(N, K):
    g = torch.Generator().manual_seed(K)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    x, w = randn(matvec.MAX_ROWS, K, **bf16), randn(N, K, **bf16)
    ones = torch.cat([matvec.matvec(x[i:i + 1], w) for i in range(x.shape[0])])
    for T in (2, 3, 5, matvec.MAX_ROWS):
        assert torch.equal(matvec.matvec(x[:T], w), ones[:T]), f"T={T}"


@pytest.mark.gpu
def test_matvec_swiglu_27b_shapes_and_rows():
    g = torch.Generator().manual_seed(9)
    x = randn(5, 5120, dtype=torch.bfloat16, device="cuda", gen=g)
    w = randn(2 * 17408, 5120, dtype=torch.bfloat16, device="cuda", gen=g, scale=0.02)
    y = matvec.matvec_swiglu(x, w)
    check(y, matvec.matvec_swiglu_ref(x, w), 1e-2)
    assert torch.equal(y, torch.cat([matvec.matvec_swiglu(x[i:i + 1], w) for i in range(5)]))



@pytest.mark.parametrize("dtype", DTYPES)
def test_matvec_into_float32(device, dtype):
    # logits straight into a float32 buffer: the product rounded to the inputs' dtype, then widened
    g = torch.Generator().manual_seed(11)
    x, w = randn(3, 200, dtype=dtype, device=device, gen=g), randn(90, 200, dtype=dtype, device=device, gen=g)
    buf = torch.full((5, 90), float("nan"), device=device)
    y = matvec.matvec_triton(x, w, out=buf[1:4])
    assert y.data_ptr() == buf[1:4].data_ptr() and buf[0].isnan().all() and buf[4].isnan().all()
    assert torch.equal(y, matvec.matvec_triton(x, w).float())
    check(y, matvec.matvec_ref(x, w).float(), TOL[dtype])


@pytest.fixture
def three_parts(monkeypatch):
    """Split products in 3 parts of 32-wide K tiles (the rule would not split these small shapes)."""
    monkeypatch.setattr(matvec, "_split_config", lambda N, K, itemsize: (3, 16, 32, 4, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("N,K", [(70, 300), (33, 200)])
def test_matvec_parts(device, three_parts, dtype, T, N, K):
    g = torch.Generator().manual_seed(T * N + K + 1)
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(N, K, dtype=dtype, device=device, gen=g)
    ranges = matvec.split_ranges(N, K, x.element_size())
    assert ranges[0][0] == 0 and ranges[-1][1] == K and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len(ranges) == 3 and all((k1 - k0) % 32 == 0 for k0, k1 in ranges[:-1])
    parts = matvec.matvec_parts_triton(x, w)
    assert parts.shape == (3, T, N) and parts.dtype == torch.float32
    check(parts, matvec.matvec_parts_ref(x, w), TOL[torch.float32], "parts")
    check(matvec.parts_sum_ref(parts, dtype), matvec.matvec_ref(x, w), TOL[dtype], "their sum")


def test_split_config_27b():
    # the 27B's 5120-row products: 80 column blocks of 64, each K in 3 ranges of whole 128-wide tiles
    for K in (6144, 17408):
        S, BN, BK, _, _ = matvec._split_config(5120, K, 2)
        assert (S, BN, BK) == (3, 64, 128)
        assert [k1 - k0 for k0, k1 in matvec.split_ranges(5120, K, 2)][:-1] == [triton_cdiv(K, 3 * BK) * BK] * 2
    assert matvec._split_config(64, 256, 2)[0] == 1     # too short a K to split


def triton_cdiv(a, b):
    return -(-a // b)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(5120, 17408), (5120, 6144), (1000, 3000)])
def test_matvec_parts_27b_shapes_and_rows(N, K):
    g = torch.Generator().manual_seed(K + 3)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    x, w = randn(5, K, **bf16), randn(N, K, **bf16)
    parts = matvec.matvec_parts(x, w)
    check(parts, matvec.matvec_parts_ref(x, w), 1e-5, "parts")
    check(matvec.parts_sum_ref(parts, torch.bfloat16), matvec.matvec_ref(x, w), 1e-2, "their sum")
    ones = torch.cat([matvec.matvec_parts(x[i:i + 1], w) for i in range(5)], dim=1)
    assert torch.equal(parts, ones)
