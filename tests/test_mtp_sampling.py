"""Lossless sampling with MTP: the acceptance rule on a fixed window and end to end, each with
negative controls (deliberately broken rules) that the same statistical tests must reject."""
import pytest
import torch

from mtpchat.engine import SamplingParams
from mtpchat.engine import decoder as decoder_module
from mtpchat.engine.sampling import process_logits, sample
from mtpchat.engine.spec import accept_sampled, seen_rows
from helpers import random_ids
from mtp_support import (E2E_PARAMS, TreeDrafter, chi2_pvalue, exact_first_tokens, first_tokens_pvalue, generate, load,
                         oracle_probs)


# --- 3. lossless sampling ---------------------------------------------------------------------------
def splice(match, drafts, fallback):
    a = int(match.long().cumprod(0).sum())
    return torch.tensor([a]), torch.cat([drafts[:a], fallback[a:a + 1], drafts.new_zeros(len(drafts) - a)])


def accept_always(logits, drafts, params, seen, generator):
    probs = process_logits(logits, params, seen)
    return splice(torch.ones_like(drafts, dtype=torch.bool), drafts, sample(probs, generator))


def accept_without_removing_the_draft(logits, drafts, params, seen, generator):
    probs = process_logits(logits, params, seen)
    u = torch.rand(len(drafts), generator=generator)
    return splice(u < probs[:-1].gather(1, drafts[:, None])[:, 0], drafts, sample(probs, generator))


def accept_ignoring_drafts_in_penalty(logits, drafts, params, seen, generator):
    return accept_sampled(logits, drafts, params, seen[:1].expand_as(seen), generator)


UNIT_PARAMS = SamplingParams(temperature=0.9, top_k=6, presence_penalty=1.5)


def window_pvalue(rule, trials=6000, seed=0) -> float:
    """Emit from one fixed verify window many times; token i must follow the target's row i given
    that the drafts before it were accepted. Returns the combined chi-square p-value."""
    logits = torch.tensor([[0.2, 1.0, -0.5, 1.8, 0.0, 0.9, -1.0, 0.3],
                           [0.1, 0.4, 0.0, 2.0, 0.3, 1.5, -0.7, 0.6],     # d1 = 3 scores high: penalise it
                           [0.5, 1.6, -0.2, 1.0, 0.0, 1.2, 0.2, -1.0],
                           [0.3, -0.4, 1.1, 0.0, 0.6, -0.2, 0.9, 0.4]])
    V = logits.shape[1]
    drafts = torch.tensor([3, 5, 1])
    seen = torch.zeros(V, dtype=torch.bool)
    seen[[2, 7]] = True
    penalised = torch.zeros(4, V, dtype=torch.bool)           # row i also counts the drafts before it
    for i, tokens in enumerate([[2, 7], [2, 7, 3], [2, 7, 3, 5], [2, 7, 3, 5, 1]]):
        penalised[i, tokens] = True
    want = oracle_probs(logits, penalised, UNIT_PARAMS)
    assert all(0.1 < want[i, drafts[i]] < 0.9 for i in range(3)), "drafts must be neither sure nor hopeless"
    counts = torch.zeros(4, V, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        a, toks = rule(logits, drafts, UNIT_PARAMS, seen_rows(seen, drafts), gen)
        for i in range(int(a) + 1):        # token i is emitted when the drafts before it all passed
            counts[i, toks[i]] += 1
    stats = [chi2_pvalue(counts[i], want[i]) for i in range(4)]
    assert counts[3].sum() > 100                               # the bonus row is reached often enough
    return min(1.0, min(stats) * 4)                            # Bonferroni over the four positions


def test_acceptance_rule_is_lossless_on_a_fixed_window():
    assert window_pvalue(accept_sampled) > 1e-3


@pytest.mark.parametrize("broken", [accept_always, accept_without_removing_the_draft,
                                    accept_ignoring_drafts_in_penalty])
def test_window_test_rejects_broken_rules(broken):
    assert window_pvalue(broken) < 1e-6


@pytest.fixture(scope="module")
def first_tokens_setup(gqa3):
    e = load(gqa3, draft_tokens=2)
    prompt = random_ids(6, 42, e.config.vocab_size)
    joint, table = exact_first_tokens(e, prompt)
    e.drafter = TreeDrafter(table)
    return e, prompt, joint


def test_sampled_first_tokens_follow_the_target_with_mtp_on_and_off(first_tokens_setup):
    e, prompt, joint = first_tokens_setup
    assert abs(sum(joint.values()) - 1) < 1e-9 and len(joint) == 27
    e.mtp = True
    on, accepted = first_tokens_pvalue(e, prompt, joint, trials=800, seed0=0)
    assert accepted == {0, 1, 2}                     # rejections, partial and full windows all occurred
    e.mtp = False
    off, accepted = first_tokens_pvalue(e, prompt, joint, trials=300, seed0=10_000)
    e.mtp = True
    assert on > 1e-3 and off > 1e-3 and not accepted
    again = [generate(e, prompt, SamplingParams(**{**E2E_PARAMS.__dict__, "seed": 5, "max_tokens": 30}),
                      after_step=e.drafter.follow)[-1].token_ids for _ in range(2)]
    assert again[0] == again[1]                      # reproducible for a seed with MTP on


def test_first_tokens_test_rejects_a_broken_rule_end_to_end(first_tokens_setup, monkeypatch):
    e, prompt, joint = first_tokens_setup
    monkeypatch.setattr(decoder_module, "accept_sampled", accept_without_removing_the_draft)
    e.mtp = True
    assert first_tokens_pvalue(e, prompt, joint, trials=300, seed0=0)[0] < 1e-6
