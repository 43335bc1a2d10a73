"""`mtpchat serve` as agents, editors and attackers meet it, as a real process on 127.0.0.1: the
loopback guard and the key, strict request checks (a JSON 4xx naming the field, never a 500), the
queue, a waiting client leaving, signals, the port taken, tools and tool calls, /v1/completions,
the vLLM histograms and the per-request log line."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from serve_support import CONTEXT, PROMPT, ServeProcess, fake_serve_argv

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
# seconds of generation on the CPU unless cancelled
LONG = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": CONTEXT - 64, "ignore_eos": True,
        "temperature": 0, "stream": True}
CALL = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("serve"), "--max-waiting", "2", "--served-model-name", "coder")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("fake"), argv=fake_serve_argv(CALL))
    yield proc.url
    proc.stop()


def post(url, body, **kw):
    return httpx.post(url + CHAT, json=body, timeout=60, **kw)


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def gauge(url: str, name: str) -> float:
    line = next((x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith(name + "{")), " 0")
    return float(line.rsplit(" ", 1)[1])


# -- safe on loopback -----------------------------------------------------------------------------

def test_cross_site_requests_and_other_host_names_are_refused(server):
    url = server.url
    plain = httpx.post(url + CHAT, content=json.dumps({"messages": HI, "max_tokens": 2}),
                       headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
    for path in ("/v1/models", "/metrics", "/health"):
        rebound = httpx.get(url + path, headers={"Host": "evil.example"})
        assert rebound.status_code == 403 and "evil.example" in rebound.json()["error"]["message"]
    assert httpx.get(url + "/v1/models", headers={"Host": "localhost:1234"}).status_code == 200
    assert post(url, {"messages": HI, "max_tokens": 2}).status_code == 200


def test_the_served_name_is_no_path_and_the_model_field_is_checked(server):
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["coder"]
    page = httpx.get(server.url + "/metrics").text
    assert 'model_name="coder"' in page and "/assets/" not in page and "/assets/" not in json.dumps(listed)
    assert post(server.url, {"model": "coder", "messages": HI, "max_tokens": 2}).status_code == 200
    assert post(server.url, {"model": "demo", "messages": HI, "max_tokens": 2}).status_code == 200   # its alias
    wrong = post(server.url, {"model": "gpt-4o", "messages": HI})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    assert "gpt-4o" in wrong.json()["error"]["message"]


def test_a_keyed_server_compares_the_key_and_reads_the_scheme_in_any_case(tmp_path):
    proc = ServeProcess(tmp_path, "--api-key", "s3cret")
    try:
        for auth, status in (("bearer s3cret", 200), ("BEARER  s3cret", 200), ("Bearer s3cre", 401),
                             ("Basic s3cret", 401), ("", 401)):
            r = httpx.get(proc.url + "/v1/models", headers={"Authorization": auth})
            assert r.status_code == status, auth
        assert httpx.get(proc.url + "/v1/models", headers={"Authorization": "Bearer s3cret",
                                                           "Host": "gpu-box.lan"}).status_code == 200
    finally:
        proc.stop()


# -- every bad request a JSON 4xx naming the field -----------------------------------------------

RAW = {   # bodies JSON cannot carry from Python's encoder: (raw body, param)
    "surrogate": (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    "nan": (b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}', "temperature"),
    "infinity": (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": Infinity}', "max_tokens"),
    "1e400": (b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1e400}', "max_tokens"),
    "deep": (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
}
FIELDS = [   # (extra fields, param, words in the message)
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, "messages", "first"),
    ({"seed": 2 ** 70}, "seed", "at most"),
    ({"stream": "false"}, "stream", "boolean"),
    ({"top_p": 0}, "top_p", "more than 0"),
    ({"n": 2}, "n", "only one"),
    ({"max_tokens": -1}, "max_tokens", "at least 1"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not served"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"tool_choice": "required"}, "tool_choice", "offers none"),
    ({"tools": [{"type": "function", "function": {"name": "a"}}],
      "tool_choice": {"type": "function", "function": {"name": "b"}}}, "tool_choice", "'b'"),
    ({"tools": "all"}, "tools", "list"),
    ({"messages": [{"role": "wizard", "content": "a"}]}, "messages", "developer"),
    ({"messages": []}, "messages", "non-empty"),
    ({"stop": [1]}, "stop", "strings"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]}, "messages", "JSON"),
]


@pytest.mark.parametrize("case", list(RAW))
def test_bodies_python_reads_badly_are_a_400(server, case):
    raw, param = RAW[case]
    r = httpx.post(server.url + CHAT, content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra,param,words", FIELDS)
def test_bad_fields_are_a_400_that_names_them(server, extra, param, words):
    r = post(server.url, {"messages": HI, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "None" not in error["message"] and "between 1 and 1" not in error["message"]


def test_unknown_routes_and_methods_are_json_errors_the_sdk_can_show(server):
    openai = pytest.importorskip("openai")
    missing = httpx.post(server.url + "/v1/responses", json={"input": "hi"})
    assert missing.status_code == 404 and "/v1/chat/completions" in missing.json()["error"]["message"]
    wrong = httpx.get(server.url + CHAT)
    assert wrong.status_code == 405 and "GET" in wrong.json()["error"]["message"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no route"):
        client.responses.create(model="coder", input="hi")


def test_the_developer_role_is_read_as_system_and_serve_s_system_goes_first(server):
    r = post(server.url, {"messages": [{"role": "developer", "content": "be brief"}, *HI], "max_tokens": 2,
                          "temperature": 0})
    plain = post(server.url, {"messages": HI, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]


def test_a_body_too_large_is_a_413_and_a_prompt_surely_too_long_is_refused_before_tokenizing(server):
    big = httpx.post(server.url + CHAT, content=b"{" + b" " * (9 << 20) + b"}",
                     headers={"Content-Type": "application/json"}, timeout=60)
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    start = time.monotonic()
    long = post(server.url, {"messages": [{"role": "user", "content": "word " * 1_500_000}]})   # 7.5 MB
    assert long.status_code == 400 and "context" in long.json()["error"]["message"]
    assert time.monotonic() - start < 5 and httpx.get(server.url + "/health").status_code == 200


def test_serve_s_own_flags_are_the_defaults_of_requests_that_do_not_say(tmp_path):
    proc = ServeProcess(tmp_path, "--max-tokens", "3", "--system", "You answer in French.", "--temperature", "0",
                        "--no-think")
    try:
        r = post(proc.url, {"messages": HI})
        assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
        with_system = r.json()["usage"]["prompt_tokens"]
        r = post(proc.url, {"messages": [{"role": "system", "content": "x"}, *HI], "max_tokens": 5})
        assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["usage"]["prompt_tokens"] < with_system
        assert "reasoning" not in r.json()["choices"][0]["message"]     # --no-think
    finally:
        proc.stop()


# -- the queue, a client leaving, signals, the port ------------------------------------------------

def test_past_the_queue_a_429_with_retry_after_and_a_waiting_client_that_leaves_is_never_prefilled(server):
    url, started, release = server.url, threading.Event(), threading.Event()

    def long_stream():
        with httpx.stream("POST", url + CHAT, json=LONG, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            started.set()
            release.wait(30)
    first = threading.Thread(target=long_stream)
    first.start()
    assert started.wait(30)
    prompt_before = gauge(url, "vllm:prompt_tokens_total")
    leavers = [raw_request(url, {"messages": [{"role": "user", "content": "leave " * 500}], "max_tokens": 4})
               for _ in range(2)]
    _wait(lambda: gauge(url, "vllm:num_requests_waiting") == 2, "two requests to wait")
    full = post(url, {"messages": HI, "max_tokens": 2})
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    for s in leavers:
        s.close()
    _wait(lambda: gauge(url, "vllm:num_requests_waiting") == 0, "the clients that left to leave the queue")
    release.set()
    first.join(30)
    r = post(url, {"messages": HI, "max_tokens": 2})
    assert r.status_code == 200
    # the long stream's prompt and the last one's (tens of tokens): none of the 2 x 500 of those that left
    assert gauge(url, "vllm:prompt_tokens_total") - prompt_before < 100


def raw_request(url: str, body: dict) -> socket.socket:
    """A request sent whole on a socket of its own, left open: closing it is the client leaving."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_cleanly_and_every_client_hears_why(tmp_path, sig, code):
    proc = ServeProcess(tmp_path, "--max-waiting", "4")
    url, events, results = proc.url, [], {}
    streaming = threading.Event()

    def stream():
        with httpx.stream("POST", url + CHAT, json=LONG, timeout=60) as r:
            for line in r.iter_lines():
                events.append(line)
                streaming.set()

    def waiting():
        results["queued"] = post(url, dict(LONG, stream=False, max_tokens=8))
    threads = [threading.Thread(target=stream), threading.Thread(target=waiting)]
    threads[0].start()
    assert streaming.wait(30)
    threads[1].start()
    _wait(lambda: gauge(url, "vllm:num_requests_waiting") == 1, "a request to wait")
    start = time.monotonic()
    proc.proc.send_signal(sig)
    assert proc.proc.wait(20) == code
    assert time.monotonic() - start < 10
    for t in threads:
        t.join(10)
    errors = [json.loads(e[6:]) for e in events if e.startswith("data: {\"error\"")]
    assert errors and errors[0]["error"]["code"] == 503 and "data: [DONE]" not in events
    assert results["queued"].status_code == 503 and "stopping" in results["queued"].json()["error"]["message"]
    log = "".join(proc.log)
    assert "Traceback" not in log and "terminate called" not in log and "CancelledError" not in log


