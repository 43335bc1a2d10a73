"""A pinned demo: the app on the fake engine with 27B-on-H100-like simulated timings.

The snapshot tests and the README screenshot both use it, so every number on screen is fixed:
the fake engine's simulated clock, the fake GPU's readings, and a fixed wall clock for timestamps.

    python -m mtpchat.app.demo assets/screenshot.svg      # re-render the README screenshot
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from mtpchat.app.chat import Composer
from mtpchat.app.fake import DEFAULT_ANSWER, FakeEngine, FakeGpu, FakeTimes
from mtpchat.app.main import build_app, dev_args

MODEL = "Qwen3.6-27B-MTP (simulated)"
CHAT = [
    ("Hi! What are you running on?",
     "Qwen3.6-27B on one GPU, decoding with its own **MTP head** as the drafter: it proposes a few "
     "tokens, and one forward pass of the full model checks them all."),
    ("How does the MTP head speed up decoding?", None),   # None: the fake engine's default answer
]
NOW = 1_767_225_600.0   # 2026-01-01 00:00 UTC
# about what a 27B model on one H100 spends per phase (bandwidth-bound: ~51 GB per target forward)
TIMES = FakeTimes(prefill_per_token=0.25, first_sample=28.0, draft_per_token=1.6, verify_base=26.5,
                  verify_per_token=0.5, accept=0.15, host=0.12)


def build(data_dir: str | Path):
    engine = FakeEngine(name=MODEL, device="cuda", times=TIMES)
    args = dev_args(["--data-dir", str(data_dir), "--device", "cuda", "--dtype", "bfloat16"])
    app = build_app(args, load_engine=lambda progress=None: engine, probe=FakeGpu, now=lambda: NOW, gpu_interval=0.05)
    app.model_name = MODEL
    return app


async def play(pilot) -> None:
    """Play the chat, then wait for the energy reading and the final redraw."""
    app = pilot.app
    await _until(pilot, lambda: app.engine is not None)
    composer = app.query_one(Composer)
    composer.cursor_blink = False
    for i, (prompt, answer) in enumerate(CHAT):
        app.engine.answer = answer or DEFAULT_ANSWER
        composer.text = prompt
        await pilot.press("enter")
        await _until(pilot, lambda: len(app.query("MessageView")) >= 2 * (i + 1) and not app.busy)
    await _until(pilot, lambda: app.telemetry.joules_per_token is not None
                 and app.telemetry.gpu.tokens == app.tokens_emitted)
    composer.focus()
    composer.cursor_blink = False   # the app turned blinking back on when the reply ended: a steady cursor
    app.redraw(force=True)
    await pilot.pause(0.1)


async def _until(pilot, cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("the demo did not settle")
        await pilot.pause(0.02)


def render(path: str | Path, size=(150, 46)) -> Path:
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        app = build(tmp)

        async def main():
            async with app.run_test(size=size) as pilot:
                await play(pilot)
                app.save_screenshot(path.name, str(path.parent))
        asyncio.run(main())
    return path


if __name__ == "__main__":
    print(render(sys.argv[1] if len(sys.argv) > 1 else "screenshot.svg"))
