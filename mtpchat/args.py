"""The `mtpchat` command line: its parser (the app's flags, shared by `run`, `bench` and `serve`,
each with its own), and the settings file merged under the flags. Imports nothing heavy, so
`mtpchat --help` answers at once.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version

from mtpchat.settings import CHECKS, MAX_DRAFT_TOKENS, load_settings, merge, settings_path

S = argparse.SUPPRESS  # options left out stay out of the namespace, so the settings file can fill them

EPILOG = """\
examples:
  mtpchat                                   chat with the demo model
  mtpchat --model Qwen3.6-27B-MTP           chat with a model from Hugging Face (downloaded once)
  mtpchat run --prompt "Hello" --json       one answer, as JSON, for scripts
  mtpchat run --model Qwen3.5-9B --dry-run  the memory plan, without loading anything
  mtpchat models                            the aliases and what is downloaded
  mtpchat pull Qwen3.5-9B                   download a model; `mtpchat rm` deletes one
  mtpchat pull Qwen3.5-9B                   download a model (only what mtpchat reads)
  mtpchat rm Qwen3.5-9B                     delete it from the cache, saying what it frees
  mtpchat --server http://gpu-box:8000      the app on a vLLM / SGLang / mtpchat serve server
  mtpchat serve --port 8000                 this engine behind an OpenAI-compatible API

defaults come from settings.toml in the user config directory (MTPCHAT_SETTINGS to move it);
flags win. Each command's --help lists its flags, with examples (mtpchat run --help);
`mtpchat completion bash|zsh|fish` prints a completion script for the shell."""


def _type(key: str):
    check = CHECKS[key]

    def convert(text: str):
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = key.replace("_", "-")  # argparse names the type in its messages
    return convert


class Parser(argparse.ArgumentParser):
    """A usage error is one line and a pointer to --help, not the whole usage block before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n  see `{self.prog} --help`\n")


class _Version(argparse.Action):
    """--version, looked up only when asked for (importlib.metadata is not free)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=S, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            v = version("mtpchat")
        except PackageNotFoundError:
            v = "unknown (not installed)"
        print(f"mtpchat {v}")
        parser.exit()


def _common() -> argparse.ArgumentParser:
    """The flags shared by the app, `run` and `bench`."""
    p = Parser(add_help=False)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=S, type=_type("model"), metavar="NAME",
                   help="alias (see `mtpchat models`), local folder, or Hugging Face org/name "
                        "(default: the demo model)")
    m.add_argument("--device", default=S, type=_type("device"), metavar="{auto,cpu,cuda}",
                   help="auto = cuda when available, else cpu (default: auto)")
    m.add_argument("--dtype", default=S, type=_type("dtype"), metavar="{auto,bfloat16,float16,float32}",
                   help="auto = bfloat16 on cuda, float32 on cpu")
    m.add_argument("--weights", default=S, type=_type("weights"), metavar="{auto,bf16,fp8,int4}",
                   help="auto = the checkpoint's own format (FP8 or 4 bits for such a release); fp8 = quantize a "
                        "bf16 checkpoint to FP8 as it loads (half the bytes a token; Ada or Hopper); int4 = to 4 "
                        "bits (about a quarter; any GPU mtpchat runs on, or the CPU); bf16 = dequantize")
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
                        "(default: the template's own: off for Qwen3.5/3.6, on for Qwen3.8)")
    c.add_argument("--reasoning-effort", default=S, type=_type("reasoning_effort"), metavar="LEVEL",
                   help="how hard the model thinks, where its chat template takes it (Qwen3.8: xhigh, "
                        "medium, low; default: the template's, xhigh); --no-think turns thinking off")
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
    parser = Parser(
        prog="mtpchat", parents=[common], epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Terminal chat for Qwen3.5 / Qwen3.6 models, decoding with their MTP head.")
    parser.add_argument("--version", action=_Version)
    _remote(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", parents=[common], help="answer one prompt without the app",
                         description="Answer one prompt and exit: the answer streams to stdout, the "
                                     "thinking to stderr.")
    _remote(run)
    run.add_argument("--prompt", metavar="TEXT",
                     help="the user message ('-' or left out with a pipe: read stdin)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object: text (the answer), reasoning (the thinking), token_ids, "
                          "prompt_tokens, finish_reason, stats")
    run.add_argument("--show-thinking", action="store_true",
                     help="print the model's thinking on stdout, between <think> and </think> before the "
                          "answer (by default it goes to stderr)")
    sub.add_parser("models", help="list the aliases and what is downloaded")
    serve = sub.add_parser("serve", parents=[common], help="serve the model over an OpenAI-compatible HTTP API",
                           description="Serve the model over an OpenAI-compatible API (/v1/chat/completions, "
                                       "/v1/models, /metrics, /health), one generation at a time.")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine "
                                                           "only; any other needs --api-key)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    serve.add_argument("--api-key", metavar="KEY", default=None,
                       help="require this key as a Bearer token (default: $MTPCHAT_API_KEY, else none)")
    serve.add_argument("--max-waiting", type=int, default=256, metavar="N",
                       help="requests that may wait, first in first out, for the one generating; more get "
                            "HTTP 429 with Retry-After (default: 256)")
    serve.add_argument("--served-model-name", metavar="NAME", default=None,
                       help="the model's name in the API (default: the alias, or the folder's name)")
    bench = sub.add_parser("bench", parents=[common], help="MTP off vs on: speed and acceptance")
    # bench's own flags come from its module, imported only when bench may be the command
    if "bench" in (argv or []) and has_module("mtpchat.bench"):
        add = getattr(importlib.import_module("mtpchat.bench"), "add_arguments", None)
        if add is not None:
            add(bench)
    _cache_commands(sub)
    _examples(sub)
    return parser


def has_module(name: str) -> bool:
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def options_from(args: argparse.Namespace):
    flags = {k: v for k, v in vars(args).items() if k in CHECKS}
    file_values = load_settings()
    options = merge(flags, file_values, settings_path())
    if "model" in options.from_file:
        _check_model_setting(options)
    return options


def _check_model_setting(options) -> None:
    """A model named in the settings file that cannot be one (a missing folder, an unknown alias)
    is said with the file's name and key, so the user knows where to fix it."""
    from mtpchat.errors import ModelNotFound, SettingsError
    from mtpchat.models import classify
    try:
        classify(options.model)
    except ModelNotFound as e:
        raise SettingsError(f"{options.said('model')}: {e}") from None


