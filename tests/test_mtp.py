"""MTP self-speculative decoding on tiny random checkpoints (CPU, float32): greedy output identical
to MTP off (also while switching MTP and k mid-generation), state after a rollback identical to
feeding the same tokens one at a time, EOS and the token limit inside an accepted window,
checkpoints without mtp.*.

On random weights the head's own drafts are almost never accepted, so most tests also replace them
with the true continuation at a chosen acceptance (ProfileDrafter, or the drafters in mtp_support).
"""
import random

import pytest
import torch

from mtpchat.engine import SamplingParams
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.decoder import prefill_pieces
from mtpchat.engine.events import Prefilled, Step
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.spec import ProfileDrafter
from tools.tiny import write_tiny_checkpoint
from helpers import assert_mtp_on_equals_off, first_diff, greedy_tokens, random_ids
from mtp_support import N_PROMPTS, NEW_TOKENS, ALL_RIGHT, GREEDY, WindowDrafter, assert_same_state, generate, load, profile_drafter, sequential_state, snapshot, steps_of, window_sizes


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


def test_greedy_exact_across_full_pending_rows(gqa3, greedy_refs, monkeypatch):
    # MTP off long enough to fill the head's pending rows (made small here) twice, then on: the
    # flushes catch the head up, and the output is still MTP off's
    plan = KernelPlan.choose("cpu", ModelConfig.load(gqa3), fp8=False).replace(pending_rows=8)
    e = load(gqa3, draft_tokens=3, plan=plan)
    ids, ref = greedy_refs[0][1], greedy_refs[1][1]
    flushes = []
    flush = e.decoder._flush_pending
    monkeypatch.setattr(e.decoder, "_flush_pending", lambda keep_last: flushes.append(e.decoder.pending) or flush(keep_last))

    def switch(steps):
        e.mtp = len(steps) > 25

    e.mtp = False
    events = generate(e, ids, after_step=switch)
    assert list(events[-1].token_ids) == ref
    steps = [ev for ev in events if isinstance(ev, Step)]
    assert sum(not s.mtp for s in steps) > 2 * 8 and any(s.mtp for s in steps)
    assert flushes.count(8) >= 2, f"flushes at {flushes} pending rows"


@pytest.mark.parametrize("tokens,product", [(0, 0), (1 << 10, 0), (0, 1 << 10), (1 << 10, 1), (0, 2)])
def test_greedy_exact_with_the_conv_in_the_recurrence(gqa3, greedy_refs, tokens, product):
    # the GDN conv as a call of its own in every step, taken by the recurrence's call in every step
    # (KernelPlan.conv_in_recurrence), or by the in_proj's call (conv_in_product; the default's)
    # in every step, in one-token steps with the recurrence's in the others, or
    # in steps of one and two tokens with a call of its own in the others: MTP on and off emit MTP
    # off's tokens of the default plan
    plan = KernelPlan.choose("cpu", ModelConfig.load(gqa3), fp8=False).replace(conv_in_recurrence=tokens,
                                                                               conv_in_product=product)
    e = load(gqa3, draft_tokens=3, plan=plan)
    for ids, ref in list(zip(*greedy_refs))[:3]:
        for mtp in (False, True):
            e.mtp = mtp
            assert list(generate(e, ids)[-1].token_ids) == ref


def test_greedy_exact_with_the_fold_beside_the_draft(gqa3, greedy_refs):
    # the last step's accepted tokens folded into the GDN states by the draft phase
    # (KernelPlan.fold_beside_draft), not by the verify after it: MTP on emits MTP off's tokens with
    # the profile's drafts and the head's, k = 3 (the GPU's tests take k = 1..4), and at the end of
    # a generation the committed state is the one step-by-step feeding gives
    plan = KernelPlan.choose("cpu", ModelConfig.load(gqa3), fp8=False).replace(fold_beside_draft=8)
    e = load(gqa3, draft_tokens=3, plan=plan)
    folded = []
    fold = e.decoder._fold_beside
    e.decoder._fold_beside = lambda: folded.append(int(e.state.fold)) or fold()
    for i, (ids, ref) in enumerate(list(zip(*greedy_refs))[:2]):
        for drafter in ("profile", "head"):
            e.drafter = profile_drafter(ref, i, e) if drafter == "profile" else None
            events = generate(e, ids)
            assert list(events[-1].token_ids) == ref, f"prompt {i} ({drafter}) diverges at {first_diff(events[-1].token_ids, ref)}"
    emitted = [t for s in steps_of(events) for t in s.token_ids]
    assert_same_state(snapshot(e), sequential_state(gqa3, ids, emitted))
    assert any(n > 1 for n in folded), f"the drafts folded {sorted(set(folded))} tokens: no accepted window was folded there"


