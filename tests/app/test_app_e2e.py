"""The real engine on a tiny random checkpoint, on the CPU, through the app as `mtpchat` starts it."""
from __future__ import annotations

import pytest
from apphelpers import idle, parsed, ready, run, send, until

from mtpchat import cli, loader
from mtpchat.app.chat import Composer
from mtpchat.app.main import build_app
from mtpchat.app.store import Store
from mtpchat.chat.engine import LocalEngine
from mtpchat.chat.think import ThinkSplitter, prompt_opens_think
from tools.tiny import write_tiny_checkpoint


@pytest.fixture
def cli_args(tmp_path, monkeypatch):
    """Arguments exactly as `mtpchat --model <tiny> ...` hands them to run_app."""
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    tiny = write_tiny_checkpoint(tmp_path / "tiny")
    argv = ["--model", str(tiny), "--device", "cpu", "--data-dir", str(tmp_path / "data"),
            "--temperature", "0", "--max-tokens", "40", "--max-context", "512"]
    args = parsed(argv)
    args.prepared = loader.prepare(args.options)
    return args


def test_real_engine_replies_through_the_app_as_it_does_headless(cli_args, tmp_path):
    app = build_app(cli_args)
    prompt = "Hello there, tiny model"

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            assert app.engine is not None and app.engine.mtp and not app.load_error
            await send(pilot, prompt)
            reply = app._views()[-1]
            # the same prompt headless, from a fresh state, greedy: the app showed exactly this
            engine = app.engine
            engine.reset()
            ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            result = cli.generate(engine, ids, loader.sampling_params(cli_args.options, cli_args.prepared.path))
            shown = [t for t in result["token_ids"] if t not in engine.stop_ids]
            split = ThinkSplitter(inside=prompt_opens_think(engine.tokenizer, ids))
            think, answer = split.push(engine.tokenizer.decode(shown))
            tail = split.flush()
            assert (reply.thinking, reply.content) == (think + tail[0], answer + tail[1])
            assert (result["reasoning"], result["text"]) == (reply.thinking, reply.content)
            assert f"{result['stats']['new_tokens']} tokens" in reply.footer and "tok/s" in reply.footer
            # MTP off through the app reaches the real engine
            await pilot.press("ctrl+t")
            assert engine.mtp is False
            await send(pilot, "again")
            await idle(pilot)
    run(go())
    store = Store(tmp_path / "data")
    stats = [m.stats for m in store.messages(store.sessions()[0].id) if m.role == "assistant"]
    assert stats[0]["verify_steps"] > 0 and stats[0]["mtp"] is True and 0 < stats[0]["new_tokens"] <= 40
    assert stats[1]["verify_steps"] == 0 and stats[1]["mtp"] is False


def test_no_flags_on_a_short_model_and_a_message_sent_while_it_loads(tmp_path, monkeypatch):
    # `mtpchat --model DIR` on a checkpoint that supports 4,096 tokens: no --max-context asked for,
    # so none is refused; the message typed while the model loads goes out once it is ready
    import threading
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    monkeypatch.setenv("MTPCHAT_DATA_DIR", str(tmp_path / "data"))
    # a short greedy reply (the same every run); no context setting
    (tmp_path / "settings.toml").write_text("max_tokens = 24\ntemperature = 0\n")
    short = write_tiny_checkpoint(tmp_path / "short", max_position_embeddings=4096)
    argv = ["--model", str(short)]
    args = parsed(argv)
    args.prepared = loader.prepare(args.options)
    assert args.prepared.max_context == 4096
    assert any("context: 4,096 tokens, the most" in n for n in args.prepared.notices)
    release = threading.Event()

    def load(progress):
        assert release.wait(20), "the test never let the model load"
        return LocalEngine(loader.load_engine(args.prepared, progress))
    app = build_app(args, load_engine=load)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            assert any("context: 4,096 tokens" in text for _, text in app.startup_notices)
            await send(pilot, "sent while loading", wait=False)
            assert app.engine is None and "goes out as soon as it is ready" in app.notices[-1][1]
            assert "queued" in str(app.query_one(Composer).border_subtitle)
            release.set()
            await ready(pilot)
            assert app.engine.max_context == 4096 and not app.load_error
            # the reply's own footer, written when it has ended (two views and not busy can also be
            # the moment before its generation starts)
            await until(pilot, lambda: len(app._views()) == 2 and "tok/s" in app._views()[-1].footer,
                        what="the queued message's reply to end")
            await idle(pilot)
            user, reply = app._views()
            assert user.content == "sent while loading" and (reply.content or reply.thinking)
    run(go())
