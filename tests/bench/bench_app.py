"""Tokens/s inside the app vs headless, on the same tiny checkpoint, runs interleaved.

    python tests/bench/bench_app.py [--tokens 2048] [--runs 15] [--k 3] [--threads 1] [--device cpu]

Headless is the `mtpchat run` loop (engine.generate, detokenizing each step, on the main thread).
The app run sends the same prompt through the Textual app, drawing to a pseudo-terminal with its
real driver (escape sequences rendered and written every frame; `--terminal none` uses Textual's
test driver, which skips that), with the generation worker, its batches, the streaming text and the
telemetry pane all live; a new chat before each run resets the engine. Both report the engine's own
decode rate (Stats.tokens_per_s, prefill excluded), greedy, with the stop tokens ignored so every
run decodes exactly --tokens tokens. MTP on uses ProfileDrafter (engine/spec.py) so drafts are
accepted at a realistic rate on random weights.

Both run in one process on one engine (separate processes differ by a few percent from memory
layout alone), loaded and warmed up once (one untimed run per mode and setting); the headless run
blocks the app's event loop, so the app does nothing meanwhile. The modes take turns, swapping which
goes first every round (ABBA), so drift and other load on the machine fall on both alike. The verdict
is the median of the per-round ratios app / headless, with their range; each mode's median and range
are shown too. glibc's malloc thresholds are pinned for the process (see pin_malloc; `--malloc
default` leaves them). `--diag` adds, per run, the CPU time of each thread, page faults, context
switches and garbage-collector pauses.
`--think off` sends the reply through the answer's streaming Markdown instead of the thinking tail.
`--device cuda --random-weights qwen3.6-27b` runs the same comparison on a GPU with random weights of
the real 27B shapes (the tiny checkpoint's tokenizer renders the ids as text); `--random-weights
PATH/config.json` takes any shape (a tiny one tries the whole bench in seconds on the CPU). Progress
goes to stderr as it happens (the load, each warm-up, each round); what the app shows as a notice is
said there too, and a reply that does not end within --run-limit seconds stops the bench with why.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = "Tell me a long story about a tiny model."
MODES = ("headless", "app")
SIZE = (150, 46)   # columns, rows: wide enough for the telemetry pane
log = sys.stderr   # progress; the app's terminal driver takes over fd 2 while it runs


class WrappedIds:
    """The tiny checkpoint's tokenizer over a big random model's vocabulary: ids are folded into
    the tiny vocabulary for display (the text is noise either way; only its cost matters)."""

    def __init__(self, tok, n: int):
        self.tok, self.n = tok, n
        self.eos_token_ids, self.think_start_id, self.think_end_id = tok.eos_token_ids, tok.think_start_id, tok.think_end_id

    def apply_chat_template(self, *args, **kw):
        return self.tok.apply_chat_template(*args, **kw)

    def decode(self, ids, **kw):
        return self.tok.decode([i % self.n for i in ids], **kw)

    def stream(self):
        inner, n = self.tok.stream(), self.n

        class Stream:
            push = staticmethod(lambda ids: inner.push([i % n for i in ids]))
            flush = staticmethod(inner.flush)
        return Stream()


def threads_now() -> dict[int, tuple[float, int, int, int]]:
    """Per thread of this process (Linux): CPU ms, voluntary and involuntary switches, page faults."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except OSError:
            continue   # the thread ended
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) * 1e3 / tick, int(status["voluntary_ctxt_switches"]),
                         int(status["nonvoluntary_ctxt_switches"]), int(fields[7]))
    return out


class Diagnosis:
    """Where the time went between prefill and the last step of one run (`--diag`): per thread, CPU
    milliseconds (clock ticks) and context switches (voluntary+forced); the decoding thread's own CPU
    clock and page faults; the garbage collector's pauses on each thread."""

    def __init__(self):
        self.gc = {}
        self.out = {}
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info) -> None:
        who = threading.current_thread().name
        if phase == "start":
            self._gc_at = time.perf_counter()
        else:
            n, ms = self.gc.get(who, (0, 0.0))
            self.gc[who] = (n + 1, ms + (time.perf_counter() - self._gc_at) * 1e3)

    def watch(self, events):
        for ev in events:
            if type(ev).__name__ == "Finished":
                wall, cpu, after = time.perf_counter(), time.thread_time(), threads_now()
                me = threading.get_native_id()
                names = {t.native_id: t.name for t in threading.enumerate()}
                self.out = {"wall_ms": (wall - self.t0) * 1e3, "decoder_cpu_ms": (cpu - self.cpu0) * 1e3,
                            "faults": after[me][3] - self.before[me][3]}
                for tid, (ms, vol, invol, _) in after.items():
                    ms0, vol0, invol0, _ = self.before.get(tid, (0.0, 0, 0, 0))
                    if ms - ms0 >= 1 or vol - vol0 >= 10:
                        name = "decoder" if tid == me else names.get(tid, f"thread {tid}")
                        self.out[name] = f"{ms - ms0:.0f}ms/{vol - vol0}+{invol - invol0}"
                self.out.update({f"gc[{who}]": f"{n}x/{ms:.1f}ms" for who, (n, ms) in self.gc.items()})
            yield ev
            if type(ev).__name__ == "Prefilled":
                self.gc.clear()
                self.t0, self.cpu0, self.before = time.perf_counter(), time.thread_time(), threads_now()

    def report(self) -> dict:
        gc.callbacks.remove(self._gc)
        return {k: round(v) if isinstance(v, float) else v for k, v in self.out.items()}