def test_a_taken_port_fails_before_the_model_loads(tmp_path, server):
    import subprocess
    import sys
    port = int(server.url.rsplit(":", 1)[1])
    start = time.monotonic()
    other = subprocess.run([sys.executable, "-m", "mtpchat", "serve", "--model", "/no/such/model", "--port", str(port)],
                           capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                             "MTPCHAT_SETTINGS": str(tmp_path / "s")})
    assert other.returncode != 0 and f"{port}" in other.stderr and "--port" in other.stderr
    assert "no such model" not in other.stderr.lower() and "Traceback" not in other.stderr
    assert time.monotonic() - start < 30
    if socket.has_ipv6:   # the other loopback family on the same port is refused too
        six = subprocess.run([sys.executable, "-m", "mtpchat", "serve", "--model", "/no/such", "--host", "::1",
                              "--port", str(port)], capture_output=True, text=True, timeout=60)
        assert six.returncode != 0 and f"{port}" in six.stderr


def test_a_client_that_never_finishes_its_headers_is_closed(server, monkeypatch):
    import mtpchat.serve as serve_module
    assert serve_module.HEADER_TIMEOUT <= 60
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=serve_module.HEADER_TIMEOUT + 15) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        start = time.monotonic()
        assert s.recv(1024) == b""          # closed by the server, not by the timeout here
        assert time.monotonic() - start < serve_module.HEADER_TIMEOUT + 10


