"""A/B of whole step phases under kernel plans (engine/plan.py): the decode step (verify 0), verify 3
and a 3-token draft, captured once per plan and replayed in interleaved rounds on random weights of
an official shape, so the ratios come from one process on one device.

    python3 ab_step.py --plans defaults [--weights fp8] [--model ...]   # each default form off alone, all off
    python3 ab_step.py --plans tiles           # matvec tile rules for groups of the 27B's products
    python3 ab_step.py --plans resident        # wide products' tiles small enough to be resident at once
    python3 ab_step.py --plans split           # the blocks' last products: parts added by the norm, or split norm
    python3 ab_step.py --plans tail            # a product's small last wave split over K into 2-14 parts, or whole
    python3 ab_step.py --plans fp8glu --weights fp8   # the FP8 SwiGLU product's tiles
    python3 ab_step.py --plans bits --weights fp8     # FP8 tiles widened by moving bits, or converted
    python3 ab_step.py --plans draft           # the MTP head's fc split, the draft's argmax as two kernels
    python3 ab_step.py --plans int4 --weights int4   # 4-bit tiles: measured, the pairs form's, rows of 16, natural layout
    python3 ab_step.py --plans fp8tiles --weights fp8 --tiles FILE   # bench_fp8.py --sweep's best FP8 tiles
    python3 ab_step.py --plans rows --weights fp8     # the few-row products' dots padded to 16 rows or to 8
    python3 ab_step.py --plans release --weights fp8  # the next kernel placed as a product starts, or after its loop
    python3 ab_step.py --plans int4tiles --weights int4 --tiles FILE   # bench_int4.py --interleaved-only's best
    python3 ab_step.py --plans conv --weights fp8      # the GDN conv as its own kernel, or in the recurrence's
    python3 ab_step.py --plans stacked --model qwen3.5-35b-a3b --weights fp8   # the expert SwiGLU's gate and up as one tile
    python3 ab_step.py --plans routed --model qwen3.5-35b-a3b --weights fp8    # a step's MoE layout written by the routing
    python3 ab_step.py --plans moefold --model qwen3.5-35b-a3b --weights fp8   # the MoE layer between Normeds, folded
    python3 ab_step.py --plans combine --model qwen3.5-35b-a3b --weights fp8   # the MoE layer finished in its combine
    python3 ab_step.py --plans drafthead --weights int4   # the trimmed draft head in 4 bits
    python3 ab_step.py --plans rides --weights fp8    # the GDN's b|a riding in the in_proj's launch, or apart
    python3 ab_step.py --plans int4stacked --model qwen3.5-35b-a3b --weights int4   # the 4-bit experts' SwiGLU stacked
    python3 ab_step.py --plans draft --only default --fc-bf16 --weights int4   # the MTP fc in 4 bits, or in bf16
    python3 ab_step.py --plans tiles --model qwen3.5-27b-gptq-int4 --weights int4   # a release's layout: bf16 attention and GDN

A plan is a name and a KernelPlan: the engine's own plan with some choices changed (the families
are in step_plans.py). One engine is
loaded; for each plan the decoder takes that plan (its forward contexts carry it) and its phases are
compiled and captured under it. Steps of a live generation write the GDN state they start from, so
logits are compared on ended steps only (`--room 0`). `--fc-bf16` adds the first plan once more with the MTP head's
fc, 4-bit under --weights int4 (engine/weights.py INT4_PARAMS), swapped for its bf16 dequantization
while that plan's phases are captured: a weight's form, not a plan's, measured the same way.
Every plan is also checked for what greedy MTP
on == off asks: verify 3's first row the decode step's row bit for bit, and a captured verify 3 what
it gives run eagerly (a plan that fails either says so on its line).
"""
from __future__ import annotations

import ast
import argparse
import json
import statistics
from pathlib import Path

import torch
from torch import nn
from step_plans import FAMILIES, fp8_tile_plans, int4_tile_plans

