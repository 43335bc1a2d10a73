"""The GDN recurrence of a step (kernels/gdn.py's `_recurrent_kernel`: a fold of the last step's
kept tokens, then the step's own, one after another through the state) written in Gluon, where
every layout is stated: the state [dk, BV] in one blocked layout, a token's k and q born in its row
slice and v, the delta and the output in its column slice. The Triton kernel's loop changes layout
through shared memory three times a token (k and q into the state's row slice, the output row for
its store: three `BAR.SYNC` in its SASS on sm_90, docs/PERFORMANCE.md 2026-11-29 (fourteenth)),
each on the chain a warp runs token by token; this form has none. A probe of that lead, with the
plain step's contract (no conv, no live flag): the same outputs, state and kept tokens as
gdn.recurrent_ref within float32 rounding, not the engine kernel's bits (its sums of squares run
in another order).

    cd tests/bench && python3 probe_gdn_gluon.py                  # GPU: checked, then timed beside the engine's
    cd tests/bench && python3 probe_gdn_gluon.py --compile-only   # no GPU: SASS counts on sm_90, both kernels

Timed as a step runs them: the 27B's GDN shapes (16 key heads, 48 value heads of 128 x 128), one
launch a layer over 48 layers' states in a CUDA graph, at (T, fold) = (1, 0) a decode after a
decode, (1, 3) a decode after a verify, (4, 2) and (4, 4) verifies of 3. The engine's kernel runs as
the engine launches it (PDL on Hopper, the any-stride form); this one without PDL.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

from mtpchat.kernels import gdn

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError as e:            # a Triton without Gluon (before 3.5)
    sys.exit(f"this probe needs Triton's Gluon (triton.experimental.gluon): {e}")

BV = 16          # value columns a program, as the engine's kernel (gdn._tile)
LAYERS = 48      # the 27B's GDN layers: one launch each, over its own state


def state_layout(rows_a_thread: int = 4, lanes_down: int = 8, bv: int = BV):
    """The state tile [dk, bv] on one warp: `lanes_down` lanes down the rows, the rest across the
    columns, each lane `rows_a_thread` neighbouring rows (repeated down dk) x its share of the columns."""
    across = 32 // lanes_down
    assert bv % across == 0, f"{across} lanes across {bv} columns"
    return gl.BlockedLayout(size_per_thread=[rows_a_thread, bv // across], threads_per_warp=[lanes_down, across],
                            warps_per_cta=[1, 1], order=[1, 0])


@gluon.jit
def _flag(x, n: gl.constexpr, layout: gl.constexpr):
    # a scalar 0 / 1 as a [n] mask in `layout`
    return (gl.zeros([n], gl.int64, layout) + x) > 0


@gluon.jit
def _recurrent_gluon(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, o, T, scale,
                     s_q, s_k, s_v, s_a, s_b, s_o, s_pp, s_pt,
                     GROUP: gl.constexpr, DK: gl.constexpr, DV: gl.constexpr, BV: gl.constexpr, LS: gl.constexpr,
                     PDL: gl.constexpr = False):
    # one program per (value head, block of BV value columns), as the engine's kernel
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    LR: gl.constexpr = gl.SliceLayout(1, LS)          # [DK]: a token's k and q
    LC: gl.constexpr = gl.SliceLayout(0, LS)          # [BV]: v, the delta, the output
    i_h = gl.program_id(0)
    i_v = gl.program_id(1)
    i_kh = i_h // GROUP
    o_k = gl.arange(0, DK, layout=LR)
    o_v = i_v * BV + gl.arange(0, BV, layout=LC)
    m_v = o_v < DV
    o_s = i_h * DK * DV + o_k[:, None] * DV + o_v[None, :]
    m_s = (o_k < DK)[:, None] & m_v[None, :]
    b_S = gl.load(state + o_s, mask=m_s, other=0.)
    b_head = 1 - gl.minimum(i_v, 1)                    # k, a, b kept by program 0 only
    b_par = gl.load(parity)
    b_fold = gl.load(fold)
    W: gl.constexpr = DK + DV + 2
    p_in = pend + b_par * s_pp + i_h * W
    p_out = pend + (1 - b_par) * s_pp + i_h * W
    b_A = gl.exp(gl.load(A_log + i_h).to(gl.float32))
    b_dt = gl.load(dt_bias + i_h).to(gl.float32)
    for j in range(b_fold + T):
        t = j - b_fold
        if j < b_fold:
            b_k = gl.load(p_in + j * s_pt + o_k)
            b_v = gl.load(p_in + j * s_pt + DK + o_v, mask=m_v, other=0.)
            b_a = gl.load(p_in + j * s_pt + DK + DV)
            b_b = gl.load(p_in + j * s_pt + DK + DV + 1)
            b_q = b_k
        else:
            b_k = gl.load(k + t * s_k + i_kh * DK + o_k).to(gl.float32)
            b_v = gl.load(v + t * s_v + i_h * DV + o_v, mask=m_v, other=0.).to(gl.float32)
            b_a = gl.load(a + t * s_a + i_h).to(gl.float32)
            b_b = gl.load(b + t * s_b + i_h).to(gl.float32)
            b_q = gl.load(q + t * s_q + i_kh * DK + o_k).to(gl.float32)
        b_x = b_a + b_dt
        b_softplus = gl.where(b_x > 20., b_x, gl.log(1. + gl.exp(b_x)))
        b_beta = 1. / (1. + gl.exp(-b_b))
        b_kn = b_k * gl.rsqrt(gl.sum(b_k * b_k, axis=0) + 1e-6)
        b_S = b_S * gl.exp(-b_A * b_softplus)
        b_delta = b_beta * (b_v - gl.sum(b_S * b_kn[:, None], axis=0))
        b_S = b_S + b_kn[:, None] * b_delta[None, :]
        # the state written once: when the fold is done, or after a one-token step's token
        b_last = gl.where(j == gl.where(T == 1, b_fold, b_fold - 1), 1, 0)
        gl.store(state + o_s, b_S, mask=m_s & _flag(b_last, BV, LC)[None, :])
        b_new = gl.where(t >= 0, 1, 0)
        b_keep = b_new * gl.where(T == 1, 0, 1)
        b_o = gl.sum(b_S * (b_q * (gl.rsqrt(gl.sum(b_q * b_q, axis=0) + 1e-6) * scale))[:, None], axis=0)
        gl.store(o + t * s_o + i_h * DV + o_v, b_o.to(o.dtype.element_ty), mask=m_v & _flag(b_new, BV, LC))
        gl.store(p_out + t * s_pt + DK + o_v, b_v, mask=m_v & _flag(b_keep, BV, LC))
        gl.store(p_out + t * s_pt + o_k, b_k, mask=_flag(b_head * b_keep, DK, LR))
        o_g = gl.arange(0, 2, layout=LC)
        gl.store(p_out + t * s_pt + DK + DV + o_g, gl.where(o_g == 0, b_a, b_b), mask=_flag(b_head * b_keep, 2, LC))


# (bv, rows a lane, lanes down the rows, PDL): the Gluon forms timed
VARIANTS = {"g16 r4 d8": (16, 4, 8, False), "g16 r1 d8": (16, 1, 8, False), "g16 r4 d4": (16, 4, 4, False),
            "g16 r4 d2": (16, 4, 2, False), "g16 r8 d2": (16, 8, 2, False), "g16 r4 d16": (16, 4, 16, False),
            "g8 r4 d8": (8, 4, 8, False), "g8 r4 d4": (8, 4, 4, False), "g8 r8 d4": (8, 8, 4, False),
            "g16 r4 d4 pdl": (16, 4, 4, True), "g8 r4 d4 pdl": (8, 4, 4, True)}


def recurrent_gluon(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, variant=(BV, 4, 8, False)):
    """gdn.recurrent_ref's contract for a plain step (no live flag): q, k [T, Hk, dk], v [T, Hv, dv]."""
    T, Hk, DK = q.shape
    Hv, DV = v.shape[1], v.shape[2]
    bv, rows, down, with_pdl = variant
    o = torch.empty(T, Hv, DV, dtype=v.dtype, device=v.device)
    _recurrent_gluon[(Hv, triton.cdiv(DV, bv))](
        q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, o, T, DK ** -0.5,
        q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), o.stride(0), pend.stride(0), pend.stride(1),
        GROUP=Hv // Hk, DK=DK, DV=DV, BV=bv, LS=state_layout(rows, down, bv), num_warps=1, PDL=with_pdl,
        **({"launch_pdl": True} if with_pdl else {}))
    return o


