"""The trimmed draft vocabulary (engine/draft_vocab.py): its size on any vocabulary (the default
on small and odd ones), which tokens (ranked by shipped data, never by the package's sources), the
head's argmax over them, its memory counted in the plan,
greedy output equal to MTP off (8 x 256 with adaptive k) and sampling still lossless when the drafts
come from the subset; the context rows, written without a host sync on CUDA; on the demo model,
the acceptance of the held-out prompts kept; the head kept in 4 bits (KernelPlan.draft_head_int4):
each row quantized on its own, context rows too, output still MTP off's, the demo's acceptance
kept."""
import builtins
import io
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from mtpchat.engine import Engine, SamplingParams, draft_vocab, memory
from mtpchat.engine.bench import real_acceptance
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.draft_vocab import (DEFAULT_DRAFT_VOCAB, PIECES, context_rows, draft_token_ids,
                                        draft_vocab_bytes, draft_vocab_size, ranked_tokens, shipped_pieces)
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.policy import AdaptiveK
from mtpchat.engine.tokenizer import Tokenizer
from mtpchat.kernels import int4
from mtpchat.kernels.forms import dense_ref
from tools.draft_rank import count_pieces, sources
from tools.tiny import write_tiny_checkpoint
from helpers import GPU_LIKE, random_ids
from mtp_support import (ALL_RIGHT, MID_PROFILE, TreeDrafter, exact_first_tokens, first_tokens_pvalue, generate, load,
                         profile_drafter)

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"


