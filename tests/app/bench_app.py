"""Tokens/s inside the app vs headless, on the same tiny checkpoint.

    python tests/app/bench_app.py [--tokens 256] [--runs 5] [--k 3] [--device cpu]

Headless is the `mtpchat run` loop (engine.generate, detokenizing each step, on the main thread).
The app run sends the same prompt through the Textual app (headless driver: it lays out and renders
every frame and only skips writing to a terminal), with the generation worker, the 30 Hz batches,
the streaming Markdown and the 4 Hz telemetry pane all live; a new chat before each run resets the
engine. Both report the engine's own decode rate (Stats.tokens_per_s, prefill excluded), greedy,
with the stop tokens ignored so every run decodes exactly --tokens tokens. MTP on uses
ProfileDrafter (engine/spec.py) so drafts are accepted at a realistic rate on random weights.
Each mode runs in its own process, with one untimed warm-up run per setting; medians are compared.
`--device cuda --random-weights qwen3.6-27b` runs the same comparison on a GPU with random weights of
the real 27B shapes (the tiny checkpoint's tokenizer renders the ids as text).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = "Tell me a long story about a tiny model."


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


def load(a):
    import torch
    from mtpchat.engine import Engine
    if not a.random_weights:
        return Engine.load(a.ckpt, device=a.device, dtype=torch.float32, max_context=8192, draft_tokens=a.k,
                           cuda_graphs=a.device != "cpu")
    from mtpchat.engine import bench
    from mtpchat.engine.config import ModelConfig
    from mtpchat.engine.tokenizer import Tokenizer
    config = ModelConfig.load(Path(bench.__file__).parent / "configs" / f"{a.random_weights}.json")
    engine = Engine(config, device=a.device, max_context=8192, draft_tokens=a.k, cuda_graphs=True)
    tok = Tokenizer.load(a.ckpt)
    engine.tokenizer = WrappedIds(tok, tok.vocab_size)
    return engine


def progress(a, mtp: int, result) -> None:
    print(f"  {a.child} MTP {'on' if mtp else 'off'}: {result[0]:.1f} tok/s", file=sys.stderr, flush=True)


def child(a) -> None:
    """One process, one mode (headless or app), MTP off then on: prints {"0": [...], "1": [...]}."""
    from mtpchat.cli import generate
    from mtpchat.engine import SamplingParams
    from mtpchat.engine.spec import ProfileDrafter

    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    engine = load(a)
    generate_any = engine.generate
    engine.generate = lambda ids, params: generate_any(ids, dataclasses.replace(params, stop_token_ids=()))
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens)
    engine.mtp = False
    reference = generate(engine, ids, params)["token_ids"]      # also the warm-up of the weights

    def arm(mtp: bool) -> None:
        engine.reset()
        engine.mtp = mtp
        engine.drafter = ProfileDrafter(reference, seed=0, vocab=engine.config.vocab_size) if mtp else None

    results = {0: [], 1: []}
    if a.child == "headless":
        for mtp in (0, 1):
            for _ in range(a.runs + 1):
                arm(bool(mtp))
                r = generate(engine, ids, params)
                assert r["token_ids"] == reference, "greedy output must not depend on MTP"
                results[mtp].append((r["stats"]["tokens_per_s"], r["stats"]["mean_acceptance_length"]))
                progress(a, mtp, results[mtp][-1])
    else:
        from mtpchat.app.app import ChatApp
        from mtpchat.app.chat import Composer
        from mtpchat.app.settings import Sampling
        from mtpchat.app.store import Store
        store = Store(tempfile.mkdtemp())
        app = ChatApp(lambda: engine, model="bench", store=store, device=a.device, think=True,
                      sampling=Sampling(temperature=0.0, max_tokens=a.tokens), draft_tokens=a.k)

        async def wait(cond):
            # plain sleeps: the test pilot's pause() repaints the screen on every call, which
            # would be charged to the app here
            while not cond():
                await asyncio.sleep(0.05)

        async def go():
            async with app.run_test(size=(150, 46)):
                await wait(lambda: app.engine is not None)
                for mtp in (0, 1):
                    for _ in range(a.runs + 1):
                        app.action_new_chat()
                        await wait(lambda: app.session_id is None and not app._views())
                        arm(bool(mtp))
                        app.query_one(Composer).post_message(Composer.Submitted(PROMPT))
                        await wait(lambda: app.busy)
                        await wait(lambda: not app.busy)
                        (msg,) = [m for m in store.messages(app.session_id) if m.role == "assistant"]
                        assert msg.stats["new_tokens"] == a.tokens, msg.stats
                        results[mtp].append((msg.stats["tokens_per_s"], msg.stats["mean_acceptance_length"]))
                        progress(a, mtp, results[mtp][-1])
        asyncio.run(go())
    print(json.dumps({m: r[1:] for m, r in results.items()}))   # the first run of each warms up


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--random-weights", metavar="NAME",
                   help="random weights of an official shape (engine/configs/NAME.json) instead of the tiny model")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--child", choices=("headless", "app"), help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a)

    from mtpchat.engine.tiny import write_tiny_checkpoint
    ckpt = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    out = {}
    for mode in ("headless", "app"):
        cmd = [sys.executable, __file__, "--child", mode, "--ckpt", str(ckpt), "--tokens", str(a.tokens),
               "--runs", str(a.runs), "--k", str(a.k), "--device", a.device, "--threads", str(a.threads)]
        cmd += ["--random-weights", a.random_weights] if a.random_weights else []
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)   # progress goes to stderr as it comes
        if proc.returncode:
            sys.exit(f"the {mode} run failed")
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    what = f"random {a.random_weights}, bfloat16" if a.random_weights else "tiny checkpoint, float32"
    print(f"{what} on {a.device}, {a.tokens} tokens per run, {a.runs} runs per mode, medians")
    for mtp in ("0", "1"):
        h = [t for t, _ in out["headless"][mtp]]
        u = [t for t, _ in out["app"][mtp]]
        acc = sorted({round(x, 2) for _, x in out["headless"][mtp] + out["app"][mtp]})
        hm, um = statistics.median(h), statistics.median(u)
        label = f"MTP on k={a.k}" if mtp == "1" else "MTP off"
        print(f"{label:10s} headless {hm:8.1f} tok/s  app {um:8.1f} tok/s  app/headless {um / hm:.3f}  "
              f"(mean acceptance length {acc}; headless {' '.join(f'{x:.0f}' for x in h)}; "
              f"app {' '.join(f'{x:.0f}' for x in u)})")


if __name__ == "__main__":
    main()
