"""An agent's loop against `mtpchat serve`: a scripted tool-using conversation sent as a coding
agent sends it, the whole history every turn, its history growing from --start to --end tokens
over --turns turns. Per turn: the prompt, the tokens new since the last turn, the tokens the
server resumed from its snapshot (usage.prompt_tokens_details.cached_tokens) and the time to the
first token. With snapshots working, the time to first token follows the new tokens, not the history.

    python tests/bench/bench_agent_loop.py --url http://127.0.0.1:8000            # a running server
    python tests/bench/bench_agent_loop.py -- --model qwen3.6-27b-fp8              # starts one
    python tests/bench/bench_agent_loop.py --start 200 --end 1200 --turns 3 -- --model assets/demo --device cpu
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

import httpx

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the project.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
LINE = "    total = sum(value * weight for value, weight in zip(values, weights))  # line {i}\n"


def file_text(tokens: int) -> str:
    """Source text of about `tokens` tokens (a line is about 20)."""
    return "".join(LINE.format(i=i) for i in range(max(tokens // 20, 1)))


def turn(url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[dict, float]:
    """One streamed request: (its usage, seconds to the first token)."""
    start, first, used = time.monotonic(), None, {}
    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") or c["delta"].get("reasoning")
                                     or c["delta"].get("tool_calls") for c in chunk["choices"]):
                first = time.monotonic() - start
            used = chunk.get("usage") or used
    return used, first if first is not None else time.monotonic() - start


def run(url: str, turns: int, start: int, end: int, max_tokens: int) -> list[dict]:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    messages = [{"role": "system", "content": "You are a coding agent. Read files with read_file.\n"
                 + file_text(start)}, {"role": "user", "content": "Find where the weighted total is computed."}]
    step = (end - start) // max(turns - 1, 1)
    rows, last = [], 0
    for i in range(turns):
        used, ttft = turn(url, model, messages, max_tokens)
        prompt = used["prompt_tokens"]
        cached = used.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        rows.append({"turn": i + 1, "prompt_tokens": prompt, "new_tokens": prompt - last, "cached_tokens": cached,
                     "ttft_ms": 1000 * ttft})
        last = prompt
        # what an agent sends next: the reply as a call, the tool's result, and the whole history again
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/part{i}.py"})}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": file_text(step)}]
    return rows


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
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--start", type=int, default=2000, help="history tokens at the first turn")
    p.add_argument("--end", type=int, default=20000, help="history tokens at the last turn")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(own)
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


if __name__ == "__main__":
    sys.exit(main())