def pin_malloc() -> None:
    """glibc's malloc thresholds fixed for the whole process (both modes alike), as `mtpchat` itself
    does for CPU runs (mtpchat/malloc.py). With glibc's moving thresholds the per-step temporaries
    go back to the system and fault in again every step, by amounts that differ between the main
    thread (headless) and a worker (the app), up to 10% for reasons that are not the app's."""
    from mtpchat.malloc import keep_step_memory
    if not keep_step_memory():
        sys.exit("mallopt failed or this is not glibc: run with --malloc default")


def load(a):
    import torch
    from mtpchat.engine import Engine
    if a.threads:
        torch.set_num_threads(a.threads)
    if not a.random_weights:
        return Engine.load(a.ckpt, device=a.device, dtype=torch.float32, max_context=a.tokens + 256,
                           draft_tokens=a.k, cuda_graphs=a.device != "cpu")
    from mtpchat.engine import bench
    from mtpchat.engine.config import ModelConfig
    from mtpchat.engine.tokenizer import Tokenizer
    named = Path(a.random_weights)
    config = ModelConfig.load(named if named.suffix == ".json" else
                              Path(bench.__file__).parent / "configs" / f"{a.random_weights}.json")
    engine = Engine(config, device=a.device, max_context=a.tokens + 256, draft_tokens=a.k, cuda_graphs=True)
    tok = Tokenizer.load(a.ckpt)
    engine.tokenizer = WrappedIds(tok, tok.vocab_size)
    return engine


