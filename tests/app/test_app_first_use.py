"""What a new user meets in the app: the footer at 80 columns, the key hints in the palette, f4 at
its limit, and a chat reopened on a message the app never answered."""
from __future__ import annotations

from textual.content import Content
from textual.widgets import Footer

from mtpchat.app.fake import FakeEngine
from mtpchat.app.store import Store
from apphelpers import make_app, parsed, ready, run, until
from serve_support import fake  # noqa: F401  (a fixture)


def test_every_footer_key_fits_at_80_columns(data_dir):
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            await ready(pilot)
            await pilot.pause()
            keys = {k.key_display: k.region for k in app.query_one(Footer).query("FooterKey")}
            palette = keys.pop("^p")
            for name in ("^o", "f8", "^t", "f4", "f3"):
                r = keys[name]
                assert r.right <= palette.x, f"{name} at {r} is under the palette's hint at {palette}"
    run(go())


def test_the_palette_names_every_key(data_dir):
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(120, 30)) as pilot:
            await ready(pilot)
            shown = {c.title: Content.from_markup(c.help).plain for c in app.get_system_commands(app.screen)}
            assert shown["More draft tokens"].endswith("[f4 / alt+up]")
            assert shown["Fewer draft tokens"].endswith("[f3 / alt+down]")
            assert shown["Toggle thinking"].endswith("[f5 / ctrl+g]")
            assert shown["Race MTP off vs on"].endswith("[f8]")
            assert shown["Regenerate"].endswith("[ctrl+r]")
    run(go())


def test_f4_at_the_engines_limit_says_why(data_dir):
    """f4 rises to the engine's own limit (8, the same whatever k it started with) and says why it
    stops there."""
    from mtpchat.engine.memory import K_MAX
    engine = FakeEngine(draft_tokens=3)
    assert engine.k_max == K_MAX == 8
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(120, 30)) as pilot:
            await ready(pilot)
            for _ in range(6):
                await pilot.press("f4")
            await until(pilot, lambda: app.notices and "stay at" in app.notices[-1][1], what="a notice")
            text = app.notices[-1][1]
            assert engine.draft_tokens == 8
            assert "stay at 8" in text and "the most the engine takes (8 drafts a step" in text
            assert "rarely kept" in text and "--draft-tokens" not in text
    run(go())


def test_a_chat_reopened_on_an_unanswered_message_says_how_to_answer_it(data_dir):
    store = Store(data_dir)
    sid = store.create_session("cut short")
    store.add_message(sid, "user", "a question the app never answered")
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(120, 30)) as pilot:
            await ready(pilot)
            await app.open_session(sid)
            await pilot.pause()
            assert any("no reply" in text and "ctrl+r" in text for _, text in app.notices)
    run(go())


CODE = 'def clear(self, data):\n    """Check if the data is empty."""\n    if not data:\n        return None\n    return data\n'


def test_a_reply_that_is_code_without_fences_keeps_its_lines(data_dir):
    from textual.widgets import Markdown
    from textual.widgets._markdown import MarkdownFence
    from apphelpers import send
    engine = FakeEngine(answer=CODE, thinking="")
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(120, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "write a method")
            view = app._views()[-1]
            fences = view.query_one("#answer", Markdown).query(MarkdownFence)
            assert len(fences) == 1 and fences.first().code.strip("\n") == CODE.strip("\n")
    run(go())


def test_markdown_replies_stay_markdown():
    from mtpchat.app.chat import as_markdown
    for text in ("Hello **there**.\n\nA second paragraph.", "Steps:\n- one\n    - two\n    - three",
                 "Here:\n```python\ndef f():\n    pass\n```\n"):
        assert as_markdown(text) == text


def test_the_race_runs_both_sides_greedy_whatever_the_chat_samples(data_dir):
    from dataclasses import replace
    from mtpchat.app.race import RaceScreen
    from apphelpers import send
    engine = FakeEngine(draft_tokens=3)
    seen = []
    plain = engine.generate
    engine.generate = lambda ids, params, **kw: seen.append(params) or plain(ids, params, **kw)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            app.sampling = replace(app.sampling, temperature=0.7, seed=None)
            await send(pilot, "race me")
            assert seen[-1].temperature == 0.7                   # the chat samples as set
            await pilot.press("f8")
            await until(pilot, lambda: isinstance(app.screen, RaceScreen) and app.screen.done and not app.busy,
                        what="the race to finish")
            off, on = seen[-2:]
            assert off.greedy and on.greedy                       # the same reply, so the same work
            assert "greedy" in str(app.screen.query_one("#race-title").render())
            assert app.sampling.temperature == 0.7               # the chat's own setting is kept
    run(go())


def test_a_servers_reply_counts_its_tokens_and_prompt_and_its_fixed_keys_say_why(fake, tmp_path, monkeypatch):
    from mtpchat.app import panel
    from mtpchat.app.main import build_app
    from apphelpers import send
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    argv = ["--server", fake("plain"), "--data-dir", str(tmp_path / "data")]
    args = parsed(argv)
    app = build_app(args)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "hello")
            # two pieces streamed; the usage says 90 tokens for a 9-token prompt: the pane says what the footer says
            assert "90 tokens" in app._views()[-1].footer
            lines = [c.plain for c in panel.speed(app.telemetry, app.live())]
            assert lines[0].endswith("90 tok") and "prompt 9 tok prefilled" in lines
            assert not any("0 tok prefilled" in line for line in lines)
            for key in ("ctrl+t", "f4", "f3", "f8"):
                before = len(app.notices)
                await pilot.press(key)
                await pilot.pause()
                assert len(app.notices) == before + 1 and "launched" in app.notices[-1][1], key
    run(go())


def test_a_server_not_up_yet_is_waited_for_and_the_chat_goes_on_when_it_answers(fake, tmp_path, monkeypatch):
    """Started before its server: a clear state (not 'loading' forever, no k=0, no CPU memory),
    tries again, and a message sent meanwhile goes out once the server answers."""
    from mtpchat.app import panel
    from mtpchat.app.main import build_app
    from mtpchat.remote.engine import RemoteEngine
    from serve_support import free_port
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    down = f"http://127.0.0.1:{free_port()}"
    argv = ["--server", down, "--data-dir", str(tmp_path / "data")]
    args = parsed(argv)
    up = {"url": None}                         # the server comes up when the test says so
    app = build_app(args, load_engine=lambda progress=None: RemoteEngine.connect(up["url"] or down))
    app.retry_first_s = app.retry_most_s = 0.05

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await until(pilot, lambda: app.waiting, what="the app to wait for the server")
            assert app.engine is None and app.load_error is None
            assert "cannot reach the server" in app.waiting and "trying again" in app.notices[-1][1]
            live = app.live()
            assert "k=0" not in live.mtp_label and panel.memory(app.telemetry, live)[0].plain.split()[-1] == "server"
            assert "connecting" in panel.header_line(live, "")
            from mtpchat.app.chat import Composer
            composer = app.query_one(Composer)
            composer.focus()
            composer.text = "hello"
            await pilot.press("enter")                   # queued, not lost
            up["url"] = fake("plain")
            await until(pilot, lambda: app.engine is not None, what="the server to answer")
            await until(pilot, lambda: len(app._views()) == 2 and not app.busy, what="the queued message's reply")
            assert app._views()[-1].content == "Hello there" and not app.waiting
    run(go())
