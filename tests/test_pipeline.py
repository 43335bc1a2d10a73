"""Steps launched ahead of the host (two in flight, as on CUDA), run here on the CPU: the same tokens,
reasons and committed state as reading each step before the next, including the step launched
after a stop id, the token limit or the context end (it must emit nothing and write no state), a
generation abandoned mid-way and a cancelled one."""
import pytest
import torch

from mtpchat.engine import SamplingParams
from mtpchat.engine.events import Finished, Step
from helpers import random_ids
from mtp_support import (ALL_RIGHT, GREEDY, NEW_TOKENS, assert_same_state, generate, load, profile_drafter,
                         sequential_state, snapshot, steps_of)


def pipelined(path, **kw):
    e = load(path, **kw)
    e.pipeline = 2
    return e


@pytest.fixture(scope="module")
def refs(gqa3):
    e = load(gqa3, mtp=False)
    prompts = [random_ids(n, 300 + n, e.config.vocab_size) for n in (3, 29, 50, 64)]
    return prompts, [list(generate(e, ids)[-1].token_ids) for ids in prompts]


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_pipelined_greedy_equals_mtp_off(gqa3, refs, k):
    e = pipelined(gqa3, mtp=k > 0, draft_tokens=max(k, 1))
    for i, (ids, ref) in enumerate(zip(*refs)):
        e.drafter = profile_drafter(ref, i, e) if k else None
        e.decoder.most_in_flight = 0
        events = generate(e, ids)
        assert e.decoder.most_in_flight == 2               # the next step was launched before this one was read
        done, steps = events[-1], steps_of(events)
        assert (done.reason, list(done.token_ids)) == ("length", ref)
        assert [t for s in steps for t in s.token_ids] == ref and done.stats.new_tokens == NEW_TOKENS
        assert done.stats.accepted == sum(s.accepted for s in steps)
        assert all(s.token_ids for s in steps)                    # the ended step is not reported
        if k:
            assert {s.accepted for s in steps[1:]} == set(range(k + 1))
        # the step launched after the last token wrote nothing: the state is the sequential one
        assert_same_state(snapshot(e), sequential_state(gqa3, ids, ref))


@pytest.fixture(scope="module")
def window_case(gqa3):
    e = load(gqa3, mtp=False)
    prompt = random_ids(30, 11, e.config.vocab_size)
    ref = list(generate(e, prompt, SamplingParams(max_tokens=40, stop_token_ids=()))[-1].token_ids)
    assert len(set(ref[:12])) == 12
    return prompt, ref


@pytest.mark.parametrize("case", [("stop", j) for j in (1, 3, 5, 6, 11)] + [("length", m) for m in (2, 5, 6, 9)],
                         ids=lambda case: f"{case[0]}{case[1]}")
def test_pipelined_stop_or_limit_leaves_the_sequential_state(gqa3, window_case, case):
    prompt, ref = window_case
    kind, j = case
    e = pipelined(gqa3, draft_tokens=4)
    e.drafter = profile_drafter(ref, 0, e, ALL_RIGHT)
    stop = (ref[j],) if kind == "stop" else ()
    events = generate(e, prompt, SamplingParams(max_tokens=40 if kind == "stop" else j, stop_token_ids=stop))
    emitted = ref[:j + 1] if kind == "stop" else ref[:j]
    assert (events[-1].reason, list(events[-1].token_ids)) == (kind, emitted)
    assert_same_state(snapshot(e), sequential_state(gqa3, prompt, emitted, stop))
    # and the next turn reuses exactly that state
    follow = prompt + emitted + random_ids(4, j, e.config.vocab_size)
    params = SamplingParams(max_tokens=12, stop_token_ids=())
    fresh = list(generate(load(gqa3, mtp=False), follow, params)[-1].token_ids)
    e.drafter = profile_drafter(fresh, j, e)
    again = list(e.generate(follow, params))
    assert again[0].cached_tokens == len(prompt) + len(emitted) - 1
    assert list(again[-1].token_ids) == fresh


def test_pipelined_context_end(gqa3):
    e = pipelined(gqa3, draft_tokens=3)
    e.mtp = False
    prompt = random_ids(500, 5, e.config.vocab_size)            # max_context 512
    done = generate(e, prompt, SamplingParams(max_tokens=100, stop_token_ids=()))[-1]
    assert done.reason == "context" and done.stats.new_tokens == 512 - 500
    assert e.decoder.length == 511 and len(e.decoder.tokens) == 511