def bench(a) -> dict:
    """Loads the engine and the app once, warms both up, then takes turns; returns the runs by
    (mode, mtp) as [tokens/s, mean acceptance length, diagnostics]."""
    from mtpchat.app.app import ChatApp
    from mtpchat.app.chat import Composer
    from mtpchat.app.settings import Sampling
    from mtpchat.app.store import Store
    from mtpchat.chat.engine import LocalEngine
    from mtpchat.cli import generate
    from mtpchat.engine.events import Step
    from mtpchat.engine.spec import ProfileDrafter

    say(f"loading the engine ({a.random_weights or 'the tiny checkpoint'} on {a.device})")
    engine = load(a)
    say("loaded; the reference reply, headless")
    generate_any = engine.generate
    diag = None

    prompts, replies, settings = [], [], []     # every prompt the engine was given, its reply's ids, and
                                                # its sampling and prefill cut as asked

    def generate_all(ids, params, **kw):
        # every run prefills as the app's turn does, cut where the app keeps its snapshot (Reply,
        # under headless, asks for no cut): a prefill cut elsewhere rounds otherwise in bf16 and
        # may lead greedy decoding to another reply
        params = dataclasses.replace(params, stop_token_ids=())
        prompts.append(list(ids))
        replies.append([])
        settings.append((params, tuple(kw.get("snapshot_at", ()))))
        kw["snapshot_at"] = keep_at
        events = generate_any(ids, params, **kw)
        return recorded(diag.watch(events) if diag else events, replies[-1])

    def recorded(events, into: list):
        for event in events:
            if isinstance(event, Step):
                into.extend(event.token_ids)
            yield event
    engine.generate = generate_all
    think = a.think == "on"
    from mtpchat.chat.prompt import build_prompt
    ids, keep_at = build_prompt(engine.tokenizer, [{"role": "user", "content": PROMPT}], think)
    # one setting for both: the app's own defaults would add its presence penalty, which headless
    # (SamplingParams) leaves off, and the greedy replies would part at the first repeated token
    sampling = Sampling(temperature=0.0, presence_penalty=0.0, max_tokens=a.tokens)
    params = sampling.to_params()
    engine.mtp = False
    reference = generate(engine, ids, params)["token_ids"]      # also the warm-up of the weights

    def arm(mtp: bool) -> None:
        nonlocal diag
        engine.reset()
        engine.mtp = mtp
        engine.drafter = ProfileDrafter(reference, seed=0, vocab=engine.config.vocab_size) if mtp else None
        diag = Diagnosis() if a.diag else None

    def headless(mtp: bool):
        # on the app's own thread, which this call blocks: the event loop does nothing meanwhile
        arm(mtp)
        r = generate(engine, ids, params)
        assert r["token_ids"] == reference, "greedy output must not depend on MTP"
        return [r["stats"]["tokens_per_s"], r["stats"]["mean_acceptance_length"], diag.report() if diag else {}]

    class BenchApp(ChatApp):
        ended: asyncio.Event

        def on_generation_ended(self, m) -> None:   # ChatApp's own handler runs as well
            self.ended.set()

        def notice(self, text: str, severity: str = "information") -> None:
            super().notice(text, severity)        # what the app shows is on the pseudo-terminal: said here too
            say(f"the app says ({severity}): {text}")

    store = Store(tempfile.mkdtemp())
    app = BenchApp(lambda progress=None: LocalEngine(engine), model="bench", store=store, device=a.device, think=think,
                   sampling=sampling, draft_tokens=a.k)

    async def wait(cond, what: str, limit: float = 600.0):
        # plain sleeps, only between runs: the test pilot's pause() repaints the screen on every
        # call, and polling during a run would be charged to the app
        t = time.perf_counter()
        while not cond():
            if app.load_error:
                raise SystemExit(f"the app did not load the engine: {app.load_error}")
            if time.perf_counter() - t > limit:
                raise SystemExit(f"gave up after {limit:.0f} s waiting for {what}; the app's notices: {app.notices}")
            await asyncio.sleep(0.05)

    async def in_app(mtp: bool):
        app.action_new_chat()
        await wait(lambda: app.session_id is None and not app._views(), "a new chat")
        arm(mtp)
        app.redraw(force=True)             # as the MTP key does: the pane shows the new setting
        await asyncio.sleep(0.1)
        app.ended = asyncio.Event()
        paints = app.pacer.paints
        app.query_one(Composer).post_message(Composer.Submitted(PROMPT))
        await wait(app.ended.is_set, "the app's reply", limit=a.run_limit)
        await wait(lambda: not app.busy, "the app to be idle")
        if prompts[-1] != list(ids):
            # the profile drafter proposes the headless reply: another prompt makes its drafts wrong
            at = next((i for i, (p, q) in enumerate(zip(prompts[-1], ids)) if p != q), min(len(prompts[-1]), len(ids)))
            raise SystemExit(f"the app's prompt differs from headless at token {at} of {len(prompts[-1])} / "
                             f"{len(ids)}: app {prompts[-1][at:at + 8]}, headless {list(ids)[at:at + 8]}")
        if settings[-1] != (settings[0][0], tuple(keep_at)):
            raise SystemExit(f"the app samples or cuts its prefill otherwise than the bench does: {settings[-1]} "
                             f"against {settings[0][0]}, {keep_at}")
        if replies[-1] != reference:
            at = next((i for i, (p, q) in enumerate(zip(replies[-1], reference)) if p != q), len(reference))
            raise SystemExit(f"the app's greedy reply differs from headless at token {at} ({len(replies[-1])} "
                             f"against {len(reference)} tokens): the profile drafter's drafts (the headless "
                             "reply's) would not measure the app")
        stored = [m for m in store.messages(app.session_id) if m.role == "assistant"]
        if len(stored) != 1 or (stored[0].stats or {}).get("new_tokens") != a.tokens:
            raise SystemExit(f"the app's reply is not {a.tokens} tokens: {[m.stats for m in stored]}; "
                             f"its notices: {app.notices}")
        msg = stored[0]
        # text paints per second of decoding (the last, with the whole reply, comes after it)
        hz = (app.pacer.paints - paints - 1) / (msg.stats["decode_ms"] / 1e3)
        return [msg.stats["tokens_per_s"], msg.stats["mean_acceptance_length"], diag.report() if diag else {}, hz]

    runs = {(m, mtp): [] for m in MODES for mtp in (0, 1)}

    async def session():
        await wait(lambda: app.engine is not None, "the app to take the engine")
        for mtp in (False, True):          # untimed warm-ups
            say(f"warm-up, MTP {'on' if mtp else 'off'}: headless")
            headless(mtp)
            say(f"warm-up, MTP {'on' if mtp else 'off'}: in the app")
            await in_app(mtp)
        say(f"warm; {a.runs} rounds of {a.tokens} tokens")
        for r in range(a.runs):
            for mtp in (0, 1):
                got = {}
                for m in (MODES if (r + mtp) % 2 == 0 else MODES[::-1]):
                    got[m] = headless(bool(mtp)) if m == "headless" else await in_app(bool(mtp))
                    runs[m, mtp].append(got[m])
                extra = "".join(f"\n    {m}: " + " ".join(f"{k} {v}" for k, v in got[m][2].items())
                                for m in MODES if got[m][2])
                print(f"  round {r + 1} MTP {'on ' if mtp else 'off'}: headless {got['headless'][0]:7.1f}  "
                      f"app {got['app'][0]:7.1f} tok/s  ratio {got['app'][0] / got['headless'][0]:.3f}{extra}",
                      file=log, flush=True)

    async def go():
        if a.terminal == "none":
            async with app.run_test(size=SIZE):
                await session()
            return
        running = asyncio.create_task(app.run_async())
        try:
            await session()
        finally:
            app.exit()
            await running

    if a.terminal == "none":
        asyncio.run(go())
    else:
        with on_pty(*SIZE):
            asyncio.run(go())
    return runs


