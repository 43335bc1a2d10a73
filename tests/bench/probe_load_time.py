"""What a load takes, and how much of it is the warm-up and capture (Triton's compiles among them):
run it twice, the first time with an empty compile cache, to separate the first load on a machine
from the later ones.

    cd tests/bench && TRITON_CACHE_DIR=/tmp/fresh python3 probe_load_time.py qwen3.6-27b fp8   # then again
"""
from __future__ import annotations

import sys
import time

import torch
from ab_step import CONFIGS

from mtpchat.engine.config import ModelConfig
from mtpchat.engine.engine import Engine


def main():
    name, weights = sys.argv[1], sys.argv[2]
    config = ModelConfig.load(CONFIGS / f"{name}.json")
    t0 = time.perf_counter()
    engine = Engine(config, device="cuda", dtype=torch.bfloat16, max_context=16384, weights=weights)
    print(f"{name} {weights}: Engine() {time.perf_counter() - t0:.1f} s, of it the warm-up and capture "
          f"{engine.runner.capture_s:.1f} s, graphs {len(engine.runner.graphs)}", flush=True)


if __name__ == "__main__":
    main()
