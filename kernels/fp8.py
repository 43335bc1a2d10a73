"""Block-scaled FP8 weights, the format of Qwen's official FP8 checkpoints: w [N, K] in float8_e4m3fn
and scale [ceil(N / 128), ceil(K / 128)] float32, one per 128 x 128 block, the dequantized weight
being w * scale blockwise (the checkpoints call it `weight_scale_inv`). The float32 references to
quantize and dequantize sit here; the products over such weights are in matvec.py (a few rows,
the scales applied in registers) and fp8_gemm.py (prefill).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

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


def values_of(w) -> torch.Tensor:
    """A product's weight tensor itself: w, or a BlockFP8's FP8 values (for device and dispatch checks)."""
    return w.w if isinstance(w, BlockFP8) else w


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
