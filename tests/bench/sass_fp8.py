"""The few-row FP8 products compiled for an H100 (sm_90) on a machine without a GPU: registers, shared
memory and the instruction mix of each, to read before spending GPU time.

    cd tests/bench && python3 sass_fp8.py

Use the Triton the GPU machine has (3.6 there: `pip install --target DIR triton==3.6.0` and put DIR
first on PYTHONPATH): with the pointers and the 16-divisible sizes marked as a launch marks them,
this gives the registers and shared memory the GPU's own compilation reports (on 2026-11-25, for
the plain FP8 product's tile of then, 64 x 128, 4 warps, 8 deep: 96 registers, 90,112 bytes).

What it showed (Triton 3.6): `.to(tl.bfloat16)` of e4m3 weights becomes, per pair, one e4m3x2 ->
f16x2 conversion, two scalar f16 -> bf16 conversions and a byte permute: 1.5 conversions an
element, on the units that convert (F2FP, F2F), where bf16 weights need none; probe_fp8_layout.py
--bits times the form that moves bits instead.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import probe_fp8_layout
from mtpchat.kernels import fp8, matvec, matvec_parts, moe
from mtpchat.kernels.plan import ProductPlan

H100 = ProductPlan(programs=132)     # the plan an H100 (132 SMs) gets: kernels/plan.py default_products
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
OPS = ["HGMMA", "HMMA", "LDGSTS", "LDS", "LDSM", "F2FP", "F2F", "PRMT", "LOP3", "SHF", "HMUL2", "IMAD", "BAR"]


def compile_sm90(fn, params: list[tuple[str, str]], consts: dict, aligned: set, warps: int, stages: int):
    """The kernel compiled for sm_90: params (name, type) in order, constexprs (the kernel's
    defaults for the parameters given neither), the names a launch would mark 16-divisible
    (pointers and sizes)."""
    consts = {p.name: p.default for p in fn.params if p.has_default and p.name not in dict(params)} | consts
    sig = dict(params) | {k: "constexpr" for k in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, _) in enumerate(params) if n in aligned}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def report(name: str, kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res).group(1)
    stack = re.search(r"STACK:(\d+)", res).group(1)
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    mix = " ".join(f"{op} {ops[op]}" for op in OPS if ops[op])
    return f"{name:<44} regs {regs:>3} stack {stack:>4} smem {kernel.metadata.shared:>6}  {mix}"


def ints(names: str) -> list[tuple[str, str]]:
    return [(n, "i32") for n in names.split()]


def widening(bits: bool, warps: int, BN: int) -> int:
    """The BITS constexpr fp8.widen_args gives on an H100 under H100's widen_group (0: as the tile suits)."""
    return (H100.widen_group or fp8.widen_group((9, 0), warps, BN)) if bits else 0


