"""The FP8 prefill product (kernels/fp8_gemm.py): the rows' quantization bit for bit against its
reference, the fp8 GEMM against gemm_ref on the same quantized rows, the whole product against the
exact one within fp8's precision; the 27B's prefill shapes on the GPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_checks import INTERPRETED, TOL, check, randn

from mtpchat.kernels import fp8_gemm
from mtpchat.kernels.fp8 import FP8, BlockFP8, dequantize_ref, quantize_ref
from mtpchat.kernels.matvec import silu_mul_ref, silu_mul_triton
from mtpchat.kernels.plan import ProductPlan

# the exact product against the one with fp8 activations: e4m3 keeps 3 bits of mantissa
FP8_TOL = 5e-2
# the kernel against gemm_ref in float32: the order of the sums alone in the interpreter (numpy's
# float32 matmul); on Hopper each 128-long fp8 dot also accumulates in the tensor cores' reduced
# precision before the float32 sum takes it
GEMM_TOL = TOL[torch.float32] if INTERPRETED else 1e-3


def rows(M, K, dtype, device, gen):
    """x [M, K] whose rows and columns span orders of magnitude (so a 128-column group holds values
    down to fp8's subnormals), the last row's first group all zeros unless that is all of x."""
    x = randn(M, K, gen=gen) * torch.exp(randn(M, 1, gen=gen)) * torch.exp(2 * randn(1, K, gen=gen))
    if M > 1 or K > 128:
        x[-1, :128] = 0
    return x.to(device=device, dtype=dtype)


def weight(N, K, device, gen):
    """A BlockFP8 [N, K] whose 128 x 128 blocks have scales over orders of magnitude, so a block's
    scale taken for another's shows."""
    w = randn(N, K, gen=gen, scale=0.02) * torch.exp(randn(N, 1, gen=gen)) * torch.exp(randn(1, K, gen=gen))
    return quantize_ref(w.to(device))


def quantized_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref computed on the CPU: torch on a GPU divides by a scalar through its
    reciprocal (a last-bit difference from IEEE division, which the kernel does), the CPU exactly."""
    xq, xs = fp8_gemm.quantize_rows_ref(x.cpu())
    return xq.to(x.device), xs.to(x.device)


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == FP8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 5, 63, 130])
@pytest.mark.parametrize("K", [128, 200, 300, 384])
def test_quantize_rows(device, dtype, M, K):
    g = torch.Generator().manual_seed(1000 * M + K)
    x = rows(M, K, dtype, device, g)
    xq, xs = fp8_gemm.quantize_rows_triton(x)
    rq, rs = quantized_ref(x)
    assert xs.shape == rs.shape == (M, -(-K // 128))
    assert same_fp8(xq, rq), f"{int((xq.view(torch.uint8) != rq.view(torch.uint8)).sum())} codes differ"
    assert torch.equal(xs, rs)
    if M > 1 or K > 128:
        assert xs[-1, 0] == 1 and (rq[-1, :128].float() == 0).all(), "a group of zeros: scale 1, codes 0"
    check(rq.float() * rs.repeat_interleave(128, dim=1)[:, :K], x.float(), FP8_TOL, "xq * xs")


@pytest.mark.parametrize("M,pad", [(37, 16), (32, 16), (5, 4)])
def test_quantize_rows_padded(device, M, pad):
    """Rows padded for cuBLAS (fp8_gemm.CUBLAS_ROWS): the first M as unpadded, the rest zero codes
    with scale 1, the scales still M-major over the padded rows."""
    x = rows(M, 300, torch.float32, device, torch.Generator().manual_seed(M))
    xq, xs = fp8_gemm.quantize_rows_triton(x, pad)
    MP = -(-M // pad) * pad
    assert xq.shape == (MP, 300) and xs.shape == (MP, 3) and xs.stride() == (1, MP)
    rq, rs = quantized_ref(x)
    assert same_fp8(xq[:M].contiguous(), rq) and torch.equal(xs[:M], rs)
    assert (xq[M:].view(torch.uint8) == 0).all() and (xs[M:] == 1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(5, 200), (37, 384)])
def test_quantized_swiglu_is_silu_mul_then_quantize_rows(device, dtype, M, K):
    """The MLP's gating straight into FP8 rows (prefill's fused form): the codes and scales of
    quantize_rows over silu_mul's rows, bit for bit, padded for cuBLAS."""
    g = torch.Generator().manual_seed(M + K)
    gate_up = torch.cat([rows(M, K, dtype, device, g), rows(M, K, dtype, device, g)], dim=1)
    got = fp8_gemm.quantized_swiglu(gate_up)
    h = silu_mul_triton(gate_up)
    xq, xs = fp8_gemm.quantize_rows_triton(h, fp8_gemm.CUBLAS_ROWS)
    assert got.rows == M and got.dtype == dtype and got.shape == (M, K) and xq.shape[0] % fp8_gemm.CUBLAS_ROWS == 0
    assert same_fp8(got.q, xq) and torch.equal(got.scale, xs) and got.scale.stride() == xs.stride()
    # and within fp8's precision of the reference's gating (silu_mul's kernel and reference may part
    # by a last bit of the model dtype, which can move a code)
    check(got.q[:M].float() * got.scale[:M].repeat_interleave(128, dim=1)[:, :K], silu_mul_ref(gate_up).float(),
          FP8_TOL, "xq * xs")


