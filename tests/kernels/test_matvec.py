"""Few-row matrix-vector products against matvec_ref, and their row invariance: row i of a T-row
call is bit for bit the 1-row call (GPU)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_checks import TOL, check, normed, randn

from mtpchat.kernels import fp8, matvec, matvec_parts
from mtpchat.kernels.plan import ProductPlan, default_products

# numpy's matmul treats Triton's bf16 as integers in the interpreter: bf16 runs on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 5])
@pytest.mark.parametrize("N,K", [(100, 300), (77, 520), (64, 256)])
def test_matvec(device, dtype, T, N, K):
    g = torch.Generator().manual_seed(T * N + K)
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(N, K, dtype=dtype, device=device, gen=g)
    check(matvec.matvec_triton(x, w), matvec.matvec_ref(x, w), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("N,K", [(70, 300), (64, 512)])
def test_matvec_swiglu(device, dtype, T, N, K):
    g = torch.Generator().manual_seed(T + N)
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(2 * N, K, dtype=dtype, device=device, gen=g, scale=0.1)
    check(matvec.matvec_swiglu_triton(x, w), matvec.matvec_swiglu_ref(x, w), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,I", [(1, 100), (7, 1500)])
def test_silu_mul(device, dtype, T, I):
    gu = randn(T, 2 * I, dtype=dtype, device=device, seed=T + I, scale=3.0)
    check(matvec.silu_mul_triton(gu), matvec.silu_mul_ref(gu), TOL[dtype])


def test_matvec_unaligned_rows(device):
    # 37 float32 columns: rows 148 bytes apart, no tile divides them
    g = torch.Generator().manual_seed(5)
    x, w = randn(2, 37, device=device, gen=g), randn(45, 37, device=device, gen=g)
    check(matvec.matvec_triton(x, w), matvec.matvec_ref(x, w), TOL[torch.float32])
    check(matvec.matvec_swiglu_triton(x, w[:44]), matvec.matvec_swiglu_ref(x, w[:44]), TOL[torch.float32])


def test_matvec_strided_rows(device):
    x = randn(3, 400, device=device, seed=1)[:, :300]
    w = randn(50, 300, device=device, seed=2)
    check(matvec.matvec_triton(x, w), matvec.matvec_ref(x, w), TOL[torch.float32])


def test_matvec_row_limit(device):
    with pytest.raises(AssertionError, match="rows"):
        matvec.matvec_triton(randn(matvec.MAX_ROWS + 1, 32, device=device), randn(16, 32, device=device))


# the 27B decode matrices: MLP down, MLP gate|up, GDN in_proj, attention q|gate|k|v, o_proj, lm_head
SHAPES_27B = [(5120, 17408), (34816, 5120), (16480, 5120), (14336, 5120), (5120, 6144), (248320, 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_27B)
def test_matvec_27b_shapes(N, K):
    g = torch.Generator().manual_seed(N)
    x, w = randn(5, K, dtype=torch.bfloat16, device="cuda", gen=g), randn(N, K, dtype=torch.bfloat16, device="cuda", gen=g)
    check(matvec.matvec(x, w), matvec.matvec_ref(x, w), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", SHAPES_27B[:4] + [(1000, 1000)])
def test_matvec_rows_do_not_depend_on_T(N, K):
    g = torch.Generator().manual_seed(K)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    x, w = randn(matvec.MAX_ROWS, K, **bf16), randn(N, K, **bf16)
    ones = torch.cat([matvec.matvec(x[i:i + 1], w) for i in range(x.shape[0])])
    for T in (2, 3, 5, matvec.MAX_ROWS):
        assert torch.equal(matvec.matvec(x[:T], w), ones[:T]), f"T={T}"


@pytest.mark.gpu
def test_matvec_swiglu_27b_shapes_and_rows():
    g = torch.Generator().manual_seed(9)
    x = randn(5, 5120, dtype=torch.bfloat16, device="cuda", gen=g)
    w = randn(2 * 17408, 5120, dtype=torch.bfloat16, device="cuda", gen=g, scale=0.02)
    y = matvec.matvec_swiglu(x, w)
    check(y, matvec.matvec_swiglu_ref(x, w), 1e-2)
    assert torch.equal(y, torch.cat([matvec.matvec_swiglu(x[i:i + 1], w) for i in range(5)]))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_late_release_changes_no_bit(fmt):
    # ProductPlan.late_release moves PDL's launch_dependents after the loop: the same sums, from
    # kernels compiled apart (the plan reaches the launch)
    g = torch.Generator().manual_seed(13)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    x, xd = randn(4, 5120, **bf16), randn(4, 6144, **bf16)
    w, w2, wd = randn(1536, 5120, **bf16), randn(2 * 768, 5120, **bf16), randn(5120, 6144, **bf16)
    if fmt == "fp8":
        w, w2, wd = (fp8.quantize_ref(t) for t in (w, w2, wd))
    r, nw = randn(4, 5120, **bf16), randn(5120, scale=0.1, **bf16)
    early = dataclasses.replace(default_products("cuda"), late_release=False)
    late = dataclasses.replace(early, late_release=True)
    compiled = lambda fn: sum(len(cache[0]) for cache in fn.device_caches.values())
    for fn in (matvec._matvec_kernel, matvec_parts._matvec_parts_kernel):
        fn.device_caches.clear()       # (an engine test may have compiled the late forms already)
    for fn, run in ((matvec._matvec_kernel, lambda p: matvec.matvec(x, w, plan=p)),
                    (matvec._matvec_kernel, lambda p: matvec.matvec_swiglu(x, w2, p)),
                    (matvec_parts._matvec_parts_kernel, lambda p: matvec_parts.matvec_parts_triton(xd, wd, plan=p)),
                    (matvec_parts._matvec_parts_kernel,
                     lambda p: matvec_parts.matvec_parts_triton(xd, wd, norm=(r, nw, 1e-6), plan=p)[1])):
        want = run(early)
        before = compiled(fn)
        assert torch.equal(run(late), want)
        assert compiled(fn) > before, "the late placement did not reach the kernel's compilation"



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("P,blocks", [(4, 5), (6, 7), (8, 10)])
@pytest.mark.parametrize("T", [1, 4])
def test_matvec_tail_split(device, dtype, P, blocks, T):
    # a last wave of one or two column blocks on P "SMs", split over K: each part leaves float32
    # sums and the last to arrive adds them; plain, SwiGLU and Normed inputs against the references
    plan = ProductPlan(programs=P)
    g = torch.Generator().manual_seed(100 * P + T)
    size = torch.tensor([], dtype=dtype).element_size()
    K = 1100
    BN, BK = matvec.tiles(1000, K, size)[:2]
    N = blocks * BN - 5
    S, KS = matvec.tail_split(blocks, matvec.triton.cdiv(K, BK), plan)
    assert S >= 2 and (S - 1) * KS < matvec.triton.cdiv(K, BK) <= S * KS
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(N, K, dtype=dtype, device=device, gen=g, scale=0.1)
    for _ in range(2):                               # the second call finds the counts at 0 again
        check(matvec.matvec_triton(x, w, plan=plan), matvec.matvec_ref(x, w), TOL[dtype])
        assert int(matvec.arrival_counts(x.device, 1).abs().sum()) == 0
    n = normed(T, K, dtype, device, g)
    BN2 = matvec.tiles(1000, K, size, swiglu=True)[0]
    w2 = randn(2 * (blocks * BN2 - 3), K, dtype=dtype, device=device, gen=g, scale=0.1)
    logits = torch.full((T, N), float("nan"), device=device)
    for what, out, ref in [("Normed", lambda: matvec.matvec_triton(n, w, plan=plan), matvec.matvec_ref(n, w)),
                           ("float32 out", lambda: matvec.matvec_triton(x, w, out=logits, plan=plan),
                            matvec.matvec_ref(x, w).float()),
                           ("swiglu", lambda: matvec.matvec_swiglu_triton(x, w2, plan), matvec.matvec_swiglu_ref(x, w2)),
                           ("swiglu, Normed", lambda: matvec.matvec_swiglu_triton(n, w2, plan),
                            matvec.matvec_swiglu_ref(n, w2))]:
        check(out(), ref, TOL[dtype], what)
        assert int(matvec.arrival_counts(x.device, 1).abs().sum()) == 0, what
    whole = ProductPlan(programs=P, tail_split=False)
    assert matvec.tail_split(blocks, matvec.triton.cdiv(K, BK), whole) is None
    check(matvec.matvec_triton(x, w, plan=whole), matvec.matvec_ref(x, w), TOL[dtype], "unsplit")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3])
def test_matvec_small_split(device, dtype, T):
    # a product of one column block on 6 "SMs" with the plan's small_split (the default): every
    # block split over K (as an MoE router would be on 132), plain, Normed, float32 logits and
    # SwiGLU against the references, each row its 1-row call, the counts back at 0
    plan = ProductPlan(programs=6)
    g = torch.Generator().manual_seed(7 + T)
    size = torch.tensor([], dtype=dtype).element_size()
    K = 1300
    BN, BK = matvec.tiles(60, K, size)[:2]
    KI = matvec.triton.cdiv(K, BK)
    S, KS = matvec.tail_split(1, KI, plan)
    assert S == min(plan.small_parts, KI, 6) and (S - 1) * KS < KI <= S * KS
    x, w = randn(T, K, dtype=dtype, device=device, gen=g), randn(BN - 3, K, dtype=dtype, device=device, gen=g, scale=0.1)
    n = normed(T, K, dtype, device, g)
    w2 = randn(2 * 21, K, dtype=dtype, device=device, gen=g, scale=0.1)
    logits = torch.full((T, BN - 3), float("nan"), device=device)
    for what, out, ref in [("plain", lambda: matvec.matvec_triton(x, w, plan=plan), matvec.matvec_ref(x, w)),
                           ("Normed", lambda: matvec.matvec_triton(n, w, plan=plan), matvec.matvec_ref(n, w)),
                           ("float32 out", lambda: matvec.matvec_triton(x, w, out=logits, plan=plan),
                            matvec.matvec_ref(x, w).float()),
                           ("swiglu", lambda: matvec.matvec_swiglu_triton(x, w2, plan), matvec.matvec_swiglu_ref(x, w2))]:
        check(out(), ref, TOL[dtype], what)
        assert int(matvec.arrival_counts(x.device, 1).abs().sum()) == 0, what
    ones = torch.cat([matvec.matvec_triton(x[i:i + 1], w, plan=plan) for i in range(T)])
    assert torch.equal(matvec.matvec_triton(x, w, plan=plan), ones)
    assert matvec.tail_split(1, KI, ProductPlan(programs=6, small_split=False)) is None


@pytest.mark.gpu
def test_small_split_on_the_35b_router():
    # the 35B-A3B's router (256 experts and the shared gate, hidden 2048) split in every block on
    # the GPU's SMs: against the reference, the same bits call after call, rows invariant in T
    g = torch.Generator().manual_seed(5)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    x, w = randn(5, 2048, **bf16), randn(257, 2048, scale=0.02, **bf16)
    n = normed(5, 2048, torch.bfloat16, "cuda", g)
    plan = default_products("cuda")
    whole = matvec.matvec(n, w, plan=ProductPlan(programs=plan.programs, small_split=False))
    assert matvec.tail_split(5, 8, plan) == (8, 1)
    first = matvec.matvec(n, w, plan=plan)
    check(first, matvec.matvec_ref(n, w), 1e-2)
    check(first, whole, 1e-2)
    for _ in range(20):
        assert torch.equal(matvec.matvec(n, w, plan=plan), first)
        assert int(matvec.arrival_counts(x.device, 1).abs().sum()) == 0
    assert torch.equal(matvec.matvec(matvec.Normed(n.x[:1], n.ss[:1], n.eps), w, plan=plan), first[:1])
    check(matvec.matvec(x, w, plan=plan), matvec.matvec_ref(x, w), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("P", [60, 114])
def test_matvec_tail_split_races(P):
    # the last wave's parts finishing in any order on the GPU: many split blocks (P 60: 15 of 135
    # left; P 114: the lm_head's 3880 blocks leave 4), each call the same bits, rows invariant in
    # T, counts back at 0 after every call; plain, float32 logits, Normed and SwiGLU
    plan = ProductPlan(programs=P)
    g = torch.Generator().manual_seed(P)
    bf16 = dict(dtype=torch.bfloat16, device="cuda", gen=g)
    N = 135 * 64 - 5 if P == 60 else 248320
    x, w = randn(5, 5120, **bf16), randn(N, 5120, scale=0.02, **bf16)
    w2 = randn(2 * (135 * 64 - 7), 5120, scale=0.02, **bf16)
    n = normed(5, 5120, torch.bfloat16, "cuda", g)
    logits = torch.empty(5, N, device="cuda")
    calls = {"plain": (lambda x: matvec.matvec(x, w, plan=plan), matvec.matvec_ref(x, w)),
             "logits": (lambda x: matvec.matvec(x, w, out=logits[:x.shape[0]], plan=plan).clone(),
                        matvec.matvec_ref(x, w).float()),
             "Normed": (lambda x: matvec.matvec(n if x.shape[0] == 5 else matvec.Normed(n.x[:1], n.ss[:1], n.eps), w,
                                                plan=plan), matvec.matvec_ref(n, w))}
    if P == 60:
        calls["swiglu"] = (lambda x: matvec.matvec_swiglu(x, w2, plan), matvec.matvec_swiglu_ref(x, w2))
    for what, (call, ref) in calls.items():
        first = call(x)
        check(first, ref, 1e-2, what)
        for _ in range(20):
            assert torch.equal(call(x), first), what
            assert int(matvec.arrival_counts(x.device, 1).abs().sum()) == 0, what
        assert torch.equal(call(x[:1]), first[:1]), f"{what}: row 0 alone"


def test_tail_config_27b():
    # on 132 SMs only the MLP gate|up ends in a small partial wave (272 blocks: 8 left), split in
    # 3 parts of 14, 14 and 12 of its 40 K tiles; the GDN in_proj (258), q|gate|k|v (224) and lm_head (3880)
    # end in waves of 126, 92 and 52 blocks, the 5120-row products (80) make less than one
    shapes = {"in": (16480, False), "qkv": (14336, False), "glu": (17408, True), "lm": (248320, False), "down": (5120, False)}
    got = {}
    for name, (N, swiglu) in shapes.items():
        BN, BK = matvec.tiles(N, 5120, 2, swiglu)[:2]
        got[name] = matvec.tail_split(matvec.triton.cdiv(N, BN), matvec.triton.cdiv(5120, BK), ProductPlan(programs=132))
    assert got == {"in": None, "qkv": None, "glu": (3, 14), "lm": None, "down": None}


@pytest.mark.parametrize("dtype", DTYPES)
def test_matvec_into_float32(device, dtype):
    # logits straight into a float32 buffer: the product rounded to the inputs' dtype, then widened
    g = torch.Generator().manual_seed(11)
    x, w = randn(3, 200, dtype=dtype, device=device, gen=g), randn(90, 200, dtype=dtype, device=device, gen=g)
    buf = torch.full((5, 90), float("nan"), device=device)
    y = matvec.matvec_triton(x, w, out=buf[1:4])
    assert y.data_ptr() == buf[1:4].data_ptr() and buf[0].isnan().all() and buf[4].isnan().all()
    assert torch.equal(y, matvec.matvec_triton(x, w).float())
    check(y, matvec.matvec_ref(x, w).float(), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5])
def test_matvec_normed_input(device, dtype, T):
    # a Normed input: each output row scaled by its rows' 1 / rms, from the partial sums of squares
    g = torch.Generator().manual_seed(40 + T)
    n = normed(T, 300, dtype, device, g)
    w = randn(70, 300, dtype=dtype, device=device, gen=g, scale=0.1)
    check(matvec.matvec_triton(n, w), matvec.matvec_ref(n, w), TOL[dtype])
    check(matvec.matvec_swiglu_triton(n, w), matvec.matvec_swiglu_ref(n, w), TOL[dtype], "swiglu")
    ref = matvec.matvec_ref(n.x, w).float() * matvec.rstd_ref(n)[:, None].cpu().to(device)
    check(matvec.matvec_ref(n, w), ref, TOL[dtype], "the reference's scale")


def test_tiles_run_shallower_where_shared_memory_is_short():
    # an RTX 3090 or 4090, an A10 or an L4 gives a program 101,376 bytes: the bf16 tiles (122,880 and
    # 147,456 bytes as measured for an H100) run 3 deep there, the rest of each tile as measured;
    # an H100's and an A100's as they are (tests/kernels/test_products_compile.py compiles them)
    small, h100 = ProductPlan(programs=128, shared_memory=101376), ProductPlan(programs=132)
    for swiglu in (False, True):
        BN, BK, warps, stages = matvec.tiles(17408, 5120, 2, swiglu, plan=h100)
        assert matvec.tiles(17408, 5120, 2, swiglu, plan=small) == (BN, BK, warps, 3) and stages > 3
        assert matvec.tiles(17408, 5120, 2, swiglu, plan=ProductPlan(programs=108, shared_memory=166912)) == \
            (BN, BK, warps, stages)
        # FP8 tiles fit either way
        assert matvec.tiles(17408, 5120, 1, swiglu, fp8=True, plan=small) == \
            matvec.tiles(17408, 5120, 1, swiglu, fp8=True, plan=h100)


@pytest.mark.parametrize("capability,given,want", [((8, 6), 0, 101376), ((8, 9), 0, 101376), ((8, 0), 0, 166912),
                                                   ((9, 0), 0, 232448), ((12, 0), 0, 101376), ((8, 6), 99000, 99000)])
def test_block_shared_memory_of_a_device(monkeypatch, capability, given, want):
    # what the device says where torch tells it, else by compute capability; the CPU: an H100's
    from mtpchat.kernels import plan as kplan
    props = type("Props", (), {"shared_memory_per_block_optin": given})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert kplan.block_shared_memory(torch.device("cuda", 0)) == want
    assert kplan.block_shared_memory(torch.device("cpu")) == ProductPlan.shared_memory


def test_a_pipelines_depth_fits_the_devices_shared_memory():
    # stages - 1 buffers and the slack within shared_memory, 2 deep at least
    small = ProductPlan(programs=1, shared_memory=101376)
    assert small.depth(5, 36864) == 3 and small.depth(4, 40960) == 3 and small.depth(3, 200000) == 2
    assert ProductPlan(programs=1).depth(5, 36864) == 5
