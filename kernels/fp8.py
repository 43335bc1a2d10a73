"""Block-scaled FP8 weights, the format of Qwen's official FP8 checkpoints: w [N, K] in float8_e4m3fn
and scale [ceil(N / 128), ceil(K / 128)] float32, one per 128 x 128 block, the dequantized weight
being w * scale blockwise (the checkpoints call it `weight_scale_inv`). The float32 references to
quantize and dequantize sit here, and `widen`, which the few-row products over such weights
(matvec.py, matvec_parts.py, moe.py: the scales applied in registers) use to bring a tile of them
to the activations' dtype; fp8_gemm.py takes prefill.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mtpchat.kernels._triton import interpreting, tl, triton

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0        # the largest finite float8_e4m3fn


FP8_CAPABILITY = (8, 9)  # Triton's float8_e4m3fn type needs Ada or Hopper


def fp8_runs_on(device) -> bool:
    """Whether the FP8 kernels run on `device`: a CUDA GPU of compute capability 8.9 or newer (the
    CPU takes the references, which dequantize)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


class BlockFP8(NamedTuple):
    """A product's weight in FP8 with its block scales; `shape` and `device` are the weight's."""
    w: torch.Tensor        # [N, K] float8_e4m3fn
    scale: torch.Tensor    # [ceil(N / BLOCK), ceil(K / BLOCK)] float32

    shape = property(lambda self: self.w.shape)
    device = property(lambda self: self.w.device)
    is_cuda = property(lambda self: self.w.is_cuda)

    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size() + self.scale.numel() * self.scale.element_size()


