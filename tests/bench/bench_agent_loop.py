"""An agent's loop against `mtpchat serve`: a scripted tool-using conversation sent as a coding
agent sends it, the whole history every turn, its history growing from --start to --end tokens
over --turns turns. Per turn: the prompt, the tokens new since the last turn, the tokens the
server resumed from its snapshot (usage.prompt_tokens_details.cached_tokens) and the time to the
first token. With snapshots working, the time to first token follows the new tokens, not the history.

    python tests/bench/bench_agent_loop.py --url http://127.0.0.1:8000            # a running server
    python tests/bench/bench_agent_loop.py -- --model qwen3.6-27b-fp8              # starts one
    python tests/bench/bench_agent_loop.py --start 200 --end 1200 --turns 3 -- --model assets/demo --device cpu
    python tests/bench/bench_agent_loop.py --random-weights qwen3.6-27b --weights fp8 --device cuda

--random-weights needs no checkpoint and no network: the engine is built in this process with random
weights of an official shape (engine/configs/NAME.json, or a config.json's path), wrapped as `mtpchat
serve` wraps it (LocalEngine, build_app, uvicorn, its turn snapshots on) and served on a free loopback
port from a thread of this process. The demo model's tokenizer and chat template render the
conversation: its vocabulary is smaller than a real model's, so its ids are valid ones, and the tool
results are sized by its own count of tokens per line, so the history grows from --start to --end
tokens as it would with the model's own tokenizer. The random model's reply ids past that vocabulary
are shown as ids within it (the text is noise either way; only its cost matters). Beside the table: the
shape, the weights, the device, the date and the command, for docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the project.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
LINE = "    total = sum(value * weight for value, weight in zip(values, weights))  # line {i}\n"
PER_LINE = 20            # tokens of a LINE, as the text is sized for a server of unknown tokenizer


def file_text(tokens: int, per_line: float = PER_LINE) -> str:
    """Source text of about `tokens` tokens, a line being `per_line` of them."""
    return "".join(LINE.format(i=i) for i in range(max(int(tokens // per_line), 1)))


def turn(url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[dict, float]:
    """One streamed request: (its usage, seconds to the first token)."""
    start, first, used = time.monotonic(), None, {}
    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"the server answered {r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") or c["delta"].get("reasoning")
                                     or c["delta"].get("tool_calls") for c in chunk["choices"]):
                first = time.monotonic() - start
            used = chunk.get("usage") or used
    return used, first if first is not None else time.monotonic() - start


def run(url: str, turns: int, start: int, end: int, max_tokens: int, per_line: float = PER_LINE,
        say=lambda line: None) -> list[dict]:
    """The rows of the table; `per_line`: tokens of a LINE with the server's tokenizer; `say` hears
    each turn as it ends."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    messages = [{"role": "system", "content": "You are a coding agent. Read files with read_file.\n"
                 + file_text(start, per_line)}, {"role": "user", "content": "Find where the weighted total is computed."}]
    step = (end - start) // max(turns - 1, 1)
    rows, last = [], 0
    for i in range(turns):
        used, ttft = turn(url, model, messages, max_tokens)
        prompt = used["prompt_tokens"]
        cached = used.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        rows.append({"turn": i + 1, "prompt_tokens": prompt, "new_tokens": prompt - last, "cached_tokens": cached,
                     "ttft_ms": 1000 * ttft})
        say(f"turn {i + 1}: {prompt:,} prompt tokens, {cached:,} resumed, {1000 * ttft:.0f} ms to the first token")
        last = prompt
        # what an agent sends next: the reply as a call, the tool's result, and the whole history again
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/part{i}.py"})}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": file_text(step, per_line)}]
    return rows


