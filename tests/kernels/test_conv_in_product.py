"""A step's causal conv done by the product that makes its inputs (conv.ConvStep in matvec's kernel,
the GDN in_proj under KernelPlan.conv_in_product): the product's first C columns come out through
the conv and silu, bit for bit the product's own launch followed by the conv kernel, the window's
ring written as the conv kernel writes it, the columns past C untouched; against the float32
references too. Over float32 and bf16 rows, plain, FP8 and 4-bit weights, a rider, Normed rows,
a last wave split over K, a window wrapped around its ring and an ended generation's step."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, normed, product_weight, randn

from mtpchat.kernels import conv, matvec
from mtpchat.kernels.plan import default_products

# numpy's matmul treats Triton's bf16 as integers in the interpreter: bf16 rows on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
KC = 4           # the conv's taps
WIDTH = KC - 1 + 5


def step(C, dtype, device, seed, off=3, live=None):
    g = torch.Generator().manual_seed(seed)
    buf = randn(C, WIDTH, dtype=dtype, device=device, gen=g)
    cw = randn(C, KC, dtype=dtype, device=device, gen=g, scale=0.5)
    live = None if live is None else torch.tensor([live], device=device)
    return conv.ConvStep(buf, torch.tensor([off], device=device), cw, live, C)


def apart(x, w, c: conv.ConvStep, plan, rider=None):
    """The product's own launch, then the conv kernel over its first C columns: (y, y2, buf)."""
    buf = c.buf.clone()
    if rider is None:
        y, y2 = matvec.matvec_triton(x, w, plan=plan), None
    else:
        y, y2 = matvec.matvec_rider_triton(x, w, rider, plan=plan)
    y[:, :c.channels] = conv.conv_update_triton(y[:, :c.channels], buf, c.off, c.weight, c.live)
    return y, y2, buf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["tensor", "fp8", "int4"])
@pytest.mark.parametrize("T,N,C,K", [(1, 200, 72, 384), (4, 96, 40, 256), (5, 448, 320, 512), (2, 300, 300, 256)])
@pytest.mark.parametrize("ride", [False, True])
def test_the_conv_in_the_product(device, dtype, form, T, N, C, K, ride):
    # C of 40 and 72: a column block half in the conv; 448 float32 rows on the interpreter's 6
    # "SMs": 7 blocks of 64, the last split over K (matvec.tail_split), its conv done by the last
    # of its parts; 300 of 300: every column through the conv
    g = torch.Generator().manual_seed(T * C + K)
    x = randn(T, K, dtype=dtype, device=device, gen=g)
    w = product_weight(form, N, K, dtype, device, seed=N + K)
    rider = randn(24, K, dtype=dtype, device=device, gen=g, scale=K ** -0.5) if ride else None
    c = step(C, dtype, device, seed=C + T, off=T + 2)
    plan = default_products(device)
    want, want2, want_buf = apart(x, w, c, plan, rider)
    before = c.buf.clone()
    if ride:
        y, y2 = matvec.matvec_rider_triton(x, w, rider, plan=plan, conv=c)
        assert torch.equal(y2, want2), "the rider moved"
    else:
        y = matvec.matvec_triton(x, w, plan=plan, conv=c)
    assert torch.equal(y, want), f"the conv in the product: {(y != want).sum().item()} of {y.numel()} values moved"
    assert torch.equal(c.buf, want_buf), "the window's ring"
    # against float32: the product, then the conv over a copy of the ring
    ref = conv.conv_step_ref(matvec.matvec_ref(x.float(), w if form != "tensor" else w.float()),
                             c._replace(buf=before.float(), weight=c.weight.float()))
    check(y[:, :C], ref[:, :C].to(dtype), TOL[dtype] if form == "tensor" else 2e-2, "post-conv columns")
    check(y[:, C:], ref[:, C:].to(dtype), TOL[dtype] if form == "tensor" else 2e-2, "columns past the conv")


