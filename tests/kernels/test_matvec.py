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
    # 37 float32 columns: rows 148 bytes apart, too unaligned for the weight prefetch, which is skipped
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


# --- products with their input's norm, and the GDN conv after the input projection

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_matvec(device, dtype, T, with_residual):
    g = torch.Generator().manual_seed(T + 10 * with_residual)
    N, K = 90, 300
    x, w = randn(T, K, dtype=dtype, device=device, gen=g, scale=3.0), randn(N, K, dtype=dtype, device=device, gen=g)
    res = randn(T, K, dtype=dtype, device=device, gen=g) if with_residual else None
    nw = randn(K, dtype=dtype, device=device, gen=g, scale=0.3)
    y, h = matvec.norm_matvec_triton(x, res, nw, 1e-6, w)
    want_y, want_h = matvec.norm_matvec_ref(x, res, nw, 1e-6, w)
    check(y, want_y, TOL[dtype])
    check(h, want_h, TOL[dtype], "residual stream")
    if with_residual:
        assert not torch.equal(want_h, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,off", [(1, 0), (1, 2), (4, 3), (5, 1)])
def test_norm_matvec_with_the_conv(device, dtype, T, off):
    # 128 conv channels (two blocks of 64 outputs) then 40 plain ones; the window advances in place
    g = torch.Generator().manual_seed(T * 7 + off)
    C, N, K, KC, W = 128, 168, 96, 4, 3 + 5
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(N, K, dtype=dtype, device=device, gen=g, scale=0.2)
    res, nw = randn(T, K, dtype=dtype, device=device, gen=g), randn(K, dtype=dtype, device=device, gen=g, scale=0.3)
    buf, cw = randn(C, W, dtype=dtype, device=device, gen=g), randn(C, KC, dtype=dtype, device=device, gen=g)
    off_t = torch.tensor([off], device=device)
    buf_ref, buf_got = buf.clone(), buf.clone()
    want_y, want_h = matvec.norm_matvec_ref(x, res, nw, 1e-6, w, conv=(buf_ref, off_t, cw))
    y, h = matvec.norm_matvec_triton(x, res, nw, 1e-6, w, conv=(buf_got, off_t, cw))
    check(y[:, :C], want_y[:, :C], TOL[dtype], "conv channels")
    check(y[:, C:], want_y[:, C:], TOL[dtype], "plain channels")
    check(h, want_h, TOL[dtype], "residual stream")
    check(buf_got[:, :KC - 1 + T], buf_ref[:, :KC - 1 + T], TOL[dtype], "conv window")
    assert not torch.equal(buf_ref, buf), "the reference must have moved the window"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4])
def test_gated_matvec(device, dtype, T):
    # heads of 32 columns, z a strided view into a wider projection as in the GDN
    g = torch.Generator().manual_seed(T + 3)
    N, D, heads = 70, 32, 5
    o = randn(T, heads * D, dtype=dtype, device=device, gen=g)
    z = randn(T, heads * D + 50, dtype=dtype, device=device, gen=g)[:, 20:20 + heads * D]
    nw, w = randn(D, dtype=dtype, device=device, gen=g), randn(N, heads * D, dtype=dtype, device=device, gen=g)
    check(matvec.gated_matvec_triton(o, z, nw, 1e-6, w), matvec.gated_matvec_ref(o, z, nw, 1e-6, w), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,with_residual", [(1, True), (3, False), (5, True)])
def test_norm_matvec_swiglu(device, dtype, T, with_residual):
    g = torch.Generator().manual_seed(T + 20)
    N, K = 70, 200
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(2 * N, K, dtype=dtype, device=device, gen=g, scale=0.2)
    res = randn(T, K, dtype=dtype, device=device, gen=g) if with_residual else None
    nw = randn(K, dtype=dtype, device=device, gen=g, scale=0.3)
    y, h = matvec.norm_matvec_swiglu_triton(x, res, nw, 1e-6, w)
    want_y, want_h = matvec.norm_matvec_swiglu_ref(x, res, nw, 1e-6, w)
    check(y, want_y, TOL[dtype])
    check(h, want_h, TOL[dtype], "residual stream")


@pytest.mark.gpu
def test_fused_products_27b_shapes_rows_do_not_depend_on_T():
    # the GDN in_proj with its norm and conv, the out_proj with the gated norm, the MLP with its norm:
    # the T-row call equals 1-row calls made one after another (the conv window advancing by one)
    g = torch.Generator().manual_seed(11)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    T, H, C, N = 5, 5120, 10240, 16480
    x, res, nw = randn(T, H, **bf16), randn(T, H, **bf16), randn(H, scale=0.3, **bf16)
    w_in, cw, buf = randn(N, H, scale=0.02, **bf16), randn(C, 4, **bf16), randn(C, 8, **bf16)
    b1, b2 = buf.clone(), buf.clone()
    y, h = matvec.norm_matvec(x, res, nw, 1e-6, w_in, conv=(b1, torch.tensor([2], device="cuda"), cw))
    want_y, _ = matvec.norm_matvec_ref(x, res, nw, 1e-6, w_in, conv=(buf.clone(), torch.tensor([2], device="cuda"), cw))
    check(y, want_y, 1e-2)
    rows = []
    for i in range(T):
        rows.append(matvec.norm_matvec(x[i:i + 1], res[i:i + 1], nw, 1e-6, w_in,
                                       conv=(b2, torch.tensor([2 if i == 0 else 1], device="cuda"), cw))[0])
    assert torch.equal(y, torch.cat(rows))
    o, z = randn(T, 6144, **bf16), randn(T, N, **bf16)[:, C:C + 6144]
    gw, w_out = randn(128, **bf16), randn(H, 6144, scale=0.02, **bf16)
    out = matvec.gated_matvec(o, z, gw, 1e-6, w_out)
    check(out, matvec.gated_matvec_ref(o, z, gw, 1e-6, w_out), 1e-2)
    assert torch.equal(out, torch.cat([matvec.gated_matvec(o[i:i + 1], z[i:i + 1], gw, 1e-6, w_out) for i in range(T)]))
    w_mlp = randn(2 * 17408, H, scale=0.02, **bf16)
    m, _ = matvec.norm_matvec_swiglu(x, res, nw, 1e-6, w_mlp)
    check(m, matvec.norm_matvec_swiglu_ref(x, res, nw, 1e-6, w_mlp)[0], 1e-2)
    assert torch.equal(m, torch.cat([matvec.norm_matvec_swiglu(x[i:i + 1], res[i:i + 1], nw, 1e-6, w_mlp)[0]
                                     for i in range(T)]))
