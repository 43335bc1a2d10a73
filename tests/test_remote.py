"""The client side: /metrics parsers on recorded vLLM and SGLang pages, per-request figures, and every
way a server can fail a user (each one line, the partial reply kept)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from serve_support import free_port

from mtpchat import cli
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


def test_per_request_figures_from_vllm_and_sglang_responses():
    vllm = {"choices": [], "metrics": {"speculative_decoding": {
        "num_drafts": 12, "num_draft_tokens": 36, "num_accepted_tokens": 20, "num_accepted_tokens_per_pos": [10, 7, 3]}}}
    spec = metrics.from_response(vllm)
    assert (spec.verify_steps, spec.drafted, spec.accepted, spec.at_least) == (12, 36, 20, [10, 7, 3])
    sglang = {"meta_info": {"completion_tokens": 50, "spec_verify_ct": 20}}
    spec = metrics.from_response(sglang)
    assert (spec.verify_steps, spec.accepted, spec.mean_length) == (20, 30, 2.5)
    assert metrics.from_response({"choices": [], "usage": {}}) is None


class Fake(BaseHTTPRequestHandler):
    """A server that is not quite right, as `mode` says."""
    mode = "ok"

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes, kind="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.mode == "html":
            return self._send(200, b"<html>a web page</html>", "text/html")
        if self.path == "/v1/models":
            return self._send(200, json.dumps({"data": [{"id": "m"}]}).encode())
        self._send(404, b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in ("Hello", " there"):
            chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.close_connection = True    # cut: no finish_reason, no [DONE]


@pytest.fixture
def fake():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    Fake.mode = "ok"
    httpd.shutdown()


def url_of(httpd) -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}"


def test_unreachable_server_and_a_non_openai_endpoint_say_what_to_do(fake):
    with pytest.raises(RemoteError, match=r"cannot reach the server .* is it running"):
        RemoteEngine.connect(f"http://127.0.0.1:{free_port()}")
    Fake.mode = "html"
    with pytest.raises(RemoteError, match="OpenAI-compatible"):
        RemoteEngine.connect(url_of(fake))


def test_a_stream_cut_mid_reply_keeps_what_came(fake):
    engine = RemoteEngine.connect(url_of(fake) + "/v1")
    assert engine.name == "m" and engine.server.metrics_text() is None
    got = []
    with pytest.raises(StreamCut, match="before the reply was complete"):
        for kind, *rest in engine.chat([{"role": "user", "content": "hi"}], True, cli_params()):
            got.append(rest[0])
    assert got == ["Hello", " there"]


def cli_params():
    from types import SimpleNamespace
    return SimpleNamespace(temperature=0.0, top_p=None, top_k=None, min_p=None, presence_penalty=None,
                           max_tokens=16, seed=None)


def test_run_server_on_a_cut_stream_prints_the_partial_reply_and_one_line(fake, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    code = cli.main(["run", "--server", url_of(fake), "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "Hello there\n"
    assert err.count("\n") == 1 and "before the reply was complete" in err
    assert "Traceback" not in err and "above" in err
    code = cli.main(["run", "--server", f"http://127.0.0.1:{free_port()}", "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 1 and "cannot reach" in err and err.count("\n") == 1
