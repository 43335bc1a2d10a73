"""Few-row products over 4-bit weights (kernels/int4.py) against their float32 references: the
plain and SwiGLU products (groups of 32, 64 and 128, symmetric and with zeros, with and without
GPTQ's perm), a Normed input, the small last wave split over K, the split products with and
without the norm finished; row i of a T-row call bit for bit the 1-row call; the 27B's shapes (GPU). The
kernels compiled for Hopper, Ampere and Ada: test_int4_compile.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_checks import TOL, check, int4_weight, normed, randn

from mtpchat.kernels import int4, matvec, matvec_parts
from mtpchat.kernels.plan import ProductPlan, default_products

# numpy's matmul treats Triton's bf16 as integers in the interpreter: bf16 activations on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def test_widened_values_are_exact():
    # the bit form of int4.widen in torch: nibble | 0x4300 as a bf16 is 128 + q, less 128 + zero exact
    q = torch.arange(16, dtype=torch.int16)
    w = (q | 0x4300).view(torch.bfloat16)
    assert torch.equal(w.float(), 128. + q.float())
    for z in range(16):
        z_bf = torch.tensor([z | 0x4300], dtype=torch.int16).view(torch.bfloat16)
        assert torch.equal((w - z_bf).float(), (q - z).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K,group,symmetric,perm", [
    (1, 100, 256, 32, True, False), (3, 70, 384, 128, False, True), (5, 448, 512, 64, False, False),
    (16, 33, 256, 128, True, True), (3, 130, 640, 32, False, True)])
def test_int4_matvec(device, dtype, T, N, K, group, symmetric, perm):
    # 448 rows: 7 column blocks of 64 on 6 programs (the interpreter's "SMs"); K 512 is one or two
    # K tiles, too few to split the last block
    w = int4_weight(N, K, device, T + N, group, symmetric, perm, scale_dtype=torch.float32 if T == 3 else torch.float16)
    x = randn(T, K, dtype=dtype, device=device, seed=K)
    if N == 448 and x.device.type == "cpu":
        BK = matvec.tiles(N, K, 4, plan=default_products(x.device), group=group)[1]
        assert matvec.tail_split(7, K // BK, default_products(x.device)) is None
    check(matvec.matvec_triton(x, w), matvec.matvec_ref(x, w), TOL[dtype])


def test_int4_matvec_tail_split(device):
    # 7 column blocks of 64 on 6 programs: the last split over K into 3 parts of 2 tiles of 128
    def tiles(product, N, K, group):
        return (64, 128, 4, 2) if product == "plain" else None
    plan = ProductPlan(programs=6, int4_tiles=tiles)
    assert matvec.tail_split(7, 6, plan) == (3, 2)
    w = int4_weight(448, 768, device, 5, 128, False, True)
    x = randn(4, 768, device=device, seed=6)
    check(matvec.matvec_triton(x, w, plan=plan), matvec.matvec_ref(x, w), TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K,group,symmetric,perm", [(1, 70, 256, 32, False, True), (5, 64, 384, 128, True, False)])
def test_int4_matvec_swiglu(device, dtype, T, N, K, group, symmetric, perm):
    w = int4_weight(2 * N, K, device, N, group, symmetric, perm)
    x = randn(T, K, dtype=dtype, device=device, seed=T)
    check(matvec.matvec_swiglu_triton(x, w), matvec.matvec_swiglu_ref(x, w), TOL[dtype])


def test_int4_products_take_a_normed_input(device):
    g = torch.Generator().manual_seed(3)
    n = normed(3, 256, torch.float32, device, g)
    w = int4_weight(200, 256, device, 4, 32, False, True)
    check(matvec.matvec_triton(n, w), matvec.matvec_ref(n, w), TOL[torch.float32])
    check(matvec.matvec_swiglu_triton(n, w), matvec.matvec_swiglu_ref(n, w), TOL[torch.float32], "swiglu")


def split_plan(parts: int) -> ProductPlan:
    def tiles(product, N, K, group):
        return (parts, 16, 64, 4, 2) if product == "split" else None
    return ProductPlan(programs=6, int4_tiles=tiles)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K,group,perm", [(4, 70, 384, 32, True), (1, 33, 256, 64, False)])
def test_int4_matvec_parts(device, dtype, T, N, K, group, perm):
    plan = split_plan(3)
    w = int4_weight(N, K, device, N, group, False, perm)
    x = randn(T, K, dtype=dtype, device=device, seed=K)
    parts = matvec_parts.matvec_parts_triton(x, w, plan=plan)
    assert parts.shape[0] > 1
    check(parts, matvec_parts.matvec_parts_ref(x, w, plan), TOL[torch.float32], "parts")
    check(matvec_parts.parts_sum_ref(parts, dtype), matvec.matvec_ref(x, w), TOL[dtype], "their sum")
    # and with the norm finished block by block: the residual stream and the next product's input
    r, nw = randn(T, N, dtype=dtype, device=device, seed=1), randn(N, dtype=dtype, device=device, seed=2, scale=0.1)
    xn, h = matvec_parts.matvec_parts_triton(x, w, norm=(r, nw, 1e-6), plan=plan)
    check(h, (matvec.matvec_ref(x, w).float() + r.float()).to(dtype), TOL[dtype], "h")
    check(xn.x, (h.float() * (1 + nw.float())).to(dtype), TOL[dtype], "x")
    want_ss = torch.stack([(h.float()[:, i:i + 16] ** 2).sum(1) for i in range(0, N, 16)], 1)
    check(xn.ss, want_ss, TOL[torch.float32], "ss")


def rows_equal(run, x):
    ones = torch.cat([run(x[i:i + 1]) for i in range(x.shape[0])])
    for T in sorted({2, 3, x.shape[0]}):
        assert torch.equal(run(x[:T]), ones[:T]), f"T={T}"


def slices_plan(form: str = "slices") -> ProductPlan:
    """The slices form (or pairs, int4.form_args), split products in 3 parts of 128-column tiles."""
    def tiles(product, N, K, group):
        return (3, 16, 128, 4, 2) if product == "split" else None
    return ProductPlan(programs=6, int4_tiles=tiles, int4_form=form)


def test_the_slices_form_takes_dots_of_16_words_or_more():
    assert int4.form_args(512, 128, "slices") == dict(BG=128, UNPACK=int4.SLICED)
    assert int4.form_args(128, 256, "slices") == dict(BG=128, UNPACK=int4.SLICED)
    assert int4.form_args(256, 64, "slices") == dict(BG=64, UNPACK=int4.RESHAPED)   # 8 words a group: reshape
    assert int4.form_args(256, 64, "pairs") == dict(BG=64, UNPACK=int4.RESHAPED)
    assert int4.form_args(512, 128, "reshape") == dict(BG=128, UNPACK=int4.RESHAPED)
    assert int4.form_of(None, "swiglu", 34816, 5120) == "pairs" and int4.form_of("slices", "gemm", 9, 9) == "slices"
    # pairs' inline assembly exists only compiled: the interpreter takes the slices' same integers
    assert int4.form_args(512, 128, "pairs") == dict(
        BG=128, UNPACK=int4.SLICED if int4.interpreting() else int4.PAIRED)
    with pytest.raises(AssertionError, match="form"):
        int4.form_args(512, 128, "nibbles")


def pairs_bits(word: int, zero: int, fp16: bool = False) -> list[int]:
    """_PAIRS_ASM's arithmetic on one word in Python integers and torch halves: the 8 results'
    16-bit patterns in nibble order."""
    magic, one, neg = (0x64006400, 0x3C00, 0xE400) if fp16 else (0x43004300, 0x3F80, 0xC300)
    dtype = torch.float16 if fp16 else torch.bfloat16
    half = lambda bits: torch.tensor([bits - (1 << 16) if bits >= 1 << 15 else bits], dtype=torch.int16).view(dtype)
    out = [0] * 8
    for p in range(4):
        t = ((word >> 4 * p) & 0x000F000F) | magic
        for j, bits in ((p, t & 0xFFFF), (p + 4, t >> 16)):
            v = half(bits).float() * half(one).float() + half(neg | zero).float()   # exact: no rounding
            out[j] = int(v.to(dtype).view(torch.int16).item()) & 0xFFFF
    return out


@pytest.mark.parametrize("fp16", [False, True])
def test_the_pairs_arithmetic_gives_q_less_zero(fp16):
    # the arithmetic int4._PAIRS_ASM is written to do, modelled here in Python and torch halves for
    # every nibble and zero, and its constants present in the assembly; the assembly itself (shifts,
    # lop3's table, which result takes which half) is checked where it runs, on the GPU:
    # test_int4_pairs_equal_slices_bit_for_bit
    dtype = torch.float16 if fp16 else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    for word in [0x76543210, 0xFEDCBA98] + torch.randint(0, 1 << 32, (30,), generator=g).tolist():
        for zero in range(16):
            got = torch.tensor([b - (1 << 16) if b >= 1 << 15 else b for b in pairs_bits(word, zero, fp16)],
                               dtype=torch.int16).view(dtype).float()
            want = torch.tensor([((word >> 4 * j) & 0xF) - zero for j in range(8)], dtype=torch.float32)
            assert torch.equal(got, want), (hex(word), zero)
    asm = int4.PAIRS_FP16 if fp16 else int4.PAIRS_BF16
    assert asm.count("0x000F000F") == 4 and asm.count("fma.rn.") == 4 and ("f16x2" if fp16 else "bf16x2") in asm
    assert ("0x64006400" if fp16 else "0x43004300") in asm and ("0x3C003C00" if fp16 else "0x3F803F80") in asm


@pytest.mark.parametrize("form", ["slices", "pairs"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K,symmetric,perm", [(1, 100, 384, True, False), (3, 70, 640, False, True)])
def test_int4_slices_form(device, dtype, T, N, K, symmetric, perm, form):
    # groups of 128 (a dot of 16 words a nibble); K 384 and 640 end inside the 512-column tile
    plan = slices_plan(form)
    w = int4_weight(N, K, device, N + 1, 128, symmetric, perm)
    x = randn(T, K, dtype=dtype, device=device, seed=K + 1)
    check(matvec.matvec_triton(x, w, plan=plan), matvec.matvec_ref(x, w), TOL[dtype], "plain")
    check(matvec.matvec_swiglu_triton(x, w, plan=plan), matvec.matvec_swiglu_ref(x, w), TOL[dtype], "swiglu")
    n = normed(T, K, dtype, device, torch.Generator().manual_seed(5))
    check(matvec.matvec_triton(n, w, plan=plan), matvec.matvec_ref(n, w), TOL[dtype], "normed")
    parts = matvec_parts.matvec_parts_triton(x, w, plan=plan)
    assert parts.shape[0] > 1
    check(parts, matvec_parts.matvec_parts_ref(x, w, plan), TOL[torch.float32], "parts")
    r, nw = randn(T, N, dtype=dtype, device=device, seed=1), randn(N, dtype=dtype, device=device, seed=2, scale=0.1)
    _, h = matvec_parts.matvec_parts_triton(x, w, norm=(r, nw, 1e-6), plan=plan)
    check(h, (matvec.matvec_ref(x, w).float() + r.float()).to(dtype), TOL[dtype], "h")


@pytest.mark.parametrize("form", ["slices", "pairs"])
def test_int4_slices_rows_do_not_depend_on_T(device, form):
    plan = slices_plan(form)
    w = int4_weight(130, 384, device, 9, 128, False, True)
    x = randn(5, 384, device=device, seed=10)
    rows_equal(lambda x: matvec.matvec_triton(x, w, plan=plan), x)
    rows_equal(lambda x: matvec_parts.matvec_parts_triton(x, w, plan=plan).transpose(0, 1), x)


def test_int4_rows_do_not_depend_on_T(device):
    w = int4_weight(130, 256, device, 7, 128, False, True)
    x = randn(5, 256, device=device, seed=8)
    rows_equal(lambda x: matvec.matvec_triton(x, w), x)
    rows_equal(lambda x: matvec.matvec_swiglu_triton(x, w), x)
    rows_equal(lambda x: matvec_parts.matvec_parts_triton(x, w, plan=split_plan(2)).transpose(0, 1), x)


def test_rows_past_the_row_tile_run_in_pieces(device):
    """A call of more rows than the plan's row tile (int4_rows) runs in pieces of the tile: each
    piece's first and last row the same bits as alone (11 rows in pieces of 4, 4 and 3), for each
    product, a Normed input and the split product's norm."""
    plan = ProductPlan(programs=6, int4_rows=4)
    edges = [0, 3, 4, 7, 8, 10]
    w = int4_weight(130, 256, device, 11, 128, False, True)
    x = randn(11, 256, device=device, seed=12)
    for run in (lambda x: matvec.matvec_triton(x, w, plan=plan), lambda x: matvec.matvec_swiglu_triton(x, w, plan=plan),
                lambda x: matvec_parts.matvec_parts_triton(x, w, plan=dataclasses.replace(split_plan(2), int4_rows=4)).transpose(0, 1)):
        ones = torch.cat([run(x[i:i + 1]) for i in edges])
        assert torch.equal(run(x)[edges], ones)
    n = normed(11, 256, torch.float32, device, torch.Generator().manual_seed(4))
    ones = torch.cat([matvec.matvec_triton(matvec.rows_slice(n, i, i + 1), w, plan=plan) for i in edges])
    assert torch.equal(matvec.matvec_triton(n, w, plan=plan)[edges], ones)
    sq = int4_weight(256, 256, device, 13, 128, True, False)
    r, nw = randn(11, 256, device=device, seed=14), randn(256, device=device, seed=15, scale=0.1)
    split = dataclasses.replace(split_plan(2), int4_rows=4)
    xn, h = matvec_parts.matvec_parts_triton(x, sq, norm=(r, nw, 1e-6), plan=split)
    for i in edges:
        xn1, h1 = matvec_parts.matvec_parts_triton(x[i:i + 1], sq, norm=(r[i:i + 1], nw, 1e-6), plan=split)
        assert torch.equal(h[i:i + 1], h1) and torch.equal(xn.x[i:i + 1], xn1.x) and torch.equal(xn.ss[i:i + 1], xn1.ss)


