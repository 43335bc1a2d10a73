"""Exceptions a user can meet, turned into one line saying what is wrong and what to do.

Load errors are worded by mtpchat.errors (shared with the CLI); the rest here.
"""
from __future__ import annotations

from mtpchat.errors import UserError, as_user_error   # the CLI's wording, so both say the same


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe_error(exc: BaseException, during: str = "load", device: str | None = None) -> str:
    if during == "load":
        user = as_user_error(exc)
        if user is not None:
            return "; ".join(line.strip() for line in str(user).splitlines() if line.strip())
    if isinstance(exc, UserError):   # already one line that says what to do (a server's failures)
        return first_line(exc) + ("; the reply so far is kept" if during == "reply" else "")
    name = type(exc).__name__
    detail = first_line(exc)
    low = detail.lower()
    if name == "OutOfMemoryError" or "out of memory" in low:
        if during == "load":
            return (f"not enough GPU memory to load the model ({detail}): try a smaller model, "
                    "a shorter --max-context, or --draft-tokens 1")
        return (f"ran out of GPU memory during the reply ({detail}): start a new chat or lower "
                "--max-context; the chat so far is kept")
    if isinstance(exc, FileNotFoundError):
        return f"model files not found ({detail}): pass --model with a downloaded checkpoint folder"
    if device == "cuda" and during == "load" and ("cuda" in low or "nvidia" in low or "gpu" in low):
        return f"no usable GPU ({detail}): run with --device cpu (small models only)"
    if during == "reply":
        return f"the engine failed during the reply ({name}: {detail}); the chat so far is kept"
    # the engine's own errors (config, weights, shapes) are already one clear line
    return detail if name in ("ValueError", "ConfigError", "WeightsError", "RuntimeError") else f"{name}: {detail}"


NO_MTP = "this checkpoint has no mtp.* weights: running with MTP off (plain decoding)"
