"""The `mtpchat` command: the chat app (no subcommand), `run`, `models`, `bench` and `serve`; the
parser is in args.py.

`mtpchat --help` must answer at once, so this module imports nothing heavy: the engine's modules
(even its torch-free ones: the chat layer and the server stand on them), torch and the app (an
optional part of a build, with textual) are imported inside the commands that need them. Every error a user can meet ends as
one or two lines on stderr and a non-zero exit status, never a traceback.
"""
from __future__ import annotations

import importlib
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

from typing import TYPE_CHECKING

from mtpchat import loader
from mtpchat.args import build_parser, has_module as _has_module, options_from
from mtpchat.errors import NotAvailable, UserError, as_user_error
from mtpchat.malloc import cpu_allocator
from mtpchat.models import WEIGHT_LABELS, list_models

if TYPE_CHECKING:
    from mtpchat.chat.engine import ChatEngine
    from mtpchat.chat.reply import Piece


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    # torch warns at import when numpy is missing; mtpchat never hands it numpy arrays
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
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


# what each extra of the package brings (pyproject.toml), by the modules its commands import
EXTRAS = {"app": "the app", "serve": "`mtpchat serve`", "remote": "`mtpchat run --server`"}


def _needs(extra: str, *modules: str) -> None:
    """Stop with the pip command that installs `extra` where one of `modules` is missing."""
    missing = [m for m in modules if not _has_module(m)]
    if missing:
        raise NotAvailable(f"{EXTRAS[extra]} needs the [{extra}] extra: pip install 'mtpchat[{extra}]' "
                           f"({', '.join(missing)} not installed)")


def _server_from_settings(args, options) -> None:
    """`server` and `api_key` of settings.toml, where the flags left them out (the app and `run`)."""
    args.server = getattr(args, "server", None) or options.server
    args.api_key = getattr(args, "api_key", None) or os.environ.get("MTPCHAT_API_KEY") or options.api_key


def cmd_app(args) -> int:
    options = options_from(args)
    _server_from_settings(args, options)
    if getattr(args, "server", None):
        _needs("app", "textual", "markdown_it", "rich", "httpx", "prometheus_client")
        from mtpchat.app.main import run_app
        args.options = options
        return run_app(args) or 0
    if getattr(args, "dry_run", False):
        return dry_run(options)
    if not _has_module("mtpchat.app.main"):
        raise NotAvailable("the chat app is not part of this build yet; "
                           "`mtpchat run --prompt TEXT` answers without it")
    _needs("app", "textual", "markdown_it", "rich")
    prep = loader.prepare(options)
    for note in prep.notices:
        _err(note)
    from mtpchat.app.main import run_app
    args.options, args.prepared = options, prep
    cpu_allocator(prep.device)
    return run_app(args) or 0


def cmd_models(args) -> int:
    print("\n".join(list_models()))
    return 0


def cmd_bench(args) -> int:
    if not _has_module("mtpchat.bench"):
        raise NotAvailable("`mtpchat bench` is not available yet in this build")
    args.options = options_from(args)
    if getattr(args, "dry_run", False):
        plan = getattr(importlib.import_module("mtpchat.bench"), "dry_run_options", None)
        return dry_run(plan(args) if plan else args.options)
    return importlib.import_module("mtpchat.bench").main(args) or 0


def _load_engine(options):
    """(prepared, engine) for `run` and `serve`: the plan's notices said, the engine loaded, and a
    line where the MTP head it was asked for is unusable."""
    prep = loader.prepare(options)
    for note in prep.notices:
        _err(note)
    check_switches(prep.path, options)
    cpu_allocator(prep.device)
    from mtpchat.progress import LoadBar
    bar = LoadBar()
    try:
        engine = loader.load_engine(prep, progress=bar)
    finally:
        bar.close()
    if prep.mtp and not engine.mtp_available:
        _err(f"{prep.name}: " + "; ".join(engine.notices or ["the MTP head is unusable: running with MTP off"]))
    return prep, engine


def dry_run(options) -> int:
    from mtpchat.engine import memory
    from mtpchat.engine.units import fmt_bytes
    prep = loader.prepare(options, dry_run=True)
    for note in prep.notices:
        _err(note)
    cfg = prep.config
    print(f"model: {prep.name}" + (f" ({prep.path})" if prep.path else ""))
    print(f"parameters: {memory.text_params(cfg):,} text + {memory.mtp_params(cfg):,} MTP")
    label = WEIGHT_LABELS.get(prep.plan.weight_format)
    print(f"device: {prep.device}, {prep.dtype}{f', {label} weights' if label else ''}; "
          f"MTP {'on' if prep.mtp else 'off'}, "
          f"{prep.draft_tokens} draft tokens per step; CUDA graphs {'on' if prep.cuda_graphs else 'off'}")
    print("\n".join(memory.describe(prep.plan)))
    print(kernel_plan_line(prep))
    if prep.free is None:
        print("free memory on the device: unknown")
        return 0
    print(f"free memory on {prep.device}: {fmt_bytes(prep.free)}")
    if prep.plan.fits(prep.free):
        print("fits")
        return 0
    print(loader.not_enough_memory_message(prep))
    return 1


