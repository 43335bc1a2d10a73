"""RMSNorm kernels (plain, fused with the residual add, gated) against their float32 references."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import fp8_gemm, norm

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 200), (5, 300), (2, 6, 40)])
def test_rmsnorm(device, dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = randn(*shape, dtype=dtype, device=device, gen=g)
    w = randn(shape[-1], dtype=dtype, device=device, gen=g, scale=0.3)
    check(norm.rmsnorm_triton(x, w, EPS), norm.rmsnorm_ref(x, w, EPS), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 5])
def test_add_rmsnorm(device, dtype, T):
    g = torch.Generator().manual_seed(2)
    x, r = randn(T, 300, dtype=dtype, device=device, gen=g), randn(T, 300, dtype=dtype, device=device, gen=g)
    w = randn(300, dtype=dtype, device=device, gen=g, scale=0.3)
    y, h = norm.add_rmsnorm_triton(x, r, w, EPS)
    y_ref, h_ref = norm.add_rmsnorm_ref(x, r, w, EPS)
    check(h, h_ref, TOL[dtype], "residual sum")
    check(y, y_ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,T", [(1, 1), (3, 1), (3, 5), (4, 2)])
def test_add_rmsnorm_parts(device, dtype, S, T):
    # the output of a split product: S float32 parts, added in order and rounded to the stream's dtype
    g = torch.Generator().manual_seed(S * 10 + T)
    parts = randn(S, T, 300, device=device, gen=g)
    r = randn(T, 300, dtype=dtype, device=device, gen=g)
    w = randn(300, dtype=dtype, device=device, gen=g, scale=0.3)
    y, h = norm.add_rmsnorm_triton(parts, r, w, EPS)
    y_ref, h_ref = norm.add_rmsnorm_ref(parts, r, w, EPS)
    assert y.dtype == h.dtype == dtype and y.shape == h.shape == (T, 300)
    check(h, h_ref, TOL[dtype], "residual sum")
    check(y, y_ref, TOL[dtype])
    if dtype == torch.float32:
        assert torch.equal(h, h_ref), "the parts are added in order, as the reference adds them"


@pytest.mark.parametrize("T,D,warps", [(5, 300, None), (21, 256, None), (7, 700, 2)])
def test_add_rmsnorm_quantized(device, T, D, warps):
    """The residual add and norm straight into FP8 rows for the product after it (prefill's fused
    form): quantize_rows over the normalised rows of the same warps, bit for bit, padded for
    cuBLAS; the sum as ever."""
    g = torch.Generator().manual_seed(T * D)
    bf16 = dict(dtype=torch.bfloat16, device=device, gen=g)
    x, r, w = randn(T, D, **bf16) * 4, randn(T, D, **bf16), randn(D, scale=0.3, **bf16)
    got, h = norm.add_rmsnorm_triton(x, r, w, EPS, quantize=True, warps=warps)
    y, h_want = norm.add_rmsnorm_triton(x, r, w, EPS, warps=warps)
    check(y, norm.add_rmsnorm_ref(x, r, w, EPS)[0], TOL[torch.bfloat16])
    xq, xs = fp8_gemm.quantize_rows_triton(y, fp8_gemm.CUBLAS_ROWS)
    assert torch.equal(h, h_want) and got.rows == T and got.q.shape == xq.shape
    assert torch.equal(got.q.view(torch.uint8), xq.view(torch.uint8)), "codes"
    assert torch.equal(got.scale, xs) and got.scale.stride() == xs.stride(), "scales"


def test_add_rmsnorm_parts_shape_mismatch(device):
    with pytest.raises(AssertionError, match="parts"):
        norm.add_rmsnorm_triton(randn(2, 3, 40, device=device), randn(2, 40, device=device), randn(40, device=device), EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_strided_heads(device, dtype):
    # the query half of a [T, H, query | gate] projection: rows 2D apart, each D contiguous
    qg = randn(3, 4, 2 * 48, dtype=dtype, device=device, seed=3)
    q = qg[..., :48]
    w = randn(48, dtype=dtype, device=device, seed=4, scale=0.3)
    check(norm.rmsnorm_triton(q, w, EPS), norm.rmsnorm_ref(q, w, EPS), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
def test_gated_rmsnorm(device, dtype, T):
    g = torch.Generator().manual_seed(5)
    H, D = 3, 40
    x = randn(T, H, D, dtype=dtype, device=device, gen=g)
    z = randn(T, H * D + 7, dtype=dtype, device=device, gen=g)[:, :H * D].view(T, H, D)   # a strided view
    w = 1 + randn(D, dtype=dtype, device=device, gen=g, scale=0.2)
    check(norm.gated_rmsnorm_triton(x, z, w, EPS), norm.gated_rmsnorm_ref(x, z, w, EPS), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 16])
def test_gated_rmsnorm_rows_a_program(device, dtype, rows):
    # a prefill's tiles of several rows (the last one partial), and a row's value independent of
    # how many rows the call holds
    g = torch.Generator().manual_seed(7 + rows)
    T, H, D = 7, 5, 48
    x = randn(T, H, D, dtype=dtype, device=device, gen=g)
    z = randn(T, H * D + 3, dtype=dtype, device=device, gen=g)[:, :H * D].view(T, H, D)
    w = 1 + randn(D, dtype=dtype, device=device, gen=g, scale=0.2)
    y = norm.gated_rmsnorm_triton(x, z, w, EPS, rows=rows)
    check(y, norm.gated_rmsnorm_ref(x, z, w, EPS), TOL[dtype])
    assert torch.equal(norm.gated_rmsnorm_triton(x[2:5], z[2:5], w, EPS, rows=rows), y[2:5])


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("T", [3, 21])
def test_gated_rmsnorm_quantized(device, rows, T):
    """The GDN output norm straight into FP8 rows for out_proj (prefill's fused form, a head of 128
    one group): quantize_rows over the norm's output, bit for bit, padded for cuBLAS."""
    g = torch.Generator().manual_seed(T + rows)
    H, D = 3, 128
    x = randn(T, H, D, dtype=torch.bfloat16, device=device, gen=g) * 3
    z = randn(T, H * D + 5, dtype=torch.bfloat16, device=device, gen=g)[:, :H * D].view(T, H, D)
    w = 1 + randn(D, dtype=torch.bfloat16, device=device, gen=g, scale=0.2)
    got = norm.gated_rmsnorm_triton(x, z, w, EPS, rows=rows, quantize=True)
    y = norm.gated_rmsnorm_triton(x, z, w, EPS, rows=rows).reshape(T, H * D)
    xq, xs = fp8_gemm.quantize_rows_triton(y, fp8_gemm.CUBLAS_ROWS)
    assert got.rows == T and got.dtype == torch.bfloat16 and got.q.shape == xq.shape
    assert torch.equal(got.q.view(torch.uint8), xq.view(torch.uint8)), "codes"
    assert torch.equal(got.scale, xs) and got.scale.stride() == xs.stride(), "scales"
    with pytest.raises(AssertionError, match="a head a group"):
        norm.gated_rmsnorm_triton(x[..., :64], z[..., :64], w[:64].contiguous(), EPS, quantize=True)


