"""What the two Gluon probes of a few-row product share (probe_int4_gluon.py, probe_fp8_gluon.py):
x's tile in 16-byte loads (`x_layout`, the weights' columns packed in `slots` order), a program's
tiles of 16 rows and part of K (`_tiles`, `_part`, `split`), the split's parts added by the last to
arrive (`_finish`, `workspace`), and the harness: the variants' labels and arguments, the compile
driver without a GPU, the timing line beside the engine's product of each shape.
"""
from __future__ import annotations

import argparse
import sys

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError as e:            # a Triton without Gluon (before 3.5)
    sys.exit(f"the Gluon probes need Triton's Gluon (triton.experimental.gluon): {e}")


def x_layout(W: int):
    """x's tile as a thread loads it, [8 (n), 4 (q), 32]: lane (g, q) holds row g's 32 contiguous
    columns 32 q + 4 c + 2 h + j, which are the B operand's k = 16 c + 8 h + 2 q + j (the words are
    packed with their columns in that order: `slots`); every warp the same."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[0, 0, 0]] * (W - 1).bit_length(), block_bases=[], shape=[8, 4, 32])


def slots(K: int, device=None) -> torch.Tensor:
    """The column each slot of the operand's k takes in a group of 128: slot 16 c + 8 h + 2 q + j holds
    column 32 q + 4 c + 2 h + j, so that a lane's 32 columns of x are contiguous (x_layout)."""
    c, h, q, j = torch.meshgrid(*(torch.arange(n, device=device) for n in (8, 2, 4, 2)), indexing="ij")
    within = (32 * q + 4 * c + 2 * h + j).flatten()
    return (torch.arange(0, K, 128, device=device)[:, None] + within[None, :]).flatten()


def unslot(v: torch.Tensor) -> torch.Tensor:
    """Columns [N, K] in slots order (v[:, k] = w[:, slots(K)[k]]) back in their own order."""
    out = torch.empty_like(v)
    out[:, slots(v.shape[1], v.device)] = v
    return out


@gluon.jit
def _x_operand(x, BK: gl.constexpr, LB: gl.constexpr):
    # x_layout's tile -> the B operand [BK, 8], rows k = 16 c + 8 h + 2 q + j
    z = gl.permute(gl.reshape(x, [8, 4, 8, 2, 2]), (2, 3, 1, 4, 0))
    return gl.convert_layout(gl.reshape(z, [BK, 8]), LB, assert_trivial=True)


@gluon.jit
def _tiles(i_n, L4: gl.constexpr, MT: gl.constexpr, W: gl.constexpr, R: gl.constexpr):
    # over the words' first four axes [MT, W, 8, R] (layout L4): block i_n's tiles of 16 rows nt
    # [MT, W] (warp w's r-th: r W + w), and the aranges of g and of the spans
    mi = gl.arange(0, MT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    wi = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    gi = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
    ri = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    return (i_n * MT + mi[:, None]) * W + wi[None, :], gi, ri


@gluon.jit
def _part(K, KS, S: gl.constexpr, BK: gl.constexpr):
    # program pid's column block and its part of K (the first and last step's columns, the end)
    pid = gl.program_id(0)
    k_lo = (pid % S) * KS
    k_hi = gl.minimum(k_lo + KS, K)
    return pid, pid // S, k_lo, k_hi, k_hi - BK


@gluon.jit
def _x_pointers(x, T, s_x, LX: gl.constexpr):
    # x's tile as x_layout loads it (lane (g, q): row g's columns 32 q .. 32 q + 31 of a step), rows
    # past T masked
    tx = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))
    qx = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))
    ix = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))
    return (x + (tx[:, None] * s_x + qx[None, :] * 32)[:, :, None] + ix[None, None, :],
            (tx[:, None, None] < T) & (ix[None, None, :] >= 0))