# --- interleaved weights (int4.interleave_ref): four dots a group over neighbouring columns ---------

def interleaved_split(parts: int) -> ProductPlan:
    """Split products in `parts` parts of 128-column K tiles (an interleaved tile takes whole groups)."""
    def tiles(product, N, K, group):
        return (parts, 16, 128, 4, 2) if product == "split" else None
    return ProductPlan(programs=6, int4_tiles=tiles)


def test_interleaving_moves_columns_within_groups_only():
    w = int4_weight(6, 384, "cpu", 3, 64, False)
    order = int4.interleaved_order(384, 64)
    assert sorted(order.tolist()) == list(range(384)) and torch.equal(order // 64, torch.arange(384) // 64)
    assert order[:6].tolist() == [0, 16, 32, 48, 1, 17]            # place 4 c + q holds column 16 q + c
    il = int4.interleave_ref(w)
    assert il.interleaved and il.w.dtype == torch.int16 and il.w.shape == (6, 96) and il.shape == w.shape
    assert il.group == 64 and torch.equal(il.scale, w.scale) and torch.equal(il.zero, w.zero)
    assert torch.equal(int4.values_ref(il), int4.unpack_ref(w.w))
    assert torch.equal(int4.dequantize_ref(il), int4.dequantize_ref(w))
    # half-word 1 of row 0 holds columns 1, 17, 33, 49 of the first group in its four nibbles
    v = int4.unpack_ref(w.w)[0]
    assert int(il.w[0, 1]) & 0xFFFF == sum(int(v[c]) << (4 * q) for q, c in enumerate((1, 17, 33, 49)))
    with pytest.raises(AssertionError, match="interleave"):
        int4.interleave_ref(int4_weight(6, 384, "cpu", 3, 32))
    with pytest.raises(AssertionError, match="perm"):
        int4.interleave_ref(int4_weight(6, 384, "cpu", 3, 128, True, True))


def check_interleaved_parts(x, w, il, plan, group, symmetric, seed):
    """The split products over an interleaved weight `il` (made from w) under the plan: their parts
    against the references, and the residual add and norm they finish over a square weight."""
    T, K = x.shape
    check(matvec_parts.matvec_parts_triton(x, il, plan=plan), matvec_parts.matvec_parts_ref(x, w, plan),
          TOL[torch.float32], "parts")
    sq = int4.interleave_ref(int4_weight(K, K, x.device, seed, group, symmetric))
    r = randn(T, K, dtype=x.dtype, device=x.device, seed=seed + 1)
    nw = randn(K, dtype=x.dtype, device=x.device, seed=seed + 2, scale=0.1)
    _, h = matvec_parts.matvec_parts_triton(x, sq, norm=(r, nw, 1e-6), plan=plan)
    check(h, (matvec.matvec_ref(x, sq).float() + r.float()).to(x.dtype), TOL[x.dtype], "h")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K,group,symmetric", [(1, 100, 384, 128, True), (5, 70, 640, 64, False),
                                                   (11, 34, 256, 128, False)])
