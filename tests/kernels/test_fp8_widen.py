"""FP8 e4m3 weights widened to bf16 by moving bits (kernels/fp8.py `widen` with BITS) against Triton's
conversion: the formula on every byte here; on the GPU the inline assembly on every byte, and each
few-row FP8 product (plain, split over its last wave, SwiGLU, the split parts with and without the
norm, the expert SwiGLU and down of a step and of a prefill) bit for bit the same under both forms,
on weights holding every finite e4m3 byte (subnormals and both zeros included)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_checks import normed, randn

from mtpchat.kernels import fp8, matvec, matvec_parts, moe, moe_routing
from mtpchat.kernels.plan import default_products

FINITE = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)


def test_the_bit_formula_equals_the_conversion_on_every_finite_byte():
    w = FINITE.view(fp8.FP8)
    got, want = fp8.bf16_of_e4m3_ref(w), w.to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))     # -0 stays -0, subnormals exact
    nan = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).view(fp8.FP8)
    assert fp8.bf16_of_e4m3_ref(nan).tolist() == [480.0, -480.0]          # never in a quantized weight


def test_the_bit_form_is_only_taken_for_bf16_activations_on_a_gpu():
    assert fp8.widen_group((9, 0), 4, 64) == 2 and fp8.widen_group((9, 0), 2, 32) == 4
    assert fp8.widen_group((8, 9), 4, 64) == 4              # no wgmma before Hopper
    for dtype in (torch.float32, torch.bfloat16):
        assert fp8.widen_args(torch.ones(2, dtype=dtype), 4, 64, True) == {"BITS": 0}    # CPU: the interpreter
    if torch.cuda.is_available():
        x = torch.ones(2, device="cuda", dtype=torch.bfloat16)
        assert fp8.widen_args(x.float(), 4, 64, True) == {"BITS": 0}                 # float32 activations
        hopper = torch.cuda.get_device_capability()[0] == 9
        assert fp8.widen_args(x, 4, 64, True) == {"BITS": 2 if hopper else 4}        # wgmma: pairs
        assert fp8.widen_args(x, 2, 32, True) == {"BITS": 4}                         # mma.sync: fours
        assert fp8.widen_args(x, 4, 64, True, group=4) == {"BITS": 4}                # the plan's group
        assert fp8.widen_args(x, 4, 64, False) == {"BITS": 0}


def raw_weights(N: int, K: int, seed: int) -> fp8.BlockFP8:
    """FP8 weights of random finite bytes (every one present: the NaN bytes 0x7F / 0xFF drawn are
    made 0x7E / 0xFE), block scales of very different sizes; drawn on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randint(0, 256, (N, K), dtype=torch.uint8, device="cuda", generator=g)
    w[(w & 0x7F) == 0x7F] ^= 1
    w.view(-1)[:FINITE.numel()] = FINITE.cuda()
    NB, KB = fp8.scale_shape(N, K)
    scale = torch.exp(torch.randn(NB, KB, device="cuda", generator=g) * 2) / 448
    return fp8.BlockFP8(w.view(fp8.FP8), scale)


def every_form(fn) -> list:
    """fn(plan) under the conversion, then under the bit form in groups of 2 and of 4 (whichever
    tiles the kernels take): [converted, bits x2, bits x4]."""
    plan = default_products("cuda")
    return [fn(dataclasses.replace(plan, widen_bits=bits > 0, widen_group=bits)) for bits in (0, 2, 4)]