def scale_shape(N: int, K: int) -> tuple[int, int]:
    return -(-N // BLOCK), -(-K // BLOCK)


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [NB, BLOCK, KB, BLOCK], zero-padded to whole blocks."""
    N, K = t.shape
    NB, KB = scale_shape(N, K)
    padded = torch.nn.functional.pad(t, (0, KB * BLOCK - K, 0, NB * BLOCK - N))
    return padded.view(NB, BLOCK, KB, BLOCK)


def dequantize_ref(q: BlockFP8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w * scale per block, in float32, cast to dtype."""
    N, K = q.w.shape
    w = _blocks(q.w.float()) * q.scale.float()[:, None, :, None]
    return w.view(w.shape[0] * BLOCK, -1)[:N, :K].to(dtype)


def quantize_ref(w: torch.Tensor) -> BlockFP8:
    """A weight to FP8 with one scale per 128 x 128 block: scale = amax / 448 (1 for a block of
    zeros), w / scale rounded to the nearest float8_e4m3fn. As the official checkpoints are made,
    so quantizing on load gives the weights an offline quantization would."""
    N, K = w.shape
    b = _blocks(w.float())
    amax = b.abs().amax(dim=(1, 3))                                      # [NB, KB]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (b / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return BlockFP8(q.view(scale.shape[0] * BLOCK, -1)[:N, :K].contiguous(), scale.contiguous())


# --- widening a tile of e4m3 weights to bf16 in a kernel ---------------------------------------------
# Triton's .to(tl.bfloat16) of e4m3 compiles (sm_90, Triton 3.6) to one e4m3x2 -> f16x2 conversion,
# two scalar f16 -> bf16 conversions and a byte permute per pair of weights: 1.5 conversions a
# weight on the conversion units, more than they keep up with at 3 TB/s of FP8. The bit form takes
# integer and bf16x2 instructions only, about 3 a weight (tests/bench/sass_fp8.py counts them).

# The bit form is the plan's default (kernels/plan.py widen_bits): the FP8 27B's decode step 0.846 x,
# the 35B-A3B's 0.848 x, outputs bit-equal to the conversion's (tests/kernels/test_fp8_widen.py).


def bf16_of_e4m3_ref(w: torch.Tensor) -> torch.Tensor:
    """The bit form's arithmetic in torch (what `widen` computes with BITS): each byte's sign to bit
    15 and its exponent and mantissa to bits 4..10 of a bf16, which then holds the value / 2^120
    (e4m3's exponent bias is 7, bf16's 127; subnormals included), times 2^120, exact in bf16. Equal
    to the conversion for every byte but the two NaNs (0x7F, 0xFF), which become +-480."""
    b = w.view(torch.uint8).to(torch.int32)
    bits = ((b & 0x7F) << 4) | ((b & 0x80) << 8)                      # 0 .. 0x87F0
    bits = bits - ((bits & 0x8000) << 1)                               # as a signed 16-bit value
    return (bits.to(torch.int16).view(torch.bfloat16) * 2.0 ** 120).to(torch.bfloat16)


def widen_group(capability: tuple[int, int], warps: int, BN: int) -> int:
    """The bit form's group (2 or 4 weights) for a tile of BN weight rows on `warps` warps on a GPU
    of this compute capability (widen_args)."""
    return 2 if capability[0] == 9 and warps % 4 == 0 and BN >= 64 else 4


def widen_args(x: torch.Tensor, warps: int, BN: int, bits: bool, group: int = 0) -> dict:
    """How a product kernel with tiles of BN weight rows on `warps` warps widens its FP8 tiles:
    {"BITS": 0}, Triton's conversion (float32 activations, the CPU, the interpreter, which runs no
    inline assembly, or `bits` off: the plan's widen_bits), or the bit form over groups of `group`
    weights (the plan's widen_group), or where that is 0 of 2 or 4 as the tile suits. Two where
    the dot takes Hopper's wgmma (4 warps, 64 rows or more), whose register operand gives each
    thread pairs of weights along K (groups of 4 would be regrouped by byte permutes first: 2.25
    more instructions a weight); four under mma.sync."""
    if not (bits and x.is_cuda and x.dtype == torch.bfloat16 and not interpreting()):
        return {"BITS": 0}
    return {"BITS": group or widen_group(torch.cuda.get_device_capability(x.device), warps, BN)}


def fp8_fit(tile: tuple, K: int) -> tuple:
    """An FP8 tile (..., BK, warps, stages) as a product of K columns can take it: a BK of two
    128-column scale blocks (a K step then takes them one after another: fp8_run) only where it
    divides K, else one block; a K step past K would read a scale past its row. (Four blocks a
    step compiled to other sums on an H200, and were slower: not taken.)"""
    *head, BK, warps, stages = tile
    assert (BK <= BLOCK and BLOCK % BK == 0) or BK == 2 * BLOCK, \
        f"an FP8 tile's K ({BK}) must divide {BLOCK} or be twice it"
    return (*head, BK if BK <= BLOCK or K % BK == 0 else BLOCK, warps, stages)


def fp8_run(BK: int, fp8: bool) -> dict:
    """The RUN launch argument of the product kernels: the 128-column scale blocks an FP8 tile of BK
    columns spans, taken one after another in each K step (each its own tile load, dot and scale,
    so a program's sums are those of one block a step, in the same order), 1 otherwise. Each
    weight row then streams in runs of RUN x 128 bytes. A product split over K in whole tiles
    (matvec.tail_split) may split elsewhere under a wider tile, and then sums other ranges: on the
    27B's shapes the splits fall on the same columns, so its products keep their bits."""
    return {"RUN": BK // BLOCK if fp8 and BK > BLOCK else 1}


if tl is not None:
    @triton.jit
    def _bf16_of_e4m3_x2(b_w):
        # two bytes a 16-bit register, widened to bytes 1 and 3 of a 32-bit one (the high halves of
        # two 16-bit lanes); and/shift/lop3 make sign | (exponent, mantissa) << 4; one bf16x2
        # multiply by 2^120 (an fma adding -0, so that a zero keeps its sign)
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 a, b, k, z;
            mov.b32 k, 0x7B807B80;
            mov.b32 z, 0x80008000;
            cvt.u32.u16 a, $1;
            prmt.b32 a, a, 0, 0x1404;
            and.b32 b, a, 0x7FFF7FFF;
            shr.b32 b, b, 4;
            lop3.b32 b, b, 0x80008000, a, 0xF8;
            fma.rn.bf16x2 $0, b, k, z;
            }""",
            "=r,h", [b_w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def _bf16_of_e4m3_x4(b_w):
        # as _x2, four bytes a 32-bit register: bytes 0, 1 and 2, 3 to two results
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 a0, a1, b0, b1, k, z;
            mov.b32 k, 0x7B807B80;
            mov.b32 z, 0x80008000;
            prmt.b32 a0, $2, 0, 0x1404;
            prmt.b32 a1, $2, 0, 0x3424;
            and.b32 b0, a0, 0x7FFF7FFF;
            and.b32 b1, a1, 0x7FFF7FFF;
            shr.b32 b0, b0, 4;
            shr.b32 b1, b1, 4;
            lop3.b32 b0, b0, 0x80008000, a0, 0xF8;
            lop3.b32 b1, b1, 0x80008000, a1, 0xF8;
            fma.rn.bf16x2 $0, b0, k, z;
            fma.rn.bf16x2 $1, b1, k, z;
            }""",
            "=r,=r,r", [b_w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4)

    @triton.jit
    def widen(b_w, b_x, BITS: tl.constexpr):
        """A tile of e4m3 weights in b_x's dtype: by moving bits, 2 or 4 weights a group (BITS; bf16
        b_x only), or by Triton's conversion (BITS 0)."""
        if BITS == 2:
            tl.static_assert(b_x.dtype == tl.bfloat16, "the bit form widens to bf16 only")
            return _bf16_of_e4m3_x2(b_w)
        elif BITS == 4:
            tl.static_assert(b_x.dtype == tl.bfloat16, "the bit form widens to bf16 only")
            return _bf16_of_e4m3_x4(b_w)
        else:
            return b_w.to(b_x.dtype)
else:
    widen = None