def recurrent_engine(q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, bv=BV, with_pdl=True):
    """The engine's any-stride kernel launched as gdn._step launches it, with `bv` value columns a
    program and PDL on or off."""
    T, Hk, DK = q.shape
    Hv, DV = v.shape[1], v.shape[2]
    o = torch.empty(T, Hv, DV, dtype=v.dtype, device=v.device)
    gdn._recurrent_kernel_any_stride[(Hv, triton.cdiv(DV, bv))](
        q, k, v, a, b, A_log, dt_bias, state, pend, fold, parity, fold, o, T,
        DK ** -0.5, q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), o.stride(0),
        pend.stride(0), pend.stride(1), GROUP=Hv // Hk, DK=DK, DV=DV, BV=bv,
        HAS_LIVE=False, num_warps=1, **({"PDL": True, "launch_pdl": True} if with_pdl else {"PDL": False}))
    return o


def inputs(T, fold, device, seed, Hk=16, Hv=48, dk=128, dv=128, R=5):
    """A step's q | k | v (views of one conv row), a, b, the gates' parameters, a state and pend."""
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape, scale=1.0: torch.randn(*shape, generator=g, device=device) * scale
    mixed = rnd(T, 2 * Hk * dk + Hv * dv).to(torch.bfloat16)
    q, k, v = mixed.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    ab = (rnd(T, 2 * Hv) * 2).to(torch.bfloat16)
    args = (q.view(T, Hk, dk), k.view(T, Hk, dk), v.view(T, Hv, dv), ab[:, :Hv], ab[:, Hv:],
            rnd(Hv, scale=0.5), rnd(Hv))
    state = rnd(Hv, dk, dv, scale=0.2)
    pend = rnd(2, R, Hv, gdn.pending_width(dk, dv))
    long = lambda x: torch.tensor([x], device=device)
    return args, state, pend, long(fold), long(fold % 2)


