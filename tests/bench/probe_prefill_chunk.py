"""Time to first token of one long prompt under prefill chunks of several sizes, one engine (random
weights of an official shape), with the peak memory each chunk size takes beyond the weights.

    python3 probe_prefill_chunk.py [--model qwen3.6-27b] [--weights int4] [--tokens 8192] [--chunks 2048,4096,8192]
                                   [--int4-prefill dense,fp8]

`--int4-prefill`: each chunk size under each of these forms of prefill's 4-bit products
(ProductPlan.int4_prefill; kernels/int4_gemm.py), the engine's plan changed between runs.
"""
from __future__ import annotations

import argparse

import torch

from mtpchat.engine.bench import time_to_first_token
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
    a = p.parse_args()
    config = ModelConfig.load(CONFIGS / f"{a.model}.json")
    engine = Engine(config, device="cuda", dtype=torch.bfloat16, max_context=a.tokens + 256, cuda_graphs=False,
                    weights=a.weights)
    weights = torch.cuda.memory_allocated()
    for form in a.int4_prefill.split(",") if a.int4_prefill else [None]:
        if form is not None:
            engine.plan = engine.decoder.plan = engine.plan.replace(int4_prefill=form)
        for chunk in map(int, a.chunks.split(",")):
            engine.decoder.prefill_chunk = chunk
            torch.cuda.reset_peak_memory_stats()
            ms = time_to_first_token(engine, a.tokens)
            peak = torch.cuda.max_memory_allocated() - weights
            print(f"{a.model} {a.weights} {a.tokens} tokens, chunk {chunk}, int4 prefill "
                  f"{engine.plan.products.int4_prefill}: {ms:.0f} ms, peak {peak / 2**30:.2f} GiB beyond the engine "
                  "at rest", flush=True)


if __name__ == "__main__":
    main()