def test_dispatch_cpu_takes_the_reference():
    x, w = randn(2, 30), randn(30, seed=1)
    assert torch.equal(norm.rmsnorm(x, w, EPS), norm.rmsnorm_ref(x, w, EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5])
def test_norms_27b_shapes(T):
    g = torch.Generator().manual_seed(6)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    x, r, w = randn(T, 5120, **bf16), randn(T, 5120, **bf16), randn(5120, scale=0.3, **bf16)
    y, h = norm.add_rmsnorm(x, r, w, EPS)
    y_ref, h_ref = norm.add_rmsnorm_ref(x, r, w, EPS)
    assert torch.equal(h, h_ref)
    check(y, y_ref, 1e-2)
    parts = randn(3, T, 5120, dtype=torch.float32, device="cuda", gen=g)
    y, h = norm.add_rmsnorm(parts, r, w, EPS)
    y_ref, h_ref = norm.add_rmsnorm_ref(parts, r, w, EPS)
    assert torch.equal(h, h_ref)
    check(y, y_ref, 1e-2)
    o, z, wn = randn(T, 48, 128, **bf16), randn(T, 48, 128, **bf16), 1 + randn(128, scale=0.2, **bf16)
    check(norm.gated_rmsnorm(o, z, wn, EPS), norm.gated_rmsnorm_ref(o, z, wn, EPS), 1e-2)
    check(norm.gated_rmsnorm(o, z, wn, EPS, rows=16), norm.gated_rmsnorm_ref(o, z, wn, EPS), 1e-2)


