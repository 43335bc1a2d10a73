"""Text gauges for the telemetry pane: bars with eighth blocks, sparklines, byte sizes."""
from __future__ import annotations

from mtpchat.engine.units import fmt_bytes

_EIGHTHS = " ▏▎▍▌▋▊▉"
_SPARK = "▁▂▃▄▅▆▇█"
NA = "N/A"


def bar(frac: float, width: int) -> str:
    """A left-aligned bar `width` cells wide, filled to frac (clamped to 0..1)."""
    frac = min(max(frac, 0.0), 1.0)
    eighths = round(frac * width * 8)
    full, part = divmod(eighths, 8)
    s = "█" * full + (_EIGHTHS[part] if part else "")
    return s.ljust(width)


def sparkline(values, width: int, lo: float | None = None, hi: float | None = None) -> str:
    """The last `width` values as one line of block heights between lo and hi (default: their range)."""
    vals = list(values)[-width:]
    if not vals:
        return " " * width
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    if hi <= lo:
        return ("▄" * len(vals)).rjust(width)
    top = len(_SPARK) - 1
    out = "".join(_SPARK[min(top, max(0, round((v - lo) / (hi - lo) * top)))] for v in vals)
    return out.rjust(width)


def size(n: int | None) -> str:
    return NA if n is None else fmt_bytes(n)


def num(x: float | None, spec: str = ".1f", unit: str = "") -> str:
    return NA if x is None else f"{x:{spec}}{unit}"


def pct(x: float | None) -> str:
    return NA if x is None else f"{x * 100:.0f}%"
