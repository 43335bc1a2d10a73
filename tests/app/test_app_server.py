"""The app as a client of `mtpchat serve` running as a real process: the reply and the acceptance
figures are the in-process engine's, and the switches a server cannot take say why. And
against fake servers: each way a server cannot be used is one line, a cut stream keeps its part."""
from __future__ import annotations

import pytest
from apphelpers import idle, parsed, ready, run, send
from serve_support import fake  # noqa: F401  (a fixture)
from serve_support import CUT_REPLY, MAX_TOKENS, PROMPT, ServeProcess, free_port, in_process

from mtpchat.app.main import build_app
from mtpchat.app.gauges import NA
from mtpchat.app.panel import acceptance


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("serve-app"))
    yield proc
    proc.stop()


def test_the_app_chats_through_a_server_as_with_the_engine_in_process(server, tmp_path, monkeypatch):
    (tmp_path / "settings.toml").touch()
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    thinking, answer, stats = in_process()
    assert stats["accepted"] > 0
    argv = ["--server", server.url, "--data-dir", str(tmp_path / "data"), "--temperature", "0",
            "--max-tokens", str(MAX_TOKENS)]
    args = parsed(argv)
    app = build_app(args)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            assert app.engine is not None and not app.load_error
            await send(pilot, PROMPT)
            await idle(pilot)
            reply = app._views()[-1]
            assert (reply.thinking, reply.content) == (thinking, answer)
            assert f"mean acceptance {stats['mean_acceptance_length']:.2f}" in reply.footer
            assert f"{stats['new_tokens']} tokens" in reply.footer
            r = app.telemetry.reply
            assert (r.verify_steps, r.drafted, r.accepted) == (stats["verify_steps"], stats["drafted"], stats["accepted"])
            assert [round(p, 4) for p in r.per_position] == stats["per_position_acceptance"]
            assert "MTP: server's" in str(acceptance(app.telemetry, app.live())[0])
            # MTP, draft tokens and the race: pressing them changes nothing, and says why
            await pilot.press("ctrl+t")
            assert app.engine.mtp is True and "launched" in app.notices[-1][1]
    run(go())


def app_on(url: str, tmp_path, monkeypatch, *flags: str):
    (tmp_path / "settings.toml").touch()
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    argv = ["--server", url, "--data-dir", str(tmp_path / "data"), *flags]
    args = parsed(argv)
    return build_app(args)


@pytest.mark.parametrize("mode, said", [("key", "refused the API key"),
                                        ("html", "OpenAI model list"), ("missing", "does not exist")])
def test_a_server_that_cannot_be_used_is_one_line_in_the_app(fake, tmp_path, monkeypatch, mode, said):
    url = fake(mode) if mode else f"http://127.0.0.1:{free_port()}"
    app = app_on(url, tmp_path, monkeypatch, "--api-key", "wrong")

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            assert app.engine is None and said in app.load_error
            assert "\n" not in app.load_error and "Traceback" not in app.load_error
            await send(pilot, "hello")       # what is sent says the same one line, not a traceback
            assert app.notices[-1] == ("error", app.load_error)
    run(go())


def test_a_stream_cut_mid_reply_keeps_the_part_that_came_marked(fake, tmp_path, monkeypatch):
    app = app_on(fake("cut"), tmp_path, monkeypatch)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "hello")
            reply = app._views()[-1]
            assert reply.content == CUT_REPLY and "stream broke" in reply.footer
            severity, text = app.notices[-1]
            assert severity == "error" and "before the reply was complete" in text and "kept" in text
            assert "\n" not in text
    run(go())


def test_a_server_that_reports_no_figures_shows_n_a(fake, tmp_path, monkeypatch):
    app = app_on(fake("plain"), tmp_path, monkeypatch)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "hello")
            reply = app._views()[-1]
            assert reply.content == "Hello there" and "acceptance N/A" in reply.footer
            assert str(acceptance(app.telemetry, app.live())[1]).split() == ["mean", "length", NA, "session", NA]
    run(go())
