"""Helpers shared by the MTP tests: loading, generating, drafters with a chosen acceptance,
snapshots of the decode state, and the statistics that tell a lossless sampling rule (the target's
exact distribution of a generation's first tokens, chi-square goodness of fit)."""
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.events import Step
from mtpchat.engine.sampling import process_logits, sample
from mtpchat.engine.spec import ProfileDrafter, accept_sampled
from mtpchat.kernels.conv import window_columns

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
    L, cols = s.length, window_columns(s.conv_off, s.kernel, s.conv_width)
    return dict(length=L, tokens=list(e.decoder.tokens),
                kv=[t[:L].clone() for pair in s.kv_layers for t in pair],
                conv=[buf.index_select(1, cols) for buf, _, _ in s.gdn_layers],
                state=s.gdn_committed(e.model, e.plan.any_stride))


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


# --- every sampling option: the float64 reference, broken acceptance rules, conditional tests -------
def reference_probs(logits: torch.Tensor, seen: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[T, V] logits, [T, V] bool tokens generated before each row -> [T, V] float64: the target's
    sampling distribution written out from SamplingParams' documented pipeline, apart from
    engine/sampling.py: presence penalty, temperature, top-k (ties at the k-th logit kept), top-p
    (the most likely tokens until their mass reaches top_p), min-p (a floor at min_p times the
    likeliest token's probability), renormalized after each filter."""
    x = logits.double().cpu() - params.presence_penalty * seen.double().cpu()
    x = x / params.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.top_k:
        kth = x.sort(-1, descending=True).values[:, params.top_k - 1:params.top_k]
        keep &= x >= kth
    p = torch.where(keep, (x - x.max(-1, keepdim=True).values).exp(), 0.0)
    p = p / p.sum(-1, keepdim=True)
    if params.top_p < 1:
        for row in range(p.shape[0]):
            values, order = p[row].sort(descending=True)
            mass = 0.0
            for j, v in enumerate(values.tolist()):
                if mass >= params.top_p:
                    keep[row, order[j:]] = False
                    break
                mass += v
        p = torch.where(keep, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if params.min_p:
        p = torch.where(p >= params.min_p * p.max(-1, keepdim=True).values, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def _emit(accept: torch.Tensor, drafts: torch.Tensor, fallback: torch.Tensor):
    """The drafts before the first rejection, then fallback[a] (the test's own splice)."""
    k = drafts.shape[0]
    a = accept.long().cumprod(0).sum().view(1)
    idx = torch.arange(k + 1, device=drafts.device)
    return a, torch.where(idx < a, torch.cat([drafts, drafts[-1:]]), fallback.gather(0, a.expand(k + 1)))


def _draft_probs(probs, drafts):
    return probs[:-1].gather(1, drafts[:, None])[:, 0]


def _without_drafts(probs, drafts):
    residual = probs.clone()
    residual[:-1].scatter_(1, drafts[:, None], 0.0)
    return residual / residual.sum(-1, keepdim=True).clamp_min(1e-30)


def accept_always(logits, drafts, params, seen, generator):
    """Broken: every draft kept, the bonus from p_k."""
    probs = process_logits(logits, params, seen)
    return _emit(torch.ones_like(drafts, dtype=torch.bool), drafts, sample(probs, generator))


def residual_keeps_the_draft(logits, drafts, params, seen, generator):
    """Broken: at a rejection, a draw from p_i itself (the rejected draft can come back)."""
    probs = process_logits(logits, params, seen)
    u = torch.rand(drafts.shape[0], device=probs.device, generator=generator)
    return _emit(u < _draft_probs(probs, drafts), drafts, sample(probs, generator))


def unnormalized_residual_inverse_cdf(logits, drafts, params, seen, generator):
    """Broken: the residual p_i without d_{i+1} left unnormalized and drawn by inverse CDF, so the
    draws past its mass fall on the last token id."""
    probs = process_logits(logits, params, seen)
    u = torch.rand(drafts.shape[0], device=probs.device, generator=generator)
    residual = probs.clone()
    residual[:-1].scatter_(1, drafts[:, None], 0.0)
    v = torch.rand(residual.shape[0], 1, device=probs.device, generator=generator)
    fallback = torch.searchsorted(residual.cumsum(-1), v)[:, 0].clamp(max=residual.shape[1] - 1)
    return _emit(u < _draft_probs(probs, drafts), drafts, fallback)


def bonus_from_the_previous_row(logits, drafts, params, seen, generator):
    """Broken: the bonus token after k accepted drafts drawn from p_{k-1} instead of p_k."""
    probs = process_logits(logits, params, seen)
    u = torch.rand(drafts.shape[0], device=probs.device, generator=generator)
    residual = _without_drafts(probs, drafts)
    residual[-1] = probs[-2]
    return _emit(u < _draft_probs(probs, drafts), drafts, sample(residual, generator))


def filters_after_the_acceptance_test(logits, drafts, params, seen, generator):
    """Broken: drafts accepted by the distribution before top-k/top-p/min-p; the residual and the
    bonus drawn from the filtered one."""
    plain = SamplingParams(temperature=params.temperature, presence_penalty=params.presence_penalty)
    unfiltered, probs = process_logits(logits, plain, seen), process_logits(logits, params, seen)
    u = torch.rand(drafts.shape[0], device=probs.device, generator=generator)
    return _emit(u < _draft_probs(unfiltered, drafts), drafts, sample(_without_drafts(probs, drafts), generator))


def temperature_twice(logits, drafts, params, seen, generator):
    """Broken: the logits divided by the temperature before the pipeline divides them again."""
    return accept_sampled(logits / params.temperature, drafts, params, seen, generator)


def drafts_not_penalised(logits, drafts, params, seen, generator):
    """Broken: every row penalises only the tokens generated before the window, not the drafts."""
    return accept_sampled(logits, drafts, params, seen[:1].expand_as(seen), generator)


BROKEN_RULES = (accept_always, residual_keeps_the_draft, unnormalized_residual_inverse_cdf,
                bonus_from_the_previous_row, filters_after_the_acceptance_test, temperature_twice,
                drafts_not_penalised)


def detectable_shift(n: float, p: float, alpha: float, z_power: float = 1.2816) -> float:
    """The smallest change of a cell of probability p that n draws detect at level alpha with
    power 0.9 (z_power), by the normal approximation of that cell's count: the power analysis the
    docstrings state."""
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - alpha / 2, dtype=torch.float64)).item()
    return (z + z_power) * (p * (1 - p) / n) ** 0.5


class Recording:
    """An acceptance rule that records the drafts of every speculative step, then applies `rule`."""

    def __init__(self, rule):
        self.rule, self.drafts = rule, []

    def __call__(self, logits, drafts, params, seen, generator):
        self.drafts.append(tuple(drafts.tolist()))
        return self.rule(logits, drafts, params, seen, generator)


def first_windows(e, prompt, params, runs: int, seed0: int, rule=accept_sampled) -> list[tuple]:
    """`runs` seeded generations with `rule` accepting, each read up to its first speculative step
    (the engine's k drafts, the token limit leaving room for all of them and the bonus): per run
    (tokens, drafts, accepted), tokens = the first token then the step's a+1. The state is kept at
    the prompt's last token, so a run prefills one token."""
    recording, out = Recording(rule), []
    e.decoder.accept_rule = recording
    try:
        for r in range(runs):
            p = SamplingParams(**{**params.__dict__, "seed": seed0 + r, "max_tokens": e.draft_tokens + 2,
                                  "stop_token_ids": ()})
            events = e.generate(prompt, p, snapshot_at=(len(prompt) - 1,))
            tokens = []
            for ev in events:
                if isinstance(ev, Step):
                    tokens += ev.token_ids
                    if ev.mtp:
                        assert ev.drafted == e.draft_tokens
                        out.append((tuple(tokens), recording.drafts[-1], ev.accepted))
                        break
            events.close()
    finally:
        e.decoder.accept_rule = accept_sampled
    return out


class ExactRows:
    """The target's exact sampling distribution after the prompt and each prefix of generated
    tokens (reference_probs of the model's own scores, from a separate full forward), cached."""

    def __init__(self, e, prompt, params):
        self.e, self.prompt, self.params, self.rows = e, list(prompt), params, {}

    def __call__(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self.rows:
            logits = self.e.logits(self.prompt + list(prefix))[len(self.prompt) - 1:]     # [len(prefix)+1, V]
            seen = torch.zeros(logits.shape, dtype=torch.bool)
            for i, t in enumerate(prefix):
                seen[i + 1:, t] = True                 # the presence penalty counts generated tokens
            probs = reference_probs(logits, seen, self.params)
            for i in range(len(prefix) + 1):
                self.rows.setdefault(prefix[:i], probs[i])
        return self.rows[prefix]


def window_tests(windows, exact: ExactRows, seed: int = 0) -> dict[str, float]:
    """p-values of the tokens of `windows` (first_windows) against `exact`, each token given the
    tokens before it:
    - `support`: 0 when a token of probability 0 was emitted, else 1;
    - `draft`: how often a speculative token equals its draft, against the sum of the drafts'
      probabilities (a z-test: most broken rules move mass onto or off the draft);
    - `first`, `window`, `bonus`: a randomized probability integral transform of the first
      (plain) tokens, of the step's tokens that had a draft, and of its bonus tokens (the token
      after k accepted drafts), each uniform under the exact rule (a chi-square over 10 bins).
    Each token's group is fixed before it is drawn, so within a group the transforms are i.i.d.
    uniform and the draft indicators martingale differences."""
    gen = torch.Generator().manual_seed(seed)
    pit = {"first": [], "window": [], "bonus": []}
    hits = expected = variance = 0.0
    for tokens, drafts, a in windows:
        k = len(drafts)
        for j, t in enumerate(tokens):
            probs = exact(tokens[:j])
            if probs[t] == 0:
                return {"support": 0.0}
            group = "first" if j == 0 else "bonus" if j == k + 1 else "window"
            if group == "window":
                p = probs[drafts[j - 1]].item()
                hits, expected, variance = hits + (t == drafts[j - 1]), expected + p, variance + p * (1 - p)
            ranked = probs.argsort(descending=True, stable=True)
            sorted_p = probs[ranked]
            at = int((ranked == t).nonzero()[0, 0])
            below = sorted_p[:at].sum().item()
            pit[group].append(below + torch.rand(1, generator=gen, dtype=torch.float64).item() * probs[t].item())
    out = {"support": 1.0}
    z = (hits - expected) / max(variance, 1e-12) ** 0.5
    out["draft"] = torch.special.erfc(torch.tensor(abs(z) / 2 ** 0.5, dtype=torch.float64)).item()
    for group, u in pit.items():
        counts = torch.bincount((torch.tensor(u, dtype=torch.float64) * 10).long().clamp(0, 9), minlength=10).double()
        out[group] = chi2_pvalue(counts, torch.full((10,), 0.1, dtype=torch.float64))
    return out


def two_sample_pvalue(a: list, b: list) -> float:
    """Chi-square test that two samples of hashable outcomes come from one distribution: a 2 x C
    contingency table whose cells are the outcomes seen at least 10 times in both samples together,
    the rest pooled into one cell."""
    both = {}
    for x in a + b:
        both[x] = both.get(x, 0) + 1
    common = [x for x, n in both.items() if n >= 10]
    index = {x: i for i, x in enumerate(common)}
    table = torch.zeros(2, len(common) + 1, dtype=torch.float64)
    for row, sample_ in enumerate((a, b)):
        for x in sample_:
            table[row, index.get(x, len(common))] += 1
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = torch.tensor(float(table.shape[1] - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()
