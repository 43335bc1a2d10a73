"""The client side: /metrics parsers on recorded vLLM and SGLang pages, per-request figures in the
shapes vLLM and SGLang send them (a recorded vLLM stream replayed whole), and every way a server
can fail a user (each one line, the partial reply kept)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_support import fake  # noqa: F401  (a fixture)
from serve_support import CUT_REPLY, free_port

from mtpchat import cli
from mtpchat.app.app import reply_footer
from mtpchat.remote import metrics
from mtpchat.remote.client import RemoteError, StreamCut
from mtpchat.remote.engine import RemoteEngine

DATA = Path(__file__).parent / "data"


def test_vllm_counters_between_two_reads_are_the_request_s_counts():
    before = metrics.parse((DATA / "vllm-0.10-metrics-before.txt").read_text())
    after = metrics.parse((DATA / "vllm-0.10-metrics-after.txt").read_text())
    assert before.counters == {"drafts": 2000, "draft_tokens": 6000, "accepted": 3000}   # both engines
    assert before.per_pos == {0: 1600, 1: 950, 2: 450}
    spec = metrics.between(before, after, 80)
    assert (spec.verify_steps, spec.drafted, spec.accepted, spec.at_least) == (30, 90, 50, [25, 16, 9])
    assert spec.exact and spec.mean_length == pytest.approx(1 + 50 / 30)
    assert metrics.between(after, before, 80) is None          # counters that went back: a restart


def test_sglang_gauges_are_an_estimate_from_the_server_average():
    snap = metrics.parse((DATA / "sglang-0.5-metrics.txt").read_text())
    assert snap.gauges == pytest.approx({"accept_length": 3.0, "accept_rate": 0.65})
    spec = metrics.between(metrics.Snapshot(), snap, 90)
    assert not spec.exact and "average" in spec.source
    assert (spec.verify_steps, spec.accepted) == (30, 60) and spec.mean_length == pytest.approx(3.0)
    assert metrics.between(metrics.Snapshot(), metrics.parse("garbage{"), 90) is None
    assert metrics.between(None, snap, 90) is None


def test_per_request_figures_in_vllm_s_documented_shape():
    stream = (DATA / "vllm-0.32-chat-stream.txt").read_text().splitlines()
    last = json.loads([x for x in stream if x.startswith("data: {")][-1][6:])
    spec = metrics.from_response(last)
    # histogram [39, 1, 0, 3] (steps that accepted exactly 0..3): at least 1, 2, 3 = 4, 3, 3
    assert (spec.verify_steps, spec.drafted, spec.accepted, spec.at_least) == (43, 129, 10, [4, 3, 3])
    assert spec.mean_length == pytest.approx(last["metrics"]["speculative_decoding"]["mean_acceptance_length"])
    assert metrics.from_response({"choices": [], "usage": {}}) is None
    assert metrics.from_response({"metrics": {"speculative_decoding": None}}) is None        # n > 1
    assert metrics.from_response({"metrics": {"speculative_decoding": {"num_spec_steps": "x"}}}) is None


@pytest.mark.parametrize("naming", ["earlier", "later"])
def test_per_request_figures_from_sglang_meta_info(naming):
    sample = json.loads((DATA / "sglang-meta-info.json").read_text())[naming]
    spec = metrics.from_response(sample)
    assert (spec.verify_steps, spec.drafted, spec.accepted, spec.at_least) == (20, 60, 33, [16, 12, 5])
    assert spec.exact and "SGLang" in spec.source
    # a version that sends only the verify count: the accepted drafts follow from the reply's length
    spec = metrics.from_response({"meta_info": {"completion_tokens": 50, "spec_verify_ct": 20}})
    assert (spec.verify_steps, spec.accepted, spec.mean_length) == (20, 30, 2.5)


def chat(engine) -> tuple[list[tuple[str, str]], object]:
    pieces, stats = [], None
    for kind, *rest in engine.chat([{"role": "user", "content": "hi"}], True, cli_params()):
        if kind == "end":
            stats = rest[1]
        else:
            pieces.append((kind, rest[0]))
    return pieces, stats


def test_a_recorded_vllm_stream_gives_thinking_answer_usage_and_figures(fake):
    engine = RemoteEngine.connect(fake("vllm"))
    pieces, stats = chat(engine)
    assert pieces == [("thinking", "The user says hello."), ("thinking", " Answer briefly."),
                      ("answer", "Hello"), ("answer", " there!")]
    assert (stats.prompt_tokens, stats.new_tokens) == (12, 54)
    assert (stats.verify_steps, stats.drafted, stats.accepted, stats.accepted_at_least) == (43, 129, 10, [4, 3, 3])
    assert engine.spec_source == "per request" and not engine.spec_estimate
    assert "mean acceptance 1.23 ·" in reply_footer(stats, "stop", True, 0, engine.spec_estimate)


def test_sglang_metrics_around_a_reply_are_an_estimate_and_none_is_none(fake):
    engine = RemoteEngine.connect(fake("sglang"))
    _, stats = chat(engine)      # 90 tokens at the page's mean length 3.0 (ranks averaged)
    assert (stats.verify_steps, stats.accepted) == (30, 60) and stats.mean_acceptance_length == pytest.approx(3.0)
    assert engine.spec_source == "SGLang /metrics (server average)" and engine.spec_estimate
    assert "mean acceptance 3.00 (server average)" in reply_footer(stats, "stop", True, 0, engine.spec_estimate)
    engine = RemoteEngine.connect(fake("plain"))
    _, stats = chat(engine)
    assert stats.new_tokens == 90 and stats.verify_steps == 0 and engine.spec_source == ""


def test_unreachable_server_and_a_non_openai_endpoint_say_what_to_do(fake):
    with pytest.raises(RemoteError, match=r"cannot reach the server .* is it running"):
        RemoteEngine.connect(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RemoteError, match="did not answer with an OpenAI model list"):
        RemoteEngine.connect(fake("html"))
    with pytest.raises(RemoteError, match="does not exist .*base URL of an OpenAI-compatible server"):
        RemoteEngine.connect(fake("missing"))
    with pytest.raises(RemoteError, match="refused the API key .*--api-key"):
        RemoteEngine.connect(fake("key"), "wrong")


def test_a_stream_cut_mid_reply_keeps_what_came(fake):
    engine = RemoteEngine.connect(fake("cut") + "/v1")
    assert engine.name == "m" and engine.server.metrics_text() is None
    got = []
    with pytest.raises(StreamCut, match="before the reply was complete"):
        for kind, *rest in engine.chat([{"role": "user", "content": "hi"}], True, cli_params()):
            got.append(rest[0])
    assert "".join(got) == CUT_REPLY


def cli_params():
    from types import SimpleNamespace
    return SimpleNamespace(temperature=0.0, top_p=None, top_k=None, min_p=None, presence_penalty=None,
                           max_tokens=16, seed=None)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["run", *argv, "--prompt", "hi"])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_server_on_a_cut_stream_prints_the_partial_reply_and_one_line(fake, capsys, tmp_path, monkeypatch):
    (tmp_path / "settings.toml").touch()
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    code, out, err = run_cli(capsys, "--server", fake("cut"))
    assert code == 1 and out == CUT_REPLY + "\n"
    assert err.count("\n") == 1 and "before the reply was complete" in err
    assert "Traceback" not in err and "above" in err


def test_run_server_json_on_a_cut_stream_keeps_the_partial_reply_in_the_object(fake, capsys, tmp_path, monkeypatch):
    (tmp_path / "settings.toml").touch()
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    code, out, err = run_cli(capsys, "--server", fake("cut"), "--json")
    result = json.loads(out)
    assert code == 1 and result["text"] == CUT_REPLY and result["finish_reason"] == "error"
    assert "before the reply was complete" in result["error"] and result["stats"] is None
    assert err.count("\n") == 1 and err.startswith("mtpchat: error: ") and "Traceback" not in err


@pytest.mark.parametrize("mode, said", [(None, "cannot reach the server"), ("key", "refused the API key"),
                                        ("html", "OpenAI model list"), ("missing", "does not exist"),
                                        ("busy", "busy (HTTP 429")])
def test_run_server_that_cannot_be_used_is_one_line_and_exit_1(fake, capsys, tmp_path, monkeypatch, mode, said):
    (tmp_path / "settings.toml").touch()
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    url = fake(mode) if mode else f"http://127.0.0.1:{free_port()}"
    code, out, err = run_cli(capsys, "--server", url, "--api-key", "wrong")
    assert code == 1 and out == "" and said in err
    assert err.count("\n") == 1 and err.startswith("mtpchat: error: ") and "Traceback" not in err


def test_run_server_says_n_a_where_the_server_reports_no_figures(fake, capsys, tmp_path, monkeypatch):
    (tmp_path / "settings.toml").touch()
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    code, out, err = run_cli(capsys, "--server", fake("plain"))
    assert code == 0 and out == "Hello there\n"
    assert "90 tokens" in err and "speculative decoding: N/A" in err and "mean acceptance" not in err
    code, out, err = run_cli(capsys, "--server", fake("vllm"))
    assert code == 0 and out == "Hello there!\n" and "mean acceptance length 1.23" in err


class LaggingServer:
    """vLLM whose /metrics counters move only some reads after the reply has ended."""
    url = "http://lagging"

    def __init__(self, stale_reads: int):
        page = lambda name: (DATA / f"vllm-0.10-metrics-{name}.txt").read_text()
        self.pages = [page("before")] * (1 + stale_reads) + [page("after")]

    def metrics_text(self):
        return self.pages.pop(0) if len(self.pages) > 1 else self.pages[0]

    def stream_chat(self, body):
        class Stream:
            def __iter__(self):
                for text in ("Hello", " there", " again"):
                    yield {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
                yield {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 40}}

            def close(self):
                pass
        return Stream()


@pytest.mark.parametrize("stale_reads", [0, 2])
def test_counters_that_trail_the_stream_are_read_again(stale_reads):
    from mtpchat.engine.sampling import SamplingParams
    engine = RemoteEngine(LaggingServer(stale_reads), "m")
    *_, (kind, reason, stats) = engine.chat([{"role": "user", "content": "hi"}], True, SamplingParams())
    before = metrics.parse((DATA / "vllm-0.10-metrics-before.txt").read_text())
    after = metrics.parse((DATA / "vllm-0.10-metrics-after.txt").read_text())
    want = metrics.between(before, after, 40)
    assert kind == "end" and stats.verify_steps == want.verify_steps > 0 and stats.accepted == want.accepted
