"""A product's weight in any form the product kernels take: a tensor (bf16 or float32), a BlockFP8
(kernels/fp8.py) or a GroupInt4 (kernels/int4.py); what every product and its reference ask of it
whatever the form."""
from __future__ import annotations

import torch

from mtpchat.kernels import fp8, int4


def values_of(w) -> torch.Tensor:
    """A product's weight tensor itself: w, a BlockFP8's FP8 values or a GroupInt4's packed words
    (for device and dispatch checks)."""
    return w.w if isinstance(w, (fp8.BlockFP8, int4.GroupInt4)) else w


def dense_ref(w, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A product's weight as a dense [N, K] tensor in dtype: a BlockFP8 or a GroupInt4 dequantized
    (in float32, then cast), a tensor cast (the products' references)."""
    if isinstance(w, fp8.BlockFP8):
        return fp8.dequantize_ref(w, dtype)
    if isinstance(w, int4.GroupInt4):
        return int4.dequantize_ref(w, dtype)
    return w.to(dtype)
