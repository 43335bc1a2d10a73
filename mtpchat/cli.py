"""The `mtpchat` command: the chat app (no subcommand), `run`, `models` and `bench`.

`mtpchat --help` must answer at once, so this module imports nothing heavy: torch, the engine
and the app are imported inside the commands that need them. Every error a user can meet ends as
one or two lines on stderr and a non-zero exit status, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from mtpchat.errors import NotAvailable, UserError, as_user_error
from mtpchat.settings import CHECKS, MAX_DRAFT_TOKENS

S = argparse.SUPPRESS  # options left out stay out of the namespace, so the settings file can fill them

EPILOG = """\
examples:
  mtpchat                                   chat with the demo model
  mtpchat --model Qwen3.6-27B-MTP           chat with a model from Hugging Face (downloaded once)
  mtpchat run --prompt "Hello" --json       one answer, as JSON, for scripts
  mtpchat run --model Qwen3.5-9B --dry-run  the memory plan, without loading anything
  mtpchat models                            the aliases and what is downloaded
  mtpchat --server http://gpu-box:8000      the app on a vLLM / SGLang / mtpchat serve server
  mtpchat serve --port 8000                 this engine behind an OpenAI-compatible API

defaults come from settings.toml in the user config directory (MTPCHAT_SETTINGS to move it);
flags win. See docs/CLI.md."""


def _type(key: str):
    check = CHECKS[key]

    def convert(text: str):
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = key.replace("_", "-")  # argparse names the type in its messages
    return convert


class _Version(argparse.Action):
    """--version, looked up only when asked for (importlib.metadata is not free)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=S, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version
        try:
            v = version("mtpchat")
        except PackageNotFoundError:
            v = "unknown (not installed)"
        print(f"mtpchat {v}")
        parser.exit()


def _common() -> argparse.ArgumentParser:
    """The flags shared by the app, `run` and `bench`."""
    p = argparse.ArgumentParser(add_help=False)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=S, type=_type("model"), metavar="NAME",
                   help="alias (see `mtpchat models`), local folder, or Hugging Face org/name "
                        "(default: the demo model)")
    m.add_argument("--device", default=S, type=_type("device"), metavar="{auto,cpu,cuda}",
                   help="auto = cuda when available, else cpu (default: auto)")
    m.add_argument("--dtype", default=S, type=_type("dtype"), metavar="{auto,bfloat16,float16,float32}",
                   help="auto = bfloat16 on cuda, float32 on cpu")
    m.add_argument("--weights", default=S, type=_type("weights"), metavar="{auto,bf16,fp8}",
                   help="auto = the checkpoint's own format (FP8 for an FP8 release); fp8 = quantize a bf16 "
                        "checkpoint to FP8 as it loads (half the bytes a token); bf16 = dequantize an FP8 one")
    m.add_argument("--max-context", default=S, type=_type("max_context"), metavar="N",
                   help="tokens of context to allocate (default: 8192, or what the model "
                        "supports and the memory holds, if less)")
    m.add_argument("--offline", default=S, action="store_true",
                   help="never touch the network; use only the local cache")
    m.add_argument("--dry-run", default=S, action="store_true",
                   help="print the memory plan and exit before reading any weight")
    d = p.add_argument_group("decoding")
    d.add_argument("--mtp", default=S, action=argparse.BooleanOptionalAction,
                   help="draft with the model's MTP head (default: on when the checkpoint has one)")
    d.add_argument("--draft-tokens", default=S, type=_type("draft_tokens"), metavar="K",
                   help=f"drafts per step, 1..{MAX_DRAFT_TOKENS}; with --adaptive-k the most (default: 3)")
    d.add_argument("--adaptive-k", default=S, action=argparse.BooleanOptionalAction,
                   help="choose each step's number of drafts from the acceptance and step times seen, "
                        "MTP off where drafting does not pay (default: on)")
    d.add_argument("--draft-vocab", default=S, type=_type("draft_vocab"), metavar="N",
                   help="draft only among the N most frequent tokens, a smaller product per draft "
                        "(default: 32768; 0: the whole vocabulary)")
    d.add_argument("--cuda-graphs", default=S, action=argparse.BooleanOptionalAction,
                   help="capture decode steps as CUDA graphs (default: on)")
    s = p.add_argument_group("sampling (unset: the checkpoint's generation_config.json, else greedy)")
    s.add_argument("--temperature", default=S, type=_type("temperature"), metavar="T",
                   help="0 = greedy")
    s.add_argument("--top-p", default=S, type=_type("top_p"), metavar="P")
    s.add_argument("--top-k", default=S, type=_type("top_k"), metavar="K", help="0 = off")
    s.add_argument("--min-p", default=S, type=_type("min_p"), metavar="P")
    s.add_argument("--presence-penalty", default=S, type=_type("presence_penalty"), metavar="X",
                   help="Qwen recommends 1.5 for general chat")
    s.add_argument("--max-tokens", default=S, type=_type("max_tokens"), metavar="N",
                   help="tokens to generate at most (default: 2048)")
    s.add_argument("--seed", default=S, type=_type("seed"), metavar="S")
    c = p.add_argument_group("chat")
    c.add_argument("--system", default=S, type=_type("system"), metavar="TEXT", help="system prompt")
    c.add_argument("--think", default=S, action=argparse.BooleanOptionalAction,
                   help="let the model think before answering (default: on)")
    c.add_argument("--preserve-thinking", default=S, action=argparse.BooleanOptionalAction,
                   help="keep earlier replies' thinking in the prompt, where the chat template offers it "
                        "(default: off, as the models were trained)")
    c.add_argument("--snapshots", default=S, type=_type("snapshots"), metavar="N",
                   help="decode-state snapshots kept on the device, so a chat turn prefills only what is new "
                        "(default: 4; 0: none)")
    c.add_argument("--data-dir", default=S, type=_type("data_dir"), metavar="DIR",
                   help="where chat history lives (also MTPCHAT_DATA_DIR)")
    return p


