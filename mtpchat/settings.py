"""Options: built-in defaults, then a TOML settings file, then command-line flags (flags win).

The file is `settings.toml` in the user config directory (platformdirs: ~/.config/mtpchat on
Linux), or wherever MTPCHAT_SETTINGS points. Its keys are the long flag names with underscores:

    model = "Qwen3.6-27B-MTP"
    max_context = 16384
    draft_tokens = 3
    temperature = 0.7
    think = false

The data directory (chat history) is --data-dir, else MTPCHAT_DATA_DIR, else `data_dir` in the
file, else the platform's user data directory (~/.local/share/mtpchat on Linux).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mtpchat.errors import SettingsError

APP = "mtpchat"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32")
WEIGHTS = ("auto", "bf16", "fp8", "int4")
MAX_DRAFT_TOKENS = 8     # the engine's own limit, mtpchat.engine.memory.K_MAX (a test keeps them equal)
DEFAULT_CONTEXT = 8192   # tokens of context when none is asked for (fewer where the model or memory has less)


@dataclass
class Options:
    model: str | None = None          # alias, folder or repo id; None = the demo model
    device: str = "auto"              # auto = cuda when available, else cpu
    dtype: str = "auto"               # auto = bfloat16 on cuda, float32 on cpu
    weights: str = "auto"             # auto = the checkpoint's format; fp8, int4 = quantized on load; bf16 = dequantized
    max_context: int | None = None    # None: DEFAULT_CONTEXT, or less where the model or memory says so
    draft_tokens: int = 3             # with adaptive_k: the most drafts a step carries
    adaptive_k: bool = True           # each step's number of drafts chosen from acceptance and step times
    draft_vocab: int = 32768          # tokens the drafts are chosen from (0: the whole vocabulary)
    mtp: bool = True
    cuda_graphs: bool = True
    # sampling; None = the checkpoint's generation_config.json, else greedy / off
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    max_tokens: int = 2048
    seed: int | None = None
    system: str | None = None
    think: bool = True
    preserve_thinking: bool | None = None   # earlier replies' thinking in the prompt; None: the template's default
    reasoning_effort: str | None = None     # where the template takes it (Qwen3.8: xhigh, medium, low); None: its default
    snapshots: int = 4                # decode-state snapshots kept for chat turns (0: none)
    offline: bool = False
    data_dir: str | None = None
    server: str | None = None         # the app and `run` talk to this OpenAI-compatible server (--server)
    api_key: str | None = None        # its key (--api-key; else MTPCHAT_API_KEY)
    # where each value read from the settings file came from, so a later error names the file
    from_file: dict[str, Path] = field(default_factory=dict, repr=False, compare=False)

    def said(self, key: str) -> str:
        """How the user gave `key`: `max_context = 99999 in /path/settings.toml`, else `--max-context 99999`."""
        value = getattr(self, key)
        if key in self.from_file:
            return f"{key} = {value!r} in {self.from_file[key]}"
        return f"--{key.replace('_', '-')} {value}"


# ---- value checks, shared by the flags and the file ---------------------------------------------

def _choice(options):
    def check(v):
        v = str(v).lower()
        if v not in options and not (options is DEVICES and v.startswith("cuda:") and v[5:].isdigit()):
            raise ValueError(f"must be one of {', '.join(options)}, got {v!r}")
        return v
    return check


def _int(lo=None, hi=None):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ValueError(f"must be a whole number, got {v!r}")
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"must be a whole number, got {v!r}") from None
        if (lo is not None and n < lo) or (hi is not None and n > hi):
            raise ValueError(f"must be between {lo} and {hi}, got {n}" if hi is not None
                             else f"must be at least {lo}, got {n}")
        return n
    return check


def _float(lo=None, hi=None, lo_open=False, hi_open=False):
    def check(v):
        if isinstance(v, bool):
            raise ValueError(f"must be a number, got {v!r}")
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"must be a number, got {v!r}") from None
        below = lo is not None and (x <= lo if lo_open else x < lo)
        above = hi is not None and (x >= hi if hi_open else x > hi)
        if below or above:
            if hi is None:
                raise ValueError(f"must be at least {lo}, got {x}")
            raise ValueError(f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, got {x}")
        return x
    return check


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


def _str(v):
    if not isinstance(v, str):
        raise ValueError(f"must be a string, got {v!r}")
    return v


def _effort(v):
    # which levels a model takes, its chat template says once loaded (mtpchat/chat/prompt.py)
    if not isinstance(v, str) or not v.strip().isalpha():
        raise ValueError(f"must be a level such as low, medium or xhigh, got {v!r}")
    return v.strip().lower()


CHECKS = {
    "model": _str, "device": _choice(DEVICES), "dtype": _choice(DTYPES), "weights": _choice(WEIGHTS),
    "max_context": _int(16), "draft_tokens": _int(1, MAX_DRAFT_TOKENS),
    "adaptive_k": _bool, "draft_vocab": _int(0), "mtp": _bool, "cuda_graphs": _bool,
    "temperature": _float(0.0), "top_p": _float(0.0, 1.0, lo_open=True), "top_k": _int(0),
    "min_p": _float(0.0, 1.0, hi_open=True), "presence_penalty": _float(-2.0, 2.0),
    "max_tokens": _int(1), "seed": _int(0), "system": _str, "think": _bool, "preserve_thinking": _bool,
    "reasoning_effort": _effort,
    "snapshots": _int(0, 64), "offline": _bool,
    "data_dir": _str, "server": _str, "api_key": _str,
}
assert set(CHECKS) == {f.name for f in dataclasses.fields(Options)} - {"from_file"}


# ---- the file ----------------------------------------------------------------------------------

def _user_dir(kind: str) -> Path:
    """platformdirs' user config or data directory; the XDG default where it is not installed."""
    try:
        import platformdirs
    except ImportError:
        var, default = {"config": ("XDG_CONFIG_HOME", ".config"), "data": ("XDG_DATA_HOME", ".local/share")}[kind]
        return Path(os.environ.get(var) or Path.home() / default) / APP
    return Path(getattr(platformdirs, f"user_{kind}_dir")(APP, appauthor=False))


