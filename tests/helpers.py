"""What the tests share: seeded random prompts, one relative error, a fresh greedy generation, the
check that greedy MTP on emits exactly MTP off's tokens, the GPU tests' tiny shapes and a
GPU-like cost table for the draft policy, and the CLI's isolated environment.

Test modules import from here (and from mtp_support, serve_support, kernels/kernel_checks,
app/apphelpers), never from one another (tests/test_layers_tests.py checks it). tests/ is on
sys.path for every test, tests/kernels' and tests/app's too: pytest's default import mode puts the
folder of tests/conftest.py (a folder without __init__.py) there."""
import hashlib
import math
from pathlib import Path

import pytest
import torch

from mtpchat import hubcache
from mtpchat.engine import SamplingParams
from mtpchat.engine.spec import ProfileDrafter

# The chunked GDN's plan forms in float32 and tf32 (KernelPlan.chunk_*), for GPU tests of other
# paths' parity: the plan's bf16 forms have a test of their own (test_gpu_engine.py)
FLOAT32_CHUNK = dict(chunk_solved="float32", chunk_terms="float32", chunk_products="tf32", chunk_prep_products="tf32")

# The GPU tests' dense model: head_dim and the GDN head dims are powers of two, as the kernels
# require (and the real models have)
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
                 linear_key_head_dim=32, linear_value_head_dim=32)
# ... and their MoE model: FP8 experts need their parts on whole 128-row blocks
GPU_MOE_SHAPE = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                     linear_value_head_dim=64, num_experts=24, num_experts_per_tok=4, moe_intermediate_size=128,
                     shared_expert_intermediate_size=128)

# a 27B-like device for the draft policy: verify k costs 0.6 % more per token, a draft step 2.5 %
# of a decode step
GPU_LIKE = [1.0 + 0.031 * k for k in range(5)]


def random_ids(n: int, seed: int, vocab: int) -> list[int]:
    """n token ids below `vocab`, the same for a seed on every machine."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def gpu_prompts(engine, n: int) -> list[list[int]]:
    """The GPU tests' n prompts of 5, 28, 51, ... ids from one seeded stream (below the tiny
    vocabulary's last 64 ids)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, engine.config.vocab_size - 64, (5 + 23 * i,), generator=g).tolist() for i in range(n)]


def rel_err(got: torch.Tensor, want: torch.Tensor, ord: float = math.inf) -> float:
    """|got - want| / |want| over all elements, in float64 on the CPU: the largest difference over
    the largest value by default (ord=inf), the Frobenius norms with ord=2."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    norm = lambda t: torch.linalg.vector_norm(t, ord)
    return (norm(got - want) / norm(want).clamp_min(1e-300)).item()


def record_forms(model, into: list):
    """Hook the target `model` so that each forward appends (tokens, form) to `into`: "step" (a
    decode or verify), "graph" (a prefill chunk started on the device, engine/decoder.py) or None
    (an eager prefill chunk). Returns the hook's handle."""
    def hook(module, args):
        ctx = args[2]
        into.append((args[0].shape[0], "step" if ctx.step else
                     "graph" if isinstance(ctx.start, torch.Tensor) else None))
    return model.register_forward_pre_hook(hook)


def first_diff(a, b) -> int:
    """The first index where two token lists differ (the shorter one's length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy(engine, ids, n: int, mtp: bool = False, k: int = 3, drafter=None):
    """A fresh greedy generation of n tokens (no stop ids): MTP off, or on with k drafts from the
    head or from `drafter`. Returns the Finished event."""
    engine.reset()
    engine.mtp, engine.draft_tokens, engine.drafter = mtp, k, drafter
    try:
        return list(engine.generate(ids, SamplingParams(max_tokens=n, stop_token_ids=())))[-1]
    finally:
        engine.drafter = None


def greedy_tokens(engine, ids, n: int, mtp: bool = False, k: int = 3, drafter=None) -> list[int]:
    return list(greedy(engine, ids, n, mtp, k, drafter).token_ids)


def assert_mtp_on_equals_off(engine, prompts, n: int, ks=(1, 2, 3, 4), profile_ks=()) -> list:
    """Greedy MTP on emits exactly MTP off's n tokens for every prompt: first with drafts of a
    chosen acceptance (ProfileDrafter, seed 10 i + k) at each k of `profile_ks`, then with the
    head's own drafts at each k of `ks`. Every run is fresh; every divergence is listed (prompt,
    k, drafter, first differing token). Returns the MTP-on runs' Finished events, in that order."""
    runs, wrong = [], []
    for i, ids in enumerate(prompts):
        ref = greedy_tokens(engine, ids, n)
        tries = [(k, ProfileDrafter(ref, seed=10 * i + k, vocab=engine.config.vocab_size)) for k in profile_ks]
        for k, drafter in tries + [(k, None) for k in ks]:
            done = greedy(engine, ids, n, mtp=True, k=k, drafter=drafter)
            runs.append(done)
            got = list(done.token_ids)
            if got != ref:
                j = first_diff(got, ref)
                wrong.append(f"prompt {i} ({len(ids)} ids), k={k}, {'profile' if drafter else 'head'} drafts: "
                             f"token {j} is {got[j:j + 1]}, MTP off's {ref[j:j + 1]}")
    assert not wrong, "greedy MTP on differs from MTP off:\n" + "\n".join(wrong)
    return runs


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A settings file (empty: the defaults) and a hub cache of the test's own, for every test of a
    module that imports it."""
    (tmp_path / "settings.toml").touch()
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(tmp_path / "settings.toml"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for var in ("HF_HUB_OFFLINE", "MTPCHAT_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)


def put_in_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str) -> Path:
    """Store files in a Hugging Face cache the way huggingface_hub does: blobs by hash, snapshot
    symlinks, refs/main; returns the snapshot folder."""
    repo = hubcache.repo_folder(cache, repo_id)
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        link = snap / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path("../../blobs") / digest)
    return snap
