"""What the app hands the engine for a chat turn: the replies' thinking as reasoning_content, the
template's preserve_thinking when asked for (alt+k), and where the rendered conversation ends."""
from __future__ import annotations

from apphelpers import make_app, ready, run, send

from mtpchat.app.fake import FakeEngine, FakeTokenizer


class Template(FakeTokenizer):
    """A tokenizer whose chat template reads preserve_thinking; it records what it is asked."""
    chat_template = "{% if preserve_thinking %}...{% endif %}"

    def __init__(self):
        super().__init__()
        self.asked: list[tuple[list[dict], dict]] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=True, **kw):
        self.asked.append(([dict(m) for m in messages], kw))
        return super().apply_chat_template(messages, add_generation_prompt, enable_thinking)


class Recording(FakeEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.tokenizer = Template()
        self.snapshot_at: list[tuple] = []

    def generate(self, prompt_ids, params, snapshot_at=()):
        self.snapshot_at.append((len(prompt_ids), tuple(snapshot_at)))
        return super().generate(prompt_ids, params)


def test_keep_thinking_toggle_reaches_the_template(data_dir):
    engine = Recording()
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "first")
            messages, kw = engine.tokenizer.asked[-1]
            assert "preserve_thinking" not in kw
            await pilot.press("alt+k")
            assert app.keep_thinking and "stays in the prompt" in app.notices[-1][1]
            await send(pilot, "second")
            messages, kw = engine.tokenizer.asked[-1]
            assert kw == {"preserve_thinking": True}
            reply = next(m for m in messages if m["role"] == "assistant")
            assert reply["reasoning_content"] and reply["content"]        # the thinking goes to the template
            # each turn's prompt carries where its conversation ends, for the engine's snapshot
            (n1, at1), (n2, at2) = engine.snapshot_at
            assert at1 and 0 < at1[0] < n1 and at2 and 0 < at2[0] < n2
            await pilot.press("alt+k")
            assert not app.keep_thinking
    run(go())


def test_keep_thinking_is_refused_where_the_template_has_none(data_dir):
    app = make_app(data_dir, FakeEngine())

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.press("alt+k")
            assert not app.keep_thinking and "has no preserve_thinking" in app.notices[-1][1]
    run(go())