def kernel_plan_line(prep) -> str:
    """The kernels' forms the engine would take (engine/plan.py): chosen here where the device is,
    else said to be chosen on it (the products split by its SMs)."""
    import torch
    from mtpchat.engine.plan import KernelPlan
    if prep.device.startswith("cuda") and not torch.cuda.is_available():
        return "kernel plan: chosen on the GPU at load (its products split by its SMs)"
    plan = KernelPlan.choose(prep.device, prep.config, prep.plan.weight_format == "fp8",
                             prep.weights == "int4").describe()
    products = plan.pop("products")
    return "kernel plan: " + " ".join(f"{k}={v}" for k, v in {**plan, **products}.items())


def _read_prompt(args) -> str:
    if args.prompt is not None and args.prompt != "-":
        prompt, where = args.prompt, "--prompt"
    elif args.prompt == "-" or not sys.stdin.isatty():
        prompt, where = sys.stdin.read(), "stdin"
    else:
        raise UserError("give the prompt with --prompt TEXT (or pipe it on stdin)", exit_code=2)
    if not prompt.strip():
        raise UserError(f"the prompt is empty ({where}); give it with --prompt TEXT or pipe it on stdin",
                        exit_code=2)
    return prompt


def cmd_run(args) -> int:
    options = options_from(args)
    _server_from_settings(args, options)
    if getattr(args, "server", None):
        _needs("remote", "httpx", "prometheus_client")
        from mtpchat.remote.run import run_remote
        return run_remote(args, options, _read_prompt(args), _api_key(args))
    if "snapshots" not in vars(args):
        options.snapshots = 0          # one answer: no later turn resumes from a snapshot
    if getattr(args, "dry_run", False):
        return dry_run(options)
    prompt = _read_prompt(args)
    from mtpchat.chat.engine import LocalEngine
    from mtpchat.chat.reply import summary
    prep, engine = _load_engine(options)
    messages = ([{"role": "system", "content": options.system}] if options.system else []) \
        + [{"role": "user", "content": prompt}]
    prompt_ids = run_prompt(engine.tokenizer, messages, options)
    if len(prompt_ids) >= prep.max_context:
        raise UserError(f"the prompt is {len(prompt_ids):,} tokens but --max-context is {prep.max_context:,}; "
                        "raise --max-context or shorten the prompt")
    params = loader.sampling_params(options, prep.path)
    shown = None if args.json else Shown(sys.stdout, sys.stdout if args.show_thinking else sys.stderr)
    local = LocalEngine(engine)
    result = generate(local, prompt_ids, params, shown)
    if args.json:
        result.update(model=prep.name, device=prep.device, dtype=prep.dtype, weights=local.weight_format,
                      mtp=bool(engine.mtp), draft_tokens=engine.draft_tokens, adaptive_k=bool(engine.adaptive),
                      draft_vocab=engine.draft_vocab)
        print(json.dumps(result, ensure_ascii=False))
    else:
        _err(summary(result))
    return 0


class Shown:
    """Where `run` writes a reply as it comes: the answer to `answer`, the thinking to `thinking`.
    Where both are one stream, the thinking goes between <think> and </think> before the answer, so
    the two stay apart; the thinking on a stream of its own is set off from what follows by a line."""

    def __init__(self, answer, thinking):
        self.answer, self.thinking = answer, thinking
        self.inline = answer is thinking
        self.thought = self.answered = False

    def __call__(self, piece: Piece) -> None:
        if piece.thinking:
            self._write(self.thinking, ("<think>\n" if self.inline and not self.thought else "") + piece.thinking)
            self.thought = True
        if piece.answer:
            self._write(self.answer, self._close() if not self.answered else "")
            self._write(self.answer, piece.answer)
            self.answered = True

    def close(self) -> None:
        self._write(self.answer, (self._close() if not self.answered else "") + "\n")

    def _close(self) -> str:
        """What ends the thinking before the answer starts."""
        if not self.thought:
            return ""
        if self.inline:
            return "\n</think>\n\n"
        self._write(self.thinking, "\n")
        return ""

    @staticmethod
    def _write(stream, text: str) -> None:
        if text:
            stream.write(text)
            stream.flush()


