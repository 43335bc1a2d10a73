"""glibc's malloc thresholds for CPU runs: set only on glibc, only for CPU runs, before the engine loads."""
import pytest

from mtpchat import cli, loader, malloc
from tools.tiny import write_tiny_checkpoint


class FakeLibc:
    def __init__(self, answer: int = 1):
        self.calls, self.answer = [], answer

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.answer


def glibc(name):
    if name != "CS_GNU_LIBC_VERSION":
        raise ValueError(name)
    return "glibc 2.36"


def musl(name):
    raise ValueError("unrecognized configuration name")   # what os.confstr says without glibc


def test_only_glibc_on_linux_counts_as_glibc():
    assert malloc.is_glibc("linux", glibc)
    assert not malloc.is_glibc("linux", musl)
    assert not malloc.is_glibc("linux", lambda name: None)
    assert not malloc.is_glibc("darwin", glibc)
    assert not malloc.is_glibc("win32", glibc)


def test_the_thresholds_are_set_on_glibc_and_nowhere_else():
    libc = FakeLibc()
    assert malloc.keep_step_memory("linux", glibc, libc)
    assert dict(libc.calls) == {-3: 32 << 20, -1: malloc.TRIM, -2: malloc.TOP_PAD}
    assert malloc.TRIM >= 64 << 20          # well above what a step of a small model frees
    for platform, confstr in (("linux", musl), ("darwin", glibc)):
        libc = FakeLibc()
        assert not malloc.keep_step_memory(platform, confstr, libc) and libc.calls == []
    assert not malloc.keep_step_memory("linux", glibc, FakeLibc(answer=0))   # refused: said so


@pytest.mark.skipif(not malloc.is_glibc(), reason="needs glibc")
def test_this_glibc_takes_them():
    assert malloc.keep_step_memory()


def test_the_cli_sets_them_for_cpu_runs_only(monkeypatch):
    calls = []
    monkeypatch.setattr(malloc, "keep_step_memory", lambda: calls.append(1) or True)
    assert not cli.cpu_allocator("cuda") and not cli.cpu_allocator("cuda:1") and calls == []
    assert cli.cpu_allocator("cpu") and calls == [1]


def test_run_sets_them_before_the_engine_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    ckpt = write_tiny_checkpoint(tmp_path / "tiny")
    order = []
    monkeypatch.setattr(malloc, "keep_step_memory", lambda: order.append("malloc") or True)
    load = loader.load_engine
    monkeypatch.setattr(loader, "load_engine", lambda prep, progress=None: order.append("load") or load(prep, progress))
    code = cli.main(["run", "--model", str(ckpt), "--device", "cpu", "--prompt", "hi", "--max-tokens", "2",
                     "--json"])
    assert code == 0 and order == ["malloc", "load"]
    order.clear()
    assert cli.main(["run", "--model", str(ckpt), "--device", "cpu", "--dry-run"]) == 0
    assert order == []                      # a dry run loads nothing and leaves the allocator alone
    capsys.readouterr()

    from mtpchat.app import main as app_main
    monkeypatch.setattr(app_main, "run_app", lambda args: order.append("app") or 0)
    assert cli.main(["--model", str(ckpt), "--device", "cpu"]) == 0
    assert order == ["malloc", "app"]       # the app loads its engine after this, on a worker thread
