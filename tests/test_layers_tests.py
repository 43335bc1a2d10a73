"""How the tests are laid out: no test module imports another (what they share lives in helpers,
mtp_support, serve_support, kernels/kernel_checks, app/apphelpers), and benchmarks and probes live
in tests/bench, apart from the tests."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (an import inside a test function counts too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_test_module_imports_another():
    wrong = [f"{path.relative_to(TESTS)} imports {name}"
             for path in sorted(TESTS.rglob("*.py"))
             for name in sorted(imported_modules(path)) if name.split(".")[-1].startswith("test_")]
    assert not wrong, "move what is shared into a helper module (tests/helpers.py):\n" + "\n".join(wrong)


def test_the_check_sees_an_import_of_a_test_module(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("import torch\n\ndef test_x():\n    from test_gpu_engine import prompts\n")
    assert imported_modules(sample) == {"torch", "test_gpu_engine"}


def test_benchmarks_and_probes_live_apart_from_the_tests():
    scripts = [p for p in TESTS.rglob("*.py") if p.name.startswith(("bench_", "probe_"))]
    assert scripts and all(p.parent == TESTS / "bench" for p in scripts), scripts
