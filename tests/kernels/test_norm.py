"""RMSNorm kernels (plain, fused with the residual add, with an MoE's combine before it, gated)
against their float32 references."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import moe, norm

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


def combine_inputs(T: int, k: int, H: int, dtype, device, shared: bool, seed: int):
    """An MoE's uncombined output (kernels/moe.py: y [T * k, H] float32, weights [T, k] summing to
    1, the shared expert's output and gate or None), a residual stream and a norm weight."""
    g = torch.Generator().manual_seed(seed)
    y = randn(T * k, H, device=device, gen=g)
    w = torch.softmax(randn(T, k, gen=g), -1).to(device)
    s = randn(T, H, dtype=dtype, device=device, gen=g) if shared else None
    gate = torch.sigmoid(randn(T, gen=g)).to(device) if shared else None
    r = randn(T, H, dtype=dtype, device=device, gen=g, scale=2.0)
    nw = randn(H, dtype=dtype, device=device, gen=g, scale=0.3)
    return (y, w, s, gate, r, nw)


# H = 300 and 600: not powers of two, and 600 past the combine kernel's 512 columns a program
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 5])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("shared", [True, False])
def test_combine_add_rmsnorm(device, dtype, T, k, shared):
    """The combine folded into the residual add and the norm: within rounding of the float32
    reference, and the same bits as the combine kernel then the norm kernel (both rounding steps
    kept: the combine's output in the stream's dtype, then the add in it)."""
    H = 300 if k != 3 else 600
    y, w, s, gate, r, nw = combine_inputs(T, k, H, dtype, device, shared, seed=T * 100 + k * 10 + shared)
    out, h = norm.combine_add_rmsnorm_triton(y, w, s, gate, r, nw, EPS)
    out_ref, h_ref = norm.combine_add_rmsnorm_ref(y, w, s, gate, r, nw, EPS)
    assert out.dtype == h.dtype == dtype and out.shape == h.shape == (T, H)
    check(h, h_ref, TOL[dtype], "residual sum")
    check(out, out_ref, TOL[dtype])
    combined = moe.combine_triton(y, w, s, gate, dtype)
    two, two_h = norm.add_rmsnorm_triton(combined, r, nw, EPS)
    assert torch.equal(h, two_h) and torch.equal(out, two), "not the bits of the combine and then the norm"


@pytest.mark.parametrize("shared", [True, False])
def test_combine_add_rmsnorm_rows_alone(device, shared):
    """Each row's result is that of the row alone (no sums across rows: greedy MTP on == off), and
    written into a given buffer (the decoder's hiddens: the final norm's whole rows)."""
    T, k, H = 5, 4, 200
    y, w, s, gate, r, nw = combine_inputs(T, k, H, torch.float32, device, shared, seed=7 + shared)
    buf = torch.full((T + 2, H), float("nan"), device=device)
    out, h = norm.combine_add_rmsnorm_triton(y, w, s, gate, r, nw, EPS, out=buf[1:T + 1])
    assert out.data_ptr() == buf[1].data_ptr() and buf[0].isnan().all() and buf[T + 1].isnan().all()
    for i in (0, 3, 4):
        pick = (y[i * k:(i + 1) * k], w[i:i + 1], s[i:i + 1] if shared else None, gate[i:i + 1] if shared else None)
        one, one_h = norm.combine_add_rmsnorm_triton(*pick, r[i:i + 1], nw, EPS)
        assert torch.equal(one[0], out[i]) and torch.equal(one_h[0], h[i]), i


def test_combine_add_rmsnorm_dispatch_cpu_takes_the_reference():
    args = combine_inputs(3, 2, 40, torch.float32, "cpu", True, seed=9)
    got, want = norm.combine_add_rmsnorm(*args, EPS), norm.combine_add_rmsnorm_ref(*args, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the reference is the combine, rounded to the stream's dtype, and then add_rmsnorm's
    c = moe.combine_ref(*args[:4], torch.float32)
    assert torch.equal(want[0], norm.add_rmsnorm_ref(c, args[4], args[5], EPS)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("as_expert", [True, False])
def test_combine_add_rmsnorm_35b_a3b_shapes(T, as_expert):
    """The 35B-A3B's MoE output (H 2048, 8 routed experts; its shared expert as a ninth choice, or
    apart with its gate), bf16: the same bits as the combine kernel then the norm kernel, and a
    row's bits those of the row alone."""
    k = 9 if as_expert else 8
    y, w, s, gate, r, nw = combine_inputs(T, k, 2048, torch.bfloat16, "cuda", not as_expert, seed=T)
    out, h = norm.combine_add_rmsnorm(y, w, s, gate, r, nw, EPS)
    two, two_h = norm.add_rmsnorm(moe.combine(y, w, s, gate, torch.bfloat16), r, nw, EPS)
    assert torch.equal(h, two_h) and torch.equal(out, two)
    check(out, norm.combine_add_rmsnorm_ref(y, w, s, gate, r, nw, EPS)[0], 1e-2)
    last = T - 1
    one, one_h = norm.combine_add_rmsnorm(y[last * k:], w[last:], s[last:] if s is not None else None,
                                          gate[last:] if gate is not None else None, r[last:], nw, EPS)
    assert torch.equal(one, out[last:]) and torch.equal(one_h, h[last:])