@pytest.mark.parametrize("M,N,K", [(5, 300, 200), (37, 129, 384)])
def test_gemm_takes_quantized_rows(device, M, N, K):
    # rows handed over quantized give the product of the same rows quantized by gemm itself
    g = torch.Generator().manual_seed(M * K)
    x, q = rows(M, K, torch.bfloat16, device, g), weight(N, K, device, g)
    xq, xs = fp8_gemm.quantize_rows_triton(x, fp8_gemm.CUBLAS_ROWS)
    plan = ProductPlan(programs=132, fp8_cublas_rows=1 << 20)            # the Triton kernel's path
    got = fp8_gemm.gemm(fp8_gemm.QuantizedRows(xq, xs, M, x.dtype), q, plan)
    assert got.shape == (M, N) and got.dtype == x.dtype
    tiles = fp8_gemm.gemm_tiles(M, fp8_gemm.SMALL, plan.fp8_small_rows)
    assert torch.equal(got, fp8_gemm.gemm_quantized_triton(*fp8_gemm.quantize_rows_triton(x), q, x.dtype, tiles))
    if x.is_cuda:        # (on the CPU gemm of a tensor is the exact product)
        assert torch.equal(got, fp8_gemm.gemm(x, q, plan))


@pytest.mark.filterwarnings("ignore:overflow encountered in divide")   # 1 / xs overflows: the point
def test_quantize_rows_tiny_groups(device):
    # groups whose scale's reciprocal would pass float32's largest (amax under 1.3e-36): the
    # reciprocal stops there, so codes stay finite, zeros zero and signs kept, as the reference's
    g = torch.Generator().manual_seed(9)
    x = rows(3, 256, torch.float32, device, g)
    x[0, :128] *= 1e-38
    x[1, 128:] = 0.
    x[1, 130], x[1, 200] = 1e-37, -3e-38
    xq, xs = fp8_gemm.quantize_rows_triton(x)
    rq, rs = quantized_ref(x)
    assert same_fp8(xq, rq) and torch.equal(xs, rs)
    codes = rq.float()
    assert codes.isfinite().all() and (codes[1, 128:].ne(0) == x[1, 128:].ne(0)).all()
    assert ((codes.sign() == x.sign()) | (codes == 0)).all()


def test_quantize_rows_ties(device):
    # a group whose amax is 448 (scale 1) holding every midpoint between two fp8 values, of either
    # sign: each rounds to the even code, the normals' and the subnormals' alike
    codes = torch.arange(0x7F, dtype=torch.uint8).view(FP8).float()              # 0 .. 448
    mids = (codes[1:] + codes[:-1]) / 2                                          # 126 of them
    row = torch.cat([torch.tensor([448.]), mids, torch.tensor([2.0 ** -11])])     # 2^-11: to 0
    x = torch.stack([row, -row]).to(device)
    xq, xs = fp8_gemm.quantize_rows_triton(x)
    rq, rs = quantized_ref(x)
    assert torch.equal(rs, torch.ones_like(rs)) and torch.equal(xs, rs)
    assert same_fp8(xq, rq)
    assert (rq.view(torch.uint8)[0, 1:127] & 1 == 0).all(), "ties round to even codes"


