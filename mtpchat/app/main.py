"""Entry point the CLI calls: `run_app(args)` builds the app from parsed arguments and runs it.

The engine (and torch) load inside the app, on a worker thread, behind a loading line; a load error
is shown as a notice and the saved chats stay browsable.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtpchat import loader
from mtpchat.app.fake import FakeEngine, FakeGpu
from mtpchat.app.settings import Sampling, initial_sampling, load_keymap
from mtpchat.app.store import Store, data_dir
from mtpchat.chat.engine import LocalEngine
from mtpchat.remote.client import base_url
from mtpchat.remote.engine import RemoteEngine

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32"}


@dataclass
class Launch:
    """What the app needs from the command line, whether the CLI prepared it or not."""
    model: str
    device: str
    dtype: str
    mtp: bool
    draft_tokens: int
    system: str
    think: bool
    data_dir: str | None
    sampling: object
    load: object
    notices: list = field(default_factory=list)
    fake: bool = False
    preserve_thinking: bool | None = None   # None: the chat template's default
    reasoning_effort: str | None = None     # None: the chat template's default


def launch_from(args) -> Launch:
    """The CLI hands over `args.options` (settings merged with flags) and `args.prepared` (the model
    resolved, the device picked, the memory plan checked); without them (tests, `python -m
    mtpchat.app`) plain attributes of `args` are read."""
    opts = getattr(args, "options", None) or args
    prep = getattr(args, "prepared", None)
    get = lambda name, default=None: getattr(opts, name, default)
    fake = bool(getattr(args, "fake", False))
    if getattr(args, "server", None):
        return remote_launch(args, opts)
    if prep is not None:
        return Launch(prep.name, prep.device, prep.dtype, prep.mtp, prep.draft_tokens, get("system") or "",
                      bool(get("think", True)), get("data_dir"), initial_sampling(opts, prep.path),
                      lambda progress=None: LocalEngine(loader.load_engine(prep, progress)), list(prep.notices),
                      preserve_thinking=get("preserve_thinking"), reasoning_effort=get("reasoning_effort"))
    device = str(get("device", "cpu"))
    if fake:
        load = lambda progress=None: FakeEngine(name="fake-model", device=device, mtp=bool(get("mtp", True)),
                                  draft_tokens=int(get("draft_tokens", 3)), step_delay=0.01)
    else:
        load = engine_loader(args)
    return Launch("fake-model" if fake else Path(str(get("model"))).name, device, str(get("dtype") or ""),
                  bool(get("mtp", True)), int(get("draft_tokens", 3)), get("system") or "", bool(get("think", True)),
                  get("data_dir"), initial_sampling(opts, None) if not fake else Sampling(), load, fake=fake,
                  preserve_thinking=get("preserve_thinking"), reasoning_effort=get("reasoning_effort"))


def remote_launch(args, opts) -> Launch:
    """The app as a client of an OpenAI-compatible server (mtpchat/remote)."""
    url = base_url(args.server)
    key = getattr(args, "api_key", None) or os.environ.get("MTPCHAT_API_KEY") or None

    def load(progress=None):
        return RemoteEngine.connect(url, key, getattr(args, "served_model", None))
    get = lambda name, default=None: getattr(opts, name, default)
    return Launch(url, "server", "", True, 0, get("system") or "", bool(get("think", True)), get("data_dir"),
                  initial_sampling(opts, None), load)


def engine_loader(args):
    """Load the engine straight from `args` (no CLI preparation): a local folder."""
    def load(progress=None):
        import torch
        from mtpchat.engine import Engine
        name = _DTYPES.get(str(args.dtype or "auto").lower())
        return LocalEngine(Engine.load(args.model, device=args.device, dtype=getattr(torch, name) if name else None,
                           max_context=args.max_context, draft_tokens=args.draft_tokens, mtp=args.mtp,
                           cuda_graphs=args.cuda_graphs, adaptive=bool(getattr(args, "adaptive_k", True)),
                           progress=progress))
    return load


def build_app(args, *, load_engine=None, probe=None, now=time.time, gpu_interval: float = 1.0):
    from mtpchat.app.app import ChatApp

    launch = launch_from(args)
    folder = data_dir(launch.data_dir)
    store = Store(folder, now=now)
    keymap, keymap_error = load_keymap(folder / "keymap.toml")
    if probe is None and launch.fake and launch.device.startswith("cuda"):
        probe = FakeGpu
    app = ChatApp(load_engine or launch.load, model=launch.model, store=store, sampling=launch.sampling,
                  device=launch.device, dtype=launch.dtype, system=launch.system, think=launch.think,
                  mtp=launch.mtp, draft_tokens=launch.draft_tokens, preserve_thinking=launch.preserve_thinking,
                  reasoning_effort=launch.reasoning_effort,
                  probe=probe, gpu_interval=gpu_interval,
                  keymap=keymap, now=now)
    app.startup_notices += [("information", n) for n in launch.notices]
    if keymap_error:
        app.startup_notices.append(("warning", keymap_error))
    return app


def run_app(args) -> int:
    try:
        app = build_app(args)
    except OSError as exc:
        print(f"mtpchat: cannot open the chat database ({exc}): pass --data-dir with a writable folder",
              file=sys.stderr)
        return 2
    app.run()
    return app.return_code or 0


def dev_args(argv=None):
    """`python -m mtpchat.app --fake`: the app on the fake engine, for working on the UI."""
    p = argparse.ArgumentParser(prog="python -m mtpchat.app")
    p.add_argument("--fake", action="store_true", default=True)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--no-mtp", dest="mtp", action="store_false")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    for name in ("temperature", "top_p", "min_p", "presence_penalty"):
        p.add_argument("--" + name.replace("_", "-"), type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--system", default="")
    p.add_argument("--no-think", dest="think", action="store_false")
    p.add_argument("--preserve-thinking", action="store_true", default=None)
    p.add_argument("--reasoning-effort")
    p.add_argument("--offline", action="store_true")
    p.add_argument("--data-dir")
    return p.parse_args(argv)