def test_a_step_after_the_end_changes_nothing(gqa3, window_case):
    prompt, ref = window_case
    e = load(gqa3, draft_tokens=3)
    e.drafter = profile_drafter(ref, 0, e, ALL_RIGHT)
    dec, s = e.decoder, e.state

    def everything():
        """Every buffer a step could touch: the GDN windows, states and kept tokens whole, the KV caches up to the
        committed length (rows past it are scratch; the head's rows stop before the pending ones),
        the scalars and the pending rows."""
        L = s.length
        bufs = [t for pair in s.gdn_layers for t in pair] + [t[:L] for pair in s.kv_layers for t in pair]
        bufs += [t[:L - dec.pending] for t in s.mtp] + [s.fold, s.parity, s.conv_off, dec.pos, dec.next_tok, dec.pend_n, dec.room,
                                         dec.gen, dec.seen, dec.pend_hidden[:dec.pending], dec.pend_tokens[:dec.pending]]
        return [t.clone() for t in bufs]

    with torch.inference_mode():
        dec.begin(prompt)
        dec.first_token(GREEDY, None)
        dec.limit(5, set())
        assert dec.step(3, GREEDY, None).tokens == ref[1:5]
        assert dec.step(3, GREEDY, None).tokens == ref[5:6]      # room 1 left: one token of the window
        before, length = everything(), s.length
        for k in (0, 2, 4, 1):                                    # room is 0 now
            r = dec.step(k, GREEDY, None)
            assert (r.tokens, r.accepted) == ([], 0)
        after = everything()
    assert s.length == length and len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(a, b), f"buffer {i} changed"
    assert_same_state(snapshot(e), sequential_state(gqa3, prompt, ref[:6]))


def test_abandoned_generation_keeps_the_mirror_exact(gqa3, refs):
    ids, ref = refs[0][1], refs[1][1]
    e = pipelined(gqa3, draft_tokens=2)
    e.drafter = profile_drafter(ref, 7, e)
    e.reset()
    seen = []
    gen = e.generate(ids, GREEDY)
    for ev in gen:
        if isinstance(ev, Step):
            seen += ev.token_ids
            if len(seen) > 10:
                break
    gen.close()                                        # a step was still in flight
    dec = e.decoder
    fed = dec.length - len(ids)
    assert len(dec.tokens) == dec.length and fed + 1 > len(seen)     # the unread step was taken in
    assert_same_state(snapshot(e), sequential_state(gqa3, ids, ref[:fed + 1]))


def test_pipelined_cancel(gqa3, refs):
    ids, ref = refs[0][2], refs[1][2]
    e = pipelined(gqa3, draft_tokens=3)
    e.drafter = profile_drafter(ref, 3, e)
    e.reset()
    events = []
    for ev in e.generate(ids, GREEDY):
        events.append(ev)
        if isinstance(ev, Step) and len(events) == 4:
            e.cancel()
    done = events[-1]
    assert isinstance(done, Finished) and done.reason == "cancelled"
    got = list(done.token_ids)
    assert got == ref[:len(got)] and len(got) < NEW_TOKENS
    assert_same_state(snapshot(e), sequential_state(gqa3, ids, got))


@pytest.mark.parametrize("mtp", [False, True])
def test_pipelined_sampling_draws_the_same_tokens(gqa3, refs, mtp):
    # a seeded sampled reply: the draws happen in launch order, so two steps in flight give the
    # tokens one at a time gives, up to the last windows before the token limit (there the step in
    # flight makes the engine draft fewer tokens, and a window of another size draws other numbers)
    params = SamplingParams(temperature=1.3, top_k=20, presence_penalty=0.5, max_tokens=60, seed=11,
                            stop_token_ids=())
    got = []
    for depth in (1, 2):
        e = load(gqa3, mtp=mtp, draft_tokens=3)
        e.pipeline = depth
        got.append(list(generate(e, refs[0][3], params)[-1].token_ids))
    assert len(got[0]) == len(got[1]) == 60
    assert got[0][:60 - 2 * 4] == got[1][:60 - 2 * 4]
