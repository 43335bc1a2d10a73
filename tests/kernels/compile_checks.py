"""What the compile tests share (test_int4_compile.py, test_products_compile.py,
test_gdn_chunk_compile.py): a kernel through Triton's whole pipeline to a cubin for a GPU target on
a machine without one, checked as a launch would check it, and the child processes they compile in.

The interpreter, which runs the other kernel tests on a CPU, never compiles; so each compile test
runs a script of its own in child processes without TRITON_INTERPRET. The script imports this
module (the children get the parent's sys.path), calls `ptxas_or_exit()` first, then
`compile_checked` for each kernel, which prints "ok <what>" for the parent to count."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# bytes of shared memory a block may take, per target (what a launch refuses past: OutOfResources)
SHARED_MEMORY = {90: 232448, 80: 166912, 86: 101376, 89: 101376}


def ptxas_or_exit():
    """Exit the child quietly (its parent skips) where Triton finds no ptxas to compile with."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(80).path
    except Exception as e:                  # Triton's own lookup: TRITON_PTXAS_PATH, its bundled ptxas
        print("NO PTXAS", repr(e))
        sys.exit(0)


def compile_checked(fn, constexprs: dict, signature: dict, cap: int, warps: int, stages: int, what: str,
                    aligned=None):
    """fn compiled for sm_<cap> with these constexprs (theirs filled in from fn's defaults, then
    only those fn takes) and the types of its other arguments; `aligned`: the arguments a launch
    marks 16-divisible (default: every pointer). Checked: a cubin for the target, within its shared
    memory, and below sm_90 nothing of Hopper's. Prints "ok <what>"; on a compile error, the error
    and exit 1."""
    import triton
    from triton.backends.compiler import GPUTarget
    consts = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    consts.update({a: v for a, v in constexprs.items() if a in fn.arg_names})
    sig = {a: "constexpr" if a in consts else signature[a] for a in fn.arg_names}
    aligned = aligned if aligned is not None else {a for a in fn.arg_names if sig[a].startswith("*")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned and a not in consts}
    try:
        k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
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
    print("ok", what)
    return k


def run_children(script: str, shards: int = 1, timeout: int = 1500) -> str:
    """Run `script` in `shards` child processes (COMPILE_SHARD "i/n" tells each its share) without
    TRITON_INTERPRET, finding the package and this module where this process does; their output,
    joined. Skips where Triton finds no ptxas at all."""
    pytest.importorskip("triton")
    import mtpchat
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    home = str(Path(mtpchat.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([home, str(Path(__file__).parent)] + [p for p in sys.path if p])
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    children = [subprocess.Popen([sys.executable, "-c", script], env=dict(env, COMPILE_SHARD=f"{i}/{shards}"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(shards)]
    outputs = [child.communicate(timeout=timeout) for child in children]
    stdout = "".join(out for out, _ in outputs)
    if stdout.startswith("NO PTXAS"):
        pytest.skip(f"Triton finds no ptxas to compile with: {stdout.strip()}")
    for child, (out, err) in zip(children, outputs):
        assert child.returncode == 0, (out[-2000:] + err[-4000:])
    return stdout
