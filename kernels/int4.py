"""Group-scaled 4-bit weights (W4A16): the one form the engine keeps every 4-bit checkpoint in, and
the float32 references to pack, unpack, quantize and dequantize it. The product kernels over such
weights read it as it is described here.

A GroupInt4 holds a weight of N rows (output features) and K columns (input features):
- `w` int32 [N, K / 8]: row n's weights k .. k + 7 in word k // 8, weight k in bits 4 (k % 8) ..
  4 (k % 8) + 3, unsigned 0 .. 15. GPTQ's `qweight` [K / 8, N] is this transposed; the
  compressed-tensors `weight_packed` [N, K / 8] is this as it is.
  Or, **interleaved** (`interleave_ref`; int16 [N, K / 4], no perm, G a multiple of 64): in each
  group of G columns, half-word c (0 .. G/4 - 1) holds column (G/4) q + c in its bits 4q .. 4q + 3
  (q = 0 .. 3). Masking a 32-bit pair of half-words with 0x000F000F after a shift by 4q then
  gives, in one register, two neighbouring columns of the group's quarter q: one dot a quarter,
  over x's G/4 columns side by side (the interleaved form of the products, form_args).
- `scale` [N, K / G] float16 or float32 (as the checkpoint holds it; never rounded to bf16, which
  would move weights by up to 1e-3), one per row and group of G consecutive columns.
- `zero` uint8 [N, K / G] (0 .. 15), or None for a symmetric weight, whose zero is 8.
- `perm` int32 [K], or None: weight column k multiplies input column perm[k]. GPTQ with desc_act
  quantizes the columns in another order and says which group each column fell in (`g_idx`, not
  monotonic); sorting the columns by group (`group_order`) makes every group G consecutive
  columns again, and the product then reads x through perm.

The dequantized weight is (q - zero) * scale; as a dense [N, K] matrix in x's column order, column
perm[k] holds weight column k. A stack of MoE experts is one GroupInt4 of E * N rows, with `perm`
[E, K] where each expert has its own.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mtpchat.kernels._triton import interpreting, tl, triton

GROUP = 128           # the group of --weights int4 and of the official GPTQ releases
PACK = 8              # 4-bit weights in one int32 word
SYMMETRIC_ZERO = 8    # the zero of a symmetric weight (GPTQ v1 stores it as 7: zero - 1)
QUANTIZE_AT_ONCE = 1 << 24   # weights quantize_ref and interleave_ref work on at once (float32 work: about 400 MB)
# the groups the engine interleaves (interleavable): a tile takes whole groups, and the experts'
# prefill tiles are 128 columns wide; the quarter's dot a power of two
INTERLEAVE_GROUPS = (64, 128)


class GroupInt4(NamedTuple):
    """A product's weight in 4 bits with its group scales (the module docstring); `shape` and
    `device` are the dequantized weight's."""
    w: torch.Tensor                      # [N, K / 8] int32, or [N, K / 4] int16: interleaved
    scale: torch.Tensor                  # [N, K / G] float16 or float32
    zero: torch.Tensor | None = None     # [N, K / G] uint8, or None: symmetric (8)
    perm: torch.Tensor | None = None     # [K] (or [E, K] for stacked experts) int32, or None

    shape = property(lambda self: torch.Size((self.w.shape[0], self.w.shape[1] * (4 if self.interleaved else PACK))))
    device = property(lambda self: self.w.device)
    is_cuda = property(lambda self: self.w.is_cuda)
    group = property(lambda self: self.shape[1] // self.scale.shape[1])
    interleaved = property(lambda self: self.w.dtype == torch.int16)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self if t is not None)


