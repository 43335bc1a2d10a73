"""The loading bar: Engine.load's progress reports drawn as a bar with bytes and tensors, the stage
named, and the bar gone once the model is ready."""
from __future__ import annotations

import threading

from apphelpers import FIXED_NOW, ready, run, until
from textual.widgets import ProgressBar, Static

from mtpchat.app.fake import FakeEngine
from mtpchat.app.main import build_app, dev_args
from mtpchat.engine.events import LoadProgress

MiB = 1 << 20


def test_the_bar_follows_the_weights_and_goes_when_ready(data_dir):
    go_on = threading.Event()
    engine = FakeEngine()

    def load(progress):
        for done in range(1, 41):       # 40 tensors of 3 MiB
            progress(LoadProgress("weights", done * 3 * MiB, 120 * MiB, done, 80, quantizing="fp8"))
        assert go_on.wait(10), "the test never let the load finish"
        return engine
    args = dev_args(["--data-dir", str(data_dir), "--device", "cpu"])
    app = build_app(args, load_engine=load, now=lambda: FIXED_NOW)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            bar = app.query_one("#loading-bar", ProgressBar)
            text = app.query_one("#loading-text", Static)
            await until(pilot, lambda: bar.progress == 120 * MiB, what="the weights' last report")
            assert bar.total == 120 * MiB
            assert str(text.render()) == ("loading weights, quantizing to FP8: 120.0 MiB / 120.0 MiB, "
                                          "40/80 tensors")
            go_on.set()
            await ready(pilot)
            await until(pilot, lambda: not app.query("#loading"), what="the bar to go once ready")
    run(go())


def test_reports_are_thinned_but_every_stage_end_arrives(data_dir):
    app = build_app(dev_args(["--data-dir", str(data_dir)]), load_engine=lambda progress: FakeEngine(),
                    now=lambda: FIXED_NOW)
    posted = []
    app.post_message = posted.append
    for done in range(1, 10_001):
        app._load_progressed(LoadProgress("weights", done, 10_000, done, 10_000))
    app._load_progressed(LoadProgress("capture", 1, 30))
    shown = [m.progress for m in posted]
    assert 150 <= len(shown) <= 210                 # about every half percent, not 10,000 messages
    assert shown[-2].done == 10_000 and shown[-1].stage == "capture"
