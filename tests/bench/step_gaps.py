"""Where a reply's wall time goes between the device's phases: for each pair of consecutive phases
(draft, verify, accept) the idle time of the device between them, and the host time of each
launch, over 128-token replies with MTP off, on with the profile drafter (k=3) and on with the
real head, on random weights of an official shape.

    python3 step_gaps.py --model qwen3.6-27b

Each phase is timed with the CUDA events the runner records around it; a gap is the elapsed time
from one phase's end event to the next phase's start event.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mtpchat.engine import bench
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.engine import Engine
from mtpchat.engine.runner import Runner
from mtpchat.engine.spec import ProfileDrafter


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    config = ModelConfig.load(Path(bench.__file__).parent / "configs" / f"{args.model}.json")
    engine = Engine(config, device="cuda", max_context=4096, k_max=4)
    log = []
    plain_run = Runner.run

    def run(self, key, fn):
        t = time.perf_counter()
        events = plain_run(self, key, fn)
        log.append((key[0], events, (time.perf_counter() - t) * 1e6))
        return events

    Runner.run = run
    prompt = bench.random_prompt(engine, 1024, 1)
    med = lambda xs: round(statistics.median(xs), 1)

    def reply(mtp, drafter=None):
        log.clear()
        r = bench.generate(engine, prompt, args.tokens, mtp=mtp, k=3, drafter=drafter)
        torch.cuda.synchronize()
        gaps, launch = {}, {}
        for (a, ea, _), (b, eb, _) in zip(log, log[1:]):
            gaps.setdefault(f"{a}->{b}", []).append(ea[1].elapsed_time(eb[0]) * 1e3)
        for name, _, us in log:
            launch.setdefault(name, []).append(us)
        return {"ms_per_step": r["ms_per_step"], "device_ms_per_step": r["draft_ms"] + r["verify_ms"] + r["accept_ms"],
                "idle_us": {k: med(v) for k, v in gaps.items()}, "launch_us": {k: med(v) for k, v in launch.items()}}

    ref = bench.generate(engine, prompt, args.tokens, mtp=False)["tokens"]     # untimed warm-ups
    bench.generate(engine, prompt, args.tokens, mtp=True, k=1, drafter=ProfileDrafter(ref, vocab=config.vocab_size))
    out = {"mtp off": reply(False)}
    out["mtp on k=3, profile"] = reply(True, ProfileDrafter(ref, bench.PROFILE, seed=3, vocab=config.vocab_size))
    out["mtp on k=3, real head"] = reply(True)
    Runner.run = plain_run
    for name, r in out.items():
        print(f"{name:24s} {r['ms_per_step']:8.3f} ms a step, device {r['device_ms_per_step']:8.3f} ms; "
              f"idle between phases (median us) {r['idle_us']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
