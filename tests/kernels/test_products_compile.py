"""The few-row products over bf16 and FP8 weights (kernels/matvec.py, matvec_parts.py), the MoE
experts over them (kernels/moe.py; a step's over the layout the plan takes, routed_layout's, and
over the other on sm_90), decode's and prefill's attention (kernels/attention.py, attention_chunk.py) and
prefill's FP8 product where cuBLAS does not serve it (kernels/fp8_gemm.py), and the plain product
with a step's conv in it (kernels/conv.py ConvStep), through Triton's
whole pipeline to a cubin, on a machine without a GPU, on the tiles the engine takes on each target
(ProductPlan.shared_memory: an RTX 3090 or 4090, an A10, an L4 or an L40S gives a program 99 KB,
an A100 163 KB, an H100 227 KB): for sm_90, sm_80, sm_86 and sm_89 (FP8 from sm_89), each within
the target's shared memory, nothing of Hopper's below it. The 4-bit products have their own such
test (test_int4_compile.py), the chunked GDN too (test_gdn_chunk_compile.py)."""
from __future__ import annotations

from compile_checks import run_children

COMPILE = r"""
from compile_checks import SHARED_MEMORY, compile_checked, ptxas_or_exit
from mtpchat.kernels import attention, attention_chunk, fp8_gemm, matvec, matvec_parts, moe, moe_layout
from mtpchat.kernels.fp8 import fp8_run, widen_group
from mtpchat.kernels.moe_layout import STEP_PAIRS, STEP_ROWS
from mtpchat.kernels.plan import ProductPlan

ptxas_or_exit()
TYPES = dict(x="*bf16", w="*bf16", sw="*fp32", y="*bf16", ws="*fp32", count="*i32", ss="*fp32", r="*bf16",
             nw="*bf16", xn="*bf16", h="*bf16", eps="fp32", q="*bf16", k_cache="*bf16", v_cache="*bf16",
             start="*i64", ws_m="*fp32", ws_l="*fp32", ws_o="*fp32", scale="fp32", w2="*bf16", ws2="*fp32",
             expert="*i32", pairs="*i32", reads="*i32", hin="*bf16")


def launches(cap):
    # (name, kernel, constexprs, types beside TYPES, warps, stages) as the engine launches them for
    # the 27B's shapes on a device of this target's shared memory
    plan = ProductPlan(programs=132, shared_memory=SHARED_MEMORY[cap])
    mv, mp = matvec._matvec_kernel, matvec_parts._matvec_parts_kernel
    formats = [("bf16", 2, dict(FP8=False, BITS=0), {})]
    if cap >= 89:
        formats.append(("fp8", 1, dict(FP8=True), {"w": "*fp8e4nv"}))
    for fmt, itemsize, consts, types in formats:
        for name, (N, K), swiglu, normed in (("plain", (16384, 5120), False, False),
                                             ("swiglu", (17408, 5120), True, True)):
            BN, BK, warps, stages = matvec.tiles(N, K, itemsize, swiglu, fmt == "fp8", plan)
            extra = dict(BITS=widen_group((cap // 10, cap % 10), warps, BN), **fp8_run(BK, True)) \
                if fmt == "fp8" else {}
            yield f"{fmt} {name}", mv, dict(consts, BT=plan.rows, BN=BN, BK=BK, NBP=8 if normed else 0, SWIGLU=swiglu,
                                            SPLIT=normed, **extra), types, warps, stages
            if not swiglu:      # the GDN in_proj with a verify's conv (conv.ConvStep), its last wave split
                yield f"{fmt} {name} with its conv", mv, \
                    dict(consts, BT=plan.rows, BN=BN, BK=BK, NBP=0, SWIGLU=False, SPLIT=True, CK=4, CLIVE=True, **extra), \
                    dict(types, cbuf="*bf16", coff="*i64", clive="*i64", cw="*bf16"), warps, stages
        _, BN, BK, warps, stages = matvec_parts.split_config(5120, 17408, 2, plan)
        if fmt == "fp8":
            stages = plan.split_fp8_stages
        extra = dict(BITS=widen_group((cap // 10, cap % 10), warps, BN), **fp8_run(BK, True)) if fmt == "fp8" else {}
        yield f"{fmt} split", mp, dict(consts, BT=plan.rows, BN=BN, BK=BK, S=3, NORM=True, RESIDUAL=True, **extra), \
            dict(types, y="*fp32"), warps, stages
        # the MoE experts (the 35B-A3B's: gate|up 1024 x 2048, down 2048 x 512) in a step, with the
        # shared expert, and in a prefill
        for step in (True, False):
            # a step's layout as the plan has it (routed_layout: written by the routing kernel)
            lay = dict(BM=STEP_ROWS, STEP=True, BP=STEP_PAIRS, LAID=plan.routed_layout) if step else \
                dict(BM=moe_layout.PREFILL_ROWS, STEP=False, BP=16)
            for product, fn in (("swiglu", moe._swiglu_kernel), ("down", moe._down_kernel)):
                BN, BK, warps, stages = moe.tiles(product, step, fmt == "fp8", 2, plan)
                extra = dict(BITS=widen_group((cap // 10, cap % 10), warps, BN), **fp8_run(BK, True)) \
                    if fmt == "fp8" else {}
                if product == "swiglu":
                    extra.update(TOPK=8, COUNT=step, STACKED=step and plan.expert_stacked)
                yield f"{fmt} expert {product} step={step}", fn, \
                    dict(consts, BN=BN, BK=BK, SHARED=step, **lay, **extra), \
                    dict(types, w2=types.get("w", "*bf16"), y="*fp32"), warps, stages
                if step and cap >= 90:      # the other layout, which only a benchmark's plan names
                    yield f"{fmt} expert {product} step={step} laid={not plan.routed_layout}", fn, \
                        dict(consts, BN=BN, BK=BK, SHARED=step, **dict(lay, LAID=not plan.routed_layout), **extra), \
                        dict(types, w2=types.get("w", "*bf16"), y="*fp32"), warps, stages
    first, split, BN, warps, stages = attention._config(32768, 2, 256, plan)
    yield "decode attention", attention._attn_split_kernel, dict(HQ=24, GROUP=6, D=256, BM=32, BN=BN, FIRST=first,
                                                                   SPLIT=split), {}, warps, stages
    if cap >= 89:     # prefill's FP8 product where cuBLAS does not serve: the wide tile and the few-row ones
        for tname, t in (("wide", fp8_gemm.WIDE), ("small", fp8_gemm.SMALL), ("small 16", fp8_gemm.gemm_tiles(16, fp8_gemm.SMALL, 16))):
            yield f"fp8 gemm {tname}", fp8_gemm._gemm_kernel, dict(BM=t.BM, BN=t.BN, BK=fp8_gemm.BK,
                                                                    GROUP_M=fp8_gemm.GROUP_M), \
                dict(a="*fp8e4nv", a_s="*fp32", b="*fp8e4nv", b_s="*fp32"), t.warps, t.stages
    BM, BN, warps, stages = attention_chunk.prefill_attention_config(256, 2, plan)
    yield "prefill attention", attention_chunk._prefill_attn_kernel, dict(GROUP=6, D=256, BD=256, BM=BM, BN=BN), \
        dict(k="*bf16", v="*bf16", o="*bf16", scale2="fp32"), warps, stages


for cap in (90, 80, 86, 89):
    for name, fn, consts, types, warps, stages in launches(cap):
        consts = dict(consts, PDL=cap >= 90)
        sig = {a: types.get(a, TYPES.get(a, "i32")) for a in fn.arg_names if a not in consts}
        # as a launch specialises them: pointers, shapes and strides 16-divisible (T, eps, scale aside)
        aligned = {a for a in sig if a not in ("T", "n", "M", "eps", "scale") and sig[a] != "fp32"}
        compile_checked(fn, consts, sig, cap, warps, stages, f"{name} sm_{cap}", aligned)
"""


def test_products_compile_within_each_targets_shared_memory():
    """In a process of its own (compile_checks.run_children): this one may run Triton's interpreter."""
    stdout = run_children(COMPILE)
    # bf16: plain (alone and with a conv), SwiGLU, split, 4 expert kernels, decode and prefill
    # attention on 4 targets; FP8's 8 and prefill's FP8 product on 3 tiles on sm_89 and sm_90; a
    # step's 2 expert kernels over the other MoE layout, bf16 and FP8, on sm_90
    assert stdout.count("ok ") == 10 * 4 + (8 + 3) * 2 + 2 * 2, stdout[-2000:]
