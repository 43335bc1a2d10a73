"""The chat layer: one Reply driver under the app's worker, the server and `mtpchat run`."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from mtpchat import cli, serve
from mtpchat.app.fake import FakeEngine
from mtpchat.app.messages import ReplyDone
from mtpchat.app.runner import drive
from mtpchat.chat.engine import ChatEngine, ChatTokenizer, LocalEngine
from mtpchat.chat.prompt import build_prompt
from mtpchat.chat.reply import Reply
from mtpchat.engine.events import Finished, Step
from mtpchat.engine.sampling import SamplingParams
from mtpchat.remote.client import Server
from mtpchat.remote.engine import RemoteEngine
from mtpchat.serve_request import Request

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"
MESSAGES = [{"role": "user", "content": "Tell me about drafts"}]
PARAMS = SamplingParams(max_tokens=4096)


class Counting(FakeEngine):
    """The fake engine, counting the cancels it is asked for."""
    cancels = 0

    def cancel(self) -> None:
        self.cancels += 1
        super().cancel()


def run_reply(engine, think=True, **kw) -> Reply:
    ids, _ = build_prompt(engine.tokenizer, MESSAGES, think)
    reply = Reply(engine, ids, PARAMS, **kw)
    for ev in reply:
        if isinstance(ev, Step):
            reply.take()
    reply.finish()
    return reply


def test_the_three_engines_are_chat_engines():
    from mtpchat.engine import Engine
    local = Engine.load(DEMO, device="cpu", max_context=256, cuda_graphs=False)
    assert isinstance(FakeEngine(), ChatEngine)
    assert isinstance(RemoteEngine(Server("http://127.0.0.1:9"), "m"), ChatEngine)
    assert isinstance(LocalEngine(local), ChatEngine) and isinstance(local.tokenizer, ChatTokenizer)
    assert not isinstance(local, ChatEngine)       # no `fixed`: the app takes it through LocalEngine
    chat = LocalEngine(local)
    chat.mtp, chat.draft_tokens = False, 2         # live switches reach the engine
    assert (local.mtp, local.draft_tokens) == (False, 2) and chat.dtype == "float32"


def test_thinking_and_answer_apart_with_the_tag_split_across_tokens():
    engine = FakeEngine(thinking="Weigh the drafts.", answer="Drafts help.", mtp=False)
    # "</think>" in the script is three pieces: "</", "think", ">"
    assert len(engine.tokenizer.encode("</think>")) == 3
    reply = run_reply(engine)
    assert reply.text() == ("Weigh the drafts.\n", "Drafts help.") and reply.reason == "stop"
    no_think = run_reply(FakeEngine(thinking="unused", answer="Drafts help."), think=False)
    assert no_think.text() == ("", "Drafts help.")


@pytest.mark.parametrize("mtp", [False, True])
def test_a_stop_string_across_tokens_cuts_the_answer_and_cancels_once(mtp):
    engine = Counting(thinking="Think.", answer="alpha beta gamma delta epsilon zeta " * 20, mtp=mtp)
    reply = run_reply(engine, stops=["ha be"])    # "alpha" ends in it, " beta" finishes it
    assert reply.text() == ("Think.\n", "alp") and reply.reason == "stop"
    assert engine.cancels == 1
    assert reply.finished.reason == "cancelled"          # the engine stopped early, asked once
    assert reply.stats.new_tokens < len(engine.tokenizer.encode(engine.answer))


def test_a_stop_string_held_back_until_it_is_not_one():
    # "gam" could start "gamut": held back, then shown when the text goes on otherwise
    reply = run_reply(FakeEngine(thinking="T.", answer="alpha gamma", mtp=False), stops=["gamut"])
    assert reply.text() == ("T.\n", "alpha gamma") and reply.reason == "stop"


def test_cancel_is_asked_once_and_the_reply_ends_cancelled():
    engine = Counting(answer="word " * 200, mtp=False)
    reply = run_reply(engine, cancelled=lambda: True)
    assert engine.cancels == 1 and reply.reason == "cancelled"
    assert reply.stats.new_tokens < 10


def test_the_turn_ending_ids_are_not_text():
    engine = FakeEngine(thinking="T.", answer="Done.", mtp=False)
    reply = run_reply(engine)
    assert reply.finished.token_ids[-1] in engine.stop_ids and reply.text()[1] == "Done."


def test_an_engine_that_ends_without_finished_still_ends_the_reply():
    class Abrupt(FakeEngine):
        def generate(self, prompt_ids, params, snapshot_at=()):
            yield from (ev for ev in super().generate(prompt_ids, params) if not isinstance(ev, Finished))
    reply = run_reply(Abrupt(thinking="T.", answer="Half", mtp=False))
    events = list(Reply(Abrupt(), [1], PARAMS))
    assert isinstance(events[-1], Finished) and reply.text() == ("T.\n", "Half") and reply.reason == "stop"


def test_app_server_and_run_give_the_same_reply():
    make = lambda: FakeEngine(thinking="Weigh it.", answer="## Yes\n\nDrafts **help**.", draft_tokens=3)
    alone = run_reply(make())

    engine = make()
    ids, _ = build_prompt(engine.tokenizer, MESSAGES, True)
    posted = []
    drive(engine, ids, PARAMS, target="chat", think_open=True, post=posted.append, cancelled=lambda: False)
    done = posted[-1]
    assert isinstance(done, ReplyDone)

    pieces = []
    out = serve.produce(make(), Request("chat", PARAMS, messages=MESSAGES, think=True, stream=True),
                        lambda item: pieces.append(item[1:3]), lambda: False)

    engine = make()
    answer, thinking = io.StringIO(), io.StringIO()
    result = cli.generate(engine, ids, PARAMS, cli.Shown(answer, thinking))

    want = alone.text()
    assert (done.thinking, done.answer) == want
    assert ("".join(out.thinking), "".join(out.answer)) == want
    assert ("".join(t for t, _ in pieces), "".join(a for _, a in pieces)) == want
    assert (result["reasoning"], result["text"]) == want
    assert (thinking.getvalue(), answer.getvalue()) == (want[0] + "\n", want[1] + "\n")
    assert done.reason == out.reason == result["finish_reason"] == "stop"
