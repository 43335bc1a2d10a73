"""Split products (kernels/matvec_parts.py) against their references: the float32 parts, their
sum, and the residual add and norm finished block by block, whose Normed the next product reads;
rows bit for bit the 1-row calls (GPU)."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, normed, randn, split_plan

from mtpchat.kernels import matvec, matvec_parts, norm
from mtpchat.kernels.plan import ProductPlan

# numpy's matmul treats Triton's bf16 as integers in the interpreter: bf16 runs on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("N,K", [(70, 300), (33, 200)])
def test_matvec_parts(device, dtype, T, N, K):
    plan = split_plan(3)
    g = torch.Generator().manual_seed(T * N + K + 1)
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(N, K, dtype=dtype, device=device, gen=g)
    ranges = matvec_parts.split_ranges(N, K, x.element_size(), plan)
    assert ranges[0][0] == 0 and ranges[-1][1] == K and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len(ranges) == 3 and all((k1 - k0) % 32 == 0 for k0, k1 in ranges[:-1])
    parts = matvec_parts.matvec_parts_triton(x, w, plan=plan)
    assert parts.shape == (3, T, N) and parts.dtype == torch.float32
    check(parts, matvec_parts.matvec_parts_ref(x, w, plan), TOL[torch.float32], "parts")
    check(matvec_parts.parts_sum_ref(parts, dtype), matvec.matvec_ref(x, w), TOL[dtype], "their sum")


def test_split_config_27b():
    # the 27B's 5120-row products: 80 column blocks of 64, each K in 3 ranges of whole 128-wide tiles
    plan = ProductPlan(programs=132)
    for K in (6144, 17408):
        S, BN, BK, _, _ = matvec_parts.split_config(5120, K, 2, plan)
        assert (S, BN, BK) == (3, 64, 128)
        assert [k1 - k0 for k0, k1 in matvec_parts.split_ranges(5120, K, 2, plan)][:-1] == \
            [matvec_parts.triton.cdiv(K, 3 * BK) * BK] * 2
    assert matvec_parts.split_config(64, 256, 2, plan)[0] == 1     # too short a K to split


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(5120, 17408), (5120, 6144), (1000, 3000)])
def test_matvec_parts_27b_shapes_and_rows(N, K):
    g = torch.Generator().manual_seed(K + 3)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    x, w = randn(5, K, **bf16), randn(N, K, **bf16)
    parts = matvec_parts.matvec_parts(x, w)
    check(parts, matvec_parts.matvec_parts_ref(x, w), 1e-5, "parts")
    check(matvec_parts.parts_sum_ref(parts, torch.bfloat16), matvec.matvec_ref(x, w), 1e-2, "their sum")
    ones = torch.cat([matvec_parts.matvec_parts(x[i:i + 1], w) for i in range(5)], dim=1)
    assert torch.equal(parts, ones)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("split", [False, True])
def test_matvec_parts_norm(device, dtype, T, split):
    # a block's last product, the residual add and the norm's two pieces: each column block's last
    # program adds the parts and the residual, writes h, x = h * (1 + w) and the block's sums of h²
    plan = split_plan(3 if split else 1)
    g = torch.Generator().manual_seed(T + 10 * split)
    x, w = randn(T, 300, dtype=dtype, device=device, gen=g), randn(70, 300, dtype=dtype, device=device, gen=g, scale=0.1)
    r = randn(T, 70, dtype=dtype, device=device, gen=g)
    nw = randn(70, dtype=dtype, device=device, gen=g, scale=0.3)
    for _ in range(2):                               # the second call finds the counts at 0 again
        n, h = matvec_parts.matvec_parts_triton(x, w, norm=(r, nw, 1e-6), plan=plan)
        assert int(matvec.arrival_counts(x.device, 1).abs().sum()) == 0
    y_ref, h_ref = norm.add_rmsnorm_ref(matvec_parts.matvec_parts_ref(x, w, plan), r, nw, 1e-6)
    check(h, h_ref, TOL[dtype], "residual sum")
    assert torch.equal(h, norm.add_rmsnorm_triton(matvec_parts.matvec_parts_triton(x, w, plan=plan), r, nw, 1e-6)[1])
    hf = h.float()
    check(n.x, (hf * (1 + nw.float())).to(dtype), TOL[dtype], "h * (1 + w)")
    assert n.ss.shape == (T, 5) and n.eps == 1e-6
    blocks = torch.nn.functional.pad(hf * hf, (0, 10)).view(T, 5, 16)     # 16 columns a block
    check(n.ss, blocks.sum(-1), TOL[torch.float32], "sums of squares")
    # what the next product makes of it: the product of the normalised rows
    w2 = randn(40, 70, dtype=dtype, device=device, gen=g, scale=0.1)
    check(matvec.matvec_triton(n, w2), matvec.matvec_ref(y_ref, w2), 2 * TOL[dtype], "the next product")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [False, True])
def test_matvec_parts_norm_without_residual(device, dtype, split):
    # the MTP head's fc finished by its layer's input norm: h = x @ wᵀ, the product rounded once
    # (the plain product's value to the bit), and the norm's two pieces of it
    plan = split_plan(3 if split else 1)
    g = torch.Generator().manual_seed(40 + split)
    x, w = randn(3, 300, dtype=dtype, device=device, gen=g), randn(70, 300, dtype=dtype, device=device, gen=g, scale=0.1)
    nw = randn(70, dtype=dtype, device=device, gen=g, scale=0.3)
    n, h = matvec_parts.matvec_parts_triton(x, w, norm=(None, nw, 1e-6), plan=plan)
    assert int(matvec.arrival_counts(x.device, 1).abs().sum()) == 0
    assert torch.equal(h, matvec_parts.parts_sum_ref(matvec_parts.matvec_parts_triton(x, w, plan=plan), dtype))
    check(h, matvec.matvec_ref(x, w), TOL[dtype], "the product")
    check(n.x, (h.float() * (1 + nw.float())).to(dtype), TOL[dtype], "h * (1 + w)")
    check(n.ss, torch.nn.functional.pad(h.float() ** 2, (0, 10)).view(3, 5, 16).sum(-1), TOL[torch.float32], "ss")
    w2 = randn(40, 70, dtype=dtype, device=device, gen=g, scale=0.1)
    want = matvec.matvec_ref(norm.rmsnorm_ref(h, nw, 1e-6), w2)
    check(matvec.matvec_triton(n, w2), want, 2 * TOL[dtype], "the next product")


@pytest.mark.gpu
@pytest.mark.parametrize("K", [6144, 17408])
def test_matvec_parts_norm_27b_rows(K):
    # 27B shapes: every piece of a T-row call is the 1-row calls' to the bit, then the next product
    g = torch.Generator().manual_seed(K + 1)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    R = matvec.MAX_ROWS
    x, w, r = randn(R, K, **bf16), randn(5120, K, scale=0.02, **bf16), randn(R, 5120, **bf16)
    nw, w2 = randn(5120, scale=0.3, **bf16), randn(2 * 17408, 5120, scale=0.02, **bf16)
    w3 = randn(16480, 5120, scale=0.02, **bf16)
    ones = [matvec_parts.matvec_parts_triton(x[i:i + 1], w, norm=(r[i:i + 1], nw, 1e-6)) for i in range(R)]
    next_ones = [(matvec.matvec_swiglu(o[0], w2), matvec.matvec(o[0], w3)) for o in ones]
    for T in (2, 3, 5, R):
        n, h = matvec_parts.matvec_parts_triton(x[:T], w, norm=(r[:T], nw, 1e-6))
        assert torch.equal(h, torch.cat([o[1] for o in ones[:T]])), f"T={T}"
        assert torch.equal(n.x, torch.cat([o[0].x for o in ones[:T]])), f"T={T}"
        assert torch.equal(n.ss, torch.cat([o[0].ss for o in ones[:T]])), f"T={T}"
        assert torch.equal(matvec.matvec_swiglu(n, w2), torch.cat([y for y, _ in next_ones[:T]])), f"T={T}"
        assert torch.equal(matvec.matvec(n, w3), torch.cat([y for _, y in next_ones[:T]])), f"T={T}"
    n, h = matvec_parts.matvec_parts_triton(x[:5], w, norm=(r[:5], nw, 1e-6))
    y_ref, h_ref = norm.add_rmsnorm_ref(matvec_parts.matvec_parts_ref(x[:5], w), r[:5], nw, 1e-6)
    assert torch.equal(h, norm.add_rmsnorm(matvec_parts.matvec_parts(x[:5], w), r[:5], nw, 1e-6)[1])
    check(h, h_ref, 1e-2, "residual sum")
    check(matvec.matvec_swiglu(n, w2), matvec.matvec_swiglu_ref(y_ref, w2), 2e-2, "the next product")
    check(matvec.matvec(n, w3), matvec.matvec_ref(y_ref, w3), 2e-2, "a plain next product")
