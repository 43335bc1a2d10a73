"""The `mtpchat` command: the chat app (no subcommand), `run`, `models`, `bench` and `serve`; the
parser is in args.py.

`mtpchat --help` must answer at once, so this module imports nothing heavy: torch, the engine
and the app are imported inside the commands that need them. Every error a user can meet ends as
one or two lines on stderr and a non-zero exit status, never a traceback.
"""
from __future__ import annotations

import importlib
import json
import os
import sys

from mtpchat.args import build_parser, has_module as _has_module, options_from
from mtpchat.errors import NotAvailable, UserError, as_user_error


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    try:
        return COMMANDS[args.command](args) or 0
    except KeyboardInterrupt:
        _err("\ninterrupted")
        return 130
    except BrokenPipeError:  # stdout closed early (`| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        user = as_user_error(e)
        if user is None:
            raise
        first, _, rest = str(user).partition("\n")
        _err(f"mtpchat: error: {first}" + (f"\n  {rest}" if rest else ""))
        return user.exit_code


# ---- commands -----------------------------------------------------------------------------------

def _api_key(args) -> str | None:
    return getattr(args, "api_key", None) or os.environ.get("MTPCHAT_API_KEY") or None


def _needs(*modules: str) -> None:
    missing = [m for m in modules if not _has_module(m)]
    if missing:
        names = {"prometheus_client": "prometheus_client"}
        raise NotAvailable(f"this needs {', '.join(names.get(m, m) for m in missing)}: "
                           f"pip install {' '.join(missing)}")


def cmd_app(args) -> int:
    options = options_from(args)
    if getattr(args, "server", None):
        _needs("httpx", "prometheus_client", "textual")
        from mtpchat.app.main import run_app
        args.options = options
        return run_app(args) or 0
    if getattr(args, "dry_run", False):
        return dry_run(options)
    if not _has_module("mtpchat.app.main"):
        raise NotAvailable("the chat app is not part of this build yet; "
                           "`mtpchat run --prompt TEXT` answers without it")
    if not _has_module("textual"):
        raise NotAvailable("the chat app needs textual (pip install 'textual>=8,<9'); "
                           "`mtpchat run --prompt TEXT` works without it")
    from mtpchat import loader
    prep = loader.prepare(options)
    for note in prep.notices:
        _err(note)
    from mtpchat.app.main import run_app
    args.options, args.prepared = options, prep
    cpu_allocator(prep.device)
    return run_app(args) or 0


def cmd_models(args) -> int:
    from mtpchat.models import list_models
    print("\n".join(list_models()))
    return 0


def cmd_bench(args) -> int:
    if not _has_module("mtpchat.bench"):
        raise NotAvailable("`mtpchat bench` is not available yet in this build")
    args.options = options_from(args)
    return importlib.import_module("mtpchat.bench").main(args) or 0


def cpu_allocator(device: str) -> bool:
    """Before an engine loads on the CPU: glibc's malloc thresholds fixed, so the temporaries each
    decode step frees and allocates again stay in the process (mtpchat/malloc.py says why). Whether
    they were set; a GPU run leaves the allocator as it is."""
    if not str(device).startswith("cpu"):
        return False
    from mtpchat import malloc
    return malloc.keep_step_memory()


def _load_engine(options):
    """(prepared, engine) for `run` and `serve`: the plan's notices said, the engine loaded, and a
    line where the MTP head it was asked for is unusable."""
    from mtpchat import loader
    prep = loader.prepare(options)
    for note in prep.notices:
        _err(note)
    cpu_allocator(prep.device)
    engine = loader.load_engine(prep)
    if prep.mtp and not engine.mtp_available:
        _err(f"{prep.name}: " + "; ".join(engine.notices or ["the MTP head is unusable: running with MTP off"]))
    return prep, engine


def dry_run(options) -> int:
    from mtpchat import loader
    from mtpchat.engine import memory
    prep = loader.prepare(options, dry_run=True)
    for note in prep.notices:
        _err(note)
    cfg = prep.config
    print(f"model: {prep.name}" + (f" ({prep.path})" if prep.path else ""))
    print(f"parameters: {memory.text_params(cfg):,} text + {memory.mtp_params(cfg):,} MTP")
    print(f"device: {prep.device}, {prep.dtype}{', FP8 weights' if prep.plan.weight_format == 'fp8' else ''}; "
          f"MTP {'on' if prep.mtp else 'off'}, "
          f"{prep.draft_tokens} draft tokens per step; CUDA graphs {'on' if prep.cuda_graphs else 'off'}")
    print("\n".join(memory.describe(prep.plan)))
    if prep.free is None:
        print("free memory on the device: unknown")
        return 0
    print(f"free memory on {prep.device}: {memory.fmt_bytes(prep.free)}")
    if prep.plan.fits(prep.free):
        print("fits")
        return 0
    print(loader.not_enough_memory_message(prep))
    return 1


