"""Tokens/s inside the app vs headless, on the same tiny checkpoint.

    python tests/app/bench_app.py [--tokens 256] [--runs 5] [--k 3] [--device cpu]

Headless is the `mtpchat run` loop (engine.generate, detokenizing each step, on the main thread).
The app run sends the same prompt through the Textual app (headless driver: it lays out and renders
every frame and only skips writing to a terminal), with the generation worker, the 30 Hz batches,
the streaming Markdown and the 4 Hz telemetry pane all live; a new chat before each run resets the
engine. Both report the engine's own decode rate (Stats.tokens_per_s, prefill excluded), greedy,
with the stop tokens ignored so every run decodes exactly --tokens tokens. MTP on uses
ProfileDrafter (engine/spec.py) so drafts are accepted at a realistic rate on random weights.
Each mode runs in its own process after one untimed warm-up run; the medians are compared.
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

HERE = Path(__file__).resolve().parent
PROMPT = "Tell me a long story about a tiny model."


def child(a) -> None:
    import torch
    from mtpchat.cli import generate
    from mtpchat.engine import Engine, SamplingParams
    from mtpchat.engine.spec import ProfileDrafter

    engine = Engine.load(a.ckpt, device=a.device, dtype=torch.float32, max_context=2048, draft_tokens=a.k,
                         cuda_graphs=False)
    generate_any = engine.generate
    engine.generate = lambda ids, params: generate_any(ids, dataclasses.replace(params, stop_token_ids=()))
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens)
    engine.mtp = False
    reference = generate(engine, ids, params)["token_ids"]      # also the warm-up of the weights

    def arm() -> None:
        engine.mtp = bool(a.mtp)
        engine.drafter = ProfileDrafter(reference, seed=0, vocab=engine.config.vocab_size) if a.mtp else None

    results = []
    if a.child == "headless":
        for _ in range(a.runs + 1):
            engine.reset()
            arm()
            r = generate(engine, ids, params)
            assert r["token_ids"] == reference, "greedy output must not depend on MTP"
            results.append((r["stats"]["tokens_per_s"], r["stats"]["mean_acceptance_length"]))
    else:
        sys.path.insert(0, str(HERE))
        from apphelpers import idle, ready, send, until

        from mtpchat.app.app import ChatApp
        from mtpchat.app.settings import Sampling
        from mtpchat.app.store import Store
        store = Store(tempfile.mkdtemp())
        app = ChatApp(lambda: engine, model="tiny", store=store, device=a.device, dtype="float32", think=True,
                      sampling=Sampling(temperature=0.0, max_tokens=a.tokens), mtp=bool(a.mtp), draft_tokens=a.k)

        async def go():
            async with app.run_test(size=(150, 46)) as pilot:
                await ready(pilot)
                for _ in range(a.runs + 1):
                    await pilot.press("ctrl+n")
                    await until(pilot, lambda: app.session_id is None and not app._views())
                    arm()
                    await send(pilot, PROMPT, wait=False)
                    await idle(pilot)
                    sid = app.session_id
                    (msg,) = [m for m in store.messages(sid) if m.role == "assistant"]
                    assert msg.stats["new_tokens"] == a.tokens, msg.stats
                    results.append((msg.stats["tokens_per_s"], msg.stats["mean_acceptance_length"]))
        asyncio.run(go())
    print(json.dumps(results[1:]))   # the first run warms up the thread that decodes


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--child", choices=("headless", "app"))
    p.add_argument("--mtp", type=int, default=0)
    p.add_argument("--ckpt")
    a = p.parse_args(argv)
    if a.child:
        return child(a)

    from mtpchat.engine.tiny import write_tiny_checkpoint
    ckpt = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    print(f"tiny checkpoint on {a.device}, float32, {a.tokens} tokens per run, {a.runs} runs per mode, medians")
    for mtp in (0, 1):
        out = {}
        for mode in ("headless", "app"):
            cmd = [sys.executable, __file__, "--child", mode, "--mtp", str(mtp), "--ckpt", str(ckpt),
                   "--tokens", str(a.tokens), "--runs", str(a.runs), "--k", str(a.k), "--device", a.device]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        h = [t for t, _ in out["headless"]]
        u = [t for t, _ in out["app"]]
        acc = sorted({round(x, 2) for _, x in out["headless"] + out["app"]})
        hm, um = statistics.median(h), statistics.median(u)
        label = f"MTP on k={a.k}" if mtp else "MTP off"
        print(f"{label:10s} headless {hm:8.1f} tok/s  app {um:8.1f} tok/s  app/headless {um / hm:.3f}  "
              f"(mean acceptance length {acc}; headless {' '.join(f'{x:.0f}' for x in h)}; "
              f"app {' '.join(f'{x:.0f}' for x in u)})")


if __name__ == "__main__":
    main()
