"""Logprobs of the emitted tokens (SamplingParams.logprobs): the target's raw distribution, the
same with MTP on as off, and equal to a full forward's log-softmax over the prompt and the reply."""
import pytest
import torch

from mtpchat.engine import SamplingParams
from mtpchat.engine.events import Step
from helpers import random_ids
from mtp_support import load, profile_drafter

N = 24
TOP = 5
# a full forward (chunked prefill) and the decode steps (one token at a time through the recurrent
# state) sum in other orders: their float32 logits differ by ~1e-4 on the tiny checkpoint
REF_TOL = 3e-4


def run(e, ids, mtp, k=3, drafter=None, top=TOP, temperature=0.0):
    e.reset()
    e.mtp, e.draft_tokens, e.drafter = mtp, k, drafter
    params = SamplingParams(max_tokens=N, stop_token_ids=(), logprobs=top, temperature=temperature, seed=1)
    try:
        steps = [ev for ev in e.generate(ids, params) if isinstance(ev, Step)]
    finally:
        e.drafter = None
    return steps


def flat(steps):
    return [lp for s in steps for lp in s.logprobs]


@pytest.fixture(scope="module")
def engine(gqa3):
    return load(gqa3)


@pytest.fixture(scope="module")
def prompt(engine):
    return random_ids(19, 7, engine.config.vocab_size)


def test_logprobs_off_leaves_steps_without_them(engine, prompt):
    engine.reset()
    steps = [ev for ev in engine.generate(prompt, SamplingParams(max_tokens=4, stop_token_ids=()))
             if isinstance(ev, Step)]
    assert steps and all(s.logprobs is None for s in steps)


def test_logprobs_equal_a_full_forward_of_prompt_and_reply(engine, prompt):
    steps = run(engine, prompt, mtp=False)
    reply = [t for s in steps for t in s.token_ids]
    got = flat(steps)
    assert [g.token_id for g in got] == reply and all(len(s.logprobs) == len(s.token_ids) for s in steps)
    ref = torch.log_softmax(engine.logits(prompt + reply).float(), -1)[len(prompt) - 1:-1]
    want = ref.gather(1, torch.tensor(reply).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([g.logprob for g in got]), want, atol=REF_TOL, rtol=0)
    for row, g in zip(ref, got):
        values, ids = torch.topk(row, TOP)
        assert [i for i, _ in g.top] == ids.tolist()          # greedy: the chosen token is the top one
        assert torch.allclose(torch.tensor([v for _, v in g.top]), values, atol=REF_TOL, rtol=0)
        assert g.top[0][0] == g.token_id and abs(g.top[0][1] - g.logprob) < 1e-6
    assert all(g.logprob < 0 for g in got)


@pytest.mark.parametrize("drafter", ["profile", "head"])
def test_logprobs_mtp_on_equal_mtp_off(engine, prompt, drafter):
    off = flat(run(engine, prompt, mtp=False))
    reply = [g.token_id for g in off]
    on_steps = run(engine, prompt, mtp=True, k=3,
                   drafter=profile_drafter(reply, 3, engine) if drafter == "profile" else None)
    on = flat(on_steps)
    if drafter == "profile":
        assert any(s.accepted > 0 for s in on_steps)        # steps of several rows were read
    assert [g.token_id for g in on] == reply
    for a, b in zip(on, off):
        assert abs(a.logprob - b.logprob) < 1e-5
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-5


def test_sampled_logprobs_are_the_raw_distribution_not_the_tempered_one(engine, prompt):
    steps = run(engine, prompt, mtp=False, temperature=2.0, top=0)
    reply = [t for s in steps for t in s.token_ids]
    ref = torch.log_softmax(engine.logits(prompt + reply).float(), -1)[len(prompt) - 1:-1]
    want = ref.gather(1, torch.tensor(reply).unsqueeze(1)).squeeze(1)
    got = torch.tensor([g.logprob for g in flat(steps)])
    assert torch.allclose(got, want, atol=REF_TOL, rtol=0)
    assert all(g.top == () for g in flat(steps))


def test_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