# ---- the commands that manage the cache and the shell, and each command's examples -----------------

EXAMPLES = {
    "run": """\
  mtpchat run --prompt "Explain GDN"                   the answer on stdout, the thinking on stderr
  echo "Hello" | mtpchat run --model Qwen3.5-9B        the prompt from a pipe
  mtpchat run --prompt "Hi" --json --no-think          one JSON object, for scripts
  mtpchat run --model Qwen3.6-27B --dry-run            the memory plan, without loading anything
  mtpchat run --server http://gpu-box:8000 --prompt "Hi"   through an OpenAI-compatible server""",
    "models": """\
  mtpchat models                                       the aliases, then what the cache holds""",
    "pull": """\
  mtpchat pull Qwen3.6-27B-MTP                         download what mtpchat reads of it
  mtpchat pull Qwen/Qwen3.5-9B --revision main         a repo id, at a branch, tag or commit
  mtpchat pull Qwen3.5-9B --offline                    only check that the cache has all of it""",
    "rm": """\
  mtpchat rm Qwen3.5-9B                                say what it frees, then ask
  mtpchat rm Qwen/Qwen3.5-9B --yes                     without asking (scripts)""",
    "serve": """\
  mtpchat serve                                        on 127.0.0.1:8000, the demo model
  mtpchat serve --model Qwen3.6-27B-MTP --port 8080
  mtpchat serve --host 0.0.0.0 --api-key SECRET        reachable from other machines: a key is required""",
    "bench": """\
  mtpchat bench                                        MTP off vs on, on the demo model
  mtpchat bench --dry-run                              the memory plan, without loading anything
  mtpchat bench --random-weights qwen3.6-27b           MTP off vs on against the bandwidth floor
  mtpchat bench --model Qwen3.5-9B --json              on a real checkpoint, as JSON""",
    "completion": """\
  mtpchat completion bash > ~/.local/share/bash-completion/completions/mtpchat
  source <(mtpchat completion zsh)                     in ~/.zshrc
  mtpchat completion fish > ~/.config/fish/completions/mtpchat.fish""",
}


def _cache_commands(sub) -> None:
    """`pull`, `rm` and `completion`: managing the model cache, and the shell's completion."""
    pull = sub.add_parser("pull", help="download a model into the Hugging Face cache (resumes an interrupted one)",
                          description="Download what mtpchat reads of a model (config, tokenizer, the shards with "
                                      "text or MTP weights) into the Hugging Face cache, with progress. An "
                                      "interrupted download resumes where it stopped.")
    pull.add_argument("model", metavar="MODEL", help="an alias (see `mtpchat models`) or an org/name repo id")
    pull.add_argument("--revision", default="main", metavar="REV", help="branch, tag or commit (default: main)")
    pull.add_argument("--offline", action="store_true",
                      help="no network: only say whether the cache has all of it (also HF_HUB_OFFLINE=1)")
    rm = sub.add_parser("rm", help="delete a model from the Hugging Face cache",
                        description="Delete every revision of a model from the Hugging Face cache, unfinished "
                                    "downloads included, after saying what it frees and asking.")
    rm.add_argument("model", metavar="MODEL", help="an alias or an org/name repo id")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask (needed where stdin is not a terminal)")
    comp = sub.add_parser("completion", help="print a shell completion script (bash, zsh, fish)",
                          description="Print a completion script for bash, zsh or fish, generated from this "
                                      "command line's own flags.")
    comp.add_argument("shell", choices=("bash", "zsh", "fish"))


def _examples(sub) -> None:
    """Each command's --help ends with its examples."""
    for name, parser in sub.choices.items():
        if name in EXAMPLES:
            parser.epilog = "examples:\n" + EXAMPLES[name]
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
