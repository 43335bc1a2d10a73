"""A/B of whole step phases under launch plans: the decode step (verify 0), verify 3 and a 3-token
draft, captured once per plan and replayed in interleaved rounds on random weights of an official
shape, so the ratios come from one process on one device.

    python3 ab_step.py --plans pdl             # programmatic dependent launch off / on
    python3 ab_step.py --plans tiles           # matvec tile tables (kernels/matvec.py: _config)
    python3 ab_step.py --plans knockout        # the step without one of its small kernels, each in turn
    python3 ab_step.py --plans attention       # decode attention's key spans
    python3 ab_step.py --plans split           # the blocks' last products split over K, or not
    python3 ab_step.py --plans small           # the small kernels' tiles and warps
    python3 ab_step.py --plans resident        # wide products' tiles small enough to be resident at once
    python3 ab_step.py --plans tail            # a product's small last wave split over K, or whole
    python3 ab_step.py --plans fp8glu --weights fp8   # the FP8 SwiGLU product's tiles
    python3 ab_step.py --plans bits --weights fp8     # FP8 tiles widened by moving bits, or converted
    python3 ab_step.py --plans draft           # the MTP head's fc split, the draft's argmax as two kernels
    python3 ab_step.py --plans router --model qwen3.5-35b-a3b   # the MoE router split, or fused with routing
    python3 ab_step.py --plans staged [--weights fp8] [--model ...] # every switch still off by default

A plan is a name and a function that sets the launch choice it stands for before its phases are
compiled and captured (and undoes nothing: the next plan sets its own). Steps of a live
generation write the GDN state they start from, so logits are compared on ended steps only
(`--room 0`).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from mtpchat.engine import bench, decoder, model, mtp
from mtpchat.engine.bench import random_prompt
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.engine import Engine
from mtpchat.engine.sampling import SamplingParams
from mtpchat.kernels import _triton, matvec, matvec_parts
from mtpchat.kernels import fp8 as fp8_format

from ab_plans import bits_plans, draft_plans, fp8_glu_plans, router_plans, staged_plans

CONFIGS = Path(bench.__file__).parent / "configs"
PDL_ON, DEFAULT_TILES, DEFAULT_SPLIT = _triton._pdl_device, matvec._config, matvec_parts._split_config
DEFAULT_TAIL = matvec._tail_config, matvec.TAIL_PARTS
DEFAULT_SMALL = matvec.SMALL_SPLIT, matvec.SMALL_PARTS


def pdl_plans() -> dict:
    def use(plan):
        return lambda: setattr(_triton, "_pdl_device", plan)
    return {"off": use(lambda index: False), "pdl": use(PDL_ON)}


def tile_plan(rule) -> callable:
    """rule(N, K, swiglu) -> (BN, BK, warps, stages) or None for the default tile (bf16 only)."""
    def tiles(N, K, itemsize, swiglu=False, fp8=False):
        return (rule(N, K, swiglu) if itemsize == 2 and not fp8 else None) or DEFAULT_TILES(N, K, itemsize, swiglu, fp8)
    return lambda: setattr(matvec, "_config", tiles)


def tile_plans() -> dict:
    """Tiles for one group of the 27B's products at a time: the two 5120 x 6144 (GDN out_proj,
    attention o_proj), the MLP down (5120 x 17408), the wide inputs (GDN in_proj 16480 rows,
    attention q|gate|k|v 14336), the MLP gate|up (SwiGLU, 17408 columns) and the lm_head."""
    groups = {"out": lambda N, K, g: N == 5120 and K == 6144, "down": lambda N, K, g: N == 5120 and K == 17408,
              "in": lambda N, K, g: N in (16480, 14336) and not g, "glu": lambda N, K, g: g,
              "lm": lambda N, K, g: N > 100_000, "plain": lambda N, K, g: not g and N < 100_000}

    def group(name, cfg):
        return tile_plan(lambda N, K, g: cfg if groups[name](N, K, g) else None)
    plans = {"base": tile_plan(lambda N, K, g: None)}
    for name, cfgs in {"out": [(64, 256, 8, 4), (64, 128, 4, 8), (64, 256, 2, 4)],
                       "down": [(64, 256, 8, 4), (64, 128, 4, 8), (64, 256, 2, 4)],
                       "in": [(128, 128, 4, 4), (128, 128, 8, 4), (64, 256, 8, 4)],
                       "glu": [(16, 256, 4, 6), (16, 256, 4, 4), (64, 128, 4, 6), (32, 256, 8, 6), (32, 128, 4, 8),
                               (64, 128, 4, 5), (64, 128, 4, 4), (64, 128, 8, 6), (128, 64, 4, 6), (128, 64, 4, 5),
                               (64, 64, 4, 8), (32, 128, 4, 6), (128, 128, 4, 3), (128, 64, 8, 6), (64, 128, 2, 6)],
                       "lm": [(128, 128, 4, 4)],
                       "plain": [(64, 256, 4, 3), (64, 256, 4, 5), (64, 128, 4, 6), (64, 128, 4, 5)]}.items():
        for cfg in cfgs:
            plans[f"{name}:{cfg[0]}x{cfg[1]}w{cfg[2]}s{cfg[3]}"] = group(name, cfg)
    return plans


def resident_plans() -> dict:
    """Tiles of the wide products (GDN in_proj 258 blocks of 64 rows, attention q|gate|k|v 224, the
    MLP gate|up 272 SwiGLU blocks) whose shared memory lets every program be resident at once on
    132 SMs (the default tiles take 160-180 KB, one program an SM, two waves and a bit)."""
    wide = lambda N, K, g: N in (16480, 14336) and not g
    rules = {"in:64x128w4s4": lambda N, K, g: (64, 128, 4, 4) if wide(N, K, g) else None,
             "in:64x128w4s5": lambda N, K, g: (64, 128, 4, 5) if wide(N, K, g) else None,
             "in:64x64w4s6": lambda N, K, g: (64, 64, 4, 6) if wide(N, K, g) else None,
             "glu:64x64w4s4": lambda N, K, g: (64, 64, 4, 4) if g else None,
             "glu:64x64w4s3": lambda N, K, g: (64, 64, 4, 3) if g else None,
             "glu:32x64w4s4": lambda N, K, g: (32, 64, 4, 4) if g else None,
             "both:64x128s4,64x64s4": lambda N, K, g: (64, 64, 4, 4) if g else ((64, 128, 4, 4) if wide(N, K, g) else None)}
    return {"base": tile_plan(lambda N, K, g: None), **{name: tile_plan(rule) for name, rule in rules.items()}}


def knockout_plans() -> dict:
    """What each small kernel of a step costs where it runs: the step with that kernel replaced by
    nothing (an empty or passed-through tensor of its output's shape; the logits are then
    meaningless, the products and every other kernel run as before). The norms between two
    products run inside the split products (engine/model.py: add_norm): "-add_rmsnorm" takes out
    the final norm alone."""
    from mtpchat.engine import model
    from mtpchat.kernels import attention, conv, gdn, norm
    kept = {(norm, "add_rmsnorm"): norm.add_rmsnorm, (conv, "conv_update"): conv.conv_update,
            (gdn, "recurrent"): gdn.recurrent, (norm, "gated_rmsnorm"): norm.gated_rmsnorm,
            (attention, "decode_attention"): attention.decode_attention, (model, "qkv_norm_rope"): model.qkv_norm_rope}
    skip = {"add_rmsnorm": lambda x, r, w, eps, out=None: (r, r),
            "conv_update": lambda x, buf, off, w, live=None: x,
            "recurrent": lambda q, k, v, *rest: torch.empty(v.shape, dtype=v.dtype, device=v.device),
            "gated_rmsnorm": lambda x, z, w, eps: torch.empty(x.shape, dtype=x.dtype, device=x.device),
            "decode_attention": lambda q, *rest: torch.empty(q.shape, dtype=q.dtype, device=q.device),
            "qkv_norm_rope": lambda q, *rest: q}

    def without(name):
        def setup():
            for (module, fn), f in kept.items():
                setattr(module, fn, skip[fn] if fn == name else f)
        return setup
    return {"all": without(None), **{f"-{name}": without(name) for name in skip}}


def attention_plans() -> dict:
    """Key spans for decode attention (kernels/attention.py: _config, a function of the cache size
    only): the default (spans of 64 keys first, then larger ones) against the larger spans only;
    and the spans the combining kernel folds at a time, with its warps (_combine_config)."""
    from mtpchat.kernels import attention
    default = attention._config

    combine = attention._combine_config

    def spans(rule):
        def setup():
            attention._config, attention._combine_config = rule, combine
        return setup

    def folds(cfg):
        def setup():
            attention._config, attention._combine_config = default, (lambda: cfg) if cfg else combine
        return setup
    return {"base": folds(None), "one size": spans(lambda L: (0, *default(L)[1:])),
            "first 32": spans(lambda L: (32, *default(L)[1:])),
            "combine 32/4w": folds((32, 4)), "combine 32/8w": folds((32, 8)), "combine 64/8w": folds((64, 8))}


def split_plans() -> dict:
    """The blocks' last products (o_proj, out_proj, MLP down): one product each, then the residual
    add and norm kernel ("unsplit"); split over K into float32 parts that the norm kernel adds
    ("parts"); split, with each column block's last program adding its parts and the residual and
    the next product taking the norm's scale ("split norm", the default: engine/model.py add_norm);
    and that under other splits and tiles ("S3 64x128w4s4": 3 parts, 64 columns by 128 bf16 of K,
    4 warps, 4 deep)."""
    from mtpchat.engine import model
    kept = model.out_linear

    def split(cfg, split_norm=True):
        def setup():
            model.out_linear, model.SPLIT_NORM = kept, split_norm
            matvec_parts._split_config = DEFAULT_SPLIT if cfg is None else (
                lambda N, K, itemsize: cfg if itemsize == 2 else DEFAULT_SPLIT(N, K, itemsize))
        return setup

    def unsplit():
        model.out_linear = model.linear
    plans = {"unsplit": unsplit, "parts": split(None, split_norm=False), "split norm": split(None)}
    for cfg in [(2, 64, 128, 4, 4), (4, 64, 128, 4, 4), (1, 64, 256, 4, 4), (2, 64, 256, 4, 4)]:
        plans["S{}x{}x{}w{}s{}".format(*cfg)] = split(cfg)
    return plans


def small_plans() -> dict:
    """Tiles and warps of the small kernels, one kernel at a time: the GDN recurrence (value columns
    a program, warps), the conv (channels a program, warps), the residual add and norm (warps for a
    5120-wide row)."""
    from mtpchat.kernels import conv, gdn, norm
    kept = {(gdn, "_tile"): gdn._tile, (conv, "_tile"): conv._tile, (norm, "_launch_params"): norm._launch_params}

    def use(module, name, fn):
        def setup():
            for (m, n), f in kept.items():
                setattr(m, n, fn if (m, n) == (module, name) else f)
        return setup
    plans = {"base": use(None, None, None)}
    for bv, warps in [(8, 1), (32, 1), (32, 2), (16, 2), (64, 2)]:
        plans[f"recurrent {bv}/{warps}w"] = use(gdn, "_tile", lambda DV, c=(bv, warps): c)
    for bc, warps in [(32, 2), (32, 4), (64, 2), (128, 4), (256, 4)]:
        plans[f"conv {bc}/{warps}w"] = use(conv, "_tile", lambda c=(bc, warps): c)
    for warps in (4, 8, 32):
        plans[f"norm {warps}w"] = use(norm, "_launch_params", lambda D, w=warps, f=kept[norm, "_launch_params"]:
                                      (f(D)[0], w) if D > 1024 else f(D))
    return plans


def tail_plans() -> dict:
    """The products whose last wave of column blocks is small (the MLP gate|up: 8 of 272 blocks on
    132 SMs) as one program a block ("whole") or with that wave split over K into 3 parts a block
    (kernels/matvec.py: TAIL_SPLIT, TAIL_PARTS, "split 3"), or into 2-14 parts (14 fill the SMs);
    with the large last waves (GDN in_proj 126 of 258 blocks, q|gate|k|v 92 of 224) split too; and
    the products of a few blocks (an MoE router's 5) split in every block (SMALL_SPLIT, "small N":
    up to N parts; only the MoE models have such products)."""
    default = DEFAULT_TAIL[0]

    def tail(on, parts=3, wide=None, small=0):
        def config(blocks, KI, P):
            if wide and blocks > P and blocks % P > P // 4:
                KS = matvec.triton.cdiv(KI, wide)
                return matvec.triton.cdiv(KI, KS), KS
            return default(blocks, KI, P)

        def setup():
            matvec.TAIL_SPLIT, matvec.TAIL_PARTS, matvec._tail_config = on, parts, config
            matvec.SMALL_SPLIT, matvec.SMALL_PARTS = small > 0, small or DEFAULT_SMALL[1]
        return setup
    return {"whole": tail(False), **{f"split {n}": tail(True, n) for n in (3, 2, 4, 5, 6, 8, 14)},
            "split 3 wide 2": tail(True, 3, 2), "split 3 wide 3": tail(True, 3, 3),
            **{f"split 3 small {n}": tail(True, 3, small=n) for n in (8, 4, 2)}}


def products_ms(model, reps: int = 20) -> float:
    """One decode step's products alone, in the step's order (each waits for the one before, as in
    the step), on the model's own weights: what the step's other kernels add is the difference."""
    xs = {}
    calls = []
    plain, glu, parts = matvec.matvec, matvec.matvec_swiglu, matvec_parts.matvec_parts
    for layer in model.layers:
        m = layer.mixer
        ws = [m.in_proj, m.out_proj] if layer.kind != "full_attention" else [m.qkv, m.o_proj]
        calls += [(ws[0], plain), (ws[1], parts), (layer.mlp.gate_up, glu), (layer.mlp.down, parts)]
    calls.append((model.head, plain))
    for w, _ in calls:
        xs.setdefault(w.shape[1], torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device))
    run = lambda: [fn(xs[w.shape[1]], w) for w, fn in calls]
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


def kernel_resources():
    """Warps, stages, shared memory and registers of each compiled matvec kernel."""
    out = []
    for fn in (matvec._matvec_kernel, matvec_parts._matvec_parts_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for kernel in cache[0].values():
                md = kernel.metadata
                ptx = kernel.asm.get("ptx", "")
                out.append(f"{fn.__name__} warps={md.num_warps} stages={md.num_stages} smem={md.shared} "
                           f"regs={getattr(kernel, 'n_regs', '?')} cp.async={ptx.count('cp.async')} "
                           f"bulk={ptx.count('cp.async.bulk')}")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--plans", default="tiles", choices=("pdl", "tiles", "knockout", "attention", "split", "small", "resident",
                                                           "tail", "fp8glu", "bits", "draft", "router", "staged"))
    p.add_argument("--weights", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--only", help="comma-separated plan names (the first is the base of the ratios)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-context", type=int, help="the cache size (default: the context + 256)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--room", type=int, default=1 << 20,
                   help="tokens the generation may still emit: 0 replays ended steps, which write no GDN state")
    p.add_argument("--products", action="store_true", help="also time the decode step's products alone")
    p.add_argument("--json")
    a = p.parse_args()
    plans = {"pdl": pdl_plans, "tiles": tile_plans, "knockout": knockout_plans, "attention": attention_plans,
             "split": split_plans, "small": small_plans, "resident": resident_plans,
             "tail": tail_plans, "fp8glu": fp8_glu_plans, "bits": bits_plans,
             "draft": draft_plans, "router": router_plans, "staged": staged_plans}[a.plans]()
    if a.only:
        plans = {name: plans[name] for name in a.only.split(",")}
    config = ModelConfig.load(CONFIGS / f"{a.model}.json")
    engine = Engine(config, device="cuda", dtype=torch.bfloat16, max_context=a.max_context or a.context + 256,
                    cuda_graphs=False, weights=a.weights)
    d = engine.decoder
    for _ in engine.generate(random_prompt(engine, a.context, 1), SamplingParams(max_tokens=2, stop_token_ids=())):
        pass
    d.room.fill_(a.room)
    kept = (d.pos, d.state.fold, d.state.parity, d.state.conv_off, d.pend_n, d.room)
    save = [t.clone() for t in kept]

    def restore():
        for t, s in zip(kept, save):
            t.copy_(s)

    phases = {"verify 0": lambda: d.verify(0), "verify 3": lambda: d.verify(3), "draft 3": lambda: d.draft(3)}
    graphs, logits = {}, {}
    pool = torch.cuda.graph_pool_handle()
    for name, setup in list(plans.items()):
        setup()
        try:
            for phase, fn in phases.items():
                restore()
                fn()                               # compiles this plan's kernels
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    restore()
                    fn()
                graphs[name, phase] = g
        except Exception as e:                     # a tile that does not fit, and the like
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            del plans[name]
            graphs = {key: g for key, g in graphs.items() if key[0] != name}
            continue
        restore()
        graphs[name, "verify 0"].replay()
        logits[name] = d.v_logits[:1].clone()
    first = next(iter(plans))
    def defaults():
        _triton._pdl_device, matvec._config, matvec_parts._split_config = PDL_ON, DEFAULT_TILES, DEFAULT_SPLIT
        matvec.TAIL_SPLIT, (matvec._tail_config, matvec.TAIL_PARTS) = True, DEFAULT_TAIL
        fp8_format.WIDEN_BITS = False
        matvec.SMALL_SPLIT, matvec.SMALL_PARTS = DEFAULT_SMALL
        mtp.FC_SPLIT, decoder.DRAFT_PICK, model.ROUTER_FUSED = False, False, False

    products = {}
    if a.products:                 # the products alone: under each plan where the plans choose them
        for name, setup in plans.items() if a.plans in ("tail", "tiles", "resident") else [("defaults", defaults)]:
            setup()
            products[name] = products_ms(engine.model)
    defaults()
    same = {name: bool(torch.equal(logits[name], logits[first])) for name in plans} if a.room == 0 else {}
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
    out = {"plans": a.plans, "same_logits": same, "ms": {}, "spread": {}, "resources": kernel_resources()}
    base = {phase: statistics.median(times[first, phase]) for phase in phases}
    for name in plans:
        row = {phase: statistics.median(times[name, phase]) for phase in phases}
        out["ms"][name] = row
        out["spread"][name] = {phase: [min(times[name, phase]), max(times[name, phase])] for phase in phases}
        rel = "  ".join(f"{ph} {ms:7.3f} ms ({ms / base[ph]:.4f})" for ph, ms in row.items())
        print(f"{name:>18}: {rel}  same logits: {same.get(name)}", flush=True)
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
