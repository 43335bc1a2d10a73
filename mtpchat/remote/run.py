"""`mtpchat run --server URL`: one answer from a server, printed as `run` prints the local engine's.

The answer streams to stdout (the thinking is not printed; `--json` carries it as "reasoning"), the
one-line summary goes to stderr, and `--json` prints one object with the keys of the local `run`
where the server gives them (no token ids: a server sends text). A stream cut mid-reply keeps what
came: above the error's line, or with `--json` in the object, finish_reason "error" and the line.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from mtpchat.chat.reply import summary
from mtpchat.errors import UserError
from mtpchat.remote.engine import RemoteEngine


def sampling_of(options):
    """The sampling flags as set; an unset one is left out of the request, so the server uses the
    model's defaults (its generation_config.json), as the local `run` does."""
    names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "max_tokens", "seed")
    return SimpleNamespace(**{n: getattr(options, n, None) for n in names})


def run_remote(args, options, prompt: str, api_key: str | None) -> int:
    engine = RemoteEngine.connect(args.server, api_key, getattr(args, "served_model", None))
    messages = ([{"role": "system", "content": options.system}] if options.system else []) \
        + [{"role": "user", "content": prompt}]
    params = sampling_of(options)
    out = None if args.json else sys.stdout
    thinking, answer = [], []
    reason, stats = "stop", None
    try:
        for kind, *rest in engine.chat(messages, options.think, params):
            if kind == "end":
                reason, stats = rest
            elif kind == "thinking":
                thinking.append(rest[0])
            else:
                answer.append(rest[0])
                if out is not None:
                    out.write(rest[0])
                    out.flush()
    except UserError as exc:
        line = str(exc).splitlines()[0]
        if args.json and answer:     # what came, kept and marked; the error's line goes to stderr as well
            print(json.dumps({"text": "".join(answer), "reasoning": "".join(thinking), "finish_reason": "error",
                              "error": line, "stats": None, "model": engine.name, "server": engine.server.url},
                             ensure_ascii=False))
        if out is not None and answer:
            out.write("\n")
            out.flush()
        kept = f" (the {len(''.join(answer))} characters that came are above)" if answer and out is not None else ""
        raise UserError(f"{line}{kept}") from None
    finally:
        engine.server.close()
    result = {"text": "".join(answer), "reasoning": "".join(thinking), "prompt_tokens": stats.prompt_tokens,
              "finish_reason": reason, "stats": stats.as_dict() | {"source": engine.spec_source or None},
              "model": engine.name, "server": engine.server.url}
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        out.write("\n")
        line = summary(result)
        if not stats.verify_steps:
            line = line[:-1] + ", speculative decoding: N/A (the server reports none)]"
        print(line, file=sys.stderr, flush=True)
    return 0
