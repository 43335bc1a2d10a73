"""Lossless sampling on the GPU: the demo model in bf16 with CUDA graphs, adaptive k (each step's
k chosen by engine/policy.py, at most 4) and the trimmed draft vocabulary (1,024 rows and their 64
context rows, filled from the prompt and the reply), sampling with every option set: the tokens
with MTP on and with MTP off come from one distribution (a two-sample chi-square test per
position and on the first three tokens jointly), while MTP on with a broken acceptance rule is
told apart from MTP off at half the runs (p < 1e-5).

Power (mtp_support.detectable_shift, two samples): 4,000 runs a side, alpha 1e-3 / 7 and power 0.9,
detect a shift of 0.057 in a cell of p 0.5 and 0.045 in one of p 0.2 (the difference of two
proportions; the common cells of these positions hold 0.2 to 0.7 of the mass).

Recorded p-values: one H100 80 GB HBM3, 2026-11-25, `python3 -m pytest -q -s tests/test_gpu_sampling.py`
(251 s for its 12,000 generations): MTP on vs off p = 1 (Bonferroni over 7 tests, so every test's
p >= 0.14); the broken rules against MTP off at 2,000 runs: accept_always p = 0 (below float64),
filters_after_the_acceptance_test p = 6.9e-98. Steps of k = 1, 2, 3, 4: 3,771, 2,770, 2,559, 98.
"""
import json
from pathlib import Path

import pytest
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.events import Finished, Step
from mtpchat.engine.policy import AdaptiveK
from mtpchat.engine.spec import accept_sampled
from helpers import GPU_LIKE
from mtp_support import accept_always, filters_after_the_acceptance_test, two_sample_pvalue

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"
PARAMS = SamplingParams(temperature=1.3, top_k=20, top_p=0.75, min_p=0.05, presence_penalty=0.6)
TOKENS, RUNS = 6, 4000


def runs(e, prompt, n: int, seed0: int, mtp: bool, rule=accept_sampled):
    """n seeded generations of TOKENS tokens from the state kept at the prompt's last token: their
    tokens, and the k of every speculative step."""
    e.mtp, e.decoder.accept_rule = mtp, rule
    out, ks = [], []
    try:
        for r in range(n):
            p = SamplingParams(**{**PARAMS.__dict__, "seed": seed0 + r, "max_tokens": TOKENS, "stop_token_ids": ()})
            for ev in e.generate(prompt, p, snapshot_at=(len(prompt) - 1,)):
                if isinstance(ev, Step) and ev.mtp:
                    ks.append(ev.drafted)
                elif isinstance(ev, Finished):
                    out.append(tuple(ev.token_ids))
    finally:
        e.decoder.accept_rule = accept_sampled
    return out, ks


def pvalue(on: list, off: list) -> float:
    """Bonferroni over each position's token and the first three tokens jointly."""
    tests = [two_sample_pvalue([t[i] for t in on], [t[i] for t in off]) for i in range(TOKENS)]
    tests.append(two_sample_pvalue([t[:3] for t in on], [t[:3] for t in off]))
    return min(1.0, len(tests) * min(tests))


def test_mtp_on_samples_as_mtp_off_bf16_graphs_adaptive_trimmed():
    e = Engine.load(DEMO, device="cuda", dtype=torch.bfloat16, max_context=256, draft_vocab=1024, adaptive=True,
                    draft_tokens=4)
    assert e.runner is not None and e.cuda_graphs and e.decoder.draft_rows.w.shape[0] == 1024 + 64
    e.policy = AdaptiveK(4, costs=GPU_LIKE)
    heldout = [json.loads(line)["prompt"] for line in (DEMO.parent / "heldout_prompts.jsonl").read_text().splitlines()]
    prompt = e.tokenizer.encode(heldout[4])[:49]
    off, _ = runs(e, prompt, RUNS, 0, mtp=False)
    on, ks = runs(e, prompt, RUNS, 100_000, mtp=True)
    assert len(on) == len(off) == RUNS and all(len(t) == TOKENS for t in on + off)
    assert len(set(ks)) >= 2 and sum(ks) > RUNS, sorted(set(ks))      # speculative steps of several k
    assert e.decoder.draft_rows.ring                                   # context rows were filled
    p = pvalue(on, off)
    assert p > 1e-3, p
    rejected = {}
    for rule in (accept_always, filters_after_the_acceptance_test):
        broken, _ = runs(e, prompt, RUNS // 2, 200_000, mtp=True, rule=rule)
        rejected[rule.__name__] = pvalue(broken, off[:RUNS // 2])
    assert all(q < 1e-5 for q in rejected.values()), rejected
    print(f"MTP on vs off: p = {p:.3g}; broken rules vs off: {rejected}; k of the steps: "
          f"{ {k: ks.count(k) for k in sorted(set(ks))} }")