def _read_prompt(args) -> str:
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if args.prompt == "-" or not sys.stdin.isatty():
        return sys.stdin.read()
    raise UserError("give the prompt with --prompt TEXT (or pipe it on stdin)", exit_code=2)


def cmd_run(args) -> int:
    options = options_from(args)
    if getattr(args, "server", None):
        _needs("httpx", "prometheus_client")
        from mtpchat.remote.run import run_remote
        return run_remote(args, options, _read_prompt(args), _api_key(args))
    if "snapshots" not in vars(args):
        options.snapshots = 0          # one answer: no later turn resumes from a snapshot
    if getattr(args, "dry_run", False):
        return dry_run(options)
    prompt = _read_prompt(args)
    from mtpchat import loader
    prep, engine = _load_engine(options)
    messages = ([{"role": "system", "content": options.system}] if options.system else []) \
        + [{"role": "user", "content": prompt}]
    prompt_ids = engine.tokenizer.apply_chat_template(messages, enable_thinking=options.think)
    if len(prompt_ids) >= prep.max_context:
        raise UserError(f"the prompt is {len(prompt_ids):,} tokens but --max-context is {prep.max_context:,}; "
                        "raise --max-context or shorten the prompt")
    params = loader.sampling_params(options, prep.path)
    result = generate(engine, prompt_ids, params, stream_to=None if args.json else sys.stdout)
    if args.json:
        result.update(model=prep.name, device=prep.device, dtype=prep.dtype,
                      mtp=bool(engine.mtp), draft_tokens=engine.draft_tokens, adaptive_k=bool(engine.adaptive),
                      draft_vocab=engine.draft_vocab)
        print(json.dumps(result, ensure_ascii=False))
    else:
        _err(summary(result))
    return 0


def generate(engine, prompt_ids: list[int], params, stream_to=None) -> dict:
    """Run one generation; stream the text to `stream_to` if given; return the JSON-able result."""
    from mtpchat.engine.events import Finished, Step
    stream, stop = engine.tokenizer.stream(), set(engine.stop_ids)
    pieces: list[str] = []
    finished = None

    def emit(piece: str):
        if piece:
            pieces.append(piece)
            if stream_to is not None:
                stream_to.write(piece)
                stream_to.flush()
    for event in engine.generate(prompt_ids, params):
        if isinstance(event, Step):  # the stop token ends the turn; it is not part of the text
            emit(stream.push([t for t in event.token_ids if t not in stop]))
        elif isinstance(event, Finished):
            finished = event
    emit(stream.flush())
    if stream_to is not None:
        stream_to.write("\n")
        stream_to.flush()
    stats = finished.stats.as_dict()
    return {"text": "".join(pieces), "token_ids": list(finished.token_ids),
            "prompt_tokens": len(prompt_ids), "finish_reason": finished.reason, "stats": stats}


def summary(result: dict) -> str:
    s = result["stats"]
    line = (f"[{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, "
            f"time to first token {s['ttft_ms']:.0f} ms")
    if s["drafted"]:
        line += (f", mean acceptance length {s['mean_acceptance_length']:.2f}, "
                 f"draft acceptance {100 * s['draft_acceptance_rate']:.0f}%")
    if result["finish_reason"] != "stop":
        line += f", stopped: {result['finish_reason']}"
    return line + "]"


def cmd_serve(args) -> int:
    options = options_from(args)
    if getattr(args, "dry_run", False):
        return dry_run(options)
    _needs("starlette", "uvicorn", "prometheus_client")
    from mtpchat import serve
    key = _api_key(args)
    serve.check_bind(args.host, key)
    if not 0 <= args.port <= 65535 or args.max_waiting < 0:
        raise UserError("--port must be 0..65535 and --max-waiting 0 or more", exit_code=2)
    prep, engine = _load_engine(options)
    serve.serve(engine, model=prep.name, host=args.host, port=args.port, api_key=key, think=options.think,
                max_waiting=args.max_waiting, announce=_err)
    return 0


COMMANDS = {None: cmd_app, "run": cmd_run, "models": cmd_models, "bench": cmd_bench, "serve": cmd_serve}
