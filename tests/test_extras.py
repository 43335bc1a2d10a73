"""The core install (no extras) runs the engine and `mtpchat run`; each command that needs an extra
names it, with the pip command, and exits 2 before loading anything."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtpchat import cli
from tools.tiny import write_tiny_checkpoint
from helpers import isolated  # noqa: F401  (autouse: a settings file and a hub cache of the test's own)

EXTRA_ONLY = ("textual", "markdown_it", "rich", "starlette", "uvicorn", "httpx", "prometheus_client", "pynvml",
              "triton", "transformers", "openai")


def without(monkeypatch, *modules):
    real = cli._has_module
    monkeypatch.setattr(cli, "_has_module", lambda name: name not in modules and real(name))


@pytest.mark.parametrize("argv, missing, extra, what", [
    ([], "textual", "app", "the app"),
    ([], "markdown_it", "app", "the app"),
    (["--server", "http://localhost:1"], "textual", "app", "the app"),
    (["serve"], "uvicorn", "serve", "`mtpchat serve`"),
    (["run", "--server", "http://localhost:1", "--prompt", "x"], "httpx", "remote", "`mtpchat run --server`"),
])
def test_a_missing_extra_is_named_with_its_pip_command(capsys, monkeypatch, argv, missing, extra, what):
    without(monkeypatch, missing)
    monkeypatch.setattr("mtpchat.loader.prepare", lambda *a, **kw: pytest.fail("prepared a model"))
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert f"{what} needs the [{extra}] extra: pip install 'mtpchat[{extra}]' ({missing} not installed)" in err


def test_the_core_runs_the_engine_without_any_extra(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", num_hidden_layers=2)
    program = f"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRA_ONLY!r}:
            raise ImportError("not installed: " + name)
sys.meta_path.insert(0, Refuse())
from mtpchat import cli
sys.exit(cli.main(["run", "--model", {str(ckpt)!r}, "--device", "cpu", "--prompt", "hi", "--max-tokens", "3",
                   "--json", "--no-think"]))
"""
    (tmp_path / "settings.toml").touch()
    env = {"MTPCHAT_SETTINGS": str(tmp_path / "settings.toml"), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["stats"]["new_tokens"] == 3
