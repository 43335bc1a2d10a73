"""The MoE expert products over 4-bit experts (kernels/moe.py with kernels/int4.py) against their
float32 references: stacked experts with and without a per-expert perm, symmetric and with zeros,
the shared expert among the routed ones (its own GroupInt4), step and prefill layouts, and a row's
result the same whatever rows share its experts; the 35B-A3B's shapes (GPU)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_checks import TOL, check, int4_weight, randn

from mtpchat.kernels import int4, matvec, moe, moe_layout, moe_routing
from mtpchat.kernels.plan import ProductPlan

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def cpu(w: int4.GroupInt4) -> int4.GroupInt4:
    return int4.GroupInt4(*(t.cpu() if t is not None else None for t in w))


def experts(E, F, H, device, seed, group=32, symmetric=True, perm=False):
    """Stacked 4-bit gate|up [E * 2F, H] and down [E * H, F]."""
    return (int4_weight(E * 2 * F, H, device, seed, group, symmetric, perm, experts=E),
            int4_weight(E * H, F, device, seed + 1, group, symmetric, perm, experts=E))


def layouts(ids, E, step, device):
    lay_cpu = moe_layout.layout_ref(ids, E, moe_layout.STEP_ROWS if step else 2, min(E, ids.numel()) if step else None)
    return lay_cpu, moe_layout.Layout(lay_cpu.expert.to(device), lay_cpu.pairs.to(device))


def routed(T, E, k, seed):
    return torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(seed + r))[:k]
                        for r in range(T)]).to(torch.int32)


def blocks(ids, E, shared, step, device):
    """(layout on the CPU, on the device) of routed ids, the shared expert E appended as every row's
    last choice where `shared`, in blocks of a step's STEP_ROWS or of 2 pairs (a prefill's kernel)."""
    if shared:
        ids = torch.cat([ids, torch.full((ids.shape[0], 1), E, dtype=torch.int32)], 1)
    lay_cpu = moe_layout.layout_ref(ids, E + shared, moe_layout.STEP_ROWS if step else 2)
    return lay_cpu, moe_layout.Layout(lay_cpu.expert.to(device), lay_cpu.pairs.to(device))


def products_match(x, wgu, wd, sgu, sd, lay_cpu, lay, kk, E, plan=None, form=lambda w: w, tol=TOL[torch.float32]):
    """The experts' SwiGLU and down products (the shared expert's weights sgu, sd or None) over the
    weights as `form` stores them, against the float32 references of the weights as given."""
    h = moe.expert_swiglu_triton(x, form(wgu), lay, kk, E, shared=sgu and form(sgu), plan=plan)
    h_ref = moe.expert_swiglu_ref(x.cpu(), cpu(wgu), lay_cpu, kk, E, shared=sgu and cpu(sgu))
    check(h.cpu(), h_ref, tol, "swiglu")
    y = moe.expert_down_triton(h_ref.to(x.device), form(wd), lay, E, shared=sd and form(sd), plan=plan)
    check(y.cpu(), moe.expert_down_ref(h_ref, cpu(wd), lay_cpu, E, shared=sd and cpu(sd)), tol, "down")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,step,group,symmetric,perm,F", [
    (1, True, 32, True, False, 96), (3, True, 128, False, True, 128), (5, False, 32, False, True, 96),
    (4, True, 64, True, True, 192)])
def test_int4_expert_products(device, dtype, T, step, group, symmetric, perm, F):
    E, k, H = 5, 2, 384                 # F 96: not a multiple of the 64-row tile; H 384: 1.5 K tiles
    wgu, wd = experts(E, F, H, device, T, group, symmetric, perm)
    x = randn(T, H, dtype=dtype, device=device, seed=T)
    lay_cpu, lay = layouts(routed(T, E, k, 7 * T), E, step, device)
    h_ref = moe.expert_swiglu_ref(x.cpu().float(), cpu(wgu), lay_cpu, k, E)
    check(moe.expert_swiglu(x, wgu, lay, k, E, rowwise=step).cpu().float(), h_ref, TOL[dtype], "int4 swiglu")
    y_ref = moe.expert_down_ref(h_ref.to(dtype).float(), cpu(wd), lay_cpu, E)
    y = moe.expert_down(h_ref.to(device, dtype), wd, lay, E, rowwise=step)
    check(y.cpu(), y_ref, TOL[dtype], "int4 down")


@pytest.mark.parametrize("interleaved", [False, True])
def test_int4_experts_fold_the_layer_over_a_normed(device, interleaved):
    """A step's MoE layer over 4-bit experts reading a Normed and finished in its down kernel
    (KernelPlan.moe_normed, moe_fold): the SwiGLU as over the rows normalised whole, the layer's h
    the combine of the down's products plus the residual."""
    T, E, k, F, H = 3, 6, 2, 128, 256
    wgu, wd = experts(E, F, H, device, 17, 64)
    form = int4.interleave_ref if interleaved else (lambda w: w)
    h = randn(T, H, device=device, seed=18) * torch.tensor([0.2, 1., 5.], device=device)[:, None]
    nw = randn(H, device=device, seed=19, scale=0.3)
    ss = torch.stack([c.square().sum(-1) for c in h.split(64, dim=1)], 1)
    normed = matvec.Normed(h * (1. + nw), ss, 1e-6)
    logits = randn(T, E, seed=20, scale=2.0).to(device)
    ids, w, _, lay = moe_routing.route_step(logits, k, E, layout=True)
    lay_cpu = moe_layout.layout_ref(ids.cpu(), E, moe_layout.STEP_ROWS)
    got = moe.expert_swiglu_triton(normed, form(wgu), lay, k, E)
    rows = normed.x * matvec.rstd_ref(normed)[:, None]
    check(got.cpu(), moe.expert_swiglu_ref(rows.cpu(), cpu(wgu), lay_cpu, k, E), TOL[torch.float32], "swiglu")
    r = randn(T, H, device=device, seed=21)
    fold = moe.Fold(w, randn(T, H, device=device, seed=22), torch.sigmoid(randn(T, seed=23)).to(device), r, nw, 1e-6)
    n_out, h_out = moe.expert_down_triton(got, form(wd), lay, E, fold=fold)
    y = moe.expert_down_triton(got, form(wd), lay, E)
    want = moe.combine_triton(y, w, fold.shared, fold.gate, torch.float32) + r
    assert torch.equal(h_out, want) and torch.equal(n_out.x, h_out * (1. + nw))
    check(n_out.ss.sum(-1).cpu(), want.square().sum(-1).cpu(), 1e-5, "sums of h²")


