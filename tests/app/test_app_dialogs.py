"""Dialogs, the palette, tinting, the composer's keys and remembered preferences."""
from __future__ import annotations

from apphelpers import make_app, ready, run, send, until

from mtpchat.app.chat import Composer
from mtpchat.app.commands import COMMANDS
from mtpchat.app.fake import FakeEngine
from mtpchat.app.gpu import NvmlProbe
from mtpchat.app.screens import SamplingScreen, SystemPromptScreen
from mtpchat.app.settings import PRESETS
from mtpchat.app.store import Store


def test_composer_newline_key_and_send(data_dir):
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.press("l", "i", "n", "e", "ctrl+j", "t", "w", "o")
            assert app.query_one(Composer).text == "line\ntwo" and not app._views()
            await pilot.press("enter")
            await until(pilot, lambda: len(app._views()) == 2 and not app.busy)
            assert app._views()[0].content == "line\ntwo" and app.query_one(Composer).text == ""
    run(go())


def test_system_prompt_is_saved_and_sent(data_dir):
    engine = FakeEngine()
    seen = []
    plain = engine.tokenizer.apply_chat_template
    engine.tokenizer.apply_chat_template = lambda messages, **kw: seen.append(messages) or plain(messages, **kw)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "hi")
            await pilot.press("f6")
            await until(pilot, lambda: isinstance(app.screen, SystemPromptScreen))
            app.screen.query_one("#system-text").text = "Answer in French."
            await pilot.press("ctrl+s")
            await until(pilot, lambda: not isinstance(app.screen, SystemPromptScreen))
            assert app.system == "Answer in French."
            await send(pilot, "again")
            assert seen[-1][0] == {"role": "system", "content": "Answer in French."}
    run(go())
    store = Store(data_dir)
    assert store.sessions()[0].system == "Answer in French."


def test_sampling_presets_and_validation(data_dir):
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.press("f7")
            await until(pilot, lambda: isinstance(app.screen, SamplingScreen))
            dialog = app.screen
            await pilot.click("#preset-1")                      # thinking, precise coding
            dialog.query_one("#f-seed").value = "7"
            dialog.query_one("#f-top_p").value = "1.5"          # out of range
            dialog.query_one("#f-top_p").focus()
            # enter applies; ctrl+s is the chat's export, and the dialog does not name it
            assert "ctrl+s" not in str(dialog.query_one(".dialog-title").render())
            await pilot.press("enter")
            assert isinstance(app.screen, SamplingScreen)       # refused, says why
            assert "top_p" in str(dialog.query_one("#sampling-error").render())
            dialog.query_one("#f-top_p").value = "0.95"
            await pilot.press("enter")
            await until(pilot, lambda: not isinstance(app.screen, SamplingScreen))
            want = PRESETS["thinking · precise coding"]
            s = app.sampling
            assert (s.temperature, s.top_p, s.top_k, s.presence_penalty, s.seed) == \
                (want.temperature, want.top_p, want.top_k, want.presence_penalty, 7)
    run(go())


def test_tint_colours_accepted_drafts_and_survives_a_restart(data_dir):
    async def first():
        app = make_app(data_dir)
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "tint me")
            reply = app._views()[-1]
            assert {d for _, d in reply.spans} == {True, False}
            assert "".join(t for t, _ in reply.spans) == reply.content
            await pilot.press("f11")
            assert reply.query_one("#tinted").display and not reply.query_one("#answer").display
            styled = reply.query_one("#tinted").render()
            assert any("$success" in str(span.style) for span in styled.spans)
    run(first())

    async def again():
        app = make_app(data_dir)
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.press("f11", "ctrl+o", "enter")
            await until(pilot, lambda: len(app._views()) == 2)
            reply = app._views()[-1]
            assert reply.query_one("#tinted").display and {d for _, d in reply.spans} == {True, False}
    run(again())


def test_every_command_is_in_the_palette(data_dir):
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            titles = {c.title for c in app.get_system_commands(app.screen)}
            assert {c.title for c in COMMANDS} <= titles
            await pilot.press("ctrl+p", *"toggle mtp")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await until(pilot, lambda: app.engine.mtp is False, what="MTP off from the palette")
            await pilot.press("ctrl+p", *"sampling settings")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, SamplingScreen), what="the sampling dialog")
    run(go())


def test_theme_is_remembered(data_dir):
    async def pick():
        app = make_app(data_dir)
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            app.theme = "nord"
            await pilot.pause()
    run(pick())

    async def check():
        app = make_app(data_dir)
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            assert app.theme == "nord"
    run(check())


def test_nvml_without_a_gpu_reads_as_not_available():
    probe = NvmlProbe()
    s = probe.sample()
    if not probe.available:   # this machine: no driver; every field N/A, nothing raised
        assert (s.used, s.total, s.power_w, s.energy_j) == (None, None, None, None)
    else:
        assert s.total and s.used is not None
