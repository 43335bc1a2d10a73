"""Helpers shared by the MTP tests: loading, generating, drafters with a chosen acceptance,
snapshots of the decode state, and the statistics that tell a lossless sampling rule (the target's
exact distribution of a generation's first tokens, chi-square goodness of fit)."""
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.events import Step
from mtpchat.engine.spec import ProfileDrafter

N_PROMPTS, NEW_TOKENS = 20, 100
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=())
MID_PROFILE = (0.8, 0.6, 0.4, 0.25)      # every accept count 0..4 shows up often
ALL_RIGHT = (1.0, 1.0, 1.0, 1.0)         # every draft is the true token: windows of k+1 tokens


def load(path, **kw) -> Engine:
    return Engine.load(path, prefill_chunk=48, max_context=512, **kw)


def generate(e, ids, params=GREEDY, after_step=None) -> list:
    """A fresh generation; `after_step(steps)` runs between events, while the generator is live."""
    e.reset()
    events, steps = [], []
    for ev in e.generate(ids, params):
        events.append(ev)
        if isinstance(ev, Step):
            steps.append(ev)
            if after_step:
                after_step(steps)
    return events


def steps_of(events):
    return [ev for ev in events if isinstance(ev, Step)]


def window_sizes(steps, k, max_tokens):
    """(drafted, mtp) each speculative step must show: k drafts, shrunk near the token limit so a
    window never overshoots it (steps[0] is the token sampled after prefill)."""
    rooms = [max_tokens - sum(len(s.token_ids) for s in steps[:j + 1]) for j in range(len(steps) - 1)]
    return [(min(k, r - 1), r > 1) for r in rooms]


def profile_drafter(ref, seed, e, profile=MID_PROFILE):
    return ProfileDrafter(ref, profile, seed=seed, vocab=e.config.vocab_size)


class WindowDrafter:
    """Proposes the true continuation for exactly schedule[i] positions at its i-th call, then
    wrong tokens, so the i-th speculative step accepts exactly schedule[i] drafts."""

    def __init__(self, reference, schedule, vocab):
        self.reference, self.schedule, self.vocab, self.calls = reference, list(schedule), vocab, 0

    def __call__(self, position, drafts):
        a = self.schedule[self.calls % len(self.schedule)]
        self.calls += 1
        true = self.reference[position:position + drafts.shape[0]]
        return torch.tensor([t if i < a else (t + 1) % self.vocab for i, t in enumerate(true)])


# --- state snapshots ------------------------------------------------------------------------------
def snapshot(e):
    """What the next token depends on: committed KV, the committed conv columns, the committed
    recurrent state, and the tokens fed so far."""
    s = e.state
    L, off, K = s.length, int(s.conv_off), s.kernel
    return dict(length=L, tokens=list(e.decoder.tokens),
                kv=[t[:L].clone() for pair in s.kv_layers for t in pair],
                conv=[buf[:, off:off + K - 1].clone() for buf, _, _ in s.gdn_layers],
                state=s.gdn_committed(e.model))


def assert_same_state(got, want):
    assert (got["length"], got["tokens"]) == (want["length"], want["tokens"])
    assert len(got["tokens"]) == got["length"]
    for part in ("kv", "conv", "state"):
        assert len(got[part]) == len(want[part]) > 0
        for a, b in zip(got[part], want[part]):
            assert b.abs().max() > 0, f"{part}: a reference state of zeros proves nothing"
            same = torch.equal(a, b)
            assert same, f"{part} differs by {(a - b).abs().max().item():.3g}"


def sequential_state(path, prompt, emitted, stop=()):
    """Reference: MTP off, the prompt prefilled, then one decode step per token. Greedy MTP-off
    generation emits `emitted` and feeds all but its last token, as the speculative run did."""
    e = load(path, mtp=False)
    done = generate(e, prompt, SamplingParams(max_tokens=len(emitted), stop_token_ids=tuple(stop)))[-1]
    assert list(done.token_ids) == list(emitted)
    return snapshot(e)


# --- lossless sampling -----------------------------------------------------------------------------
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
