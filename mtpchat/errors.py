"""Errors a user can meet: each carries one or two lines that say what is wrong and what to do.

The CLI prints the message on stderr and exits with `exit_code`; it never shows a traceback for
these. Engine exceptions (config, weights, tokenizer) are turned into a UserError in one place,
`as_user_error`, so every front end (the CLI, the app) words them the same way.
"""
from __future__ import annotations


class UserError(Exception):
    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ModelNotFound(UserError):
    """An unknown alias, a missing folder, a repository that does not exist or cannot be reached."""


class IncompleteModel(UserError):
    """A cache or folder that lacks files or holds truncated ones."""


class DiskFull(UserError):
    """Not enough disk space for a download."""


class NotEnoughMemory(UserError):
    """The memory plan does not fit the device."""


class DeviceError(UserError):
    """CUDA asked for but missing or too old; a model too large for the CPU."""


class SettingsError(UserError):
    """A settings file that cannot be read, or a value of the wrong kind."""


class NotAvailable(UserError):
    exit_code = 2


def as_user_error(exc: BaseException) -> UserError | None:
    """The user-facing form of an engine exception, or None when it is a bug (let it surface)."""
    if isinstance(exc, UserError):
        return exc
    # matched by class name, so mapping an error never imports the engine (or torch)
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    kind = next((k for k in ("UnsupportedFormat", "ConfigError", "WeightsError", "TokenizerError",
                             "OutOfMemoryError") if k in kinds), type(exc).__name__)
    if kind == "UnsupportedFormat":   # not a damaged download: a format this build cannot run
        return UserError(f"unsupported checkpoint: {exc}", exit_code=2)
    if kind == "ConfigError":
        return UserError(f"unsupported checkpoint: {exc}")
    if kind == "WeightsError":
        return IncompleteModel(f"cannot load the weights: {exc}")
    if kind == "TokenizerError":
        return IncompleteModel(f"cannot load the tokenizer: {exc}")
    if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC
        return DiskFull(f"the disk is full ({exc.filename or 'while writing'}); "
                        "free some space and try again")
    if kind == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError
        first = str(exc).splitlines()[0] if str(exc) else ""
        return NotEnoughMemory(f"the GPU ran out of memory: {first}\n"
                               "try a shorter --max-context, fewer --draft-tokens or a smaller model")
    return None
