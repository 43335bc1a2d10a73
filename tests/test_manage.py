"""`mtpchat pull`, `mtpchat rm` and `mtpchat completion`, and each command's examples in --help.
The hub cache is a folder of the test's own laid out as huggingface_hub lays it out; downloads go
to a fake snapshot_download at the library's boundary (no network)."""
import json
import shutil
import subprocess
from pathlib import Path

import huggingface_hub
import pytest

from mtpchat import cli, hubcache
from mtpchat.engine.units import fmt_bytes
from tools.tiny import write_tiny_checkpoint
from helpers import put_in_cache
from helpers import isolated  # noqa: F401  (autouse: a settings file and a hub cache of the test's own)

REPO = "Qwen/Qwen3.5-0.8B"          # the repo of the alias Qwen3.5-0.8B
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def remote(tmp_path_factory) -> dict[str, bytes]:
    """The repo's files: a tiny checkpoint (three shards) and a vision-only shard never downloaded."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("remote"), num_hidden_layers=2)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    files["model-vision.safetensors"] = b"never fetched"
    return files


def store(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    return put_in_cache(cache, repo_id, files, commit)


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "hub"            # HF_HUB_CACHE, set by `isolated`


@pytest.fixture
def hub(monkeypatch, remote, cache):
    """snapshot_download replaced at the boundary: 'downloads' the allowed files from `remote`."""
    calls = []

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, **kw):
        assert not kw.get("local_files_only")
        calls.append(sorted(allow_patterns))
        return str(store(Path(cache_dir), repo_id, {f: d for f, d in remote.items() if f in allow_patterns}))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr("mtpchat.models._remote_sizes", lambda *a: None)
    return calls


def main(capsys, *argv, stdin=None, monkeypatch=None):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- pull --------------------------------------------------------------------------------------

def test_pull_downloads_only_what_is_read_then_says_where(capsys, hub, cache, remote):
    code, _, err = main(capsys, "pull", "Qwen3.5-0.8B")
    assert code == 0 and len(hub) == 2                     # the small files, then the shards
    shards = [f for f in remote if f.startswith("model-0")]
    assert hub[1] == sorted(shards)                        # not the vision-only shard
    assert f"downloading {len(shards)} shard file(s) of {REPO}" in err
    snap = hubcache.cached_snapshot(cache, REPO)
    assert f"Qwen3.5-0.8B: ready, " in err and str(snap) in err
    size = sum((snap / f).stat().st_size for f in shards + ["config.json", "generation_config.json",
                                                            "tokenizer.json", "tokenizer_config.json"]
               if (snap / f).exists())
    assert fmt_bytes(size) in err


def test_pull_resumes_an_interrupted_download_with_what_is_missing(capsys, hub, cache, remote):
    shards = sorted(f for f in remote if f.startswith("model-0"))
    store(cache, REPO, {f: d for f, d in remote.items() if f != shards[-1] and f != "model-vision.safetensors"})
    code, _, err = main(capsys, "pull", "Qwen3.5-0.8B")
    assert code == 0 and hub[-1] == [shards[-1]]           # only the missing shard asked for
    assert f"incomplete (missing {shards[-1]})" in err and "ready" in err


def test_pull_of_a_complete_copy_touches_no_network(capsys, hub, cache, remote):
    store(cache, REPO, remote)
    code, _, err = main(capsys, "pull", "Qwen3.5-0.8B")
    assert code == 0 and hub == [] and "ready" in err


def test_pull_offline(capsys, hub, cache, remote):
    code, _, err = main(capsys, "pull", "Qwen3.5-0.8B", "--offline")
    assert code == 1 and "not in the local cache" in err and "--offline is set" in err and hub == []
    store(cache, REPO, remote)
    code, _, err = main(capsys, "pull", "Qwen3.5-0.8B", "--offline")
    assert code == 0 and "ready" in err and hub == []


def test_pull_and_rm_refuse_a_folder(capsys, tmp_path):
    for command in ("pull", "rm"):
        code, _, err = main(capsys, command, str(tmp_path))
        assert code == 2 and "is a local folder, not a model in the Hugging Face cache" in err


# ---- rm ----------------------------------------------------------------------------------------

def test_rm_says_what_it_frees_and_removes_with_yes(capsys, cache, remote):
    snap = store(cache, REPO, remote)
    other = store(cache, "Qwen/Qwen3.5-2B", {"config.json": b"{}"}, commit="f" * 40)
    partial = hubcache.repo_folder(cache, REPO) / "blobs" / "feed.incomplete"
    partial.write_bytes(b"x" * 3000)
    blobs = sum(p.stat().st_size for p in (hubcache.repo_folder(cache, REPO) / "blobs").iterdir()) - 3000
    code, out, _ = main(capsys, "rm", "Qwen3.5-0.8B", "--yes")
    assert code == 0
    assert f"1 revision(s), {fmt_bytes(blobs)} and {fmt_bytes(3000)} of unfinished downloads" in out
    assert f"frees {fmt_bytes(blobs + 3000)}" in out and f"freed {fmt_bytes(blobs + 3000)}" in out
    assert not hubcache.repo_folder(cache, REPO).exists() and not snap.exists()
    assert other.is_dir()                                   # another model untouched


def test_rm_asks_and_keeps_on_no(capsys, cache, remote, monkeypatch):
    store(cache, REPO, remote)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    code, out, err = main(capsys, "rm", "Qwen3.5-0.8B")
    assert code == 1 and "not removed" in err and hubcache.repo_folder(cache, REPO).is_dir()
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    code, out, _ = main(capsys, "rm", "Qwen3.5-0.8B")
    assert code == 0 and "freed" in out and not hubcache.repo_folder(cache, REPO).exists()


def test_rm_without_a_terminal_needs_yes(capsys, cache, remote, monkeypatch):
    store(cache, REPO, remote)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False, raising=False)
    code, _, err = main(capsys, "rm", "Qwen3.5-0.8B")
    assert code == 2 and "pass --yes" in err and hubcache.repo_folder(cache, REPO).is_dir()


def test_rm_of_what_is_not_cached(capsys, cache):
    code, _, err = main(capsys, "rm", "Qwen3.5-0.8B", "--yes")
    assert code == 1 and "is not in the local cache" in err and "nothing to remove" in err


def test_models_lists_sizes_as_the_library_counts_them(capsys, cache, remote):
    store(cache, REPO, remote)
    size = huggingface_hub.scan_cache_dir(cache).repos.__iter__().__next__().size_on_disk
    code, out, _ = main(capsys, "models")
    line = next(l for l in out.splitlines() if l.strip().startswith(REPO))
    assert code == 0 and fmt_bytes(size) in line and "ready" in line


# ---- completion and examples -------------------------------------------------------------------

def complete(script: str, *words: str) -> list[str]:
    """What bash offers for the last of `words` with the generated script loaded."""
    line = " ".join(f"'{w}'" for w in ("mtpchat", *words))
    program = f'{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words)}; _mtpchat; printf "%s\\n" "${{COMPREPLY[@]}}"'
    return subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_offers_commands_flags_and_values(capsys):
    code, script, _ = main(capsys, "completion", "bash")
    assert code == 0
    assert {"run", "pull", "rm", "completion", "serve"} <= set(complete(script, ""))
    assert complete(script, "run", "--dev") == ["--device"]
    assert complete(script, "run", "--device", "") == ["auto", "cpu", "cuda"]
    assert "--prompt" in complete(script, "run", "--p") and "--prompt" not in complete(script, "--p")
    assert "--random-weights" in complete(script, "bench", "--r")      # bench's own flags too
    assert complete(script, "pull", "Qwen3.5-0") == ["Qwen3.5-0.8B"]
    assert complete(script, "completion", "f") == ["fish"]


def test_zsh_and_fish_scripts(capsys):
    _, zsh, _ = main(capsys, "completion", "zsh")
    assert zsh.startswith("#compdef mtpchat") and "bashcompinit" in zsh and "complete -F _mtpchat mtpchat" in zsh
    _, fish, _ = main(capsys, "completion", "fish")
    lines = fish.splitlines()
    assert "complete -c mtpchat -n '__fish_use_subcommand' -a pull -d 'download a model into the Hugging Face " \
           "cache (resumes an interrupted one)'" in lines
    assert any(l.startswith("complete -c mtpchat -n '__fish_seen_subcommand_from run' -l device -r -a 'auto cpu cuda'")
               for l in lines)
    assert any("__fish_seen_subcommand_from run' -l prompt" in l for l in lines)
    if shutil.which("fish"):
        subprocess.run(["fish", "-n", "-c", fish], check=True)


@pytest.mark.parametrize("command", ["run", "models", "serve", "bench", "pull", "rm", "completion"])
def test_every_command_help_ends_with_examples(capsys, command):
    code, out, _ = main(capsys, command, "--help")
    examples = out.split("examples:\n", 1)[1].splitlines()
    assert code == 0 and examples and all(l.startswith("  mtpchat ") or l.startswith("  echo") or l.startswith("  source")
                                          for l in examples)
    assert any(f"mtpchat {command}" in l for l in examples)


def test_top_level_help_points_to_what_an_installed_copy_has(capsys):
    code, out, _ = main(capsys, "--help")
    assert code == 0 and "docs/CLI.md" not in out
    assert "mtpchat run --help" in out and "mtpchat completion bash|zsh|fish" in out


def test_rm_leaves_a_repo_with_the_same_commit_hash(capsys, cache, remote):
    # the library deletes revisions by hash across repos: a hash two repos share must not take both
    store(cache, REPO, remote)
    other = store(cache, "someone/copy", {"config.json": b"{}"})            # the same COMMIT
    code, out, _ = main(capsys, "rm", "Qwen3.5-0.8B", "--yes")
    assert code == 0 and not hubcache.repo_folder(cache, REPO).exists()
    assert other.is_dir() and (other / "config.json").read_bytes() == b"{}"