def test_interleaved_products(device, dtype, T, N, K, group, symmetric):
    """Every few-row product over an interleaved weight against the references of the weight it
    came from (rows past the row tile in pieces), a Normed input, the split product with and without
    its norm; each row the same bits as alone."""
    w = int4_weight(N, K, device, N + T, group, symmetric)
    il = int4.interleave_ref(w)
    x = randn(T, K, dtype=dtype, device=device, seed=T)
    check(matvec.matvec_triton(x, il), matvec.matvec_ref(x, w), TOL[dtype])
    check(matvec.matvec_swiglu_triton(x, il), matvec.matvec_swiglu_ref(x, w), TOL[dtype], "swiglu")
    n = normed(T, K, dtype, device, torch.Generator().manual_seed(T))
    check(matvec.matvec_triton(n, il), matvec.matvec_ref(n, w), TOL[dtype], "normed")
    plan = interleaved_split(2)
    check_interleaved_parts(x, w, il, plan, group, symmetric, 5)
    rows_equal(lambda x: matvec.matvec_triton(x, il), x)
    rows_equal(lambda x: matvec.matvec_swiglu_triton(x, il), x)
    rows_equal(lambda x: matvec_parts.matvec_parts_triton(x, il, plan=plan).transpose(0, 1), x)


def test_the_plan_names_the_interleaved_swiglu_tile():
    """ProductPlan.int4_glu_tile (an H200's 3 deep) takes a step's SwiGLU over interleaved weights
    only; None leaves int4.measured's, and a tile rule still comes first."""
    deep = ProductPlan(programs=132, int4_glu_tile=(32, 512, 2, 3))
    assert matvec.tiles(17408, 5120, 2, swiglu=True, plan=deep, group=128, interleaved=True) == (32, 512, 2, 3)
    assert matvec.tiles(17408, 5120, 2, swiglu=True, plan=ProductPlan(programs=132), group=128,
                        interleaved=True) == int4.measured("swiglu", 17408, 5120, True)[0]
    assert matvec.tiles(17408, 5120, 2, swiglu=True, plan=deep, group=128) == int4.measured("swiglu", 17408, 5120)[0]
    assert matvec.tiles(16384, 5120, 2, plan=deep, group=128, interleaved=True) == \
        int4.measured("plain", 16384, 5120, True)[0]
    ruled = dataclasses.replace(deep, int4_tiles=lambda product, N, K, group: (64, 256, 4, 4))
    assert matvec.tiles(17408, 5120, 2, swiglu=True, plan=ruled, group=128, interleaved=True) == (64, 256, 4, 4)


