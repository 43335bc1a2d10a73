"""Triton where it is installed (Linux); elsewhere stand-ins, so the float32 references still import
and the kernels' decorators are no-ops. The Triton paths are only taken for CUDA tensors."""
from __future__ import annotations

import functools
import os
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

__all__ = ["triton", "tl", "pdl", "pdl_start", "prefetch_rows"]


def use_triton(*tensors) -> bool:
    """The kernels serve CUDA tensors outside autograd (they have no backward); anything else, a
    CPU tensor or a forward that records gradients, takes the float32 torch reference."""
    return tensors[0].is_cuda and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


# Programmatic dependent launch (Hopper and later). A step is a chain of some 450 kernels, most of
# them either tiny or a product whose weights do not depend on the kernels before it. Launched with
# PDL, a kernel's programs may start while the previous kernel still runs: each kernel lets its
# successor launch as soon as it starts, and waits for its predecessor's results (griddepcontrol.wait)
# before it reads any activation or writes anything. Before that wait a product only prefetches its
# first weight tiles into L2, so the tail of one kernel and the launch of the next overlap with
# weight traffic. Measured on an H100 it gained nothing over CUDA graphs alone (docs/PERFORMANCE.md),
# so it is off unless MTPCHAT_PDL=1.

@functools.cache
def _pdl_device(index: int) -> bool:
    return (tl is not None and hasattr(tl.extra.cuda, "gdc_wait") and os.environ.get("MTPCHAT_PDL", "0") == "1"
            and os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.get_device_capability(index) >= (9, 0))


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with programmatic dependent launch."""
    return t.is_cuda and _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device())


if tl is not None:
    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """Let the next kernel launch, then wait for the previous one's results (a no-op without PDL)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def pdl_release(PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def prefetch_rows(base, o_rows, stride, NBYTES: tl.constexpr):
        """Hint L2 to fetch the first NBYTES (a multiple of 16) of rows base + o_rows * stride, each
        16-byte aligned. Issued only before a product's wait; its result is never read."""
        if NBYTES > 0:
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                      [base + o_rows * stride, o_rows.to(tl.int32) * 0 + NBYTES],
                                      dtype=tl.int32, is_pure=False, pack=1)
else:
    pdl_start = pdl_release = pdl_wait = prefetch_rows = None


def prefetch_bytes(w: torch.Tensor, limit: int = 2048) -> int:
    """How many bytes of each row of w a product may prefetch: 0 unless its rows are 16-byte aligned."""
    row = w.stride(0) * w.element_size()
    if not pdl(w) or w.data_ptr() % 16 or row % 16:
        return 0
    return min(limit, w.shape[1] * w.element_size()) // 16 * 16