@gluon.jit
def _finish(acc, y, ws, count, pid, i_n, T, N, s_y, ns, BM: gl.constexpr, S: gl.constexpr, MMA: gl.constexpr):
    ty = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    m_y = (ty[None, :] < T) & (ns[:, None] < N)
    p_y = y + ty[None, :] * s_y + ns[:, None]
    if S == 1:
        gl.store(p_y, acc.to(y.dtype.element_ty), mask=m_y)
    else:
        o_ws = gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))[:, None] * 8 + ty[None, :]
        gl.store(ws + pid * (BM * 8) + o_ws, acc)
        gl.thread_barrier()
        if gl.atomic_add(count + i_n, 1, sem="acq_rel", scope="gpu") == S - 1:
            p_0 = ws + i_n * S * (BM * 8) + o_ws
            total = gl.load(p_0, cache_modifier=".cg")
            for i_p in range(1, S):
                total += gl.load(p_0 + i_p * (BM * 8), cache_modifier=".cg")
            gl.store(p_y, total.to(y.dtype.element_ty), mask=m_y)
            gl.atomic_xchg(count + i_n, 0)


SMS = 132         # the SMs a split aims its programs at (an H100's, an H200's)


def split(blocks: int, KI: int, W: int, per_sm: int) -> tuple[int, int]:
    """(parts a block, K steps a part) putting about per_sm warps on each SM (0: no split)."""
    if per_sm == 0:
        return 1, KI
    KS = -(-KI // min(KI, max(1, round(SMS * per_sm / (blocks * W)))))
    return -(-KI // KS), KS


def programs(N: int, K: int, variant: tuple, device) -> tuple:
    """A launch of a probe's kernel over N rows and K columns: (grid, S, the columns a part takes,
    the parts' sums, the blocks' arrival counts); a step is 32 R columns."""
    W, R, MT, _, per_sm = variant
    blocks = N // (16 * W * MT)
    S, KS = split(blocks, K // (32 * R), W, per_sm)
    ws, count = workspace(device, blocks * S * 16 * W * MT * 8, blocks)
    return (blocks * S,), S, KS * 32 * R, ws, count


_spaces: dict = {}


def workspace(device, floats: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' float32 sums and the blocks' arrival counts (left at 0 by every launch), made once
    outside graph capture and grown as needed."""
    ws, count = _spaces.get(device, (None, None))
    if ws is None or ws.numel() < floats or count.numel() < blocks:
        ws = torch.empty(max(floats, 1 << 20), dtype=torch.float32, device=device)
        count = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
        _spaces[device] = ws, count
    return ws, count


SIGNATURE = {"x": "*bf16", "w": "*i32", "s": "*fp32", "y": "*bf16", "ws": "*fp32", "count": "*i32", "T": "i32",
             "N": "i32", "K": "i32", "KC": "i32", "KS": "i32", "s_x": "i32", "s_y": "i32"}


def label(variant: tuple) -> str:
    """A variant's label: W x R [m MT] p.. (steps ahead) [/ warps an SM]; a ring's (probe_int4_ring.py,
    a sixth field: groups a step) W x R [m MT] g NG d DEPTH [/ warps an SM]."""
    W, R, MT, depth, per_sm = variant[:5]
    ahead = f"g{variant[5]}d{depth}" if len(variant) > 5 else "p" * depth
    return f"{W}x{R}" + (f"m{MT}" if MT > 1 else "") + ahead + (f"/{per_sm}" if per_sm else "")


def parse_args(default: str = "4x4p/32,8x4p/32,4x4m2p/32,8x4m2p/24,4x4m2pp/24,2x4m4p/16",
               ring: bool = False) -> tuple[bool, list]:
    """--compile-only, and the variants [(W, R, MT, depth, warps an SM)] from labels W x R, m and the
    tiles of 16 rows a warp takes (1 without), a p for each step in flight ahead (at most 2), / the
    warps an SM a split over K aims at (none: no split); with `ring` (probe_int4_ring.py) a sixth
    field, g and the groups a step (1 without), and d and the ring's depth for the p's."""
    import re
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--variants", default=default)
    a = p.parse_args()
    variants = []
    for v in a.variants.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)(?:m(\d+))?(?:g(\d+))?(?:d(\d+)|(p{0,2}))(?:/(\d+))?", v)
        assert m and (ring or not (m[4] or m[5])), f"a variant is W x R [m MT] {'[g NG] d DEPTH' if ring else '[p | pp]'} [/ warps an SM]: {v}"
        depth = int(m[5]) if m[5] else len(m[6])
        variants.append((int(m[1]), int(m[2]), int(m[3] or 1), depth, int(m[7] or 0)) + ((int(m[4] or 1),) if ring else ()))
    return a.compile_only, variants


def registers(ptx: str, cap: int) -> str:
    """The registers a thread of the kernel takes, as Triton's own ptxas reports them."""
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        r = subprocess.run([get_ptxas(cap).path, "-v", f"-arch=sm_{cap}{'a' if cap == 90 else ''}", f.name, "-o", "/dev/null"],
                           capture_output=True, text=True)
    m = re.search(r"Used (\d+) registers", r.stderr)
    return m.group(1) if m else "?"


def compile_variants(fn, layouts_of, signature: dict, aligned: tuple, caps: tuple, ops: tuple, variants,
                     more=lambda variant: {}):
    """Each variant of a probe's kernel compiled for each sm_<cap> without a GPU (`layouts_of(W, R)`:
    its layouts; `more(variant)`: any further constexprs; `aligned`: the arguments a launch marks
    16-divisible; S 2 where the variant splits): its shared memory, registers where ptxas says, and
    the counts of `ops` in its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    for cap in caps:
        for variant in variants:
            W, R, MT, depth, per_sm = variant[:5]
            mma, a, b, lx, lw = layouts_of(W, R, MT)
            cons = {"W": W, "R": R, "MT": MT, "DEPTH": depth, "S": 2 if per_sm else 1, "MMA": mma, "LA": a, "LB": b,
                    "LX": lx, "LW": lw, **more(variant)}
            src = GluonASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in cons}}, constexprs=cons,
                                 attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
            k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=dict(num_warps=W))
            counts = {op: k.asm["ptx"].count(op) for op in ops}
            regs = registers(k.asm["ptx"], cap)
            print(f"sm_{cap} {label(variant)}: shared {k.metadata.shared} B, regs {regs}, PTX {counts}", flush=True)


def gpu_setup():
    """The copy rate (bytes a second), the engine's product plan for this GPU and a seeded generator,
    after a header line; the SMs a split aims at, this GPU's."""
    from mtpchat.engine.bench import copy_bandwidth
    from mtpchat.kernels.plan import default_products
    global SMS
    SMS = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.3f} TB/s; us at T rows (x the bytes at the copy rate)")
    return bw, default_products("cuda"), torch.Generator(device="cuda").manual_seed(0)


def time_shape(head: str, floor: float, ours, run_variant, want: torch.Tensor, x: torch.Tensor, copies: int, variants):
    """One shape's line: at T = 1, 4, 8 rows the engine's product `ours(x, i)` and each variant's
    `run_variant(x, i, variant)` over weight copy i (0: the checked one) in us, against `floor`, with
    the variant's error against float32 `want` and whether row 0 keeps its bits."""
    from graph_timing import graph_time
    line = [f"{head} floor {floor:.1f}"]
    for T in (1, 4, 8):
        xt = x[:T].contiguous()
        t = min(graph_time(lambda i: ours(xt, i), copies) for _ in range(3))
        line.append(f"T={T} ours {t:.1f} ({t / floor:.2f} x)")
        for v in variants:
            got = run_variant(xt, 0, v)
            err = ((got.float() - want[:T]).norm() / want[:T].norm()).item()
            one = run_variant(x[:1].contiguous(), 0, v)[0]
            same = torch.equal(one, run_variant(x, 0, v)[0]) and torch.equal(one, run_variant(x[:1].contiguous(), 0, v)[0])
            t = min(graph_time(lambda i: run_variant(xt, i, v), copies) for _ in range(3))
            line.append(f"{label(v)} {t:.1f} ({t / floor:.2f} x, err {err:.1e}{'' if same else ', ROW 0 CHANGES'})")
    print("  " + "\n    ".join(line), flush=True)


def engine_product(kind: str, plan):
    """The engine's product for a shape of probe_int4_libraries.SHAPES (its kind: plain, swiglu or split)
    as the model runs it; a SwiGLU's gate|up timed as the plain product over the same bytes when the
    probe's output is the plain one would be unfair to neither (both read every weight once)."""
    from mtpchat.kernels import matvec, matvec_parts
    return {"plain": lambda x, w: matvec.matvec(x, w, plan=plan),
            "swiglu": lambda x, w: matvec.matvec_swiglu(x, w, plan),
            "split": lambda x, w: matvec_parts.matvec_parts(x, w, plan)}[kind]
