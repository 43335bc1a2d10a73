"""MTP self-speculative decoding on tiny random checkpoints (CPU, float32): greedy output identical
to MTP off, state after a rollback identical to feeding the same tokens one at a time, lossless
sampling (with negative controls that must be caught), the draft head against a from-scratch
implementation, EOS and the token limit inside an accepted window, checkpoints without mtp.*.

On random weights the head's own drafts are almost never accepted, so most tests also replace them
with the true continuation at a chosen acceptance (ProfileDrafter, or the small drafters below).
"""
import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine import decoder as decoder_module
from mtpchat.engine.events import Prefilled, Step
from mtpchat.engine.sampling import process_logits, sample
from mtpchat.engine.spec import ProfileDrafter, accept_sampled, seen_rows
from mtpchat.engine.tiny import write_tiny_checkpoint

N_PROMPTS, NEW_TOKENS = 20, 100
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=())
MID_PROFILE = (0.8, 0.6, 0.4, 0.25)      # every accept count 0..4 shows up often
ALL_RIGHT = (1.0, 1.0, 1.0, 1.0)         # every draft is the true token: windows of k+1 tokens


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the tiny model is all per-op overhead: one thread is several times faster on a shared CPU
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gqa3(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gqa3"), seed=0)    # Hv/Hk = 6/2 = 3, untied


@pytest.fixture(scope="module")
def tied(tmp_path_factory):   # Hv/Hk = 2, tied head, two full-attention layers
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tied"), tie=True, linear_num_value_heads=4,
                                 num_hidden_layers=8, seed=1)


def load(path, **kw) -> Engine:
    return Engine.load(path, prefill_chunk=48, max_context=512, **kw)


def random_ids(n, seed, vocab):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


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
    L, off, slot, K = s.length, int(s.conv_off), int(s.slot), s.kernel
    return dict(length=L, tokens=list(e.decoder.tokens),
                kv=[t[:L].clone() for pair in s.kv_layers for t in pair],
                conv=[buf[:, off:off + K - 1].clone() for buf, _ in s.gdn_layers],
                ring=[ring[slot].clone() for _, ring in s.gdn_layers])


def assert_same_state(got, want):
    assert (got["length"], got["tokens"]) == (want["length"], want["tokens"])
    assert len(got["tokens"]) == got["length"]
    for part in ("kv", "conv", "ring"):
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


# --- 1. greedy exactness ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_refs(gqa3):
    e = load(gqa3, mtp=False)
    lengths = [1, 2, 3, 5, 8, 13, 21, 30, 40, 47, 48, 49, 50, 55, 63, 64, 65, 70, 77, 97][:N_PROMPTS]
    prompts = [random_ids(n, 1000 + i, e.config.vocab_size) for i, n in enumerate(lengths)]
    refs = [list(generate(e, ids)[-1].token_ids) for ids in prompts]
    assert all(len(r) == NEW_TOKENS for r in refs) and len({tuple(r) for r in refs}) == N_PROMPTS
    return prompts, refs


