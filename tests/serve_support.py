"""`mtpchat serve` as a real process on a free localhost port, the in-process engine to compare, and
fake servers that fail a client in each way a real one can (or replay a recorded vLLM / SGLang one).

The model is the demo checkpoint in assets/demo: small enough for the CPU, and trained, so its MTP
head's drafts are accepted often (a random checkpoint's almost never are, which would make equal
acceptance figures an equality of zeros)."""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"
PROMPT = "def parse_args(argv):"
MAX_TOKENS = 40
CONTEXT = 4096


class ServeProcess:
    """`python -m mtpchat serve ... --port 0`; the URL is read from the line it prints once bound.
    `argv` replaces the command (a fake engine's server, `fake_serve_argv`)."""

    def __init__(self, tmp: Path, *extra: str, timeout: float = 120.0, argv: list[str] | None = None):
        (tmp / "settings.toml").touch()
        env = dict(os.environ, MTPCHAT_SETTINGS=str(tmp / "settings.toml"), PYTHONUNBUFFERED="1")
        env.pop("MTPCHAT_API_KEY", None)
        argv = argv or [sys.executable, "-m", "mtpchat", "serve", "--model", str(DEMO), "--device", "cpu",
                        "--max-context", str(CONTEXT), "--port", "0", "--no-adaptive-k", *extra]  # a fixed k
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        end = time.monotonic() + timeout
        self.url = None
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(end - time.monotonic(), 0.01))
            except queue.Empty:
                self.stop()
                raise AssertionError("mtpchat serve did not start:\n" + "".join(self.log)) from None
            if line is None:
                raise AssertionError("mtpchat serve exited:\n" + "".join(self.log))
            if m := re.search(r"at (http://\S+)/v1 ", line):
                self.url = m.group(1)

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def fake_serve_argv(answer: str, step_delay: float = 0.0) -> list[str]:
    """The server of `mtpchat serve` around the fake engine (mtpchat/app/fake.py), which answers
    every request with `answer`: a reply the demo model would never write (tool calls)."""
    here = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import serve_support; serve_support.fake_serve()"
    return [sys.executable, "-c", code, json.dumps({"answer": answer, "step_delay": step_delay})]


def fake_serve() -> None:
    from mtpchat import serve
    from mtpchat.app.fake import FakeEngine, FakeTokenizer
    from mtpchat.chat.prompt import Switches
    from mtpchat.engine.sampling import SamplingParams
    from mtpchat.serve_request import Defaults

    class Tokenizer(FakeTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=True, **kw):
            return super().apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                               add_generation_prompt, enable_thinking)
    options = json.loads(sys.argv[1])
    engine = FakeEngine(name="fake", answer=options["answer"], thinking="", step_delay=options["step_delay"])
    engine.tokenizer = Tokenizer()
    defaults = Defaults(SamplingParams(max_tokens=512, stop_token_ids=engine.stop_ids), Switches(think=False),
                        names=("fake",))
    sock = serve.bind("127.0.0.1", 0)
    sys.exit(serve.serve(engine, sock, model="fake", defaults=defaults, host="127.0.0.1", api_key=None,
                         max_waiting=4, announce=lambda line: print(line, file=sys.stderr)))


def in_process(think: bool = True, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS):
    """The same request on the in-process engine: (thinking, answer, stats dict), greedy."""
    import torch
    from mtpchat import cli
    from mtpchat.chat.engine import LocalEngine
    from mtpchat.engine import Engine, SamplingParams
    engine = Engine.load(DEMO, device="cpu", dtype=torch.float32, max_context=CONTEXT)
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], enable_thinking=think)
    result = cli.generate(LocalEngine(engine), ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return result["reasoning"], result["text"], result["stats"]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DATA = Path(__file__).resolve().parent / "data"
CUT_REPLY = "Hello there"


class FakeHandler(BaseHTTPRequestHandler):
    """A server that is not quite right, or replays a recorded one, as `mode` says:
    "cut" streams two pieces and closes without finishing; "html" is a web page, not an API;
    "missing" answers 404 everywhere; "key" refuses every request with 401; "busy" lists its model
    but answers a chat with 429, as `mtpchat serve` past its queue bound; "plain" finishes a reply
    but reports no speculative figures and has no /metrics; "vllm" replays vLLM's recorded stream;
    "sglang" finishes a reply without figures, with SGLang's recorded /metrics page."""
    mode = "cut"

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes, kind="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self) -> bool:
        if self.mode == "key":
            self._send(401, json.dumps({"error": {"message": "Unauthorized", "code": 401}}).encode())
        elif self.mode == "missing":
            self._send(404, b'{"detail":"Not Found"}')
        elif self.mode == "html":
            self._send(200, b"<html>a web page</html>", "text/html")
        return self.mode in ("key", "missing", "html")

    def do_GET(self):
        if self._refuse():
            return
        if self.path == "/v1/models":
            return self._send(200, json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode())
        if self.path == "/metrics" and self.mode == "sglang":
            return self._send(200, (DATA / "sglang-0.5-metrics.txt").read_bytes(), "text/plain")
        self._send(404, b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self._refuse():
            return
        if self.mode == "busy":
            return self._send(429, json.dumps({"error": {"message": "the server is busy", "code": 429}}).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if self.mode == "vllm":
            text = (DATA / "vllm-0.32-chat-stream.txt").read_text()
            self.wfile.write("".join(f"{x}\n" for x in text.splitlines() if not x.startswith("#")).encode())
        else:
            pieces = [{"delta": {"content": t}, "finish_reason": None} for t in ("Hello", " there")]
            if self.mode != "cut":
                pieces.append({"delta": {}, "finish_reason": "stop"})
            for choice in pieces:
                self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, **choice}]})}\n\n".encode())
                self.wfile.flush()
            if self.mode != "cut":
                used = {"prompt_tokens": 9, "completion_tokens": 90, "total_tokens": 99}
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': used})}\n\ndata: [DONE]\n\n".encode())
        self.close_connection = True    # "cut": no finish_reason, no [DONE]


class FakeServer:
    """A FakeHandler on a free localhost port, on a thread of its own."""

    def __init__(self, mode: str = "cut"):
        handler = type("Handler", (FakeHandler,), {"mode": mode})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    """start(mode) -> the URL of a FakeServer in that mode; every one started is closed after the test."""
    servers = []

    def start(mode: str) -> str:
        servers.append(FakeServer(mode))
        return servers[-1].url
    yield start
    for server in servers:
        server.close()
