"""Where a decode step's MoE expert kernels spend their time at the 35B-A3B's shapes (H 2048, 256
experts of 512): each kernel timed over 1, 2, 4 and 8 experts a row (one row, as in decode), its
weights the same in every call (held in L2) or another routing each call (read from memory), with
the step's layout derived on the device (as the engine runs) or given (`Layout`, the bookkeeping
skipped). The slope over the experts is what a further expert costs, the intercept what every call
costs whatever it reads.

    cd tests/bench && python3 probe_moe_latency.py
"""
from __future__ import annotations

import torch

from bench_moe import timed
from mtpchat.kernels import fp8, moe, moe_routing
from mtpchat.kernels.plan import default_products

E, F, H, ROUTINGS = 256, 512, 2048, 16


def main():
    plan = default_products("cuda")
    print("us a call; experts a row 1 / 2 / 4 / 8")
    for weights in ("fp8", "bf16"):
        gu = torch.randn(E * 2 * F, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        down = torch.randn(E * H, F, device="cuda", dtype=torch.bfloat16) / F ** 0.5
        if weights == "fp8":
            gu, down = fp8.quantize_ref(gu), fp8.quantize_ref(down)
        x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        rows = {}
        for k in (1, 2, 4, 8):
            lays = [moe_routing.route_step(torch.randn(1, E + 1, device="cuda", dtype=torch.bfloat16) * 3, k, E)[3] for _ in range(ROUTINGS)]
            given = [lay.expand(E) for lay in lays]
            h = moe.expert_swiglu_triton(x, gu, lays[0], k, E, plan=plan)
            for name, ls in (("step", lays), ("given", given)):
                state = {"i": 0}

                def rotating(fn):
                    def call():
                        fn(ls[state["i"] % ROUTINGS])
                        state["i"] += 1
                    return call
                for kind, fn in (("swiglu", lambda lay: moe.expert_swiglu_triton(x, gu, lay, k, E, plan=plan)),
                                 ("down", lambda lay: moe.expert_down_triton(h, down, lay, E, plan=plan))):
                    same = timed(lambda: fn(ls[0]))
                    fresh = timed(rotating(fn))
                    rows.setdefault((kind, name, "same"), []).append(same)
                    rows.setdefault((kind, name, "fresh"), []).append(fresh)
        for (kind, name, reuse), ts in rows.items():
            slope = (ts[-1] - ts[0]) / 7
            print(f"{weights:>4} {kind:>6} layout {name:>5} weights {reuse:>5}: "
                  + " / ".join(f"{t:5.1f}" for t in ts) + f"   a further expert {slope:4.2f}, intercept {ts[0] - slope:5.1f}")
    t_launch = timed(lambda: torch.add(x, 1))
    print(f"an elementwise op on one row in the same graph: {t_launch:.1f} us")


if __name__ == "__main__":
    main()
