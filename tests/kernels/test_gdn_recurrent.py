"""Gated DeltaNet recurrent step (gates and q/k l2norm fused; the last step's accepted tokens
folded into the state first) against recurrent_ref: outputs, the state and the kept tokens, for
decode (T = 1), verify (T = k+1), GQA ratios 1-3, rollback, ended steps and the fold alone."""
from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import gdn

R = 5        # tokens a step may hold (k_max + 1)


def _inputs(T, Hk, Hv, dk, dv, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    # q, k, v are views of one conv output row, a and b of a wider projection, as in the model
    mixed = randn(T, 2 * Hk * dk + Hv * dv, dtype=dtype, device=device, gen=g)
    q, k, v = mixed.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    ab = randn(T, 2 * Hv + 3, dtype=dtype, device=device, gen=g, scale=2.0)
    a, b = ab[:, :Hv], ab[:, Hv:2 * Hv]
    A_log = randn(Hv, dtype=dtype, device=device, gen=g, scale=0.5)
    dt_bias = randn(Hv, dtype=dtype, device=device, gen=g)
    state = randn(Hv, dk, dv, device=device, gen=g, scale=0.2)
    # a previous step's tokens as it kept them: raw k, v, a and b per value head
    pend = randn(2, R, Hv, gdn.pending_width(dk, dv), device=device, gen=g)
    return (q.view(T, Hk, dk), k.view(T, Hk, dk), v.view(T, Hv, dv), a, b, A_log, dt_bias), state, pend


def _long(x, device):
    return torch.tensor([x], device=device)


def _both(args, state, pend, fold, parity, live=None):
    """The kernel and the reference on copies: (o, state, pend) of each."""
    got, want = (state.clone(), pend.clone()), (state.clone(), pend.clone())
    o = gdn.recurrent_triton(*args, *got, fold, parity, live)
    o_ref = gdn.recurrent_ref(*args, *want, fold, parity, live)
    return (o, *got), (o_ref, *want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,fold", [(1, 1), (2, 0), (5, 3)])
@pytest.mark.parametrize("Hk,Hv,dk,dv", [(2, 2, 32, 24), (2, 4, 16, 40), (1, 3, 32, 48)])
def test_recurrent(device, dtype, T, fold, Hk, Hv, dk, dv):
    args, state, pend = _inputs(T, Hk, Hv, dk, dv, dtype, device, seed=T * 7 + Hv)
    (o, s, p), (o_ref, s_ref, p_ref) = _both(args, state, pend, _long(fold, device), _long(1, device))
    check(o, o_ref, TOL[dtype])
    check(s, s_ref, TOL[torch.float32], "state")       # the state is float32 whatever the inputs
    if fold == 0:
        assert torch.equal(s, state), "with nothing to fold the state is not written"
    check(p[0, :T], p_ref[0, :T], TOL[torch.float32], "kept tokens")
    assert torch.equal(p[1], pend[1]), "the half being folded is only read"
    assert torch.equal(p[0, T:], pend[0, T:]), "rows past T are untouched"


def test_recurrent_large_gates(device):
    # a + dt_bias past softplus' threshold (20) and far below it
    args, state, pend = _inputs(3, 1, 2, 16, 16, torch.float32, device, seed=1)
    q, k, v, a, b, A_log, dt_bias = args
    a = torch.tensor([[30.0, -30.0], [25.0, 0.5], [-5.0, 21.0]], device=device)
    (o, s, p), (o_ref, s_ref, p_ref) = _both((q, k, v, a, b, A_log, dt_bias), state, pend,
                                             _long(0, device), _long(0, device))
    check(o, o_ref, TOL[torch.float32])
    check(p, p_ref, TOL[torch.float32], "kept tokens")


def _steps(args, state, pend, device, groups, accepted):
    """Run the kernel over token groups (start, end) one step each, accepting `accepted[i]` of
    group i as the engine commits them (a one-token step as fold 0: it wrote its token); returns
    each group's outputs and the committed state."""
    fold, parity, outs = _long(0, device), _long(0, device), []
    state, pend = state.clone(), pend.clone()
    for (start, end), n in zip(groups, accepted):
        group = [t[start:end] for t in args[:5]] + list(args[5:])
        outs.append(gdn.recurrent_triton(*group, state, pend, fold, parity))
        if end - start > 1:
            fold, parity = _long(n, device), 1 - parity
        else:
            fold = _long(0, device)
    gdn.fold_pending_triton(state, pend, fold, parity, *args[5:])
    return outs, state


def test_recurrent_rollback(device):
    # verify 4 tokens, accept 2, decode 2 more from there: the same as the 2 kept tokens and the 2
    # new ones in one reference call, and bit for bit the same state as one token a step
    args, state, pend = _inputs(6, 2, 4, 16, 24, torch.float32, device, seed=2)
    kept = [torch.cat([t[:2], t[4:]]) for t in args[:5]] + list(args[5:])
    outs, committed = _steps(args, state, pend, device, groups=[(0, 4), (4, 6)], accepted=[2, 2])
    ref_state, ref_pend = state.clone(), pend.clone()
    o_ref = gdn.recurrent_ref(*kept, ref_state, ref_pend, _long(0, device), _long(0, device))
    gdn.fold_pending_ref(ref_state, ref_pend, _long(4, device), _long(1, device), *args[5:])
    check(outs[1], o_ref[2:], TOL[torch.float32])
    check(committed, ref_state, TOL[torch.float32], "committed state")
    # one token a step over the kept tokens (decode: each writes the state after its token, none
    # is folded later): the same bits (what greedy MTP on == off rests on)
    one_outs, one_state = _steps(kept, state, pend, device, groups=[(i, i + 1) for i in range(4)], accepted=[1] * 4)
    assert torch.equal(one_state, committed)
    assert torch.equal(torch.cat(one_outs[2:]), outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 5])
def test_recurrent_27b_shapes(T):
    args, state, pend = _inputs(T, 16, 48, 128, 128, torch.bfloat16, "cuda", seed=T)
    (o, s, p), (o_ref, s_ref, p_ref) = _both(args, state, pend, _long(T - 1, "cuda"), _long(T % 2, "cuda"))
    check(o, o_ref, 1e-2)
    check(s, s_ref, 1e-5, "state")
    check(p, p_ref, 1e-5, "kept tokens")


def test_one_token_step_writes_its_token(device):
    # a decode step folds what is pending, runs its token and writes the state after it; it keeps
    # nothing, and the reference agrees
    args, state, pend = _inputs(1, 2, 4, 16, 24, torch.float32, device, seed=4)
    (o, s, p), (o_ref, s_ref, p_ref) = _both(args, state, pend, _long(2, device), _long(0, device))
    check(o, o_ref, TOL[torch.float32])
    check(s, s_ref, TOL[torch.float32], "state")
    assert torch.equal(p, pend) and torch.equal(p_ref, pend), "a one-token step keeps no rows"
    folded = state.clone()
    gdn.fold_pending_triton(folded, pend, _long(2, device), _long(0, device), *args[5:])
    assert not torch.equal(s, folded), "the state holds the step's own token too"


@pytest.mark.parametrize("live", [0, 3])
def test_recurrent_live_flag(device, live):
    # a step launched after its generation ended (live 0) writes neither the state nor its tokens;
    # any positive value writes as without the flag; the outputs are computed either way
    args, state, pend = _inputs(3, 2, 4, 16, 24, torch.float32, device, seed=9)
    fold, parity, flag = _long(2, device), _long(1, device), _long(live, device)
    (o, s, p), (o_ref, s_ref, p_ref) = _both(args, state, pend, fold, parity, flag)
    check(o, o_ref, TOL[torch.float32])
    check(s, s_ref, TOL[torch.float32], "state")
    check(p, p_ref, TOL[torch.float32], "kept tokens")
    if live:
        (_, s_plain, p_plain), _ = _both(args, state, pend, fold, parity)
        assert not torch.equal(s, state) and not torch.equal(p, pend)
        assert torch.equal(s, s_plain) and torch.equal(p, p_plain)
    else:
        assert torch.equal(s, state) and torch.equal(p, pend), "an ended step must not write"


@pytest.mark.parametrize("fold", [0, 1, 4])
def test_fold_pending(device, fold):
    # the fold alone (before a prefill) against the reference, and the very state a step folds to
    args, state, pend = _inputs(2, 2, 4, 16, 24, torch.float32, device, seed=fold)
    n, parity = _long(fold, device), _long(0, device)
    got, want = state.clone(), state.clone()
    gdn.fold_pending_triton(got, pend, n, parity, *args[5:])
    gdn.fold_pending_ref(want, pend, n, parity, *args[5:])
    check(got, want, TOL[torch.float32], "state")
    stepped, p = state.clone(), pend.clone()
    gdn.recurrent_triton(*args, stepped, p, n, parity)
    assert torch.equal(got, stepped if fold else state)


def _layers(L, Hv, dk, dv, device, seed, pad=0, align=16):
    """L layers' states, kept tokens and gate parameters, each a tensor with a layer a row: the
    rows of the first two `pad` floats longer than their values, then rounded up to `align`
    floats (as engine/state.py lays them out)."""
    g = torch.Generator().manual_seed(seed)
    W = gdn.pending_width(dk, dv)
    width = lambda n: -(-(n + pad) // align) * align
    rows = lambda *shape, scale=1.0: randn(L, width(math.prod(shape)), device=device, gen=g, scale=scale)[
        :, :math.prod(shape)].view(L, *shape)
    states, pends = rows(Hv, dk, dv, scale=0.2), rows(2, R, Hv, W)
    A_logs, dt_biases = randn(L, Hv, device=device, gen=g, scale=0.5), randn(L, Hv, device=device, gen=g)
    return states, pends, A_logs, dt_biases


@pytest.mark.parametrize("fold,parity,pad,layers,any_stride", [(0, 0, 0, 1, True), (1, 1, 0, 2, True),
                                                                (3, 0, 48, 3, True), (5, 1, 7, 2, True),
                                                                (4, 0, 0, 5, False), (2, 1, 7, 1, False)])
def test_fold_pending_layers(device, fold, parity, pad, layers, any_stride):
    # every layer's fold in one launch: each layer's state the very bits its own launch gives
    # (fold_pending_triton, the kernel the steps fold with), near the reference, the kept tokens
    # only read; at odd sizes (3 value heads, 40 value columns: a partial column block), the
    # layers' rows padded apart or not
    states, pends, A_logs, dt_biases = _layers(3, 3, 16, 40, device, seed=fold + 10 * parity, pad=pad)
    kept = pends.clone()
    n, par = _long(fold, device), _long(parity, device)
    got, want = states.clone(), states.clone()
    if pad:                                   # (clone() packs the rows: padded again, as given)
        got = _layers(3, 3, 16, 40, device, seed=0, pad=pad)[0].copy_(states)
    gdn.fold_pending_layers_triton(got, pends, n, par, A_logs, dt_biases, any_stride, layers)
    gdn.fold_pending_layers_ref(want, pends, n, par, A_logs, dt_biases)
    check(got, want, TOL[torch.float32], "states")
    assert torch.equal(pends, kept), "the kept tokens are only read"
    for i in range(3):
        own = states[i].clone()
        gdn.fold_pending_triton(own, pends[i], n, par, A_logs[i], dt_biases[i], any_stride)
        assert torch.equal(got[i], own), f"layer {i}"
        assert fold == 0 or not torch.equal(own, states[i]), f"layer {i} folded nothing"
    if fold == 0:
        assert torch.equal(got, states)
    again = states.clone()
    gdn.fold_pending_layers(again, pends, n, par, A_logs, dt_biases, any_stride, layers)    # the dispatcher
    assert torch.equal(again, got if device == "cuda" else want)


def test_fold_pending_layers_refuses_unaligned_rows(device):
    # rows 7 floats apart would compile the fold for other alignments than a layer's own launch
    states, pends, A_logs, dt_biases = _layers(2, 3, 16, 40, device, seed=1, pad=7, align=1)
    with pytest.raises(AssertionError, match="aligned"):
        gdn.fold_pending_layers_triton(states, pends, _long(1, device), _long(0, device), A_logs, dt_biases)


@pytest.mark.gpu
def test_fold_pending_layers_is_a_steps_fold_27b():
    # the 27B's 48 GDN layers folded in one launch: each layer's state the bits of its own step's
    # fold (a verify with the step's launch options, in the any-stride form the engine takes)
    states, pends, A_logs, dt_biases = _layers(48, 48, 128, 128, "cuda", seed=6)
    n, parity = _long(4, "cuda"), _long(1, "cuda")
    folded = states.clone()
    gdn.fold_pending_layers(folded, pends, n, parity, A_logs, dt_biases, any_stride=True, layers=6)
    args = _inputs(2, 16, 48, 128, 128, torch.bfloat16, "cuda", seed=7)[0]
    for i in (0, 17, 47):
        stepped, p = states[i].clone(), pends[i].clone()
        gdn.recurrent(*args[:5], A_logs[i], dt_biases[i], stepped, p, n, parity, _long(1, "cuda"), any_stride=True)
        assert torch.equal(folded[i], stepped), f"layer {i}"


@pytest.mark.gpu
def test_prefill_fold_is_a_steps_fold_27b():
    # what a new turn's prefill folds in (fold_pending) must be, to the bit, the state a live step's
    # own fold writes (with the step's launch options: the live flag, the GQA ratio); otherwise
    # MTP on and off could part at the next turn
    args, state, pend = _inputs(2, 16, 48, 128, 128, torch.bfloat16, "cuda", seed=5)
    n, parity = _long(3, "cuda"), _long(1, "cuda")
    folded = state.clone()
    gdn.fold_pending(folded, pend, n, parity, *args[5:])
    stepped, p = state.clone(), pend.clone()
    gdn.recurrent(*args, stepped, p, n, parity, _long(1, "cuda"))   # a verify writes the state when folded
    assert torch.equal(folded, stepped)


@pytest.mark.parametrize("N", [776, 784])
@pytest.mark.parametrize("any_stride", [True, False])
def test_decodes_are_a_verify_over_the_products_rows(device, N, any_stride):
    # q | k | v as views of the in_proj's rows [T, N] (KernelPlan.conv_in_product; the tiny MoE
    # model's shapes, N = 776 no multiple of 16, 784 one): T one-token steps give the outputs and
    # the state of one T-token step and the fold of its kept tokens, bit for bit, in the kernel's
    # any_stride form (the plan's with the product's conv). On the GPU the stride-specialised form
    # is held to it only where N is a multiple of 16: its one-row views' strides (the heads' width)
    # then compile as the longer steps' do (tests/kernels/test_gdn_step_forms.py)
    if device == "cuda" and not any_stride and N % 16:
        pytest.skip("two compiled forms of the default kernel over these views: why any_stride exists")
    Hk, Hv, dk, dv, T = 2, 4, 64, 64, 4
    C, V = 2 * Hk * dk + Hv * dv, Hv * dv
    g = torch.Generator().manual_seed(N)
    y = randn(T, N, dtype=torch.bfloat16, device=device, gen=g)

    def heads(rows):
        n = rows.shape[0]
        q, k, v = rows[:, :C].split([Hk * dk, Hk * dk, V], -1)
        return (q.view(n, -1, dk), k.view(n, -1, dk), v.view(n, Hv, dv), rows[:, C + V + Hv:C + V + 2 * Hv],
                rows[:, C + V:C + V + Hv])
    A_log = randn(Hv, device=device, gen=g, scale=0.5)
    dt_bias = randn(Hv, device=device, gen=g, scale=0.5)
    start = randn(Hv, dk, dv, device=device, gen=g, scale=0.1)
    one_by_one, stepped = start.clone(), start.clone()
    pend = torch.zeros(2, R, Hv, gdn.pending_width(dk, dv), device=device)
    outs = [gdn.recurrent_triton(*heads(y[t:t + 1]), A_log, dt_bias, one_by_one, pend.clone(), _long(0, device),
                                 _long(0, device), any_stride=any_stride) for t in range(T)]
    verified = gdn.recurrent_triton(*heads(y), A_log, dt_bias, stepped, pend, _long(0, device), _long(0, device),
                                    any_stride=any_stride)          # its tokens kept in pend's half 1
    gdn.fold_pending_triton(stepped, pend, _long(T, device), _long(1, device), A_log, dt_bias, any_stride)
    assert torch.equal(torch.cat(outs), verified), "outputs"
    assert torch.equal(one_by_one, stepped), "state"