def generate(engine: ChatEngine, prompt_ids: list[int], params, show: Shown | None = None) -> dict:
    """Run one generation; `show` gets the text as it is decoded and is closed at the end; return the
    JSON-able result: `text` is the answer, `reasoning` the thinking."""
    from mtpchat.chat.reply import Reply
    from mtpchat.engine.events import Step
    reply = Reply(engine, prompt_ids, params)

    def emit(pieces: list[Piece]) -> None:
        for piece in pieces if show is not None else ():
            show(piece)
    for event in reply:
        if isinstance(event, Step):
            emit(reply.take())
    emit(reply.finish())
    if show is not None:
        show.close()
    thinking, answer = reply.text()
    return {"text": answer, "reasoning": thinking, "token_ids": list(reply.finished.token_ids),
            "prompt_tokens": len(prompt_ids), "finish_reason": reply.reason, "stats": reply.stats.as_dict()}


def cmd_serve(args) -> int:
    options = options_from(args)
    if getattr(args, "dry_run", False):
        return dry_run(options)
    _needs("serve", "starlette", "uvicorn", "prometheus_client")
    from mtpchat import serve
    from mtpchat.chat.engine import LocalEngine
    from mtpchat.serve_request import Defaults
    key = _api_key(args)
    serve.check_bind(args.host, key)
    if not 0 <= args.port <= 65535 or args.max_waiting < 0:
        raise UserError("--port must be 0..65535 and --max-waiting 0 or more", exit_code=2)
    sock = serve.bind(args.host, args.port)      # a taken port fails now, not after the model loads
    try:
        prep, engine = _load_engine(options)
        names = served_names(args.served_model_name, prep.name)
        params = loader.sampling_params(options, prep.path)
        # unset --max-tokens: as long as the context allows, as vLLM serves
        limit = options.max_tokens if "max_tokens" in vars(args) else prep.max_context
        params = dataclasses.replace(params, max_tokens=limit, stop_token_ids=tuple(engine.stop_ids))
        defaults = Defaults(params, server_switches(options), system=options.system or None, names=names)
        return serve.serve(LocalEngine(engine), sock, model=names[0], defaults=defaults, host=args.host,
                           api_key=key, max_waiting=args.max_waiting, announce=_err)
    finally:
        sock.close()


def served_names(asked: str | None, name: str) -> tuple[str, ...]:
    """The served model name (--served-model-name, else the alias or the folder's name, never a
    path), then the other names a request's `model` may give."""
    short = Path(name).name if Path(name).is_absolute() or Path(name).is_dir() else name
    return tuple(dict.fromkeys(n for n in (asked, short) if n))


def check_switches(folder, options, tokenizer=None) -> None:
    """Refuse a --reasoning-effort the checkpoint's chat template does not take, in one line (before
    any weight loads, where the folder is known)."""
    if options.reasoning_effort is None or (folder is None and tokenizer is None):
        return
    from mtpchat.chat.prompt import SwitchError, check_effort
    if tokenizer is None:
        from mtpchat.engine.tokenizer import Tokenizer
        tokenizer = Tokenizer.load(folder)
    try:
        check_effort(tokenizer, options.reasoning_effort, "--reasoning-effort")
    except SwitchError as e:
        raise UserError(str(e), exit_code=2) from None


def run_prompt(tokenizer, messages: list[dict], options) -> list[int]:
    """`run`'s prompt, through the chat layer with the template's switches from the options."""
    from mtpchat.chat.prompt import build_prompt
    check_switches(None, options, tokenizer)
    return build_prompt(tokenizer, messages, options.think, options.preserve_thinking, options.reasoning_effort)[0]


def server_switches(options):
    """The template's switches `serve` uses where a request sets none."""
    from mtpchat.chat.prompt import Switches
    return Switches(options.think, options.preserve_thinking, options.reasoning_effort)


def cmd_pull(args) -> int:
    from mtpchat.models import pull
    _err(pull(args.model, offline=args.offline, revision=args.revision))
    return 0


def cmd_rm(args) -> int:
    from mtpchat import hubcache
    from mtpchat.models import removal
    what, repo = removal(args.model)
    print(what)
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError("not removed: stdin is not a terminal to ask on; pass --yes to remove it", exit_code=2)
        if input("remove it? [y/N] ").strip().lower() not in ("y", "yes"):
            _err("not removed")
            return 1
    from mtpchat.engine.units import fmt_bytes
    freed = hubcache.delete_repo(hubcache.hub_cache_dir(), repo)
    print(f"removed {repo.repo_id}; freed {fmt_bytes(freed)}")
    return 0


def cmd_completion(args) -> int:
    from mtpchat.completion import script
    from mtpchat.models import ALIASES
    # bench's own flags included; the aliases offered for --model
    print(script(args.shell, build_parser(["bench"]), models=[a.name for a in ALIASES.values()]), end="")
    return 0


COMMANDS = {None: cmd_app, "run": cmd_run, "models": cmd_models, "bench": cmd_bench, "serve": cmd_serve,
            "pull": cmd_pull, "rm": cmd_rm, "completion": cmd_completion}