@pytest.mark.parametrize("drafter", ["profile", "head"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_mtp_on_equals_mtp_off(gqa3, greedy_refs, k, drafter):
    e = load(gqa3, draft_tokens=k)
    accepted_counts = set()
    for i, (ids, ref) in enumerate(zip(*greedy_refs)):
        e.drafter = profile_drafter(ref, i, e) if drafter == "profile" else None
        events = generate(e, ids)
        steps, done = steps_of(events), events[-1]
        assert list(done.token_ids) == ref, f"prompt {i} diverges at {first_diff(done.token_ids, ref)}"
        assert [t for s in steps for t in s.token_ids] == ref
        spec = steps[1:]
        assert [(s.drafted, s.mtp) for s in spec] == window_sizes(steps, k, NEW_TOKENS)
        assert done.stats.accepted == sum(s.accepted for s in spec)
        assert done.stats.drafted == sum(s.drafted for s in spec)
        assert done.stats.verify_steps == sum(s.mtp for s in spec)
        accepted_counts |= {s.accepted for s in spec}
    if drafter == "profile":
        assert accepted_counts == set(range(k + 1))        # every outcome of a window was exercised


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("drafter", ["profile", "head"])
def test_greedy_exact_while_switching_mtp_and_k_mid_generation(gqa3, greedy_refs, drafter):
    e = load(gqa3, draft_tokens=3)
    longest_off = 0
    for i, (ids, ref) in enumerate(zip(*greedy_refs)):
        e.drafter = profile_drafter(ref, i, e) if drafter == "profile" else None
        rng, plan = random.Random(i), []
        e.mtp, e.draft_tokens = True, 3

        def switch(steps):
            # the setting in force for this step must be the one chosen after the previous step
            if plan:
                mtp, k = plan[-1]
                room = NEW_TOKENS - sum(len(s.token_ids) for s in steps[:-1])
                assert steps[-1].mtp == (mtp and room > 1)
                assert steps[-1].drafted == (min(k, room - 1) if mtp else 0)
            if rng.random() < 0.3:
                e.mtp = not e.mtp
            if rng.random() < 0.5:
                e.draft_tokens = rng.randint(1, 4)
            plan.append((e.mtp, e.draft_tokens))

        events = generate(e, ids, after_step=switch)
        assert list(events[-1].token_ids) == ref, f"prompt {i} diverges at {first_diff(events[-1].token_ids, ref)}"
        run = 0
        for mtp, _ in plan:
            run = 0 if mtp else run + 1
            longest_off = max(longest_off, run)
    # an MTP-off stretch longer than k_max+1 makes the head catch up over many rows at once
    assert longest_off > e.k_max + 1


# --- 2. rollback leaves exactly the state of one-at-a-time feeding ---------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("ckpt", ["gqa3", "tied"])
def test_state_after_accepting_a_drafts_equals_sequential_feeding(request, ckpt, k):
    path = request.getfixturevalue(ckpt)
    e = load(path, mtp=False)
    prompt = random_ids(50, 7 + k, e.config.vocab_size)           # prefill crosses a chunk boundary
    ref = list(generate(e, prompt, SamplingParams(max_tokens=60, stop_token_ids=()))[-1].token_ids)
    schedule = list(range(k, -1, -1)) + list(range(k + 1))        # every a in 0..k, after big and small ones
    e = load(path, draft_tokens=k)
    e.drafter = WindowDrafter(ref, schedule, e.config.vocab_size)
    seen, steps = [], []
    e.reset()
    gen = e.generate(prompt, SamplingParams(max_tokens=60, stop_token_ids=()))
    for ev in gen:
        steps += [ev] if isinstance(ev, Step) else []
        if isinstance(ev, Step) and ev.mtp:
            a = schedule[len(seen)]
            assert (ev.drafted, ev.accepted, ev.from_draft) == (k, a, (True,) * a + (False,))
            got = snapshot(e)
            emitted = [t for x in steps for t in x.token_ids]
            assert len(emitted) == 1 + sum(x + 1 for x in schedule[:len(seen) + 1])
            assert got["length"] == len(prompt) + len(emitted) - 1
            assert emitted == ref[:len(emitted)]
            assert int(e.state.slot) == a and int(e.state.conv_off) == a + 1   # committed by index, not copied
            assert_same_state(got, sequential_state(path, prompt, emitted))
            seen.append(a)
            if len(seen) == len(schedule):
                gen.close()
                break
    assert seen == schedule


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


# --- 4. the draft head against a from-scratch implementation of its formula ----------------------
class ReferenceHead:
    """qwen35-model.md §6 written out in float64 from the checkpoint's own tensors: row p takes
    token x_{p+1} and the target's post-norm hidden h_p, at rotary position p."""

    def __init__(self, path):
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        self.w = {}
        for name, shard in index.items():
            if name.startswith(("mtp.", "lm_head.", "model.language_model.embed_tokens.")):
                with safe_open(str(path / shard), framework="pt") as f:
                    self.w[name] = f.get_tensor(name).double()
        self.embed = self.w["model.language_model.embed_tokens.weight"]
        self.lm_head = self.w.get("lm_head.weight", self.embed)
        t = json.loads((path / "config.json").read_text())["text_config"]
        self.heads, self.kv_heads, self.D = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        self.rot = int(self.D * t["rope_parameters"]["partial_rotary_factor"])
        self.theta, self.eps = t["rope_parameters"]["rope_theta"], t["rms_norm_eps"]

    def norm(self, x, name):   # Qwen3.5 RMSNorm: the weight is stored zero-centred
        return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt() * (1 + self.w[name])

    def rope(self, x, pos):    # NeoX rotation of the first `rot` dims of every head
        freq = self.theta ** (-torch.arange(0, self.rot, 2, dtype=torch.float64) / self.rot)
        ang = pos.double()[:, None, None] * torch.cat([freq, freq])
        r, rest = x[..., :self.rot], x[..., self.rot:]
        half = self.rot // 2
        turned = torch.cat([-r[..., half:], r[..., :half]], -1)
        return torch.cat([r * ang.cos() + turned * ang.sin(), rest], -1)

    def __call__(self, tokens, hidden, pos, past=None):
        """Rows at positions `pos` attending to `past` (K, V of earlier rows) and causally to each
        other -> (out [T, H], logits [T, V], (K, V) including these rows)."""
        w, T, D, L = self.w, len(tokens), self.D, "mtp.layers.0."
        e = self.norm(self.embed[tokens], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(hidden.double(), "mtp.pre_fc_norm_hidden.weight")
        x = torch.cat([e, h], -1) @ w["mtp.fc.weight"].T                 # order: [embedding, hidden]
        a = self.norm(x, L + "input_layernorm.weight")
        qg = (a @ w[L + "self_attn.q_proj.weight"].T).view(T, self.heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, -1)               # per head: [query | gate]
        q = self.rope(self.norm(q, L + "self_attn.q_norm.weight"), pos)
        k = self.rope(self.norm((a @ w[L + "self_attn.k_proj.weight"].T).view(T, self.kv_heads, D),
                                L + "self_attn.k_norm.weight"), pos)
        v = (a @ w[L + "self_attn.v_proj.weight"].T).view(T, self.kv_heads, D)
        if past is not None:
            k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
        n = k.shape[0]
        group = self.heads // self.kv_heads
        scores = torch.einsum("thd,nhd->htn", q, k.repeat_interleave(group, 1)) / D ** 0.5
        causal = torch.arange(n)[None, :] <= torch.arange(n - T, n)[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("htn,nhd->thd", probs, v.repeat_interleave(group, 1)).reshape(T, -1)
        x = x + (o * gate.sigmoid()) @ w[L + "self_attn.o_proj.weight"].T
        m = self.norm(x, L + "post_attention_layernorm.weight")
        mlp = F.silu(m @ w[L + "mlp.gate_proj.weight"].T) * (m @ w[L + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[L + "mlp.down_proj.weight"].T
        out = self.norm(x, "mtp.norm.weight")
        return out, out @ self.lm_head.T, (k, v)


def target_hiddens(e, ids):
    """The target's post-final-norm hidden of every position, from a fresh full forward."""
    hidden = []
    hook = e.model.register_forward_hook(lambda m, args, out: hidden.append(out.clone()))
    try:
        e.logits(ids)
    finally:
        hook.remove()
    return torch.cat(hidden)


def rel_err(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("ckpt", ["gqa3", "tied"])
def test_head_matches_the_formula_through_a_generation(request, ckpt):
    """Every row the head computes during a generation with rejections, MTP switched off and on
    and k changing (prefill rows, catch-up rows and chained drafts) matches the reference over the
    true sequence: the head's KV is complete and right after every rollback."""
    path = request.getfixturevalue(ckpt)
    e = load(path, mtp=False)
    prompt = random_ids(60, 5, e.config.vocab_size)
    ref = list(generate(e, prompt, SamplingParams(max_tokens=50, stop_token_ids=()))[-1].token_ids)
    e = load(path, draft_tokens=3)
    e.drafter = profile_drafter(ref, 3, e)
    calls = []
    e.head.register_forward_hook(lambda m, args, out: calls.append(
        (args[1].clone(), args[2].clone(), args[4].positions.clone(), e.state.length, out.clone())))
    plan = iter([(True, 3)] * 3 + [(False, 3)] * 8 + [(True, 4), (True, 1), (True, 2), (False, 2), (True, 4)] * 9)

    def switch(steps):
        e.mtp, e.draft_tokens = next(plan)

    out = generate(e, prompt, SamplingParams(max_tokens=50, stop_token_ids=()), after_step=switch)[-1].token_ids
    assert list(out) == ref
    seq = prompt + ref                                   # x_0..x_L; the last one was never fed
    L = len(seq) - 1
    head, hiddens = ReferenceHead(path), target_hiddens(e, seq[:L])
    true_out, true_logits, (K, V) = head(torch.tensor(seq[1:]), hiddens, torch.arange(L))
    checked, chained = set(), 0
    chain = None      # (reference output of the previous row, K/V up to it) for the next chained draft
    for ids, hidden, pos, fed, got in calls:
        logits = e.model.logits(got, rowwise=False)
        if len(ids) == 1 and int(pos[0]) >= fed:         # a chained draft: the head's own output as hidden
            ref_out, ref_logits, kv = head(ids, chain[0], pos, chain[1])
            assert rel_err(logits, ref_logits) < 1e-4
            chain, chained = (ref_out, kv), chained + 1
            continue
        valid = pos < fed                                # draft catch-up rows past the last fed token are scratch
        assert valid.any()
        assert torch.equal(ids[valid], torch.tensor(seq)[pos[valid] + 1])     # row p pairs x_{p+1} with h_p
        assert rel_err(hidden[valid], hiddens[pos[valid]].double()) < 1e-4
        assert rel_err(logits[valid], true_logits[pos[valid]]) < 1e-4
        checked |= set(pos[valid].tolist())
        last = int(pos[valid][-1])
        chain = (true_out[last:last + 1], (K[:last + 1], V[:last + 1]))
    assert checked == set(range(len(checked))) and len(checked) > L - 8 and chained > 10


# --- 5. a stop id or the token limit inside an accepted window --------------------------------------
@pytest.fixture(scope="module")
def window_case(gqa3):
    e = load(gqa3, mtp=False)
    prompt = random_ids(30, 11, e.config.vocab_size)
    ref = list(generate(e, prompt, SamplingParams(max_tokens=40, stop_token_ids=()))[-1].token_ids)
    assert len(set(ref[:8])) == 8          # each of them can serve as a stop id that first occurs there
    return prompt, ref


def assert_next_turn_continues(path, e, prompt, emitted, seed):
    """The next turn reuses exactly the emitted tokens and continues as a fresh engine would."""
    follow = prompt + emitted + random_ids(4, seed, e.config.vocab_size)
    params = SamplingParams(max_tokens=20, stop_token_ids=())
    fresh = list(generate(load(path, mtp=False), follow, params)[-1].token_ids)
    e.drafter = profile_drafter(fresh, seed, e)
    events = list(e.generate(follow, params))                     # no reset: a chat turn
    assert isinstance(events[0], Prefilled) and events[0].cached_tokens == len(prompt) + len(emitted) - 1
    assert list(events[-1].token_ids) == fresh


@pytest.mark.parametrize("case", [("stop", j) for j in range(1, 8)] + [("length", m) for m in range(2, 8)],
                         ids=lambda case: f"{case[0]}{case[1]}")
def test_stop_or_limit_inside_an_accepted_window(gqa3, window_case, case):
    prompt, ref = window_case
    kind, j = case
    e = load(gqa3, draft_tokens=4)
    e.drafter = profile_drafter(ref, 0, e, ALL_RIGHT)
    stop = (ref[j],) if kind == "stop" else ()
    max_tokens = 40 if kind == "stop" else j
    events = generate(e, prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop))
    done, last = events[-1], steps_of(events)[-1]
    emitted = ref[:j + 1] if kind == "stop" else ref[:j]
    assert (done.reason, list(done.token_ids)) == (kind, emitted)
    steps = steps_of(events)
    assert [(s.drafted, s.mtp) for s in steps[1:]] == window_sizes(steps, 4, max_tokens)
    if kind == "stop":
        # windows emit ref[1..5], ref[6..10]: the stop id cuts one after an accepted draft
        # (j = 1..4, 6, 7) or lands on its bonus token (j = 5)
        assert last.mtp and last.token_ids[-1] == ref[j]
        assert last.from_draft == (True,) * (len(last.token_ids) - (j == 5)) + (False,) * (j == 5)
    assert_same_state(snapshot(e), sequential_state(gqa3, prompt, emitted, stop))
    assert_next_turn_continues(gqa3, e, prompt, emitted, seed=j)


@pytest.mark.parametrize("budget", [1, 2, 3, 4])
def test_step_budget_truncates_the_window_and_rolls_back(gqa3, window_case, budget):
    """The decoder's own truncation (the engine shrinks k first, so only a direct step reaches it)."""
    prompt, ref = window_case
    e = load(gqa3, draft_tokens=4)
    e.drafter = profile_drafter(ref, 0, e, ALL_RIGHT)
    dec = e.decoder
    with torch.inference_mode():
        dec.begin(prompt)
        assert dec.first_token(GREEDY, None) == ref[0]
        r = dec.step(4, GREEDY, None, budget=budget, stop=set())
    assert (r.tokens, r.accepted) == (ref[1:1 + budget], budget)
    assert_same_state(snapshot(e), sequential_state(gqa3, prompt, ref[:1 + budget]))
    assert_next_turn_continues(gqa3, e, prompt, ref[:1 + budget], seed=20 + budget)


# --- 6. checkpoints without mtp.* ---------------------------------------------------------------------
def test_checkpoint_without_mtp_runs_with_mtp_off(tmp_path, greedy_refs):
    path = write_tiny_checkpoint(tmp_path, mtp=False, seed=0)      # the same target weights as gqa3
    e = load(path, mtp=True, draft_tokens=3)
    assert not e.mtp_available and not e.mtp and e.memory()["mtp_kv"] == 0
    assert len(e.notices) == 1 and "mtp" in e.notices[0].lower()
    e.mtp, e.draft_tokens = True, 4
    assert e.mtp is False and e.draft_tokens == 4
    prompts, refs = greedy_refs
    e.drafter = profile_drafter(refs[0], 0, e, ALL_RIGHT)

    def switch(steps):
        e.mtp = len(steps) % 2 == 0

    for ids, ref in list(zip(prompts, refs))[:3]:
        events = generate(e, ids, after_step=switch)
        assert list(events[-1].token_ids) == ref
        assert not any(s.mtp or s.drafted for s in steps_of(events)) and events[-1].stats.drafted == 0
    assert len(e.notices) == 1                                        # said once, not per switch


def test_profile_drafter_wrong_tokens_stay_in_the_vocabulary():
    V = 512
    drafter = ProfileDrafter([V - 1] * 4, profile=(0.0,) * 4, seed=0, vocab=V)
    out = drafter(0, torch.zeros(4, dtype=torch.long))
    assert ((out >= 0) & (out < V)).all() and (out != V - 1).all()