def _remote(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("server (an OpenAI-compatible one: vLLM, SGLang, mtpchat serve)")
    r.add_argument("--server", metavar="URL", default=None,
                   help="chat through this server instead of a local model, e.g. http://gpu-box:8000")
    r.add_argument("--api-key", metavar="KEY", default=None,
                   help="the server's API key (default: $MTPCHAT_API_KEY)")
    r.add_argument("--served-model", metavar="NAME", default=None,
                   help="which of the server's models (default: the first it lists)")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="mtpchat", parents=[common], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Terminal chat for Qwen3.5 / Qwen3.6 models, decoding with their MTP head.")
    parser.add_argument("--version", action=_Version)
    _remote(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", parents=[common], help="answer one prompt without the app",
                         description="Answer one prompt and exit: the text streams to stdout.")
    _remote(run)
    run.add_argument("--prompt", metavar="TEXT",
                     help="the user message ('-' or left out with a pipe: read stdin)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object: text, token_ids, prompt_tokens, finish_reason, stats")
    sub.add_parser("models", help="list the aliases and what is downloaded")
    serve = sub.add_parser("serve", parents=[common], help="serve the model over an OpenAI-compatible HTTP API",
                           description="Serve the model over an OpenAI-compatible API (/v1/chat/completions, "
                                       "/v1/models, /metrics, /health), one generation at a time.")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine "
                                                           "only; any other needs --api-key)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    serve.add_argument("--api-key", metavar="KEY", default=None,
                       help="require this key as a Bearer token (default: $MTPCHAT_API_KEY, else none)")
    serve.add_argument("--max-waiting", type=int, default=8, metavar="N",
                       help="requests that may wait for the one generating; more get HTTP 429 (default: 8)")
    bench = sub.add_parser("bench", parents=[common], help="MTP off vs on: speed and acceptance")
    # bench's own flags come from its module, imported only when bench may be the command
    if "bench" in (argv or []) and _has_module("mtpchat.bench"):
        add = getattr(importlib.import_module("mtpchat.bench"), "add_arguments", None)
        if add is not None:
            add(bench)
    return parser


def _has_module(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def options_from(args: argparse.Namespace):
    from mtpchat.settings import load_settings, merge
    flags = {k: v for k, v in vars(args).items() if k in CHECKS}
    return merge(flags, load_settings())


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
    prep = loader.prepare(options)
    for note in prep.notices:
        _err(note)
    cpu_allocator(prep.device)
    engine = loader.load_engine(prep)
    if prep.mtp and not engine.mtp_available:
        _err(f"{prep.name}: " + "; ".join(engine.notices or ["the MTP head is unusable: running with MTP off"]))
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
    from mtpchat import loader, serve
    key = _api_key(args)
    serve.check_bind(args.host, key)
    if not 0 <= args.port <= 65535 or args.max_waiting < 0:
        raise UserError("--port must be 0..65535 and --max-waiting 0 or more", exit_code=2)
    prep = loader.prepare(options)
    for note in prep.notices:
        _err(note)
    cpu_allocator(prep.device)
    engine = loader.load_engine(prep)
    if prep.mtp and not engine.mtp_available:
        _err(f"{prep.name}: " + "; ".join(engine.notices or ["the MTP head is unusable: running with MTP off"]))
    serve.serve(engine, model=prep.name, host=args.host, port=args.port, api_key=key, think=options.think,
                max_waiting=args.max_waiting, announce=_err)
    return 0


COMMANDS = {None: cmd_app, "run": cmd_run, "models": cmd_models, "bench": cmd_bench, "serve": cmd_serve}
