"""Few-row products over 4-bit weights (kernels/int4.py) against their float32 references: the
plain and SwiGLU products (groups of 32, 64 and 128, symmetric and with zeros, with and without
GPTQ's perm), a Normed input, the small last wave split over K, the split products with and
without the norm finished; row i of a T-row call bit for bit the 1-row call; the kernel compiled
for Ampere and Ada (no GPU needed); the 27B's shapes (GPU)."""
from __future__ import annotations

import os
import subprocess
import sys

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
    # 448 rows: 7 column blocks of 64 on 6 programs (the interpreter's "SMs"), the last split over K
    w = int4_weight(N, K, device, T + N, group, symmetric, perm, scale_dtype=torch.float32 if T == 3 else torch.float16)
    x = randn(T, K, dtype=dtype, device=device, seed=K)
    if N == 448 and x.device.type == "cpu":
        assert matvec.tail_split(7, 2, default_products(x.device)) is None        # 2 K tiles: too few ...
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


def test_int4_rows_do_not_depend_on_T(device):
    w = int4_weight(130, 256, device, 7, 128, False, True)
    x = randn(5, 256, device=device, seed=8)
    rows_equal(lambda x: matvec.matvec_triton(x, w), x)
    rows_equal(lambda x: matvec.matvec_swiglu_triton(x, w), x)
    rows_equal(lambda x: matvec_parts.matvec_parts_triton(x, w, plan=split_plan(2)).transpose(0, 1), x)


# --- the kernel for Ampere and Ada, compiled without a GPU ------------------------------------------

COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from mtpchat.kernels import matvec

types = dict(x="*bf16", w="*i32", sw="*fp16", y="*bf16", ws="*fp32", count="*i32", ss="*fp32", zw="*u8",
             perm="*i32", eps="fp32")
fn = matvec._matvec_kernel
for cap in (80, 86, 89):
    for plain in (False, True):
        consts = dict(BT=16, BN=32, BK=256, NBP=8, SWIGLU=True, SPLIT=True, FP8=False, PDL=False, BITS=0,
                      G=128, BG=128)
        if plain:
            consts.update(zw=None, perm=None)
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        c = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", cap, 32), options=dict(num_warps=4, num_stages=4))
        ptx = c.asm["ptx"]
        assert f".target sm_{cap}" in ptx and "mma.sync" in ptx, cap
        assert "wgmma" not in ptx and "setmaxnreg" not in ptx and "griddepcontrol" not in ptx, cap
        assert len(c.asm["cubin"]) > 0
        print(cap, plain, len(c.asm["cubin"]))
"""


def test_int4_matvec_compiles_for_ampere_and_ada():
    """The 4-bit product (SwiGLU, split, Normed input; zeros and perm, or neither) through Triton's
    whole pipeline to a cubin for sm_80, sm_86 and sm_89, on a machine without a GPU: no
    instruction of Hopper's on the way (no wgmma, no PDL), the dots on mma.sync. In a process of
    its own: this one may run Triton's interpreter, whose kernels do not compile."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.split("\n")) > 6


# --- the 27B's shapes on the GPU --------------------------------------------------------------------

# GDN in_proj [qkv | z], attention q|gate|k|v, GDN out_proj and attention o_proj, MLP down
SHAPES_27B = [(16384, 5120), (14336, 5120), (5120, 6144), (5120, 17408)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_27B)
@pytest.mark.parametrize("group,symmetric,perm", [(128, True, False), (32, False, True)])
def test_int4_27b_shapes_and_rows(N, K, group, symmetric, perm):
    w = int4_weight(N, K, "cuda", N, group, symmetric, perm)
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