@pytest.mark.parametrize("glu_tile", [None, (32, 512, 2, 3)])
def test_the_interleaved_swiglu_on_its_planned_tiles(device, glu_tile):
    """The step SwiGLU over an interleaved weight on the measured tile and the H200's (3 deep), at
    odd sizes: against the reference of the weight it came from, each row the same bits alone."""
    T, N, K = 5, 70, 1152
    w = int4_weight(2 * N, K, device, 17, 128, False)
    il = int4.interleave_ref(w)
    plan = ProductPlan(programs=6, int4_glu_tile=glu_tile)
    x = randn(T, K, dtype=torch.float32, device=device, seed=18)
    check(matvec.matvec_swiglu_triton(x, il, plan=plan), matvec.matvec_swiglu_ref(x, w), TOL[torch.float32])
    rows_equal(lambda x: matvec.matvec_swiglu_triton(x, il, plan=plan), x)


@pytest.mark.gpu
def test_the_h200_interleaved_swiglu_tile_on_the_27b_shape():
    """The 27B's gate|up on the H200's 3-deep tile: near the reference, the same bits as the
    measured 2-deep tile (the same sums in the same order), a row the same alone."""
    w = int4_weight(2 * 17408, 5120, "cuda", 1, 128, True)
    il = int4.interleave_ref(w)
    x = randn(matvec.MAX_ROWS, 5120, dtype=torch.bfloat16, device="cuda", seed=2)
    deep = dataclasses.replace(default_products("cuda"), int4_glu_tile=(32, 512, 2, 3))
    two = dataclasses.replace(default_products("cuda"), int4_glu_tile=None)
    got = matvec.matvec_swiglu_triton(x[:4], il, plan=deep)
    check(got, matvec.matvec_swiglu_ref(x[:4], w), 2e-2)
    assert torch.equal(got, matvec.matvec_swiglu_triton(x[:4], il, plan=two))
    rows_equal(lambda x: matvec.matvec_swiglu_triton(x, il, plan=deep), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,K,group,symmetric,perm,interleaved", [
    (1, 70, 256, 128, True, False, False), (17, 100, 384, 128, False, True, False),
    (40, 34, 256, 64, False, False, True), (64, 66, 512, 32, True, True, False), (23, 130, 256, 128, True, False, True)])