def tensors(out) -> list[torch.Tensor]:
    """The tensors of a kernel's result (a tensor, or tuples of them: a Normed's x and ss)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out if isinstance(o, (torch.Tensor, tuple)) for t in tensors(o)]


def same(forms: list, what: str):
    for bits, out in zip((2, 4), forms[1:]):
        for x, y in zip(tensors(forms[0]), tensors(out), strict=True):
            assert torch.equal(x, y), f"{what}: the bit form in groups of {bits} differs from the conversion"


if torch.cuda.is_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _widen_all(w, out, n, BITS: tl.constexpr, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        b_x = tl.zeros([B], dtype=tl.bfloat16)
        tl.store(out + o, fp8.widen(tl.load(w + o, mask=o < n, other=0.), b_x, BITS), mask=o < n)


@pytest.mark.gpu
def test_the_inline_assembly_on_every_byte_and_lane():
    # every byte in each of the four lanes of a register: 256 bytes, shifted by 0..3, tiled
    b = torch.cat([torch.arange(256, dtype=torch.int32).roll(s) for s in range(4)]).to(torch.uint8)
    w = b.repeat(5)[:-3].view(fp8.FP8).cuda()           # an odd length: the tail is masked
    out = {bits: torch.empty(w.numel(), dtype=torch.bfloat16, device="cuda") for bits in (0, 2, 4)}
    for bits, o in out.items():
        _widen_all[(triton.cdiv(w.numel(), 512),)](w, o, w.numel(), BITS=bits, B=512)
    want = fp8.bf16_of_e4m3_ref(w.cpu()).view(torch.int16)
    finite = (b.repeat(5)[:-3] & 0x7F) != 0x7F
    for bits in (2, 4):
        assert torch.equal(out[bits].cpu().view(torch.int16), want), f"groups of {bits}"
        assert torch.equal(out[bits].cpu()[finite].view(torch.int16), out[0].cpu()[finite].view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,swiglu", [(300, 257, False), (16384, 5120, False), (2 * 17408, 5120, True),
                                        (2 * 128, 300, True)])
def test_products_equal_under_both_forms(N, K, swiglu):
    # (2 * 17408, 5120) SwiGLU: the 27B's MLP gate|up, its last wave split over K on an H100
    w = raw_weights(N, K, seed=N + K)
    x = randn(matvec.MAX_ROWS, K, dtype=torch.bfloat16, device="cuda", seed=K) / K ** 0.5
    product = matvec.matvec_swiglu if swiglu else matvec.matvec
    for T in (1, 5, matvec.MAX_ROWS):
        same(every_form(lambda plan: product(x[:T], w, plan=plan)), f"{N}x{K} swiglu={swiglu} T={T}")
    xn = normed(matvec.MAX_ROWS, K, torch.bfloat16, "cuda", torch.Generator().manual_seed(3))
    same(every_form(lambda plan: product(xn, w, plan=plan)), "a Normed input")


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(5120, 6144), (5120, 17408), (320, 1000)])
def test_split_parts_equal_under_both_forms(N, K):
    w = raw_weights(N, K, seed=N)
    x = randn(4, K, dtype=torch.bfloat16, device="cuda", seed=K) / K ** 0.5
    same(every_form(lambda plan: matvec_parts.matvec_parts(x, w, plan=plan)), "parts")
    r = randn(4, N, dtype=torch.bfloat16, device="cuda", seed=1)
    nw = randn(N, dtype=torch.bfloat16, device="cuda", seed=2)
    same(every_form(lambda plan: matvec_parts.matvec_parts_triton(x, w, (r, nw, 1e-6), plan=plan)), "parts + norm")


@pytest.mark.gpu
@pytest.mark.parametrize("T,step", [(1, True), (4, True), (9, True), (70, False)])
def test_expert_products_equal_under_both_forms(T, step):
    E, k, F, H = 256, 8, 512, 2048                       # the 35B-A3B's experts, the shared one as expert E
    gu, down = raw_weights((E + 1) * 2 * F, H, seed=1), raw_weights((E + 1) * H, F, seed=2)
    cut = lambda q, rows: (fp8.BlockFP8(q.w[:-rows], q.scale[:-rows // 128]),
                           fp8.BlockFP8(q.w[-rows:], q.scale[-rows // 128:]))
    (gu, sgu), (down, sdown) = cut(gu, 2 * F), cut(down, H)
    x = randn(T, H, dtype=torch.bfloat16, device="cuda", seed=T) / H ** 0.5
    logits = randn(T, E + 1, seed=7, scale=3.0).cuda()
    ids, weights, gate, lay = moe_routing.route(logits, k, E, step=step, shared=True)

    def experts(plan):
        h = moe.expert_swiglu_triton(x, gu, lay, k + 1, E, shared=sgu, plan=plan)
        return h, moe.expert_down_triton(h, down, lay, E, shared=sdown, plan=plan)
    same(every_form(experts), f"T={T} step={step}")
