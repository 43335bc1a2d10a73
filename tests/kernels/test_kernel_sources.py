"""What the interpreter lets pass and the GPU's compiler refuses: a Triton kernel that reads a
module's plain global (an int such as fp8.BLOCK) runs under TRITON_INTERPRET=1 and fails to
compile on a GPU. Every name a kernel reads must be its own (a parameter, a local), a function,
a module, a builtin, or a global made with tl.constexpr."""
from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil

import pytest

import mtpchat.kernels
from mtpchat.kernels._triton import tl

MODULES = sorted(m.name for m in pkgutil.iter_modules(mtpchat.kernels.__path__))


def _jit_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def plain_globals(module) -> list[str]:
    """`kernel: NAME` for each plain global a jitted function of `module` reads."""
    with open(module.__file__) as f:
        tree = ast.parse(f.read())
    found = []
    for fn in _jit_functions(tree):
        own = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        own |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(fn):
            if not (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)) or n.id in own or hasattr(builtins, n.id):
                continue
            value = getattr(module, n.id, None)
            if value is None or not (callable(value) or isinstance(value, tl.constexpr)
                                     or type(value).__name__ == "module"):
                found.append(f"{fn.name}: {n.id}")
    return sorted(set(found))


@pytest.mark.parametrize("name", MODULES)
def test_kernels_read_no_plain_globals(name):
    module = importlib.import_module(f"mtpchat.kernels.{name}")
    assert plain_globals(module) == [], "pass these as tl.constexpr arguments"


def test_the_check_finds_a_plain_global(tmp_path, monkeypatch):
    (tmp_path / "plain_global_kernel.py").write_text(
        "from mtpchat.kernels._triton import tl, triton\n"
        "WIDTH = 128\n"
        "@triton.jit\n"
        "def _k(x, N: tl.constexpr):\n"
        "    o = tl.arange(0, N) + WIDTH\n"
        "    tl.store(x + o, o)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plain_globals(importlib.import_module("plain_global_kernel")) == ["_k: WIDTH"]
