"""Acceptance of a speculative window, on the device, with no host sync.

The drafts d_1..d_k come from the MTP head greedily (a one-hot proposal). The target verified
[x, d_1..d_k] in one forward, giving distributions p_0..p_k (row i predicts the token after d_i).

Greedy:   accept the longest prefix with d_{i+1} == argmax p_i; the bonus is argmax p_a (fused
          with the commit in kernels/accept.py, whose greedy_tokens_ref is the rule in torch).
Sampling: accept d_{i+1} with probability p_i(d_{i+1}) (= min(1, p/q) for a one-hot q); at the first
          rejection i, draw from norm(max(0, p_i - q_i)) = p_i without d_{i+1}; if all k pass, draw
          the bonus from p_k. Every emitted token then has the target's distribution exactly.
Returns (a, tokens) with tokens [k+1] = d_1..d_a, bonus, then filler: a+1 tokens are emitted.
"""
from __future__ import annotations

import torch

from mtpchat.engine.sampling import SamplingParams, process_logits, sample
from mtpchat.kernels.profile_drafts import profile_drafts


def accept_sampled(logits: torch.Tensor, drafts: torch.Tensor, params: SamplingParams,
                   seen: torch.Tensor | None, generator: torch.Generator):
    """The lossless rule for a one-hot proposal. `seen` [k+1, V]: tokens counted by the presence
    penalty at each row (the generated ones plus the drafts before that row)."""
    k = drafts.shape[0]
    probs = process_logits(logits, params, seen)                  # [k+1, V]
    p_draft = probs[:-1].gather(1, drafts[:, None])[:, 0]         # p_i(d_{i+1})
    u = torch.rand(k, device=probs.device, generator=generator)
    residual = probs.clone()
    residual[:-1].scatter_(1, drafts[:, None], 0.0)               # p_i without d_{i+1}
    residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-30)
    fallback = sample(residual, generator)                        # a draw for every row; row a is used
    return _splice(u < p_draft, drafts, fallback)


def _splice(match: torch.Tensor, drafts: torch.Tensor, fallback: torch.Tensor):
    a = match.long().cumprod(0).sum().view(1)                     # leading accepted drafts
    k = drafts.shape[0]
    idx = torch.arange(k + 1, device=drafts.device)
    padded = torch.cat([drafts, drafts[-1:]])
    tokens = torch.where(idx < a, padded, fallback.gather(0, a.expand(k + 1)))
    return a, tokens


def seen_rows(seen: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """seen [V] bool -> [k+1, V]: row i also counts drafts d_1..d_i."""
    k = drafts.shape[0]
    rows = seen.expand(k + 1, -1).clone()
    for i in range(k):
        rows[i + 1:, drafts[i]] = True
    return rows


class ProfileDrafter:
    """Drafts with a controlled acceptance profile, for benchmarks and tests on random weights.

    Given the reference continuation (the greedy output with MTP off), it proposes the true next
    token at draft position i with the conditional probability that makes
    P(at least i+1 drafts accepted) = profile[i], and a wrong token otherwise. Under greedy
    decoding the target then accepts with exactly that profile, and the output is unchanged.
    The real MTP head still runs (so its cost is measured); only its tokens are replaced.
    It works on the device (the position comes as the decoder's count of emitted tokens, the
    right/wrong draws from a generator on the device), so no step waits for the host.
    """
    on_device = True
    writes_in_place = True            # into the drafts it is given (engine/decoder.py skips its copy)

    def __init__(self, reference: list[int], profile=(0.95, 0.83, 0.70, 0.55), seed: int = 0, vocab: int = 0):
        self.reference, self.profile, self.vocab, self.seed = list(reference), list(profile), vocab, seed
        self._table = self._rng = self._cond = None     # made on the drafts' device at the first call

    def __call__(self, position, drafts: torch.Tensor) -> torch.Tensor:
        """position: index in `reference` of the first token to draft (an int, or a 1-element
        device tensor); drafts: the head's [k] tokens (long, contiguous), overwritten with the
        drafts, which are returned."""
        k, dev = drafts.shape[0], drafts.device
        if self._table is None or self._table.device != dev:
            self._setup(dev)
        # Run eagerly between a step's draft and its verify, on the GPU's time but not a real draft's:
        # two kernels, the k draws and one that writes the drafts over the head's.
        u = torch.rand(k, generator=self._rng, device=dev)
        return profile_drafts(u, self._cond, torch.as_tensor(position, device=dev).view(-1), self._table, drafts)

    def _setup(self, dev):
        """The tokens' table, the draws' generator and their thresholds, on the drafts' device."""
        true = torch.tensor(self.reference + [0], device=dev)              # past the end: token 0
        wrong = (true + 1) % self.vocab if self.vocab else true + 1
        # one table, the wrong tokens first: a draft is table[right * (n + 1) + min(position + i, n)]
        self._table = torch.cat([wrong, true])
        self._rng = torch.Generator(device=dev).manual_seed(self.seed)
        # P(draft i right | the drafts before it right) = profile[i] / profile[i-1]; 0 past the profile
        prev = [1.0] + self.profile[:-1]
        cond = [p / q if q > 0 else 0.0 for p, q in zip(self.profile, prev)]
        self._cond = torch.tensor(cond + [0.0] * 16, device=dev)
