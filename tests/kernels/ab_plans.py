"""Launch plans of ab_step.py for the FP8 products, the draft step and the MoE router (the staged
changes among them: kernels/fp8.py WIDEN_BITS, engine/mtp.py FC_SPLIT, engine/decoder.py DRAFT_PICK,
kernels/matvec.py SMALL_SPLIT, engine/model.py ROUTER_FUSED). A plan is a name and a function that
sets the choice it stands for; ab_step.py's `defaults` undoes them."""
from __future__ import annotations

from mtpchat.engine import decoder, model, mtp
from mtpchat.kernels import fp8 as fp8_format
from mtpchat.kernels import matvec

DEFAULT_TILES = matvec._config


def fp8_glu_plans() -> dict:
    """The FP8 MLP gate|up (SwiGLU) under two-warp tiles (bench_fp8.py: 32 x 128, 2 warps, 3-4 deep
    reached 2.30-2.38 TB/s alone against 1.79 for the default 64 x 128, 4 warps, 6 deep)."""
    def glu(cfg):
        def tiles(N, K, itemsize, swiglu=False, fp8=False):
            return cfg if fp8 and swiglu and cfg else DEFAULT_TILES(N, K, itemsize, swiglu, fp8)
        return lambda: setattr(matvec, "_config", tiles)
    return {"base": glu(None), "glu:32x128w2s3": glu((32, 128, 2, 3)), "glu:32x128w2s4": glu((32, 128, 2, 4))}


def bits_plans() -> dict:
    """FP8 weight tiles widened to bf16 by moving bits (kernels/fp8.py widen) against Triton's
    conversion: under the default tiles, and under tiles the conversion made slower (plain products
    on 2 warps, which take mma.sync and groups of 4; the SwiGLU product's earlier 64 x 128 on 4).
    With --room 0 the logits of every plan must be the conversion's, bit for bit."""
    def use(bits: bool, plain=None, glu=None):
        def tiles(N, K, itemsize, swiglu=False, fp8=False):
            cfg = (glu if swiglu else plain) if fp8 else None
            return cfg or DEFAULT_TILES(N, K, itemsize, swiglu, fp8)

        def setup():
            fp8_format.WIDEN_BITS = bits
            matvec._config = tiles
        return setup
    return {"cvt": use(False), "bits": use(True), "bits plain:32x128w2s4": use(True, plain=(32, 128, 2, 4)),
            "bits glu:64x128w4s6": use(True, glu=(64, 128, 4, 6))}


STAGED = ("bits", "small split", "fc split", "pick", "fused router")


def switched(on: set):
    """A plan's setup: each staged switch on if its name is in `on`, off otherwise (so the order of
    the plans does not matter)."""
    def setup():
        fp8_format.WIDEN_BITS = "bits" in on
        matvec.SMALL_SPLIT = "small split" in on
        mtp.FC_SPLIT, decoder.DRAFT_PICK = "fc split" in on, "pick" in on
        model.ROUTER_FUSED = "fused router" in on
    return setup


def alone_and_together(names: tuple) -> dict:
    return {"none": switched(set()), **{name: switched({name}) for name in names}, "all": switched(set(names))}


def draft_plans() -> dict:
    """The draft step's staged changes, alone and together: the MTP head's fc split over K and
    finished by its layer's input norm (engine/mtp.py FC_SPLIT) and the draft's argmax and id map
    as two PDL kernels (engine/decoder.py DRAFT_PICK). Read the "draft 3" phase."""
    return alone_and_together(("fc split", "pick"))


def router_plans() -> dict:
    """An MoE model's router: the 5-program product and the routing kernel ("none"), the product
    split in every block (SMALL_SPLIT; it reaches every product of few blocks), or product and
    routing in one kernel (ROUTER_FUSED). Run with --model qwen3.5-35b-a3b."""
    return alone_and_together(("small split", "fused router"))


def staged_plans() -> dict:
    """Every staged switch alone against none, and all together: one run a model and weight format
    decides them (the bit form matters with --weights fp8 only, the router and the fused routing on
    the MoE models only)."""
    return alone_and_together(STAGED)
