"""Which files of a checkpoint mtpchat needs, and whether a folder (or the Hugging Face cache) has them.

The official repos are vision-language checkpoints; mtpchat reads only the text model and the MTP
head, so a shard is needed only when the index's weight_map puts a text or `mtp.*` tensor in it.
Shards that hold only `model.visual.*` are never downloaded.

A shard counts as present when its safetensors header parses and the file is as long as the header
says; that catches interrupted copies without hashing gigabytes; that check is ours, the rest of
the cache is huggingface_hub's business: it finds a revision's snapshot
(`try_to_load_from_cache`), lists the cached repos and their sizes
(`scan_cache_dir`) and deletes them (`delete_revisions`). Nothing here touches the network.

The cache layout (huggingface_hub's):  <cache>/models--ORG--NAME/refs/main   (a commit hash)
                                       <cache>/models--ORG--NAME/snapshots/<commit>/<file> -> ../../blobs/<hash>
                                       <cache>/models--ORG--NAME/blobs/<hash>[.incomplete]
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "special_tokens_map.json")
REQUIRED_FILES = ("config.json", "tokenizer.json")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# the official layout, then a text-only layout (Qwen3_5ForCausalLM saves `model.layers.*`)
TEXT_PREFIXES = ("model.language_model.", "lm_head.", "mtp.",
                 "model.embed_tokens.", "model.layers.", "model.norm.")
MAX_HEADER = 100 << 20  # a safetensors header larger than this is garbage, not a header


def is_needed_tensor(name: str) -> bool:
    return name.startswith(TEXT_PREFIXES)


def needed_shards(weight_map: dict[str, str]) -> list[str]:
    """The shard files that hold at least one text or MTP tensor, sorted."""
    return sorted({f for name, f in weight_map.items() if is_needed_tensor(name)})


def has_mtp_tensors(names) -> bool:
    return any(n.startswith("mtp.") for n in names)


def safetensors_problem(path: Path) -> tuple[str | None, list[str]]:
    """(what is wrong with the file or None, the tensor names its header lists)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return "empty or truncated", []
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER):
                return "truncated or not a safetensors file", []
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"unreadable ({e.__class__.__name__})", []
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    except (KeyError, TypeError, IndexError):
        return "has a malformed header", []
    expected = 8 + n + end
    if size < expected:
        from mtpchat.engine.units import fmt_bytes
        return f"truncated: {fmt_bytes(expected - size)} short of {fmt_bytes(expected)}", list(tensors)
    return None, list(tensors)


@dataclass
class FolderCheck:
    folder: Path
    missing: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)   # "file (why)"
    shards: list[str] = field(default_factory=list)    # the shard files mtpchat reads
    has_mtp: bool = False

    @property
    def complete(self) -> bool:
        return not self.missing and not self.damaged

    def describe(self, limit: int = 5) -> str:
        parts = []
        if self.missing:
            parts.append("missing " + _names(self.missing, limit))
        if self.damaged:
            parts.append("damaged " + _names(self.damaged, limit))
        return "; ".join(parts)


def _names(items: list[str], limit: int) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_folder(folder: Path) -> FolderCheck:
    """Whether `folder` holds everything mtpchat reads: config, tokenizer, and the needed shards."""
    folder = Path(folder)
    check = FolderCheck(folder)
    # is_file() follows symlinks, so a snapshot link to a blob that never arrived counts as missing
    check.missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):
            check.damaged.append(f"{INDEX} (not a valid index)")
            return check
        check.shards = needed_shards(weight_map)
        check.has_mtp = has_mtp_tensors(weight_map)
    elif (folder / SINGLE).is_file():
        check.shards = [SINGLE]
    else:
        check.missing.append(f"{INDEX} or {SINGLE}")
        return check
    for shard in check.shards:
        path = folder / shard
        if not path.is_file():
            check.missing.append(shard)
            continue
        problem, names = safetensors_problem(path)
        if problem:
            check.damaged.append(f"{shard} ({problem})")
        if shard == SINGLE:
            check.has_mtp = has_mtp_tensors(names)
    return check


# ---- the Hugging Face cache -------------------------------------------------------------------

def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder, from the same environment variables, read now (not at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def cached_snapshot(cache_dir: Path, repo_id: str, revision: str = "main") -> Path | None:
    """The snapshot folder the cache holds for `revision` (a branch, tag or commit), or None. Found
    by huggingface_hub through the snapshot's config.json; a snapshot without one (an interrupted
    download) is found here from the ref, so that the completeness check can name what is missing;
    "main" in a copied cache with no refs is its newest snapshot."""
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(cache_dir), revision=revision)
    except ImportError:      # resolve() says what is missing when it comes to download
        found = None
    except ValueError:       # not a valid repo id or revision
        return None
    if isinstance(found, str):
        return Path(found).parent
    repo = repo_folder(cache_dir, repo_id)
    ref = repo / "refs" / revision
    snap = repo / "snapshots" / (ref.read_text().strip() if ref.is_file() else revision)
    if snap.is_dir():
        return snap
    if revision != "main" or ref.is_file():
        return None
    snaps = sorted((p for p in (repo / "snapshots").glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def partial_downloads(cache_dir: Path, repo_id: str) -> list[Path]:
    """Blobs that a download started and did not finish."""
    return sorted((repo_folder(cache_dir, repo_id) / "blobs").glob("*.incomplete"))


@dataclass
class CachedRepo:
    repo_id: str
    snapshot: Path | None
    size: int              # bytes of finished blobs (what deleting the repo frees, with `partial`)
    check: FolderCheck | None
    partial: int = 0       # bytes of unfinished downloads
    revisions: tuple[str, ...] = ()   # the commits it holds
    path: Path | None = None          # its folder in the cache


def _scan(cache_dir: Path):
    from huggingface_hub import CacheNotFound, scan_cache_dir
    try:
        return scan_cache_dir(cache_dir)
    except CacheNotFound:
        return None


def cached_repos(cache_dir: Path) -> list[CachedRepo]:
    """Every model repo in the cache (huggingface_hub's scan), with whether its snapshot has what
    mtpchat needs."""
    info = _scan(Path(cache_dir))
    out = []
    for repo in sorted((r for r in info.repos if r.repo_type == "model"), key=lambda r: r.repo_id) if info else ():
        snap = cached_snapshot(cache_dir, repo.repo_id)
        partial = sum(b.stat().st_size for b in partial_downloads(cache_dir, repo.repo_id))
        out.append(CachedRepo(repo.repo_id, snap, repo.size_on_disk, check_folder(snap) if snap else None, partial,
                              tuple(sorted(r.commit_hash for r in repo.revisions)), Path(repo.repo_path)))
    return out


def delete_repo(cache_dir: Path, repo: CachedRepo) -> int:
    """Delete every revision of `repo` from the cache (huggingface_hub's delete_revisions, which
    removes the repo's folder, unfinished downloads with it, once no revision is left); the bytes
    freed."""
    import shutil
    info = _scan(Path(cache_dir))
    freed = repo.partial
    # delete_revisions picks revisions by commit hash across all repos: only where the hashes are this repo's alone
    elsewhere = {r.commit_hash for other in (info.repos if info else ()) if Path(other.repo_path) != repo.path
                 for r in other.revisions}
    if info is not None and repo.revisions and not elsewhere & set(repo.revisions):
        strategy = info.delete_revisions(*repo.revisions)
        freed += strategy.expected_freed_size
        strategy.execute()
    elif repo.path is not None:
        freed += repo.size
    if repo.path is not None and repo.path.exists():    # no revision (only unfinished downloads), or shared hashes
        shutil.rmtree(repo.path)
    return freed
