"""The trimmed draft vocabulary (engine/draft_vocab.py): which tokens, the head's argmax over them,
its memory counted in the plan, greedy output equal to MTP off (with adaptive k too) and sampling
still lossless when the drafts come from the subset; on the demo model, drafts really accepted."""
from pathlib import Path

import pytest
import torch

from mtpchat.engine import Engine, SamplingParams, memory
from mtpchat.engine.draft_vocab import DEFAULT_DRAFT_VOCAB, draft_token_ids, draft_vocab_size, ranked_tokens
from mtpchat.engine.events import Finished
from mtpchat.engine.policy import AdaptiveK
from mtpchat.engine.tiny import write_tiny_checkpoint
from mtp_support import generate, load, random_ids, steps_of
from test_mtp_sampling import E2E_PARAMS, TreeDrafter, chi2_pvalue, exact_first_tokens, first_tokens_pvalue
from test_policy import GPU_LIKE

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"


def test_size_clamps_to_the_full_head():
    assert draft_vocab_size(248320, DEFAULT_DRAFT_VOCAB) == 32768
    assert draft_vocab_size(4096, DEFAULT_DRAFT_VOCAB) == 0          # a small vocabulary: the full head
    assert draft_vocab_size(4096, 4096) == draft_vocab_size(4096, 0) == draft_vocab_size(4096, None) == 0
    assert draft_vocab_size(4096, 1000) == 1000


def test_ranking_puts_added_tokens_then_counted_ones_first(gqa3):
    e = load(gqa3, mtp=False)
    tok, V = e.tokenizer, e.config.vocab_size
    text = "def f(x):\n    return x + 1\n" * 50 + "the end"
    ranked = ranked_tokens(tok, V, [text])
    assert sorted(ranked) == list(range(V))                          # every id once
    added = [i for i in tok.added_token_ids if i < V]
    assert len(added) >= 4 and ranked[:len(added)] == sorted(added)
    counted = set(tok.encode(text)) - set(added)
    assert set(ranked[len(added):len(added) + len(counted)]) == counted
    rest = ranked[len(added) + len(counted):]
    assert rest == sorted(rest)                                      # then by id
    ids = draft_token_ids(tok, V, 64, [text])
    assert ids == sorted(ids) and len(set(ids)) == 64 and tok.im_end_id in ids and tok.think_end_id in ids
    assert draft_token_ids(None, 1000, 10) == list(range(10))        # random weights: the first ids


@pytest.fixture(scope="module")
def trimmed(gqa3):
    return load(gqa3, draft_tokens=4, draft_vocab=96)


def test_draft_is_the_argmax_over_the_subset(trimmed):
    e, dec = trimmed, trimmed.decoder
    w, ids = dec.draft_head
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
    assert full.decoder.draft_head is None
    assert trimmed.memory()["weights"] - full.memory()["weights"] == (96 + 16) * (trimmed.config.hidden_size * 4 + 8)


def test_greedy_exact_with_trimmed_head_and_adaptive_k(gqa3, trimmed):
    off = load(gqa3, mtp=False)
    trimmed.adaptive = True
    for i, n in enumerate((5, 33, 70)):
        ids = random_ids(n, 500 + i, off.config.vocab_size)
        ref = list(generate(off, ids)[-1].token_ids)
        trimmed.policy = AdaptiveK(4, costs=GPU_LIKE)
        events = generate(trimmed, ids)
        assert list(events[-1].token_ids) == ref
        assert any(s.drafted for s in steps_of(events))
    trimmed.adaptive = False


def test_sampling_stays_lossless_with_drafts_from_the_subset(gqa3):
    e = load(gqa3, draft_tokens=2, draft_vocab=160)
    prompt = random_ids(6, 42, e.config.vocab_size)
    joint, table = exact_first_tokens(e, prompt)
    subset = set(e.decoder.draft_head[1].tolist())
    # the tree's likeliest tokens where the subset has them, else the trimmed head's own draft
    tree = {prefix: t for prefix, t in table.items() if t in subset}
    assert 0 < len(tree) < len(table)
    e.drafter = TreeDrafter(tree)
    p, accepted = first_tokens_pvalue(e, prompt, joint, trials=500, seed0=0)
    assert p > 1e-3 and {0, 1} <= accepted


@pytest.mark.parametrize("size", [1024])
def test_demo_trimmed_head_keeps_its_acceptance(size):
    """The demo model drafts from a quarter of its vocabulary about as well as from all of it."""
    lengths = {}
    for rows in (0, size):
        e = Engine.load(DEMO, device="cpu", dtype=torch.float32, max_context=512, draft_vocab=rows)
        e.mtp, e.draft_tokens = True, 3
        ids = e.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments")
        e.reset()
        done = [ev for ev in e.generate(ids, SamplingParams(max_tokens=48, stop_token_ids=())) if isinstance(ev, Finished)]
        lengths[rows] = done[0].stats.mean_acceptance_length
    assert lengths[0] > 1.8 and lengths[size] > 0.9 * lengths[0], lengths


def test_context_rows_take_the_tokens_the_subset_lacks(gqa3):
    e = load(gqa3, draft_tokens=3, draft_vocab=64)
    dec = e.decoder
    w, ids = dec.draft_head
    outside = [t for t in range(e.config.vocab_size) if t not in dec.draft_set][:40]
    dec.draft_context(outside[:10] + [int(ids[0])] + outside[:3])       # repeats and subset tokens skipped
    assert ids[64:74].tolist() == outside[:10] and (ids[74:] == ids[0]).all()
    dec.draft_context(outside[10:30])                                    # 30 > 16 rows: the oldest go
    assert set(ids[64:].tolist()) == set(outside[14:30]) and torch.equal(w, e.model.head[ids])
    # the head drafts one of them when its logit is the largest
    h = e.model.head[outside[29]][None] * 50
    into = torch.zeros(1, dtype=torch.long)
    dec._greedy(h, into)
    assert into.item() == outside[29]
