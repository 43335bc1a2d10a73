"""Model resolution against a fake Hugging Face cache laid out as the real one; no network."""
import errno
import json
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import errors as hub_errors
from safetensors.torch import save_file

from mtpchat import hubcache, models
from helpers import put_in_cache as cache_files
from mtpchat.errors import DiskFull, IncompleteModel, ModelNotFound, UserError

REPO = "Qwen/Qwen3.5-0.8B"  # the repo of an alias
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMALL = [*hubcache.CONFIG_FILES, *hubcache.TOKENIZER_FILES, hubcache.INDEX]


def _safetensors(tmp: Path, names: list[str]) -> bytes:
    path = tmp / "shard.tmp"
    save_file({n: torch.full((2, 3), float(i + 1)) for i, n in enumerate(names)}, str(path))
    data = path.read_bytes()
    path.unlink()
    return data


def remote_files(tmp: Path, mtp: bool = True) -> dict[str, bytes]:
    """The files of a repo in the official layout: text in shards 1-2, MTP in 3, vision alone in 4."""
    shards = {
        "model-00001-of-00004.safetensors": ["model.language_model.embed_tokens.weight",
                                             "model.language_model.layers.0.mlp.up_proj.weight"],
        "model-00002-of-00004.safetensors": ["model.language_model.norm.weight", "lm_head.weight",
                                             "model.visual.blocks.0.attn.qkv.weight"],
        "model-00003-of-00004.safetensors": ["mtp.fc.weight", "mtp.norm.weight"] if mtp else [],
        "model-00004-of-00004.safetensors": ["model.visual.patch_embed.proj.weight",
                                             "model.visual.merger.linear_fc1.weight"],
    }
    shards = {f: names for f, names in shards.items() if names}
    files = {f: _safetensors(tmp, names) for f, names in shards.items()}
    files[hubcache.INDEX] = json.dumps({"weight_map": {n: f for f, ns in shards.items() for n in ns}}).encode()
    files["config.json"] = json.dumps({"model_type": "qwen3_5", "text_config": {"hidden_size": 8}}).encode()
    files["generation_config.json"] = b'{"eos_token_id": [2, 1]}'
    files["tokenizer.json"] = b'{"model": {}}'
    files["tokenizer_config.json"] = b"{}"
    files["chat_template.jinja"] = b"{{ messages }}"
    return files


def put_in_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    return cache_files(cache, repo_id, files, commit)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return cache


@pytest.fixture
def remote(tmp_path):
    return remote_files(tmp_path)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("the network must not be used here")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setattr(models, "_remote_sizes", lambda *a: None)


@pytest.fixture
def fake_hub(monkeypatch, cache, remote):
    """snapshot_download that 'downloads' from `remote` into the cache; records each call."""
    calls = []

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, **kw):
        calls.append(sorted(allow_patterns))
        wanted = {f: d for f, d in remote.items() if f in allow_patterns}
        return str(put_in_cache(Path(cache_dir), repo_id, wanted))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(models, "_remote_sizes", lambda *a: None)
    return calls


def _response(status):
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/x/y"))


# ---- names ---------------------------------------------------------------------------------------

def test_alias_lookup_is_case_insensitive():
    assert models.classify("qwen3.6-27b-mtp") == ("repo", "Qwen/Qwen3.6-27B", models.lookup_alias("Qwen3.6-27B-MTP"))
    assert models.classify("Qwen3.5-9B")[1] == "Qwen/Qwen3.5-9B"


def test_repo_id_and_folder(tmp_path):
    assert models.classify("someone/some-model") == ("repo", "someone/some-model", None)
    assert models.classify(str(tmp_path)) == ("folder", str(tmp_path), None)


def test_unknown_alias_suggests_the_closest():
    with pytest.raises(ModelNotFound, match=r"unknown model 'qwen3.5-9'; did you mean 'Qwen3.5-9B'\?"):
        models.classify("qwen3.5-9")
    with pytest.raises(ModelNotFound) as e:
        models.classify("zzzz")
    assert "did you mean" not in str(e.value) and "mtpchat models" in str(e.value)


def test_missing_folder_and_file(tmp_path):
    with pytest.raises(ModelNotFound, match="no such folder: ./nowhere/at/all"):
        models.classify("./nowhere/at/all")
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(ModelNotFound, match="is a file; pass the folder"):
        models.classify(str(tmp_path / "f.json"))


def test_demo_default_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "DEMO_DIR", tmp_path / "absent")
    with pytest.raises(ModelNotFound, match="the demo model is not in .*absent; pass --model"):
        models.resolve(None)


def test_hub_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hubcache.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hubcache.hub_cache_dir() == tmp_path / "c"


# ---- the shard filter ------------------------------------------------------------------------------

