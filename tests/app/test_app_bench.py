"""The app-against-headless bench (tests/bench/bench_app.py) runs end to end on the tiny
checkpoint: through the app the same prompt gives the same greedy reply as headless (the bench
stops where it does not), MTP off and on, and it prints both ratios. On the GPU the same script
measures the app's cost (docs/PERFORMANCE.md)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_app.py"


def test_the_app_bench_runs_and_the_app_replies_as_headless():
    done = subprocess.run([sys.executable, str(BENCH), "--tokens", "24", "--runs", "1", "--terminal", "none"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert "MTP off    app/headless" in out and "MTP on k=3 app/headless" in out, out[-2000:]
    on = next(line for line in out.splitlines() if line.startswith("MTP on k=3"))
    assert "mean acceptance length [1.0]" not in on, on        # the profile drafter took effect in both