@pytest.mark.parametrize("shared_perm,experts_perm,group,interleaved", [
    (True, True, 32, False), (False, True, 32, False), (True, False, 32, False), (False, False, 64, True),
    (False, False, 128, True)])
def test_int4_shared_expert_as_expert_e(device, shared_perm, experts_perm, group, interleaved):
    """The shared expert, a GroupInt4 of its own, as every row's last choice, in a step's own layout
    (route_step: its blocks found on the device, pairs past a block's end at -1): where only it or
    only the routed experts have a perm, the other reads x in order; or both interleaved
    (int4.interleave_ref), on the step's tiles."""
    T, E, k, H = 3, 6, 2, 128
    F = 3 * group if interleaved else 32
    wgu, wd = experts(E, F, H, device, 31, group, False, experts_perm)
    sgu = int4_weight(2 * F, H, device, 33, group, False, shared_perm)
    sd = int4_weight(H, F, device, 34, group, False, shared_perm)
    logits = randn(T, E + 1, seed=22, scale=2.0).to(device)
    x = randn(T, H, device=device, seed=23)
    ids, w, _, lay = moe_routing.route_step(logits, k, E, shared=True)
    ref_lay = moe_layout.layout_ref(ids.cpu(), E + 1, 16)
    products_match(x, wgu, wd, sgu, sd, ref_lay, lay, k + 1, E, form=int4.interleave_ref if interleaved else lambda w: w)


@pytest.mark.parametrize("step,shared", [(True, True), (False, False)])
def test_int4_experts_in_the_slices_form(device, step, shared):
    """Groups of 128: each group's dot as 8 over the words' nibbles (int4.form_args)."""
    T, E, k, F, H = 3, 5, 2, 128, 384
    wgu, wd = experts(E, F, H, device, 41, 128, False, True)
    sgu, sd = (int4_weight(2 * F, H, device, 43, 128, False, False), int4_weight(H, F, device, 44, 128, False, False)) \
        if shared else (None, None)
    x = randn(T, H, device=device, seed=45)
    products_match(x, wgu, wd, sgu, sd, *blocks(routed(T, E, k, 46), E, shared, step, device), k + shared, E,
                   plan=ProductPlan(programs=6, int4_form="slices"))


