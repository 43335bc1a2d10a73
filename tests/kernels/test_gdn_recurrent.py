"""Gated DeltaNet recurrent step (gates and q/k l2norm fused, ring snapshots) against recurrent_ref:
outputs and every ring slot, for decode (T = 1), verify (T = k+1), GQA ratios 1-3, and rollback."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import gdn

SLOTS = 5


def _inputs(T, Hk, Hv, dk, dv, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    # q, k, v are views of one conv output row, a and b of a wider projection, as in the model
    mixed = randn(T, 2 * Hk * dk + Hv * dv, dtype=dtype, device=device, gen=g)
    q, k, v = mixed.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    ab = randn(T, 2 * Hv + 3, dtype=dtype, device=device, gen=g, scale=2.0)
    a, b = ab[:, :Hv], ab[:, Hv:2 * Hv]
    A_log = randn(Hv, dtype=dtype, device=device, gen=g, scale=0.5)
    dt_bias = randn(Hv, dtype=dtype, device=device, gen=g)
    ring = randn(SLOTS, Hv, dk, dv, device=device, gen=g, scale=0.2)
    return (q.view(T, Hk, dk), k.view(T, Hk, dk), v.view(T, Hv, dv), a, b, A_log, dt_bias), ring


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 5])
@pytest.mark.parametrize("Hk,Hv,dk,dv", [(2, 2, 32, 24), (2, 4, 16, 40), (1, 3, 32, 48)])
def test_recurrent(device, dtype, T, Hk, Hv, dk, dv):
    args, ring = _inputs(T, Hk, Hv, dk, dv, dtype, device, seed=T * 7 + Hv)
    slot = torch.tensor([3], device=device)
    ring_ref = ring.clone()
    o = gdn.recurrent_triton(*args, ring, slot)
    o_ref = gdn.recurrent_ref(*args, ring_ref, slot)
    check(o, o_ref, TOL[dtype])
    check(ring, ring_ref, TOL[torch.float32], "ring")     # the state is float32 whatever the inputs
    assert torch.equal(ring[T:], ring_ref[T:]), "slots past T must be untouched"


def test_recurrent_large_gates(device):
    # a + dt_bias past softplus' threshold (20) and far below it
    args, ring = _inputs(3, 1, 2, 16, 16, torch.float32, device, seed=1)
    q, k, v, a, b, A_log, dt_bias = args
    a = torch.tensor([[30.0, -30.0], [25.0, 0.5], [-5.0, 21.0]], device=device)
    slot = torch.tensor([0], device=device)
    ring_ref = ring.clone()
    o = gdn.recurrent_triton(q, k, v, a, b, A_log, dt_bias, ring, slot)
    check(o, gdn.recurrent_ref(q, k, v, a, b, A_log, dt_bias, ring_ref, slot), TOL[torch.float32])
    check(ring, ring_ref, TOL[torch.float32], "ring")


def test_recurrent_rollback(device):
    # verify 4 tokens from slot 0, accept 2 (commit slot 1), decode 2 more from there: the same as
    # the 2 kept tokens and the 2 new ones in one reference call
    args, ring = _inputs(6, 2, 4, 16, 24, torch.float32, device, seed=2)
    ring_ref = ring.clone()
    first = [t[:4] for t in args[:5]] + list(args[5:])
    gdn.recurrent_triton(*first, ring, torch.tensor([0], device=device))
    second = [t[4:] for t in args[:5]] + list(args[5:])
    o = gdn.recurrent_triton(*second, ring, torch.tensor([1], device=device))
    kept = [torch.cat([t[:2], t[4:]]) for t in args[:5]] + list(args[5:])
    o_ref = gdn.recurrent_ref(*kept, ring_ref, torch.tensor([0], device=device))
    check(o, o_ref[2:], TOL[torch.float32])
    check(ring[:2], ring_ref[2:4], TOL[torch.float32], "ring")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 5])
def test_recurrent_27b_shapes(T):
    args, ring = _inputs(T, 16, 48, 128, 128, torch.bfloat16, "cuda", seed=T)
    slot = torch.tensor([T - 1], device="cuda")
    ring_ref = ring.clone()
    check(gdn.recurrent(*args, ring, slot), gdn.recurrent_ref(*args, ring_ref, slot), 1e-2)
    check(ring, ring_ref, 1e-5, "ring")


@pytest.mark.parametrize("live", [0, 3])
def test_recurrent_live_flag(device, live):
    # a step launched after its generation ended (live 0) leaves every slot as it was; any positive
    # value writes as without the flag; the outputs are computed either way
    args, ring = _inputs(3, 2, 4, 16, 24, torch.float32, device, seed=9)
    before, ring_ref = ring.clone(), ring.clone()
    slot, flag = torch.tensor([1], device=device), torch.tensor([live], device=device)
    o = gdn.recurrent_triton(*args, ring, slot, flag)
    o_ref = gdn.recurrent_ref(*args, ring_ref, slot, flag)
    check(o, o_ref, TOL[torch.float32])
    check(ring, ring_ref, TOL[torch.float32], "ring")
    if live:
        plain = before.clone()
        gdn.recurrent_ref(*args, plain, slot)
        assert not torch.equal(ring[:3], before[:3])
        check(ring, plain, TOL[torch.float32], "ring")
    else:
        assert torch.equal(ring, before), "an ended step must not write the ring"
