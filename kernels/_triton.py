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

__all__ = ["triton", "tl", "pdl", "pdl_start", "interpreting"]


def use_triton(*tensors) -> bool:
    """The kernels serve CUDA tensors outside autograd (they have no backward); anything else, a
    CPU tensor or a forward that records gradients, takes the float32 torch reference."""
    return tensors[0].is_cuda and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


# Programmatic dependent launch (Hopper and later). A decode step is a chain of some 590 kernels,
# half of them small (norms, conv, recurrence, attention) between the weight-streaming products.
# Launched in order, each waits for its predecessor to end before its programs are even placed;
# launched with PDL, a kernel's programs are placed as soon as the previous kernel's have all
# started, and wait (griddepcontrol.wait) for its results before reading or writing anything. Every
# step kernel starts with `pdl_start`, so a kernel that passes its wait knows that all before it
# have ended, and the launch latency of each kernel hides behind the one before.

def interpreting() -> bool:
    """Whether Triton runs kernels under its interpreter, where PDL and inline assembly do not exist:
    TRITON_INTERPRET as Triton itself reads it (its knobs), or as it reads booleans where it has none."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


@functools.cache
def _pdl_device(index: int) -> bool:
    return (tl is not None and not interpreting()
            and torch.cuda.get_device_capability(index) >= (9, 0))


def pdl(t: torch.Tensor) -> dict:
    """Launch options for a kernel that begins with `pdl_start`: {"PDL": True, "launch_pdl": True}
    for CUDA tensors on Hopper or later, {"PDL": False} elsewhere (CPU, the interpreter, Ampere)."""
    if t.is_cuda and _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if tl is not None:
    @triton.jit
    def pdl_start(PDL: tl.constexpr, LATE: tl.constexpr = False):
        """Let the next kernel's programs be placed (LATE: not yet, pdl_release does), then wait until
        the previous kernel has ended and its writes are visible. First in every step kernel, before
        any load, store or return."""
        if PDL:
            if not LATE:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def pdl_release(PDL: tl.constexpr):
        """Let the next kernel's programs be placed: in a kernel that began with pdl_start(PDL, LATE=True),
        once its program has read what it streams."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
else:
    pdl_start = pdl_release = None
