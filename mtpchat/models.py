"""Model names: aliases, local folders and Hugging Face repo ids, resolved to a folder on disk.

Offline first: a complete copy in the local Hugging Face cache is used without touching the
network. Otherwise (unless offline) only the files mtpchat reads are downloaded: config, generation
config, tokenizer files, chat template, and the shards that hold text or `mtp.*` tensors.

Each alias also carries the shape of its model (qwen35-model.md §1), so a memory plan can be made,
and a smaller model suggested, before anything is downloaded.
"""
from __future__ import annotations

import difflib
import errno
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from mtpchat import hubcache
from mtpchat.errors import DiskFull, IncompleteModel, ModelNotFound, UserError

def _demo_dir() -> Path:
    """assets/demo, installed as package data of mtpchat.assets (a checkout maps it to assets/)."""
    try:
        from importlib.resources import files
        return Path(str(files("mtpchat.assets") / "demo"))
    except (ModuleNotFoundError, TypeError):
        return Path(__file__).resolve().parent.parent / "assets" / "demo"


DEMO_DIR = _demo_dir()
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHT_LABELS = {"fp8": "FP8", "int4": "int4"}   # an engine's (or memory plan's) weight_format, as shown
FORMATS = {"bf16": ("", "bf16"), "fp8": ("-FP8", "FP8"), "gptq-int4": ("-GPTQ-Int4", "GPTQ-Int4")}  # repo suffix, label
# the official GPTQ releases' quantization_config: group 128, symmetric, in order; attention (full and
# GDN), the shared experts and the MTP layer left in bf16: the dense models' MLPs or the routed experts
GPTQ_INT4 = dict(method="gptq", group=128, symmetric=True, desc_act=False,
                 skip=(".*attn.*", ".*shared_expert.*", ".*mtp.*", ".*visual.*"))


@dataclass(frozen=True)
class Alias:
    name: str
    repo_id: str
    # text_config fields that differ between sizes; the rest is shared (see `alias_config`)
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    linear_num_value_heads: int
    tie_word_embeddings: bool
    format: str = "bf16"        # the release's weights: "bf16", "fp8" (block-scaled float8_e4m3fn) or
                                # "gptq-int4" (GPTQ_INT4: 4 bits in groups of 128, some products)
    # the MoE models: (experts, chosen per token, expert width, shared expert width); () for dense
    moe: tuple[int, int, int, int] = ()


