"""The chat flow through Textual's pilot, against the fake engine."""
from __future__ import annotations

from mtpchat.app.chat import ChatLog, Composer, code_blocks
from mtpchat.app.fake import DEFAULT_ANSWER, DEFAULT_THINKING, FakeEngine
from mtpchat.app.messages import ReplyDelta
from mtpchat.app.store import Store
from apphelpers import idle, make_app, ready, run, send, steps_reached, until

LONG = "\n\n".join(f"Paragraph {i}: " + "speculative decoding drafts and verifies tokens. " * 6 for i in range(30))


def test_sending_streams_a_reply_in_batches(data_dir):
    engine = FakeEngine(step_delay=0.015)
    deltas = []
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40), message_hook=lambda m: isinstance(m, ReplyDelta) and deltas.append(m)) as pilot:
            await ready(pilot)
            await send(pilot, "What is speculative decoding?")
            user, reply = app._views()
            assert user.role == "user" and user.content == "What is speculative decoding?"
            assert reply.content == DEFAULT_ANSWER
            assert reply.thinking.strip() == DEFAULT_THINKING
            assert "tok/s" in reply.footer and "mean acceptance" in reply.footer
            # thinking streamed first, then folded away once the answer started
            assert any(d.thinking for d in deltas) and reply.query_one("#thinking").collapsed
            # streamed: several deltas, but far fewer messages than engine steps (batched, not per token;
            # how many depends on how fast this machine paints, see pacer.py)
            assert 2 <= len(deltas) < len(engine.step_log) / 2
            assert "".join(d.answer for d in deltas) == DEFAULT_ANSWER
            # the final full render has the code block (fences parse only once complete)
            assert reply.query("MarkdownFence")
    run(go())
    store = Store(data_dir)
    (session,) = store.sessions()
    msgs = store.messages(session.id)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].content == DEFAULT_ANSWER and msgs[1].thinking.strip() == DEFAULT_THINKING
    assert msgs[1].stats["new_tokens"] == engine.tokens_emitted and msgs[1].stats["tokens_per_s"] > 0


def test_escape_stops_the_reply_and_keeps_what_was_shown(data_dir):
    engine = FakeEngine(step_delay=0.01, answer=LONG)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "go on", wait=False)
            await steps_reached(pilot, engine, 40)       # past the thinking, into the answer
            await pilot.press("escape")
            await idle(pilot)
            reply = app._views()[-1]
            assert 0 < len(reply.content) < len(LONG) and LONG.startswith(reply.content)
            assert "stopped" in reply.footer
            n = len(engine.step_log)
            await pilot.pause(0.1)
            assert len(engine.step_log) == n        # the engine really stopped
            # the app is usable again
            engine.answer, engine.step_delay = "Short.", 0.0
            await send(pilot, "again")
            assert app._views()[-1].content == "Short."
    run(go())
    store = Store(data_dir)
    msgs = store.messages(store.sessions()[0].id)
    assert msgs[1].stats["reason"] == "cancelled" and LONG.startswith(msgs[1].content)


def test_stopping_before_the_engine_says_anything_leaves_no_empty_reply(data_dir):
    engine = FakeEngine(step_delay=0.01)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            composer = app.query_one(Composer)
            composer.text = "hello"
            composer.action_submit()
            await until(pilot, lambda: app.busy, what="the reply to start")
            app.action_stop()
            await idle(pilot)
            assert all(v.finished and "generating" not in v.footer for v in app._views() if v.role == "assistant")
            await send(pilot, "again")
            assert app._views()[-1].content == DEFAULT_ANSWER
    run(go())


def test_mtp_toggle_and_draft_count_reach_the_engine_mid_reply(data_dir):
    engine = FakeEngine(step_delay=0.01, answer=LONG, draft_tokens=2)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "long one", wait=False)
            await steps_reached(pilot, engine, 5)
            await pilot.press("f4")                   # draft up: 2 -> 3
            mark = len(engine.step_log)
            await steps_reached(pilot, engine, mark + 5)
            await pilot.press("ctrl+t")               # MTP off
            mark2 = len(engine.step_log)
            await steps_reached(pilot, engine, mark2 + 5)
            assert app.busy                            # all within one reply
            log = engine.step_log
            assert (True, 2) in log[1:5]
            assert (True, 3) in log[mark:mark2 + 1]
            assert log[-1] == (False, 0) and all(s == (False, 0) for s in log[mark2 + 2:])
            await pilot.press("escape")
            await idle(pilot)
            header = str(app.query_one("#header").render())
            assert "MTP off" in header
            await pilot.press("ctrl+t", "f3")
            assert engine.mtp and engine.draft_tokens == 2
    run(go())


def test_draft_count_stays_within_bounds(data_dir):
    engine = FakeEngine(draft_tokens=4, k_max=4)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.press("f4")
            assert engine.draft_tokens == 4 and "stay at 4" in app.notices[-1][1]
            for _ in range(5):
                await pilot.press("f3")
            assert engine.draft_tokens == 1
    run(go())


def test_regenerate_replaces_the_last_reply(data_dir):
    engine = FakeEngine()
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "hi")
            engine.answer = "A different answer."
            await pilot.press("ctrl+r")
            await until(pilot, lambda: app.busy or app._views()[-1].content == "A different answer.")
            await idle(pilot)
            views = app._views()
            assert [v.role for v in views] == ["user", "assistant"]
            assert views[-1].content == "A different answer."
    run(go())
    store = Store(data_dir)
    msgs = store.messages(store.sessions()[0].id)
    assert [(m.role, m.content) for m in msgs] == [("user", "hi"), ("assistant", "A different answer.")]