def check(T, fold, variant):
    args, state, pend, n, parity = inputs(T, fold, "cuda", seed=T + 7 * fold)
    got_s, got_p, want_s, want_p = state.clone(), pend.clone(), state.clone(), pend.clone()
    got = recurrent_gluon(*args, got_s, got_p, n, parity, variant)
    want = gdn.recurrent_ref(*args, want_s, want_p, n, parity)
    rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()
    return {"output": rel(got, want), "state": rel(got_s, want_s), "kept": rel(got_p, want_p)}


def time_step(T, fold, form, variant=None) -> float:
    """us a launch, LAYERS launches over their own states in a graph (graph_timing.graph_time)."""
    from graph_timing import graph_time
    args, state, pend, n, parity = inputs(T, fold, "cuda", seed=1)
    states = [state.clone() for _ in range(LAYERS)]
    pends = [pend.clone() for _ in range(LAYERS)]
    saved = [s.clone() for s in states], [p.clone() for p in pends]
    if form == "engine":
        fn = lambda i: recurrent_engine(*args, states[i], pends[i], n, parity, *variant)
    else:
        fn = lambda i: recurrent_gluon(*args, states[i], pends[i], n, parity, variant)
    us = min(graph_time(fn, LAYERS, LAYERS) for _ in range(3))
    for s, p, s0, p0 in zip(states, pends, *saved):       # a step's writes, undone (fold > 0 writes the state)
        s.copy_(s0)
        p.copy_(p0)
    return us


def compile_only():
    """Both kernels compiled for sm_90 without a GPU: instructions, barriers and shuffles in the SASS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    types = {n: "*bf16" for n in ("q", "k", "v", "a", "b", "o")} | {n: "*fp32" for n in ("A_log", "dt_bias", "state", "pend")} \
        | {n: "*i64" for n in ("fold", "parity", "live")} | {"scale": "fp32"}
    aligned = ("q", "k", "v", "a", "b", "o", "state", "pend", "s_ls", "s_lp", "s_lg")
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

    def sass_counts(kernel, what):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "k.cubin").write_bytes(kernel.asm["cubin"])
            sass = subprocess.run([str(bindir / "nvdisasm"), "-c", str(Path(d) / "k.cubin")], capture_output=True,
                                  text=True).stdout
        lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        count = lambda op: sum(1 for line in lines if re.search(rf"\s{op}[\s.]", line))
        print(f"{what}: {len(lines)} instructions, BAR {count('BAR')}, SHFL {count('SHFL')}, STS {count('STS')}, "
              f"LDS {count('LDS')}, shared {kernel.metadata.shared} B")

    fn = gdn._recurrent_kernel_any_stride
    consts = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    consts.update(GROUP=3, DK=128, DV=128, BV=BV, HAS_LIVE=True, PDL=True, xc=None, buf=None, off=None, cw=None)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in fn.arg_names}
    kernel = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, num_stages=3))
    sass_counts(kernel, "the engine's kernel (Triton)")
    fn = _recurrent_gluon
    for name, (bv, rows, down, with_pdl) in VARIANTS.items():
        consts = dict(GROUP=3, DK=128, DV=128, BV=bv, LS=state_layout(rows, down, bv), PDL=with_pdl)
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in fn.arg_names}
        kernel = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
        sass_counts(kernel, f"Gluon {name}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compile-only", action="store_true")
    a = p.parse_args()
    if a.compile_only:
        return compile_only()
    print(f"{torch.cuda.get_device_name()}: us a launch, {LAYERS} launches in a graph (the 27B's GDN shapes)")
    cases = ((1, 0), (1, 3), (4, 2), (4, 4), (4, 3))
    print(f"{'form':18s}" + "".join(f"  T={T} f={f}" for T, f in cases) + "   worst error against float32 (output, state, kept)")
    engines = {"engine 16 pdl": (16, True), "engine 16": (16, False), "engine 8 pdl": (8, True), "engine 32 pdl": (32, True)}
    for name, variant in engines.items():
        print(f"{name:18s}" + "".join(f"  {time_step(T, f, 'engine', variant):8.2f}" for T, f in cases), flush=True)
    for name, variant in VARIANTS.items():
        try:
            errs = [check(T, f, variant) for T, f in cases]
            worst = [max(e[key] for e in errs) for key in ("output", "state", "kept")]
            times = [time_step(T, f, "gluon", variant) for T, f in cases]
        except Exception as e:          # a form this Triton cannot lay out
            print(f"{name:18s}  failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        print(f"{name:18s}" + "".join(f"  {t:8.2f}" for t in times) + "   " + " ".join(f"{w:.1e}" for w in worst),
              flush=True)


if __name__ == "__main__":
    main()