from mtpchat.bench import random_config
from mtpchat.engine.bench import random_prompt
from mtpchat.engine.dispatch import weight
from mtpchat.engine.engine import Engine, interleave_4bit
from mtpchat.engine.plan import KernelPlan
from mtpchat.engine.runner import capture_stream
from mtpchat.engine.sampling import SamplingParams
from mtpchat.kernels import matvec, matvec_parts
from mtpchat.kernels.int4 import GroupInt4, dequantize_ref



def _x_key(w) -> tuple:
    """(K, dtype) of the rows a product of w takes: a tensor's dtype, bf16 for FP8 and 4-bit forms."""
    return w.shape[1], w.dtype if isinstance(w, torch.Tensor) and w.dtype.is_floating_point else torch.bfloat16


def products_ms(model, plan: KernelPlan, reps: int = 20) -> float:
    """One decode step's products alone, in the step's order (each waits for the one before, as in
    the step), on the model's own weights, under the plan: what the step's other kernels add is the
    difference."""
    p = plan.products
    plain = lambda x, w: matvec.matvec(x, w, plan=p)
    glu = lambda x, w: matvec.matvec_swiglu(x, w, p)
    parts = lambda x, w: matvec_parts.matvec_parts(x, w, p)
    calls = []
    for layer in model.layers:
        m = layer.mixer
        ws = [weight(m, "in_proj"), weight(m, "out_proj")] if layer.kind != "full_attention" else \
            [weight(m, "qkv"), weight(m, "o_proj")]
        calls += [(ws[0], plain), (ws[1], parts), (weight(layer.mlp, "gate_up"), glu),
                  (weight(layer.mlp, "down"), parts)]
    calls.append((model.head, plain))
    xs = {}
    for w, _ in calls:
        xs.setdefault(_x_key(w), torch.randn(1, w.shape[1], dtype=_x_key(w)[1], device=w.device))
    run = lambda: [fn(xs[_x_key(w)], w) for w, fn in calls]
    run()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def fc_in_bf16(head) -> dict:
    """The MTP head's 4-bit fc swapped for its bf16 dequantization; what fc_put_back restores."""
    q = weight(head, "fc")
    if not isinstance(q, GroupInt4):
        raise SystemExit("--fc-bf16: this model's MTP fc is not 4-bit (load it with --weights int4)")
    kept = {n: getattr(head, n) for n in ("fc", "fc_scale", "fc_zero", "fc_perm") if hasattr(head, n)}
    for n in kept:
        delattr(head, n)
    head.fc = nn.Parameter(dequantize_ref(q, torch.bfloat16), requires_grad=False)
    return kept


def fc_put_back(head, kept: dict) -> None:
    del head.fc
    for n, p in kept.items():
        setattr(head, n, p)


