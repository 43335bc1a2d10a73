"""Few-row products over block-scaled FP8 weights (kernels/fp8.py) against their float32 references:
the plain, SwiGLU and split products (a split finishing the norm too), the scales applied in
registers; the quantization itself; rows bit for bit the 1-row calls, and the 27B's shapes (GPU)."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, normed, randn, split_plan

from mtpchat.kernels import fp8, matvec, matvec_parts
from mtpchat.kernels.plan import ProductPlan, default_products

# numpy's matmul treats Triton's bf16 as integers in the interpreter: bf16 activations on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def weights(N: int, K: int, device, seed: int) -> fp8.BlockFP8:
    """Random FP8 weights whose blocks have scales of very different sizes (and one block of zeros)."""
    g = torch.Generator().manual_seed(seed)
    w = randn(N, K, gen=g) * torch.logspace(-2, 1, fp8.scale_shape(N, K)[0]).repeat_interleave(fp8.BLOCK)[:N, None]
    w[:min(N, fp8.BLOCK), :min(K, fp8.BLOCK)] = 0.
    q = fp8.quantize_ref(w)
    return fp8.BlockFP8(q.w.to(device), q.scale.to(device))


@pytest.mark.parametrize("N,K", [(300, 257), (128, 128), (200, 640)])
def test_quantize_roundtrip(N, K):
    w = randn(N, K, seed=N + K)
    q = fp8.quantize_ref(w)
    assert q.w.dtype == fp8.FP8 and q.scale.shape == fp8.scale_shape(N, K)
    back = fp8.dequantize_ref(q)
    assert ((back - w).norm() / w.norm()).item() < 0.04           # e4m3: 3 mantissa bits
    again = fp8.quantize_ref(back)                                  # quantizing what it dequantizes: the same
    assert torch.equal(again.w.view(torch.uint8), q.w.view(torch.uint8)) and torch.equal(again.scale, q.scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 5])
@pytest.mark.parametrize("N,K", [(300, 257), (128, 512), (448, 640)])
def test_fp8_matvec(device, dtype, T, N, K):
    # 448 rows: 7 column blocks on 6 programs (the interpreter's "SMs"), the last split over K in 2
    w = weights(N, K, device, seed=T + N)
    x = randn(T, K, dtype=dtype, device=device, seed=K)
    if N == 448 and x.device.type == "cpu":
        assert matvec.tail_split(7, 5, default_products(x.device)) == (2, 3)
    check(matvec.matvec_triton(x, w), matvec.matvec_ref(x, w), TOL[dtype])


def test_fp8_matvec_on_the_long_rows_tile(device):
    # rows of 4096 or more take 32-row tiles (matvec.tiles): 300 rows, a partial last scale block
    # of rows, a plain and a Normed input, one row
    assert matvec.tiles(300, 4096, 2, fp8=True)[0] == 32 and matvec.tiles(300, 2048, 2, fp8=True)[0] == 64
    w = weights(300, 4096, device, seed=41)
    x = randn(1, 4096, dtype=torch.float32, device=device, seed=42)
    check(matvec.matvec_triton(x, w), matvec.matvec_ref(x, w), TOL[torch.float32])
    n = normed(1, 4096, torch.float32, device, torch.Generator().manual_seed(43))
    check(matvec.matvec_triton(n, w), matvec.matvec_ref(n, w), TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("N,K", [(128, 300), (256, 640)])
def test_fp8_matvec_swiglu(device, dtype, T, N, K):
    w = weights(2 * N, K, device, seed=N)
    x = randn(T, K, dtype=dtype, device=device, seed=T)
    check(matvec.matvec_swiglu_triton(x, w), matvec.matvec_swiglu_ref(x, w), TOL[dtype])


def test_fp8_matvec_takes_a_normed_input(device):
    g = torch.Generator().manual_seed(3)
    n = normed(3, 300, torch.float32, device, g)
    w = weights(200, 300, device, seed=4)
    check(matvec.matvec_triton(n, w), matvec.matvec_ref(n, w), TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(70, 300), (130, 257)])
def test_fp8_matvec_parts(device, dtype, N, K):
    plan = split_plan(3)
    w = weights(N, K, device, seed=N)
    x = randn(4, K, dtype=dtype, device=device, seed=K)
    parts = matvec_parts.matvec_parts_triton(x, w, plan=plan)
    check(parts, matvec_parts.matvec_parts_ref(x, w, plan), TOL[torch.float32], "parts")
    # and with the norm finished block by block: the residual stream and the next product's input
    r, nw = randn(4, N, dtype=dtype, device=device, seed=1), randn(N, dtype=dtype, device=device, seed=2, scale=0.1)
    (xn, h) = matvec_parts.matvec_parts_triton(x, w, norm=(r, nw, 1e-6), plan=plan)
    want_h = (matvec.matvec_ref(x, w).float() + r.float()).to(dtype)
    check(h, want_h, TOL[dtype], "h")
    check(xn.x, (h.float() * (1 + nw.float())).to(dtype), TOL[dtype], "x")


def _run_tiles(BK: int, BN: int = 32, warps: int = 2, stages: int = 2, parts: int = 3, programs: int = 6):
    """A plan whose FP8 products take tiles of BK columns (several scale blocks a K step where BK >
    128: fp8.fp8_run), the same rows, warps and depth whatever BK."""
    def tiles(N, K, itemsize, swiglu=False, fp8=False):
        return (BN, BK, warps, stages) if fp8 else None

    def split_tiles(N, K, itemsize):
        return parts, BN, BK, warps, stages
    return ProductPlan(programs=programs, tiles=tiles, split_tiles=split_tiles)


def test_fp8_two_blocks_where_the_plan_and_k_allow():
    # the measured rule: two scale blocks a step for rows of 4096 or more that 256 divides, for the
    # products the plan names (the plain ones by default, the SwiGLU too on an H200's plan)
    both = ProductPlan(programs=132, fp8_two_blocks=("plain", "swiglu"))
    assert matvec.tiles(5120, 17408, 2, fp8=True)[1:] == (256, 2, 4)
    assert matvec.tiles(300, 4224, 2, fp8=True)[1:] == (128, 2, 8)            # 33 blocks: one at a time
    assert matvec.tiles(2048, 2048, 2, fp8=True)[1] == 128                     # short rows
    assert matvec.tiles(17408, 5120, 2, swiglu=True, fp8=True)[1] == 128
    assert matvec.tiles(17408, 5120, 2, swiglu=True, fp8=True, plan=both)[1:] == (256, 2, 3)
    assert matvec.tiles(5120, 17408, 2, fp8=True, plan=ProductPlan(programs=132, fp8_two_blocks=()))[1] == 128
    assert matvec.tiles(5120, 17408, 2, fp8=False)[1] == 256                   # bf16: its own tiles


def test_fp8_runs_are_the_same_sums(device):
    # a K step of BK / 128 scale blocks, taken one after another (each its own load, dot and scale):
    # the plain, SwiGLU and split products the same bits as one block a step (where no split over
    # K falls elsewhere: none here), and near float32; a K that BK does not divide (640 = 5 blocks)
    # falls back to one block a step
    BK = 256
    x = randn(3, 1536, dtype=torch.float32, device=device, seed=BK)
    w, w2 = weights(160, 1536, device, seed=5), weights(2 * 128, 1536, device, seed=6)
    run, one = _run_tiles(BK), _run_tiles(128)
    assert matvec.tiles(160, 1536, 4, fp8=True, plan=run)[1] == BK
    assert matvec.tiles(160, 640, 4, fp8=True, plan=run)[1] == 128
    got = matvec.matvec_triton(x, w, plan=run)
    assert torch.equal(got, matvec.matvec_triton(x, w, plan=one))
    check(got, matvec.matvec_ref(x, w), TOL[torch.float32])
    assert torch.equal(matvec.matvec_swiglu_triton(x, w2, plan=run), matvec.matvec_swiglu_triton(x, w2, plan=one))
    parts = matvec_parts.matvec_parts_triton(x, w, plan=run)
    assert parts.shape[0] == 3 and torch.equal(parts, matvec_parts.matvec_parts_triton(x, w, plan=one))
    check(parts, matvec_parts.matvec_parts_ref(x, w, run), TOL[torch.float32], "parts")


# the 27B's FP8 products: GDN [qkv | z], attention q|gate|k|v, MLP gate|up (SwiGLU), and the 5120-row ones
SHAPES_27B = [(16384, 5120), (14336, 5120), (5120, 6144), (5120, 17408)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_27B)
def test_fp8_27b_shapes_and_rows(N, K):
    w = weights(N, K, "cuda", seed=N)
    x = randn(matvec.MAX_ROWS, K, dtype=torch.bfloat16, device="cuda", seed=K)
    check(matvec.matvec(x[:5], w), matvec.matvec_ref(x[:5], w), 1e-2)
    ones = torch.cat([matvec.matvec(x[i:i + 1], w) for i in range(x.shape[0])])
    for T in (2, 3, 5, matvec.MAX_ROWS):
        assert torch.equal(matvec.matvec(x[:T], w), ones[:T]), f"T={T}"


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_27B)
def test_fp8_runs_are_the_same_sums_27b(N, K):
    # compiled for the GPU (the bit form, wgmma or mma.sync), a K step of several scale blocks gives
    # the very sums of one block a step, at the 27B's shapes: plain (32 rows, 2 warps) and split
    # (64 rows, 4 warps, the norm finished), and the SwiGLU over the gate|up
    x = randn(4, K, dtype=torch.bfloat16, device="cuda", seed=K)
    w = weights(N, K, "cuda", seed=N)
    for BN, warps in ((32, 2), (64, 4)):
        run, one = (_run_tiles(b, BN, warps, 4, programs=132) for b in (256, 128))
        assert torch.equal(matvec.matvec(x, w, plan=run), matvec.matvec(x, w, plan=one))
        r, nw = randn(4, N, dtype=torch.bfloat16, device="cuda", seed=1), randn(N, device="cuda", seed=2).bfloat16()
        got, want = (matvec_parts.matvec_parts_triton(x, w, norm=(r, nw, 1e-6), plan=p) for p in (run, one))
        assert torch.equal(got[0].x, want[0].x) and torch.equal(got[0].ss, want[0].ss) and torch.equal(got[1], want[1])
    if N == 16384:
        gu = weights(2 * 17408, K, "cuda", seed=3)
        run, one = (_run_tiles(b, programs=132) for b in (256, 128))
        assert torch.equal(matvec.matvec_swiglu(x, gu, plan=run), matvec.matvec_swiglu(x, gu, plan=one))


@pytest.mark.gpu
def test_fp8_swiglu_27b_rows():
    w = weights(2 * 17408, 5120, "cuda", seed=1)
    x = randn(matvec.MAX_ROWS, 5120, dtype=torch.bfloat16, device="cuda", seed=2)
    check(matvec.matvec_swiglu(x[:4], w), matvec.matvec_swiglu_ref(x[:4], w), 2e-2)
    ones = torch.cat([matvec.matvec_swiglu(x[i:i + 1], w) for i in range(x.shape[0])])
    for T in (2, 4, matvec.MAX_ROWS):
        assert torch.equal(matvec.matvec_swiglu(x[:T], w), ones[:T]), f"T={T}"