class FoldedIds:
    """The demo tokenizer over a larger model's vocabulary: an id past its own is shown as one of its
    plain (not special) tokens; everything else is the demo tokenizer's, chat template included."""

    def __init__(self, tok):
        self.tok, self.n, self.plain = tok, tok.vocab_size, min(tok.added_token_ids, default=tok.vocab_size)

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def fold(self, ids) -> list[int]:
        return [i if i < self.n else i % self.plain for i in ids]

    def decode(self, ids, **kw) -> str:
        return self.tok.decode(self.fold(ids), **kw)

    def stream(self, **kw):
        inner, fold = self.tok.stream(**kw), self.fold

        class Stream:
            push = staticmethod(lambda ids: inner.push(fold(ids)))
            flush = staticmethod(inner.flush)
        return Stream()


def random_engine(name: str, weights: str, device: str, max_context: int | None, context_for: int):
    """(Engine with random weights of `name`'s shape and the demo tokenizer, its shape's label).
    `max_context` None: `context_for` tokens and some room, where the shape has it."""
    import torch
    from mtpchat.bench import RANDOM, RANDOM_4BIT, random_config
    from mtpchat.engine import Engine
    from mtpchat.engine.config import ModelConfig
    from mtpchat.engine.tokenizer import Tokenizer
    from mtpchat.malloc import cpu_allocator
    from mtpchat.models import DEMO_DIR
    from mtpchat.progress import LoadBar
    if name.endswith(".json"):
        config, label = ModelConfig.load(name), f"{Path(name).resolve().parent.name} ({name})"
    elif name.lower() in (*RANDOM, *RANDOM_4BIT):
        config, label = random_config(name.lower()), name.lower()
    else:
        raise SystemExit(f"--random-weights {name}: not an official shape ({', '.join((*RANDOM, *RANDOM_4BIT))}) "
                         "nor a config.json's path")
    tok = Tokenizer.load(DEMO_DIR)
    if config.vocab_size < tok.vocab_size:
        raise SystemExit(f"--random-weights {name}: its vocabulary ({config.vocab_size:,}) is smaller than the demo "
                         f"tokenizer's ({tok.vocab_size:,}), whose ids the prompts are; take a shape with a larger one")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible to torch; --device cpu runs a small shape")
    max_context = min(max_context or context_for, config.max_position_embeddings)
    cpu_allocator(device)
    bar = LoadBar()
    try:
        # as `mtpchat serve` loads a model: its turn snapshots (the default count), adaptive k
        engine = Engine(config, device=device, max_context=max_context, cuda_graphs=device.startswith("cuda"),
                        weights=None if weights == "auto" else weights, adaptive=True, progress=bar)
    except ValueError as exc:
        raise SystemExit(f"--random-weights {name}: {exc}") from None
    finally:
        bar.close()
    engine.tokenizer = FoldedIds(tok)       # stop_ids: the demo tokenizer's end of turn
    return engine, label


@contextlib.contextmanager
def random_server(engine, model: str):
    """`engine` served as `mtpchat serve` serves it, on a free loopback port from a thread of this
    process; yields its URL, and stops the server (and any generation still running) at the end."""
    from mtpchat import serve
    from mtpchat.chat.engine import LocalEngine
    from mtpchat.chat.prompt import Switches
    from mtpchat.engine import SamplingParams
    from mtpchat.serve_request import Defaults
    chat = LocalEngine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=chat.max_context, stop_token_ids=tuple(chat.stop_ids))
    app = serve.build_app(chat, model=model, defaults=Defaults(params, Switches(), names=(model,)))
    sock = serve.bind("127.0.0.1", 0)
    server = serve.http_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="server", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise SystemExit("the server did not start (its error is above)")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        running = app.state.running()
        if running is not None:        # a generation on its thread: it ends at its next step
            running[0].set()
            running[1].join(30)
        sock.close()


def device_name(device) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"CPU ({line.split(':', 1)[1].strip()}, {torch.get_num_threads()} threads)"
    return "CPU"