def kernel_resources():
    """Warps, stages, shared memory and registers of each compiled matvec kernel."""
    out = []
    for fn in (matvec._matvec_kernel, matvec_parts._matvec_parts_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for kernel in cache[0].values():
                md = kernel.metadata
                out.append(f"{fn.__name__} warps={md.num_warps} stages={md.num_stages} smem={md.shared} "
                           f"regs={getattr(kernel, 'n_regs', '?')}")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--plans", default="defaults", choices=(*FAMILIES, "fp8tiles", "int4tiles"))
    p.add_argument("--weights", default="bf16", choices=("bf16", "fp8", "int4"))
    p.add_argument("--only", help="comma-separated plan names (the first is the base of the ratios)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-context", type=int, help="the cache size (default: the context + 256)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--room", type=int, default=1 << 20,
                   help="tokens the generation may still emit: 0 replays ended steps, which write no GDN state")
    p.add_argument("--verify-fold", type=int, help="the last verify's tokens that each replayed verify folds into "
                   "the GDN state first (an acceptance: 1..k+1), the decode step then folding none, as with MTP off "
                   "(default: both as the generation left them)")
    p.add_argument("--products", action="store_true", help="also time the decode step's products alone")
    p.add_argument("--tiles", metavar="FILE", help="--plans fp8tiles: the JSON of bench_fp8.py --sweep; "
                   "--plans int4tiles: of bench_int4.py --interleaved-only")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a field of the base plan changed before the family's plans are built "
                        "(e.g. widen_bits=False); repeatable")
    p.add_argument("--fc-bf16", action="store_true", help="also the first plan with the MTP fc in bf16 (its 4-bit "
                   "weight dequantized), as 'PLAN, fc bf16'")
    p.add_argument("--json")
    a = p.parse_args()
    config = random_config(a.model)          # a shipped shape, or a 4-bit release's (qwen3.5-27b-gptq-int4)
    # the engine loads its 4-bit weights natural; plans that take them interleaved convert them below
    default = KernelPlan.choose("cuda", config, fp8=a.weights == "fp8", int4=a.weights == "int4")
    for item in a.set:
        field, _, value = item.partition("=")
        default = default.replace(**{field: ast.literal_eval(value)})
    engine = Engine(config, device="cuda", dtype=torch.bfloat16, max_context=a.max_context or a.context + 256,
                    cuda_graphs=False, weights=a.weights, plan=default.replace(int4_interleave=False))
    if a.plans == "fp8tiles":
        plans = fp8_tile_plans(default, json.loads(Path(a.tiles).read_text()))
    elif a.plans == "int4tiles":
        plans = int4_tile_plans(default, json.loads(Path(a.tiles).read_text()))
    else:
        plans = FAMILIES[a.plans](default)
    if a.only:
        plans = {name: plans[name] for name in a.only.split(",")}
    d = engine.decoder
    for _ in engine.generate(random_prompt(engine, a.context, 1), SamplingParams(max_tokens=2, stop_token_ids=())):
        pass
    d.room.fill_(a.room)
    # the drafted tokens too (d.fed): a verify reads them, and a plan that drafts otherwise
    # (draft_head_int4) writes others when its draft runs
    kept = (d.pos, d.state.fold, d.state.parity, d.state.conv_off, d.pend_n, d.room, d.fed)
    save = [t.clone() for t in kept]

    def restore(phase: str = ""):
        for t, s in zip(kept, save):
            t.copy_(s)
        if a.verify_fold is not None:
            d.state.fold.fill_(0 if phase == "verify 0" else a.verify_fold)

    phases = {"verify 0": lambda: d.verify(0), "verify 3": lambda: d.verify(3), "draft 3": lambda: d.draft(3)}
    graphs, logits, checks, verify3 = {}, {}, {}, {}
    pool = torch.cuda.graph_pool_handle()
    # plans that store the 4-bit weights interleaved come last: the weights are converted once, in
    # place, the natural ones kept alive for the graphs captured before
    plans = dict(sorted(plans.items(), key=lambda kv: kv[1].products.int4_interleave))
    fc_bf16 = set()
    if a.fc_bf16:        # the first plan once more, right after it (its weights' layout, before any other's)
        first, *rest = plans
        fc_bf16.add(first + ", fc bf16")
        plans = {first: plans[first], first + ", fc bf16": plans[first], **{name: plans[name] for name in rest}}
    kept_weights, kept_heads, streams = [], [], {}
    for name, plan in list(plans.items()):
        if plan.products.int4_interleave and not kept_weights:
            kept_weights = [p for m in (engine.model, engine.head) if m is not None for p in m.parameters()]
            interleave_4bit(engine.model, engine.head)
        d.plan = plan                              # the decoder's contexts carry it from here on
        fc_kept = fc_in_bf16(engine.head) if name in fc_bf16 else None
        if d.draft_rows is not None:               # the trimmed head in this plan's form (draft_head_int4)
            kept_heads.append(d.draft_rows)        # the graphs captured before read its rows
            d.trim_draft_head(sorted(d.draft_rows.subset), d.draft_rows.context)
        # captured on the stream the engine's runner takes for this plan (its priority: fold_yields)
        if plan.fold_yields not in streams:
            streams[plan.fold_yields] = capture_stream(plan)
        stream = streams[plan.fold_yields]
        try:
            for phase, fn in phases.items():
                restore(phase)
                fn()                               # compiles this plan's kernels
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    restore(phase)
                    fn()
                graphs[name, phase] = g
        except Exception as e:                     # a tile that does not fit, and the like
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            del plans[name]
            graphs = {key: g for key, g in graphs.items() if key[0] != name}
            if fc_kept is not None:
                fc_put_back(engine.head, fc_kept)
            continue
        restore("verify 0")
        graphs[name, "verify 0"].replay()
        logits[name] = d.v_logits[:1].clone()
        # greedy MTP on == off asks that a verify's first row be the decode step's row, bit for bit,
        # and a captured step what the same step gives run eagerly
        restore("verify 3")
        graphs[name, "verify 3"].replay()
        rows = d.v_logits[:4].clone()
        restore("verify 3")
        d.verify(3)
        verify3[name] = rows
        checks[name] = {"verify 3 row 0 == decode": bool(torch.equal(rows[:1], logits[name])),
                        "verify 3 captured == eager": bool(torch.equal(rows, d.v_logits[:4]))}
        if a.verify_fold is not None:               # another state: its first row is another row
            del checks[name]["verify 3 row 0 == decode"]
        if fc_kept is not None:                     # its graphs keep the bf16 fc they read alive
            kept_heads.append(weight(engine.head, "fc"))
            fc_put_back(engine.head, fc_kept)
    d.plan = engine.plan
    first = next(iter(plans))
    products = {}
    if a.products:
        for name, plan in plans.items():
            products[name] = products_ms(engine.model, plan)
    same = {name: bool(torch.equal(logits[name], logits[first])) for name in plans} if a.room == 0 else {}
    if a.room == 0:         # and verify 3's every row
        for name in plans:
            checks[name]["verify 3 rows == the first plan's"] = bool(torch.equal(verify3[name], verify3[first]))
    # where a plan moves the logits (another rounding), by how much: |a - b| / |b| over the vocabulary
    apart = {name: ((logits[name].float() - logits[first].float()).norm() / logits[first].float().norm()).item()
             for name in plans} if a.room == 0 else {}
    times = {key: [] for key in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(a.rounds):
        for key, g in graphs.items():
            g.replay()
            start.record()
            for _ in range(a.replays):
                g.replay()
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end) / a.replays)
    out = {"plans": a.plans, "base_plan": default.describe(), "same_logits": same, "logits_apart": apart,
           "row_checks": checks,
           "ms": {}, "spread": {},
           "resources": kernel_resources()}
    base = {phase: statistics.median(times[first, phase]) for phase in phases}
    for name in plans:
        row = {phase: statistics.median(times[name, phase]) for phase in phases}
        out["ms"][name] = row
        out["spread"][name] = {phase: [min(times[name, phase]), max(times[name, phase])] for phase in phases}
        rel = "  ".join(f"{ph} {ms:7.3f} ms ({ms / base[ph]:.4f})" for ph, ms in row.items())
        moved = f" ({apart[name]:.1e} apart)" if same.get(name) is False else ""
        failed = [check for check, ok in checks[name].items() if not ok]
        print(f"{name:>18}: {rel}  same logits: {same.get(name)}{moved}"
              f"{'  FAILS: ' + '; '.join(failed) if failed else ''}", flush=True)
    for line in out["resources"]:
        print(line)
    if products:
        out["products_ms"] = products
        for name, ms in products.items():
            print(f"the decode step's products alone, {name}: {ms:.3f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