def test_fold_beside_the_draft_runs_the_committed_tokens_in(gqa3, greedy_refs):
    # after a window whose drafts were all accepted, the draft phase under fold_beside_draft leaves
    # fold 0 and every GDN layer's state with the committed tokens run in by its own gates, bit for
    # bit what a step's fold gives (DecodeState.gdn_committed, before)
    plan = KernelPlan.choose("cpu", ModelConfig.load(gqa3), fp8=False).replace(fold_beside_draft=8)
    e = load(gqa3, draft_tokens=3, plan=plan)
    ids, ref = greedy_refs[0][2], greedy_refs[1][2]
    e.drafter = ProfileDrafter(ref, ALL_RIGHT, seed=0, vocab=e.config.vocab_size)
    generate(e, ids, SamplingParams(max_tokens=13, stop_token_ids=()))    # 1 + 4 + 4 + 4: full windows
    assert int(e.state.fold) == 4
    want = e.state.gdn_committed(e.model, e.plan.any_stride)
    before = [state.clone() for _, state, _ in e.state.gdn_layers]
    e.decoder._fold_beside()
    assert int(e.state.fold) == 0
    for (_, state, _), w, b in zip(e.state.gdn_layers, want, before):
        assert not torch.equal(w, b) and torch.equal(state, w)


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
    off = None
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
            # committed by count, not copied: the next step folds the a+1 tokens into the GDN states,
            # and the conv window moves on by a+1
            assert int(e.state.fold) == a + 1
            assert off is None or int(e.state.conv_off) - off == a + 1
            off = int(e.state.conv_off)
            assert_same_state(got, sequential_state(path, prompt, emitted))
            seen.append(a)
            if len(seen) == len(schedule):
                gen.close()
                break
    assert seen == schedule




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
        dec.limit(budget, set())
        r = dec.step(4, GREEDY, None)
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


def test_profile_drafter_follows_its_profile():
    profile = (0.9, 0.6, 0.45, 0.2)
    drafter = ProfileDrafter(list(range(100, 140)), profile=profile, seed=1, vocab=512)
    n, hits = 4000, torch.zeros(4)
    for t in range(n):
        out = drafter(torch.tensor([t % 30]), torch.zeros(4, dtype=torch.long))
        right = out == torch.arange(100, 104) + t % 30
        hits += right.long().cumprod(0)                # right from the start up to draft i
    assert torch.allclose(hits / n, torch.tensor(profile), atol=0.03), hits / n


def test_k_past_the_captured_ones_is_exact(gqa3):
    """k beyond CAPTURED_K (the engine's limit is K_MAX): such steps run eagerly, the head catching
    up over the rows a long acceptance left first; greedy output stays MTP off's."""
    from mtpchat.engine.memory import CAPTURED_K, K_MAX
    e = load(gqa3, k_max=K_MAX, draft_tokens=K_MAX)
    assert e.decoder.R == CAPTURED_K + 1 and sorted(e.policy.step_ms) == list(range(CAPTURED_K + 1))
    prompts = [random_ids(n, 70 + n, e.config.vocab_size) for n in (5, 33)]
    assert_mtp_on_equals_off(e, prompts, 40, ks=(K_MAX, 6), profile_ks=(K_MAX, 7))
    # drafts that are always right: every step keeps all 8, leaving 9 rows for the head to catch up on
    ref = greedy_tokens(e, prompts[0], 40)
    e.mtp, e.draft_tokens = True, K_MAX
    e.drafter = ProfileDrafter(ref, (1.0,) * K_MAX, seed=0, vocab=e.config.vocab_size)
    events = generate(e, prompts[0], SamplingParams(max_tokens=40, stop_token_ids=()))
    e.drafter = None
    assert list(events[-1].token_ids) == ref and events[-1].stats.k_histogram.get(K_MAX, 0) >= 3


@pytest.mark.parametrize("graphs", [(), (8, 16, 32)])
def test_greedy_exact_with_short_prompts_in_pieces(gqa3, greedy_refs, graphs):
    # a GPU's plan: short prompts are prefilled in step pieces, or in chunks of the graphs' sizes and
    # step pieces (engine/decoder.py prefill_pieces); MTP on and off still emit what MTP off emits
    # after a chunked prefill
    plan = KernelPlan.choose("cpu", ModelConfig.load(gqa3), fp8=False).replace(step_prefill=2, prefill_graphs=graphs)
    e = load(gqa3, draft_tokens=3, plan=plan)
    short = [(ids, ref) for ids, ref in zip(*greedy_refs)
             if prefill_pieces(len(ids), e.decoder.R, 2, graphs, plan.prefill_pieces) is not None]
    assert len(short) >= (8 if graphs else 4)
    for ids, ref in short:
        for mtp in (False, True):
            e.mtp = mtp
            assert list(generate(e, ids)[-1].token_ids) == ref
