"""What a load takes, and how much of it is the warm-up and capture (Triton's compiles among them):
run it twice, the first time with an empty compile cache, to separate the first load on a machine
from the later ones.

    cd tests/bench && TRITON_CACHE_DIR=/tmp/fresh python3 probe_load_time.py qwen3.6-27b fp8   # then again
    cd tests/bench && python3 probe_load_time.py qwen3.6-27b fp8 prefill_early=/   # under a plan changed so
"""
from __future__ import annotations

import sys
import time

import torch
from ab_step import CONFIGS
from probe_prefill_chunk import parse_changes

from mtpchat.engine.config import ModelConfig
from mtpchat.engine.engine import Engine
from mtpchat.engine.plan import KernelPlan


def main():
    name, weights = sys.argv[1], sys.argv[2]
    changes = sys.argv[3] if len(sys.argv) > 3 else ""
    config = ModelConfig.load(CONFIGS / f"{name}.json")
    plan = None
    if changes:
        plan = KernelPlan.choose(torch.device("cuda"), config, weights == "fp8", weights == "int4")
        plan = plan.replace(**parse_changes(changes))
    t0 = time.perf_counter()
    engine = Engine(config, device="cuda", dtype=torch.bfloat16, max_context=16384, weights=weights, plan=plan)
    print(f"{name} {weights} {changes or '(the default plan)'}: Engine() {time.perf_counter() - t0:.1f} s, of it the warm-up and capture "
          f"{engine.runner.capture_s:.1f} s, graphs {len(engine.runner.graphs)}", flush=True)


if __name__ == "__main__":
    main()
