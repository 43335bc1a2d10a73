"""The draft-length policy (engine/policy.py): its choice against the expected-rate arithmetic, off
under drafts that are always wrong, the maximum under drafts that are always right, back on when
acceptance recovers; and in the engine, greedy output equal to MTP off while it switches k."""
import pytest
import torch

from mtpchat.engine import SamplingParams
from mtpchat.engine.events import PhaseTimes
from mtpchat.engine.bench import PROFILES
from mtpchat.engine.policy import MAX_PROBE_EVERY, ON_MARGIN, AdaptiveK
from helpers import GPU_LIKE, random_ids
from mtp_support import ALL_RIGHT, MID_PROFILE, NEW_TOKENS, generate, load, profile_drafter, steps_of, window_sizes


def run(policy, k_user, accept_of, steps):
    """Drive the policy as the engine does: choose, launch, observe; returns the ks launched."""
    ks = []
    for s in range(steps):
        k, why = policy.choose(k_user)
        policy.launched(k, why)
        policy.observe(k, min(accept_of(s), k), PhaseTimes(verify=1.0), k_user)
        ks.append(k)
    return ks


def test_choice_maximises_expected_tokens_per_time():
    p = AdaptiveK(4, costs=[10.0, 11.0, 12.5, 14.5, 17.0])
    p.hits, p.trials = [0.9, 0.8, 0.5, 0.3], [1.0] * 4          # conditional rates
    P = [0.9, 0.72, 0.36, 0.108]
    rates = [(1 + sum(P[:k])) / p.costs[k] for k in range(5)]
    k, why = p.best(4)
    assert k == max(range(5), key=rates.__getitem__) == 2
    # draft 3 would need (1 + P1 + P2) (T3 / T2 - 1) = 2.62 x 0.16 = 42 %; it gets P3 = 36 %
    assert why == "2 of 4 drafts: draft 3 would need 42% acceptance to pay, and gets 36%"
    assert p.best(1)[0] == 1 and p.best(1)[1] == "the draft pays off"


def test_always_wrong_turns_mtp_off_and_probes_ever_more_rarely():
    p = AdaptiveK(4, costs=GPU_LIKE)
    ks = run(p, 4, lambda s: 0, 400)
    assert ks[0] == 4                                   # the prior starts optimistic
    off_from = ks.index(0)
    assert off_from < 25
    tail = ks[off_from:]
    probes = [i for i, k in enumerate(tail) if k]
    assert tail.count(0) > 0.95 * len(tail) and set(tail) <= {0, 1}
    assert len(probes) >= 3 and probes[-1] - probes[-2] == MAX_PROBE_EVERY + 1   # backed off to the limit
    assert p.why.startswith("MTP off: a draft would need")


def test_always_right_rises_to_the_maximum_and_recovers_after_off():
    p = AdaptiveK(4, costs=GPU_LIKE)
    run(p, 4, lambda s: 0, 100)
    assert p.choose(4)[0] == 0
    ks = run(p, 4, lambda s: 4, 400)                     # acceptance recovers: the probes see it
    assert ks[-50:] == [4] * 50 and p.why == "all 4 drafts pay off"
    assert ks.index(4) < 200
    assert run(p, 2, lambda s: 4, 5) == [2] * 5          # the user's k stays the maximum


def test_measured_times_decide_where_no_costs_are_given():
    p = AdaptiveK(3)
    # drafts that are always right, on a device where a verify costs (k + 1) decode steps: never pays
    for _ in range(60):
        k, why = p.choose(3)
        p.launched(k, why)
        p.observe(k, k, PhaseTimes(draft=0.1 * k, verify=10.0 * (k + 1)), 3)
    assert p.choose(3)[0] == 0 and p.step_ms[0] == pytest.approx(10.0)
    assert p.time(2) == pytest.approx(p.step_ms[1] + (p.step_ms[1] - p.step_ms[0]))


# a CPU's step times, relative to a decode step: a verify of k+1 rows costs about what k+1 decode
# steps do less what they share, and a draft step a third of one (the demo model on 2 cores)
CPU_LIKE = [1.0, 1.80, 2.17, 2.52, 2.94]
HEAVY = [1.0 + 0.9 * k for k in range(5)]          # every row of a verify costs nearly a decode step


def conditional(profile):
    """The per-position rates c_i of a profile of P(at least i drafts accepted)."""
    return [p / q for p, q in zip(profile, (1.0, *profile))]