# dense models largest first, then the MoE ones (`smaller_aliases` orders them by size)
ALIASES: dict[str, Alias] = {a.name.lower(): a for a in [
    # Qwen3.8 keeps the Qwen3.5 architecture and the 27B's shapes; its chat template takes reasoning_effort
    Alias("Qwen3.8-27B", "Qwen/Qwen3.8-27B", 5120, 64, 17408, 24, 4, 48, False),
    Alias("Qwen3.8-27B-FP8", "Qwen/Qwen3.8-27B-FP8", 5120, 64, 17408, 24, 4, 48, False, format="fp8"),
    Alias("Qwen3.6-27B-MTP", "Qwen/Qwen3.6-27B", 5120, 64, 17408, 24, 4, 48, False),
    Alias("Qwen3.6-27B", "Qwen/Qwen3.6-27B", 5120, 64, 17408, 24, 4, 48, False),
    Alias("Qwen3.6-27B-FP8", "Qwen/Qwen3.6-27B-FP8", 5120, 64, 17408, 24, 4, 48, False, format="fp8"),
    Alias("Qwen3.5-27B", "Qwen/Qwen3.5-27B", 5120, 64, 17408, 24, 4, 48, False),
    Alias("Qwen3.5-27B-FP8", "Qwen/Qwen3.5-27B-FP8", 5120, 64, 17408, 24, 4, 48, False, format="fp8"),
    Alias("Qwen3.5-27B-GPTQ-Int4", "Qwen/Qwen3.5-27B-GPTQ-Int4", 5120, 64, 17408, 24, 4, 48, False,
          format="gptq-int4"),
    # the 122B's shape as planned here; its own config.json decides once it is downloaded
    Alias("Qwen3.5-122B-A10B", "Qwen/Qwen3.5-122B-A10B", 3072, 48, 0, 32, 2, 64, False, moe=(256, 8, 1024, 1024)),
    Alias("Qwen3.5-122B-A10B-FP8", "Qwen/Qwen3.5-122B-A10B-FP8", 3072, 48, 0, 32, 2, 64, False, format="fp8",
          moe=(256, 8, 1024, 1024)),
    Alias("Qwen3.6-35B-A3B", "Qwen/Qwen3.6-35B-A3B", 2048, 40, 0, 16, 2, 32, False, moe=(256, 8, 512, 512)),
    Alias("Qwen3.6-35B-A3B-FP8", "Qwen/Qwen3.6-35B-A3B-FP8", 2048, 40, 0, 16, 2, 32, False, format="fp8",
          moe=(256, 8, 512, 512)),
    Alias("Qwen3.5-35B-A3B", "Qwen/Qwen3.5-35B-A3B", 2048, 40, 0, 16, 2, 32, False, moe=(256, 8, 512, 512)),
    Alias("Qwen3.5-35B-A3B-FP8", "Qwen/Qwen3.5-35B-A3B-FP8", 2048, 40, 0, 16, 2, 32, False, format="fp8",
          moe=(256, 8, 512, 512)),
    Alias("Qwen3.5-35B-A3B-GPTQ-Int4", "Qwen/Qwen3.5-35B-A3B-GPTQ-Int4", 2048, 40, 0, 16, 2, 32, False,
          format="gptq-int4", moe=(256, 8, 512, 512)),
    Alias("Qwen3.5-9B", "Qwen/Qwen3.5-9B", 4096, 32, 12288, 16, 4, 32, False),
    Alias("Qwen3.5-4B", "Qwen/Qwen3.5-4B", 2560, 32, 9216, 16, 4, 32, True),
    Alias("Qwen3.5-2B", "Qwen/Qwen3.5-2B", 2048, 24, 6144, 8, 2, 16, True),
    Alias("Qwen3.5-0.8B", "Qwen/Qwen3.5-0.8B", 1024, 24, 3584, 8, 2, 16, True),
]}


def lookup_alias(name: str) -> Alias | None:
    return ALIASES.get(name.lower())


def suggest_alias(name: str) -> str | None:
    close = difflib.get_close_matches(name.lower(), list(ALIASES), n=1, cutoff=0.5)
    return ALIASES[close[0]].name if close else None


