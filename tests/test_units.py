"""One byte formatter (engine/units.py), binary units, used by the memory plan, the model cache, the
app's panel, bench and the progress bars: no other place formats byte sizes by hand."""
import re
from pathlib import Path

from mtpchat.app.gauges import size
from mtpchat.engine import memory
from mtpchat.engine.units import fmt_bytes

ROOT = Path(__file__).resolve().parent.parent


def test_binary_units_one_decimal():
    assert fmt_bytes(0) == "0 B" and fmt_bytes(1023) == "1023 B"
    assert fmt_bytes(1024) == "1.0 KiB" and fmt_bytes(1536 * 1024) == "1.5 MiB"
    assert fmt_bytes(int(50.1 * 2 ** 30)) == "50.1 GiB" and fmt_bytes(3 * 2 ** 40) == "3.0 TiB"
    assert memory.fmt_bytes is fmt_bytes and size(5 * 2 ** 30) == "5.0 GiB" and size(None) == "N/A"


def test_no_hand_made_byte_units_in_the_runtime():
    # "/ 1e9 ... GB" or "/ 2**30 ... GiB" formatted by hand: a second convention creeping back
    hand = re.compile(r"/\s*(1e9|1e6|2\s*\*\*\s*30|2\s*\*\*\s*20|\(1 << 30\)|1 << 30)\b[^\n]*\b(GB|MB|GiB|MiB)\b")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("mtpchat", "engine") for p in (ROOT / folder).rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if hand.search(line)]
    assert not found, found
