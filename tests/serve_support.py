"""`mtpchat serve` as a real process on a free localhost port, and the in-process engine to compare.

The model is the demo checkpoint in assets/demo: small enough for the CPU, and trained, so its MTP
head's drafts are accepted often (a random checkpoint's almost never are, which would make equal
acceptance figures an equality of zeros)."""
from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"
PROMPT = "def parse_args(argv):"
MAX_TOKENS = 40
CONTEXT = 4096


class ServeProcess:
    """`python -m mtpchat serve ... --port 0`; the URL is read from the line it prints once bound."""

    def __init__(self, tmp: Path, *extra: str, timeout: float = 120.0):
        env = dict(os.environ, MTPCHAT_SETTINGS=str(tmp / "settings.toml"), PYTHONUNBUFFERED="1")
        env.pop("MTPCHAT_API_KEY", None)
        argv = [sys.executable, "-m", "mtpchat", "serve", "--model", str(DEMO), "--device", "cpu",
                "--max-context", str(CONTEXT), "--port", "0", "--no-adaptive-k", *extra]  # a fixed k: figures to compare
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


def in_process(think: bool = True, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS):
    """The same request on the in-process engine: (thinking, answer, stats dict), greedy."""
    import torch
    from mtpchat import cli
    from mtpchat.app.think import ThinkSplitter, prompt_opens_think
    from mtpchat.engine import Engine, SamplingParams
    engine = Engine.load(DEMO, device="cpu", dtype=torch.float32, max_context=CONTEXT)
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], enable_thinking=think)
    result = cli.generate(engine, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    split = ThinkSplitter(inside=prompt_opens_think(engine.tokenizer, ids))
    think_text, answer = split.push(result["text"])
    tail = split.flush()
    return think_text + tail[0], answer + tail[1], result["stats"]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
