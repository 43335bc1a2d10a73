"""Helpers for driving the app with Textual's pilot against the fake engine."""
from __future__ import annotations

import asyncio
import time

from mtpchat import cli
from mtpchat.app.chat import Composer
from mtpchat.app.fake import FakeEngine, FakeGpu
from mtpchat.app.main import build_app, dev_args

FIXED_NOW = 1_767_225_600.0   # 2026-01-01 00:00 UTC: pins every timestamp the app stores or shows


def make_app(data_dir, engine: FakeEngine | None = None, *, device: str = "cpu", load=None, flags=(), gpu=False):
    engine = engine if engine is not None else FakeEngine(device=device)
    args = dev_args(["--data-dir", str(data_dir), "--device", device, *flags])
    return build_app(args, load_engine=(lambda progress: load()) if load else (lambda progress: engine), now=lambda: FIXED_NOW,
                     probe=FakeGpu if gpu else None, gpu_interval=0.05)


async def until(pilot, cond, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def ready(pilot) -> None:
    app = pilot.app
    await until(pilot, lambda: app.engine is not None or app.load_error is not None, what="the engine to load")


async def send(pilot, text: str, wait: bool = True) -> None:
    app = pilot.app
    composer = app.query_one(Composer)
    composer.focus()
    composer.text = text
    views, notices = len(app._views()), len(app.notices)
    await pilot.press("enter")
    await until(pilot, lambda: len(app._views()) >= views + 2 or len(app.notices) > notices,
                what="the reply to start")
    if wait:
        await idle(pilot)


async def idle(pilot) -> None:
    app = pilot.app
    await until(pilot, lambda: not app.busy, what="the reply to end")
    await pilot.pause()


async def steps_reached(pilot, engine: FakeEngine, n: int) -> None:
    await until(pilot, lambda: len(engine.step_log) >= n, what=f"{n} engine steps")


def run(coro):
    return asyncio.run(coro)


def parsed(argv: list[str]):
    """The app's arguments as the command line makes them, its options resolved (settings, flags)."""
    args = cli.build_parser(argv).parse_args(argv)
    args.options = cli.options_from(args)
    return args
