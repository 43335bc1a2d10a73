"""Chunked Gated DeltaNet prefill against chunk_ref (outputs and final state), and against the
recurrence, at lengths below, at and across the 64-token chunk."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import INTERPRETED, TOL, check, randn

from mtpchat.kernels import gdn, gdn_chunk

# the GPU kernels multiply in tf32 (10-bit mantissa), as fla does in bf16
STATE_TOL = TOL[torch.float32] if not torch.cuda.is_available() else 5e-3


def _inputs(T, Hk, Hv, dk, dv, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    mixed = randn(T, 2 * Hk * dk + Hv * dv, dtype=dtype, device=device, gen=g)
    q, k, v = mixed.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    ab = randn(T, 2 * Hv + 5, dtype=dtype, device=device, gen=g, scale=2.0)
    A_log = randn(Hv, dtype=dtype, device=device, gen=g, scale=0.5)
    dt_bias = randn(Hv, dtype=dtype, device=device, gen=g)
    state = randn(Hv, dk, dv, device=device, gen=g, scale=0.2)
    return (q.view(T, Hk, dk), k.view(T, Hk, dk), v.view(T, Hv, dv), ab[:, :Hv], ab[:, Hv:2 * Hv], A_log, dt_bias), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 63, 64, 130])
@pytest.mark.parametrize("Hk,Hv,dk,dv", [(2, 2, 32, 24), (1, 3, 16, 40)])
# the output by its own kernel or by the scan
@pytest.mark.parametrize("form", ["three", "fused"])
def test_chunk(device, dtype, T, Hk, Hv, dk, dv, form):
    args, state = _inputs(T, Hk, Hv, dk, dv, dtype, device, seed=T + Hv)
    state_in = state.clone()
    config = {"fused_out": form == "fused"}
    o, s = gdn_chunk.chunk_triton(*args, state, config=config)
    o_ref, s_ref = gdn_chunk.chunk_ref(*args, state)
    assert torch.equal(state, state_in), "the start state is an input"
    check(o, o_ref, max(TOL[dtype], STATE_TOL))
    check(s, s_ref, STATE_TOL, "final state")


def test_fused_output_is_the_three_kernels_output(device):
    # the same sums in the same order: the final state bit for bit; the output too under the
    # interpreter (on a GPU the scan's products run on other warps than the output kernel's)
    args, state = _inputs(130, 2, 4, 32, 24, torch.bfloat16, device, seed=4)
    o, s = gdn_chunk.chunk_triton(*args, state)
    o_fused, s_fused = gdn_chunk.chunk_triton(*args, state, config={"fused_out": True})
    assert torch.equal(s_fused, s), "final state"
    if INTERPRETED:
        assert torch.equal(o_fused, o), "output"
    check(o_fused, o, 1e-2)


@pytest.mark.parametrize("fused", [False, True])
def test_chunk_end_state_over_the_start_state(device, fused):
    # the engine's prefill hands the start state as `out`: the same end state and output in place
    args, state = _inputs(130, 2, 4, 32, 24, torch.float32, device, seed=5)
    config = {"fused_out": fused}
    o, s = gdn_chunk.chunk_triton(*args, state, config=config)
    o2, s2 = gdn_chunk.chunk_triton(*args, state, config=config, out=state)
    assert s2 is state and torch.equal(state, s) and torch.equal(o2, o)


@pytest.mark.parametrize("solved,terms", [("float32", "bfloat16"), ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("fused", [False, True])
def test_chunk_with_bf16_between_the_kernels(device, solved, terms, fused):
    # what the kernels hand each other rounded to bf16 (as fla keeps it): the output's terms alone
    # (terms) leave the final state as it was, bit for bit; w and u (solved) move it by about bf16's rounding
    args, state = _inputs(130, 2, 4, 32, 24, torch.bfloat16, device, seed=6)
    o_ref, s_ref = gdn_chunk.chunk_ref(*args, state)
    o32, s32 = gdn_chunk.chunk_triton(*args, state, config={"fused_out": fused})
    o, s = gdn_chunk.chunk_triton(*args, state, config={"fused_out": fused, "solved": solved, "terms": terms})
    assert not torch.equal(o, o32), "the output's terms were rounded"
    check(o, o_ref, 2e-2)
    if solved == "float32":
        assert torch.equal(s, s32), "final state"
    else:
        check(s, s_ref, 2e-2, "final state")


@pytest.mark.parametrize("fused", [False, True])
def test_chunk_with_unit_rows_from_the_prep(device, fused):
    # q and k normalised once by the prep (float32 between the kernels): the same arithmetic as each
    # kernel normalising them itself (bit for bit under the interpreter; compiled, each kernel's
    # layout sums a row in its own order)
    args, state = _inputs(130, 2, 6, 32, 24, torch.bfloat16, device, seed=8)
    o, s = gdn_chunk.chunk_triton(*args, state, config={"fused_out": fused})
    o2, s2 = gdn_chunk.chunk_triton(*args, state, config={"fused_out": fused, "normed": True})
    if INTERPRETED:
        assert torch.equal(o2, o) and torch.equal(s2, s)
    check(o2, o, 1e-2)
    check(s2, s, 1e-4, "final state")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bv", [64, 16])
def test_chunk_with_bf16_products(device, fused, bv):
    # the scan's and the output's products on bf16 operands (as fla's), everything between the
    # kernels bf16 too: within bf16's reach of the float32 reference, and apart from the tf32 form
    args, state = _inputs(130, 2, 6, 32, 40, torch.bfloat16, device, seed=9)
    o_ref, s_ref = gdn_chunk.chunk_ref(*args, state)
    config = dict(fused_out=fused, normed=True, solved="bfloat16", terms="bfloat16", scan_bv=bv)
    o_tf32, s_tf32 = gdn_chunk.chunk_triton(*args, state, config=config)
    o, s = gdn_chunk.chunk_triton(*args, state, config=dict(config, state_dot="bf16"))
    assert not torch.equal(s, s_tf32), "the state's products took bf16 operands"
    check(o, o_ref, 3e-2)
    check(s, s_ref, 2e-2, "final state")


def test_float32_inputs_keep_float32_between_the_kernels(device):
    args, state = _inputs(70, 1, 2, 16, 24, torch.float32, device, seed=7)
    o, s = gdn_chunk.chunk_triton(*args, state)
    o2, s2 = gdn_chunk.chunk_triton(*args, state, config={"solved": "bfloat16", "terms": "bfloat16",
                                                          "state_dot": "bf16", "dot": "bf16"})
    assert torch.equal(o2, o) and torch.equal(s2, s)


def test_chunk_passes_the_plans_forms(monkeypatch):
    # chunk() hands chunk_triton every form it is given (the engine's plan: engine/model.py)
    seen = {}
    monkeypatch.setattr(gdn_chunk, "use_triton", lambda *t: True)
    monkeypatch.setattr(gdn_chunk, "chunk_triton", lambda *args: seen.update(args[9]) or ("o", "s"))
    args, state = _inputs(5, 1, 2, 16, 16, torch.float32, "cpu", seed=12)
    gdn_chunk.chunk(*args, state, fused_out=True, solved="bfloat16", terms="bfloat16", products="bf16",
                    normed=True, prep_products="bf16")
    assert seen == dict(fused_out=True, solved="bfloat16", terms="bfloat16", normed=True, state_dot="bf16",
                        dot="bf16")
    with pytest.raises(AssertionError, match="prep_products"):
        gdn_chunk.chunk(*args, state, prep_products="fp8")


def test_a_float32_model_takes_the_reference_where_shared_memory_is_short(monkeypatch):
    # its kernels' tiles need ROOMY bytes a block (an RTX 4090 gives 99 KB): there chunk() runs chunk_ref
    monkeypatch.setattr(gdn_chunk, "use_triton", lambda *t: True)
    monkeypatch.setattr(gdn_chunk, "roomy", lambda device: False)
    monkeypatch.setattr(gdn_chunk, "chunk_triton", lambda *args: pytest.fail("the kernels ran"))
    args, state = _inputs(70, 1, 2, 16, 24, torch.float32, "cpu", seed=13)
    o, s = gdn_chunk.chunk(*args, state)
    o_ref, s_ref = gdn_chunk.chunk_ref(*args, state)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_chunk_config_tiles():
    # the plan's bf16 forms on BF16_TILES; tf32 ones on CHUNK_CONFIG's, or SMALL_TILES where shared
    # memory is short; a float32 model's on WIDE_TILES in float32 and tf32x3 whatever is asked; a
    # tile `config` names wins
    low = gdn_chunk.plan_config(True, "bfloat16", "bfloat16", "bf16", True, "bf16")
    assert gdn_chunk.chunk_config(low, False, False)["scan_bv"] == gdn_chunk.BF16_TILES["scan_bv"]
    assert gdn_chunk.chunk_config({}, False, True)["scan_bv"] == gdn_chunk.CHUNK_CONFIG["scan_bv"]
    assert gdn_chunk.chunk_config({}, False, False)["out_bv"] == gdn_chunk.SMALL_TILES["out_bv"]
    wide = gdn_chunk.chunk_config(low, True, True)
    assert (wide["solved"], wide["terms"], wide["dot"], wide["state_dot"]) == ("float32", "float32", "tf32x3", "tf32x3")
    assert wide["scan_bv"] == gdn_chunk.WIDE_TILES["scan_bv"]
    assert gdn_chunk.chunk_config(dict(low, scan_bv=64), False, False)["scan_bv"] == 64


@pytest.mark.parametrize("fused", [False, True])
def test_prep_with_bf16_products(device, fused):
    # the prep's products of keys and queries on bf16 operands too (the plan's form, fla's way
    # throughout): within bf16's reach of the float32 reference, and apart from its tf32 prep
    args, state = _inputs(130, 2, 6, 32, 40, torch.bfloat16, device, seed=10)
    o_ref, s_ref = gdn_chunk.chunk_ref(*args, state)
    config = dict(fused_out=fused, normed=True, state_dot="bf16", solved="bfloat16", terms="bfloat16")
    o_tf32, s_tf32 = gdn_chunk.chunk_triton(*args, state, config=config)
    o, s = gdn_chunk.chunk_triton(*args, state, config=dict(config, dot="bf16"))
    assert not torch.equal(s, s_tf32), "the prep's products took bf16 operands"
    check(o, o_ref, 3e-2)
    check(s, s_ref, 2e-2, "final state")


def test_chunk_matches_the_recurrence(device):
    args, state = _inputs(100, 2, 4, 16, 24, torch.float32, device, seed=3)
    o, s = gdn_chunk.chunk_triton(*args, state)
    Hv, dk, dv = state.shape
    rec, pend = state.clone(), torch.zeros(2, 100, Hv, gdn.pending_width(dk, dv), device=device)
    zero = torch.tensor([0], device=device)
    o_rec = gdn.recurrent_ref(*args, rec, pend, zero, zero)
    gdn.fold_pending_ref(rec, pend, torch.tensor([100], device=device), 1 - zero, *args[5:])
    check(o, o_rec, STATE_TOL)
    check(s, rec, STATE_TOL, "final state")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1000, 8192])
def test_chunk_27b_shapes(T):
    args, state = _inputs(T, 16, 48, 128, 128, torch.bfloat16, "cuda", seed=T)
    o_ref, s_ref = gdn_chunk.chunk_ref(*args, state)
    for fused in (False, True):
        o, s = gdn_chunk.chunk(*args, state, fused_out=fused)
        check(o, o_ref, 1e-2)
        check(s, s_ref, STATE_TOL, "final state")
    # the plan's candidates: fused, w|u and the output's terms in bf16, bf16 products, unit rows once
    for fused in (False, True):
        o, s = gdn_chunk.chunk(*args, state, fused_out=fused, solved="bfloat16", terms="bfloat16")
        check(o, o_ref, 2e-2)
        check(s, s_ref, 2e-2, "final state")
        for prep_products in ("tf32", "bf16"):
            o, s = gdn_chunk.chunk(*args, state, fused_out=fused, solved="bfloat16", terms="bfloat16",
                                   products="bf16", normed=True, prep_products=prep_products)
            check(o, o_ref, 2e-2)
            check(s, s_ref, 2e-2, "final state")
