"""The candidate kernel plans that ab_step.py times in whole steps: each family (FAMILIES, and the
two built from a benchmark's JSON, fp8_tile_plans and int4_tile_plans) maps plan names to the
engine's own plan with some choices changed (engine/plan.py KernelPlan.replace). ab_step.py's
docstring says what each family compares and how to run it.
"""
from __future__ import annotations

import ast

from mtpchat.engine.plan import KernelPlan
from mtpchat.kernels import matvec_parts


def tile_rule(rule, name: str):
    """A ProductPlan tile rule from rule(N, K, swiglu) -> (BN, BK, warps, stages) or None (bf16 only)."""
    def tiles(N, K, itemsize, swiglu=False, fp8=False):
        return rule(N, K, swiglu) if itemsize == 2 and not fp8 else None
    tiles.__name__ = name
    return tiles


def int4_tiles_of(tiles: dict, name: str = "int4:given"):
    """A ProductPlan int4_tiles rule from {product: (BN, BK, warps, stages)}: those products' 4-bit
    tiles, the measured ones for the rest."""
    def int4_tiles(product, N, K, group):
        return tiles.get(product)
    int4_tiles.__name__ = name
    return int4_tiles


def tile_arguments(args: list[str]) -> tuple[dict, list[str]]:
    """Command-line arguments "tile.PRODUCT=(BN, BK, warps, stages)" -> ({PRODUCT: tile}, the others)."""
    tiles = {a.split("=", 1)[0][len("tile."):]: ast.literal_eval(a.split("=", 1)[1]) for a in args if a.startswith("tile.")}
    return tiles, [a for a in args if not a.startswith("tile.")]


def tile_plans(base: KernelPlan) -> dict:
    """Tiles for one group of the 27B's products at a time: the two 5120 x 6144 (GDN out_proj,
    attention o_proj), the MLP down (5120 x 17408), the wide inputs (GDN in_proj 16480 rows,
    attention q|gate|k|v 14336), the MLP gate|up (SwiGLU, 17408 columns) and the lm_head."""
    groups = {"out": lambda N, K, g: N == 5120 and K == 6144, "down": lambda N, K, g: N == 5120 and K == 17408,
              "in": lambda N, K, g: N in (16480, 14336) and not g, "glu": lambda N, K, g: g,
              "lm": lambda N, K, g: N > 100_000, "plain": lambda N, K, g: not g and N < 100_000}
    plans = {"base": base}
    for name, cfgs in {"out": [(64, 256, 8, 4), (64, 128, 4, 8), (64, 256, 2, 4)],
                       "down": [(64, 256, 8, 4), (64, 128, 4, 8), (64, 256, 2, 4)],
                       "in": [(128, 128, 4, 4), (128, 128, 8, 4), (64, 256, 8, 4)],
                       "glu": [(16, 256, 4, 6), (32, 256, 8, 6), (32, 128, 4, 8), (64, 128, 4, 6), (64, 128, 4, 4),
                               (128, 64, 4, 6), (64, 64, 4, 8), (32, 128, 4, 6), (128, 128, 4, 3)],
                       "lm": [(128, 128, 4, 4)],
                       "plain": [(64, 256, 4, 3), (64, 256, 4, 5), (64, 128, 4, 6), (64, 128, 4, 5)]}.items():
        for cfg in cfgs:
            label = f"{name}:{cfg[0]}x{cfg[1]}w{cfg[2]}s{cfg[3]}"
            rule = tile_rule(lambda N, K, g, name=name, cfg=cfg: cfg if groups[name](N, K, g) else None, label)
            plans[label] = base.replace(tiles=rule)
    return plans


def resident_plans(base: KernelPlan) -> dict:
    """Tiles of the wide products (GDN in_proj 258 blocks of 64 rows, attention q|gate|k|v 224, the
    MLP gate|up 272 SwiGLU blocks) whose shared memory lets every program be resident at once on
    132 SMs (the default tiles take 160-180 KB, one program an SM, two waves and a bit)."""
    wide = lambda N, K, g: N in (16480, 14336) and not g
    rules = {"in:64x128w4s4": lambda N, K, g: (64, 128, 4, 4) if wide(N, K, g) else None,
             "in:64x64w4s6": lambda N, K, g: (64, 64, 4, 6) if wide(N, K, g) else None,
             "glu:64x64w4s4": lambda N, K, g: (64, 64, 4, 4) if g else None,
             "glu:32x64w4s4": lambda N, K, g: (32, 64, 4, 4) if g else None}
    return {"base": base, **{name: base.replace(tiles=tile_rule(rule, name)) for name, rule in rules.items()}}


