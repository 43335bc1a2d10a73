"""The MoE kernels (kernels/moe.py, kernels/moe_layout.py) against their float32 references: the
step's layout, the expert SwiGLU and down products over bf16/float32 and FP8 experts (step and
prefill layouts), the combine and the layer folded into the down kernel, a Normed read by the
SwiGLU; a row's result the same whatever rows share its experts; and the 35B-A3B's shapes (GPU).
The routing's own tests: test_moe_routing.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import fp8, matvec, moe, moe_layout, moe_routing
from mtpchat.kernels.plan import default_products

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def experts(E: int, F: int, H: int, device, dtype, fp8_: bool, seed: int):
    """Stacked gate|up [E*2F, H] and down [E*H, F], each expert's scale its own, so a product that
    read the wrong expert's rows would be off by far more than rounding."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 0.5, E)
    gu = randn(E, 2 * F, H, gen=g) * scales[:, None, None] / H ** 0.5
    down = randn(E, H, F, gen=g) * scales.flip(0)[:, None, None] / F ** 0.5
    gu, down = gu.reshape(E * 2 * F, H), down.reshape(E * H, F)
    if fp8_:
        q1, q2 = fp8.quantize_ref(gu), fp8.quantize_ref(down)
        return (fp8.BlockFP8(q1.w.to(device), q1.scale.to(device)), fp8.BlockFP8(q2.w.to(device), q2.scale.to(device)))
    return gu.to(device, dtype), down.to(device, dtype)


@pytest.mark.parametrize("fp8_", [False, True])
@pytest.mark.parametrize("T", [1, 4])
def test_expert_products_on_the_routed_layout(device, fp8_, T):
    """The expert kernels on the layout the routing wrote: the same bits as on the layout they
    derive, the shared expert as expert E, the routed experts counted once."""
    E, k, F, H = 9, 3, 128, 256
    wgu, wd = experts(E + 1, F, H, device, torch.float32, fp8_, seed=61 + T)
    if fp8_:
        split = lambda q, rows: (fp8.BlockFP8(q.w[:-rows].contiguous(), q.scale[:-rows // 128].contiguous()),
                                 fp8.BlockFP8(q.w[-rows:].contiguous(), q.scale[-rows // 128:].contiguous()))
    else:
        split = lambda t, rows: (t[:-rows].contiguous(), t[-rows:].contiguous())
    (gu, sgu), (d, sd) = split(wgu, 2 * F), split(wd, H)
    x = randn(T, H, device=device, seed=62)
    logits = randn(T, E + 1, seed=63, scale=2.0).to(device)
    out = []
    for laid in (False, True):
        ids, _, _, lay = moe_routing.route_step(logits, k, E, shared=True, layout=laid)
        reads = torch.zeros(1, dtype=torch.int64, device=device)
        h = moe.expert_swiglu_triton(x, gu, lay, k + 1, E, reads=reads, shared=sgu)
        out.append((h, moe.expert_down_triton(h, d, lay, E, shared=sd)))
        assert reads.item() == len(set(ids[:, :k].flatten().tolist())), laid
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("T,E,k", [(1, 12, 3), (5, 12, 3), (4, 40, 8), (2, 5, 4), (9, 40, 9)])
def test_step_kernels_lay_out_and_count_as_the_reference(device, T, E, k):
    """The swiglu kernel derives each block's expert and pairs from the routing: its output equals
    the reference over layout_ref's blocks, pairs in no block stay as they were, and the distinct
    experts are counted once."""
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(T * 100 + r))[:k]
                       for r in range(T)]).to(torch.int32)
    F, H = 24, 40
    wgu, wd = experts(E, F, H, device, torch.float32, False, seed=E)
    x = randn(T, H, device=device, seed=k)
    reads = torch.zeros(1, dtype=torch.int64, device=device)
    step = moe_layout.StepLayout(ids.to(device), min(E, T * k))
    h = moe.expert_swiglu_triton(x, wgu, step, k, E, reads=reads)
    want = moe_layout.layout_ref(ids, E, moe_layout.STEP_ROWS, min(E, T * k))
    check(h.cpu(), moe.expert_swiglu_ref(x.cpu(), wgu.cpu(), want, k, E), TOL[torch.float32], "swiglu")
    check(moe.expert_down_triton(h, wd, step, E).cpu(),
          moe.expert_down_ref(h.cpu(), wd.cpu(), want, E), TOL[torch.float32], "down")
    assert reads.item() == len(set(ids.flatten().tolist())) == int((want.expert >= 0).sum())


def test_layout_groups_every_pair_once():
    ids = torch.tensor([[3, 1, 4], [1, 5, 9], [2, 6, 5], [3, 5, 8]], dtype=torch.int32)
    lay = moe_layout.layout_ref(ids, 10, bm=2)
    flat = ids.flatten()
    pairs = [p for row in lay.pairs.tolist() for p in row if p >= 0]
    assert sorted(pairs) == list(range(12))                                   # every pair, once
    for e, row in zip(lay.expert.tolist(), lay.pairs.tolist()):
        assert e >= 0 and all(flat[p] == e for p in row if p >= 0)           # each block one expert
    assert lay.expert.tolist() == sorted(lay.expert.tolist())
    assert lay.expert.tolist().count(5) == 2                                  # 3 pairs in blocks of 2
    padded = moe_layout.layout_ref(ids, 10, bm=16, blocks=12)
    assert padded.expert.tolist()[8:] == [-1] * 4 and (padded.pairs[8:] == -1).all()


@pytest.mark.parametrize("T,E,k,bm", [(1, 6, 3, 64), (37, 9, 4, 8), (64, 257, 9, 64), (200, 5, 2, 16)])
def test_a_layout_bounded_ahead_is_the_layout_then_empty_blocks(T, E, k, bm):
    # a prefill's layout on the GPU takes most_blocks blocks, known before the routing (no count
    # waits for the device, so a graph can capture it): the same blocks, then empty ones
    g = torch.Generator().manual_seed(T * E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    skewed = torch.where(torch.rand(T, k, generator=g) < 0.5, ids[:1].expand(T, k), ids)   # some experts crowded
    for chosen in (ids, skewed):
        exact = moe_layout.layout_ref(chosen, E, bm)
        n = exact.expert.numel()
        bounded = moe_layout.layout_ref(chosen, E, bm, moe_layout.most_blocks(T * k, E, bm))
        assert n <= bounded.expert.numel() == moe_layout.most_blocks(T * k, E, bm)
        assert torch.equal(bounded.expert[:n], exact.expert) and torch.equal(bounded.pairs[:n], exact.pairs)
        assert (bounded.expert[n:] == -1).all() and (bounded.pairs[n:] == -1).all()


def routed(T, E, k, device, seed):
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(seed + r))[:k] for r in range(T)])
    return ids.to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k,F,H", [(1, 6, 3, 40, 72), (5, 6, 3, 40, 72), (4, 9, 2, 24, 130)])