# -- the API agents use ---------------------------------------------------------------------------

def test_tool_calls_whole_and_streamed_through_the_openai_client(fake):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=fake + "/v1", api_key="unused")
    history = [{"role": "user", "content": "weather in Paris?"}]
    r = client.chat.completions.create(model="fake", messages=history, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    calls, text, finish = {}, [], None
    for chunk in client.chat.completions.create(model="fake", messages=history, tools=TOOLS, stream=True):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                got = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
    assert "".join(text) == "Checking." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris", "days": 3})]
    # the call and its result go back in the history, as an agent sends them
    history += [choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = client.chat.completions.create(model="fake", messages=history, tools=TOOLS, tool_choice="none")
    assert again.choices[0].finish_reason == "stop" and "<tool_call>" in again.choices[0].message.content


def test_a_malformed_call_comes_back_as_text(server):
    r = post(server.url, {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "max_tokens": 12,
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0})
    assert r.status_code == 200
    message = r.json()["choices"][0]
    # the demo model knows no tools: what it wrote after the forced start stays text, no call is made up
    assert message["finish_reason"] == "length" and "tool_calls" not in message["message"]
    assert message["message"]["content"].startswith("<tool_call>\n<function=get_weather>")


def test_langchain_bind_tools_gets_the_call(fake):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=fake + "/v1", api_key="unused", model="fake", max_retries=0)

    def get_weather(city: str, days: int = 1) -> str:
        """The forecast for a city."""
        return "sunny"
    reply = llm.bind_tools([get_weather]).invoke("weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert reply.tool_calls[0]["args"] == {"city": "Paris", "days": 3}
    streamed = None
    for part in llm.bind_tools([get_weather]).stream("weather in Paris?"):
        streamed = part if streamed is None else streamed + part
    assert streamed.tool_calls[0]["args"] == {"city": "Paris", "days": 3}


def test_completions_stream_and_whole_give_the_same_text(server):
    body = {"model": "coder", "prompt": "def parse_args(argv):", "max_tokens": 16, "temperature": 0}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert whole["object"] == "text_completion" and whole["usage"]["completion_tokens"] == 16
    text = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(text) == whole["choices"][0]["text"] and whole["choices"][0]["text"]


def test_usage_counts_reasoning_tokens(server):
    r = post(server.url, {"messages": HI, "max_tokens": 6, "temperature": 0})
    used = r.json()["usage"]
    assert r.json()["choices"][0]["message"].get("reasoning")       # still thinking at 6 tokens
    assert used["completion_tokens_details"]["reasoning_tokens"] == used["completion_tokens"] == 6


def test_metrics_have_vllm_s_histograms_and_the_log_a_line_per_request(server):
    before = len(server.log)
    r = post(server.url, {"messages": HI, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    page = httpx.get(server.url + "/metrics").text
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        count = [x for x in page.splitlines() if x.startswith(f"vllm:{name}_count{{")]
        assert count and 'model_name="coder"' in count[0] and float(count[0].rsplit(" ", 1)[1]) >= 1, name
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="coder"}' in page
    assert f'vllm:request_prompt_tokens_bucket{{le="{CONTEXT}.0"' not in page    # 1-2-5 buckets up to the context
    assert 'vllm:request_prompt_tokens_bucket{le="2000.0",model_name="coder"}' in page
    _wait(lambda: len(server.log) > before, "the log line")
    line = server.log[-1]
    assert "chat 200" in line and "in=" in line and "out=5" in line and "ttft=" in line and "ms/token" in line
    assert "acceptance=" in line


def test_the_agent_loop_benchmark_resumes_each_turn_from_the_last(server):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
    import bench_agent_loop
    rows = bench_agent_loop.run(server.url, turns=3, start=200, end=1200, max_tokens=4)
    assert [r["turn"] for r in rows] == [1, 2, 3] and rows[-1]["prompt_tokens"] > 1000
    for before, now in zip(rows, rows[1:]):
        # the history up to the last turn is resumed, not prefilled again
        assert now["cached_tokens"] >= before["prompt_tokens"] - 16, rows