def simulate(costs, profile, steps=3000, seed=0):
    """Drive a policy under draws from `profile` (conditional acceptance per position); returns the
    time per token of its steps, probes included, and the ks it launched."""
    import random
    draw, c = random.Random(seed), conditional(profile)
    p, time, tokens, ks = AdaptiveK(4, costs=costs), 0.0, 0, []
    for _ in range(steps):
        k, why = p.choose(4)
        p.launched(k, why)
        accepted = 0
        while accepted < k and draw.random() < c[accepted]:
            accepted += 1
        p.observe(k, accepted, None, 4)
        time, tokens = time + costs[k], tokens + accepted + 1
        ks.append(k)
    return time / tokens, ks


@pytest.mark.parametrize("costs, profile", [(CPU_LIKE, "creative"), (HEAVY, "creative"), (HEAVY, "chat-thinking"),
                                            (CPU_LIKE, (0.62, 0.35, 0.15, 0.06))])
def test_where_drafts_cost_more_than_they_gain_the_policy_is_mtp_off(costs, profile):
    """A CPU's costs at low to moderate acceptance: k = 0, and never slower than MTP off (whose time
    per token is one decode step), the probes that look for a change included."""
    P = PROFILES.get(profile, profile)
    p = AdaptiveK(4, costs=costs)
    p.hits, p.trials = conditional(P), [1.0] * 4
    k, why = p.best(4)
    assert k == 0 and why.startswith("MTP off: a draft")
    per_token, ks = simulate(costs, P)
    assert ks[-1000:].count(0) > 0.95 * 1000
    assert per_token <= costs[0] * 1.02


def test_a_gain_within_the_margin_is_not_taken():
    """Drafting that would gain less than ON_MARGIN over MTP off (a rate within the noise of measured
    step times) leaves MTP off; a clear gain turns it on."""
    p = AdaptiveK(1, costs=[1.0, 1.5])
    p.hits, p.trials = [0.52], [1.0]             # E_1 / T_1 = 1.52 / 1.5: 1.3 % better than off
    k, why = p.best(1)
    assert k == 0 and why == f"MTP off: a draft would need {(1 + ON_MARGIN) * 1.5 - 1:.0%} acceptance to pay, and gets 52%"
    p.hits = [0.7]                               # 13 % better
    assert p.best(1)[0] == 1


@pytest.mark.parametrize("costs, profile", [(GPU_LIKE, "creative"), (GPU_LIKE, "chat-thinking"), (GPU_LIKE, "code"),
                                            (CPU_LIKE, "code")])
def test_where_drafting_pays_the_policy_drafts_and_is_faster_than_off(costs, profile):
    P = PROFILES[profile]
    p = AdaptiveK(4, costs=costs)
    p.hits, p.trials = conditional(P), [1.0] * 4
    assert p.best(4)[0] > 0
    per_token, ks = simulate(costs, P)
    assert ks[-1000:].count(0) < 250 and per_token < costs[0] / (1 + ON_MARGIN)


@pytest.fixture(scope="module")
def refs(gqa3):
    e = load(gqa3, mtp=False)
    prompts = [random_ids(n, 300 + n, e.config.vocab_size) for n in (7, 40)]
    return prompts, [list(generate(e, ids)[-1].token_ids) for ids in prompts]