def test_int4_prefill_products(device, dtype, T, N, K, group, symmetric, perm, interleaved):
    """A short prefill's 4-bit product in the few-row kernel (matvec_prefill: rows padded to 16, 32
    or 64, the plan's int4_prefill_tile, groups of 32 taking BK up to whole groups) against the
    reference of the weight it came from; natural words with zeros and a perm, interleaved ones."""
    w = int4_weight(N, K, device, T + N, group, symmetric, perm)
    wv = int4.interleave_ref(w) if interleaved else w
    x = randn(T, K, dtype=dtype, device=device, seed=T)
    plan = ProductPlan(programs=6, int4_prefill_rows=64)
    check(matvec.matvec_prefill(x, wv, plan), matvec.matvec_ref(x, w), TOL[dtype])
    other = dataclasses.replace(plan, int4_prefill_tile=(32, 256, 2, 3), permute_x=False)
    check(matvec.matvec_prefill(x, wv, other), matvec.matvec_ref(x, w), TOL[dtype], "another tile, perm in the tiles")
    with pytest.raises(AssertionError, match="1..64 rows"):
        matvec.matvec_prefill(randn(65, K, dtype=dtype, device=device, seed=1), wv, plan)


def test_int4_prefill_fits_says_where_one_buffer_is_too_many():
    # matvec.prefill_fits: BK holds whole groups, so wide groups outgrow a small device's shared memory
    plan = ProductPlan(programs=6)
    small = dataclasses.replace(plan, shared_memory=101376)
    for group, fits_small in ((128, True), (512, True), (1024, False)):
        w = int4_weight(64, 2048, "cpu", 1, group)
        assert matvec.prefill_fits(64, w, 2, plan) and matvec.prefill_fits(64, w, 2, small) == fits_small
        assert matvec.prefill_fits(8, w, 2, small)           # x's tile of 16 rows: 64 KB with groups of 1,024
    assert not matvec.prefill_fits(8, int4_weight(64, 4096, "cpu", 1, 2048), 2, small)


