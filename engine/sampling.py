"""Sampling: the logit pipeline and on-device sampling without a host sync.

The pipeline, in order: presence penalty -> temperature -> top-k -> top-p -> min-p -> softmax.
The same pipeline runs at every position, with MTP off and on (the speculative acceptance rule
needs the target's processed distribution, not the raw logits). Greedy is temperature 0.
Sampling draws with the exponential-race trick (argmax of p / Exp(1)), which equals a categorical
draw and needs no `.item()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20   # the most alternatives a token's logprobs list


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0        # 0 = greedy
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0              # 1 = off
    min_p: float = 0.0              # 0 = off
    presence_penalty: float = 0.0   # subtracted once from the logit of every token already generated
    max_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None = the checkpoint's EOS ids
    logprobs: int | None = None     # None = off; N = each token's logprob and the N most likely (0..20)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, params: SamplingParams,
                   seen: torch.Tensor | None = None) -> torch.Tensor:
    """[T, V] logits -> [T, V] float32 probabilities of the target's sampling distribution.

    `seen` is a [T, V] bool mask of tokens generated before each row (for the presence penalty).
    """
    x = logits.float()
    if params.presence_penalty and seen is not None:
        x = x - params.presence_penalty * seen.float()
    x = x / params.temperature
    if params.top_k:
        kth = torch.topk(x, min(params.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_x.softmax(-1)) >= params.top_p   # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(-1)
    if params.min_p > 0:
        floor = params.min_p * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[T, V] probabilities -> [T] token ids, one categorical draw per row, no host sync."""
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(-1)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """[n, V] logits and the n tokens chosen from them -> per row (the token's logprob, the `top`
    most likely (id, logprob)): the raw distribution, log_softmax of the logits. One host sync."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
        best = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        best = [[] for _ in tokens]
    return list(zip(chosen, best))