def test_shard_filter_skips_vision_only_shards():
    weight_map = {"model.language_model.layers.0.mlp.up_proj.weight": "a",
                  "model.visual.blocks.0.attn.qkv.weight": "b",   # b also holds lm_head: needed
                  "lm_head.weight": "b", "mtp.fc.weight": "c", "model.visual.merger.fc.weight": "d"}
    assert hubcache.needed_shards(weight_map) == ["a", "b", "c"]
    assert hubcache.needed_shards({"model.layers.0.mlp.up_proj.weight": "x", "visual.x": "y"}) == ["x"]
    assert hubcache.has_mtp_tensors(weight_map) and not hubcache.has_mtp_tensors(["lm_head.weight"])


# ---- the cache, offline first ----------------------------------------------------------------------

def test_offline_use_of_a_complete_cache(cache, remote, no_network):
    snap = put_in_cache(cache, REPO, remote)
    got = models.resolve("Qwen3.5-0.8B", offline=True)
    assert got.path == snap and got.repo_id == REPO and got.name == "Qwen3.5-0.8B" and got.has_mtp
    assert got.shards == ("model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                          "model-00003-of-00004.safetensors")


def test_complete_cache_is_used_without_network_even_online(cache, remote, no_network):
    put_in_cache(cache, REPO, remote)
    assert models.resolve(REPO).repo_id == REPO


def test_vision_only_shard_is_not_needed(cache, remote, no_network):
    del remote["model-00004-of-00004.safetensors"]
    put_in_cache(cache, REPO, remote)
    assert models.resolve(REPO, offline=True).path.is_dir()


def test_incomplete_cache_names_the_missing_file(cache, remote, no_network):
    snap = put_in_cache(cache, REPO, remote)
    (snap / "model-00002-of-00004.safetensors").unlink()
    (hubcache.repo_folder(cache, REPO) / "blobs" / "deadbeef.incomplete").write_bytes(b"\0" * 10)
    with pytest.raises(IncompleteModel) as e:
        models.resolve("Qwen3.5-0.8B", offline=True)
    msg = str(e.value)
    assert "the cached copy of Qwen3.5-0.8B is incomplete: missing model-00002-of-00004.safetensors" in msg
    assert "1 interrupted download(s)" in msg and "--offline is set" in msg


def test_truncated_shard_is_detected(cache, remote, no_network):
    remote["model-00001-of-00004.safetensors"] = remote["model-00001-of-00004.safetensors"][:-7]
    put_in_cache(cache, REPO, remote)
    with pytest.raises(IncompleteModel, match=r"damaged model-00001-of-00004.safetensors \(truncated"):
        models.resolve(REPO, offline=True)


def test_dangling_snapshot_link_counts_as_missing(cache, remote, no_network):
    snap = put_in_cache(cache, REPO, remote)
    target = (snap / "tokenizer.json").resolve()
    target.unlink()
    with pytest.raises(IncompleteModel, match="missing tokenizer.json"):
        models.resolve(REPO, offline=True)


def test_offline_with_nothing_cached(cache, no_network):
    with pytest.raises(ModelNotFound, match=r"Qwen3.5-0.8B is not in the local cache .* --offline is set"):
        models.resolve("Qwen3.5-0.8B", offline=True)


def test_hf_hub_offline_is_honoured(cache, monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE is set"):
        models.resolve(REPO)


def test_checkpoint_without_mtp(cache, tmp_path, no_network):
    put_in_cache(cache, REPO, remote_files(tmp_path, mtp=False))
    assert models.resolve(REPO, offline=True).has_mtp is False


def test_local_folder_complete_and_incomplete(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, data in remote_files(tmp_path).items():
        (folder / name).write_bytes(data)
    assert models.resolve(str(folder)).path == folder
    (folder / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(IncompleteModel, match=r"ckpt is incomplete: missing model-00003-of-00004.safetensors"):
        models.resolve(str(folder))


# ---- downloading ---------------------------------------------------------------------------------

def test_download_fetches_only_what_is_needed(cache, fake_hub):
    got = models.resolve("Qwen3.5-0.8B", notify=lambda line: None)
    assert fake_hub == [sorted(SMALL), ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                                        "model-00003-of-00004.safetensors"]]
    assert not (got.path / "model-00004-of-00004.safetensors").exists()
    assert got.has_mtp and hubcache.check_folder(got.path).complete


def test_download_resumes_with_the_missing_shard_only(cache, remote, fake_hub):
    snap = put_in_cache(cache, REPO, remote)
    (snap / "model-00003-of-00004.safetensors").unlink()
    notes = []
    models.resolve(REPO, notify=notes.append)
    assert fake_hub[-1] == ["model-00003-of-00004.safetensors"]
    assert "incomplete (missing model-00003-of-00004.safetensors); downloading the rest" in notes[0]


def test_single_file_checkpoint(cache, tmp_path, monkeypatch):
    remote = {"config.json": b"{}", "tokenizer.json": b"{}",
              "model.safetensors": _safetensors(tmp_path, ["model.layers.0.mlp.up_proj.weight"])}
    calls = []

    def snapshot_download(repo_id, allow_patterns=None, cache_dir=None, **kw):
        calls.append(sorted(allow_patterns))
        return str(put_in_cache(Path(cache_dir), repo_id, {f: d for f, d in remote.items() if f in allow_patterns}))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(models, "_remote_sizes", lambda *a: None)
    got = models.resolve("someone/flat", notify=lambda line: None)
    assert calls[-1] == ["model.safetensors"] and got.shards == ("model.safetensors",) and not got.has_mtp


def _raising(exc):
    def snapshot_download(*a, **kw):
        raise exc
    return snapshot_download


@pytest.mark.parametrize("exc, cls, message", [
    (lambda: hub_errors.RepositoryNotFoundError("404", response=_response(404)), ModelNotFound,
     "repository nobody/nothing was not found on Hugging Face"),
    (lambda: hub_errors.GatedRepoError("403", response=_response(403)), ModelNotFound,
     "nobody/nothing is gated: accept its terms"),
    (lambda: hub_errors.LocalEntryNotFoundError("offline"), ModelNotFound,
     "cannot reach huggingface.co to download nobody/nothing, and the cache"),
    (lambda: OSError(errno.ENOSPC, "No space left on device"), DiskFull,
     "is full while downloading nobody/nothing"),
    (lambda: hub_errors.HfHubHTTPError("500 Server Error", response=_response(500)), UserError,
     "downloading nobody/nothing failed: 500 Server Error"),
    (lambda: type("ConnectError", (Exception,), {})("no route"), ModelNotFound,
     r"cannot reach huggingface.co to download nobody/nothing \(ConnectError\)"),
])
def test_download_errors(cache, monkeypatch, exc, cls, message):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(exc()))
    with pytest.raises(cls, match=message):
        models.resolve("nobody/nothing")


def test_disk_space_is_checked_before_the_shards(cache, fake_hub, monkeypatch):
    monkeypatch.setattr(models, "_remote_sizes", lambda repo, rev, files: {f: 10 ** 15 for f in files})
    with pytest.raises(DiskFull, match=r"needs 2728\.5 TiB for 3 file\(s\) but only [\d.]+ [KMGT]?i?B is free"):
        models.resolve(REPO, notify=lambda line: None)
    assert len(fake_hub) == 1  # the small files only; no shard was requested


# ---- listing -------------------------------------------------------------------------------------

def test_models_lists_aliases_and_cache(cache, tmp_path):
    put_in_cache(cache, REPO, remote_files(tmp_path))
    broken = remote_files(tmp_path)
    del broken["model-00001-of-00004.safetensors"]
    put_in_cache(cache, "Qwen/Qwen3.5-9B", broken)
    other = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}",
             "model.safetensors": _safetensors(tmp_path, ["model.layers.0.w"])}
    put_in_cache(cache, "meta/llama", other)
    text = "\n".join(models.list_models())
    rows = {line.split()[0]: " ".join(line.split()[1:]) for line in text.splitlines()[1:] if line.startswith("  Qwen3")}
    assert rows["Qwen3.5-0.8B"] == "Qwen/Qwen3.5-0.8B bf16 dense [cached]"
    assert rows["Qwen3.5-9B"] == "Qwen/Qwen3.5-9B bf16 dense [incomplete]"
    assert rows["Qwen3.5-27B"] == "Qwen/Qwen3.5-27B bf16 dense"
    assert rows["Qwen3.6-27B-FP8"] == "Qwen/Qwen3.6-27B-FP8 FP8 dense"
    assert rows["Qwen3.6-35B-A3B-FP8"] == "Qwen/Qwen3.6-35B-A3B-FP8 FP8 MoE, 8 of 256 experts"
    starts = {line.index("Qwen/") for line in text.splitlines() if line.startswith("  Qwen3")}
    assert len(starts) == 1                                   # one column, however long the names
    assert "incomplete: missing model-00001-of-00004.safetensors" in text
    assert "meta/llama" in text and "not a Qwen3.5 / Qwen3.6 model" in text
    assert f"local cache ({cache})" in text


def test_smaller_aliases_are_ordered_and_unique():
    names = [a.name for a in models.smaller_aliases(10 ** 12)]
    assert names == ["Qwen3.5-122B-A10B", "Qwen3.6-35B-A3B", "Qwen3.5-35B-A3B", "Qwen3.8-27B", "Qwen3.6-27B-MTP",
                     "Qwen3.5-27B",
                     "Qwen3.5-9B", "Qwen3.5-4B", "Qwen3.5-2B", "Qwen3.5-0.8B"]
    assert [a.name for a in models.smaller_aliases(4_000_000_000)] == ["Qwen3.5-2B", "Qwen3.5-0.8B"]



def test_download_without_huggingface_hub(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ModelNotFound, match="huggingface_hub is not installed to download it"):
        models.resolve("nobody/nothing")