def setup_lines(engine, label: str, argv: list[str], args) -> list[str]:
    """What the table was measured on, and how to measure it again."""
    import torch
    from mtpchat.models import WEIGHT_LABELS
    fmt = engine.weight_format
    versions = f"torch {torch.__version__}"
    if engine.device.type == "cuda":
        import triton
        versions += f", triton {triton.__version__}, CUDA graphs {'on' if engine.cuda_graphs else 'off'}"
    return [f"model: random weights of the {label} shape, {WEIGHT_LABELS.get(fmt, fmt)} weights; the demo model's "
            f"tokenizer and chat template",
            f"device: {device_name(engine.device)}; {versions}",
            f"context: {engine.max_context:,} tokens, {engine.decoder.snapshots.count} turn snapshots, MTP "
            f"{'on' if engine.mtp else 'off'}; {args.max_tokens} tokens generated per turn, greedy",
            f"date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
            "command: python tests/bench/bench_agent_loop.py " + shlex.join(argv), ""]


def table(rows: list[dict]) -> str:
    out = ["| turn | prompt tokens | new tokens | resumed tokens | time to first token |", "|---|---|---|---|---|"]
    out += [f"| {r['turn']} | {r['prompt_tokens']:,} | {r['new_tokens']:,} | {r['cached_tokens']:,} | "
            f"{r['ttft_ms']:.0f} ms |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, serve_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start `mtpchat serve` with the arguments after --)")
    p.add_argument("--random-weights", metavar="NAME",
                   help="serve random weights of an official shape (engine/configs/NAME.json, or a config.json's "
                        "path) from this process: no checkpoint, no network")
    p.add_argument("--weights", choices=("auto", "fp8", "bf16"), default="auto",
                   help="with --random-weights: how the big products are held (auto: as the shape's config says)")
    p.add_argument("--device", default="auto", help="with --random-weights: cuda, cuda:N or cpu (auto: cuda if any)")
    p.add_argument("--max-context", type=int, metavar="N",
                   help="with --random-weights: the server's context (default: the last turn and some room)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--start", type=int, default=2000, help="history tokens at the first turn")
    p.add_argument("--end", type=int, default=20000, help="history tokens at the last turn")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(own)
    if args.random_weights:
        if args.url or serve_args:
            p.error("--random-weights serves its own model: give neither --url nor arguments after --")
        return random_main(args, argv)
    proc = None
    url = args.url
    if url is None:
        proc = subprocess.Popen([sys.executable, "-m", "mtpchat", "serve", "--port", "0", *serve_args],
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        for line in proc.stderr:
            if m := re.search(r"at (http://\S+)/v1 ", line):
                url = m.group(1)
                break
        if url is None:
            print("mtpchat serve did not start", file=sys.stderr)
            return 1
    try:
        rows = run(url.rstrip("/"), args.turns, args.start, args.end, args.max_tokens)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(rows) if args.json else table(rows))
    return 0


def random_main(args, argv: list[str]) -> int:
    """--random-weights: the engine built here, served from a thread, the loop run against it."""
    say = lambda line: print(f"[{time.monotonic() - t0:6.1f} s] {line}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    say(f"building random weights of {args.random_weights} ({args.weights}) on {args.device}")
    # the last prompt is about --end tokens, plus the template's markup and the reply
    engine, label = random_engine(args.random_weights, args.weights, args.device, args.max_context,
                                  args.end + args.end // 8 + args.max_tokens + 1024)
    tok = engine.tokenizer.tok
    per_line = len(tok.encode(file_text(100 * PER_LINE))) / 100
    say(f"loaded; {per_line:.1f} demo tokens a line of the tool results")
    with random_server(engine, Path(args.random_weights).parent.name if args.random_weights.endswith(".json")
                       else args.random_weights.lower()) as url:
        rows = run(url, args.turns, args.start, args.end, args.max_tokens, per_line, say)
    if args.json:
        print(json.dumps(rows))
    else:
        print("\n".join(setup_lines(engine, label, argv, args)) + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