def production(bits: bool) -> list[tuple[str, object, list, dict, set, int, int]]:
    """(name, kernel, params, constexprs, aligned, warps, stages) of each few-row FP8 product at the
    tiles an H100's plan gives them (kernels/plan.py ProductPlan; kernels/matvec.py tiles,
    matvec_parts.py split_config, moe.py tiles), widening by conversion or by bits. Aligned: the
    arguments a launch at the 27B's and the 35B-A3B's shapes finds 16-divisible (without them
    Triton does not pipeline the split products' loads)."""
    out = []
    params = [("x", "*bf16"), ("w", "*fp8e4nv"), ("sw", "*fp32"), ("y", "*bf16"), ("ws", "*fp32"),
              ("count", "*i32"), ("ss", "*fp32")] + ints("T N K NB F KS S s_x s_w s_sw s_y s_ss") + [("eps", "fp32")]
    aligned = {"x", "w", "sw", "y", "ws", "count", "ss", "N", "K", "s_x", "s_w", "s_y"}
    for swiglu in (False, True):
        BN, BK, warps, stages = matvec.tiles(16384, 5120, 2, swiglu=swiglu, fp8=True, plan=H100)
        consts = dict(BT=16, BN=BN, BK=BK, NBP=0, SWIGLU=swiglu, SPLIT=False, FP8=True, PDL=True,
                      BITS=widening(bits, warps, BN), **fp8.fp8_run(BK, True))
        out.append((f"matvec{' swiglu' if swiglu else ''} {BN}x{BK} w{warps} s{stages}", matvec._matvec_kernel,
                    params, consts, aligned, warps, stages))
    params = [("x", "*bf16"), ("w", "*fp8e4nv"), ("sw", "*fp32"), ("y", "*fp32"), ("count", "*i32"), ("r", "*bf16"),
              ("nw", "*bf16"), ("xn", "*bf16"), ("h", "*bf16"), ("ss", "*fp32")] + \
        ints("T N K KS s_x s_w s_yp s_y s_r s_xn s_h s_ss s_sw")
    _, BN, BK, warps, _ = matvec_parts.split_config(5120, 17408, 2, H100)
    stages = H100.split_fp8_stages
    consts = dict(BT=16, BN=BN, BK=BK, S=3, NORM=True, FP8=True, PDL=True, BITS=widening(bits, warps, BN),
                  RESIDUAL=True)
    out.append((f"parts+norm {BN}x{BK} w{warps} s{stages}", matvec_parts._matvec_parts_kernel,
                params, consts, {n for n, _ in params} - {"T", "s_sw"}, warps, stages))
    BN, BK, warps, stages = moe.tiles("swiglu", True, True, plan=H100)
    params = [("x", "*bf16"), ("w", "*fp8e4nv"), ("ws", "*fp32"), ("w2", "*fp8e4nv"), ("ws2", "*fp32"),
              ("expert", "*i32"), ("pairs", "*i32"), ("reads", "*i64"), ("h", "*bf16")] + \
        ints("P E H F s_x s_h s_ws")
    consts = dict(TOPK=9, BM=16, BN=BN, BK=BK, STEP=True, BP=64, COUNT=True, SHARED=True, FP8=True, PDL=True,
                  BITS=widening(bits, warps, BN))
    out.append((f"moe swiglu step {BN}x{BK} w{warps} s{stages}", moe._swiglu_kernel, params, consts,
                {n for n, _ in params} - {"P"}, warps, stages))
    BN, BK, warps, stages = moe.tiles("down", True, True, plan=H100)
    params = [("hin", "*bf16"), ("w", "*fp8e4nv"), ("ws", "*fp32"), ("w2", "*fp8e4nv"), ("ws2", "*fp32"),
              ("expert", "*i32"), ("pairs", "*i32"), ("y", "*fp32")] + ints("P E H F s_h s_y s_ws")
    consts = dict(BM=16, BN=BN, BK=BK, STEP=True, BP=64, SHARED=True, FP8=True, PDL=True,
                  BITS=widening(bits, warps, BN))
    out.append((f"moe down step {BN}x{BK} w{warps} s{stages}", moe._down_kernel, params, consts,
                {n for n, _ in params} - {"P", "s_ws"}, warps, stages))
    return out


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"triton {triton.__version__}")
    for bits in (False, True):
        for name, fn, params, consts, aligned, warps, stages in production(bits):
            kernel = compile_sm90(fn, params, consts, aligned, warps, stages)
            form = f"bits x{consts['BITS']}" if bits else "cvt"
            print(report(f"{name} {form}", kernel))
    params = [("x", "*bf16"), ("w", "*fp8e4nv"), ("sw", "*fp32"), ("y", "*fp32"), ("T", "i32"), ("K", "i32"),
              ("s_sw", "i32")]
    for BN, warps, stages in ((64, 4, 8), (32, 2, 4)):
        for bits in (False, True):
            consts = dict(TILED=False, U=1, LOADS_ONLY=False, BN=BN, BK=128, BT=16, BITS=bits)
            k = compile_sm90(probe_fp8_layout._probe, params, consts, {"x", "w", "sw", "y", "K"}, warps, stages)
            print(report(f"probe {'bits' if bits else 'cvt'} {BN}x128 w{warps} s{stages}", k))


if __name__ == "__main__":
    main()
