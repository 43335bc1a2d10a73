"""The import graph of mtpchat: no circles, nothing imported upward, and the server without the app.

Layers, lowest first: mtpchat.kernels <- mtpchat.engine <- mtpchat.chat <- mtpchat.app / mtpchat.serve /
mtpchat.cli. A module imports its own layer and the ones below. Modules outside the named layers
(settings, errors, loader, remote, ...) only have to stay out of circles.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"mtpchat": ROOT / "mtpchat", "mtpchat.engine": ROOT / "engine", "mtpchat.kernels": ROOT / "kernels"}
LAYERS = {"mtpchat.kernels": 0, "mtpchat.engine": 1, "mtpchat.chat": 2,
          "mtpchat.app": 3, "mtpchat.serve": 3, "mtpchat.serve_request": 3, "mtpchat.cli": 3}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found.setdefault(name, path)     # mtpchat/ holds no engine/ or kernels/ of its own
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that `name` imports, anywhere in the file (lazy imports count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:      # `import mtpchat.engine.events as e` names a known module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def layer(name: str) -> int | None:
    hits = [(len(p), n) for p, n in LAYERS.items() if name == p or name.startswith(p + ".")]
    return max(hits)[1] if hits else None


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                on.discard(w)
                group.append(w)
            on.discard(v)
            if group:
                out.append(sorted(group + [v]))
    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    g = graph()
    # known edges, so a parser that reads nothing cannot pass the tests below
    assert "mtpchat.chat.reply" in g["mtpchat.serve"] and "mtpchat.chat.reply" in g["mtpchat.cli"]
    assert "mtpchat.engine.events" in g["mtpchat.chat.reply"]
    assert any(t.startswith("mtpchat.kernels") for m in g if m.startswith("mtpchat.engine") for t in g[m])


# circles known today, each to go: a fix makes its entry fail below until it is taken out
KNOWN: list[list[str]] = []


def test_no_import_circles():
    found = cycles(graph())
    assert [c for c in found if c not in KNOWN] == []
    assert [c for c in KNOWN if c not in found] == [], "a known circle is gone: take it out of KNOWN"


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_imports_upward():
    upward = [(m, t) for m, targets in graph().items() for t in sorted(targets)
              if layer(m) is not None and layer(t) is not None and layer(t) > layer(m)]
    assert upward == []


def test_serve_loads_neither_the_app_nor_textual():
    code = ("import sys, mtpchat.serve, mtpchat.serve_request\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'textual' or m.startswith('mtpchat.app')"
            " or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
