"""The app's parts without a screen: think parsing, telemetry definitions, batching, the store."""
from __future__ import annotations

import json
import sqlite3

import pytest

from apphelpers import make_app, ready, run
from mtpchat.app.fake import DEFAULT_ANSWER, DEFAULT_THINKING, FakeEngine, FakeTokenizer
from mtpchat.app.gauges import bar, sparkline
from mtpchat.app.gpu import GpuSample, Sampler, energy_per_token
from mtpchat.app.messages import ReplyDelta, ReplyDone
from mtpchat.app.runner import drive
from mtpchat.app.settings import PRESETS, Sampling, initial_sampling, load_keymap
from mtpchat.app.store import Store, data_dir, decode_spans, encode_spans
from mtpchat.app.telemetry import StepRecord, Telemetry
from mtpchat.chat.think import ThinkSplitter, prompt_opens_think


# --- thinking ---

def split_all(pieces, inside):
    s = ThinkSplitter(inside=inside)
    out = [s.push(p) for p in pieces] + [s.flush()]
    return "".join(t for t, _ in out), "".join(a for _, a in out)


@pytest.mark.parametrize("cut", range(1, 30))
def test_think_split_survives_any_chunking(cut):
    text = "step one, step two</think>\n\nThe answer is 4."
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    assert split_all(pieces, inside=True) == ("step one, step two", "The answer is 4.")


def test_think_split_when_the_model_opens_the_block_itself():
    assert split_all(["<thi", "nk>\nhmm</th", "ink>\n\nyes"], inside=False) == ("\nhmm", "yes")
    assert split_all(["no thinking at all, a < b"], inside=False) == ("", "no thinking at all, a < b")
    assert split_all(["never closed </thin"], inside=True) == ("never closed </thin", "")


def test_prompt_opens_think_reads_token_ids_not_user_text():
    tok = FakeTokenizer()
    thinking = tok.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=True)
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False)
    sneaky = tok.apply_chat_template([{"role": "user", "content": "<think>"}], add_generation_prompt=False)
    assert prompt_opens_think(tok, thinking) and not prompt_opens_think(tok, plain)
    assert not prompt_opens_think(tok, sneaky)


# --- telemetry: the serving engines' definitions, equal to the engine's own Stats ---

def test_telemetry_matches_the_engine_stats():
    engine = FakeEngine(draft_tokens=3)
    tok = engine.tokenizer
    from mtpchat.engine.sampling import SamplingParams
    events = list(engine.generate(tok.apply_chat_template([{"role": "user", "content": "x"}]),
                                  SamplingParams(max_tokens=4096)))
    stats = events[-1].stats
    t = Telemetry()
    t.add_steps([StepRecord.of(e) for e in events if type(e).__name__ == "Step"])
    assert stats.verify_steps > 10 and 0 < stats.accepted < stats.drafted
    assert t.reply.mean_length == pytest.approx(stats.mean_acceptance_length)
    assert t.reply.rate == pytest.approx(stats.draft_acceptance_rate)
    assert t.reply.per_position == pytest.approx(stats.per_position_acceptance)
    assert t.tokens == stats.new_tokens
    assert t.tokens_per_s == pytest.approx(stats.tokens_per_s, rel=1e-6)
    phases = t.phase_ms()
    assert phases["verify"] > phases["draft"] > phases["accept"] > 0
    assert t.session.mean_length is None and t.session_live.mean_length == t.reply.mean_length
    t.finished(stats)
    assert t.session_live is t.session
    t.new_reply()
    assert t.phase_ms() is None and t.reply.mean_length is None
    t.finished(stats)
    assert t.session.mean_length == pytest.approx(stats.mean_acceptance_length)   # two equal replies


def test_session_totals_from_stored_replies():
    t = Telemetry()
    t.load_session([{"verify_steps": 10, "drafted": 30, "accepted": 20, "per_position_acceptance": [0.9, 0.7, 0.4]},
                    {"verify_steps": 30, "drafted": 90, "accepted": 30, "per_position_acceptance": [0.5, 0.3, 0.2]}])
    assert t.session.mean_length == pytest.approx(1 + 50 / 40)
    assert t.session.rate == pytest.approx(50 / 120)
    assert t.session.per_position == pytest.approx([(9 + 15) / 40, (7 + 9) / 40, (4 + 6) / 40])


