"""The MoE routing kernel (kernels/moe_routing.py) timed as a step sees it: launches in a CUDA
graph, one after another, at the 35B-A3B's shapes (256 experts, 8 chosen, the shared expert as
choice 9), for a decode (1 row), verifies and the MTP head's catch-up (stale rows past `rows`),
with and without the layout it writes (ProductPlan.routed_layout).

    cd tests/bench && python3 bench_routing.py
    python3 bench_routing.py --rows 1,2,4,5,9
"""
from __future__ import annotations

import argparse

import torch

from graph_timing import graph_time
from mtpchat.kernels import moe_routing


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rows", default="1,2,4,5,9")
    a = p.parse_args()
    E, k = a.experts, a.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'rows':>4} {'layout':>6} {'stale':>5} {'us a launch':>12}")
    for T in map(int, a.rows.split(",")):
        logits = (torch.randn(T, E + 1, device="cuda", generator=g) * 2).to(torch.bfloat16)
        live = torch.tensor([max(T - 1, 1)], dtype=torch.int32, device="cuda")
        for layout in (False, True):
            for stale in ((False, True) if T > 1 else (False,)):
                fn = lambda i: moe_routing.route_step(logits, k, E, shared=True, layout=layout,
                                                      rows=live if stale else None)
                t = graph_time(fn, 1, launches=50)
                print(f"{T:>4} {str(layout):>6} {str(stale):>5} {t:12.2f}", flush=True)


if __name__ == "__main__":
    main()