# (M, N, K): a row, odd rows and columns, N and K off multiples of 128, more than one tile each way
GEMM_SHAPES = [(1, 64, 128), (5, 300, 200), (63, 129, 384), (130, 200, 300), (17, 256, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", GEMM_SHAPES)
def test_gemm_kernel(device, dtype, M, N, K):
    # the product of rows quantized by the reference (contiguous scales [M, KB]) in float32
    g = torch.Generator().manual_seed(M * N + K)
    x, q = rows(M, K, dtype, device, g), weight(N, K, device, g)
    xq, xs = fp8_gemm.quantize_rows_ref(x)
    y = fp8_gemm.gemm_quantized_triton(xq, xs, q, torch.float32)
    check(y, fp8_gemm.gemm_ref(xq, xs, q, torch.float32), GEMM_TOL)


# the few-row tiles: the plan's SMALL, 32 weight rows a program
FEW_ROW_TILES = [fp8_gemm.SMALL, fp8_gemm.GemmTiles(16, 32, 2, 3)]


@pytest.mark.parametrize("tiles", FEW_ROW_TILES, ids=["small", "32-columns"])
@pytest.mark.parametrize("M,N,K", [(1, 64, 128), (5, 300, 200), (17, 200, 384), (40, 129, 300)])
def test_gemm_kernel_few_row_tiles(device, tiles, M, N, K):
    # a tile of 16-64 rows, one scale block's columns or fewer: outputs against gemm_ref, a weight
    # scale row shared by the tiles of one 128-row block
    g = torch.Generator().manual_seed(M * 7 + N + K)
    x, q = rows(M, K, torch.float32, device, g), weight(N, K, device, g)
    xq, xs = fp8_gemm.quantize_rows_ref(x)
    t = fp8_gemm.gemm_tiles(M, tiles, 64)
    assert t.BM == (16 if M <= 16 else tiles.BM)
    y = fp8_gemm.gemm_quantized_triton(xq, xs, q, torch.float32, t)
    check(y, fp8_gemm.gemm_ref(xq, xs, q, torch.float32), GEMM_TOL)


def test_gemm_tiles_rule():
    assert fp8_gemm.gemm_tiles(5) == fp8_gemm.WIDE                            # no small tile given
    assert fp8_gemm.gemm_tiles(300, fp8_gemm.SMALL, 256) == fp8_gemm.WIDE     # more rows than it takes
    assert fp8_gemm.gemm_tiles(256, fp8_gemm.SMALL, 256) == fp8_gemm.SMALL
    assert fp8_gemm.gemm_tiles(20, fp8_gemm.SMALL, 256).BM == 64
    assert fp8_gemm.gemm_tiles(16, fp8_gemm.SMALL, 256).BM == fp8_gemm.gemm_tiles(1, fp8_gemm.SMALL, 256).BM == 16
    with pytest.raises(AssertionError, match="divide the scale block"):
        g = torch.Generator().manual_seed(1)
        x, q = rows(3, 128, torch.float32, "cpu", g), weight(64, 128, "cpu", g)
        fp8_gemm.gemm_quantized_triton(*fp8_gemm.quantize_rows_ref(x), q, torch.float32,
                                       fp8_gemm.GemmTiles(16, 96, 4, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", GEMM_SHAPES[1:4])
def test_gemm_triton(device, dtype, M, N, K):
    # the whole path, rows quantized by the kernel (scales [M, KB] with strides (1, M)), in x's
    # dtype; and within fp8's precision of the exact product, which the CPU path returns
    g = torch.Generator().manual_seed(M + N * K)
    x, q = rows(M, K, dtype, device, g), weight(N, K, device, g)
    y = fp8_gemm.gemm_triton(x, q)
    assert y.dtype == dtype and y.shape == (M, N)
    check(y, fp8_gemm.gemm_ref(*quantized_ref(x), q, dtype), max(TOL[dtype], GEMM_TOL))
    check(y, (x.float() @ dequantize_ref(q).T).to(dtype), FP8_TOL, "against the exact product")


def test_gemm_on_the_cpu_is_the_exact_product():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x, q = rows(7, 300, dtype, "cpu", g), weight(90, 300, "cpu", g)
        assert torch.equal(fp8_gemm.gemm(x, q), (x.float() @ dequantize_ref(q).T).to(dtype))
        assert all(torch.equal(a, b) if a.dtype != FP8 else same_fp8(a, b)
                   for a, b in zip(fp8_gemm.quantize_rows(x), fp8_gemm.quantize_rows_ref(x)))


def test_gemm_layout_contract(device):
    g = torch.Generator().manual_seed(4)
    x, q = rows(4, 256, torch.float32, device, g), weight(130, 256, device, g)
    xq, xs = fp8_gemm.quantize_rows_ref(x)
    with pytest.raises(AssertionError, match="xs must be"):
        fp8_gemm.gemm_quantized_triton(xq, xs[:, :1], q, torch.float32)
    with pytest.raises(AssertionError, match="scale"):
        fp8_gemm.gemm_quantized_triton(xq, xs, BlockFP8(q.w, q.scale[:1]), torch.float32)
    with pytest.raises(AssertionError, match="disagree"):
        fp8_gemm.gemm_triton(x[:, :200], q)


# the 27B's prefill products: GDN in_proj q|k|v|z, MLP gate|up, MLP down, GDN out_proj and
# attention o_proj, attention q|gate (2 x 24 heads x 256) with k|v (2 x 4 x 256)
SHAPES_27B = [(16384, 5120), (34816, 5120), (5120, 17408), (5120, 6144), (12288 + 2048, 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(2048, 16384, 5120), (300, 640, 384), (5, 300, 200)])
def test_cublas_and_triton_agree(M, N, K):
    # cuBLAS's block-scaled product where it takes the shapes, else the Triton kernel: both within
    # fp8 accumulation of gemm_ref
    g = torch.Generator().manual_seed(M + N)
    x, q = rows(M, K, torch.bfloat16, "cuda", g), weight(N, K, "cuda", g)
    xq, xs = quantized_ref(x)
    want = fp8_gemm.gemm_ref(xq, xs, q, torch.float32)
    check(fp8_gemm.gemm_quantized_triton(xq, xs, q, torch.float32), want, GEMM_TOL)
    check(fp8_gemm.gemm(x, q), want.to(torch.bfloat16), 4e-3)
    if M == 2048:
        m_major = xs.T.contiguous().T          # cuBLAS takes the rows' scales M-major, as quantize_rows lays them
        check(fp8_gemm.gemm_cublas(xq, m_major, q, torch.bfloat16), want.to(torch.bfloat16), 4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16, 40, 64, 200])
@pytest.mark.parametrize("N,K", [(5120, 6144), (640, 384)])
def test_gemm_few_rows_under_the_plan(M, N, K):
    # a short prefill chunk's product under the plan's defaults (cuBLAS for any rows, padded to 16,
    # where its trial agreed; 640 x 384 it once computed wrong) and with cuBLAS off (the Triton
    # kernel on the small tile): both within fp8 accumulation of gemm_ref
    g = torch.Generator().manual_seed(M + N)
    x, q = rows(M, K, torch.bfloat16, "cuda", g), weight(N, K, "cuda", g)
    want = fp8_gemm.gemm_ref(*quantized_ref(x), q, torch.float32).to(torch.bfloat16)
    plan = ProductPlan(programs=132)
    assert plan.fp8_cublas_rows <= 1 and plan.fp8_small_rows >= 200
    triton_only = dataclasses.replace(plan, fp8_cublas_rows=1 << 20)
    for p in (plan, triton_only, dataclasses.replace(triton_only, fp8_small_rows=0)):   # cuBLAS, SMALL, WIDE
        y = fp8_gemm.gemm(x, q, p)
        assert y.shape == (M, N) and y.dtype == torch.bfloat16
        check(y, want, 4e-3)
    if N == 5120:        # a 27B shape: cuBLAS was tried at these rows and took them
        key = ("block", q.w.device, N, K, torch.bfloat16, max(16, 1 << (M - 1).bit_length()))
        assert fp8_gemm._cublas_trusted.get(key) is True


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_27B)
def test_gemm_27b_prefill(N, K):
    g = torch.Generator().manual_seed(N + K)
    x, q = rows(2048, K, torch.bfloat16, "cuda", g), weight(N, K, "cuda", g)
    xq, xs = quantized_ref(x)
    got_q, got_s = fp8_gemm.quantize_rows(x)
    assert same_fp8(got_q, xq) and torch.equal(got_s, xs)
    y = fp8_gemm.gemm(x, q)
    # both rounded to bf16 at the end: a last-bit difference is 2^-9 of a value
    check(y, fp8_gemm.gemm_ref(xq, xs, q, torch.bfloat16), 4e-3)
    check(y, x @ dequantize_ref(q, torch.bfloat16).T, FP8_TOL, "against the bf16 product")
