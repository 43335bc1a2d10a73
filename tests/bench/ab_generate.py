"""A/B of kernel plans end to end: one engine of one model per plan, all in one process, each
generating MTP on at k drafts under the benchmark's acceptance profile (engine/bench.py PROFILE,
the same draws for every plan), in alternated rounds. What ab_step.py's phase replays cannot show: a
form that moves work from one phase of a step to another (the GDN fold into the draft's graph:
KernelPlan.fold_beside_draft). Every output is checked against MTP off.

    cd tests/bench && python3 ab_generate.py --plans "fold_beside_draft=0;fold_beside_draft=1" --weights int4
    cd tests/bench && python3 ab_generate.py --model qwen3.5-35b-a3b --weights int4 --plans "...;..." --ks 3,1,4

A plan is the engine's chosen plan with the changes given (probe_prefill_chunk.parse_changes: "a=1,b=2");
the first is the base each ratio is taken against. Each line: ms a token of each round, the median
verify and draft (a token) and the step against the base's (medians over the rounds).
"""
from __future__ import annotations

import argparse
import statistics

from probe_prefill_chunk import parse_changes

from mtpchat.bench import random_config
from mtpchat.engine import Engine, bench
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.spec import ProfileDrafter


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.6-27b", help="an official shape, random weights")
    p.add_argument("--weights", default="int4", help="bf16, fp8 or int4")
    p.add_argument("--plans", required=True, help='plans as changes, ";" between them: "fold_beside_draft=0;..."')
    p.add_argument("--ks", default="3,1,4", help="the drafts a step, each its own rounds (the first: --rounds)")
    p.add_argument("--rounds", type=int, default=4, help="rounds at the first k (2 at the others)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--max-context", type=int, default=4096,
                   help="the engines' context (Engine.load's default; the app's is 8,192, mtpchat bench's 8,320)")
    a = p.parse_args()
    config = random_config(a.model)
    weights = None if a.weights == "bf16" else a.weights
    base = KernelPlan.choose("cuda", config, weights == "fp8", weights == "int4")
    engines = {}
    for changes in a.plans.split(";"):
        plan = base.replace(**parse_changes(changes))
        engines[changes or "chosen"] = Engine(config, device="cuda", max_context=a.max_context, cuda_graphs=True,
                                              weights=weights, plan=plan)
    first = next(iter(engines.values()))
    prompt = bench.random_prompt(first, 1024, 0)
    refs = {name: bench.generate(e, prompt, a.tokens, mtp=False)["tokens"] for name, e in engines.items()}
    ref = refs[next(iter(refs))]
    assert all(r == ref for r in refs.values()), "MTP off differs between the plans"
    vocab = config.vocab_size
    drafter = lambda k: ProfileDrafter(ref, bench.PROFILE, seed=k, vocab=vocab)
    ks = [int(k) for k in a.ks.split(",")]
    for e in engines.values():                    # untimed: each k's first run
        for k in ks:
            bench.generate(e, prompt, a.tokens, mtp=True, k=k, drafter=drafter(k))
    print(f"{a.model} {a.weights}, {a.tokens} tokens a run, MTP k under the profile {bench.PROFILE}")
    for i, k in enumerate(ks):
        rows = {name: [] for name in engines}
        for r in range(a.rounds if i == 0 else 2):
            order = list(engines.items())
            for name, e in (order if r % 2 == 0 else order[::-1]):
                on = bench.generate(e, prompt, a.tokens, mtp=True, k=k, drafter=drafter(k))
                rows[name].append(dict(token=on["ms_per_token"], step=on["ms_per_step"], verify=on["verify_ms"],
                                       draft=on["draft_ms"] / k, length=on["stats"].mean_acceptance_length,
                                       exact=on["tokens"] == ref))
        med = lambda rs, key: statistics.median(x[key] for x in rs)
        base_step = med(next(iter(rows.values())), "step")
        for name, rs in rows.items():
            print(f"k={k} {name:28s} ms a token {[round(x['token'], 4) for x in rs]}  verify {med(rs, 'verify'):.4f}  "
                  f"draft a token {med(rs, 'draft'):.4f}  length {sorted({round(x['length'], 4) for x in rs})}  "
                  f"exact {all(x['exact'] for x in rs)}  step {med(rs, 'step') / base_step:.4f} x "
                  f"({(base_step - med(rs, 'step')) * 1e3:+.1f} us)", flush=True)


if __name__ == "__main__":
    main()
