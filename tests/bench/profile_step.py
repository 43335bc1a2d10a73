"""Where a step's GPU time goes: kernel times grouped by kernel, for the decode step (verify k=0),
verify k, one draft phase and a long prefill, on random weights of an official shape.

    python3 profile_step.py --model qwen3.6-27b --context 1024 --prefill 8192 --json out.json
    python3 profile_step.py --model qwen3.5-35b-a3b --weights fp8 --prefill 0

Graph replays are profiled as they run in the engine (CUPTI sees the kernels inside a graph).
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mtpchat.engine import bench
from mtpchat.engine.bench import random_prompt
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.engine import Engine
from mtpchat.engine.sampling import SamplingParams

CONFIGS = Path(bench.__file__).parent / "configs"


def kernel_table(fn, repeats: int) -> dict:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    groups = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name if len(ev.name) < 70 else ev.name[:67] + "..."
            groups[name][0] += 1
            groups[name][1] += ev.device_time_total
    rows = sorted(((n, c / repeats, t / repeats) for n, (c, t) in groups.items()), key=lambda r: -r[2])
    return {"kernels_us": {n: {"count": c, "us": round(t, 1)} for n, c, t in rows},
            "total_us": round(sum(r[2] for r in rows), 1), "launches": sum(r[1] for r in rows)}


def sequence(fn, first: int, skip: int = 0) -> list:
    """The kernels of one call of fn in launch order, (name, us) each, `first` of them after `skip`."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda ev: ev.time_range.start)
    return [(ev.name[:60], round(ev.device_time_total, 1)) for ev in evs][skip:skip + first]


def wall(fn, repeats: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


def show(title: str, table: dict, wall_us: float | None = None, top: int = 25):
    extra = f", wall {wall_us:.1f} us" if wall_us else ""
    print(f"\n== {title}: kernels {table['total_us']:.1f} us in {table['launches']:.0f} launches{extra}")
    for name, r in list(table["kernels_us"].items())[:top]:
        print(f"  {r['us']:9.1f} us  x{r['count']:<5.0f} {name}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--weights", choices=("bf16", "fp8", "int4"), default="bf16")
    p.add_argument("--json")
    p.add_argument("--sequence", type=int, default=0, metavar="N",
                   help="also list N kernels of an eager decode step, verify 3 and the draft 3 graph in launch "
                        "order (after --skip)")
    p.add_argument("--skip", type=int, default=0)
    a = p.parse_args()
    config = ModelConfig.load(CONFIGS / f"{a.model}.json")
    engine = Engine(config, device="cuda", dtype=torch.bfloat16, max_context=max(a.context, a.prefill) + 256,
                    weights=a.weights)
    d, out = engine.decoder, {}
    for _ in engine.generate(random_prompt(engine, a.context, 1), SamplingParams(max_tokens=2, stop_token_ids=())):
        pass
    runner = engine.runner

    def replay(key):
        return lambda: runner.graphs[key].replay()

    # a live generation (room left), so the steps write their GDN state as they do in a reply
    d.room.fill_(1 << 20)
    save = [t.clone() for t in (d.pos, d.state.fold, d.state.parity, d.state.conv_off, d.room)]
    def restore():
        for t, s in zip((d.pos, d.state.fold, d.state.parity, d.state.conv_off, d.room), save):
            t.copy_(s)

    for key in (("verify", 0), ("verify", 3), ("draft", 3)):
        fn = lambda key=key: (restore(), replay(key)())
        table = kernel_table(fn, a.repeats)
        w = wall(fn, a.repeats)
        out[f"{key[0]} {key[1]}"] = {**table, "wall_us": w}
        show(f"graph {key}", table, w)
    if a.sequence:
        runs = [(f"eager verify {k}", lambda k=k: (restore(), d.verify(k))) for k in (0, 3)]
        for title, run in runs + [("graph draft 3", lambda: (restore(), replay(("draft", 3))()))]:
            seq = sequence(run, a.sequence, a.skip)
            out[f"{title} sequence"] = seq
            print(f"\n== {title}, kernels {a.skip} .. {a.skip + len(seq)} in launch order")
            for name, us in seq:
                print(f"  {us:8.1f} us  {name}")
    for k in (0, 3):
        table = kernel_table(lambda k=k: (restore(), d.verify(k)), a.repeats)
        out[f"verify {k} eager"] = table
        show(f"eager verify {k}", table)

    if a.prefill:
        prompt = random_prompt(engine, a.prefill, 2)
        def prefill():
            engine.reset()
            d.prefill(prompt)
        table = kernel_table(prefill, 1)
        w = wall(prefill, 1)
        out[f"prefill {a.prefill}"] = {**table, "wall_us": w}
        show(f"prefill {a.prefill}", table, w, top=30)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
