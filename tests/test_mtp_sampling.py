"""Lossless sampling with MTP: the acceptance rule on a fixed window and end to end, each with
negative controls (deliberately broken rules) that the same statistical tests must reject."""
import pytest
import torch

from mtpchat.engine import SamplingParams
from mtpchat.engine import decoder as decoder_module
from mtpchat.engine.sampling import process_logits, sample
from mtpchat.engine.spec import accept_sampled, seen_rows
from mtp_support import generate, load, random_ids, steps_of


# --- 3. lossless sampling ---------------------------------------------------------------------------
def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of counts [V] to probs [V]. A count where the probability is 0 rejects;
    cells expecting fewer than 5 are pooled so the chi-square approximation holds."""
    n = counts.sum()
    if n == 0:
        return 1.0
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = n * probs
    big = expected >= 5
    small = (probs > 0) & ~big
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1))
    return torch.special.gammaincc(df / 2, stat / 2).item() if df > 0 else 1.0


def oracle_probs(logits, seen, params):
    """The target's sampling distribution, written out for the parameters used here (float64)."""
    x = (logits.double() - params.presence_penalty * seen.double()) / params.temperature
    kth = x.topk(params.top_k, dim=-1).values[..., -1:]
    return x.masked_fill(x < kth, float("-inf")).softmax(-1)


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


E2E_PARAMS = SamplingParams(temperature=6.0, top_k=3, presence_penalty=6.0, max_tokens=4, stop_token_ids=())


class TreeDrafter:
    """Drafts the target's most likely token after the tokens generated so far (looked up in a
    precomputed tree), so drafts are accepted often and rejected often. `follow` is the
    generation's after-step hook: it tells the drafter what was emitted."""

    def __init__(self, table):
        self.table, self.emitted = table, ()

    def follow(self, steps):
        self.emitted = tuple(t for s in steps for t in s.token_ids)

    def __call__(self, position, drafts):
        assert position == len(self.emitted)
        prefix, out = self.emitted, []
        for i in range(drafts.shape[0]):
            out.append(self.table.get(prefix, int(drafts[i])))    # past the tree: the head's own draft
            prefix += (out[-1],)
        return torch.tensor(out)


def exact_first_tokens(e, prompt):
    """The target's exact joint distribution of the first three generated tokens, and the tree of
    most likely next tokens after each prefix of up to two tokens."""
    def dist(prefix):
        seen = torch.zeros(e.config.vocab_size, dtype=torch.bool)
        seen[list(prefix)] = True
        return oracle_probs(e.logits(prompt + list(prefix))[-1], seen, E2E_PARAMS)
    joint, table = {}, {}
    p1 = dist(())
    for t1 in p1.nonzero()[:, 0].tolist():
        p2 = dist((t1,))
        table[(t1,)] = int(p2.argmax())
        for t2 in p2.nonzero()[:, 0].tolist():
            p3 = dist((t1, t2))
            table[(t1, t2)] = int(p3.argmax())
            for t3 in p3.nonzero()[:, 0].tolist():
                joint[(t1, t2, t3)] = (p1[t1] * p2[t2] * p3[t3]).item()
    return joint, table


def first_tokens_pvalue(e, prompt, joint, trials, seed0):
    """Chi-square p-value of the first three tokens of `trials` seeded generations against the
    exact joint, and the set of accept counts the speculative steps saw."""
    cells, accepted = list(joint), set()
    counts = torch.zeros(len(cells) + 1, dtype=torch.float64)     # last cell: anything outside the support
    for t in range(trials):
        params = SamplingParams(**{**E2E_PARAMS.__dict__, "seed": seed0 + t})
        events = generate(e, prompt, params, after_step=e.drafter.follow)
        toks = tuple(events[-1].token_ids[:3])
        counts[cells.index(toks) if toks in joint else -1] += 1
        accepted |= {s.accepted for s in steps_of(events) if s.mtp}
    return chi2_pvalue(counts, torch.tensor([joint[c] for c in cells] + [0.0], dtype=torch.float64)), accepted


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