def pack_ref(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0 .. 15 -> [N, K / 8] int32, weight k in bits 4 (k % 8) of word k // 8."""
    assert int(q.min()) >= 0 and int(q.max()) <= 15, "4-bit values must lie in 0 .. 15"
    return _pack(q)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """pack_ref for values known to lie in 0 .. 15 (clamped, or unpacked), without the check's
    wait for the device: a few rows quantized between steps queue behind them."""
    N, K = q.shape
    assert K % PACK == 0, f"4-bit weights pack 8 to a word: K = {K} is not a multiple of 8"
    nibbles = q.to(torch.int64).view(N, K // PACK, PACK) << (4 * torch.arange(PACK, device=q.device))
    words = nibbles.sum(-1)                                          # 0 .. 2^32 - 1
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_ref(w: torch.Tensor) -> torch.Tensor:
    """[N, K / 8] int32 -> [N, K] int32, the values 0 .. 15 (pack_ref's inverse)."""
    N, W = w.shape
    shifts = 4 * torch.arange(PACK, device=w.device, dtype=torch.int32)
    return ((w[:, :, None] >> shifts) & 0xF).view(N, W * PACK)


def interleaved_order(K: int, G: int, device=None) -> torch.Tensor:
    """[K] long: the column an interleaved weight keeps at each place (the module docstring):
    place 4 c + q of a group holds its column (G / 4) q + c."""
    s = torch.arange(K, device=device)
    return s // G * G + (s % G) % 4 * (G // 4) + (s % G) // 4


def interleave_ref(q: GroupInt4) -> GroupInt4:
    """A weight (its words int32, no perm) in the interleaved layout: the same values, the words
    int16 [N, K / 4]. Groups must be a multiple of 64 columns (quarters of 16 or more: a dot's
    least)."""
    N, K = q.shape
    assert not q.interleaved and q.perm is None, "interleave a weight of int32 words without a perm"
    assert q.group % 64 == 0, f"groups of {q.group} columns do not interleave (a multiple of 64)"
    order = interleaved_order(K, q.group, q.w.device)
    out = torch.empty(N, K // 4, dtype=torch.int16, device=q.w.device)
    rows = max(1, QUANTIZE_AT_ONCE // K)       # a few rows at a time: unpacked and repacked, some 20 bytes a weight
    for i in range(0, N, rows):
        out[i:i + rows] = _pack(unpack_ref(q.w[i:i + rows])[:, order]).view(torch.int16)
    return q._replace(w=out)


def interleavable(q: GroupInt4) -> bool:
    """Whether the engine stores this weight interleaved (ProductPlan.int4_interleave): natural
    words, no perm, groups of INTERLEAVE_GROUPS (interleave_ref itself takes any multiple of 64,
    but a product's tiles hold whole groups)."""
    return not q.interleaved and q.perm is None and q.group in INTERLEAVE_GROUPS


def values_ref(q: GroupInt4) -> torch.Tensor:
    """[N, K] int32: the 4-bit values 0 .. 15 in the weight's column order, either layout."""
    if not q.interleaved:
        return unpack_ref(q.w)
    N, K = q.shape
    out = torch.empty(N, K, dtype=torch.int32, device=q.w.device)
    out[:, interleaved_order(K, q.group, q.w.device)] = unpack_ref(q.w.view(torch.int32))
    return out


def dequantize_ref(q: GroupInt4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight [N, K] in x's column order, computed in float32 and cast to dtype."""
    N, K = q.shape
    G = q.group
    zero = SYMMETRIC_ZERO if q.zero is None else q.zero.float().repeat_interleave(G, dim=1)
    w = (values_ref(q).float() - zero) * q.scale.float().repeat_interleave(G, dim=1)
    if q.perm is not None:
        perm = q.perm.long()
        if perm.dim() == 1:
            out = torch.empty_like(w)
            out[:, perm] = w
        else:                                   # stacked experts, each with its own order
            E = perm.shape[0]
            out = torch.empty_like(w).view(E, N // E, K)
            out.scatter_(2, perm[:, None, :].expand(E, N // E, K), w.view(E, N // E, K))
            out = out.view(N, K)
        w = out
    return w.to(dtype)


def quantize_ref(w: torch.Tensor, group: int = GROUP, symmetric: bool = True,
                 scale_dtype: torch.dtype = torch.float16) -> GroupInt4:
    """Round-to-nearest 4-bit quantization of w [N, K] in groups of `group` columns.

    Symmetric: each group's scale is its value of largest magnitude m divided by -8, so m falls on
    the level -8 and all 16 levels -8 .. 7 are used (llama.cpp's Q4_0 rule), and the zero is 8; a
    group of zeros gets scale 1, a scale too small for scale_dtype its smallest normal value. Asymmetric: scale (max - min) / 15 and zero round(-min / scale). The scale is
    rounded to `scale_dtype` before the weights are divided by it, so dequantizing gives exactly
    the values the rounding chose. `--weights int4` on load is this function on the device, a few
    rows at a time: its float32 work takes some 24 bytes a weight (13 GB for one layer's stack of
    the 35B-A3B's experts whole), and rows quantize on their own."""
    N, K = w.shape
    assert K % group == 0 and group % PACK == 0, f"K = {K} must be a multiple of the group {group} (itself of 8)"
    rows = max(1, QUANTIZE_AT_ONCE // K)
    if N > rows:
        parts = [quantize_ref(w[i:i + rows], group, symmetric, scale_dtype) for i in range(0, N, rows)]
        return GroupInt4(*(None if ts[0] is None else torch.cat(ts) for ts in zip(*parts)))
    g = w.float().view(N, K // group, group)
    if symmetric:
        idx = g.abs().argmax(-1, keepdim=True)
        m = g.gather(-1, idx).squeeze(-1)
        scale = _representable(torch.where(m != 0, m / -8.0, torch.ones_like(m)), scale_dtype)
        zero = torch.full_like(scale, SYMMETRIC_ZERO, dtype=torch.float32)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = _representable(torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi)), scale_dtype)
        zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(0, 15).view(N, K)
    return GroupInt4(_pack(q), scale.contiguous(), None if symmetric else zero.to(torch.uint8).contiguous())


def _representable(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tiny = torch.finfo(dtype).tiny
    return torch.where(scale.abs() < tiny, torch.where(scale < 0, -tiny, tiny), scale).to(dtype)


def group_order(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """GPTQ's g_idx [K] (the group of each input column) -> perm [K] int32: the columns sorted by
    group (stably), or None where they already are in order (desc_act false). Raises ValueError
    where a group does not hold exactly `group` columns, which no GPTQ quantizer writes."""
    K = g_idx.numel()
    g = g_idx.to(torch.int64)
    if K % group or torch.bincount(g, minlength=K // group).ne(group).any() or int(g.max()) >= K // group:
        raise ValueError(f"g_idx does not put exactly {group} of the {K} columns in each group")
    if torch.equal(g, torch.arange(K, device=g.device) // group):
        return None
    return torch.sort(g, stable=True).indices.to(torch.int32)


def permute_columns(q: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Unpacked weights [N, K] in x's column order -> in perm's order (column k = column perm[k])."""
    return q[:, perm.long()]


# --- 4-bit tiles in a product kernel ----------------------------------------------------------------
# A tile of words [BN, BG / 8] is loaded once and unpacked in registers: nibble k of a row moved to
# the low bits of a 16-bit lane under 0x4300, which as a bf16 is 128 + q (exponent 2^7, q in the
# low mantissa bits); less 128 + zero, also a bf16, it is q - zero in -15 .. 15, exact. The dot
# takes the integers, its float32 result is scaled by the group's scale per row (as FP8 applies
# its block scale), so the weights enter the tensor cores exact and every group's scale is applied
# in float32. Triton's interpreter computes bf16 arithmetic on the raw 16 bits, so float32
# activations (the CPU's tests) take the two bf16 values to float32 before the subtraction.
# The zero costs one bf16 subtraction a weight pair (for a symmetric weight 128 + 8 is a constant).
# How the words become the dots' operands is the plan's choice (form_args: "reshape", "slices",
# "pairs").

def check_int4(w: GroupInt4, K: int, interleaved: bool = False) -> None:
    """The layout the 4-bit product kernels read (the module docstring), for a weight of K columns;
    `interleaved`: the kernel reads that layout too."""
    N = w.w.shape[0]
    G = w.group
    if w.interleaved:
        assert interleaved, "this kernel does not read interleaved 4-bit weights (int16 words)"
        assert w.w.shape == (N, K // 4) and w.w.is_contiguous() and w.perm is None and G % 64 == 0, \
            f"interleaved 4-bit weights must be int16 [N, K / 4] = [{N}, {K // 4}], contiguous, no perm, G % 64 == 0"
    else:
        assert w.w.dtype == torch.int32 and w.w.shape == (N, K // PACK) and w.w.is_contiguous(), \
            f"4-bit weights must be int32 [N, K / 8] = [{N}, {K // PACK}], contiguous"
    assert K % G == 0 and G % 16 == 0, f"a group of {G} columns must divide K = {K} and be a multiple of 16"
    assert w.scale.shape == (N, K // G) and w.scale.dtype in (torch.float16, torch.float32) and \
        w.scale.is_contiguous(), f"4-bit scales must be float16 or float32 [{N}, {K // G}], contiguous"
    assert w.zero is None or (w.zero.dtype == torch.uint8 and w.zero.shape == w.scale.shape
                              and w.zero.is_contiguous()), "4-bit zeros must be uint8 like the scales"
    assert w.perm is None or (w.perm.dtype == torch.int32 and w.perm.shape[-1] == K and w.perm.is_contiguous()), \
        f"a 4-bit weight's perm must be int32 [..., {K}], contiguous"


def sub_tile(BK: int, G: int) -> int:
    """The columns of one dot in a tile of BK columns: a whole group, or the tile where it lies
    inside one (BK and G powers of 2, or G a multiple of BK)."""
    BG = min(BK, G)
    assert G % BG == 0 and BK % BG == 0, f"tiles of {BK} columns do not fit groups of {G}"
    return BG


FORMS = ("reshape", "slices", "pairs")   # how a tile's words are unpacked for the dots (ProductPlan.int4_form)
# form_args' UNPACK: the form a kernel compiles (the interleaved weights': interleaved_args)
RESHAPED, SLICED, PAIRED, INTERLEAVED, INTERLEAVED_ASM = range(5)


def interleaved_args(BK: int, G: int) -> dict:
    """The launch arguments of a tile of BK columns over an interleaved weight (groups of G): one
    group a dot's sub-tile, four dots a group (each over a quarter's G/4 neighbouring columns)."""
    assert BK % G == 0 and G % 64 == 0, f"an interleaved weight's tiles take whole groups: BK {BK}, G {G}"
    return dict(BG=G, UNPACK=INTERLEAVED if interpreting() else INTERLEAVED_ASM)


def form_args(BK: int, G: int, form: str) -> dict:
    """The launch arguments of a 4-bit tile of BK columns in groups of G: BG, the columns of one
    group's dot (sub_tile), and UNPACK, the unpack form (RESHAPED, SLICED or PAIRED).
    "reshape": the words [BN, BG / 8] expanded to the weights [BN, BG] (a layout change through
    shared memory), one dot a group. "slices": 8 dots a group, dot j over nibble j of every word
    ([BN, BG / 8]) against x's columns 8 i + j (x read with a stride of 8). "pairs": the slices'
    dots, their nibbles made two at a time in one 32-bit register (`nibbles` with ASM: about 1.4
    instructions a weight against some 5), where the kernel runs compiled; the interpreter takes
    the slices, which give the same exact integers. A dot takes 16 columns at least, so groups
    (or tiles) of fewer than 128 columns keep the reshape form. Every form's weights are exact
    integers times x summed in float32 within a group; slices and pairs sum in the same order
    (equal bit for bit), reshape in another (equal within rounding)."""
    assert form in FORMS, f"a 4-bit unpack form is one of {FORMS}, not {form!r}"
    BG = sub_tile(BK, G)
    if form == "reshape" or BG // PACK < 16:
        return dict(BG=BG, UNPACK=RESHAPED)
    return dict(BG=BG, UNPACK=PAIRED if form == "pairs" and not interpreting() else SLICED)


def measured(product: str, N: int, K: int, interleaved: bool = False) -> tuple[tuple[int, ...], str]:
    """The tile (BN, BK in weights, warps, stages) and unpack form of a 4-bit product where the
    plan names none, by the product ("plain", "swiglu", "split", "expert_swiglu", "expert_down";
    any other, e.g. prefill's "gemm": the reshape form) and the weight's [N, K]. Measured on an
    H100 (tests/bench/bench_int4.py --rows 8, 2026-11-26, T = 1, groups of 128, the best tile of
    each form in us; bf16 beside), the rows padded to 8 (ProductPlan.int4_rows), where the pairs
    form, whose x tiles and sums the padding doubles, is the fastest everywhere:
    - plain, the 27B's GDN in_proj [16384 x 5120]: pairs 64 x 1024, 4 warps, 2 deep 40.9 against
      reshape's best 63.6 and slices' 59.4 (bf16 57.5; with rows of 16 the reshape form's 57.6 was
      the best). q|gate|k|v [14336 x 5120] alike: 39.2.
    - swiglu, the MLP gate|up [34816 x 5120]: pairs 64 columns (128 rows of w) x 256, 4 warps, 4
      deep: alone 74.2 against 32 columns, 2 warps' 64.1, but in the 27B's whole decode step 0.980
      x the time with it (verify 3 0.977, draft 3 0.994: ab_step.py --plans int4); slices' best
      96.7, reshape's 112.9 (bf16 118.9; rows of 16: 81.6).
    - split over K: out_proj and o_proj [5120 x 6144] pairs 64 x 1024, 4 warps, 2 deep, 2 parts
      22.4 (bf16 26.2; rows of 16: 29.9), MLP down [5120 x 17408] the same tile, 3 parts, 47.7
      (bf16 68.7; rows of 16: 69.7).
    - the 35B-A3B's experts at a step (8 of them; kernels/moe.py, rows of their own): gate|up
      pairs 32 x 256, 4 warps, 4 deep 22.2 against 33.9 (bf16 13.5); down reshape 64 x 512 10.7,
      pairs 11.2 (bf16 7.5); measured 2026-11-25.
    Interleaved weights (interleave_ref, the engine's by default, experts included; their form is
    interleaved_args, "interleaved" here) take tiles of their own: the dense products 32 rows on
    2 warps, 512 weights a step (bench_int4.py --interleaved-only, H100, 2026-11-26, T = 1, us,
    the pairs form's tiles beside): in_proj 21.1 (64 x 1024, 4 warps, 2 deep: 30.2), q|gate|k|v 19.6 (27.8), 4 deep;
    gate|up 46.6, 2 deep (64 x 256, 4 warps, 4 deep: 64.4; 3 deep alone the same, but the whole
    step 1.017 x slower); split out_proj 12.8 in 3 parts (17.5 in 2), down 28.7 in 3 (32.6), 4 deep
    (split_config: 3 parts where the 27B's 160 column blocks make 480 programs). The 27B's whole
    decode step with them: 0.782 x the time with the pairs' tiles (verify 3 0.800, draft 3 0.886:
    ab_step.py --plans int4, then the SwiGLU's 2 deep 0.983 x: --plans int4tiles). The 35B-A3B's
    interleaved experts at a step (8 of them, `--experts-only`): gate|up 64 x 256, 4 warps, 4 deep
    14.0 us (32 x 512, 2 warps: 20.5; natural, pairs: 22.3; bf16 11.5), down 64 x 512, 4 warps, 3
    deep 7.0 (natural 10.3; bf16 7.6); the 35B-A3B's int4 decode step with all its weights
    interleaved 0.724 x the natural layout's, and the experts' gate|up tile then 0.979 x (verify 3
    0.907: ab_step.py --model qwen3.5-35b-a3b --plans int4 / int4tiles). Once the split products'
    words loaded in 16-byte copies (2026-11-27), the 27B's MLP down [5120 x 17408] took 23.9 us in
    4 parts of 32 x 256, 2 warps, 6 deep, against 25.8 in 3 of 32 x 512 (out_proj: 11.6 either
    way; bench_int4.py --kinds split), and the decode step 0.986 x (verify 3 0.994: ab_step.py
    --plans int4tiles): a split tile of rows of 16384 or more comes with its parts,
    (S, BN, BK, warps, stages). On an H200 at a verify's 4 rows (bench_int4.py --interleaved-only
    --kinds split --rows-timed 4,1, 2026-11-29) the down took 23.5 us in 4 parts of 32 x 512, 2
    warps, 3 deep against 23.7 on 32 x 256, 6 deep, and the 27B int4's steps with it 0.994 x
    (decode), 0.993 x (verify 3), draft 3 1.001 x (ab_step.py --plans int4tiles); the out_proj and
    o_proj [5120 x 6144], 10.6 us alone in those 4 parts of 32 x 256 against 11.0 in 3 of 32 x 512,
    4 deep, made the step's verify 3 1.009 x slower, so they keep the latter. The experts' down
    [2048 x 512] in a verify of 4 rows (31 experts, the layout derived by the kernels:
    bench_int4.py --experts-only --rows-timed 4,1) took 21.5 us
    on 128 x 256, 8 warps, 2 deep against 30.5 on 64 x 512, 4 warps, 3 deep (one K step a program:
    1,056 programs of 96 KB of shared memory, two an SM; 7.1 us either way for a decode's 8), and
    the 35B-A3B's verify 3 step 0.962 x (decode 0.991, draft 3 0.995: ab_step.py --plans int4tiles,
    H100, 2026-11-27); the SwiGLU on 64 x 512, 3 deep, 1.013 x, stays. Then the SwiGLU's gate and
    up tiles as one (ProductPlan.int4_expert_stacked: 2 BN rows, one dot a group, 16 rows a warp,
    half the instructions a thread of the 64-column tile apart, sm_90) on 32 columns, 4 warps, 4
    deep: the 35B-A3B int4's decode step 0.967 x the 64 apart, verify 3 1.003, draft 3 0.989
    (ab_step.py --plans int4stacked; 64 x 256 on 8 warps 0.983 / 1.009 / 0.997): the interleaved
    experts' SwiGLU tile, stacked (moe.tiles)."""
    if interleaved and product == "split" and K >= 16384:
        return (4, 32, 512, 2, 3), "interleaved"           # parts too (matvec_parts.split_config)
    if interleaved and product in ("plain", "split"):
        return (32, 512, 2, 4), "interleaved"
    if interleaved and product == "swiglu":
        return (32, 512, 2, 2), "interleaved"
    if interleaved and product == "expert_swiglu":
        return (32, 256, 4, 4), "interleaved"              # stacked (moe.tiles)
    if interleaved and product == "expert_down":
        return (128, 256, 8, 2), "interleaved"
    if product in ("plain", "split"):
        return (64, 1024, 4, 2), "pairs"
    if product == "swiglu":
        return (64, 256, 4, 4), "pairs"
    if product == "expert_swiglu":
        return (32, 256, 4, 4), "pairs"
    return (64, 512, 4, 3), "reshape"


def form_of(form: str | None, product: str, N: int, K: int) -> str:
    """A plan's int4_form, or where it names none the product's measured one."""
    return form if form is not None else measured(product, N, K)[1]


# The pairs form's unpacking, for bf16 (and fp16) x. One word holds nibbles 0 .. 7; masking the
# word (shifted right by 4 p) with 0x000F000F keeps nibble p in the low half and nibble p + 4 in
# the high one, and or-ing 0x4300 into each half makes the bf16 128 + q (fp16: 0x6400, 1024 + q),
# one lop3 for both. One fma of the pair, times 1 plus -(128 + zero), gives q - zero exactly. The
# halves become two 16-bit results by renaming registers. Ampere and Ada have every instruction
# (fma.rn.bf16x2 from sm_80).
def _pairs_asm(one: str, magic: str, fma: str) -> str:
    """The pairs form's assembly: word $8 -> nibble p in $p and nibble p + 4 in $(p + 4), each less
    the zero ($9, the pair -(magic + zero))."""
    lines = [".reg .b32 s, t, one;", f"mov.b32 one, {one};"]
    for p in range(4):
        if p:
            lines.append(f"shr.u32 s, $8, {4 * p};")
        lines += [f"lop3.b32 t, {'s' if p else '$8'}, 0x000F000F, {magic}, 0xEA;",   # (word & mask) | magic
                  f"fma.rn.{fma} t, t, one, $9;",
                  f"mov.b32 {{${p}, ${p + 4}}}, t;"]
    return "{\n" + "\n".join(lines) + "\n}"


PAIRS_BF16 = _pairs_asm("0x3F803F80", "0x43004300", "bf16x2")
PAIRS_FP16 = _pairs_asm("0x3C003C00", "0x64006400", "f16x2")


# The interleaved form's unpacking: the same arithmetic on a 32-bit pair of half-words (two
# neighbouring columns of each quarter, the module docstring), each result a register of two
# weights of one quarter's dot, as the dot takes them: no byte permutes.
def _quarters_asm(one: str, magic: str, fma: str) -> str:
    """Half-words $4 (two) -> quarter q's two weights in $q (q = 0 .. 3), each less the zero ($5)."""
    lines = [".reg .b32 s, t, one;", f"mov.b32 one, {one};"]
    for q in range(4):
        if q:
            lines.append(f"shr.u32 s, $4, {4 * q};")
        lines += [f"lop3.b32 t, {'s' if q else '$4'}, 0x000F000F, {magic}, 0xEA;", f"fma.rn.{fma} ${q}, t, one, $5;"]
    return "{\n" + "\n".join(lines) + "\n}"


QUARTERS_BF16 = _quarters_asm("0x3F803F80", "0x43004300", "bf16x2")
QUARTERS_FP16 = _quarters_asm("0x3C003C00", "0x64006400", "f16x2")


if tl is not None:
    _SLICED, _PAIRED = tl.constexpr(SLICED), tl.constexpr(PAIRED)
    _INTERLEAVED, _INTERLEAVED_ASM = tl.constexpr(INTERLEAVED), tl.constexpr(INTERLEAVED_ASM)
    _PAIRS_BF16, _PAIRS_FP16 = tl.constexpr(PAIRS_BF16), tl.constexpr(PAIRS_FP16)
    _QUARTERS_BF16, _QUARTERS_FP16 = tl.constexpr(QUARTERS_BF16), tl.constexpr(QUARTERS_FP16)

    @triton.jit
    def _offset(b_z):
        """The zeros b_z (int32) or'ed into 0x4300: 128 + zero in bf16 (_less_zero)."""
        return (b_z | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _less_zero(b_n, b_o, b_x):
        """4-bit values b_n (int32, 0 .. 15) -> q - zero in b_x's dtype, b_o 128 + zero (_offset, a
        shape that broadcasts to b_n's): the value or'ed into 0x4300 too, whose bf16 is 128 + the
        value, so the difference is exact in bf16."""
        b_w = (b_n | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)                 # 128 + q
        if b_x.dtype == tl.bfloat16:
            return b_w - b_o
        else:
            return (b_w.to(tl.float32) - b_o.to(tl.float32)).to(b_x.dtype)

    @triton.jit
    def widen(b_q, b_z, b_x):
        """Words [BN, W] -> the weights [BN, 8 W] as q - zero in b_x's dtype (b_z [BN] int32)."""
        BN: tl.constexpr = b_q.shape[0]
        W: tl.constexpr = b_q.shape[1]
        b_n = (b_q[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF      # [BN, W, 8]
        return _less_zero(tl.reshape(b_n, [BN, W * 8]), _offset(b_z)[:, None], b_x)   # column 8 w + j

    @triton.jit
    def widen_nibble(b_q, j: tl.constexpr, b_z, b_x):
        """Nibble j of each word [BN, W] -> the weights [BN, W] as q - zero in b_x's dtype."""
        return _less_zero((b_q >> (4 * j)) & 0xF, _offset(b_z)[:, None], b_x)

    @triton.jit
    def nibbles(b_q, b_z, b_x, ASM: tl.constexpr):
        """Words [BN, W] -> their 8 nibbles as 8 tensors [BN, W] of q - zero in b_x's dtype (b_z
        [BN] int32): with ASM two a register (the pairs' assembly), where x is bf16 or fp16; else
        one at a time (widen_nibble). The same integers either way."""
        if ASM and b_x.dtype == tl.bfloat16:
            b_m = (b_z | 0xC300)[:, None] + tl.zeros(b_q.shape, tl.int32)  # bf16 -(128 + zero)
            return tl.inline_asm_elementwise(_PAIRS_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
                                             [b_q, b_m | (b_m << 16)], dtype=(tl.bfloat16,) * 8,
                                             is_pure=True, pack=1)
        elif ASM and b_x.dtype == tl.float16:
            b_m = (b_z | 0xE400)[:, None] + tl.zeros(b_q.shape, tl.int32)  # fp16 -(1024 + zero)
            return tl.inline_asm_elementwise(_PAIRS_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
                                             [b_q, b_m | (b_m << 16)], dtype=(tl.float16,) * 8,
                                             is_pure=True, pack=1)
        else:
            return (widen_nibble(b_q, 0, b_z, b_x), widen_nibble(b_q, 1, b_z, b_x),
                    widen_nibble(b_q, 2, b_z, b_x), widen_nibble(b_q, 3, b_z, b_x),
                    widen_nibble(b_q, 4, b_z, b_x), widen_nibble(b_q, 5, b_z, b_x),
                    widen_nibble(b_q, 6, b_z, b_x), widen_nibble(b_q, 7, b_z, b_x))

    @triton.jit
    def quarters(b_h, b_z, b_x, ASM: tl.constexpr):
        """Half-words (int16, interleaved; any shape) -> their 4 nibbles as 4 tensors of their shape,
        q - zero in b_x's dtype (b_z int32, the half-words' shape): with ASM two a register, where x
        is bf16 or fp16, else one at a time; the same integers either way."""
        if ASM and b_x.dtype == tl.bfloat16:
            return tl.inline_asm_elementwise(_QUARTERS_BF16, "=r,=r,=r,=r,r,r", [b_h, (b_z | 0xC300).to(tl.int16)],
                                             dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)     # bf16 -(128 + zero)
        elif ASM and b_x.dtype == tl.float16:
            return tl.inline_asm_elementwise(_QUARTERS_FP16, "=r,=r,=r,=r,r,r", [b_h, (b_z | 0xE400).to(tl.int16)],
                                             dtype=(tl.float16,) * 4, is_pure=True, pack=2)     # fp16 -(1024 + zero)
        else:
            b_q, b_o = b_h.to(tl.int32), _offset(b_z)
            return (_less_zero(b_q & 0xF, b_o, b_x), _less_zero((b_q >> 4) & 0xF, b_o, b_x),
                    _less_zero((b_q >> 8) & 0xF, b_o, b_x), _less_zero((b_q >> 12) & 0xF, b_o, b_x))

    @triton.jit
    def _x_tile(p_x, m_x, o_k, K, perm):
        """x's tile [len(o_k), BT] for the weight columns o_k (< K), read through perm where there
        is one; rows' pointers p_x [1, BT] (m_x [BT])."""
        m_k = o_k < K
        if perm is None:
            o_x = o_k
        else:
            o_x = tl.load(perm + o_k, mask=m_k, other=0)
        return tl.load(p_x + o_x[:, None], mask=m_k[:, None] & m_x[None, :], other=0.)

    @triton.jit
    def dot_int4(b_acc, w, sw, zw, perm, o_r, m_r, s_w, s_sw, p_x, m_x, k, K,
                 BK: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, UNPACK: tl.constexpr = 0):
        """b_acc [BN, BT] + the weight rows o_r [BN] (m_r) over columns k .. k + BK @ x's tile,
        whose rows' pointers are p_x [1, BT] (m_x [BT]): one dot a group (or a tile inside one,
        BG columns), its float32 result times the group's scales. zw None: symmetric (zero 8);
        perm (not None): column c of the weight reads x's column perm[c]. UNPACK: the unpack form
        (form_args): one dot a group, or 8 over the words' nibbles, made one or two at a time; or,
        over an interleaved weight (int16 half-words, no perm), 4 over its quarters; x's tiles then
        load without masks, so every one of p_x's row pointers must lie in x (the callers' rows
        past T repeat a row of x, whose sums nobody stores), and a sub-tile past K reads x's last
        group (its weights masked to scale 0)."""
        Q: tl.constexpr = BG // 4                                # an interleaved group's quarter
        for i in tl.static_range(BK // BG):
            kk = k + i * BG
            o_c = kk // 8 + tl.arange(0, BG // 8)
            m_g = m_r & (tl.full(o_r.shape, kk, tl.int32) < K)   # K is whole groups: a sub-tile lies in K or past it
            b_s = tl.load(sw + o_r * s_sw + kk // G, mask=m_g, other=0.).to(tl.float32)
            if zw is None:
                b_z = tl.full(o_r.shape, 8, tl.int32)          # SYMMETRIC_ZERO
            else:
                b_z = tl.load(zw + o_r * s_sw + kk // G, mask=m_g, other=0).to(tl.int32)
            if UNPACK == _INTERLEAVED or UNPACK == _INTERLEAVED_ASM:
                o_h = kk // 4 + tl.arange(0, Q)
                b_h = tl.load(w + o_r[:, None] * s_w + o_h[None, :], mask=m_g[:, None], other=0)
                p_q = p_x + (tl.minimum(kk, K - BG) + tl.arange(0, Q))[:, None]      # x's, in x
                b_x0, b_x1, b_x2, b_x3 = tl.load(p_q), tl.load(p_q + Q), tl.load(p_q + 2 * Q), tl.load(p_q + 3 * Q)
                n0, n1, n2, n3 = quarters(b_h, b_z[:, None] + tl.zeros(b_h.shape, tl.int32), b_x0,
                                          UNPACK == _INTERLEAVED_ASM)
                b_d = tl.dot(n0, b_x0, input_precision="ieee")
                b_d = tl.dot(n1, b_x1, b_d, input_precision="ieee")
                b_d = tl.dot(n2, b_x2, b_d, input_precision="ieee")
                b_d = tl.dot(n3, b_x3, b_d, input_precision="ieee")
                b_acc += b_s[:, None] * b_d
            elif UNPACK == _PAIRED or UNPACK == _SLICED:
                b_q = tl.load(w + o_r[:, None] * s_w + o_c[None, :], mask=m_g[:, None] & (o_c < K // 8)[None, :], other=0)
                b_x = _x_tile(p_x, m_x, o_c * 8, K, perm)
                n0, n1, n2, n3, n4, n5, n6, n7 = nibbles(b_q, b_z, b_x, UNPACK == _PAIRED)
                b_d = tl.dot(n0, b_x, input_precision="ieee")
                b_d = tl.dot(n1, _x_tile(p_x, m_x, o_c * 8 + 1, K, perm), b_d, input_precision="ieee")
                b_d = tl.dot(n2, _x_tile(p_x, m_x, o_c * 8 + 2, K, perm), b_d, input_precision="ieee")
                b_d = tl.dot(n3, _x_tile(p_x, m_x, o_c * 8 + 3, K, perm), b_d, input_precision="ieee")
                b_d = tl.dot(n4, _x_tile(p_x, m_x, o_c * 8 + 4, K, perm), b_d, input_precision="ieee")
                b_d = tl.dot(n5, _x_tile(p_x, m_x, o_c * 8 + 5, K, perm), b_d, input_precision="ieee")
                b_d = tl.dot(n6, _x_tile(p_x, m_x, o_c * 8 + 6, K, perm), b_d, input_precision="ieee")
                b_d = tl.dot(n7, _x_tile(p_x, m_x, o_c * 8 + 7, K, perm), b_d, input_precision="ieee")
                b_acc += b_s[:, None] * b_d
            else:
                b_q = tl.load(w + o_r[:, None] * s_w + o_c[None, :], mask=m_g[:, None] & (o_c < K // 8)[None, :], other=0)
                b_x = _x_tile(p_x, m_x, kk + tl.arange(0, BG), K, perm)
                b_acc += b_s[:, None] * tl.dot(widen(b_q, b_z, b_x), b_x, input_precision="ieee")
        return b_acc
else:
    widen = widen_nibble = dot_int4 = None
