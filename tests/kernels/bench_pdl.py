"""What programmatic dependent launch (kernels/_triton.py) buys: the decode step (verify 0),
verify 3 and a 3-token draft, each captured with PDL and without and replayed in interleaved
rounds, on random weights of an official shape; the logits must be the same bits.

    python3 bench_pdl.py --model qwen3.6-27b --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from mtpchat.engine import bench
from mtpchat.engine.bench import random_prompt
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.engine import Engine
from mtpchat.kernels import _triton
from mtpchat.engine.sampling import SamplingParams

CONFIGS = Path(bench.__file__).parent / "configs"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--room", type=int, default=1 << 20,
                   help="tokens the generation may still emit: 0 replays ended steps, which write no GDN state")
    p.add_argument("--json")
    a = p.parse_args()
    config = ModelConfig.load(CONFIGS / f"{a.model}.json")
    engine = Engine(config, device="cuda", dtype=torch.bfloat16, max_context=a.context + 256, cuda_graphs=False)
    d = engine.decoder
    for _ in engine.generate(random_prompt(engine, a.context, 1), SamplingParams(max_tokens=2, stop_token_ids=())):
        pass
    d.room.fill_(a.room)
    save = [t.clone() for t in (d.pos, d.state.fold, d.state.parity, d.state.conv_off, d.pend_n, d.room)]

    def restore():
        for t, s in zip((d.pos, d.state.fold, d.state.parity, d.state.conv_off, d.pend_n, d.room), save):
            t.copy_(s)

    phases = {"verify 0": lambda: d.verify(0), "verify 3": lambda: d.verify(3), "draft 3": lambda: d.draft(3)}
    on = _triton._pdl_device
    plans = {"off": lambda index: False, "pdl": on}
    graphs, logits = {}, {}
    pool = torch.cuda.graph_pool_handle()
    for name, plan in plans.items():
        _triton._pdl_device = plan                 # what kernels/_triton.pdl() asks
        for phase, fn in phases.items():
            restore()
            fn()                                   # compiles this plan's kernels
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                restore()
                fn()
            graphs[name, phase] = g
        restore()
        graphs[name, "verify 0"].replay()
        logits[name] = d.v_logits[:1].clone()
    _triton._pdl_device = on
    # replays of a live step overwrite the state they start from, so only ended ones compare
    same = {name: bool(torch.equal(logits[name], logits["off"])) for name in plans} if a.room == 0 else {}
    times = {key: [] for key in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(a.rounds):
        for key, g in graphs.items():
            g.replay()
            start.record()
            for _ in range(a.replays):
                g.replay()
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end) / a.replays)
    out = {"same_logits": same, "ms": {}}
    base = {phase: statistics.median(times["off", phase]) for phase in phases} if "off" in plans else None
    for name in plans:
        row = {phase: statistics.median(times[name, phase]) for phase in phases}
        out["ms"][name] = row
        rel = "  ".join(f"{ph} {ms:7.3f} ms" + (f" ({ms / base[ph]:.4f})" if base else "") for ph, ms in row.items())
        print(f"{name:>4}: {rel}  same logits: {same.get(name)}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
