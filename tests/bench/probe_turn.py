"""Where a short prefill's time goes: a chat turn of a few tokens after a long history, its wall
time against the GPU time of its kernels (CUPTI) and their count, so a turn that waits on the host
(launches) shows as wall >> GPU. One engine, random weights of an official shape, eager prefill as
the engine runs it.

With --generation-prompt G (and --graphs, as the app runs), a turn is what a chat turn prefills:
the new message, a snapshot where it ends, then a G-token generation prompt (Decoder.begin with
snapshot_at), so the plan's step_prefill shows on the pieces short enough for it.

    cd tests/bench && python3 probe_turn.py [--model qwen3.6-27b] [--weights fp8] [--history 8192]
                                            [--tokens 16,50,128,512] [--plans ";prefill_attention=flash"]
                                            [--cprofile 40] [--graphs] [--generation-prompt 5]
                                            [--prefill-graphs 8,16,24,32,40,48,56,64] [--kernels 25]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mtpchat.engine.bench import random_prompt
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.engine import Engine
from mtpchat.engine.memory import CAPTURED_K
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.sampling import SamplingParams
from ab_step import CONFIGS
from probe_prefill_chunk import parse_changes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--weights", default="fp8")
    p.add_argument("--history", type=int, default=8192)
    p.add_argument("--tokens", default="16,50,128,512")
    p.add_argument("--plans", default="", help="plans as changes to the engine's, ';'-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cprofile", type=int, default=0, metavar="ROWS",
                   help="also the host's time by function (cProfile) over one turn of each size, ROWS rows")
    p.add_argument("--graphs", action="store_true", help="capture the step graphs, as the app does")
    p.add_argument("--generation-prompt", type=int, default=0, metavar="G",
                   help="a chat turn: the message, a snapshot, then G tokens of generation prompt")
    p.add_argument("--kernels", type=int, default=0, metavar="ROWS",
                   help="also each turn's kernels by name, the ROWS that took the most GPU time")
    p.add_argument("--load-plan", default="", metavar="CHANGES",
                   help="changes to the plan the engine loads and captures under, e.g. prefill_pieces=1 "
                        "(its prefill_graphs stay as chosen before them: give --prefill-graphs to change those)")
    p.add_argument("--recapture", action="store_true",
                   help="capture the graphs again under each plan of --plans (a graph keeps the plan it was captured under)")
    p.add_argument("--prefill-graphs", metavar="SIZES",
                   help="the prefill chunks captured at load, e.g. 8,16,24 (default: the plan's)")
    a = p.parse_args()
    sizes = [int(t) for t in a.tokens.split(",")]
    config = ModelConfig.load(CONFIGS / f"{a.model}.json")
    plan = None
    if a.prefill_graphs or a.load_plan:
        plan = KernelPlan.choose(torch.device("cuda"), config, a.weights == "fp8", a.weights == "int4")
        plan = plan.replace(**parse_changes(a.load_plan))
    if a.prefill_graphs:
        plan = plan.replace(prefill_graphs=tuple(int(t) for t in a.prefill_graphs.split(",")))
    engine = Engine(config, device="cuda", dtype=torch.bfloat16,
                    max_context=a.history + 2 * max(sizes) + a.generation_prompt + 256,
                    cuda_graphs=a.graphs, weights=a.weights, snapshots=2 if a.generation_prompt else 0, plan=plan)
    dec, base = engine.decoder, engine.plan
    history = random_prompt(engine, a.history, 0)
    gen = random_prompt(engine, a.generation_prompt, 99)
    print(f"{torch.cuda.get_device_name()}, {a.model} {a.weights}, {a.history} tokens of history, "
          f"graphs {'on' if a.graphs else 'off'}, a generation prompt of {a.generation_prompt}, prefill graphs "
          f"{base.prefill_graphs}, graph pool {engine.runner.pool_bytes / 2**20 if engine.runner else 0:.0f} MiB, "
          f"capture {engine.runner.capture_s if engine.runner else 0:.1f} s", flush=True)

    def turn_of(ids):
        if a.generation_prompt:
            dec.begin(history + ids + gen, snapshot_at=(a.history + len(ids),))
        else:
            dec.prefill(ids)

    for changes in [parse_changes(c) for c in a.plans.split(";")] if a.plans else [{}]:
        engine.plan = dec.plan = base.replace(**changes)
        if a.recapture and engine.runner is not None and engine.runner.graphs_on:
            engine.runner.graphs.clear()
            engine.runner.pool = torch.cuda.graph_pool_handle()   # a pool is not captured into twice
            with torch.inference_mode():
                engine.runner.capture(min(engine.state.k_max, CAPTURED_K), engine.head is not None, SamplingParams())
        for n in sizes:
            turn = random_prompt(engine, n, 1 + n)
            walls = []
            for i in range(a.repeats + 1):
                engine.reset()
                dec.begin(history)
                torch.cuda.synchronize()
                t = time.perf_counter()
                turn_of(turn)
                torch.cuda.synchronize()
                if i:                                 # the first compiles
                    walls.append((time.perf_counter() - t) * 1e3)
            engine.reset()
            dec.begin(history)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                turn_of(turn)
                torch.cuda.synchronize()
            if a.cprofile:
                engine.reset()
                dec.begin(history)
                torch.cuda.synchronize()
                with cProfile.Profile() as host:
                    turn_of(turn)
                    torch.cuda.synchronize()
                for key in ("tottime", "cumulative"):
                    pstats.Stats(host).sort_stats(key).print_stats(a.cprofile)
            kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
            gpu = sum(ev.device_time_total for ev in kernels) / 1e3
            wall = statistics.median(walls)
            print(f"  plan {changes or 'as loaded'}, {n:4d} new tokens: wall {wall:7.2f} ms (min {min(walls):.2f}), "
                  f"kernels {gpu:7.2f} ms in {len(kernels)} launches: {wall / gpu:.2f} x the GPU's time, "
                  f"{(wall - gpu) / len(kernels) * 1e3:.1f} us a launch beyond it", flush=True)
            if a.kernels:
                by_name: dict = {}
                for ev in kernels:
                    t, count = by_name.get(ev.name, (0.0, 0))
                    by_name[ev.name] = (t + ev.device_time_total / 1e3, count + 1)
                for name, (t, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:a.kernels]:
                    print(f"      {t:8.3f} ms {count:5d} x  {name[:110]}")


if __name__ == "__main__":
    main()