def test_energy_per_token_over_a_window():
    a = GpuSample(energy_j=100.0, tokens=10)
    assert energy_per_token(a, GpuSample(energy_j=130.0, tokens=20)) == pytest.approx(3.0)
    assert energy_per_token(a, GpuSample(energy_j=130.0, tokens=10)) is None     # idle
    assert energy_per_token(a, GpuSample(tokens=20)) is None                     # unsupported


def test_a_failing_probe_never_stops_the_sampler():
    seen = []

    class Flaky:
        n = 0

        def sample(self):
            Flaky.n += 1
            if Flaky.n % 2:
                raise RuntimeError("NVML: not supported")
            return GpuSample(used=1)
    s = Sampler(Flaky(), lambda x: (seen.append(x), len(seen) >= 3 and s.stop()), lambda: 7, interval=0.001)
    s.run()
    assert len(seen) == 3 and all(x.tokens == 7 and x.used == 1 for x in seen)


# --- the worker's batching ---

def test_drive_batches_by_time_and_ends_with_the_whole_reply():
    engine = FakeEngine()
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=True)
    clock = iter(range(10_000))
    posted = []
    from mtpchat.engine.sampling import SamplingParams
    drive(engine, ids, SamplingParams(max_tokens=4096), target="chat", think_open=True, post=posted.append,
          cancelled=lambda: False, interval=5, clock=lambda: next(clock))
    deltas = [m for m in posted if isinstance(m, ReplyDelta)]
    done = posted[-1]
    assert isinstance(done, ReplyDone) and done.reason == "stop"
    assert done.answer == DEFAULT_ANSWER and done.thinking.strip() == DEFAULT_THINKING
    steps = len(engine.step_log)
    assert len(deltas) == pytest.approx(steps / 5, abs=2)          # one message per 5 clock ticks
    assert sum(len(d.steps) for d in deltas) == steps
    assert "".join(d.answer for d in deltas) == DEFAULT_ANSWER
    assert "".join(t for t, _ in done.spans) == DEFAULT_ANSWER
    assert {d for _, d in done.spans} == {True, False}              # both provenances present


def test_drive_passes_cancellation_to_the_engine():
    engine = FakeEngine()
    posted = []
    from mtpchat.engine.sampling import SamplingParams
    drive(engine, [1, 5], SamplingParams(max_tokens=4096), target="chat", think_open=False, post=posted.append,
          cancelled=lambda: len(engine.step_log) >= 4)
    assert posted[-1].reason == "cancelled" and len(engine.step_log) == 4



def test_drive_leaves_the_decoding_steps_alone_between_batches():
    """The text of the steps is made when a batch goes out, not between the engine's steps."""
    engine = FakeEngine()
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=True)
    now = {"t": 0}

    def tick():
        now["t"] += 1
        return now["t"]
    pushed_at, posted_at = [], []
    streams = engine.tokenizer.stream

    def stream():
        inner = streams()

        class Counting:
            def push(self, part):
                pushed_at.append(now["t"])
                return inner.push(part)
            flush = staticmethod(inner.flush)
        return Counting()
    engine.tokenizer.stream = stream
    from mtpchat.engine.sampling import SamplingParams
    posted = []
    drive(engine, ids, SamplingParams(max_tokens=4096), target="chat", think_open=True,
          post=lambda m: (posted.append(m), posted_at.append(now["t"])), cancelled=lambda: False,
          interval=7, clock=tick)
    assert len(pushed_at) > 3 * len(set(posted_at))            # several steps' text per batch
    assert set(pushed_at) <= set(posted_at)                    # and only when a batch goes out
    assert posted[-1].answer == DEFAULT_ANSWER and posted[-1].thinking.strip() == DEFAULT_THINKING


