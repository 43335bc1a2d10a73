"""The installed runtime holds inference only: the trainers, their corpora and the tiny checkpoint
writer live in tests/tools, which nothing in mtpchat.engine imports; the data the engine reads at
run time ships as package data."""
import fnmatch
import json
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import mtpchat.engine
from mtpchat.engine.draft_vocab import PIECES

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tests" / "tools"


def test_the_engine_package_holds_no_trainer():
    names = {m.name for m in pkgutil.iter_modules(mtpchat.engine.__path__)}
    assert {"engine", "model", "weights", "draft_vocab", "tokenizer"} <= names
    assert not {n for n in names if any(w in n for w in ("train", "demo", "corpus", "bpe", "tiny"))}, names
    for folder in mtpchat.engine.__path__:
        for source in Path(folder).glob("*.py"):
            text = source.read_text(encoding="utf-8")
            assert "BpeTrainer" not in text and "train_from_iterator" not in text, source


def test_importing_the_engine_imports_nothing_from_the_tools():
    """Every module of mtpchat.engine imported in a fresh interpreter that could find tests/tools:
    none of them comes from there."""
    code = f"""
import importlib, pkgutil, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import mtpchat.engine
for m in pkgutil.iter_modules(mtpchat.engine.__path__):
    importlib.import_module("mtpchat.engine." + m.name)
print([n for n, m in sys.modules.items() if n == "tools" or n.startswith("tools.")
       or {str(TOOLS)!r} in str(getattr(m, "__file__", None) or "")])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_the_runtime_data_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["mtpchat.engine"]
    for name in (PIECES.name, "chat_template.jinja"):
        assert any(fnmatch.fnmatch(name, pattern) for pattern in data), (name, data)
    assert json.loads(PIECES.read_text(encoding="utf-8"))["pieces"]