def test_int4_prefill_tile_fits_the_shared_memory():
    # x's tile of 64 rows by BK weights is the large buffer: a 99 KB device runs it shallower
    w = int4_weight(64, 256, "cpu", 1, 32)
    plan = ProductPlan(programs=6, int4_prefill_tile=(64, 100, 4, 4))
    assert matvec.prefill_tile(w, 64, 2, plan) == (64, 128, 4, 4)                  # BK up to whole groups
    small = dataclasses.replace(plan, shared_memory=101376)
    BN, BK, warps, stages = matvec.prefill_tile(w, 64, 2, small)
    assert stages == 4 and (stages - 1) * (BN * BK // 2 + BK * 64 * 2) <= 101376
    assert matvec.prefill_tile(w, 64, 2, dataclasses.replace(small, int4_prefill_tile=(64, 256, 4, 4)))[3] == 3
    assert matvec.prefill_tile(w, 64, 2, dataclasses.replace(small, int4_prefill_tile=(64, 512, 4, 4)))[3] == 2
    assert matvec.prefill_tile(w, 64, 2, dataclasses.replace(plan, int4_prefill_tile=(64, 512, 4, 4)))[3] == 3


def test_float32_rows_count_the_widened_weights():
    """With float32 rows a dot's weights widened to float32 sit in shared memory beside the buffers
    (matvec.int4_widened): on a 99 KB device the prefill tile of 64 rows takes half its columns (one
    buffer and that tile would not fit), 2 deep; bf16 rows and an H100's room keep the plan's tile."""
    w = int4_weight(64, 2048, "cpu", 1, 128)
    plan = ProductPlan(programs=6)
    small = dataclasses.replace(plan, shared_memory=101376)
    assert matvec.int4_widened(64, 256, 128, 4) == 64 * 128 * 4 and matvec.int4_widened(64, 256, 128, 2) == 0
    assert matvec.prefill_tile(w, 64, 4, small) == (32, 256, 4, 2)
    assert matvec.prefill_tile(w, 16, 4, small) == (64, 256, 4, 3)
    assert matvec.prefill_tile(w, 64, 2, small) == plan.int4_prefill_tile
    assert matvec.prefill_tile(w, 64, 4, plan) == plan.int4_prefill_tile
    assert all(matvec.prefill_fits(T, w, 4, small) for T in (1, 16, 33, 64))
    # the MoE prefill's experts alike (kernels/moe.py tiles): the down over blocks of 64 pairs
    from mtpchat.kernels import moe
    assert moe.tiles("down", False, False, 4, small, (2048, 512, 128), True, 64) == (64, 128, 8, 2)
    assert moe.tiles("swiglu", False, False, 4, small, (1024, 2048, 128), True, 64) == (32, 128, 8, 2)
    assert moe.tiles("down", False, False, 2, small, (2048, 512, 128), True, 64) == (128, 128, 8, 3)
    assert moe.tiles("down", False, False, 4, plan, (2048, 512, 128), True, 64) == (128, 128, 8, 3)
    # a step's measured expert tiles: float32 on a 99 KB device shallower or narrower, bf16 as measured
    assert moe.tiles("swiglu", True, False, 4, small, (1024, 2048, 128), True) == (32, 256, 4, 3)
    assert moe.tiles("down", True, False, 4, small, (2048, 512, 128), True) == (64, 256, 8, 2)
    for device_plan in (small, plan):
        for product, shape in (("swiglu", (1024, 2048, 128)), ("down", (2048, 512, 128))):
            assert moe.tiles(product, True, False, 2, device_plan, shape, True) == \
                int4.measured("expert_" + product, *shape[:2], True)[0]


# --- the 27B's shapes on the GPU --------------------------------------------------------------------

# GDN in_proj [qkv | z], attention q|gate|k|v, GDN out_proj and attention o_proj, MLP down, the MTP fc
SHAPES_27B = [(16384, 5120), (14336, 5120), (5120, 6144), (5120, 17408), (5120, 10240)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_27B)
@pytest.mark.parametrize("group,symmetric,perm,interleaved", [(128, True, False, False), (32, False, True, False),
                                                               (128, True, False, True)])
def test_int4_27b_shapes_and_rows(N, K, group, symmetric, perm, interleaved):
    # interleaved: the engine's layout, on the measured tiles (the MLP down's split with its own parts)
    w = int4_weight(N, K, "cuda", N, group, symmetric, perm)
    if interleaved:
        w = int4.interleave_ref(w)
    x = randn(matvec.MAX_ROWS, K, dtype=torch.bfloat16, device="cuda", seed=K)
    check(matvec.matvec(x[:5], w), matvec.matvec_ref(x[:5], w), 1e-2)
    rows_equal(lambda x: matvec.matvec(x, w), x)
    if N == 5120:
        parts = matvec_parts.matvec_parts(x[:5], w)
        check(parts, matvec_parts.matvec_parts_ref(x[:5], w), 1e-5, "parts")
        rows_equal(lambda x: matvec_parts.matvec_parts(x, w).transpose(0, 1), x)
        r, nw = randn(5, N, dtype=torch.bfloat16, device="cuda", seed=1), randn(N, device="cuda", seed=2, scale=0.1)
        xn, h = matvec_parts.matvec_parts_triton(x[:5], w, norm=(r, nw.bfloat16(), 1e-6))
        check(h, (matvec.matvec_ref(x[:5], w).float() + r.float()).bfloat16(), 1e-2, "h")


@pytest.mark.gpu
@pytest.mark.parametrize("group,symmetric,perm", [(128, True, False), (64, False, True)])
def test_int4_swiglu_27b_rows(group, symmetric, perm):
    w = int4_weight(2 * 17408, 5120, "cuda", 1, group, symmetric, perm)
    x = randn(matvec.MAX_ROWS, 5120, dtype=torch.bfloat16, device="cuda", seed=2)
    check(matvec.matvec_swiglu(x[:4], w), matvec.matvec_swiglu_ref(x[:4], w), 2e-2)
    rows_equal(lambda x: matvec.matvec_swiglu(x, w), x)
    n = normed(4, 5120, torch.bfloat16, "cuda", torch.Generator().manual_seed(3))
    check(matvec.matvec_swiglu(n, w), matvec.matvec_swiglu_ref(n, w), 2e-2, "normed")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K,group,symmetric,perm", [(16384, 5120, 128, True, False), (5120, 6144, 128, False, True),
                                                      (300, 1152, 128, False, False)])
