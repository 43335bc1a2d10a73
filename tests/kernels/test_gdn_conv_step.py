"""The GDN step with its causal conv inside the recurrence kernel (gdn.conv_recurrent) against its
float32 reference (conv.py's reference, then the recurrence's): outputs, the state, the kept tokens
and the conv's window buffer, for decode and verify, folds, a window wrapped around its ring, GQA
ratios 1-3 and ended steps; on the GPU, bit for bit the two kernels it replaces."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import conv, gdn

R = 5            # tokens a step may hold (k_max + 1)
KC = 4           # the conv's taps
WIDTH = KC - 1 + R


def _inputs(T, Hk, Hv, dk, dv, dtype, device, seed, width=WIDTH):
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * dk + Hv * dv
    # the step's q | k | v before the conv, a view of a wider projection row (z and b | a after it)
    proj = randn(T, C + 9, dtype=dtype, device=device, gen=g)
    x = proj[:, :C]
    ab = randn(T, 2 * Hv + 3, dtype=dtype, device=device, gen=g, scale=2.0)
    a, b = ab[:, :Hv], ab[:, Hv:2 * Hv]
    weights = (randn(C, KC, dtype=dtype, device=device, gen=g, scale=0.5),
               randn(Hv, dtype=dtype, device=device, gen=g, scale=0.5), randn(Hv, dtype=dtype, device=device, gen=g))
    buf = randn(C, width, dtype=dtype, device=device, gen=g)
    state = randn(Hv, dk, dv, device=device, gen=g, scale=0.2)
    pend = randn(2, R, Hv, gdn.pending_width(dk, dv), device=device, gen=g)
    return x, a, b, weights, (buf, state, pend)


def _long(x, device):
    return torch.tensor([x], device=device)


def _run(fn, x, a, b, weights, kept, off, fold, parity, live, Hk):
    """fn on copies of the buffers: (o, buf, state, pend)."""
    buf, state, pend = (t.clone() for t in kept)
    cw, A_log, dt_bias = weights
    o = fn(x, buf, off, cw, a, b, A_log, dt_bias, state, pend, fold, parity, live, Hk)
    return o, buf, state, pend


def _compare(got, want, dtype):
    o, buf, state, pend = got
    o_ref, buf_ref, state_ref, pend_ref = want
    check(o, o_ref, TOL[dtype])
    assert torch.equal(buf, buf_ref), "the conv's window buffer"
    # the state and the kept k and v follow the conv's output, rounded to the model dtype
    check(state, state_ref, TOL[dtype], "state")
    check(pend, pend_ref, TOL[dtype], "kept tokens")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,fold", [(1, 2), (2, 0), (5, 3)])
@pytest.mark.parametrize("Hk,Hv,dk,dv", [(2, 2, 32, 24), (2, 4, 16, 40), (1, 3, 32, 48)])
def test_conv_recurrent(device, dtype, T, fold, Hk, Hv, dk, dv):
    x, a, b, weights, kept = _inputs(T, Hk, Hv, dk, dv, dtype, device, seed=T * 11 + Hv + fold)
    args = (x, a, b, weights, kept, _long(2 ** 40 + 5, device), _long(fold, device), _long(1, device), None, Hk)
    got, want = _run(gdn.conv_recurrent_triton, *args), _run(gdn.conv_recurrent_ref, *args)
    _compare(got, want, dtype)
    assert not torch.equal(got[1], kept[0]), "the step's inputs went into the window"
    assert torch.equal(got[3][1], kept[2][1]), "the half being folded is only read"


@pytest.mark.parametrize("off", [0, 3, 6, 7])
def test_conv_recurrent_around_the_ring(device, off):
    # the committed window at every place in the ring, a width that is not a power of two, k_max 3
    x, a, b, weights, kept = _inputs(4, 1, 2, 16, 24, torch.float32, device, seed=off, width=WIDTH - 1)
    args = (x, a, b, weights, kept, _long(off, device), _long(1, device), _long(0, device), None, 1)
    _compare(_run(gdn.conv_recurrent_triton, *args), _run(gdn.conv_recurrent_ref, *args), torch.float32)


def test_conv_recurrent_refuses_a_step_over_the_window(device):
    x, a, b, weights, kept = _inputs(6, 1, 2, 16, 24, torch.float32, device, seed=3, width=WIDTH - 1)
    args = (x, a, b, weights, kept, _long(0, device), _long(0, device), _long(0, device), None, 1)
    with pytest.raises(AssertionError, match="would write the window it reads"):
        _run(gdn.conv_recurrent_triton, *args)


@pytest.mark.parametrize("live", [0, 1])
def test_conv_recurrent_live_flag(device, live):
    # an ended step (live 0) writes neither the window, the state nor its tokens
    x, a, b, weights, kept = _inputs(3, 2, 4, 16, 24, torch.float32, device, seed=8)
    args = (x, a, b, weights, kept, _long(9, device), _long(2, device), _long(0, device), _long(live, device), 2)
    got = _run(gdn.conv_recurrent_triton, *args)
    _compare(got, _run(gdn.conv_recurrent_ref, *args), torch.float32)
    unchanged = [torch.equal(g, k) for g, k in zip(got[1:], kept)]
    assert unchanged == ([True] * 3 if live == 0 else [False] * 3)


def _two_kernels(x, buf, off, cw, a, b, A_log, dt_bias, state, pend, fold, parity, live, Hk):
    """The conv kernel, then the recurrence kernel on its output (the path the conv form replaces)."""
    T, (Hv, dk, dv) = x.shape[0], state.shape
    y = conv.conv_update_triton(x, buf, off, cw, live)
    q, k, v = y.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    return gdn.recurrent_triton(q.view(T, Hk, dk), k.view(T, Hk, dk), v.view(T, Hv, dv), a, b, A_log, dt_bias,
                                state, pend, fold, parity, live)


def _differ(got, want, names=("output", "window", "state", "kept tokens")) -> str:
    return "; ".join(f"{what}: {(g != w).sum().item()} of {g.numel()} values, by "
                     f"{(g.float() - w.float()).abs().max().item():.2e}"
                     for g, w, what in zip(got, want, names) if not torch.equal(g, w))


@pytest.mark.gpu
@pytest.mark.parametrize("T,fold", [(1, 0), (1, 3), (2, 1), (4, 2), (5, 5)])
def test_conv_recurrent_is_the_two_kernels_27b(T, fold):
    # the 27B's GDN shapes: a step with the conv inside gives the same bits as the conv kernel then
    # the recurrence kernel, outputs, window, state and kept tokens, whatever it folds: what greedy
    # MTP on == off and the plans' equality rest on (a fold before a prefill or a snapshot runs the
    # plain kernel)
    x, a, b, weights, kept = _inputs(T, 16, 48, 128, 128, torch.bfloat16, "cuda", seed=T + fold)
    args = (x, a, b, weights, kept, _long(1234, "cuda"), _long(fold, "cuda"), _long(fold % 2, "cuda"),
            _long(1, "cuda"), 16)
    differ = _differ(_run(gdn.conv_recurrent_triton, *args), _run(_two_kernels, *args))
    assert not differ, differ


@pytest.mark.gpu
def test_a_fold_is_the_conv_forms_fold_27b():
    # a fold before a prefill or a snapshot (the plain kernel, no tokens) writes the state that a
    # verify with the conv inside writes after its fold, to the bit
    x, a, b, (cw, A_log, dt_bias), (buf, state, pend) = _inputs(2, 16, 48, 128, 128, torch.bfloat16, "cuda", seed=7)
    n, parity = _long(3, "cuda"), _long(1, "cuda")
    folded = state.clone()
    gdn.fold_pending_triton(folded, pend, n, parity, A_log, dt_bias)
    stepped = state.clone()
    gdn.conv_recurrent_triton(x, buf.clone(), _long(9, "cuda"), cw, a, b, A_log, dt_bias, stepped, pend.clone(), n,
                              parity, _long(1, "cuda"), 16)
    assert torch.equal(folded, stepped)