def split_plans(base: KernelPlan) -> dict:
    """The blocks' last products (o_proj, out_proj, MLP down) split over K into float32 parts that the
    norm kernel adds ("parts"), or with each column block's last program adding its parts and the
    residual and the next product taking the norm's scale ("split norm", the default), and that
    under other splits and tiles ("S3x64x128w4s4": 3 parts, 64 columns by 128 bf16 of K, 4 warps,
    4 deep)."""
    def split(cfg, name):
        def rule(N, K, itemsize):
            return cfg if itemsize == 2 else None
        rule.__name__ = name
        return rule
    plans = {"split norm": base, "parts": base.replace(split_norm=False)}
    for cfg in [(2, 64, 128, 4, 4), (4, 64, 128, 4, 4), (1, 64, 256, 4, 4), (2, 64, 256, 4, 4)]:
        name = "S{}x{}x{}w{}s{}".format(*cfg)
        plans[name] = base.replace(split_tiles=split(cfg, name))
    return plans


def tail_plans(base: KernelPlan) -> dict:
    """The products whose last wave of column blocks is small (the MLP gate|up: 8 of 272 blocks on
    132 SMs) as one program a block ("whole") or with that wave split over K into 2-14 parts a
    block (14 fill the SMs); the products of a few blocks (an MoE router's 5) split in every block
    into up to N parts ("small N"), or not ("no small")."""
    return {"split 3": base, "whole": base.replace(tail_split=False),
            **{f"split {n}": base.replace(tail_parts=n) for n in (2, 4, 5, 6, 8, 14)},
            "no small": base.replace(small_split=False),
            **{f"small {n}": base.replace(small_split=True, small_parts=n) for n in (8, 4, 2)}}


def fp8_glu_plans(base: KernelPlan) -> dict:
    """The FP8 MLP gate|up (SwiGLU) under other tiles than its measured one (32 rows, 2 warps, 3 deep,
    one or two scale blocks a step as the device's plan says: matvec.tiles)."""
    def glu(cfg, name):
        def tiles(N, K, itemsize, swiglu=False, fp8=False):
            return cfg if fp8 and swiglu else None
        tiles.__name__ = name
        return tiles
    return {"base": base, **{name: base.replace(tiles=glu(cfg, name)) for name, cfg in
                             {"glu:32x128w2s4": (32, 128, 2, 4), "glu:64x128w4s6": (64, 128, 4, 6)}.items()}}


def bits_plans(base: KernelPlan) -> dict:
    """FP8 weight tiles widened to bf16 by moving bits (kernels/fp8.py widen; the default) against
    Triton's conversion, and in groups of 4 where the tile would take 2. With --room 0 the logits
    of every plan must be the conversion's, bit for bit."""
    return {"cvt": base.replace(widen_bits=False), "bits": base.replace(widen_bits=True),
            "bits x4": base.replace(widen_bits=True, widen_group=4)}


def draft_plans(base: KernelPlan) -> dict:
    """The draft step's forms, each off alone and both off: the MTP head's fc split over K and
    finished by its layer's input norm (fc_split) and the draft's argmax and id map as two PDL
    kernels (draft_pick); the head's input in one kernel (head_input) and the catch-up's hand-off
    to the chained drafts in one kernel (draft_chain), each flipped from the default. Read the
    "draft 3" phase."""
    flip = ("-" if base.head_input else "+") + "head input"
    chain = ("-" if base.draft_chain else "+") + "chain"
    return {"default": base, flip: base.replace(head_input=not base.head_input),
            chain: base.replace(draft_chain=not base.draft_chain),
            "-fc split": base.replace(fc_split=False), "-pick": base.replace(draft_pick=False),
            "-both": base.replace(fc_split=False, draft_pick=False)}


