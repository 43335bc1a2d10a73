"""Time to first token of one long prompt under prefill chunks of several sizes, one engine (random
weights of an official shape), with the peak memory each chunk size takes beyond the weights.

    python3 probe_prefill_chunk.py [--model qwen3.6-27b] [--weights int4] [--tokens 8192] [--chunks 2048,4096,8192]
                                   [--int4-prefill dense,fp8] [--plans "prefill_rows=1;prefill_rows=16"]
                                   [--rounds 1]

`--int4-prefill`: each chunk size under each of these forms of prefill's 4-bit products
(ProductPlan.int4_prefill; kernels/int4_gemm.py), the engine's plan changed between runs.
`--plans`: each chunk size under each of these plans, given as changes to the engine's
(`name=value` pairs, comma-separated, for KernelPlan.replace; an empty one is the engine's own),
the plans in turn `--rounds` times, so that a ratio between two is read from one process.
"""
from __future__ import annotations

import argparse

import torch

from mtpchat.engine.bench import second_turn, time_to_first_token
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.engine import Engine
from ab_step import CONFIGS


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--weights", default="int4")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunks", default="2048,4096,8192")
    p.add_argument("--int4-prefill", default="", help="forms of prefill's 4-bit products, comma-separated")
    p.add_argument("--plans", default="", help="plans as changes to the engine's, ';'-separated")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--turn", type=int, default=0, metavar="NEW",
                   help="also a chat turn of NEW tokens after the prompt's snapshot (engine.bench.second_turn)")
    a = p.parse_args()
    config = ModelConfig.load(CONFIGS / f"{a.model}.json")
    engine = Engine(config, device="cuda", dtype=torch.bfloat16, max_context=a.tokens + 256, cuda_graphs=False,
                    weights=a.weights)
    weights = torch.cuda.memory_allocated()
    base = engine.plan
    plans = [parse_changes(c) for c in a.plans.split(";")] if a.plans else [{}]
    forms = a.int4_prefill.split(",") if a.int4_prefill else [None]
    for _, changes, form in ((r, c, f) for r in range(a.rounds) for c in plans for f in forms):
        engine.plan = engine.decoder.plan = base.replace(**changes, **({"int4_prefill": form} if form else {}))
        for chunk in map(int, a.chunks.split(",")):
            engine.decoder.prefill_chunk = chunk
            torch.cuda.reset_peak_memory_stats()
            ms = time_to_first_token(engine, a.tokens)
            peak = torch.cuda.max_memory_allocated() - weights
            print(f"{a.model} {a.weights} {a.tokens} tokens, chunk {chunk}, int4 prefill "
                  f"{engine.plan.products.int4_prefill}, plan {changes or 'as loaded'}: {ms:.1f} ms, peak "
                  f"{peak / 2**30:.2f} GiB beyond the engine at rest", flush=True)
            if a.turn:
                turn = second_turn(engine, a.tokens, a.turn)
                print(f"    then a turn of {a.turn} tokens after the snapshot: {turn['second_ms']:.1f} ms "
                      f"({turn['second_reused']} reused; the first turn {turn['first_ms']:.1f} ms)", flush=True)


def parse_changes(text: str) -> dict:
    """"prefill_rows=16,int4_prefill=fp8,prefill_graphs=8/16" -> {"prefill_rows": 16, "int4_prefill":
    "fp8", "prefill_graphs": (8, 16)} (ints, booleans, words, tuples of ints split by '/')."""
    out = {}
    for pair in filter(None, (t.strip() for t in text.split(","))):
        key, value = pair.split("=")
        out[key] = (int(value) if value.lstrip("-").isdigit() else
                    tuple(int(v) for v in value.split("/") if v) if "/" in value else
                    {"true": True, "false": False}.get(value.lower(), value))
    return out


if __name__ == "__main__":
    main()