def test_drive_shows_what_came_before_an_engine_failure():
    engine = FakeEngine(fail_after=6)
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=True)
    from mtpchat.engine.sampling import SamplingParams
    posted = []
    drive(engine, ids, SamplingParams(max_tokens=4096), target="chat", think_open=True, post=posted.append,
          cancelled=lambda: False, interval=10**9, clock=lambda: 0.0)
    failed = posted[-1]
    assert type(failed).__name__ == "ReplyFailed" and "simulated engine failure" in failed.text
    # the first step went out at once; the next five were kept, and still reach the screen
    assert sum(len(m.steps) for m in posted if isinstance(m, ReplyDelta)) == 6
    assert failed.thinking and DEFAULT_THINKING.startswith(failed.thinking.strip()[:20])

# --- the store ---

def test_store_commits_every_message_at_once(tmp_path):
    store = Store(tmp_path, now=lambda: 5.0)
    sid = store.create_session("t", "be brief", "m")
    spans = [("Hello ", False), ("world", True)]
    store.add_message(sid, "user", "hi")
    store.add_message(sid, "assistant", "Hello world", "hmm", encode_spans(spans), {"new_tokens": 3})
    # another connection (a restart after a kill) sees both without any close or commit
    rows = sqlite3.connect(tmp_path / "chats.sqlite3").execute("SELECT role, content, stats FROM messages").fetchall()
    assert rows == [("user", "hi", None), ("assistant", "Hello world", json.dumps({"new_tokens": 3}))]
    (msg,) = [m for m in store.messages(sid) if m.role == "assistant"]
    assert decode_spans(msg.content, msg.spans) == spans
    assert decode_spans("Edited", msg.spans) is None
    store.delete_session(sid)
    assert store.messages(sid) == [] and store.sessions() == []


def test_data_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCHAT_DATA_DIR", str(tmp_path / "env"))
    assert data_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    assert data_dir(None) == tmp_path / "env"
    monkeypatch.delenv("MTPCHAT_DATA_DIR")
    assert data_dir(None).name == "mtpchat"


# --- settings ---

def test_initial_sampling_follows_the_run_command(tmp_path):
    class Opts:
        temperature = None
        top_p = None
        top_k = 7
        min_p = presence_penalty = seed = None
        max_tokens = 100
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    s = initial_sampling(Opts, tmp_path)
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.6, 0.95, 7, 100)
    assert initial_sampling(Opts, None).temperature == 0.0
    assert PRESETS["thinking · general"] == Sampling(1.0, 0.95, 20, 0.0, 1.5)
    assert Sampling(top_p=0).check() and Sampling(temperature=-1).check() and Sampling().check() is None


def test_keymap_file(tmp_path):
    path = tmp_path / "keymap.toml"
    assert load_keymap(path) == ({}, None)
    path.write_text('toggle_mtp = "f2"\nrace = "ctrl+b"\n')
    assert load_keymap(path) == ({"toggle_mtp": "f2", "race": "ctrl+b"}, None)
    path.write_text("toggle_mtp = 3\n")
    assert "must be a string" in load_keymap(path)[1]
    path.write_text("toggle_mtp = \n")
    assert "not valid TOML" in load_keymap(path)[1]


# --- gauges ---

def test_gauges():
    assert bar(0.5, 4) == "██  " and bar(1.2, 3) == "███" and bar(1 / 16, 2) == "▏ "
    assert sparkline([1, 2, 3], 5, lo=1, hi=3) == "  ▁▅█"
    assert sparkline([], 3) == "   " and sparkline([2, 2], 2) == "▄▄"


def test_the_key_list_documents_every_binding():
    from pathlib import Path

    from mtpchat.app.commands import COMMANDS
    doc = (Path(__file__).resolve().parents[2] / "docs" / "KEYS.md").read_text()
    for c in COMMANDS:
        keys = " or ".join(f"`{k}`" for k in c.keys.split(","))
        assert f"| {keys} |" in doc, c.id
        assert c.id == "stop" or f"`{c.id}`" in doc, c.id