def int4_plans(base: KernelPlan) -> dict:
    """The 4-bit products' measured tiles (kernels/int4.py measured: over interleaved weights, the
    engine's default, their own) against: the pairs form's tiles over the same weights (plain and
    split 64 x 1024, 4 warps, 2 deep, split in parts for 240 programs; SwiGLU 64 x 256, 4 deep);
    rows padded to 16 (ProductPlan.int4_rows); and the natural layout (int4_interleave off: the
    pairs form and its tiles; captured first, the weights then converted in place). Logits may
    differ in the last bits between plans (split products sum other parts)."""
    programs = base.products.split_programs

    def pairs_tiles(product, N, K, group):
        if product == "swiglu":
            return 64, 256, 4, 4
        if product == "split":
            return max(1, min(-(-K // (3 * 1024)), round(programs / -(-N // 64)))), 64, 1024, 4, 2
        return 64, 1024, 4, 2
    pairs_tiles.__name__ = "int4:pairs' tiles"
    return {"measured": base, "pairs' tiles": base.replace(int4_tiles=pairs_tiles),
            "rows 16": base.replace(int4_rows=16), "natural": base.replace(int4_interleave=False)}


def int4_tile_plans(base: KernelPlan, found: dict) -> dict:
    """The fastest interleaved tiles of `bench_int4.py --interleaved-only` (its JSON: per product
    shape at T = 1, the us of each "(tile) interleaved" candidate) for the plain products, the
    SwiGLU, the split ones, and all together, against the measured tiles (int4.measured); weights
    interleaved in every plan."""
    table = {}
    for row in found["results"]:
        timed = {ast.literal_eval(label.rsplit(" ", 1)[0]): us for label, us in row.get("tiles", {}).items()
                 if label.endswith(" interleaved") and isinstance(us, float)}
        if timed:       # a SwiGLU product's tiles are chosen by its gate rows, half the weight's
            N = row["N"] // 2 if row["kind"] == "swiglu" else row["N"]
            table.setdefault(row["kind"], {})[N, row["K"]] = min(timed, key=timed.get)

    def rule(kinds, name):
        def int4_tiles(product, N, K, group):
            tile = table.get(product, {}).get((N, K)) if product in kinds else None
            if tile is not None and product == "split" and len(tile) == 4:
                return (matvec_parts.split_config(N, K, 2, base.products, group, True)[0],) + tile
            return tile
        int4_tiles.__name__ = name
        return int4_tiles
    plans = {"measured": base.replace(int4_interleave=True)}
    for kind in table:
        plans[kind] = base.replace(int4_interleave=True, int4_tiles=rule((kind,), f"int4:{kind}"))
    if len(table) > 1:
        plans["all"] = base.replace(int4_interleave=True, int4_tiles=rule(tuple(table), "int4:all"))
    return plans


def fp8_tiles_everywhere(base: KernelPlan, name: str, tiles: dict) -> KernelPlan:
    """The plan with every FP8 product of a kind on one tile: tiles {"plain": (BN, BK, warps,
    stages), "swiglu": ..., "parts": (S, BN, BK, warps, stages), "expert_swiglu", "expert_down":
    (BN, BK, warps, stages) of a step's MoE expert products, FP8 ones, "bf16_expert_swiglu",
    "bf16_expert_down" of bf16 ones}, each optional."""
    def tile(N, K, itemsize, swiglu=False, fp8=False):
        got = tiles.get("swiglu" if swiglu else "plain")
        return tuple(got) if fp8 and got else None
    tile.__name__ = f"fp8:{name}"

    def split(N, K, itemsize):        # every split product is FP8 under --weights fp8 (but the fc's)
        return tuple(tiles["parts"])
    split.__name__ = f"fp8:{name}"

    def experts(product, step, fp8, itemsize=2):
        got = tiles.get(("" if fp8 else "bf16_") + "expert_" + product)
        return tuple(got) if step and got and (fp8 or itemsize == 2) else None
    experts.__name__ = f"fp8:{name}"
    experts_ruled = any("expert_" in k for k in tiles)
    return base.replace(tiles=tile, split_tiles=split if "parts" in tiles else None,
                        expert_tiles=experts if experts_ruled else None)


def fp8_tile_plans(base: KernelPlan, found: dict) -> dict:
    """The best FP8 tiles of `bench_fp8.py --sweep` (its JSON's "best": per product shape, a tile or
    None for the default), for the plain products, the SwiGLU, the split ones, and all together; or
    named plans (its "plans": name -> tiles by kind, fp8_tiles_everywhere)."""
    if "plans" in found:
        return {"base": base, **{name: fp8_tiles_everywhere(base, name, tiles) for name, tiles in found["plans"].items()}}
    table = {kind: {(b["N"], b["K"]): tuple(b["tile"]) for b in found["best"].values()
                    if b["kind"] == kind and b["tile"]} for kind in ("plain", "swiglu", "parts")}

    def tiles_of(kinds, name):
        def tiles(N, K, itemsize, swiglu=False, fp8=False):
            kind = "swiglu" if swiglu else "plain"
            return table[kind].get((N, K)) if fp8 and kind in kinds else None
        tiles.__name__ = name
        return tiles

    def split(N, K, itemsize):        # the products of these shapes are FP8 under --weights fp8
        return table["parts"].get((N, K))
    split.__name__ = "fp8:split"
    plans = {"base": base}
    if table["plain"]:
        plans["plain"] = base.replace(tiles=tiles_of(("plain",), "fp8:plain"))
    if table["swiglu"]:
        plans["glu"] = base.replace(tiles=tiles_of(("swiglu",), "fp8:glu"))
    if table["parts"]:
        plans["split"] = base.replace(split_tiles=split)
    if len(plans) > 2:
        plans["all"] = base.replace(tiles=tiles_of(("plain", "swiglu"), "fp8:all"),
                                    split_tiles=split if table["parts"] else None)
    return plans


DEFAULT_FORMS = {"bits": dict(widen_bits=False), "small split": dict(small_split=False),
                 "fc split": dict(fc_split=False), "pick": dict(draft_pick=False), "head input": dict(head_input=False),
                 "chain": dict(draft_chain=False),
                 "routed layout": dict(routed_layout=False), "moe normed": dict(moe_normed=False),
                 "rides": dict(rides=False), "combine normed": dict(combine_normed=False),
                 "draft head int4": dict(draft_head_int4=False)}


def release_plans(base: KernelPlan) -> dict:
    """The few-row products let the next kernel's programs be placed as their own start (PDL's
    launch_dependents first, the default) or once they have streamed their weights
    (ProductPlan.late_release). With --room 0 the logits must be the same bits. (The MoE expert
    products released late as well took the 35B-A3B's phases 0.989-1.054 x the time of the dense
    products alone released late: not kept.)"""
    return {"at start": base.replace(late_release=False), "late": base.replace(late_release=True)}


def rows_plans(base: KernelPlan) -> dict:
    """The few-row products' row tile (ProductPlan.rows): their dots padded to 16 rows, or to 8 (the
    steps timed here take 1 to 5). With --room 0 the logits must be the same bits."""
    return {"rows 16": base.replace(rows=16), "rows 8": base.replace(rows=8)}


def conv_plans(base: KernelPlan) -> dict:
    """A step's GDN conv as a kernel of its own before the recurrence, computed by the recurrence
    kernel (KernelPlan.conv_in_recurrence: one launch a GDN layer fewer) in one-token steps or in
    every step, or by the in_proj's kernel in every step (conv_in_product). The
    logits must be the same bits."""
    return {"conv kernel": base.replace(conv_in_recurrence=0, conv_in_product=0),
            "in decode": base.replace(conv_in_recurrence=1, conv_in_product=0),
            "in every step": base.replace(conv_in_recurrence=1 << 10, conv_in_product=0),
            "in product": base.replace(conv_in_recurrence=0, conv_in_product=1 << 10)}


def stacked_plans(base: KernelPlan) -> dict:
    """The MoE expert SwiGLU's gate and up tiles apart (two dots a K step) or stacked
    (ProductPlan.expert_stacked, the default: one dot of 2 BN rows), the stacked on 4 warps (one chain of
    matrix instructions) or 8 (the gate and up halves on two warpgroups at once), and FP8 stacked on
    tiles of 32 columns (144 programs a decode step). The logits must be the same bits."""
    def warps8(product, step, fp8, itemsize=2):
        if product != "swiglu" or not step:
            return None
        return (64, 128, 8, 3) if fp8 else (64, 256, 8, 3)
    warps8.__name__ = "experts:swiglu 8 warps"

    def fp8_swiglu(tile):
        def rule(product, step, fp8, itemsize=2):
            return tile if product == "swiglu" and step and fp8 else None
        rule.__name__ = "experts:fp8 swiglu {}x{}w{}s{}".format(*tile)
        return rule
    return {"apart": base.replace(expert_stacked=False), "stacked": base.replace(expert_stacked=True),
            "stacked 8 warps": base.replace(expert_stacked=True, expert_tiles=warps8),
            "apart 8 warps": base.replace(expert_stacked=False, expert_tiles=warps8),
            **{f"stacked {BN}x{BK} w{w} s{st}": base.replace(expert_stacked=True, expert_tiles=fp8_swiglu((BN, BK, w, st)))
               for BN, BK, w, st in ((32, 128, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (32, 128, 2, 3))}}


def int4_stacked_plans(base: KernelPlan) -> dict:
    """The 4-bit experts' SwiGLU with its gate and up tiles apart (on the tile measured for them,
    64 x 256) or stacked (ProductPlan.int4_expert_stacked, the default for interleaved experts: one
    dot of 2 BN rows a group) on the measured tile (int4.measured) and others whose warps take 16 of
    its rows each. The logits must be the same bits."""
    def swiglu(tile):
        return int4_tiles_of({"expert_swiglu": tile}, "int4:expert swiglu {}x{}w{}s{}".format(*tile))
    return {"apart 64x256 w4 s4": base.replace(int4_expert_stacked=False, int4_tiles=swiglu((64, 256, 4, 4))),
            "stacked (measured)": base.replace(int4_expert_stacked=True),
            **{f"stacked {BN}x{BK} w{w} s{st}": base.replace(int4_expert_stacked=True, int4_tiles=swiglu((BN, BK, w, st)))
               for BN, BK, w, st in ((64, 256, 8, 4), (64, 256, 8, 3), (32, 512, 4, 3))}}


def routed_plans(base: KernelPlan) -> dict:
    """A step's MoE layout derived by every program of the expert kernels or written once by the
    routing kernel's last row (ProductPlan.routed_layout, the default). The logits must be the same
    bits."""
    return {"derived": base.replace(routed_layout=False), "routed": base.replace(routed_layout=True)}


def fold_plans(base: KernelPlan) -> dict:
    """A step's MoE layer finished by its own kernels (the down product, the combine, then the next
    norm whole) or in its down kernel (KernelPlan.moe_fold: each column block's last program
    combines, adds the residual and hands the next product a Normed; two launches a layer fewer).
    The MoE layer reading the norm before it as a Normed (KernelPlan.moe_normed: the router, the
    shared expert and the expert SwiGLU scale each row by its 1 / rms after their dots; a launch a
    layer fewer), alone and with the fold. The logits move by the norms' rounding."""
    off = base.replace(moe_fold=False, moe_normed=False)
    return {"combine": off, "folded": off.replace(moe_fold=True), "normed": off.replace(moe_normed=True),
            "folded normed": off.replace(moe_fold=True, moe_normed=True)}


def combine_plans(base: KernelPlan) -> dict:
    """A step's MoE layer finished by its combine kernel (KernelPlan.combine_normed: each program
    adds the residual to its row's block and writes the block's share of the next norm as a
    Normed; the norm kernel after the layer goes, a launch a layer fewer, with no arrival count)
    against the combine then the next norm whole. The logits move by the norm's rounding."""
    return {"norm apart": base.replace(combine_normed=False), "combine normed": base.replace(combine_normed=True)}


def draft_head_plans(base: KernelPlan) -> dict:
    """The trimmed draft head in bf16 or in 4 bits (KernelPlan.draft_head_int4: a quarter of the
    bytes of the lm_head rows each draft reads); the verify's logits stay the same bits."""
    return {"bf16 draft head": base.replace(draft_head_int4=False), "4-bit draft head": base.replace(draft_head_int4=True)}


def rider_plans(base: KernelPlan) -> dict:
    """An FP8 or 4-bit model's GDN b|a product (bf16) as a launch of its own, or riding as the first
    programs of the in_proj's launch (ProductPlan.rides: a launch a GDN layer fewer). The in_proj's
    logits are the same bits; b|a's move by its sums' order (one program over all of K against the
    small split's parts)."""
    return {"apart": base.replace(rides=False), "rides": base.replace(rides=True)}


def default_plans(base: KernelPlan) -> dict:
    """The plan's defaults that were measured in (DEFAULT_FORMS), each off alone against all on, and
    all off: the ratios say what each still buys on this model and weight format (the bit form
    matters with --weights fp8 only, the small split on the MoE models and FP8 only, the routed
    layout and moe_normed on the MoE models only)."""
    off = {k: v for forms in DEFAULT_FORMS.values() for k, v in forms.items()}
    return {"defaults": base, **{f"-{name}": base.replace(**forms) for name, forms in DEFAULT_FORMS.items()},
            "none": base.replace(**off)}


FAMILIES = {"defaults": default_plans, "tiles": tile_plans, "resident": resident_plans, "split": split_plans,
            "tail": tail_plans, "fp8glu": fp8_glu_plans, "bits": bits_plans, "draft": draft_plans,
            "int4": int4_plans, "rows": rows_plans, "release": release_plans, "conv": conv_plans,
            "combine": combine_plans, "drafthead": draft_head_plans, "stacked": stacked_plans, "routed": routed_plans, "moefold": fold_plans,
            "rides": rider_plans, "int4stacked": int4_stacked_plans}