def test_add_rmsnorm_into_out(device):
    # the normalised rows written into a given buffer (the decoder's verify hiddens), h as before
    g = torch.Generator().manual_seed(12)
    x, r = randn(3, 300, device=device, gen=g), randn(3, 300, device=device, gen=g)
    w = randn(300, device=device, gen=g, scale=0.3)
    buf = torch.full((5, 300), float("nan"), device=device)
    y, h = norm.add_rmsnorm_triton(x, r, w, EPS, out=buf[1:4])
    assert y.data_ptr() == buf[1:4].data_ptr() and buf[0].isnan().all() and buf[4].isnan().all()
    y_ref, h_ref = norm.add_rmsnorm_ref(x, r, w, EPS)
    check(y, y_ref, TOL[torch.float32])
    check(h, h_ref, TOL[torch.float32], "residual sum")
    parts = randn(2, 3, 300, device=device, gen=g)
    y2, _ = norm.add_rmsnorm(parts, r, w, EPS, out=buf[1:4])
    assert y2.data_ptr() == buf[1:4].data_ptr()
    check(y2, norm.add_rmsnorm_ref(parts, r, w, EPS)[0], TOL[torch.float32], "from parts")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 300), (5, 300), (3, 1000)])
def test_head_input(device, dtype, T, H):
    """The MTP head's input in one kernel: each row's embedding and hidden, each normalised with its
    own weight, side by side, against the reference; the rows' own (repeated and out-of-order) ids;
    the hidden rows strided; each half the bits of the norm kernel alone."""
    g = torch.Generator().manual_seed(T * H)
    embed = randn(37, H, dtype=dtype, device=device, gen=g) * 3
    hidden = randn(T, H + 7, dtype=dtype, device=device, gen=g)[:, 3:3 + H]          # a strided view
    w_e, w_h = (randn(H, dtype=dtype, device=device, gen=g, scale=0.3) for _ in range(2))
    ids = torch.tensor([36, 0, 17, 17, 5][:T], device=device)
    got = norm.head_input_triton(ids, embed, hidden, w_e, w_h, EPS)
    ref = norm.head_input_ref(ids, embed, hidden, w_e, w_h, EPS)
    assert got.shape == (T, 2 * H) and got.dtype == dtype
    check(got[:, :H], ref[:, :H], TOL[dtype], "embedding half")
    check(got[:, H:], ref[:, H:], TOL[dtype], "hidden half")
    assert torch.equal(got[:, :H], norm.rmsnorm_triton(embed[ids], w_e, EPS))
    assert torch.equal(got[:, H:], norm.rmsnorm_triton(hidden.contiguous(), w_h, EPS))
    i32 = norm.head_input_triton(ids.to(torch.int32), embed, hidden, w_e, w_h, EPS)
    assert torch.equal(i32, got), "int32 ids read as int64 ones"


def test_head_input_checks_its_shapes(device):
    embed, hidden, w = torch.ones(9, 64, device=device), torch.ones(2, 64, device=device), torch.ones(64, device=device)
    with pytest.raises(AssertionError, match=r"ids must be \[2\]"):
        norm.head_input_triton(torch.zeros(3, dtype=torch.long, device=device), embed, hidden, w, w, EPS)
    with pytest.raises(AssertionError, match="share a dtype"):
        norm.head_input_triton(torch.zeros(2, dtype=torch.long, device=device), embed.bfloat16(), hidden, w, w, EPS)
    with pytest.raises(AssertionError, match="contiguous"):
        norm.head_input_triton(torch.zeros(4, dtype=torch.long, device=device)[::2], embed, hidden, w, w, EPS)
    cpu = norm.head_input(torch.zeros(2, dtype=torch.long), embed.cpu(), hidden.cpu(), w.cpu(), w.cpu(), EPS)
    assert cpu.shape == (2, 128)