@pytest.mark.parametrize("label", ["FP8", "int4"])
def test_the_header_and_the_memory_panel_name_the_weight_format(label):
    from mtpchat.app.panel import Live, header_line, memory
    from mtpchat.app.telemetry import Telemetry
    t = Telemetry()
    t.memory = {"weights": 29 << 30, "kv": 2 << 30, "snapshots": 587 << 20}
    live = Live(model="Qwen3.6-27B", device="cuda", dtype="bfloat16", loaded=True, weights=label)
    assert f"cuda bfloat16 · {label} weights" in header_line(live, "chat")
    lines = [c.plain for c in memory(t, live)]
    assert any(f"{label} wts" in line and "29.0 GiB" in line for line in lines)
    assert any("turns" in line and "587.0 MiB" in line for line in lines)
    plain = Live(model="m", device="cuda", dtype="bfloat16", loaded=True)
    assert label not in header_line(plain, "chat") and not any(label in c.plain for c in memory(t, plain))


@pytest.mark.parametrize("fmt, shown", [("int4", "int4"), ("fp8", "FP8"), ("bf16", None)])
def test_the_app_shows_the_engines_weight_format(data_dir, fmt, shown):
    from mtpchat.app.panel import memory
    engine = FakeEngine(device="cpu", weight_format=fmt)
    app = make_app(data_dir, engine)

    async def go():
        async with app.run_test(size=(140, 40)) as pilot:
            await ready(pilot)
            await pilot.pause()
            header = str(app.query_one("#header").render())
            pane = "\n".join(c.plain for c in memory(app.telemetry, app.live()))
            if shown:
                assert f"cpu float32 · {shown} weights" in header and f"{shown} wts" in pane
            else:
                assert "weights" not in header and "wts" not in pane and "weights" in pane
    run(go())


def test_the_acceptance_panel_shows_the_chosen_k_and_why():
    from mtpchat.app import panel
    from mtpchat.app.panel import Live, acceptance
    from mtpchat.engine.events import PhaseTimes, Step
    live = Live(model="m", device="cuda", loaded=True, mtp=True, draft_tokens=4, k_max=4)
    t = Telemetry()
    t.add_steps([StepRecord.of(Step((1, 2, 3), (True, True, False), 4, 2, True, PhaseTimes(verify=1.0), 5.0))])
    assert not any(c.plain.startswith("drafts") for c in acceptance(t, live))      # a fixed k: no line
    why = "2 of 4 drafts: draft 3 would need 42% acceptance to pay, and gets 36%"
    t.add_steps([StepRecord.of(Step((4, 5), (True, False), 2, 1, True, PhaseTimes(verify=1.0), 9.0, why))])
    lines = [c.plain for c in acceptance(t, live)]
    # the reason in whole words over as many lines as it takes, none past the pane's width
    at = lines.index("drafts  2 of 4 this step")
    assert " ".join(lines[at + 1:at + 3]) == why and all(len(line) <= panel.W for line in lines)
    off = "MTP off: a draft costs more than it can gain"
    t.add_steps([StepRecord.of(Step((6,), (False,), 0, 0, False, PhaseTimes(verify=1.0), 12.0, off))])
    lines = [c.plain for c in acceptance(t, live)]
    at = lines.index("drafts  0 of 4 this step")
    assert " ".join(lines[at + 1:at + 3]) == off


def test_the_prompt_line_is_never_cut():
    from mtpchat.app import panel
    t = Telemetry()
    t.prefilled(17_093, 812.0, 17_000)
    lines = [c.plain for c in panel.speed(t, panel.Live())]
    assert "prompt 93 tok prefilled, 17,000 reused" in lines and all(len(line) <= panel.W for line in lines)


def test_speed_panel_shows_the_experts_an_moe_step_reads():
    from mtpchat.app import panel
    t = Telemetry()
    rec = lambda mtp, experts, at: StepRecord(1 + 2 * mtp, 3 * mtp, 2 * mtp, mtp, 0.1, 1.0, 0.1, 0.1, at, "", experts)
    t.add_steps([rec(False, 40 * 8, 10.0), rec(False, 40 * 8, 20.0), rec(True, 40 * 30, 30.0), rec(True, 40 * 20, 40.0)])
    assert t.experts_per_layer("decode", 40) == 8.0 and t.experts_per_layer("verify", 40) == 25.0
    text = "\n".join(str(line) for line in panel.speed(t, panel.Live(moe_layers=40)))
    assert "8.0 decode" in text and "25.0 verify /layer" in text
    dense = "\n".join(str(line) for line in panel.speed(t, panel.Live()))
    assert "experts" not in dense