def settings_path() -> Path:
    """The settings file: MTPCHAT_SETTINGS, else the user config directory's. MTPCHAT_SETTINGS in a
    folder that does not exist is a mistake, said at once; a file not written yet is no settings."""
    if os.environ.get("MTPCHAT_SETTINGS"):
        path = Path(os.environ["MTPCHAT_SETTINGS"]).expanduser()
        if not path.parent.is_dir():
            raise SettingsError(f"MTPCHAT_SETTINGS is {path}, but the folder {path.parent} does not exist; "
                                "point it at a settings file, or unset it")
        return path
    return _user_dir("config") / "settings.toml"


def load_settings(path: Path | None = None, warn=None) -> dict:
    """The validated values of the settings file; {} when there is none. A file that MTPCHAT_SETTINGS
    names and that does not exist is said in one line to `warn` (stderr when None); the default
    file not written yet is normal and said nowhere."""
    named = path is None and bool(os.environ.get("MTPCHAT_SETTINGS"))
    path = Path(path) if path else settings_path()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if named:
            # (mtpchat writes no settings file itself: the user creates it)
            line = f"mtpchat: MTPCHAT_SETTINGS is {path}, which does not exist: using the defaults"
            (warn or (lambda text: print(text, file=sys.stderr, flush=True)))(line)
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError(f"cannot read the settings file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"the settings file {path} is not valid TOML: {e}") from None
    values = {}
    for key, value in raw.items():
        if key not in CHECKS:
            close = difflib.get_close_matches(key, list(CHECKS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(CHECKS)}"
            raise SettingsError(f"{path}: unknown setting {key!r}{hint}")
        try:
            values[key] = CHECKS[key](value)
        except ValueError as e:
            raise SettingsError(f"{key} = {value!r} in {path}: {e}") from None
    return values


def merge(flags: dict, file_values: dict, path: Path | None = None) -> Options:
    """Options from the defaults, overridden by the file (at `path`), overridden by the flags given."""
    # (--server and --api-key are None when not given: the file's value stands)
    given = {k: v for k, v in flags.items() if k in CHECKS and v is not None}
    options = Options(**{**file_values, **given})
    if path is not None:
        options.from_file = {k: Path(path) for k in file_values if k not in given}
    if "data_dir" not in flags and os.environ.get("MTPCHAT_DATA_DIR"):
        options.data_dir = os.environ["MTPCHAT_DATA_DIR"]  # the environment beats the file
        options.from_file.pop("data_dir", None)
    return options


def data_dir(options: Options) -> Path:
    """Where chat history lives (created on first use by the app)."""
    if options.data_dir:
        return Path(options.data_dir).expanduser()
    return _user_dir("data")
