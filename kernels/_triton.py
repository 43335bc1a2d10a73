"""Triton where it is installed (Linux); elsewhere stand-ins, so the float32 references still import
and the kernels' decorators are no-ops. The Triton paths are only taken for CUDA tensors."""
from __future__ import annotations

import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    def _jit(fn=None, **_options):
        return fn if fn is not None else (lambda f: f)

    triton = types.SimpleNamespace(jit=_jit, cdiv=lambda a, b: -(-a // b),
                                   next_power_of_2=lambda n: 1 << max(0, n - 1).bit_length())
    tl = None

__all__ = ["triton", "tl"]


def use_triton(*tensors) -> bool:
    """The kernels serve CUDA tensors outside autograd (they have no backward); anything else, a
    CPU tensor or a forward that records gradients, takes the float32 torch reference."""
    return tensors[0].is_cuda and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
