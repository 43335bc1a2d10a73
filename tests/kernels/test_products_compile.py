"""The few-row products over bf16 and FP8 weights (kernels/matvec.py, matvec_parts.py) and decode's
attention (kernels/attention.py) through Triton's whole pipeline to a cubin, on a machine without a
GPU, on the tiles the engine takes on each target (ProductPlan.shared_memory: an RTX 3090 or 4090,
an A10 or an L4 gives a program 99 KB, an A100 163 KB, an H100 227 KB): for sm_90, sm_80, sm_86 and
sm_89 (FP8 from sm_89), each within the target's shared memory, nothing of Hopper's below it. The
4-bit products have their own such test (test_int4_compile.py), the chunked GDN too
(test_gdn_chunk_compile.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mtpchat

COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from mtpchat.kernels import attention, matvec, matvec_parts
from mtpchat.kernels.fp8 import fp8_run, widen_group
from mtpchat.kernels.plan import ProductPlan

try:
    from triton.backends.nvidia.compiler import get_ptxas
    get_ptxas(80).path
except Exception as e:                      # Triton's own lookup: TRITON_PTXAS_PATH, its bundled ptxas
    print("NO PTXAS", repr(e))
    sys.exit(0)

SHARED_MEMORY = {90: 232448, 80: 166912, 86: 101376, 89: 101376}    # bytes a block may take, per target
TYPES = dict(x="*bf16", w="*bf16", sw="*fp32", y="*bf16", ws="*fp32", count="*i32", ss="*fp32", r="*bf16",
             nw="*bf16", xn="*bf16", h="*bf16", eps="fp32", q="*bf16", k_cache="*bf16", v_cache="*bf16",
             start="*i64", ws_m="*fp32", ws_l="*fp32", ws_o="*fp32", scale="fp32")


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
        _, BN, BK, warps, stages = matvec_parts.split_config(5120, 17408, 2, plan)
        if fmt == "fp8":
            stages = plan.split_fp8_stages
        extra = dict(BITS=widen_group((cap // 10, cap % 10), warps, BN), **fp8_run(BK, True)) if fmt == "fp8" else {}
        yield f"{fmt} split", mp, dict(consts, BT=plan.rows, BN=BN, BK=BK, S=3, NORM=True, RESIDUAL=True, **extra), \
            dict(types, y="*fp32"), warps, stages
    first, split, BN, warps, stages = attention._config(32768, 2, 256, plan.shared_memory)
    yield "decode attention", attention._attn_split_kernel, dict(HQ=24, GROUP=6, D=256, BM=32, BN=BN, FIRST=first,
                                                                   SPLIT=split), {}, warps, stages


for cap in (90, 80, 86, 89):
    for name, fn, consts, types, warps, stages in launches(cap):
        c_ = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
        c_.update({a: v for a, v in dict(consts, PDL=cap >= 90).items() if a in fn.arg_names})
        sig = {a: "constexpr" if a in c_ else types.get(a, TYPES.get(a, "i32")) for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if a not in c_ and a not in ("T", "eps", "scale") and sig[a] != "fp32"}
        what = f"{name} sm_{cap}"
        try:
            k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=c_, attrs=attrs),
                               target=GPUTarget("cuda", cap, 32), options=dict(num_warps=warps, num_stages=stages))
        except Exception as e:
            print("FAILED", what, "\n", str(e)[-1500:], file=sys.stderr)
            raise SystemExit(1)
        ptx = k.asm["ptx"]
        assert f".target sm_{cap}" in ptx and len(k.asm["cubin"]) > 0, what
        # what a launch would refuse (OutOfResources), which compiling alone lets through
        assert k.metadata.shared <= SHARED_MEMORY[cap], f"{what}: {k.metadata.shared} bytes of shared memory"
        if cap < 90:
            assert "wgmma" not in ptx and "setmaxnreg" not in ptx and "griddepcontrol" not in ptx, what
        print("ok", what, k.metadata.shared)
"""


def test_products_compile_within_each_targets_shared_memory():
    """In a process of its own: this one may run Triton's interpreter, whose kernels never compile.
    The child finds the package where this process found it and ptxas as Triton does; only where
    there is none at all it skips."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(mtpchat.__file__).parent.parent)] + [p for p in sys.path if p])
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    child = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=1500)
    if child.stdout.startswith("NO PTXAS"):
        pytest.skip(f"Triton finds no ptxas to compile with: {child.stdout.strip()}")
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-4000:]
    # bf16: plain, SwiGLU, split and attention on 4 targets; FP8's three on sm_89 and sm_90
    assert child.stdout.count("ok ") == 4 * 4 + 3 * 2, child.stdout[-2000:]