def test_size_clamps_to_the_full_head():
    assert draft_vocab_size(248320, DEFAULT_DRAFT_VOCAB) == 32768
    assert draft_vocab_size(4096, DEFAULT_DRAFT_VOCAB) == 0          # a small vocabulary: the full head
    assert draft_vocab_size(4096, 4096) == draft_vocab_size(4096, 0) == draft_vocab_size(4096, None) == 0
    assert draft_vocab_size(4096, -5) == 0 and draft_vocab_size(4096, 1000) == 1000
    # a trimmed head (subset + context rows) as large as the vocabulary saves nothing: the full head
    assert context_rows(32768) == 2048 and draft_vocab_size(33000, DEFAULT_DRAFT_VOCAB) == 0
    assert draft_vocab_size(34817, DEFAULT_DRAFT_VOCAB) == 32768 and draft_vocab_size(34816, DEFAULT_DRAFT_VOCAB) == 0
    assert draft_vocab_size(523, 492) == 492 and draft_vocab_size(523, 493) == 0      # 492 + 30 < 523 <= 493 + 30
    assert draft_vocab_bytes(523, 493, 64 * 4) == 0 and draft_vocab_bytes(523, 492, 64 * 4) == (492 + 30) * (64 * 4 + 8)


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """A checkpoint whose vocabulary is odd and far below the default draft vocabulary."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("odd_vocab"), vocab_size=523, seed=3)


@pytest.mark.parametrize("asked, rows", [("default", 0), (None, 0), (0, 0), (1, 1), (7, 7), (100, 100),
                                         (492, 492), (493, 0), (523, 0), (10 ** 6, 0)])
def test_any_vocabulary_loads_and_stays_exact_with_no_flag(odd, asked, rows):
    """The default on a vocabulary smaller than it, and every size asked of an odd one (fewer rows
    than the added tokens, the largest that trims, the vocabulary itself, more): it loads, drafts
    and equals MTP off."""
    kw = {} if asked == "default" else {"draft_vocab": asked}
    e = load(odd, draft_tokens=3, adaptive=True, **kw)
    assert e.config.vocab_size == 523 and e.draft_vocab == rows
    assert (e.decoder.draft_rows is None) == (rows == 0)
    if rows:
        w, ids = e.decoder.draft_rows.w, e.decoder.draft_rows.ids
        assert w.shape == (rows + context_rows(rows), e.config.hidden_size)
        assert ids[:rows].tolist() == draft_token_ids(e.tokenizer, 523, rows)
    ids = random_ids(9, 77, 523)
    e.mtp = False
    ref = list(generate(e, ids)[-1].token_ids)
    e.mtp, e.policy = True, AdaptiveK(3, costs=GPU_LIKE)
    e.drafter = profile_drafter(ref, 0, e)
    events = generate(e, ids)
    assert list(events[-1].token_ids) == ref and events[-1].stats.drafted > 0
    e.drafter = None
    assert list(generate(e, ids)[-1].token_ids) == ref                  # the real head's drafts


def test_ranking_puts_added_tokens_then_counted_ones_first(gqa3):
    e = load(gqa3, mtp=False)
    tok, V = e.tokenizer, e.config.vocab_size
    text = "def f(x):\n    return x + 1\n" * 50 + "the end"
    ranked = ranked_tokens(tok, V, {text: 1})
    assert sorted(ranked) == list(range(V))                          # every id once
    added = [i for i in tok.added_token_ids if i < V]
    assert len(added) >= 4 and ranked[:len(added)] == sorted(added)
    counted = set(tok.encode(text)) - set(added)
    assert set(ranked[len(added):len(added) + len(counted)]) == counted
    rest = ranked[len(added) + len(counted):]
    assert rest == sorted(rest)                                      # then by id
    ids = draft_token_ids(tok, V, 64, {text: 1})
    assert ids == sorted(ids) and len(set(ids)) == 64 and tok.im_end_id in ids and tok.think_end_id in ids
    assert draft_token_ids(None, 1000, 10) == list(range(10))        # random weights: the first ids


def test_the_ranking_reads_its_data_and_no_source_file(gqa3, monkeypatch):
    """Which drafts the engine makes cannot move when a source file is edited or added: the ranking
    opens draft_pieces.json and nothing else, and gives what those counts give."""
    tok = Tokenizer.load(gqa3)
    V = tok.vocab_size
    opened, real_open = [], io.open

    def spy(file, *args, **kw):
        opened.append(Path(file))
        return real_open(file, *args, **kw)
    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    ids = draft_token_ids(tok, V, 64)
    monkeypatch.undo()
    assert opened == [PIECES]
    assert ids == draft_token_ids(tok, V, 64, json.loads(PIECES.read_text(encoding="utf-8"))["pieces"])
    assert len(ids) == 64 and tok.im_end_id in ids


@pytest.mark.parametrize("which", ["demo", "tiny"])
def test_pieces_count_what_the_whole_text_counts(gqa3, which):
    """Counted by pieces (draft_pieces.json's form) or by encoding the whole text, the tokens are the
    same: the shipped counts stand for the sample with any byte-level BPE."""
    tok = Tokenizer.load(DEMO if which == "demo" else gqa3)
    texts = [f.read_text(encoding="utf-8") for f in sources()[:3]]
    by_pieces = Counter()
    for piece, n in count_pieces(texts).items():
        for t in tok.encode(piece):
            by_pieces[t] += n
    assert by_pieces == Counter(t for text in texts for t in tok.encode(text))
    assert sum(shipped_pieces().values()) > 50_000 and len(shipped_pieces()) > 2_000


@pytest.fixture(scope="module")
def trimmed(gqa3):
    return load(gqa3, draft_tokens=4, draft_vocab=96)


def test_draft_is_the_argmax_over_the_subset(trimmed):
    e, dec = trimmed, trimmed.decoder
    w, ids = dec.draft_rows.w, dec.draft_rows.ids
    assert w.shape == (96 + 16, e.config.hidden_size) and w.is_contiguous() and ids.shape == (96 + 16,)
    assert torch.equal(w, e.model.head[ids])
    g = torch.Generator().manual_seed(0)
    full_pick = 0
    for _ in range(20):
        h = torch.randn(1, e.config.hidden_size, generator=g)
        into = torch.zeros(1, dtype=torch.long)
        dec._greedy(h, into)
        logits = (h @ e.model.head.T)[0]
        assert into.item() == ids[logits[ids].argmax()].item()
        full_pick += into.item() == logits.argmax().item()
    assert full_pick < 20                      # the subset changes some picks: the test can tell


def test_plan_counts_the_trimmed_head(gqa3, trimmed):
    plan = memory.plan_memory(trimmed.config, 512, 4, "float32", cuda_graphs=False, draft_vocab=96)
    assert plan.weights == trimmed.memory()["weights"]
    full = load(gqa3, draft_tokens=4, draft_vocab=0)
    assert full.decoder.draft_rows is None
    assert trimmed.memory()["weights"] - full.memory()["weights"] == (96 + 16) * (trimmed.config.hidden_size * 4 + 8)


def test_greedy_exact_with_trimmed_head_and_adaptive_k(gqa3, trimmed):
    """8 prompts x 256 tokens in float32: the trimmed head's own drafts (context rows filling up as
    tokens outside its 96 show up), and drafts of a chosen acceptance while the policy moves k
    between off and the maximum, equal MTP off token for token."""
    off = load(gqa3, mtp=False)
    params = SamplingParams(max_tokens=256, stop_token_ids=())
    profiles = (None, MID_PROFILE, (0.0,) * 4, ALL_RIGHT)
    ks, real_drafts = set(), 0
    try:
        trimmed.adaptive = True
        for i in range(8):
            ids = random_ids(5 + 13 * i, 500 + i, off.config.vocab_size)
            ref = list(generate(off, ids, params)[-1].token_ids)
            assert len(ref) == 256
            profile = profiles[i % len(profiles)]
            trimmed.policy = AdaptiveK(4, costs=GPU_LIKE)
            trimmed.drafter = profile_drafter(ref, i, trimmed, profile) if profile else None
            done = generate(trimmed, ids, params)[-1]
            assert list(done.token_ids) == ref, (i, profile)
            ks |= set(done.stats.k_histogram)
            real_drafts += done.stats.drafted if profile is None else 0
    finally:
        trimmed.drafter, trimmed.adaptive = None, False
    assert {0, 4} <= ks and len(ks) >= 3 and real_drafts > 0
    assert trimmed.decoder.draft_rows.ring                               # tokens outside the subset got rows


def test_sampling_stays_lossless_with_drafts_from_the_subset(gqa3):
    e = load(gqa3, draft_tokens=2, draft_vocab=160)
    prompt = random_ids(6, 42, e.config.vocab_size)
    joint, table = exact_first_tokens(e, prompt)
    subset = set(e.decoder.draft_rows.ids.tolist())
    # the tree's likeliest tokens where the subset has them, else the trimmed head's own draft
    tree = {prefix: t for prefix, t in table.items() if t in subset}
    assert 0 < len(tree) < len(table)
    e.drafter = TreeDrafter(tree)
    p, accepted = first_tokens_pvalue(e, prompt, joint, trials=500, seed0=0)
    assert p > 1e-3 and {0, 1} <= accepted


def test_demo_trimmed_head_in_float32_and_4_bits_keeps_its_acceptance():
    """On the demo model, over assets/heldout_prompts.jsonl with the real head: the default draft
    vocabulary is its whole 4,096-token head, and half of it (+ context rows) keeps the acceptance
    length within 2 %, in float32 and in 4 bits (the plan's draft_head_int4; measured over 128
    tokens a prompt: 3.018 and 3.048), every output equal to MTP off."""
    heldout = DEMO.parent / "heldout_prompts.jsonl"
    lengths = {}
    for rows, four in ((DEFAULT_DRAFT_VOCAB, False), (2048, False), (2048, True)):
        plan = four_bit_plan(DEMO) if four else None
        e = Engine.load(DEMO, device="cpu", dtype=torch.float32, max_context=1024, draft_vocab=rows, plan=plan)
        assert e.draft_vocab == (0 if rows == DEFAULT_DRAFT_VOCAB else rows)
        assert e.decoder.draft_rows is None if not e.draft_vocab else e.decoder.draft_rows.four_bit == four
        prompts = [e.tokenizer.encode(json.loads(line)["prompt"]) for line in heldout.read_text().splitlines() if line]
        assert len(prompts) == 8
        r = real_acceptance(e, prompts, 64, ks=(3,))[3]
        assert r["identical_to_mtp_off"], (rows, four)
        lengths[rows, four] = r["mean_acceptance_length"]
    full, trimmed, four_bit = lengths[DEFAULT_DRAFT_VOCAB, False], lengths[2048, False], lengths[2048, True]
    assert full > 2.5 and abs(trimmed / full - 1) <= 0.02 and abs(four_bit / trimmed - 1) <= 0.02, lengths


def test_context_rows_take_the_tokens_the_subset_lacks(gqa3):
    e = load(gqa3, draft_tokens=3, draft_vocab=64)
    dec = e.decoder
    w, ids = dec.draft_rows.w, dec.draft_rows.ids
    outside = [t for t in range(e.config.vocab_size) if t not in dec.draft_rows.subset][:40]
    dec.draft_context(outside[:10] + [int(ids[0])] + outside[:3])       # repeats and subset tokens skipped
    assert ids[64:74].tolist() == outside[:10] and (ids[74:] == ids[0]).all()
    dec.draft_context(outside[10:30])                                    # 30 > 16 rows: the oldest go
    assert set(ids[64:].tolist()) == set(outside[14:30]) and torch.equal(w, e.model.head[ids])
    # the head drafts one of them when its logit is the largest
    h = e.model.head[outside[29]][None] * 50
    into = torch.zeros(1, dtype=torch.long)
    dec._greedy(h, into)
    assert into.item() == outside[29]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_context_rows_are_written_without_a_host_sync(gqa3):
    """Between two steps in flight: a copy from pageable memory would wait for the one running."""
    e = Engine.load(gqa3, device="cuda", dtype=torch.bfloat16, max_context=256, draft_vocab=64, cuda_graphs=False)
    outside = context_rows_without_a_sync(e)
    w, ids = e.decoder.draft_rows.w, e.decoder.draft_rows.ids
    assert set(ids[64:].tolist()) == set(outside[4:20]) and torch.equal(w, e.model.head[ids])


def context_rows_without_a_sync(e) -> list[int]:
    """20 tokens outside the subset given context rows in two calls, any host sync an error; the
    tokens."""
    dec = e.decoder
    outside = [t for t in range(e.config.vocab_size) if t not in dec.draft_rows.subset][:20]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dec.draft_context(outside[:5])
        dec.draft_context(outside[5:20])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return outside


@pytest.fixture(scope="module")
def wide(tmp_path_factory):      # rows of 128 columns: a 4-bit head's group
    return write_tiny_checkpoint(tmp_path_factory.mktemp("wide"), hidden_size=128, seed=3)


def four_bit_plan(path, device="cpu", **changes) -> KernelPlan:
    return KernelPlan.choose(device, ModelConfig.load(path), fp8=False).replace(draft_head_int4=True, **changes)


@pytest.mark.parametrize("interleave, at_once", [(False, None), (True, None), (False, 3 * 128), (True, 5 * 128)])
def test_a_four_bit_draft_head_quantizes_each_row_on_its_own(wide, interleave, at_once, monkeypatch):
    """The trimmed head's rows in 4 bits (symmetric, groups of 128, interleaved where the plan stores
    4-bit weights so): quantize_ref of the head's rows bit for bit, also when they are quantized a
    few rows at a time (`at_once` weights: draft_vocab.QUANTIZE_AT_ONCE), the context rows written
    later too, a quarter of the bytes and less; the draft the argmax of the 4-bit rows' logits."""
    if at_once:
        monkeypatch.setattr(draft_vocab, "QUANTIZE_AT_ONCE", at_once)
    e = load(wide, draft_tokens=3, draft_vocab=64, plan=four_bit_plan(wide, int4_interleave=interleave))
    dec, rows = e.decoder, e.decoder.draft_rows

    def want():
        q = int4.quantize_ref(e.model.head[rows.ids])
        return int4.interleave_ref(q) if interleave else q
    assert rows.four_bit and isinstance(rows.w, int4.GroupInt4) and rows.w.interleaved == interleave
    assert rows.w.shape == (64 + 16, 128) and rows.w.group == int4.GROUP
    assert torch.equal(rows.w.w, want().w) and torch.equal(rows.w.scale, want().scale)
    outside = [t for t in range(e.config.vocab_size) if t not in rows.subset][:30]
    dec.draft_context(outside[:10])
    dec.draft_context(outside[10:30])                  # 30 > 16 rows: the oldest replaced
    assert set(rows.ids[64:].tolist()) == set(outside[14:30])
    assert torch.equal(rows.w.w, want().w) and torch.equal(rows.w.scale, want().scale)
    assert rows.nbytes() < (64 + 16) * (128 * 4 / 7 + 8)       # float32 rows: under a seventh, ids beside
    # what the memory plan counts for them on a GPU (draft_int4), exactly what the engine holds
    assert e.memory()["weights"] == memory.weight_bytes(e.config, "float32", draft_vocab=64, draft_int4=True)
    assert e.memory()["weights"] < memory.weight_bytes(e.config, "float32", draft_vocab=64)
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        h = torch.randn(1, 128, generator=g)
        into = torch.zeros(1, dtype=torch.long)
        dec._greedy(h, into)
        assert into.item() == rows.ids[(h @ dense_ref(rows.w).T)[0].argmax()].item()


