"""The chunked GDN's kernels (kernels/gdn_chunk.py) through Triton's whole pipeline to a cubin, on a
machine without a GPU, configured as chunk_triton configures them (gdn_chunk.chunk_config) for the
engine's plan (KernelPlan.chunk_*) and with the output by its own kernel for Hopper (sm_90) and for
Ampere and Ada (sm_80, sm_86, sm_89: the products on mma.sync, nothing of Hopper's); the plan's
other forms (the prep's products in tf32, the tf32 form) and a float32 model's for Hopper; each
within the target's shared memory on the tiles it takes there (a float32 model only where the
device is roomy: the others run it on the torch reference). The interpreter, which runs
test_gdn_chunk.py here, never compiles."""
from __future__ import annotations

from compile_checks import run_children

COMPILE = r"""
from compile_checks import SHARED_MEMORY, compile_checked, ptxas_or_exit
from mtpchat.engine.plan import KernelPlan
from mtpchat.kernels import gdn_chunk as g
from mtpchat.kernels.plan import ProductPlan

ptxas_or_exit()
SHAPE = dict(HV=48, GROUP=3, DK=128, DV=128, BDV=128, BC=64)        # the 27B's heads
plan = KernelPlan(products=ProductPlan(programs=132))
PLAN = (plan.chunk_fused_out, plan.chunk_solved, plan.chunk_terms, plan.chunk_products, plan.chunk_normed,
        plan.chunk_prep_products)
FORMS = {"plan": (g.plan_config(*PLAN), False),
         "plan unfused": (g.plan_config(False, *PLAN[1:]), False),
         "plan, tf32 prep": (g.plan_config(*PLAN[:5], "tf32"), False),
         "tf32": (g.plan_config(False, "float32", "float32", "tf32", False, "tf32"), False),
         "tf32 fused": (g.plan_config(True, "float32", "float32", "tf32", False, "tf32"), False),
         "float32 model": ({}, True)}


def launches(cfg):
    # (name, kernel, constexprs, warps, stages) as chunk_triton launches them under cfg
    dot, state_dot, fused = cfg["dot"], cfg["state_dot"] or cfg["dot"], cfg["fused_out"]
    flags = dict(FUSED=fused, NORMED=cfg["normed"])
    yield "prep", g._chunk_prep_kernel, dict(SB=16, NB=4, DOT=dot, **flags), cfg["prep_warps"], 3
    yield "scan", g._chunk_scan_kernel, dict(BV=cfg["scan_bv"], DOT=state_dot, **flags), cfg["scan_warps"], \
        cfg["scan_stages"]
    if not fused:
        yield "out", g._chunk_out_kernel, dict(BV=cfg["out_bv"], DOT=state_dot, NORMED=cfg["normed"]), \
            cfg["out_warps"], 3


def pointer(name, cfg, wide):
    # what passes between the kernels in cfg's dtypes; the model's tensors bf16 (a float32 model's float32)
    if name in ("ws_w", "ws_u", "ws_k"):
        return "*bf16" if cfg["solved"] == "bfloat16" else "*fp32"
    if name in ("ws_h", "ws_v", "ws_p", "ws_q"):
        return "*bf16" if cfg["terms"] == "bfloat16" else "*fp32"
    return "*fp32" if wide or name in ("ws_a", "ws_g", "state", "s_out") else "*bf16"


# the engine's forms (the plan's, unfused, a float32 model's) for every target; the others, which
# only a benchmark's plan names, for sm_90
ENGINE_FORMS = ("plan", "plan unfused", "float32 model")
for form, (config, wide) in FORMS.items():
    for cap in (90, 80, 86, 89) if form in ENGINE_FORMS else (90,):
        room = SHARED_MEMORY[cap] >= g.ROOMY
        if wide and not room:
            continue                        # chunk() takes the reference there
        cfg = g.chunk_config(config, wide, room)
        for name, fn, consts, warps, stages in launches(cfg):
            consts = {**SHAPE, **consts}
            sig = {a: "fp32" if a == "scale" else "i32" if a == "T" or a.startswith("s_") and a != "s_out" else
                   pointer(a, cfg, wide) for a in fn.arg_names if a not in consts}
            # as a launch specialises them: pointers, the heads' strides 16-divisible (T aside)
            aligned = {a for a in sig if a not in ("T", "scale")}
            k = compile_checked(fn, consts, sig, cap, warps, stages, f"{form}: {name} sm_{cap}", aligned)
            assert cap >= 90 or "mma.sync" in k.asm["ptx"], name
"""


def test_chunk_kernels_compile_for_hopper_ampere_and_ada():
    """In a process of its own (compile_checks.run_children): this one may run Triton's interpreter."""
    stdout = run_children(COMPILE)
    # plan 2 kernels and unfused 3 on 4 targets; tf32 prep 2, tf32 3, tf32 fused 2 and the float32 model's 3 on sm_90
    assert stdout.count("ok ") == (2 + 3) * 4 + (2 + 3 + 2) + 3, stdout[-2000:]
