"""Every product kernel over 4-bit weights (kernels/int4.py) through Triton's whole pipeline to a
cubin, on a machine without a GPU: for Hopper (sm_90, with PDL) and for Ampere and Ada (sm_80,
sm_86, sm_89: no instruction of Hopper's on the way, the dots on mma.sync). The interpreter runs
the other kernel tests here and never compiles: a kernel can pass them all and still not compile
(a branch the interpreter takes in Python that Triton must type, a None among the values a
function returns). The few-row products (plain, SwiGLU, split over K, a Normed input), the split
parts with and without the norm, the MoE expert products (SwiGLU and down, a step's layout with
the shared expert and a prefill's without, on the tiles the engine takes for them), prefill's
products (the fused form's, and the few-row kernel's for 64 rows: matvec.matvec_prefill), each with
zeros and perm and with neither, in the unpack form the engine takes for it on every target and in
the plan's other forms (ProductPlan.int4_form) for Hopper (the pairs form's inline assembly
assembled for each target), each within the target's shared memory; over interleaved weights, the
products and experts on their own tiles; and with float32 rows on a 99 KB GPU, where the widened
weights take shared memory too."""
from __future__ import annotations

import os

from compile_checks import run_children

COMPILE = r"""
import dataclasses
import os
import torch
from compile_checks import SHARED_MEMORY, compile_checked, ptxas_or_exit
from mtpchat.kernels import int4, int4_gemm, matvec, matvec_parts, moe, moe_layout
from mtpchat.kernels.moe_layout import STEP_PAIRS, STEP_ROWS
from mtpchat.kernels.plan import ProductPlan

ptxas_or_exit()

POINTERS = dict(x="*bf16", w="*i32", sw="*fp16", ws="*fp16", w2="*i32", ws2="*fp16", y="*bf16", count="*i32",
                ss="*fp32", zw="*u8", zw2="*u8", perm="*i32", perm2="*i32", expert="*i32", pairs="*i32",
                reads="*i32", h="*bf16", hin="*bf16", r="*bf16", nw="*bf16", xn="*bf16", eps="fp32")


# this process compiles every SHARDS-th compilation from SHARD on (the test runs one process a core),
# an sm_89 one in the process of the sm_86 one before it (compile_checks.TWINS: its code from it)
SHARD, SHARDS = map(int, os.environ.get("COMPILE_SHARD", "0/1").split("/"))
_job, _mine = -1, False


def mine(cap=None):
    global _job, _mine
    if cap != 89:
        _job += 1
        _mine = _job % SHARDS == SHARD
    return _mine


def aligned(fn, consts, sig):
    # as a launch specialises them: pointers 16-byte aligned, the shapes and strides multiples of
    # 16 (the rows' count T, the pairs' P and eps aside); with these hints Triton pipelines x's
    # loads through shared memory, as on the GPU
    return {a for a in fn.arg_names if a not in consts and a not in ("T", "P", "eps") and sig[a] != "fp32"}


def constexprs(fn, given):
    # what a launch gives fn's constexpr parameters: their defaults, then `given` (those fn takes)
    out = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    return {**out, **{a: v for a, v in given.items() if a in fn.arg_names}}


def variants():
    # (name, kernel, its constexprs, pointer types other than POINTERS'[, (warps, stages)]); G 128 and BK 256: two
    # sub-tiles a tile (both forms take them); the "slices" form needs sub-tiles of 128 columns
    i4 = dict(G=128, BG=128, FP8=False, BITS=0)
    mv = matvec._matvec_kernel
    BT = ProductPlan(programs=132).int4_rows
    # the few-row products on the tiles the engine takes (int4.measured), and on others
    (BN, BK, warps, stages), _ = int4.measured("swiglu", 17408, 5120)
    yield "matvec swiglu split normed", mv, dict(BT=BT, BN=BN, BK=BK, NBP=8, SWIGLU=True, SPLIT=True, **i4), \
        {"ws": "*fp32"}, (warps, stages)
    yield "matvec swiglu 32 x 256", mv, dict(BT=16, BN=32, BK=256, NBP=8, SWIGLU=True, SPLIT=True, **i4), {"ws": "*fp32"}
    (BN, BK, warps, stages), _ = int4.measured("plain", 16384, 5120)
    yield "matvec plain", mv, dict(BT=BT, BN=BN, BK=BK, NBP=0, SWIGLU=False, SPLIT=False, **i4), {"ws": "*fp32"}, \
        (warps, stages)
    mp = matvec_parts._matvec_parts_kernel
    (BN, BK, warps, stages), _ = int4.measured("split", 5120, 17408)
    for norm in (True, False):
        yield f"parts norm={norm}", mp, dict(BT=BT, BN=BN, BK=BK, S=3, NORM=norm, RESIDUAL=norm, **i4), {"y": "*fp32"}, \
            (warps, stages)
    yield "parts 64 x 256", mp, dict(BT=16, BN=64, BK=256, S=3, NORM=True, RESIDUAL=True, **i4), {"y": "*fp32"}
    # a step with the shared expert, a prefill without over blocks of 64 and of 16 pairs (each on its tiles)
    for step, shared, bm in ((True, True, STEP_ROWS), (False, False, moe_layout.PREFILL_ROWS), (False, False, 16)):
        # the tiles the engine takes for the 35B-A3B's experts (gate|up 1024 x 2048, down 2048 x 512)
        # a step's layout as the plan has it (routed_layout: written by the routing kernel)
        lay = dict(BM=bm, STEP=True, BP=STEP_PAIRS, LAID=ProductPlan(programs=132).routed_layout) if step else \
            dict(BM=bm, STEP=False, BP=16)
        BN, BK, warps, stages = moe.tiles("swiglu", step, False, 2, None, (1024, 2048, 128), rows=bm)
        yield f"expert swiglu step={step} shared={shared} rows={bm}", moe._swiglu_kernel, dict(
            TOPK=8, BN=BN, BK=BK, COUNT=step, SHARED=shared, **lay, **i4), {}, (warps, stages)
        BN, BK, warps, stages = moe.tiles("down", step, False, 2, None, (2048, 512, 128), rows=bm)
        yield f"expert down step={step} shared={shared} rows={bm}", moe._down_kernel, dict(
            BN=BN, BK=BK, SHARED=shared, **lay, **i4), {"y": "*fp32"}, (warps, stages)
    yield "gemm", int4_gemm._gemm_kernel, dict(BM=64, BN=128, BK=128, G=128, BG=128), {}
    # a short prefill chunk's products in the few-row kernel (matvec.matvec_prefill), 64 rows
    BN, BK, warps, stages = ProductPlan(programs=132).int4_prefill_tile
    yield "matvec prefill 64 rows", mv, dict(BT=64, BN=BN, BK=BK, NBP=0, SWIGLU=False, SPLIT=True, **i4), \
        {"ws": "*fp32"}, (warps, stages)


# Each variant in the form the engine takes for its product (int4.measured, where the plan names
# none) compiles for all four targets with zeros and a perm, and without them for sm_86 (the
# smaller GPUs' shared memory); the plan's other forms, which only a benchmark's plan names, with
# zeros and a perm for sm_90. Some 100 compilations, and with the interleaved and float32 ones
# below some 170, most of sm_89's 29 sm_86's PTX assembled (compile_checks.TWINS): some 6 min
# of CPU from an empty cache (shared among the cores' processes), seconds from Triton's cache
# after. Typing errors such
# as a None returned or a branch compiled with the other format's tiles come before any target's
# code; the targets' own instructions and shared memory (each variant on its own tiles and layout:
# a prefill's experts take more than a step's) are checked on each.
PRODUCTS = {"matvec swiglu": "swiglu", "matvec plain": "plain", "matvec prefill": "plain", "parts": "split",
            "expert swiglu": "expert_swiglu", "expert down": "expert_down", "gemm": "gemm"}


def product_of(name):
    return next(product for prefix, product in PRODUCTS.items() if name.startswith(prefix))


for name, fn, consts, types, *launch in variants():
    warps, stages = launch[0] if launch else (4, 3)
    default = int4.measured(product_of(name), 5120, 5120)[1]
    for form in int4.FORMS:
        for extra in ({}, dict(zw=None, perm=None, zw2=None, perm2=None)):
            if extra and form != default:
                continue
            caps = ((86,) if extra else (90, 80, 86, 89)) if form == default else (90,)
            c_ = dict(consts, UNPACK=int4.FORMS.index(form), **extra)
            for cap in caps:
                if not mine(cap):
                    continue
                c_["PDL"] = cap >= 90
                c_ = constexprs(fn, c_)
                sig = {a: types.get(a, POINTERS.get(a, "i32")) for a in fn.arg_names if a not in c_}
                k = compile_checked(fn, c_, sig, cap, warps, stages, f"{name} {form} zeros/perm={not extra} sm_{cap}",
                                    aligned(fn, c_, sig))
                assert cap >= 90 or "mma.sync" in k.asm["ptx"], name

# interleaved weights (int16 half-words, their own form) in the few-row products, the experts'
# (a step with the shared expert) and prefill's dequantize kernel, on the engine's tiles, for every target
il = dict(G=128, BG=128, FP8=False, BITS=0, UNPACK=int4.INTERLEAVED_ASM, zw=None, perm=None)
BT = ProductPlan(programs=132).int4_rows
(BN, BK, warps, stages), _ = int4.measured("plain", 16384, 5120, True)
(SN, SK, swarps, sstages), _ = int4.measured("swiglu", 17408, 5120, True)
(PS, PN, PK, pwarps, pstages), _ = int4.measured("split", 5120, 17408, True)     # the 27B's down: with its parts
(QN, QK, qwarps, qstages) = ProductPlan(programs=132).int4_prefill_tile           # a short prefill's (matvec_prefill)
step = dict(BM=STEP_ROWS, STEP=True, BP=STEP_PAIRS, SHARED=True, zw2=None, perm2=None,
            LAID=ProductPlan(programs=132).routed_layout)
(EN, EK, ewarps, estages) = moe.tiles("swiglu", True, False, 2, None, (1024, 2048, 128), True)
(DN, DK, dwarps, dstages) = moe.tiles("down", True, False, 2, None, (2048, 512, 128), True)
i16 = {"w2": "*i16"}
# a prefill's expert products over blocks of 16, 32 and 64 pairs, each on its tiles (moe.tiles)
prefill = []
for bm in (16, 32, moe_layout.PREFILL_ROWS):
    lay = dict(BM=bm, STEP=False, BP=16, SHARED=True, zw2=None, perm2=None)
    (FN, FK, fwarps, fstages) = moe.tiles("swiglu", False, False, 2, None, (1024, 2048, 128), True, bm)
    prefill.append((f"expert swiglu prefill {bm}", moe._swiglu_kernel,
                    dict(TOPK=9, BN=FN, BK=FK, COUNT=False, STACKED=False, **lay, **il), i16, (fwarps, fstages)))
    (FN, FK, fwarps, fstages) = moe.tiles("down", False, False, 2, None, (2048, 512, 128), True, bm)
    prefill.append((f"expert down prefill {bm}", moe._down_kernel, dict(BN=FN, BK=FK, **lay, **il), dict(i16, y="*fp32"),
                    (fwarps, fstages)))
inter = prefill + [("plain", matvec._matvec_kernel, dict(BT=BT, BN=BN, BK=BK, NBP=8, SWIGLU=False, SPLIT=True, **il), {"ws": "*fp32"}, (warps, stages)),
         ("swiglu", matvec._matvec_kernel, dict(BT=BT, BN=SN, BK=SK, NBP=0, SWIGLU=True, SPLIT=False, **il), {"ws": "*fp32"}, (swarps, sstages)),
         # an H200's plan takes the SwiGLU 3 deep (ProductPlan.int4_glu_tile)
         ("swiglu h200", matvec._matvec_kernel, dict(BT=BT, BN=32, BK=512, NBP=0, SWIGLU=True, SPLIT=False, **il), {"ws": "*fp32"}, (2, 3)),
         ("parts", matvec_parts._matvec_parts_kernel, dict(BT=BT, BN=PN, BK=PK, S=PS, NORM=True, RESIDUAL=True, **il), {"y": "*fp32"}, (pwarps, pstages)),
         ("expert swiglu", moe._swiglu_kernel, dict(TOPK=8, BN=EN, BK=EK, COUNT=True, STACKED=True, **step, **il), i16,
          (ewarps, estages)),
         ("expert down", moe._down_kernel, dict(BN=DN, BK=DK, **step, **il), dict(i16, y="*fp32"), (dwarps, dstages)),
         # the SwiGLU's gate and up tiles apart (ProductPlan.int4_expert_stacked off), on their own tile
         ("expert swiglu apart", moe._swiglu_kernel, dict(TOPK=8, BN=64, BK=256, COUNT=True, STACKED=False, **step, **il),
          i16, (4, 4)),
         ("prefill", matvec._matvec_kernel, dict(BT=64, BN=QN, BK=QK, NBP=0, SWIGLU=False, SPLIT=True, **il),
          {"ws": "*fp32"}, (qwarps, qstages)),
         ("dequantize", int4_gemm._dequantize_kernel, dict(G=128, BN=16, BK=1024, zw=None, INTERLEAVED=True), {"out": "*bf16"}, (4, 1))]
for name, fn, consts, types, (warps, stages) in inter:
    for cap in (90, 80, 86, 89):
        if not mine(cap):
            continue
        c_ = constexprs(fn, dict(consts, PDL=cap >= 90))
        sig = {a: types.get(a, dict(POINTERS, w="*i16").get(a, "i32")) for a in fn.arg_names if a not in c_}
        what = f"interleaved {name} sm_{cap}"
        k = compile_checked(fn, c_, sig, cap, warps, stages, what, aligned(fn, c_, sig))
        assert name == "dequantize" or "lop3.b32" in k.asm["ptx"], what
        # the few-row products' weights stream through shared memory in 16-byte copies (cp.async.cg):
        # a split's K start known only as a multiple of 16 weights (8 bytes of half-words) once gave
        # 8-byte copies, or none at all (matvec.py, matvec_parts.py: tl.multiple_of)
        assert name not in ("plain", "swiglu", "parts") or "cp.async.cg.shared.global" in k.asm["ptx"], \
            f"{what}: its weights load in copies of under 16 bytes"

# float32 rows on a 99 KB GPU (sm_86, as sm_89), where a dot's weights widened to float32 sit in shared
# memory beside the buffers (matvec.int4_widened): a prefill's experts over blocks of 16, 32 and 64
# pairs and its few-row products of 16, 32 and 64 rows on the tiles the engine takes there, and the
# step's products on theirs
small = ProductPlan(programs=84, shared_memory=SHARED_MEMORY[86])
f32 = {"x": "*fp32", "y": "*fp32", "h": "*fp32", "hin": "*fp32", "r": "*fp32", "nw": "*fp32", "xn": "*fp32"}
w = int4.GroupInt4(torch.zeros(1, 5120 // 4, dtype=torch.int16), torch.ones(1, 5120 // 128, dtype=torch.float16))
float32 = []
for bm in (16, 32, moe_layout.PREFILL_ROWS):
    lay = dict(BM=bm, STEP=False, BP=16, SHARED=True, zw2=None, perm2=None)
    (FN, FK, fwarps, fstages) = moe.tiles("swiglu", False, False, 4, small, (1024, 2048, 128), True, bm)
    float32.append((f"expert swiglu prefill {bm}", moe._swiglu_kernel,
                    dict(TOPK=9, BN=FN, BK=FK, COUNT=False, STACKED=False, **lay, **il), dict(i16, **f32), (fwarps, fstages)))
    (FN, FK, fwarps, fstages) = moe.tiles("down", False, False, 4, small, (2048, 512, 128), True, bm)
    float32.append((f"expert down prefill {bm}", moe._down_kernel, dict(BN=FN, BK=FK, **lay, **il), dict(i16, **f32),
                    (fwarps, fstages)))
    (QN, QK, qwarps, qstages) = matvec.prefill_tile(w, bm, 4, small)
    float32.append((f"prefill {bm} rows", matvec._matvec_kernel, dict(BT=bm, BN=QN, BK=QK, NBP=0, SWIGLU=False, SPLIT=True,
                                                                      **il), dict(f32, ws="*fp32"), (qwarps, qstages)))
float32 += [(name, fn, consts, dict(types, **f32), launch) for name, fn, consts, types, launch in inter
            if name in ("plain", "swiglu", "parts")]
for product, fn, shape in (("swiglu", moe._swiglu_kernel, (1024, 2048, 128)), ("down", moe._down_kernel, (2048, 512, 128))):
    (EN, EK, ewarps, estages) = moe.tiles(product, True, False, 4, small, shape, True)
    extra = dict(TOPK=8, COUNT=True, STACKED=True) if product == "swiglu" else {}
    float32.append((f"expert {product}", fn, dict(BN=EN, BK=EK, **extra, **step, **il), dict(i16, **f32), (ewarps, estages)))
(EN, EK, ewarps, estages) = moe.tiles("swiglu", True, False, 4, dataclasses.replace(small, int4_expert_stacked=False),
                                      (1024, 2048, 128), True)
float32.append(("expert swiglu apart", moe._swiglu_kernel, dict(TOPK=8, BN=EN, BK=EK, COUNT=True, STACKED=False, **step, **il),
                dict(i16, **f32), (ewarps, estages)))
for name, fn, consts, types, (warps, stages) in float32:
    for cap in (86,):                   # sm_89's shared memory and instructions on this path are sm_86's
        if not mine():
            continue
        c_ = constexprs(fn, dict(consts, PDL=False))
        sig = {a: types.get(a, dict(POINTERS, w="*i16").get(a, "i32")) for a in fn.arg_names if a not in c_}
        compile_checked(fn, c_, sig, cap, warps, stages, f"float32 {name} sm_{cap}", aligned(fn, c_, sig))
"""


def test_every_int4_kernel_compiles_for_hopper_ampere_and_ada():
    """In a process of its own: this one may run Triton's interpreter, whose kernels never compile.
    The children (one a core, each compiling its share) find the package where this process found it
    (then the rest of its sys.path: a checkout's top folder may hold an `mtpchat/` without its
    engine and kernels) and ptxas as Triton does (TRITON_PTXAS_PATH, else the one Triton ships); only where
    there is none at all it skips."""
    shards = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    stdout = run_children(COMPILE, shards, timeout=900)
    # 14 variants in natural words: the engine's form on 4 targets and without zeros and perm on 1,
    # the 2 other forms on sm_90
    assert stdout.count(" zeros/perm=") == 14 * (4 + 1 + 2), stdout[-2000:]
    assert stdout.count("ok ") == 14 * 7 + 15 * 4 + 15, stdout[-2000:]
    assert "pairs" in stdout and stdout.count("ok interleaved") == 15 * 4, stdout[-2000:]     # 15 kernels x 4 targets
    assert stdout.count("ok float32") == 15, stdout[-2000:]                                   # 15 kernels, sm_86
