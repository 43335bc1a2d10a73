"""Race (MTP off vs on) and the errors a user can meet, through the pilot."""
from __future__ import annotations

from apphelpers import idle, make_app, ready, run, send, until

from mtpchat.app.chat import Composer
from mtpchat.app.errors import NO_MTP, describe_error
from mtpchat.app.fake import DEFAULT_ANSWER, FakeEngine
from mtpchat.app.race import RaceScreen
from mtpchat.app.store import Store


def test_race_runs_the_last_prompt_off_then_on_and_shows_the_speedup(data_dir):
    engine = FakeEngine(draft_tokens=3)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "race me")
            chat_steps = len(engine.step_log)
            await pilot.press("f8")
            await until(pilot, lambda: isinstance(app.screen, RaceScreen) and app.screen.done and not app.busy,
                        what="the race to finish")
            race = app.screen
            off, on = race.lane("race:off"), race.lane("race:on")
            assert DEFAULT_ANSWER.strip() in off.answer and off.answer == on.answer   # same text both ways
            runs = engine.step_log[chat_steps:]
            first_on = runs.index((True, 3))
            assert all(not mtp for mtp, _ in runs[:first_on]) and first_on > 10
            assert all(mtp for mtp, _ in runs[first_on + 1:])     # after its first (prefill) token
            s_off, s_on = race.stats["race:off"], race.stats["race:on"]
            assert s_on.tokens_per_s > s_off.tokens_per_s
            result = str(race.query_one("#race-result").render())
            assert f"speedup {s_on.tokens_per_s / s_off.tokens_per_s:.2f}×" in result
            assert engine.mtp is True and engine.resets >= 2       # the engine is put back as it was
            # the chat itself is untouched
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, RaceScreen) and len(app._views()) == 2
    run(go())


def test_race_needs_a_prompt_and_an_mtp_head(data_dir):
    async def go(engine, expect):
        app = make_app(data_dir, engine)
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.press("f8")
            assert not isinstance(app.screen, RaceScreen) and expect in app.notices[-1][1]
    run(go(FakeEngine(), "send a message first"))
    run(go(FakeEngine(mtp_available=False), "no mtp.* weights"))


def test_a_load_error_is_a_notice_and_the_app_stays_usable(data_dir):
    def load():
        raise FileNotFoundError("/models/missing/config.json")
    app = make_app(data_dir, load=load)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            severity, text = app.notices[-1]
            assert severity == "error" and "model files not found" in text and "--model" in text
            assert not app.query_one("#loading").display
            await send(pilot, "hello?")
            assert app.notices[-1][1] == text and not app._views()    # explains again, sends nothing
            await pilot.press("ctrl+o")                                # saved chats stay browsable
            await pilot.pause()
            assert app.screen.query("OptionList")
    run(go())


def test_an_engine_failure_mid_reply_keeps_the_chat(data_dir):
    engine = FakeEngine(fail_after=8)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "this will break")
            severity, text = app.notices[-1]
            assert severity == "error" and "failed during the reply" in text and "simulated engine failure" in text
            user, reply = app._views()
            assert user.content == "this will break" and reply.thinking and "failed" in reply.footer
            engine.fail_after = None
            await send(pilot, "and now?")
            assert app._views()[-1].content == DEFAULT_ANSWER
    run(go())
    store = Store(data_dir)
    roles = [m.role for m in store.messages(store.sessions()[0].id)]
    assert roles == ["user", "assistant", "user", "assistant"]


def test_a_checkpoint_without_mtp_runs_with_mtp_off_and_says_so(data_dir):
    engine = FakeEngine(mtp_available=False)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            assert ("warning", NO_MTP) in app.notices
            await pilot.press("ctrl+t")
            assert engine.mtp is False and app.notices[-1] == ("warning", NO_MTP)
            await send(pilot, "hi")
            assert all(not mtp for mtp, _ in engine.step_log)
            assert "MTP n/a" in str(app.query_one("#header").render())
    run(go())


def test_busy_guards(data_dir):
    engine = FakeEngine(step_delay=0.01, answer="word " * 400)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "one", wait=False)
            await send(pilot, "two", wait=False)
            assert "Esc" in app.notices[-1][1] and len(app._views()) == 2
            # new chat while streaming: stops the reply first, then clears
            await pilot.press("ctrl+n")
            await until(pilot, lambda: not app.busy and not app._views(), what="a new chat")
            await idle(pilot)
    run(go())


def test_error_lines_name_the_problem_and_the_fix():
    class OutOfMemoryError(RuntimeError):
        pass
    oom = describe_error(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "load")
    assert "ran out of memory" in oom and "--max-context" in oom and "\n" not in oom
    mid_oom = describe_error(OutOfMemoryError("CUDA out of memory"), "reply")
    assert "during the reply" in mid_oom and "kept" in mid_oom
    gpu = describe_error(RuntimeError("Found no NVIDIA driver on your system"), "load", device="cuda")
    assert "--device cpu" in gpu
    mid = describe_error(ValueError("boom\nsecond line"), "reply")
    assert "boom" in mid and "second line" not in mid and "kept" in mid


def test_quitting_mid_reply_ends_the_engine_thread(data_dir):
    import time
    engine = FakeEngine(step_delay=0.02, answer="word " * 2000)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await send(pilot, "long", wait=False)
            await until(pilot, lambda: len(engine.step_log) > 3)
    t = time.monotonic()
    run(go())   # leaving run_test exits the app; the worker thread must not keep it alive
    assert time.monotonic() - t < 5 and len(engine.step_log) < 200


def test_a_message_sent_while_loading_goes_out_once_the_model_is_ready(data_dir):
    import threading
    loaded = threading.Event()
    engine = FakeEngine()

    def slow_load():
        assert loaded.wait(10), "the test never released the load"
        return engine
    app = make_app(data_dir, load=slow_load)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await send(pilot, "hello while loading", wait=False)
            assert app.engine is None and not app._views()
            assert "goes out as soon as it is ready" in app.notices[-1][1]
            loaded.set()
            await ready(pilot)
            await until(pilot, lambda: len(app._views()) == 2, what="the queued message to be sent")
            await idle(pilot)
            user, reply = app._views()
            assert user.role == "user" and user.content == "hello while loading"
            assert reply.role == "assistant" and reply.content
    run(go())


def test_a_reply_is_busy_from_its_first_view_and_a_stop_in_that_window_holds(data_dir):
    # the views of a sent message mount over several awaits; busy must be set before the first,
    # or a poller (and the stop key) sees "two views, not busy" before the generation has begun
    engine = FakeEngine(step_delay=0.02, answer="word " * 200)
    app = make_app(data_dir, engine)
    busy_at_mount = []

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            chat = app._chat()
            add = chat.add

            async def spy(view):
                busy_at_mount.append(app.busy)
                if view.role == "assistant":
                    app.action_stop()    # pressed while the reply's view mounts
                return await add(view)
            chat.add = spy
            composer = app.query_one(Composer)
            composer.focus()
            composer.text = "hello"
            await pilot.press("enter")
            await until(pilot, lambda: len(busy_at_mount) == 2 and not app.busy, what="the stopped reply to end")
            await pilot.pause()
            assert busy_at_mount == [True, True]
            assert not engine.step_log, "the stop pressed before the generation began was lost"
            user, = app._views()
            assert user.content == "hello"
    run(go())
