"""The wheel built from the repository: the runtime, the demo model and the license, nothing of the
tests or the demo trainer; its metadata: a small core, the extras each command names, the license.
The build takes a recent setuptools from the package registry (build isolation), as pip does."""
import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):       # not a checkout: everything but build output
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                and not {"build", "dist", ".git", "__pycache__"} & set(p.relative_to(ROOT).parts)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in tracked_files():          # a clean copy: no build folder or egg-info of a checkout
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out),
                           str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("mtpchat-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_the_runtime_the_demo_and_the_license(wheel):
    names = set(wheel.namelist())
    for package in ("mtpchat", "mtpchat/app", "mtpchat/chat", "mtpchat/remote", "mtpchat/engine", "mtpchat/kernels"):
        assert f"{package}/__init__.py" in names, package
    # every module of the source is there
    for folder, package in (("mtpchat", "mtpchat"), ("engine", "mtpchat/engine"), ("kernels", "mtpchat/kernels")):
        for path in (ROOT / folder).rglob("*.py"):
            assert f"{package}/{path.relative_to(ROOT / folder)}" in names, path
    assert "mtpchat/app/app.tcss" in names and "mtpchat/engine/chat_template.jinja" in names
    demo = {p.name for p in (ROOT / "assets" / "demo").iterdir()}
    assert {n.rsplit("/", 1)[1] for n in names if n.startswith("mtpchat/assets/demo/")} == demo
    license_ = [n for n in names if n.endswith("/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")]
    assert license_ and b"Apache License" in wheel.read(license_[0])


def test_the_wheel_has_nothing_of_the_tests_or_the_trainer(wheel):
    names = wheel.namelist()
    assert not [n for n in names if n.startswith(("tests/", "tools/", "mtpchat/tools/"))]
    assert not [n for n in names if "heldout_prompts" in n or "test_" in n.rsplit("/", 1)[-1]]
    assert not [n for n in names if n.startswith("mtpchat/assets/") and not n.startswith("mtpchat/assets/demo/")
                and n != "mtpchat/assets/README.md"]
    size = sum(i.file_size for i in wheel.infolist())
    demo = sum(p.stat().st_size for p in (ROOT / "assets" / "demo").iterdir())
    assert size < demo + 3_000_000            # the demo model and some code: nothing else of size


def test_the_metadata_a_small_core_and_the_extras(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    msg = email.message_from_bytes(wheel.read(meta))
    requires = msg.get_all("Requires-Dist")
    core = {r.split(">")[0].split("<")[0].split("=")[0].split(";")[0].strip().lower()
            for r in requires if "extra ==" not in r}
    assert {n.replace("-", "_") for n in core} == {"torch", "safetensors", "tokenizers", "jinja2", "huggingface_hub",
                                                   "platformdirs", "tqdm"}
    extra = lambda name: " ".join(r for r in requires if f'extra == "{name}"' in r)
    assert "textual" in extra("app") and "markdown-it-py" in extra("app") and "rich" in extra("app")
    assert "starlette" in extra("serve") and "uvicorn" in extra("serve")
    assert "triton" in extra("test") and "triton" not in extra("app") + extra("serve")
    assert set(msg.get_all("Provides-Extra")) >= {"app", "serve", "remote", "all", "test"}
    assert msg["License-Expression"] == "Apache-2.0" and msg.get_all("License-File") == ["LICENSE"]
    assert msg.get_all("Keywords") and any("Topic ::" in c for c in msg.get_all("Classifier"))