@pytest.mark.parametrize("profile, expect", [((0.0,) * 4, 0), (ALL_RIGHT, 4), (MID_PROFILE, None)])
def test_engine_adaptive_k_is_exact_and_follows_acceptance(gqa3, refs, profile, expect):
    e = load(gqa3, draft_tokens=4, adaptive=True)
    for i, (ids, ref) in enumerate(zip(*refs)):
        e.policy = AdaptiveK(4, costs=GPU_LIKE)
        e.drafter = profile_drafter(ref, i, e, profile)
        events = generate(e, ids)
        assert list(events[-1].token_ids) == ref
        steps, stats = steps_of(events)[1:], events[-1].stats
        assert sum(stats.k_histogram.values()) == stats.steps == len(steps)
        assert all(s.why for s in steps if s.drafted) and all(s.drafted <= 4 for s in steps)
        late = [s.drafted for s in steps[len(steps) // 2:-1]]      # the last step may be cut by the limit
        if expect == 0:
            assert late.count(0) > 0.8 * len(late)
        elif expect == 4:
            assert late.count(4) > 0.8 * len(late)
        else:
            assert len(set(s.drafted for s in steps)) >= 2


class RecoveringDrafter:
    """Drafts of the reply's tokens that are always wrong before token `switch` and always right
    from it (on the device, as ProfileDrafter: the position is the decoder's count of emitted tokens)."""
    on_device = True

    def __init__(self, reference, switch, vocab):
        self.ref, self.switch, self.vocab = torch.tensor(list(reference) + [0]), switch, vocab

    def __call__(self, position, drafts):
        at = torch.as_tensor(position).view(-1)[:1] + torch.arange(drafts.shape[0])
        true = self.ref[at.clamp(max=len(self.ref) - 1)]
        return torch.where(at >= self.switch, true, (true + 1) % self.vocab)


def test_engine_turns_mtp_off_then_back_on_when_acceptance_recovers(gqa3):
    off = load(gqa3, mtp=False)
    params = SamplingParams(max_tokens=256, stop_token_ids=())
    ids = random_ids(20, 5, off.config.vocab_size)
    ref = list(generate(off, ids, params)[-1].token_ids)
    e = load(gqa3, draft_tokens=4, adaptive=True)
    e.policy = AdaptiveK(4, costs=GPU_LIKE)
    e.drafter = RecoveringDrafter(ref, 64, e.config.vocab_size)
    events = generate(e, ids, params)
    assert list(events[-1].token_ids) == ref
    steps, at = steps_of(events)[1:], 1           # at: the reply's token each step starts at
    starts = []
    for s in steps:
        starts.append(at)
        at += len(s.token_ids)
    wrong = [s.drafted for s, a in zip(steps, starts) if 32 <= a < 64]
    assert wrong and set(wrong) <= {0, 1} and wrong.count(0) >= len(wrong) - 1     # off, one probe at most
    probes = [a for s, a in zip(steps, starts) if a >= 64 and s.why.startswith("probing: one step with draft 1")]
    assert probes                                   # off: only a probe can see acceptance come back ...
    late = [s.drafted for s, a in zip(steps, starts) if a > probes[0]][:-1]
    assert len(late) > 10 and set(late) == {4}      # ... and the policy is back at the maximum after it


def test_engine_fixed_k_when_adaptive_is_off(gqa3, refs):
    e = load(gqa3, draft_tokens=3)
    assert not e.adaptive
    events = generate(e, refs[0][0])
    steps = steps_of(events)
    assert [(s.drafted, s.mtp) for s in steps[1:]] == window_sizes(steps, 3, NEW_TOKENS)
    assert events[-1].stats.k_histogram[3] > 0
    assert all(s.why == "" for s in steps_of(events))


# ---- the step times measured at load ----------------------------------------------------------------

DEMO = __import__("pathlib").Path(__file__).resolve().parents[1] / "assets" / "demo"


@pytest.fixture(scope="module")
def demo():
    from mtpchat.engine import Engine
    return Engine(DEMO, device="cpu", max_context=512, adaptive=True, k_max=4)


def test_the_step_time_of_every_k_is_measured_at_load_on_the_cpu(demo):
    times = demo.policy.step_ms
    assert sorted(times) == [0, 1, 2, 3, 4] and all(ms > 0 for ms in times.values())
    # the policy weighs each k by its own measured time (on the demo model a verify of 5 rows and a
    # decode step take within some 10 % of each other on a CPU, whose load moves them as much: no
    # order between them is asserted)
    assert all(demo.policy.time(k) == times[k] for k in times)
    assert demo.decoder.length == 0 and demo.decoder.tokens == []        # the decode state is empty again


def test_the_first_choice_weighs_drafts_by_their_measured_cost(demo):
    """At the acceptance of creative writing, the first step already takes the k that the measured
    times make fastest (MTP off where drafts cost more than they give), not the prior's GPU-like one."""
    p = demo.policy
    p.forget()
    p.hits, p.trials = [0.50, 0.44, 0.36, 0.37], [1.0] * 4                 # the creative profile
    P = p.at_least()
    rate = lambda k: (1 + sum(P[:k])) / p.step_ms[k]
    best = max(range(5), key=lambda k: (rate(k), -k))
    assert p.choose(4)[0] == (best if rate(best) >= (1 + ON_MARGIN) * rate(0) else 0)
    # where each draft costs a whole decode step, none pays at this acceptance
    p.step_ms.update({k: 10.0 + 10.0 * k for k in range(5)})
    assert p.choose(4)[0] == 0
    p.forget()


@pytest.mark.parametrize("costs, profile", [(CPU_LIKE, "creative"), (HEAVY, "creative"), (HEAVY, "chat-thinking")])
def test_a_short_reply_from_the_prior_is_never_slower_than_off(costs, profile):
    """From the prior (a fresh policy, as each `mtpchat bench` run starts), a reply of 200 steps at
    low acceptance on a CPU's costs: the steps spent learning that the drafts do not pay (the prior
    expects 0.8, 0.75, 0.7 of them) must not make it slower than MTP off."""
    per_token, _ = simulate(costs, PROFILES[profile], steps=200)
    assert per_token <= costs[0] * 1.02
