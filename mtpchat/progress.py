"""Progress bars on the terminal (tqdm) for what takes a while: loading weights (and quantizing them
on load), capturing CUDA graphs, downloading a model. The engine only calls back with
`LoadProgress` values; drawing them is the CLI's business, and the app draws its own.
"""
from __future__ import annotations

import sys
import time

from mtpchat.engine.units import fmt_bytes
from mtpchat.models import WEIGHT_LABELS

STAGES = {"weights": "loading weights", "capture": "capturing CUDA graphs"}


def stage_label(p) -> str:
    """The stage's name, and what its weights are quantized to as they load (`quantizing` names
    the format: "fp8", "int4")."""
    to = p.quantizing
    return STAGES.get(p.stage, p.stage) + (f", quantizing to {WEIGHT_LABELS.get(to, to)}" if to else "")


def describe(p, elapsed: float) -> str:
    """'1.2 GiB / 50.1 GiB, 120/800 tensors, 1.1 GiB/s' (weights) or '12/30 steps'."""
    if p.stage != "weights":
        return f"{p.done}/{p.total} {p.unit}"
    rate = f", {fmt_bytes(p.done / elapsed)}/s" if elapsed > 0 else ""
    return f"{fmt_bytes(p.done)} / {fmt_bytes(p.total)}, {p.tensors}/{p.tensors_total} tensors{rate}"


class LoadBar:
    """A `progress` callable for Engine.load drawing one tqdm bar per stage, on stderr by default
    (off where stderr is not a terminal, unless a `file` is given). Call `close()` at the end."""

    def __init__(self, file=None, min_interval: float = 0.1):
        self.file = file if file is not None else sys.stderr
        self.disable = None if file is None else False     # tqdm: None = off unless a terminal
        self.min_interval = min_interval
        self.bar = self.stage = None
        self.t0 = 0.0

    def __call__(self, p) -> None:
        from tqdm import tqdm
        label = stage_label(p)
        if label != self.stage:
            self.close()
            self.stage, self.t0 = label, time.perf_counter()
            self.bar = tqdm(total=p.total, desc=label, file=self.file, disable=self.disable,
                            mininterval=self.min_interval, leave=True, dynamic_ncols=True)
        # our own figures in the bar's line (tqdm's own byte units are decimal; ours are binary)
        self.bar.bar_format = ("{desc}: {percentage:3.0f}%|{bar}| " + describe(p, time.perf_counter() - self.t0)
                               + " [{elapsed}<{remaining}]")
        self.bar.update(p.done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = self.stage = None
