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
from types import SimpleNamespace

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


# Triton's pipeline gives sm_89 the PTX it gives sm_86 for the same kernel, the .target line aside,
# on every path these tests compile but FP8's (sm_86 has none). Its MLIR passes are what a
# compilation costs (some 3-5 s a kernel on one core, where ptxas takes 0.3), so a kernel this
# process compiled for sm_86 gets its sm_89 code from ptxas alone: of each kernel function, the
# first such pair in a process through Triton for both targets, their PTX checked to agree; its
# other specialisations assembled from sm_86's.
TWINS = {89: 86}
_compiled: dict = {}           # (cap, the kernel and its specialisation) -> what Triton compiled
_twins_agree: set = set()      # (target, kernel function) whose PTX this process has seen agree with the twin's


def _retarget(ptx: str, cap: int, twin: int) -> str:
    line = f".target sm_{twin}\n"
    assert ptx.count(line) == 1, "no single .target line in the PTX"
    return ptx.replace(line, f".target sm_{cap}\n")


def _assembled(ptx: str, cap: int, warps: int, stages: int, what: str):
    """ptx assembled for sm_<cap> by ptxas as Triton assembles it (its backend's make_cubin, with
    its options): a stand-in for the compiled kernel, with the PTX, the cubin and the metadata."""
    import triton
    from triton.backends.compiler import GPUTarget
    backend = triton.compiler.make_backend(GPUTarget("cuda", cap, 32))
    options = backend.parse_options(dict(num_warps=warps, num_stages=stages))
    try:
        cubin = backend.make_cubin(ptx, {}, options, cap)
    except Exception as e:
        print("FAILED", what, "\n", str(e)[-1500:], file=sys.stderr)
        raise SystemExit(1)
    return cubin


def compile_checked(fn, constexprs: dict, signature: dict, cap: int, warps: int, stages: int, what: str,
                    aligned=None):
    """fn compiled for sm_<cap> with these constexprs (theirs filled in from fn's defaults, then
    only those fn takes) and the types of its other arguments; `aligned`: the arguments a launch
    marks 16-divisible (default: every pointer). Checked: a cubin for the target, within its shared
    memory, and below sm_90 nothing of Hopper's. For sm_89, where this process compiled the same
    kernel for sm_86 and has seen the two targets' PTX of its function agree (TWINS), sm_86's PTX
    assembled for sm_89. Prints "ok <what>"; on a compile error, the error and exit 1."""
    import triton
    from triton.backends.compiler import GPUTarget
    consts = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    consts.update({a: v for a, v in constexprs.items() if a in fn.arg_names})
    sig = {a: "constexpr" if a in consts else signature[a] for a in fn.arg_names}
    aligned = aligned if aligned is not None else {a for a in fn.arg_names if sig[a].startswith("*")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned and a not in consts}
    kernel = f"{fn.fn.__module__}.{fn.fn.__qualname__}" if hasattr(fn, "fn") else repr(fn)
    key = (kernel, repr(sorted(consts.items())), repr(sig), repr(sorted(aligned)), warps, stages)
    twin = _compiled.get((TWINS.get(cap), key))
    if twin is not None and (cap, kernel) in _twins_agree:
        ptx = _retarget(twin.asm["ptx"], cap, TWINS[cap])
        k = SimpleNamespace(asm={"ptx": ptx, "cubin": _assembled(ptx, cap, warps, stages, what)},
                            metadata=twin.metadata)
    else:
        try:
            k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", cap, 32), options=dict(num_warps=warps, num_stages=stages))
        except Exception as e:
            print("FAILED", what, "\n", str(e)[-1500:], file=sys.stderr)
            raise SystemExit(1)
        if cap in TWINS.values():
            _compiled[cap, key] = k
        if twin is not None:
            assert k.asm["ptx"] == _retarget(twin.asm["ptx"], cap, TWINS[cap]), \
                f"{what}: Triton's PTX for sm_{cap} is no longer sm_{TWINS[cap]}'s (compile_checks.TWINS)"
            _twins_agree.add((cap, kernel))
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