@pytest.mark.parametrize("step,shared,group", [(True, True, 128), (False, True, 64), (True, False, 64)])
def test_int4_interleaved_experts(device, step, shared, group):
    """Interleaved experts (int4.interleave_ref, no perm), the shared expert interleaved too, in
    layouts of blocks of STEP_ROWS and of 2 pairs (the prefill's kernel): against the references of
    the natural weights they came from; a shared expert of the other layout is refused."""
    T, E, k, H = 3, 5, 2, 384
    F = 3 * group                         # 1.5 or 3 tiles of 128 columns
    wgu, wd = experts(E, F, H, device, 51, group, False, False)
    sgu, sd = (int4_weight(2 * F, H, device, 53, group, False, False), int4_weight(H, F, device, 54, group, False, False)) \
        if shared else (None, None)
    x = randn(T, H, device=device, seed=55)
    lay_cpu, lay = blocks(routed(T, E, k, 56), E, shared, step, device)
    products_match(x, wgu, wd, sgu, sd, lay_cpu, lay, k + shared, E, form=int4.interleave_ref)
    if shared:
        with pytest.raises(AssertionError, match="layout"):
            moe.expert_swiglu_triton(x, int4.interleave_ref(wgu), lay, k + shared, E, shared=sgu)


@pytest.mark.parametrize("bm", [16, 32, 64])
def test_int4_prefill_blocks_of_each_size_on_their_tiles(device, bm):
    """A prefill's interleaved experts (the engine's form) over blocks of 16, 32 and 64 pairs
    (ProductPlan.prefill_block_rows), each on the tiles moe.tiles gives that size (64 x 256 / 64 x 128
    weights under 16, 128 x 128 from 32), the shared expert among them: against the references; H
    384 leaves part of the SwiGLU's last K tile empty."""
    T, E, k, F, H = 5, 4, 2, 256, 384
    wgu, wd = experts(E, F, H, device, 71, 128, False, False)
    sgu, sd = int4_weight(2 * F, H, device, 73, 128, False, False), int4_weight(H, F, device, 74, 128, False, False)
    ids = torch.cat([routed(T, E, k, 75), torch.full((T, 1), E, dtype=torch.int32)], 1)
    lay_cpu = moe_layout.layout_ref(ids, E + 1, bm)
    lay = moe_layout.Layout(lay_cpu.expert.to(device), lay_cpu.pairs.to(device))
    assert moe.tiles("swiglu", False, False, 2, None, (2 * F, H, 128), True, bm)[:3] == \
        ((64, 256, 4) if bm == 16 else (128, 128, 8))
    assert moe.tiles("down", False, False, 2, None, (H, F, 128), True, bm)[:3] == ((64, 128, 4) if bm == 16 else (128, 128, 8))
    # groups wider than 128 keep the SwiGLU's K tile at 128 under 16 pairs too: a dot as wide at every
    # block size (int4.sub_tile), so a row's sums do not change with the chunk's size
    assert moe.tiles("swiglu", False, False, 2, None, (2 * F, H, 256), False, bm)[1] == 128
    x = randn(T, H, device=device, seed=76)
    products_match(x, wgu, wd, sgu, sd, lay_cpu, lay, k + 1, E, form=int4.interleave_ref)


def stacked_plan(tile=(32, 128, 4, 2)) -> ProductPlan:
    """4-bit experts' SwiGLU stacked (ProductPlan.int4_expert_stacked) on `tile`."""
    return ProductPlan(programs=6, int4_expert_stacked=True,
                       int4_tiles=lambda product, N, K, group: tile if product == "expert_swiglu" else None)


@pytest.mark.parametrize("group,normed", [(64, False), (128, True)])
def test_int4_stacked_swiglu_is_the_apart_one_bit_for_bit(device, group, normed):
    """The SwiGLU's gate and up tiles as one (2 BN rows, one dot a group) give the same bits as the
    two dots apart on the same tile on the GPU (each row's sums in the same order), the shared expert
    and a Normed input included; F 80 leaves the last tile's columns part empty."""
    T, E, k, F, H = 3, 5, 2, 80, 256
    wgu = int4_weight(E * 2 * F, H, device, 61, group, False, False, experts=E)
    sgu = int4_weight(2 * F, H, device, 63, group, False, False)
    form = int4.interleave_ref          # the engine's layout, which the plan stacks
    x = randn(T, H, device=device, seed=65)
    if normed:
        x = matvec.Normed(x, randn(T, 4, device=device, seed=66).abs() * 60, 1e-6)
    # a step's own layout (route_step): what the stacked form is for (a prefill's blocks keep them apart)
    ids, _, _, lay = moe_routing.route_step(randn(T, E + 1, seed=67, scale=2.0).to(device), k, E, shared=True)
    assert isinstance(lay, moe_layout.StepLayout)
    lay_cpu = moe_layout.layout_ref(ids.cpu(), E + 1, moe_layout.STEP_ROWS)
    apart = dataclasses.replace(stacked_plan(), int4_expert_stacked=False)
    assert moe.swiglu_stacked(form(wgu), True, stacked_plan()) and not moe.swiglu_stacked(form(wgu), True, apart)
    assert not moe.swiglu_stacked(wgu, True, stacked_plan()) and not moe.swiglu_stacked(form(wgu), False, stacked_plan())
    h = moe.expert_swiglu_triton(x, form(wgu), lay, k + 1, E, shared=form(sgu), plan=stacked_plan())
    h_apart = moe.expert_swiglu_triton(x, form(wgu), lay, k + 1, E, shared=form(sgu), plan=apart)
    if device == "cuda":
        assert torch.equal(h, h_apart)
    else:       # the interpreter's dots are numpy's, whose sums' order may follow the tile's rows
        check(h, h_apart, 1e-6, "stacked against apart")
    if not normed:
        check(h.cpu(), moe.expert_swiglu_ref(x.cpu(), cpu(wgu), lay_cpu, k + 1, E, shared=cpu(sgu)), TOL[torch.float32])


