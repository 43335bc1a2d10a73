"""Fixed glibc malloc thresholds for decoding on the CPU.

A decode step on the CPU frees and allocates the same temporaries every step, some of them a little
larger each step (the attention's copies of the keys and values grow with the context). glibc moves
its trim threshold as blocks come and go, so the free top of the heap keeps going back to the system
and the next step faults the same pages in again. On the tiny test checkpoint with MTP on that was
about 400,000 page faults per 2,048 tokens and 640-700 instead of 850-920 tokens/s; on the demo
model, k=3 decoded 4-5% slower. Fixed thresholds keep those blocks: at most TRIM bytes of free memory
stay in the process, and blocks of MMAP bytes or more (weights, caches) are still mapped on their
own and go back to the system when freed.

Only glibc has mallopt with these meanings (musl, macOS and Windows allocate differently), so
anywhere else this does nothing. The CLI calls it once, before an engine loads, for CPU runs only: a
GPU run allocates little on the host per step, and the kept memory would buy nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3   # glibc's <malloc.h>
TRIM = 256 << 20
TOP_PAD = 16 << 20
MMAP = 32 << 20          # glibc's own ceiling for its moving threshold on 64-bit systems


def is_glibc(platform: str | None = None, confstr=None) -> bool:
    platform = sys.platform if platform is None else platform
    if not platform.startswith("linux"):
        return False
    try:
        version = (confstr or os.confstr)("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return False
    return bool(version) and version.startswith("glibc")


def settings() -> list[tuple[int, int]]:
    return [(M_MMAP_THRESHOLD, MMAP), (M_TRIM_THRESHOLD, TRIM), (M_TOP_PAD, TOP_PAD)]


def keep_step_memory(platform: str | None = None, confstr=None, libc=None) -> bool:
    """Sets the thresholds when the C library is glibc; returns whether it did."""
    if not is_glibc(platform, confstr):
        return False
    if libc is None:
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            return False
    # mallopt returns 1 on success; a refusal leaves glibc's own behaviour, which is merely slower
    return all([libc.mallopt(param, value) == 1 for param, value in settings()])


def cpu_allocator(device: str) -> bool:
    """Before an engine loads on the CPU: glibc's malloc thresholds fixed, so the temporaries each
    decode step frees and allocates again stay in the process. Whether they were set; a GPU run
    leaves the allocator as it is."""
    if not str(device).startswith("cpu"):
        return False
    return keep_step_memory()