def test_a_four_bit_draft_head_keeps_the_output(wide):
    """Greedy MTP on (k = 1..3) equal to MTP off, token for token, drafting from the 4-bit rows."""
    off = load(wide, mtp=False)
    e = load(wide, draft_tokens=3, draft_vocab=64, plan=four_bit_plan(wide))
    assert e.decoder.draft_rows.four_bit
    params = SamplingParams(max_tokens=96, stop_token_ids=())
    drafted = 0
    for i in range(3):
        ids = random_ids(7 + 5 * i, 900 + i, off.config.vocab_size)
        ref = list(generate(off, ids, params)[-1].token_ids)
        e.draft_tokens = i + 1
        done = generate(e, ids, params)[-1]
        assert list(done.token_ids) == ref, i
        drafted += done.stats.drafted
    assert drafted > 0


def test_rows_that_take_no_group_keep_the_head_as_it_is(gqa3):
    """A model whose rows are not whole groups of 128 (the tiny one's 64) keeps its bf16 rows under
    the plan: a default that would fail on it cannot."""
    e = load(gqa3, draft_tokens=2, draft_vocab=96, plan=four_bit_plan(gqa3))
    assert not e.decoder.draft_rows.four_bit and isinstance(e.decoder.draft_rows.w, torch.Tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_four_bit_head_on_the_gpu_writes_its_context_rows_without_a_host_sync(wide):
    """The 4-bit rows quantized on the device between two steps in flight without waiting for them,
    and greedy MTP on == off through CUDA graphs."""
    e = Engine.load(wide, device="cuda", dtype=torch.bfloat16, max_context=256, draft_vocab=64,
                    plan=four_bit_plan(wide, "cuda"))
    rows = e.decoder.draft_rows
    assert rows.four_bit
    outside = context_rows_without_a_sync(e)
    assert set(rows.ids[64:].tolist()) == set(outside[4:20])
    q = int4.quantize_ref(e.model.head[rows.ids])
    q = int4.interleave_ref(q) if rows.w.interleaved else q
    assert torch.equal(rows.w.w, q.w) and torch.equal(rows.w.scale, q.scale)
    off = Engine.load(wide, device="cuda", dtype=torch.bfloat16, max_context=256, mtp=False)
    params = SamplingParams(max_tokens=64, stop_token_ids=())
    for i in range(2):
        ids = random_ids(9 + 4 * i, 950 + i, off.config.vocab_size)
        assert list(generate(e, ids, params)[-1].token_ids) == list(generate(off, ids, params)[-1].token_ids)