def test_int4_pairs_equal_slices_bit_for_bit(dtype, N, K, group, symmetric, perm):
    # the same integers summed in the same order: the inline assembly against Triton's own unpacking
    w = int4_weight(N, K, "cuda", N + K, group, symmetric, perm)
    x = randn(5, K, dtype=dtype, device="cuda", seed=K)
    pairs = dataclasses.replace(default_products("cuda"), int4_form="pairs")
    slices = dataclasses.replace(default_products("cuda"), int4_form="slices")
    for run in (matvec.matvec_triton, matvec.matvec_swiglu_triton if N % 2 == 0 else None,
                lambda x, w, plan: matvec_parts.matvec_parts_triton(x, w, plan=plan)):
        if run is None:
            continue
        a, b = run(x, w, plan=pairs), run(x, w, plan=slices)
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    check(matvec.matvec_triton(x, w, plan=pairs), matvec.matvec_ref(x, w), 1e-2)


@pytest.mark.parametrize("form", ["reshape", "slices"])
def test_perm_applied_to_x_once_gives_the_same_bits(device, form):
    # ProductPlan.permute_x: x gathered through the perm once, the weight read without it
    w = int4_weight(70, 640, device, 11, 128, False, True)
    x = randn(3, 640, device=device, seed=12)
    tiles = lambda product, N, K, group: (3, 16, 128, 4, 2) if product == "split" else None
    base = ProductPlan(programs=6, int4_tiles=tiles, int4_form=form, permute_x=False)
    once = dataclasses.replace(base, permute_x=True)
    assert torch.equal(matvec.matvec_triton(x, w, plan=once), matvec.matvec_triton(x, w, plan=base))
    assert torch.equal(matvec.matvec_swiglu_triton(x, w, plan=once), matvec.matvec_swiglu_triton(x, w, plan=base))
    n = normed(3, 640, torch.float32, device, torch.Generator().manual_seed(6))
    assert torch.equal(matvec.matvec_triton(n, w, plan=once), matvec.matvec_triton(n, w, plan=base))
    assert torch.equal(matvec_parts.matvec_parts_triton(x, w, plan=once), matvec_parts.matvec_parts_triton(x, w, plan=base))
    norm = (randn(3, 70, device=device, seed=13), randn(70, device=device, seed=14), 1e-6)
    (a, h_a), (b, h_b) = (matvec_parts.matvec_parts_triton(x, w, norm=norm, plan=p) for p in (once, base))
    assert torch.equal(a.x, b.x) and torch.equal(a.ss, b.ss) and torch.equal(h_a, h_b)
    x2, w2 = matvec.permuted_once(x, w, once)
    assert w2.perm is None and torch.equal(x2, x[:, w.perm.long()])