def test_edit_last_takes_the_exchange_back(data_dir):
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "first")
            await send(pilot, "second with a typo")
            await pilot.press("ctrl+l")
            await until(pilot, lambda: len(app._views()) == 2)
            assert app.query_one(Composer).text == "second with a typo"
            # up arrow in an empty composer does the same
            app.query_one(Composer).text = ""
            await pilot.press("up")
            await until(pilot, lambda: not app._views())
            assert app.query_one(Composer).text == "first"
    run(go())
    store = Store(data_dir)
    assert store.messages(store.sessions()[0].id) == []


def test_new_chat_and_sessions_reload_after_a_restart(data_dir):
    engine = FakeEngine()

    async def first():
        app = make_app(data_dir, engine)
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "the first chat")
            await pilot.press("ctrl+n")
            await until(pilot, lambda: not app._views())
            assert app.session_id is None
            engine.answer = "Second answer."
            await send(pilot, "the second chat")
            return app.telemetry.session.mean_length

    second_mean = run(first())

    async def again():
        app = make_app(data_dir, FakeEngine())
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            assert not app._views()                    # a restart opens a new chat
            await pilot.press("ctrl+o")
            await pilot.pause()
            options = app.screen.query_one("OptionList")
            assert options.option_count == 2
            assert "the second chat" in str(options.get_option_at_index(0).prompt)   # newest first
            await pilot.press("enter")
            await until(pilot, lambda: len(app._views()) == 2)
            views = app._views()
            assert [v.content for v in views] == ["the second chat", "Second answer."]
            assert "tok/s" in views[1].footer
            assert app.telemetry.session.mean_length == second_mean
            await pilot.press("ctrl+o", "down", "enter")
            await until(pilot, lambda: app._views() and app._views()[0].content == "the first chat")
            assert app._views()[1].content == DEFAULT_ANSWER and app._views()[1].thinking
    run(again())


def test_copy_and_export(data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "code please")
            await pilot.press("f9")
            assert app.clipboard == DEFAULT_ANSWER
            await pilot.press("f10")
            assert app.clipboard == code_blocks(DEFAULT_ANSWER)[0] and app.clipboard.startswith("def step")
            await pilot.press("ctrl+s")
            text = app.export_written.read_text()
            assert app.export_written.parent == tmp_path
            assert "## You" in text and "code please" in text and "<summary>Thinking</summary>" in text
            assert DEFAULT_ANSWER.strip() in text
    run(go())


def test_auto_scroll_stops_while_the_user_reads_above(data_dir):
    engine = FakeEngine(step_delay=0.01, answer=LONG)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(120, 30)) as pilot:
            await ready(pilot)
            await send(pilot, "long", wait=False)
            chat = app.query_one(ChatLog)
            await until(pilot, lambda: chat.max_scroll_y > 20, what="the reply to overflow")
            assert chat.scroll_y >= chat.max_scroll_y - 1          # following the reply
            chat.scroll_to(y=2, animate=False)                      # the user scrolls up to read
            await steps_reached(pilot, engine, len(engine.step_log) + 15)
            await pilot.pause(0.1)
            assert chat.scroll_y == 2 and chat.max_scroll_y > 20   # left where the user put it
            chat.scroll_end(animate=False)                          # back at the bottom: follow again
            await pilot.press("escape")
            await idle(pilot)
            await pilot.pause(0.1)
            assert chat.scroll_y >= chat.max_scroll_y - 1
    run(go())


def test_narrow_terminal_folds_the_pane_into_a_status_line(data_dir):
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(80, 30)) as pilot:
            await ready(pilot)
            await send(pilot, "hi")
            await pilot.pause(0.3)
            assert not app.query_one("#telemetry").display or app.query_one("#telemetry").region.width == 0
            status = app.query_one("#status")
            assert status.region.height == 1
            assert "tok/s" in str(status.render()) and "MTP on" in str(status.render())
            await pilot.resize_terminal(140, 30)
            await pilot.pause(0.2)
            assert app.query_one("#telemetry").region.width > 30 and app.query_one("#status").region.height == 0
    run(go())


def test_a_keymap_file_moves_a_binding(data_dir):
    data_dir.mkdir(parents=True)
    (data_dir / "keymap.toml").write_text('toggle_mtp = "ctrl+b"\n')
    engine = FakeEngine()
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+t")
            assert engine.mtp is True
            await pilot.press("ctrl+b")
            assert engine.mtp is False
    run(go())


def test_deleting_chats_from_the_list(data_dir):
    app = make_app(data_dir)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "old chat")
            await pilot.press("ctrl+n")
            await until(pilot, lambda: not app._views())
            await send(pilot, "current chat")
            await pilot.press("ctrl+o")
            await pilot.pause()
            await pilot.press("d")                      # the highlighted one: the current chat
            await until(pilot, lambda: app.session_id is None and not app._views(), what="a new chat")
            options = app.screen.query_one("OptionList")
            assert options.option_count == 1 and "old chat" in str(options.get_option_at_index(0).prompt)
    run(go())
    assert [s.title for s in Store(data_dir).sessions()] == ["old chat"]