@contextlib.contextmanager
def on_pty(columns: int, rows: int):
    """Stdin and stderr (where Textual's driver reads and writes) on a pseudo-terminal of the given
    size, drained by `cat` into /dev/null: the app runs its real terminal driver, writer thread and
    escape-sequence rendering, which its headless test driver skips."""
    import fcntl
    import pty
    import struct
    import subprocess
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    drain = subprocess.Popen(["cat"], stdin=master, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(master)
    saved = os.dup(0), os.dup(2)
    env = {k: os.environ.get(k) for k in ("COLUMNS", "LINES")}
    os.environ.update(COLUMNS=str(columns), LINES=str(rows))
    os.dup2(slave, 0)
    os.dup2(slave, 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 0)
        os.dup2(saved[1], 2)
        os.close(slave)
        drain.wait()
        for k, v in env.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})


def say(line: str) -> None:
    """Progress, with the seconds since the start, where the app's terminal does not take it."""
    print(f"[{time.perf_counter() - STARTED:6.1f} s] {line}", file=log, flush=True)


STARTED = time.perf_counter()


def spread(xs, f: str = ".3f") -> str:
    return f"{statistics.median(xs):{f}} ({min(xs):{f}}-{max(xs):{f}})"


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--runs", type=int, default=15, help="rounds; each is one run of each mode per setting")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--think", choices=("on", "off"), default="on")
    p.add_argument("--malloc", choices=("pinned", "default"), default="pinned",
                   help="glibc malloc thresholds: pinned (see pin_malloc) or glibc's defaults")
    p.add_argument("--terminal", choices=("pty", "none"), default="pty",
                   help="the app draws to a pseudo-terminal (its real driver) or to none (Textual's test driver)")
    p.add_argument("--text-hz", type=float, default=0,
                   help="the slowest the streaming text may paint (default: the app's, pacer.LIVE_INTERVAL)")
    p.add_argument("--diag", action="store_true", help="per run: CPU time per thread and GC pauses")
    p.add_argument("--random-weights", metavar="NAME",
                   help="random weights of an official shape (engine/configs/NAME.json, or a config.json's path) "
                        "instead of the tiny model")
    p.add_argument("--run-limit", type=float, default=600.0, metavar="S",
                   help="seconds one reply in the app may take before the bench gives up and says why")
    a = p.parse_args(argv)
    if a.malloc == "pinned":
        pin_malloc()
    if a.text_hz:
        from mtpchat.app import pacer
        pacer.LIVE_INTERVAL = 1 / a.text_hz
    global log
    log = open(os.dup(2), "w")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # tests/, for tools.tiny when run as a script
    from tools.tiny import write_tiny_checkpoint
    a.ckpt = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    runs = bench(a)
    dtype = "float32" if a.device == "cpu" or not a.random_weights else "bfloat16"
    what = f"random {a.random_weights}, {dtype}" if a.random_weights else "tiny checkpoint, float32"
    from mtpchat.app import pacer
    print(f"{what} on {a.device}, {a.tokens} tokens per run, {a.runs} rounds, thinking {a.think}, "
          f"malloc {a.malloc}, terminal {a.terminal}, text >= {1 / pacer.LIVE_INTERVAL:g} Hz; "
          f"median (min-max)")
    for mtp in (0, 1):
        h, u = ([x[0] for x in runs[m, mtp]] for m in MODES)
        ratios = [x / y for x, y in zip(u, h)]
        acc = sorted({round(x[1], 2) for m in MODES for x in runs[m, mtp]})
        label = f"MTP on k={a.k}" if mtp else "MTP off"
        hz = statistics.median(x[3] for x in runs["app", mtp])
        print(f"{label:10s} app/headless {spread(ratios)}   headless {spread(h, '.1f')} tok/s   "
              f"app {spread(u, '.1f')} tok/s   text paints {hz:.1f}/s   mean acceptance length {acc}")


if __name__ == "__main__":
    main()