@pytest.mark.parametrize("off", [0, 4, 7, 13])
def test_around_the_ring_and_normed_rows(device, off):
    # the window's K-1 columns and a step's new ones wrapped around the ring of 8 (off 4: the new
    # ones wrap, 7 and 13: the window does), over Normed rows
    g = torch.Generator().manual_seed(off)
    x = normed(3, 256, torch.float32, device, g)
    w = product_weight("int4", 160, 256, torch.float32, device, seed=off)
    c = step(96, torch.float32, device, seed=off, off=off)
    plan = default_products(device)
    want, _, want_buf = apart(x, w, c, plan)
    y = matvec.matvec_triton(x, w, plan=plan, conv=c)
    assert torch.equal(y, want) and torch.equal(c.buf, want_buf)


@pytest.mark.parametrize("live", [0, 1])
def test_an_ended_step_leaves_the_ring(device, live):
    x = randn(2, 256, device=device, seed=5)
    w = product_weight("tensor", 128, 256, torch.float32, device, seed=5)
    c = step(64, torch.float32, device, seed=5, live=live)
    before = c.buf.clone()
    plan = default_products(device)
    want, _, want_buf = apart(x, w, c, plan)
    y = matvec.matvec_triton(x, w, plan=plan, conv=c)
    assert torch.equal(y, want) and torch.equal(c.buf, want_buf)
    assert torch.equal(c.buf, before) == (live == 0)


def test_the_reference_path_and_what_it_refuses(device):
    # on the CPU without the interpreter's kernels matvec takes the references, the conv with them;
    # a conv is a step's: rows in one launch, no more than the ring's new columns
    x = randn(3, 256, device="cpu", seed=2)
    w = randn(96, 256, device="cpu", seed=3)
    c = step(64, torch.float32, "cpu", seed=4)
    buf = c.buf.clone()
    want = conv.conv_step_ref(matvec.matvec_ref(x, w), c._replace(buf=buf))
    got = matvec.matvec(x, w, conv=c)
    assert torch.equal(got, want) and torch.equal(c.buf, buf)
    plan = default_products(device)
    xs, ws = x.to(device), w.to(device)
    with pytest.raises(AssertionError, match="step"):
        matvec.matvec_triton(randn(6, 256, device=device, seed=1), ws, plan=plan, conv=step(64, torch.float32, device, 1))
    with pytest.raises(AssertionError, match="columns"):
        matvec.matvec_triton(xs, ws, plan=plan, conv=step(128, torch.float32, device, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 5])
@pytest.mark.parametrize("form", ["tensor", "fp8", "int4"])
def test_the_27b_in_proj_with_its_conv(T, form):
    # the 27B's GDN in_proj (qkv | z | b | a in bf16, q | k | v | z with b | a riding in FP8 and 4 bits)
    # with its 10,240 conv channels: the same bits as the product's launch and the conv kernel,
    # which greedy MTP on == off rests on when a verify's conv runs in the product and a decode's
    # in the recurrence kernel (whose bits are the conv kernel's: test_gdn_conv_step.py)
    C, K = 10240, 5120
    N = C + 6144 + (96 if form == "tensor" else 0)
    g = torch.Generator().manual_seed(T)
    x = randn(T, K, dtype=torch.bfloat16, device="cuda", gen=g)
    w = product_weight(form, N, K, torch.bfloat16, "cuda", seed=T)
    rider = None if form == "tensor" else randn(96, K, dtype=torch.bfloat16, device="cuda", gen=g, scale=K ** -0.5)
    c = step(C, torch.bfloat16, "cuda", seed=T, off=1234)
    plan = default_products("cuda")
    want, want2, want_buf = apart(x, w, c, plan, rider)
    if rider is None:
        y = matvec.matvec_triton(x, w, plan=plan, conv=c)
    else:
        y, y2 = matvec.matvec_rider_triton(x, w, rider, plan=plan, conv=c)
        assert torch.equal(y2, want2)
    assert torch.equal(y, want), f"{(y != want).sum().item()} of {y.numel()} values moved"
    assert torch.equal(c.buf, want_buf)
