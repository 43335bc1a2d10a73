"""Times the 27B's 4-bit interleaved products (in_proj, MLP gate|up, out_proj, MLP down) at T = 1 and
4 under whichever package is first on sys.path, and saves their outputs to /tmp/out_TAG.pt: a code
variant of the kernels against the package as it is, one process each, alternated on one GPU, the
outputs compared bit for bit afterwards.

    cd tests/bench && PYTHONPATH=SITE_A python3 probe_x_tile.py a && PYTHONPATH=SITE_B python3 probe_x_tile.py b

or a plan's product fields against the defaults, in one process or alternated:

    cd tests/bench && python3 probe_x_tile.py base && python3 probe_x_tile.py rows16 int4_rows=16
    cd tests/bench && python3 probe_x_tile.py flat "tile.swiglu=(32, 512, 2, 1)"

(2026-11-27: an interleaved group's x loaded as one tile, and variants of the interleaved dot,
docs/PERFORMANCE.md.)"""
import ast
import dataclasses
import sys
import torch
from graph_timing import graph_time
from step_plans import int4_tiles_of, tile_arguments
from mtpchat.kernels import int4, matvec, matvec_parts
from mtpchat.kernels.plan import default_products

torch.manual_seed(0)
tag = sys.argv[1]
# tile.PRODUCT=(BN, BK, warps, stages): that product's 4-bit tile (ProductPlan.int4_tiles), the rest measured
tiles, fields = tile_arguments(sys.argv[2:])
plan = dataclasses.replace(default_products("cuda"), **{k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in fields)},
                           **({"int4_tiles": int4_tiles_of(tiles)} if tiles else {}))
out = {}
SHAPES = [("in_proj", 16384, 5120, "plain"), ("gate_up", 34816, 5120, "swiglu"), ("out_proj", 5120, 6144, "split"),
          ("down", 5120, 17408, "split")]
run = {"plain": lambda x, w: matvec.matvec(x, w, plan=plan), "swiglu": lambda x, w: matvec.matvec_swiglu(x, w, plan),
       "split": lambda x, w: matvec_parts.matvec_parts(x, w, plan)}
with torch.inference_mode():
    for name, N, K, kind in SHAPES:
        q = int4.quantize_ref(torch.randn(N, K, device="cuda") / K ** 0.5)
        copies = max(2, -(-160 * 2 ** 20 // q.nbytes()))
        ws = [int4.interleave_ref(q)] + [int4.interleave_ref(int4.quantize_ref(torch.randn(N, K, device="cuda"))) for _ in range(copies - 1)]
        for T in (1, 4):
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            f = run[kind]
            out[f"{name} {T}"] = f(x, ws[0]).cpu()
            t = min(graph_time(lambda i: f(x, ws[i % copies]), copies) for _ in range(3))
            print(f"{tag} {name} T={T}: {t:.2f} us", flush=True)
torch.save(out, f"/tmp/out_{tag}.pt")
