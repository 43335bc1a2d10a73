"""The reasoning effort in the app (alt+e): off, low, medium, xhigh over what the chat template
takes, shown in the header, and rendered into the prompt of the next reply; where the template takes
no effort the key says so, and a --reasoning-effort it refuses is said once and left out."""
from __future__ import annotations

import shutil
from pathlib import Path

from apphelpers import make_app, ready, run, send

from mtpchat.app.fake import FakeEngine, FakeTokenizer
from mtpchat.app.panel import HeaderBar
from mtpchat.engine.tokenizer import Tokenizer

TEMPLATE = (Path(__file__).resolve().parents[1] / "data" / "qwen38_style.jinja").read_text()


class Qwen38Style(FakeTokenizer):
    """The fake engine's ids, with the Qwen3.8-style template rendered (by the real tokenizer's
    renderer) and recorded for every prompt."""
    chat_template = TEMPLATE

    def __init__(self, renderer: Tokenizer):
        super().__init__()
        self.renderer = renderer
        self.rendered: list[tuple[str, dict]] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=True, **kw):
        text = self.renderer.render_chat(messages, add_generation_prompt, enable_thinking, **kw)  # raises as the template does
        if add_generation_prompt:
            self.rendered.append((text, kw))
        # the fake's own ids, led by one that stands for the system message the template wrote
        system = self._id("\x01" + text.split("<|im_start|>user")[0])
        return [system] + super().apply_chat_template(messages, add_generation_prompt, enable_thinking)


def engine_with(gqa3, folder: Path) -> FakeEngine:
    """A fake engine whose prompts go through the tiny checkpoint's tokenizer and the Qwen3.8-style template."""
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(gqa3) / name).is_file():
            shutil.copy(Path(gqa3) / name, folder / name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    engine = FakeEngine()
    engine.tokenizer = Qwen38Style(Tokenizer.load(folder))
    return engine


def header(app) -> str:
    return str(app.query_one(HeaderBar).render())


def test_the_effort_key_cycles_and_reaches_the_prompt(data_dir, gqa3, tmp_path):
    engine = engine_with(gqa3, tmp_path / "tok")
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.pause()
            assert "thinking xhigh" in header(app)            # the template's default, named
            await send(pilot, "first")
            text, kw = engine.tokenizer.rendered[-1]
            assert "reasoning_effort" not in kw and text.startswith("<|im_start|>system\nReasoning effort: extra high.")
            seen = []
            for level in ("off", "low", "medium", "xhigh", "off"):
                await pilot.press("alt+e")
                await pilot.pause()
                assert f"thinking {level}" in header(app)
                seen.append(app.notices[-1][1])
                await send(pilot, level)
                text, kw = engine.tokenizer.rendered[-1]
                if level == "off":
                    assert text.endswith("<think>\n\n</think>\n\n") and "Reasoning effort" not in text
                else:
                    assert kw["reasoning_effort"] == level and text.endswith("<|im_start|>assistant\n<think>\n")
                    assert ("Reasoning effort: low." in text) == (level == "low")
                    assert ("Reasoning effort: extra high." in text) == (level == "xhigh")
            assert seen[0] == "thinking off for the next reply" and seen[1] == "reasoning effort low for the next reply"
            await pilot.press("f5")                            # thinking back on keeps the level it had
            await pilot.pause()
            assert "thinking xhigh" in header(app)
    run(go())


def test_the_effort_key_where_the_template_takes_none(data_dir):
    app = make_app(data_dir, FakeEngine())

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.press("alt+e")
            assert "has no reasoning_effort" in app.notices[-1][1] and app.think
            assert "thinking on" in header(app)
    run(go())


def test_a_refused_effort_at_start_is_said_and_left_out(data_dir, gqa3, tmp_path):
    engine = engine_with(gqa3, tmp_path / "tok")
    app = make_app(data_dir, engine, flags=("--reasoning-effort", "high"))

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.pause()
            assert any("--reasoning-effort 'high': this model's chat template takes low, medium, xhigh" in n
                       for _, n in app.notices)
            await send(pilot, "hi")
            text, kw = engine.tokenizer.rendered[-1]
            assert "reasoning_effort" not in kw and app.effort is None
    run(go())