def alias_config(alias: Alias):
    """The ModelConfig of an alias's model, built from its shape (no download)."""
    from mtpchat.engine.config import Int4Format, ModelConfig
    quantization = {"fp8": "fp8", "gptq-int4": "int4"}.get(alias.format)
    return ModelConfig(vocab_size=248320, hidden_size=alias.hidden_size,
                       intermediate_size=alias.intermediate_size,
                       num_hidden_layers=alias.num_hidden_layers,
                       num_attention_heads=alias.num_attention_heads,
                       num_key_value_heads=alias.num_key_value_heads, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=alias.linear_num_value_heads,
                       linear_key_head_dim=128, linear_value_head_dim=128,
                       tie_word_embeddings=alias.tie_word_embeddings, mtp_num_hidden_layers=1,
                       quantization=quantization,
                       int4=Int4Format(**GPTQ_INT4) if quantization == "int4" else None,
                       **dict(zip(("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                   "shared_expert_intermediate_size"), alias.moe)))


def release(name: str, fmt: str) -> Alias | None:
    """The alias of the same model as `name` (an alias or its repo id) in the release of format
    `fmt` ("bf16", "fp8", "gptq-int4"), if there is one; the one named as its repo first."""
    alias = lookup_alias(name) or next((a for a in ALIASES.values() if a.repo_id == name), None)
    if alias is None:
        return None
    repo_id = alias.repo_id.removesuffix(FORMATS[alias.format][0]) + FORMATS[fmt][0]
    same = [a for a in ALIASES.values() if a.format == fmt and a.repo_id == repo_id]
    return min(same, key=lambda a: a.name != repo_id.partition("/")[2], default=None)


def smaller_aliases(than_params: int) -> list[Alias]:
    """Aliases of models with fewer parameters than `than_params`, largest first, one per repo."""
    from mtpchat.engine.memory import text_params
    seen, out = set(), []
    for alias in sorted(ALIASES.values(), key=lambda a: -text_params(alias_config(a))):   # stable: list order on ties
        if alias.repo_id not in seen and alias.format == "bf16" and text_params(alias_config(alias)) < than_params:
            seen.add(alias.repo_id)
            out.append(alias)
    return out


@dataclass(frozen=True)
class ResolvedModel:
    name: str               # what to show: the alias, the repo id or the folder
    path: Path              # the folder that holds config.json, the tokenizer and the shards
    repo_id: str | None     # None for a local folder
    has_mtp: bool           # the checkpoint ships mtp.* tensors
    shards: tuple[str, ...]


def is_offline(offline: bool) -> bool:
    return offline or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def classify(spec: str) -> tuple[str, str, Alias | None]:
    """("folder", path, None) | ("repo", repo_id, alias or None); raises ModelNotFound otherwise."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFound(f"{spec} is a file; pass the folder that holds config.json and the shards")
        return "folder", str(path), None
    alias = lookup_alias(spec)
    if alias:
        return "repo", alias.repo_id, alias
    if REPO_ID.match(spec) and not spec.startswith(("./", "../")):
        return "repo", spec, None
    if spec.startswith((".", "/", "~")) or os.sep in spec or "/" in spec:
        raise ModelNotFound(f"no such folder: {spec}")
    hint = suggest_alias(spec)
    raise ModelNotFound(f"unknown model {spec!r}" + (f"; did you mean {hint!r}?" if hint else "")
                        + "\n`mtpchat models` lists the aliases; a local folder or an org/name repo id works too")


def resolve(spec: str | None, *, offline: bool = False, cache_dir: Path | None = None,
            revision: str = "main", notify=None) -> ResolvedModel:
    """A folder with everything needed to load `spec`, downloading what is missing unless offline.
    `notify(line)` receives progress notes (default: stderr)."""
    notify = notify or (lambda line: print(line, file=sys.stderr))
    if spec is None:
        if not DEMO_DIR.is_dir():
            raise ModelNotFound(f"the demo model is not in {DEMO_DIR}; pass --model with an alias, "
                                "a folder or a repo id (`mtpchat models` lists the aliases)")
        spec = str(DEMO_DIR)
    kind, target, alias = classify(spec)
    if kind == "folder":
        check = hubcache.check_folder(Path(target))
        if not check.complete:
            raise IncompleteModel(f"{target} is incomplete: {check.describe()}")
        return ResolvedModel(spec, Path(target), None, check.has_mtp, tuple(check.shards))

    name = alias.name if alias else target
    cache_dir = Path(cache_dir) if cache_dir else hubcache.hub_cache_dir()
    snap = hubcache.cached_snapshot(cache_dir, target, revision)
    check = hubcache.check_folder(snap) if snap else None
    if check and check.complete:
        return ResolvedModel(name, snap, target, check.has_mtp, tuple(check.shards))
    if is_offline(offline):
        why = "--offline is set" if offline else "HF_HUB_OFFLINE is set"
        if check is None:
            raise ModelNotFound(f"{name} is not in the local cache ({cache_dir}) and {why}; "
                                "run once online to download it")
        raise IncompleteModel(_incomplete_message(name, check, cache_dir, target)
                              + f"\n{why}; run once online to finish the download")
    if check is not None:
        notify(f"{name}: the cached copy is incomplete ({check.describe(3)}); downloading the rest")
    snap = download(target, cache_dir, revision, notify)
    check = hubcache.check_folder(snap)
    if not check.complete:
        raise IncompleteModel(_incomplete_message(name, check, cache_dir, target)
                              + "\nrun the same command again to retry the download")
    return ResolvedModel(name, snap, target, check.has_mtp, tuple(check.shards))


def _incomplete_message(name, check, cache_dir, repo_id) -> str:
    partial = hubcache.partial_downloads(cache_dir, repo_id)
    note = f" ({len(partial)} interrupted download(s) in the cache)" if partial else ""
    return f"the cached copy of {name} is incomplete: {check.describe()}{note}"


# ---- downloading ------------------------------------------------------------------------------

def download(repo_id: str, cache_dir: Path, revision: str = "main", notify=print) -> Path:
    """Fetch the small files, read the index, then fetch only the shards with text or MTP tensors."""
    small = [*hubcache.CONFIG_FILES, *hubcache.TOKENIZER_FILES, hubcache.INDEX]
    snap = _snapshot(repo_id, cache_dir, revision, small)
    check = hubcache.check_folder(snap)
    if (snap / hubcache.INDEX).is_file():
        shards = check.shards
    else:  # a single-file checkpoint
        shards = [hubcache.SINGLE]
    todo = [s for s in shards if not (snap / s).is_file() or any(d.startswith(s + " ") for d in check.damaged)]
    if not todo:
        return snap
    _check_disk(repo_id, revision, todo, cache_dir)
    notify(f"downloading {len(todo)} shard file(s) of {repo_id} into {cache_dir}")
    return _snapshot(repo_id, cache_dir, revision, todo)


def _snapshot(repo_id: str, cache_dir: Path, revision: str, files: list[str]) -> Path:
    try:
        import huggingface_hub as hub
        from huggingface_hub import errors
    except ImportError:
        raise ModelNotFound(f"{repo_id} is not in the cache and huggingface_hub is not installed to "
                            "download it; pip install huggingface_hub, or pass a local folder") from None
    try:
        return Path(hub.snapshot_download(repo_id, revision=revision, cache_dir=str(cache_dir),
                                          allow_patterns=list(files)))
    except errors.GatedRepoError:
        raise ModelNotFound(f"{repo_id} is gated: accept its terms on https://huggingface.co/{repo_id} "
                            "and log in with `hf auth login`") from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFound(f"repository {repo_id} was not found on Hugging Face (or it is private); "
                            "check the name, or see `mtpchat models` for the aliases") from None
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"{repo_id} has no revision {revision!r}") from None
    except errors.LocalEntryNotFoundError:
        raise ModelNotFound(f"cannot reach huggingface.co to download {repo_id}, and the cache "
                            f"({cache_dir}) does not have it; connect, or pass a local folder") from None
    except errors.HfHubHTTPError as e:  # an OSError too: keep it before the OSError branch
        raise UserError(f"downloading {repo_id} failed: {_first_line(e)}") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFull(f"the disk holding {cache_dir} is full while downloading {repo_id}; "
                           "free some space (or set HF_HUB_CACHE to another disk) and run again") from None
        raise UserError(f"downloading {repo_id} failed: {_first_line(e)}") from None
    except Exception as e:  # the HTTP client's own connection errors (requests or httpx)
        if any(w in type(e).__name__ for w in ("Connect", "Timeout", "Network")):
            raise ModelNotFound(f"cannot reach huggingface.co to download {repo_id} "
                                f"({type(e).__name__}); connect, or pass a local folder") from None
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _remote_sizes(repo_id: str, revision: str, files: list[str]) -> dict[str, int] | None:
    """Sizes of files in the repo, or None when the hub cannot say (the check is then skipped)."""
    try:
        import huggingface_hub as hub
        infos = hub.HfApi().get_paths_info(repo_id, files, revision=revision)
        return {i.path: int(i.size) for i in infos if getattr(i, "size", None) is not None}
    except Exception:  # an optional check: never block a download on it
        return None


def _check_disk(repo_id: str, revision: str, files: list[str], cache_dir: Path) -> None:
    sizes = _remote_sizes(repo_id, revision, files)
    if not sizes:
        return
    from mtpchat.engine.units import fmt_bytes
    need = sum(sizes.values())
    where = Path(cache_dir)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise DiskFull(f"{repo_id} needs {fmt_bytes(need)} for {len(files)} file(s) but only "
                       f"{fmt_bytes(free)} is free on {where}; free some space or set HF_HUB_CACHE "
                       "to another disk")


# ---- listing ----------------------------------------------------------------------------------

def _is_supported(snapshot: Path) -> bool:
    try:
        raw = json.loads((snapshot / "config.json").read_text())
    except (OSError, ValueError):
        return True  # unknown yet: the completeness check reports the missing config
    types = {raw.get("model_type"), (raw.get("text_config") or {}).get("model_type")}
    return bool(types & {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


def list_models(cache_dir: Path | None = None) -> list[str]:
    """Lines for `mtpchat models`: the aliases, then what the local cache holds."""
    cache_dir = Path(cache_dir) if cache_dir else hubcache.hub_cache_dir()
    from mtpchat.engine.units import fmt_bytes
    cached = {r.repo_id: r for r in hubcache.cached_repos(cache_dir)}
    lines = ["aliases:"]
    name_w = max(len(a.name) for a in ALIASES.values()) + 2
    repo_w = max(len(a.repo_id) for a in ALIASES.values()) + 2
    fmt_w = max(len(label) for _, label in FORMATS.values()) + 2
    for alias in ALIASES.values():
        repo = cached.get(alias.repo_id)
        state = "" if repo is None else "  [cached]" if repo.check and repo.check.complete else "  [incomplete]"
        kind = f"MoE, {alias.moe[1]} of {alias.moe[0]} experts" if alias.moe else "dense"
        lines.append(f"  {alias.name:<{name_w}}{alias.repo_id:<{repo_w}}{FORMATS[alias.format][1]:<{fmt_w}}{kind}{state}")
    demo = "present" if DEMO_DIR.is_dir() else "not built"
    lines.append(f"  {'(default)':<{name_w}}the demo model in {DEMO_DIR} ({demo})")
    lines.append(f"local cache ({cache_dir}):")
    if not cached:
        lines.append("  nothing yet")
    for repo in cached.values():
        if repo.check is None:
            state = "no snapshot"
        elif not _is_supported(repo.snapshot):
            state = "not a Qwen3.5 / Qwen3.6 model"
        elif repo.check.complete:
            state = "ready" + ("" if repo.check.has_mtp else ", no MTP weights")
        else:
            state = "incomplete: " + repo.check.describe(3)
        lines.append(f"  {repo.repo_id:<32}{fmt_bytes(repo.size):>10}  {state}")
    return lines


# ---- managing the cache: `mtpchat pull` and `mtpchat rm` ------------------------------------------

def cache_target(spec: str) -> tuple[str, str]:
    """(what to show, repo id) of an alias or repo id; a folder is not the cache's to manage."""
    kind, target, alias = classify(spec)
    if kind == "folder":
        raise UserError(f"{spec} is a local folder, not a model in the Hugging Face cache; "
                        "pull and rm take an alias or an org/name repo id", exit_code=2)
    return (alias.name if alias else target), target


def pull(spec: str, *, offline: bool = False, revision: str = "main", cache_dir: Path | None = None,
         notify=None) -> str:
    """Download what mtpchat reads of `spec` into the cache (resuming an interrupted download: the
    library picks up its unfinished blobs); offline, only say whether the cache has it all. The
    line to print at the end."""
    from mtpchat.engine.units import fmt_bytes
    name, repo_id = cache_target(spec)
    got = resolve(spec, offline=offline, cache_dir=cache_dir, revision=revision, notify=notify)
    size = sum((got.path / f).stat().st_size for f in {*got.shards, *hubcache.CONFIG_FILES, *hubcache.TOKENIZER_FILES}
               if (got.path / f).is_file())
    mtp = "" if got.has_mtp else "; it has no MTP weights (runs with MTP off)"
    return f"{name}: ready, {fmt_bytes(size)} in {got.path}{mtp}"


def removal(spec: str, cache_dir: Path | None = None) -> tuple[str, hubcache.CachedRepo]:
    """(what deleting `spec` from the cache frees, said in a line; the cached repo)."""
    from mtpchat.engine.units import fmt_bytes
    name, repo_id = cache_target(spec)
    cache_dir = Path(cache_dir) if cache_dir else hubcache.hub_cache_dir()
    repo = next((r for r in hubcache.cached_repos(cache_dir) if r.repo_id == repo_id), None)
    if repo is None:
        raise ModelNotFound(f"{name} ({repo_id}) is not in the local cache ({cache_dir}); nothing to remove")
    revisions = f"{len(repo.revisions)} revision(s)" if repo.revisions else "no finished revision"
    partial = f" and {fmt_bytes(repo.partial)} of unfinished downloads" if repo.partial else ""
    return (f"{name}: {repo_id}, {revisions}, {fmt_bytes(repo.size)}{partial} in {repo.path}; "
            f"removing it frees {fmt_bytes(repo.size + repo.partial)}"), repo
