"""Byte sizes as people read them: one function, one convention (binary units, one decimal), used by
the memory plan, the model cache, the app's panel and the progress bars. No torch here."""
from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: int | float) -> str:
    """'50.1 GiB', '64.0 KiB', '146.8 MiB', '512 B'."""
    size, i = float(n), 0
    while abs(size) >= 1024 and i < len(UNITS) - 1:
        size, i = size / 1024, i + 1
    return f"{int(n)} B" if i == 0 else f"{size:.1f} {UNITS[i]}"
