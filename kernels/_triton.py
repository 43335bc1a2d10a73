"""Triton where it is installed (Linux); elsewhere stand-ins, so the float32 references still import
and the kernels' decorators are no-ops. The Triton paths are only taken for CUDA tensors."""
from __future__ import annotations

import types

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
