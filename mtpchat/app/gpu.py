"""Device readings for the memory panel: NVML on a GPU, the process's resident memory on a CPU.

Every NVML call is wrapped on its own: a query the driver does not support reads as None (shown as
N/A) and never raises. The probes are polled from a worker thread about once a second.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import Callable


@dataclass(frozen=True)
class GpuSample:
    name: str | None = None
    used: int | None = None        # bytes in use on the device (all processes)
    total: int | None = None
    power_w: float | None = None
    energy_j: float | None = None  # the driver's running energy counter, joules since it was loaded
    rss: int | None = None         # this process's resident memory (CPU runs)
    tokens: int | None = None      # tokens emitted by the app when this was read


def energy_per_token(prev: GpuSample | None, cur: GpuSample) -> float | None:
    """Joules per token between two readings, or None when it cannot be known."""
    if prev is None or prev.energy_j is None or cur.energy_j is None:
        return None
    if prev.tokens is None or cur.tokens is None or cur.tokens <= prev.tokens:
        return None
    return (cur.energy_j - prev.energy_j) / (cur.tokens - prev.tokens)


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return None


class NvmlProbe:
    def __init__(self, index: int = 0):
        self._nv = None
        self._handle = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nv = pynvml
        except Exception:
            pass   # no driver, no GPU, or no NVML: every reading is N/A

    @property
    def available(self) -> bool:
        return self._handle is not None

    def sample(self) -> GpuSample:
        if self._handle is None:
            return GpuSample()
        nv, h = self._nv, self._handle
        mem = _try(nv.nvmlDeviceGetMemoryInfo, h)
        name = _try(nv.nvmlDeviceGetName, h)
        power = _try(nv.nvmlDeviceGetPowerUsage, h)               # milliwatts
        energy = _try(nv.nvmlDeviceGetTotalEnergyConsumption, h)  # millijoules
        return GpuSample(name=name.decode() if isinstance(name, bytes) else name,
                         used=getattr(mem, "used", None), total=getattr(mem, "total", None),
                         power_w=power / 1e3 if power is not None else None,
                         energy_j=energy / 1e3 if energy is not None else None)


class ProcessProbe:
    """Resident memory of this process, from /proc on Linux, else the peak from getrusage."""

    def sample(self) -> GpuSample:
        return GpuSample(rss=process_rss())


def process_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:
        pass
    try:
        import resource
        import sys
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except Exception:
        return None


class Sampler:
    """Polls a probe every `interval` seconds on the calling (worker) thread until stopped.

    `wake()` asks for a reading now (at the end of a reply, so its energy is counted).
    """

    def __init__(self, probe, on_sample: Callable[[GpuSample], None],
                 token_counter: Callable[[], int], interval: float = 1.0):
        self.probe, self.on_sample, self.token_counter = probe, on_sample, token_counter
        self.interval = interval
        self._wake = threading.Event()
        self._stop = threading.Event()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                s = self.probe.sample()
                if s.tokens is None:
                    s = replace(s, tokens=self.token_counter())
                self.on_sample(s)
            except Exception:
                pass   # a broken probe must never take the app down; the panel keeps N/A
            self._wake.wait(self.interval)
            self._wake.clear()
