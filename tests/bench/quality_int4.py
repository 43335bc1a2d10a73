"""What `--weights int4` (symmetric round-to-nearest, groups of 128, quantized on load) costs the
demo model (assets/demo) in quality, against the checkpoint as it is (bf16 weights), both run in
float32 on the CPU:

- held-out perplexity, teacher-forced: over the held-out files of the demo's training corpus (the
  standard library's files that tests/tools/demo/corpus.py holds out; the first `--window` tokens
  of each) and over assets/heldout_prompts.jsonl; and how often the two models' top-1 agrees;
- the greedy reply (MTP off) to each held-out prompt: the int4 model's first token that differs
  from bf16's;
- the real MTP head's mean acceptance length, greedy, at k = 1, 2, 3, 4 over the held-out prompts
  (engine/bench.py real_acceptance, what `mtpchat bench` reports as mtp_real), and whether every
  MTP-on output equals MTP off (it must, in either format); for the int4 model also with the MTP
  fc as the checkpoint holds it (what the fc's 4 bits cost the drafts).

    PYTHONPATH=tests python tests/bench/quality_int4.py [--tokens 64] [--window 1024] [--json out.json]
    PYTHONPATH=tests python tests/bench/quality_int4.py --draft-head --tokens 128   # the draft head in 4 bits
    PYTHONPATH=tests python tests/bench/quality_int4.py --prefill-forms      # on a GPU
    PYTHONPATH=tests python tests/bench/quality_int4.py --plans "chunk_terms=bfloat16;..."   # on a GPU

`--prefill-forms` (a GPU) scores the held-out texts three ways instead, in bf16: the checkpoint
as it is, and `--weights int4` with prefill's 4-bit products in the dense form and in the fp8 form
(kernels/int4_gemm.py: the weights requantized to FP8 blocks, x's rows quantized to FP8 per token
and 128 columns). The scores are a prefill's logits, so they show what the fp8 form alone costs;
a text of fewer than 256 tokens (the held-out prompts) takes the dense form either way
(int4_gemm.fp8_serves).

`--plans` (a GPU) scores them in bf16 under the engine's own plan and under each of these changes
to it (KernelPlan.replace pairs, comma-separated, the plans ';'-separated): what a prefill form
costs the scores, against the plan's defaults.

PYTHONPATH=tests: the held-out files are the training script's (tools.demo.corpus). About two
minutes on two CPU cores.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mtpchat.engine import Engine
from mtpchat.engine.bench import generate, real_acceptance
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.dispatch import weight
from mtpchat.engine.plan import KernelPlan
from mtpchat.kernels.int4 import GroupInt4
from tools.demo import corpus

ROOT = Path(__file__).resolve().parents[2]
DEMO, PROMPTS = ROOT / "assets" / "demo", ROOT / "assets" / "heldout_prompts.jsonl"


def heldout_texts() -> list[str]:
    root = corpus.stdlib_root()
    return [corpus.read(root, rel) for rel in corpus.stdlib_files(root) if corpus.is_heldout(rel)]


def heldout(tok, window: int) -> tuple[list[list[int]], list[list[int]]]:
    """The held-out prompts' and files' token ids (the first `window` tokens of each file)."""
    prompts = [tok.encode(json.loads(line)["prompt"]) for line in PROMPTS.read_text().splitlines() if line.strip()]
    files = [ids[:window] for ids in map(tok.encode, heldout_texts()) if len(ids) > 1]
    return prompts, files


def show_perplexity(out: dict, names):
    for key in ("heldout_files", "heldout_prompts"):
        r = out[key]
        print(f"{key}: {r['documents']} texts, {r['tokens']:,} tokens scored")
        for name in names:
            print(f"  {name:<10} perplexity {r[name]['perplexity']:.4f}  top-1 agreement with bf16 "
                  f"{r[name]['top1_agreement']:.4f}")


def perplexity(engines: dict[str, Engine], docs: list[list[int]]) -> dict:
    """Teacher-forced: exp of the mean negative log-likelihood of every token after the first, pooled
    over the documents; `top1_agreement`: the share of positions where each model's argmax equals
    the first model's."""
    nll = {name: 0.0 for name in engines}
    agree = {name: 0 for name in engines}
    n = 0
    for ids in docs:
        target = torch.tensor(ids[1:])
        logits = {name: e.logits(ids)[:-1] for name, e in engines.items()}
        first = next(iter(logits.values())).argmax(-1)
        for name, lg in logits.items():
            nll[name] += F.cross_entropy(lg, target.to(lg.device), reduction="sum").item()
            agree[name] += int((lg.argmax(-1) == first.to(lg.device)).sum())
        n += len(target)
    return {"tokens": n, "documents": len(docs),
            **{name: {"perplexity": math.exp(nll[name] / n), "top1_agreement": agree[name] / n} for name in engines}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per held-out prompt (default 64)")
    p.add_argument("--window", type=int, default=1024, help="tokens of each held-out file scored (default 1024)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--prefill-forms", action="store_true", help="on a GPU: int4 prefill's dense and fp8 forms")
    p.add_argument("--plans", default="", help="on a GPU: plans as changes to the engine's, ';'-separated")
    p.add_argument("--draft-head", action="store_true",
                   help="the acceptance of the trimmed draft head in float32 and in 4 bits (draft_head_int4)")
    args = p.parse_args(argv)
    if args.prefill_forms:
        return prefill_forms(args)
    if args.draft_head:
        return draft_head(args)
    if args.plans:
        return plan_forms(args)

    t0 = time.perf_counter()
    engines = {w: Engine.load(DEMO, device="cpu", dtype=torch.float32, max_context=2048, weights=w)
               for w in ("bf16", "int4")}
    assert engines["bf16"].weight_format == "float32" and engines["int4"].weight_format == "int4"
    prompts, files = heldout(engines["bf16"].tokenizer, args.window)
    out = {"heldout_files": perplexity(engines, files), "heldout_prompts": perplexity(engines, prompts)}

    replies = {w: [generate(e, ids, args.tokens, mtp=False)["tokens"] for ids in prompts] for w, e in engines.items()}
    same = [next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
            for ref, got in zip(replies["bf16"], replies["int4"])]
    out["greedy_first_difference"] = same
    # and the int4 model with the MTP fc as the checkpoint holds it: what the fc's 4 bits cost the drafts
    drafters = engines | {"int4, fc as stored": with_stored_fc(
        Engine.load(DEMO, device="cpu", dtype=torch.float32, max_context=2048, weights="int4"), engines["bf16"])}
    out["mtp_real"] = {w: {k: {"mean_acceptance_length": m["mean_acceptance_length"],
                               "identical_to_mtp_off": m["identical_to_mtp_off"]}
                           for k, m in real_acceptance(e, prompts, args.tokens).items()} for w, e in drafters.items()}
    out["seconds"] = time.perf_counter() - t0

    show_perplexity(out, engines)
    print(f"greedy reply ({args.tokens} tokens, MTP off), int4's first token unlike bf16's, per prompt: {same}")
    for w, by_k in out["mtp_real"].items():
        print(f"{w:<18} mean acceptance length: " + ", ".join(
            f"k={k} {m['mean_acceptance_length']:.3f}" + ("" if m["identical_to_mtp_off"] else " (OUTPUT DIFFERS)")
            for k, m in by_k.items()))
    print(f"{out['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    identical = all(m["identical_to_mtp_off"] for by_k in out["mtp_real"].values() for m in by_k.values())
    return 0 if identical else 1


def with_stored_fc(engine: Engine, source: Engine) -> Engine:
    """`engine` (4-bit) with its MTP head's fc replaced by `source`'s (the checkpoint's own)."""
    head = engine.head
    assert isinstance(weight(head, "fc"), GroupInt4), "--weights int4 keeps the MTP fc in 4 bits"
    for name in ("fc", "fc_scale", "fc_zero", "fc_perm"):
        if hasattr(head, name):
            delattr(head, name)
    head.fc = source.head.fc
    return engine


def draft_head(args) -> int:
    """The real head's mean acceptance length over the held-out prompts, greedy, k = 1..4, with a
    trimmed draft head of 2,048 rows (+ context rows) kept as the checkpoint's (float32 here) and in
    4 bits (KernelPlan.draft_head_int4), on the CPU; every output must equal MTP off."""
    t0 = time.perf_counter()
    out = {}
    for name, four in (("float32", False), ("int4", True)):
        plan = KernelPlan.choose("cpu", ModelConfig.load(DEMO), fp8=False).replace(draft_head_int4=four)
        e = Engine.load(DEMO, device="cpu", dtype=torch.float32, max_context=2048, draft_vocab=2048, plan=plan)
        assert e.decoder.draft_rows.four_bit == four
        prompts, _ = heldout(e.tokenizer, args.window)
        out[name] = {k: {"mean_acceptance_length": m["mean_acceptance_length"],
                         "identical_to_mtp_off": m["identical_to_mtp_off"]}
                     for k, m in real_acceptance(e, prompts, args.tokens).items()}
        print(f"{name:<7} draft head ({e.decoder.draft_rows.nbytes()} bytes), mean acceptance length: " + ", ".join(
            f"k={k} {m['mean_acceptance_length']:.3f}" + ("" if m["identical_to_mtp_off"] else " (OUTPUT DIFFERS)")
            for k, m in out[name].items()), flush=True)
    out["seconds"] = time.perf_counter() - t0
    print(f"{out['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(m["identical_to_mtp_off"] for name in ("float32", "int4") for m in out[name].values()) else 1


def plan_forms(args) -> int:
    """The held-out perplexity in bf16 under the engine's plan and under each change to it, on a GPU."""
    from probe_prefill_chunk import parse_changes
    t0 = time.perf_counter()
    load = dict(device="cuda", dtype=torch.bfloat16, max_context=max(2048, args.window + 64), cuda_graphs=False)
    engines = {"defaults": Engine.load(DEMO, weights="bf16", **load)}
    for text in args.plans.split(";"):
        e = Engine.load(DEMO, weights="bf16", **load)
        e.plan = e.decoder.plan = e.plan.replace(**parse_changes(text))
        engines[text] = e
    return score(engines, args, t0)


def prefill_forms(args) -> int:
    """The held-out perplexity of bf16 and of int4 under prefill's dense and fp8 forms, on a GPU."""
    t0 = time.perf_counter()
    load = dict(device="cuda", dtype=torch.bfloat16, max_context=2048, cuda_graphs=False)
    engines = {"bf16": Engine.load(DEMO, weights="bf16", **load)}
    for form in ("dense", "fp8"):
        e = Engine.load(DEMO, weights="int4", **load)
        e.plan = e.plan.replace(int4_prefill=form)
        engines[f"int4 {form}"] = e
    return score(engines, args, t0, {"plans": {name: e.plan.describe()["products"]["int4_prefill"]
                                               for name, e in engines.items()}})


def score(engines: dict[str, Engine], args, t0: float, extra: dict | None = None) -> int:
    """The held-out perplexity of each engine against the first, shown and written to --json."""
    prompts, files = heldout(next(iter(engines.values())).tokenizer, args.window)
    out = {"heldout_files": perplexity(engines, files), "heldout_prompts": perplexity(engines, prompts),
           **(extra or {})}
    out["seconds"] = time.perf_counter() - t0
    show_perplexity(out, engines)
    print(f"{out['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