@pytest.mark.parametrize("step", [True, False])
def test_expert_products(device, dtype, T, E, k, F, H, step):
    wgu, wd = experts(E, F, H, device, dtype, False, seed=T + E)
    x = randn(T, H, dtype=dtype, device=device, seed=3)
    ids = routed(T, E, k, device, seed=T)
    lay_cpu = moe_layout.layout_ref(ids, E, moe_layout.STEP_ROWS if step else 2, min(E, T * k) if step else None)
    lay = moe_layout.Layout(lay_cpu.expert.to(device), lay_cpu.pairs.to(device))
    h = moe.expert_swiglu(x, wgu, lay, k, E, rowwise=step)
    h_ref = moe.expert_swiglu_ref(x.cpu().float(), wgu.cpu().float(), lay_cpu, k, E)
    check(h.cpu().float(), h_ref, TOL[dtype], "swiglu")
    y = moe.expert_down(h_ref.to(device, dtype), wd, lay, E, rowwise=step)
    y_ref = moe.expert_down_ref(h_ref.to(dtype).float(), wd.cpu().float(), lay_cpu, E)
    assert y.dtype == torch.float32
    check(y.cpu(), y_ref, TOL[dtype], "down")


@pytest.mark.parametrize("T", [1, 3, 5])
def test_fp8_expert_products(device, T):
    E, k, F, H = 5, 2, 128, 256          # FP8 experts: each part on whole 128-row blocks
    wgu, wd = experts(E, F, H, device, None, True, seed=T)
    x = randn(T, H, device=device, seed=T)
    ids = routed(T, E, k, device, seed=7 * T)
    lay_cpu = moe_layout.layout_ref(ids, E, moe_layout.STEP_ROWS, min(E, T * k))
    lay = moe_layout.Layout(lay_cpu.expert.to(device), lay_cpu.pairs.to(device))
    cpu = lambda q: fp8.BlockFP8(q.w.cpu(), q.scale.cpu())
    h_ref = moe.expert_swiglu_ref(x.cpu(), cpu(wgu), lay_cpu, k, E)
    check(moe.expert_swiglu_triton(x, wgu, lay, k, E).cpu(), h_ref, TOL[torch.float32], "fp8 swiglu")
    y_ref = moe.expert_down_ref(h_ref, cpu(wd), lay_cpu, E)
    check(moe.expert_down_triton(h_ref.to(device), wd, lay, E).cpu(), y_ref, TOL[torch.float32], "fp8 down")


def _expert_tiles(BK: int, stages: int = 2):
    """A plan whose FP8 expert products take BN 64 x BK tiles on 4 warps (BK 256: two scale blocks a
    K step, fp8.fp8_run)."""
    def expert_tiles(product, step, fp8_, itemsize=2):
        return (64, BK, 4, stages) if fp8_ else None
    return dataclasses.replace(default_products("cuda" if torch.cuda.is_available() else "cpu"),
                               expert_tiles=expert_tiles)


