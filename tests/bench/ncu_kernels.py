"""One decode row through the step kernels that run furthest from their floor, each launched a few
times eagerly, for Nsight Compute to read their stall reasons, issue rates and occupancy:

    cd tests/bench && ncu --clock-control none --kernel-name regex:'_swiglu_kernel|_matvec_parts_kernel|_matvec_kernel' \\
        --launch-skip 3 --launch-count 6 --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section SchedulerStats --section WarpStateStats python3 ncu_kernels.py

The stall reasons by name (cycles a warp waits per issued instruction, one line a launch):

    ncu --clock-control none --kernel-name regex:'_swiglu_kernel|_matvec_parts_kernel|_matvec_kernel' \\
        --launch-skip 0 --launch-count 20 \\
        --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio',gpu__time_duration.sum \\
        python3 ncu_kernels.py

Where in a kernel the waits sit (warp states sampled per SASS instruction; Triton keeps line info):

    ncu --clock-control none --set full --import-source yes --kernel-name regex:'_matvec_kernel' \
        --launch-skip 5 --launch-count 1 -o /tmp/int4-swiglu python3 ncu_kernels.py --int4
    ncu -i /tmp/int4-swiglu.ncu-rep --page source --csv --print-source sass > int4-swiglu-sass.csv

The kernels: the 35B-A3B's FP8 expert SwiGLU of a decode step (8 experts, the engine's default
stacked tile and the 64-column tile apart), the 27B's FP8 MLP down (split over K), and the 27B's
GDN in_proj under --weights int4 (interleaved). Run alone, it checks that each runs. With --int4,
the 27B's interleaved 4-bit products alone (GDN in_proj, MLP gate|up, MLP down in its parts), under
whichever package is first on the path (a variant of the kernels against the package as it is),
on other tiles with arguments such as "tile.swiglu=(32, 512, 2, 3)".
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from mtpchat.kernels import fp8, int4, matvec, matvec_parts, moe, moe_routing
from mtpchat.kernels.plan import default_products
from step_plans import int4_tiles_of, tile_arguments

E, F, H = 256, 512, 2048


def int4_products():
    # tile.PRODUCT=(BN, BK, warps, stages) arguments: that product's 4-bit tile (as probe_x_tile.py takes them)
    tiles, _ = tile_arguments(sys.argv[1:])
    plan = default_products("cuda")
    if tiles:
        plan = dataclasses.replace(plan, int4_tiles=int4_tiles_of(tiles))
    for N, K, run in ((16384, 5120, matvec.matvec), (2 * 17408, 5120, matvec.matvec_swiglu),
                      (5120, 17408, matvec_parts.matvec_parts)):
        w = int4.interleave_ref(int4.quantize_ref(torch.randn(N, K, device="cuda") / K ** 0.5))
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            run(x, w, plan=plan)
    torch.cuda.synchronize()
    print("ran: 27B int4 in_proj, gate|up, down in parts")


def main():
    if "--int4" in sys.argv:
        return int4_products()
    base = default_products("cuda")
    apart = dataclasses.replace(base, expert_stacked=False)
    gu = fp8.quantize_ref(torch.randn(E * 2 * F, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    _, _, _, lay = moe_routing.route_step(torch.randn(1, E + 1, device="cuda", dtype=torch.bfloat16) * 3, 8, E)
    down27 = fp8.quantize_ref(torch.randn(5120, 17408, device="cuda", dtype=torch.bfloat16) / 17408 ** 0.5)
    x27 = torch.randn(1, 17408, device="cuda", dtype=torch.bfloat16)
    in_proj = int4.interleave_ref(int4.quantize_ref(torch.randn(16384, 5120, device="cuda") / 5120 ** 0.5))
    x5 = torch.randn(1, 5120, device="cuda", dtype=torch.bfloat16)
    for plan in (base, apart):
        for _ in range(5):
            moe.expert_swiglu_triton(x, gu, lay, 8, E, plan=plan)
    for _ in range(5):
        matvec_parts.matvec_parts_triton(x27, down27, plan=base)
    for _ in range(5):
        matvec.matvec(x5, in_proj, plan=base)
    torch.cuda.synchronize()
    print("ran: expert SwiGLU stacked and apart, 27B FP8 down in parts, 27B int4 in_proj")


if __name__ == "__main__":
    main()
