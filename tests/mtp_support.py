"""Helpers shared by the MTP tests: loading, generating, drafters with a chosen acceptance, and
snapshots of the decode state."""
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