def int4_rows_equal(device, dtype, E, k, F, H, T=5, group=128, plan=None, interleaved=False):
    wgu, wd = experts(E, F, H, device, 11, group, False, not interleaved)
    if interleaved:
        wgu, wd = int4.interleave_ref(wgu), int4.interleave_ref(wd)
    router = (randn(E, H, seed=12) / H ** 0.5).to(device, dtype)
    x = randn(T, H, dtype=dtype, device=device, seed=13)

    def forward(rows):
        logits = torch.cat([moe.F.linear(r[None], router) for r in rows])
        ids, w, g, lay = moe_routing.route_step(logits, k, E)
        h = moe.expert_swiglu_triton(rows, wgu, lay, k, E, plan=plan)
        y = moe.expert_down_triton(h, wd, lay, E, plan=plan)
        return h.view(-1, k, F), y.view(-1, k, H)
    together = forward(x)
    for i in range(T):
        for name, a, b in zip(("swiglu", "down"), forward(x[i:i + 1]), together):
            assert torch.equal(a[0], b[i]), f"row {i}: {name} differs alone"


def test_int4_a_row_does_not_depend_on_the_rows_beside_it(device):
    int4_rows_equal(device, torch.float32, E=8, k=3, F=96, H=128, group=32)
    int4_rows_equal(device, torch.float32, E=4, k=2, F=128, H=128, T=3, group=128,
                    plan=ProductPlan(programs=6, int4_form="slices"))
    int4_rows_equal(device, torch.float32, E=4, k=2, F=128, H=256, T=3, group=64, interleaved=True)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_int4_rows_bitwise_on_the_35b_shapes(interleaved):
    int4_rows_equal("cuda", torch.bfloat16, E=256, k=8, F=512, H=2048, interleaved=interleaved)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(64, 256, 8, 4), (32, 256, 4, 4)])
def test_int4_stacked_swiglu_on_the_35b_shapes(tile):
    # a row's bits whatever rows share its experts, and the stacked tile's bits the apart tile's
    int4_rows_equal("cuda", torch.bfloat16, E=256, k=8, F=512, H=2048, interleaved=True, plan=stacked_plan(tile))
    E, k, F, H = 256, 8, 512, 2048
    wgu = int4.interleave_ref(experts(E, F, H, "cuda", 71, 128, True, False)[0])
    x = randn(4, H, dtype=torch.bfloat16, device="cuda", seed=72)
    ids, w, g, lay = moe_routing.route_step(randn(4, E, seed=73, scale=3.0).cuda(), k, E)
    apart = dataclasses.replace(stacked_plan(tile), int4_expert_stacked=False)
    assert moe.swiglu_stacked(wgu, True, stacked_plan(tile))
    assert torch.equal(moe.expert_swiglu_triton(x, wgu, lay, k, E, plan=stacked_plan(tile)),
                       moe.expert_swiglu_triton(x, wgu, lay, k, E, plan=apart))


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric,perm", [(True, False), (False, True)])
def test_int4_35b_shapes_against_reference(symmetric, perm):
    E, k, F, H, T = 256, 8, 512, 2048, 4
    wgu, wd = experts(E, F, H, "cuda", 5, 128, symmetric, perm)
    x = randn(T, H, dtype=torch.bfloat16, device="cuda", seed=6)
    logits = randn(T, E, seed=7, scale=3.0).cuda()
    ids, w, g, lay = moe_routing.route_step(logits, k, E)
    h = moe.expert_swiglu(x, wgu, lay, k, E, rowwise=True)
    y = moe.expert_down(h, wd, lay, E, rowwise=True)
    # the references on the GPU too (float32, rowwise): dequantizing 256 experts on a CPU is slow
    lay_ref = moe_layout.layout_ref(ids.cpu(), E, moe_layout.STEP_ROWS)
    h_ref = moe.expert_swiglu_ref(x.float(), wgu, lay_ref, k, E)
    check(h.float(), h_ref, 1e-2, "swiglu")
    check(y, moe.expert_down_ref(h.float(), wd, lay_ref, E), 1e-2, "down")