def test_fp8_expert_runs_are_the_same_sums(device):
    # the experts' kernels (not the reference the dispatchers take on the CPU): gate|up over H = 512
    # and down over F = 256, two K steps of two scale blocks, the same bits as one block a step and
    # near float32; F = 128 (one block) takes one block a step whatever the rule says
    E, k, T = 3, 2, 3
    assert fp8.fp8_fit((64, 256, 4, 2), 128)[1] == 128 and fp8.fp8_fit((64, 256, 4, 2), 512)[1] == 256
    cpu = lambda q: fp8.BlockFP8(q.w.cpu(), q.scale.cpu())
    for F, H in ((256, 512), (128, 256)):
        wgu, wd = experts(E, F, H, device, None, True, seed=F)
        x = randn(T, H, device=device, seed=3)
        lay_cpu = moe_layout.layout_ref(routed(T, E, k, device, seed=5).cpu(), E, moe_layout.STEP_ROWS, min(E, T * k))
        lay = moe_layout.Layout(lay_cpu.expert.to(device), lay_cpu.pairs.to(device))
        run, one = _expert_tiles(256), _expert_tiles(128)
        h = moe.expert_swiglu_triton(x, wgu, lay, k, E, plan=run)
        assert torch.equal(h, moe.expert_swiglu_triton(x, wgu, lay, k, E, plan=one))
        check(h.cpu(), moe.expert_swiglu_ref(x.cpu(), cpu(wgu), lay_cpu, k, E), TOL[torch.float32], "swiglu")
        y = moe.expert_down_triton(h, wd, lay, E, plan=run)
        assert torch.equal(y, moe.expert_down_triton(h, wd, lay, E, plan=one))
        check(y.cpu(), moe.expert_down_ref(h.cpu(), cpu(wd), lay_cpu, E), TOL[torch.float32], "down")


@pytest.mark.gpu
def test_fp8_expert_runs_are_the_same_sums_35b():
    # compiled for the GPU at the 35B-A3B's expert shapes, a step's routing: the same bits either way
    E, k, F, H, T = 256, 8, 512, 2048, 4
    wgu, wd = experts(E, F, H, "cuda", torch.bfloat16, True, seed=5)
    x = randn(T, H, dtype=torch.bfloat16, device="cuda", seed=6)
    _, _, _, lay = moe_routing.route_step(randn(T, E + 1, seed=7, scale=3.0).cuda(), k, E)
    run, one = _expert_tiles(256), _expert_tiles(128, 3)
    h = moe.expert_swiglu_triton(x, wgu, lay, k, E, plan=run)
    assert torch.equal(h, moe.expert_swiglu_triton(x, wgu, lay, k, E, plan=one))
    assert torch.equal(moe.expert_down_triton(h, wd, lay, E, plan=run), moe.expert_down_triton(h, wd, lay, E, plan=one))


def _stacked(device, tiles=None, stacked=True):
    """The device's plan with the expert SwiGLU's gate and up tiles stacked (ProductPlan.expert_stacked)
    or not, on `tiles` (BN, BK, warps, stages) where given."""
    plan = dataclasses.replace(default_products(device), expert_stacked=stacked)
    if tiles is not None:
        plan = dataclasses.replace(plan, expert_tiles=lambda product, step, fp8_, itemsize=2: tiles)
    return plan


@pytest.mark.parametrize("fp8_", [False, True])
def test_expert_swiglu_stacked(device, fp8_):
    """A step's gate and up tiles as one tile of 2 BN rows, one dot a K step: against the float32
    reference and the separate dots, with the shared expert as expert E, the routed experts counted
    once. F = 192 leaves the second column tile of 128 half past F (its up rows masked as its gate
    rows); unquantized, H = 200 leaves the last K tile 72 columns; FP8 (H = 512) takes two scale
    blocks a K step (BK 256) as well as one, the gate's and the up's scales differing per block."""
    T, E, k = 3, 6, 2
    F, H = (256, 512) if fp8_ else (192, 200)
    wgu, _ = experts(E + 1, F, H, device, torch.float32, fp8_, seed=51)
    if fp8_:
        gu, sgu = (fp8.BlockFP8(wgu.w[:-2 * F].contiguous(), wgu.scale[:-2 * F // 128].contiguous()),
                   fp8.BlockFP8(wgu.w[-2 * F:].contiguous(), wgu.scale[-2 * F // 128:].contiguous()))
        cpu = lambda q: fp8.BlockFP8(q.w.cpu(), q.scale.cpu())
    else:
        gu, sgu = wgu[:-2 * F].contiguous(), wgu[-2 * F:].contiguous()
        cpu = lambda t: t.cpu()
    x = randn(T, H, device=device, seed=52)
    logits = randn(T, E + 1, seed=53, scale=2.0).to(device)
    ids, _, _, lay = moe_routing.route_step(logits, k, E, shared=True)
    h_ref = moe.expert_swiglu_ref(x.cpu(), cpu(gu), moe_layout.layout_ref(ids.cpu(), E + 1, 16), k + 1, E,
                                  shared=cpu(sgu))
    for tiles in ((128, 128, 4, 2),) + (((64, 256, 4, 2), (16, 128, 2, 4)) if fp8_ else ((64, 64, 4, 2),)):
        reads = torch.zeros(1, dtype=torch.int64, device=device)
        h = moe.expert_swiglu_triton(x, gu, lay, k + 1, E, reads=reads, shared=sgu, plan=_stacked(device, tiles))
        check(h.cpu(), h_ref, TOL[torch.float32], f"stacked on {tiles}")
        apart = moe.expert_swiglu_triton(x, gu, lay, k + 1, E, shared=sgu, plan=_stacked(device, tiles, False))
        check(h.cpu(), apart.cpu(), TOL[torch.float32], f"stacked against apart on {tiles}")
        assert reads.item() == len(set(ids[:, :k].flatten().tolist()))


def test_expert_swiglu_stacked_keeps_a_row_independent_of_the_rows_beside_it(device):
    moe_rows_equal(device, torch.float32, E=12, k=3, F=40, H=72, plan=_stacked(device, (32, 64, 4, 2)))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_", [False, True])
@pytest.mark.parametrize("warps", [4, 8])
def test_expert_swiglu_stacked_on_the_35b_shapes(fp8_, warps):
    """At the 35B-A3B's expert shapes, a verify's routing: stacked, the same bits as the separate
    dots (each row's sums over the same K steps in the same order), and a row the same bits alone
    and among others."""
    E, k, F, H, T = 256, 8, 512, 2048, 4
    wgu, _ = experts(E, F, H, "cuda", torch.bfloat16, fp8_, seed=5)
    x = randn(T, H, dtype=torch.bfloat16, device="cuda", seed=6)
    _, _, _, lay = moe_routing.route_step(randn(T, E + 1, seed=7, scale=3.0).cuda(), k, E)
    tiles = (64, 128, warps, 3)
    h = moe.expert_swiglu_triton(x, wgu, lay, k, E, plan=_stacked("cuda", tiles))
    assert torch.equal(h, moe.expert_swiglu_triton(x, wgu, lay, k, E, plan=_stacked("cuda", tiles, False)))
    if fp8_ and warps == 4:     # the default FP8 step tile, 32 columns stacked (64 rows a dot), against 64 apart
        assert torch.equal(h, moe.expert_swiglu_triton(x, wgu, lay, k, E, plan=_stacked("cuda", (32, 128, 4, 3))))
    moe_rows_equal("cuda", torch.bfloat16, E=E, k=k, F=F, H=H, plan=_stacked("cuda", tiles))


def test_the_fp8_expert_swiglu_takes_the_plans_tile():
    """A step's stacked FP8 expert SwiGLU takes ProductPlan.fp8_expert_glu_tile (an H200's 16 columns, 2
    warps); unstacked, a prefill's, and a tile rule's choices are not its."""
    h200 = dataclasses.replace(default_products("cpu"), fp8_expert_glu_tile=(16, 128, 2, 4))
    assert moe.tiles("swiglu", True, True, plan=h200) == (16, 128, 2, 4)
    assert moe.tiles("swiglu", True, True, plan=default_products("cpu")) == (32, 128, 4, 3)
    assert moe.tiles("swiglu", True, True) == (32, 128, 4, 3)
    assert moe.tiles("swiglu", True, True, plan=dataclasses.replace(h200, expert_stacked=False)) == (64, 128, 4, 3)
    assert moe.tiles("swiglu", False, True, plan=h200) == (64, 128, 4, 3)
    assert moe.tiles("down", True, True, plan=h200) == (64, 128, 4, 3)
    ruled = dataclasses.replace(h200, expert_tiles=lambda product, step, fp8_, itemsize=2: (32, 256, 4, 4))
    assert moe.tiles("swiglu", True, True, plan=ruled) == (32, 256, 4, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_the_h200_fp8_expert_swiglu_tile_on_the_35b_shapes(T):
    """The 35B-A3B's FP8 experts with the shared one as expert E on the H200's stacked tile (16
    columns, 2 warps, 4 deep): near the float32 reference, and each row the same bits alone as
    among the others (MTP's exactness rests on it)."""
    E, k, F, H = 256, 8, 512, 2048
    wgu, _ = experts(E + 1, F, H, "cuda", torch.bfloat16, True, seed=81)
    gu = fp8.BlockFP8(wgu.w[:-2 * F].contiguous(), wgu.scale[:-2 * F // 128].contiguous())
    sgu = fp8.BlockFP8(wgu.w[-2 * F:].contiguous(), wgu.scale[-2 * F // 128:].contiguous())
    plan = dataclasses.replace(default_products("cuda"), fp8_expert_glu_tile=(16, 128, 2, 4))
    x = randn(T, H, dtype=torch.bfloat16, device="cuda", seed=82)
    logits = randn(T, E + 1, seed=83, scale=3.0).cuda()

    def swiglu(rows, logits):
        ids, _, _, lay = moe_routing.route_step(logits, k, E, shared=True, layout=plan.routed_layout)
        return ids, lay, moe.expert_swiglu_triton(rows, gu, lay, k + 1, E, shared=sgu, plan=plan)
    ids, lay, h = swiglu(x, logits)
    cpu = lambda q: fp8.BlockFP8(q.w.cpu(), q.scale.cpu())
    want = moe.expert_swiglu_ref(x.float().cpu(), cpu(gu), moe_layout.layout_ref(ids.cpu(), E + 1, 16), k + 1, E,
                                 shared=cpu(sgu))
    check(h.float().cpu(), want, 2e-2)
    h = h.view(T, k + 1, F)
    for i in range(T):
        assert torch.equal(swiglu(x[i:i + 1], logits[i:i + 1])[2].view(1, k + 1, F)[0], h[i]), f"row {i}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [True, False])
def test_combine(device, dtype, shared):
    T, k, H = 3, 4, 600
    y = randn(T * k, H, device=device, seed=1)
    w = torch.softmax(randn(T, k, seed=2), -1).to(device)
    s = randn(T, H, dtype=dtype, device=device, seed=3) if shared else None
    g = torch.sigmoid(randn(T, seed=4)).to(device) if shared else None
    out = moe.combine_triton(y, w, s, g, dtype)     # the kernel (combine takes the reference on a CPU)
    ref = moe.combine_ref(y.cpu(), w.cpu(), s.cpu() if shared else None, g.cpu() if shared else None)
    assert out.dtype == dtype
    check(out.cpu().float(), ref, TOL[dtype])


def test_a_row_does_not_depend_on_the_rows_beside_it(device):
    """The step's pipeline (route, products, combine) for row i alone and among others: the same
    bits (float32 on the CPU through the interpreter; bf16 on the GPU, in the gpu test below)."""
    moe_rows_equal(device, torch.float32, E=12, k=3, F=40, H=72)


def moe_rows_equal(device, dtype, E, k, F, H, T=5, plan=None):
    wgu, wd = experts(E, F, H, device, dtype, False, seed=11)
    router = (randn(E + 1, H, seed=12) / H ** 0.5).to(device, dtype)
    x = randn(T, H, dtype=dtype, device=device, seed=13)

    def forward(rows):
        logits = torch.cat([moe.F.linear(r[None], router) for r in rows])   # per row, as matvec gives
        ids, w, g, lay = moe_routing.route_step(logits, k, E, layout=plan is not None and plan.routed_layout)
        h = moe.expert_swiglu_triton(rows, wgu, lay, k, E, plan=plan)
        y = moe.expert_down_triton(h, wd, lay, E, plan=plan)
        return ids.view(-1, k), w, h.view(-1, k, F), y.view(-1, k, H), moe.combine_triton(y, w, None, None, dtype)
    together = forward(x)
    for i in range(T):
        alone = forward(x[i:i + 1])
        for name, a, b in zip(("ids", "weights", "swiglu", "down", "combine"), alone, together):
            assert torch.equal(a[0], b[i]), f"row {i}: {name} differs alone"


def test_the_routed_layout_keeps_a_row_independent_of_the_rows_beside_it(device):
    plan = dataclasses.replace(default_products(device), routed_layout=True)
    moe_rows_equal(device, torch.float32, E=12, k=3, F=40, H=72, plan=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 9])
def test_the_routed_layout_on_the_35b_shapes(T):
    """At the 35B-A3B's shapes, bf16 and FP8 experts with the shared one: the routing's layout as
    layout_ref gives it, and the expert products the same bits on it as on the derived one."""
    E, k, F, H = 256, 8, 512, 2048
    logits = randn(T, E + 1, seed=70 + T, scale=3.0).cuda()
    x = randn(T, H, dtype=torch.bfloat16, device="cuda", seed=71)
    for fp8_ in (False, True):
        wgu, wd = experts(E, F, H, "cuda", torch.bfloat16, fp8_, seed=72)
        sgu = fp8.BlockFP8(wgu.w[:2 * F].contiguous(), wgu.scale[:2 * F // 128].contiguous()) if fp8_ else wgu[:2 * F]
        sd = fp8.BlockFP8(wd.w[:H].contiguous(), wd.scale[:H // 128].contiguous()) if fp8_ else wd[:H]
        out = []
        for laid in (False, True):
            ids, _, _, lay = moe_routing.route_step(logits, k, E, shared=True, layout=laid)
            h = moe.expert_swiglu_triton(x, wgu, lay, k + 1, E, shared=sgu)
            out.append((h, moe.expert_down_triton(h, wd, lay, E, shared=sd)))
        ref = moe_layout.layout_ref(ids.cpu(), E + 1, moe_layout.STEP_ROWS, lay.blocks)
        assert torch.equal(lay.expert.cpu(), ref.expert) and torch.equal(lay.pairs.cpu(), ref.pairs)
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]), fp8_


@pytest.mark.gpu
def test_rows_bitwise_on_the_35b_shapes():
    moe_rows_equal("cuda", torch.bfloat16, E=256, k=8, F=512, H=2048)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_", [False, True])
def test_35b_shapes_against_reference(fp8_):
    E, k, F, H, T = 256, 8, 512, 2048, 4
    wgu, wd = experts(E, F, H, "cuda", torch.bfloat16, fp8_, seed=5)
    x = randn(T, H, dtype=torch.bfloat16, device="cuda", seed=6)
    logits = randn(T, E + 1, seed=7, scale=3.0).cuda()
    ids, w, g, lay = moe_routing.route_step(logits, k, E)
    h = moe.expert_swiglu(x, wgu, lay, k, E, rowwise=True)
    y = moe.expert_down(h, wd, lay, E, rowwise=True)
    lay_cpu = moe_layout.layout_ref(ids.cpu(), E, moe_layout.STEP_ROWS)
    cpu = (lambda q: fp8.BlockFP8(q.w.cpu(), q.scale.cpu())) if fp8_ else (lambda t: t.cpu().float())
    h_ref = moe.expert_swiglu_ref(x.cpu().float(), cpu(wgu), lay_cpu, k, E)
    check(h.cpu().float(), h_ref, 1e-2, "swiglu")
    check(y.cpu(), moe.expert_down_ref(h.cpu().float(), cpu(wd), lay_cpu, E), 1e-2, "down")


@pytest.mark.parametrize("fp8_", [False, True])
@pytest.mark.parametrize("step", [True, False])
def test_the_shared_expert_as_expert_e(device, fp8_, step):
    """The shared expert taken by the expert kernels as every row's last choice (expert E, its own
    weight tensors): routing, products and the count of routed experts as the references give."""
    T, E, k, F, H = 4, 7, 3, 128, 256
    wgu, wd = experts(E + 1, F, H, device, torch.float32, fp8_, seed=21)
    if fp8_:    # the last expert's rows and scales as a tensor of their own
        split = lambda q, rows: (fp8.BlockFP8(q.w[:-rows].contiguous(), q.scale[:-rows // 128].contiguous()),
                                 fp8.BlockFP8(q.w[-rows:].contiguous(), q.scale[-rows // 128:].contiguous()))
    else:
        split = lambda t, rows: (t[:-rows].contiguous(), t[-rows:].contiguous())
    (gu, sgu), (d, sd) = split(wgu, 2 * F), split(wd, H)
    logits = randn(T, E + 1, seed=22, scale=2.0).to(device)
    x = randn(T, H, device=device, seed=23)
    ids_r, w_r, g_r = moe_routing.route_ref(logits.cpu(), k, E, shared=True)
    assert g_r is None and (ids_r[:, k] == E).all() and torch.equal(w_r[:, k], torch.sigmoid(logits[:, E].cpu()))
    if step:
        ids, w, _, lay = moe_routing.route_step(logits, k, E, shared=True)
        assert torch.equal(ids.cpu(), ids_r) and lay.blocks == min(E + 1, T * (k + 1))
        check(w.cpu(), w_r, 1e-6, "weights")
    else:
        lay = moe_layout.layout_ref(ids_r, E + 1, 2)
        lay = moe_layout.Layout(lay.expert.to(device), lay.pairs.to(device))
    reads = torch.zeros(1, dtype=torch.int64, device=device)
    h = moe.expert_swiglu_triton(x, gu, lay, k + 1, E, reads=reads if step else None, shared=sgu)
    ref_lay = moe_layout.layout_ref(ids_r, E + 1, 16)
    cpu = (lambda q: fp8.BlockFP8(q.w.cpu(), q.scale.cpu())) if fp8_ else (lambda t: t.cpu())
    h_ref = moe.expert_swiglu_ref(x.cpu(), cpu(gu), ref_lay, k + 1, E, shared=cpu(sgu))
    check(h.cpu(), h_ref, TOL[torch.float32], "swiglu")
    y = moe.expert_down_triton(h_ref.to(device), d, lay, E, shared=sd)
    check(y.cpu(), moe.expert_down_ref(h_ref, cpu(d), ref_lay, E, shared=cpu(sd)), TOL[torch.float32], "down")
    if step:
        assert reads.item() == len(set(ids_r[:, :k].flatten().tolist()))     # routed experts only


def fold_case(device, dtype, fp8_, T, shared_as_expert, E=7, k=3, F=128, H=384, seed=0, routed=False):
    """A step's MoE layer up to its down product: (h, down, shared down or None, layout, Fold) with a
    residual, a norm weight and, where the shared expert is not expert E, its output and gate; the
    layout derived by the kernels, or written by the routing (`routed`)."""
    wgu, wd = experts(E + 1, F, H, device, dtype, fp8_, seed=31 + seed)
    if fp8_:
        d, sd = (fp8.BlockFP8(wd.w[:-H].contiguous(), wd.scale[:-H // 128].contiguous()),
                 fp8.BlockFP8(wd.w[-H:].contiguous(), wd.scale[-H // 128:].contiguous()))
    else:
        d, sd = wd[:-H].contiguous(), wd[-H:].contiguous()
    logits = randn(T, E + 1, seed=32 + seed, scale=2.0).to(device)
    ids, w, g, lay = moe_routing.route_step(logits, k, E, shared=shared_as_expert, layout=routed)
    h = randn(T * (k + shared_as_expert), F, dtype=dtype, device=device, seed=33 + seed)
    so = None if shared_as_expert else randn(T, H, dtype=dtype, device=device, seed=34 + seed)
    r = randn(T, H, dtype=dtype, device=device, seed=35 + seed, scale=3.0)
    nw = randn(H, device=device, seed=36 + seed, scale=0.3).to(dtype)
    return h, d, sd if shared_as_expert else None, lay, moe.Fold(w, so, g, r, nw, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8_", [False, True])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shared_as_expert,routed", [(True, False), (False, False), (True, True)])
def test_the_down_kernel_folds_the_layer(device, dtype, fp8_, T, shared_as_expert, routed):
    """The down kernel finishing a step's MoE layer (moe.Fold): its h the combine kernel's output
    (rounded to the model dtype) plus the residual, rounded, bit for bit; x = h * (1 + w) bit for
    bit; the block sums of h² adding up to the row's; the counts back at 0. 7 experts, 3 or 4
    chosen a row: the layout's blocks not taken count too. (bf16 on the GPU only: the interpreter's
    bf16 products are not the GPU's.)"""
    if fp8_ and dtype != torch.float32:
        pytest.skip("FP8 experts take float32 or bf16 rows alike: one of them is enough")
    h, d, sd, lay, fold = fold_case(device, dtype, fp8_, T, shared_as_expert, seed=T, routed=routed)
    y = moe.expert_down_triton(h, d, lay, 7, shared=sd)
    normed, hh = moe.expert_down_triton(h, d, lay, 7, shared=sd, fold=fold)
    c = moe.combine_triton(y, fold.weights, fold.shared, fold.gate, dtype)
    want = (c.float() + fold.residual.float()).to(dtype)
    assert torch.equal(hh, want)
    assert torch.equal(normed.x, (want.float() * (1. + fold.norm_weight.float())).to(dtype))
    assert normed.ss.shape[0] == T and normed.ss.shape[1] > 1 and normed.eps == fold.eps
    check(normed.ss.sum(-1).cpu(), want.float().square().sum(-1).cpu(), 1e-5, "sums of h²")
    assert not moe.fold_count(hh.device, normed.ss.shape[1]).any(), "the down kernel left a count set"
    # against the float32 reference of the whole layer
    cpu = (lambda q: fp8.BlockFP8(q.w.cpu(), q.scale.cpu())) if fp8_ else (lambda t: t.cpu().float())
    ref_lay = lay.expand(8) if shared_as_expert else lay.expand(7)
    y_ref = moe.expert_down_ref(h.cpu().float(), cpu(d), moe_layout.Layout(ref_lay.expert.cpu(), ref_lay.pairs.cpu()), 7,
                                shared=None if sd is None else cpu(sd))
    n_ref, h_ref = moe.fold_ref(y_ref, moe.Fold(*(t.cpu().float() if isinstance(t, torch.Tensor) else t for t in fold)))
    check(hh.cpu().float(), h_ref, TOL[dtype], "h")
    # (the rows' h rounded to bf16 give sums of squares other than the float32 layer's by about 1e-4:
    # the sums of the rounded rows are checked against `want` above)
    check(matvec.rstd_ref(normed).cpu(), matvec.rstd_ref(n_ref), TOL[dtype], "1 / rms")


@pytest.mark.parametrize("routed", [False, True])
def test_the_folded_layer_keeps_a_row_independent_of_the_rows_beside_it(device, routed):
    """Row i's h, x and sums of h² the same bits alone and among 5 rows, the shared expert as
    expert E. (Under the interpreter the sums do not depend on the tile's layout: the test bites on
    the GPU, where a tile of rows sized by T once changed a row's bits.)"""
    T, k = 5, 3
    h, d, sd, _, fold = fold_case(device, torch.float32, False, T, True, seed=9)
    logits = randn(T, 8, seed=41, scale=2.0).to(device)
    _, w_all, _, lay_all = moe_routing.route_step(logits, k, 7, shared=True, layout=routed)
    n_all, h_all = moe.expert_down_triton(h, d, lay_all, 7, shared=sd, fold=fold._replace(weights=w_all))
    for i in range(T):
        _, w, _, lay_i = moe_routing.route_step(logits[i:i + 1], k, 7, shared=True, layout=routed)
        f_i = moe.Fold(w, None, None, fold.residual[i:i + 1], fold.norm_weight, fold.eps)
        pairs = slice((k + 1) * i, (k + 1) * (i + 1))
        n_i, h_i = moe.expert_down_triton(h[pairs], d, lay_i, 7, shared=sd, fold=f_i)
        assert torch.equal(h_i[0], h_all[i]) and torch.equal(n_i.x[0], n_all.x[i]), f"row {i}"
        assert torch.equal(n_i.ss[0], n_all.ss[i]), f"row {i}: sums of h²"


def combine_fold_case(device, dtype, T, shared, H=1100, k=4, seed=0):
    """The down products y [T * k, H] float32 of a step's pairs and a Fold to finish the layer with
    (rows 0.1 to 10 apart in scale; the shared expert's output and gate where `shared`)."""
    y = randn(T * k, H, device=device, seed=81 + seed) * torch.logspace(-1, 1, T * k, device=device)[:, None]
    w = torch.softmax(randn(T, k, seed=82 + seed), -1).to(device)
    so = randn(T, H, dtype=dtype, device=device, seed=83 + seed) if shared else None
    g = torch.sigmoid(randn(T, seed=84 + seed)).to(device) if shared else None
    r = randn(T, H, dtype=dtype, device=device, seed=85 + seed, scale=3.0)
    nw = randn(H, device=device, seed=86 + seed, scale=0.3).to(dtype)
    return y, moe.Fold(w, so, g, r, nw, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shared", [True, False])
def test_the_combine_finishes_the_layer(device, dtype, T, shared):
    """The combine kernel finishing a step's MoE layer (moe.Fold, KernelPlan.combine_normed): h the
    plain combine rounded to the model dtype plus the residual, rounded, bit for bit; x = h * (1 +
    w) bit for bit; one sum of h² a block of COMBINE_COLUMNS columns (1100 columns: 3 blocks, the
    last short), adding up to the row's; and against the float32 reference of the whole (fold_ref,
    which the dispatcher takes on a CPU)."""
    y, fold = combine_fold_case(device, dtype, T, shared, seed=T)
    normed, h = moe.combine_triton(y, None, fold=fold)
    want = (moe.combine_triton(y, fold.weights, fold.shared, fold.gate, dtype).float() + fold.residual.float()).to(dtype)
    assert h.dtype == dtype and torch.equal(h, want)
    assert torch.equal(normed.x, (want.float() * (1. + fold.norm_weight.float())).to(dtype))
    assert normed.ss.shape == (T, 3) and normed.eps == fold.eps
    for b, cols in enumerate(want.float().split(moe.COMBINE_COLUMNS, dim=1)):
        check(normed.ss[:, b].cpu(), cols.square().sum(-1).cpu(), 1e-5, f"block {b}'s sums of h²")
    cpu = moe.Fold(*(t.cpu().float() if isinstance(t, torch.Tensor) else t for t in fold))
    n_ref, h_ref = moe.combine(y.cpu(), None, fold=cpu)
    check(h.cpu().float(), h_ref, TOL[dtype], "h")
    check(normed.x.cpu().float(), n_ref.x, TOL[dtype], "x")
    check(matvec.rstd_ref(normed).cpu(), matvec.rstd_ref(n_ref), TOL[dtype], "1 / rms")


def test_the_finishing_combine_keeps_a_row_independent_of_the_rows_beside_it(device):
    """Row i's h, x and block sums of h² the same bits alone and among 5 rows."""
    T, k = 5, 4
    y, fold = combine_fold_case(device, torch.float32, T, True, k=k, seed=7)
    n_all, h_all = moe.combine_triton(y, None, fold=fold)
    for i in range(T):
        f_i = moe.Fold(fold.weights[i:i + 1], fold.shared[i:i + 1], fold.gate[i:i + 1], fold.residual[i:i + 1],
                       fold.norm_weight, fold.eps)
        n_i, h_i = moe.combine_triton(y[k * i:k * (i + 1)], None, fold=f_i)
        assert torch.equal(h_i[0], h_all[i]) and torch.equal(n_i.x[0], n_all.x[i]), f"row {i}"
        assert torch.equal(n_i.ss[0], n_all.ss[i]), f"row {i}: sums of h²"


@pytest.mark.parametrize("routed", [False, True])
def test_the_expert_swiglu_of_a_normed_keeps_a_row_independent_of_the_rows_beside_it(device, routed):
    """Each pair's SwiGLU over a Normed the same bits alone and among 5 rows (its row's 1 / rms from
    the row's own sums of squares, whatever place its pair takes in its block)."""
    T, E, k, F, H = 5, 7, 3, 128, 256
    wgu, _ = experts(E, F, H, device, torch.float32, False, seed=71)
    normed = matvec.Normed(randn(T, H, device=device, seed=72),
                           randn(T, 3, device=device, seed=73).abs() * torch.logspace(-1, 2, T, device=device)[:, None],
                           1e-6)
    logits = randn(T, E, seed=74, scale=2.0).to(device)
    lay_all = moe_routing.route_step(logits, k, E, layout=routed)[3]
    together = moe.expert_swiglu_triton(normed, wgu, lay_all, k, E)
    for i in range(T):
        lay_i = moe_routing.route_step(logits[i:i + 1], k, E, layout=routed)[3]
        alone = moe.expert_swiglu_triton(matvec.rows_slice(normed, i, i + 1), wgu, lay_i, k, E)
        assert torch.equal(alone, together[k * i:k * (i + 1)]), f"row {i}"


@pytest.mark.parametrize("fp8_", [False, True])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("routed", [False, True])
def test_the_expert_swiglu_reads_a_normed(device, fp8_, T, routed):
    """The SwiGLU over a Normed x (KernelPlan.moe_normed): each pair's sums scaled by its row's
    1 / rms, as the product of the rows normalised whole; rows of scales 0.1 to 10 apart, so a
    pair scaled by another row's 1 / rms is far off."""
    E, k, F, H = 7, 3, 128, 256
    wgu, _ = experts(E, F, H, device, torch.float32, fp8_, seed=51 + T)
    h = randn(T, H, device=device, seed=52) * torch.logspace(-1, 1, T, device=device)[:, None]
    nw = randn(H, device=device, seed=53, scale=0.3)
    xn = h * (1. + nw)
    ss = torch.stack([c.square().sum(-1) for c in h.split(96, dim=1)], 1)      # 3 blocks, the last short
    normed = matvec.Normed(xn, ss, 1e-6)
    logits = randn(T, E, seed=54, scale=2.0).to(device)
    ids, _, _, lay = moe_routing.route_step(logits, k, E, layout=routed)
    got = moe.expert_swiglu_triton(normed, wgu, lay, k, E)
    rows = xn * matvec.rstd_ref(normed)[:, None]
    cpu = (lambda q: fp8.BlockFP8(q.w.cpu(), q.scale.cpu())) if fp8_ else (lambda t: t.cpu())
    want = moe.expert_swiglu_ref(rows.cpu(), cpu(wgu), moe_layout.layout_ref(ids.cpu(), E, 16), k, E)
    check(got.cpu(), want, TOL[torch.float32], "swiglu of a Normed")
