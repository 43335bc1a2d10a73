"""How the few-row products run: the choices a product kernel takes as an argument. The engine
decides one ProductPlan at load (engine/plan.py) and hands it to every product it launches; a
benchmark or a test that wants another form builds another plan. Nothing here is read from a
module-level switch, so two engines in one process can differ, and a CUDA graph captured under a
plan keeps it.

The defaults are the forms measured fastest on an H100 (docs/PERFORMANCE.md), and on an H200 where
they differ (_default: fp8_two_blocks, fp8_expert_glu_tile, int4_glu_tile). None of a step's forms is a
function of the number of rows, so a row's result never depends on how many rows a call holds; a
prefill's need not hold to that (its 4-bit few-row product pads its rows to 16, 32 or 64:
int4_prefill_rows).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Callable

import torch

from mtpchat.kernels.int4 import GroupInt4

CPU_PROGRAMS = 6       # the "SMs" under Triton's interpreter, where products split as on a small GPU
PIPELINE_SLACK = 4096  # what Triton's pipeline keeps beside its buffers (barriers, the epilogue's layout changes)
PREFILL_ROWS = 64      # the most rows of a prefill's few-row product over 4-bit weights (matvec.matvec_prefill)

# (N, K, itemsize, swiglu, fp8) -> (BN, BK, warps, stages), or None for the default tile (matvec.tiles)
TileRule = Callable[[int, int, int, bool, bool], "tuple[int, int, int, int] | None"]
# (N, K, itemsize) -> (S, BN, BK, warps, stages), or None for the default split (matvec_parts.split_config)
SplitRule = Callable[[int, int, int], "tuple[int, int, int, int, int] | None"]
# (product "swiglu" or "down", step, fp8, itemsize) -> (BN, BK, warps, stages), or None for the
# default (moe.tiles)
ExpertRule = Callable[[str, bool, bool, int], "tuple[int, int, int, int] | None"]
# 4-bit weights (kernels/int4.py): (product, N, K, group) -> (BN, BK, warps, stages), or for
# product "split" (S, BN, BK, warps, stages); None for the default. product: "plain" and "swiglu"
# (matvec.tiles), "split" (matvec_parts.split_config), "expert_swiglu" and "expert_down" (moe.tiles),
# with N and K the expert's; BK counts columns (weights), 2 a byte.
Int4Rule = Callable[[str, int, int, int], "tuple[int, ...] | None"]


@dataclass(frozen=True)
class ProductPlan:
    programs: int                   # programs resident at once for the wide products' tiles: one an SM
    shared_memory: int = 232448     # bytes of shared memory a program may take on the device (block_shared_memory:
                                    # H100 227 KB, A100 163 KB; RTX 30 and 40, A10, L4, RTX 50: 99 KB): a few-row
                                    # product's measured tile runs shallower where its buffers would take more
                                    # (matvec.tiles; the bf16 tiles took 120-144 KB)
    rows: int = 16                  # the row tile (BT) of a few-row product over bf16 or FP8 weights: its one
                                    # compiled kernel takes 1..rows rows, padded to this many in its dots, so a
                                    # row's result never depends on how many a call holds (more rows run in
                                    # pieces); 8 or 16 (kernels/matvec.py MAX_ROWS). 8 made the FP8 products
                                    # 1.07-1.23 x slower, bf16 ones 1.00-1.06 x (H100, tests/bench/bench_rows.py)
    int4_rows: int = 8              # ... over 4-bit weights: 8, where the pairs form's dots, x's tiles and sums
                                    # take half the work (gate|up 0.78 x the time of 16, out_proj 0.84 x, and
                                    # the pairs form then the fastest everywhere: tests/bench/bench_int4.py --rows)
    tail_split: bool = True         # a small last wave of column blocks split over K (matvec.tail_split) ...
    tail_parts: int = 3             # ... into this many parts a block
    small_split: bool = True        # a product of at most programs / 4 column blocks split over K in every block ...
    small_parts: int = 8            # ... into at most this many parts
    rides: bool = True              # a small product in the model dtype over the rows another product reads (an FP8
                                    # or 4-bit model's GDN b|a beside its in_proj) runs as the first programs of
                                    # that product's launch (matvec.matvec_rider): a launch a GDN layer fewer. Whole
                                    # steps, decode / verify 3 (H100, tests/bench/ab_step.py --plans rides): 35B-A3B
                                    # FP8 0.960 / 0.970 x, int4 0.955 / 0.961; 27B FP8 0.989 / 0.990, int4 0.965 / 0.954
    widen_bits: bool = True         # FP8 tiles widened to bf16 by moving bits, not by Triton's conversion (fp8.widen) ...
    widen_group: int = 0            # ... in groups of this many weights (2 or 4); 0: as the tile suits (fp8.widen_group)
    late_release: bool = False      # the few-row products let the next kernel's programs be placed once their own
                                    # have streamed their weights, not as they start (_triton.pdl_start's LATE): on
                                    # for FP8 and 4-bit models (KernelPlan.choose)
    split_programs: int = 240       # programs of a split product (matvec_parts) in all
    split_fp8_stages: int = 8       # its pipeline depth over FP8 tiles (half the bytes of bf16's: twice as deep)
    fp8_two_blocks: tuple[str, ...] = ("plain",)  # the FP8 products ("plain", "swiglu") whose K steps take two
                                    # scale blocks of each weight row, one after another (fp8.fp8_run): the FP8
                                    # 27B's decode step 0.987 x on an H100 and 0.990 x on an H200 for the plain
                                    # ones; the SwiGLU 1.011 x on an H100 but 0.965 x on an H200, so there too
                                    # (default_products; tests/bench/ab_step.py --plans fp8tiles)
    fp8_expert_glu_tile: tuple[int, int, int, int] = (32, 128, 4, 3)   # a step's FP8 expert SwiGLU stacked: (BN, BK,
                                    # warps, stages), 32 columns (moe.tiles). On an H200 16 columns, 2 warps, 4 deep
                                    # (288 programs of 32 rows for a decode's 9 experts, not 144 of 64 on 4 warps):
                                    # the 35B-A3B FP8's decode step 0.979 x, verify 3 0.997 x, draft 3 0.989 x
                                    # (twice; 3 deep 0.981 / 0.995 / 0.985, 8 deep 1.030 x, 1 warp 1.021 x, 16 x 256
                                    # 1.023 x: tests/bench/ab_step.py --plans fp8tiles, 2026-11-28)
    int4_glu_tile: tuple[int, int, int, int] | None = None    # a step's SwiGLU over interleaved 4-bit weights
                                    # (matvec.tiles); None: int4.measured's, timed on an H100 (32 x 512, 2 warps, 2
                                    # deep). On an H200 3 deep: the 27B's gate|up alone 35.3 us against 39.9
                                    # (bench_int4.py --interleaved-only), its int4 decode step 0.977 x, verify 3
                                    # 0.976 x, draft 3 0.988 x, the same logits (ab_step.py --plans int4tiles,
                                    # 2026-11-28); on an H100 3 deep took the step 1.017 x
    expert_stacked: bool = True     # a step's MoE expert SwiGLU (bf16 and FP8 experts) takes a tile's gate and up
                                    # rows as one tile, one dot a K step (moe._swiglu_stacked): one chain of matrix
                                    # instructions a step where there were two, each waited for; the FP8 tile then
                                    # 32 columns (moe.tiles): the 35B-A3B's FP8 decode step 0.976 x (H100), 0.975 x
                                    # (H200); bf16 1.003 x, unchanged (tests/bench/ab_step.py --plans stacked)
    int4_expert_stacked: bool = True    # the same for interleaved 4-bit experts (moe._swiglu_int4): a tile of
                                    # 2 BN rows, one dot a group, 16 of its rows a warp, on 32 columns (int4.measured):
                                    # the 35B-A3B int4's decode step 0.967 x the 64 columns apart, verify 3 1.003 x,
                                    # draft 3 0.989 x (H100, tests/bench/ab_step.py --plans int4stacked)
    routed_layout: bool = True      # a step's MoE layout written once by the routing kernel's last row, not derived
                                    # by each expert kernel's programs (moe_layout.write_step_layout): end to end
                                    # the 35B-A3B's FP8 decode 0.991 x, MTP k = 3 0.828 x a token (verify 3 4.60
                                    # against 5.62 ms), 0 mismatches (H100, one run; docs/PERFORMANCE.md
                                    # 2026-11-27). Its routing kernel compiles one form per row count, and a sum
                                    # over a layout the compiler picks once gave a decode's weights other last bits
                                    # than a verify's, which broke MTP on == off: the weights are now summed in order
    tiles: TileRule | None = None   # tiles other than the measured ones (benchmarks; small tiles for the interpreter)
    split_tiles: SplitRule | None = None
    expert_tiles: ExpertRule | None = None  # the MoE expert products' tiles (tests/bench/bench_moe.py)
    int4_tiles: Int4Rule | None = None      # every product's tiles over 4-bit weights (tests/bench/bench_int4.py)
    int4_interleave: bool = True    # the engine stores its 4-bit weights interleaved where their layout allows
                                    # (kernels/int4.py; engine/weights.py interleave_int4), read by four dots a group
                                    # over neighbouring columns: no byte permutes, x's columns of a dot side by side
                                    # (the int4 decode step 0.61 x the natural layout's on the 27B, 0.71 x on the
                                    # 35B-A3B: tests/bench/ab_step.py --plans int4, H100)
    int4_form: str | None = None    # how every 4-bit tile unpacks for the dots (int4.form_args: "reshape",
                                    # "slices", "pairs"); None: each product's measured form (int4.measured)
    permute_x: bool = True          # a 4-bit weight's perm (GPTQ desc_act) applied to x once per few-row product,
                                    # not in every tile (the same sums; with its gather 0.57-0.92 x the time on
                                    # the 27B's products at 1 and 4 rows, H100: tests/bench/bench_int4.py)
    int4_prefill_rows: int = 64     # a prefill's product over 4-bit weights of at most this many (PREFILL_ROWS) rows
                                    # runs in the few-row kernel (matvec.matvec_prefill: the weight streamed once, the rows
                                    # padded to a power of two from 16 to 64) where the slab forms write and read a dense
                                    # copy of all of it (kernels/int4_gemm.py); 0: never. The 27B's six products of a
                                    # chunk of 16 / 64 rows: 11.1 / 16.0 ms against the fp8 slab's 28.9 / 31.0 and the
                                    # dense slab's 44.0 / 44.7 (H200, tests/bench/probe_small_gemm.py --weights int4).
                                    # With it a 4-bit model's prefill chunks of up to this many tokens are captured as
                                    # graphs (memory.prefill_graph_sizes): the 27B int4's chat turn of 16 / 50 tokens
                                    # after 8K 126.7 / 135.4 -> 39.5 / 58.4 ms (tests/bench/probe_turn.py, H200)
    int4_prefill_tile: tuple[int, int, int, int] = (64, 256, 4, 3)   # its tile: BN, BK (weights: whole groups, rounded
                                    # up to them), warps, stages (cut to fit the x tile of 64 rows: ProductPlan.depth);
                                    # at 8 / 16 / 32 / 64 rows 10.6 / 11.1 / 12.3 / 16.0 ms a chunk's products against
                                    # 64 x 128, 4 deep's 12.9 / 13.5 / 12.5 / 15.5 (the same probe)
    fp8_cublas_rows: int = 1        # a prefill's product over FP8 weights of at least this many rows runs in cuBLAS's
                                    # block-scaled product (its rows padded to 16) where cuBLAS was seen to compute
                                    # the shape right (fp8_gemm.cublas_serves), fewer in the Triton kernel. cuBLAS
                                    # splits the 27B's 5,120-column products over K: a chunk of 16 / 64 / 256 tokens'
                                    # products 8.6 / 9.9 / 12.5 ms against the Triton kernel's 20.0 / 22.1 / 33.4, and
                                    # a chat turn of 16 / 50 / 128 tokens after 8K 0.80 / 0.83 / 0.73 x the wall time of
                                    # cuBLAS from 256 rows (H200, tests/bench/probe_small_gemm.py, probe_turn.py)
    fp8_small_rows: int = 256       # the Triton kernel's tile for at most this many rows is fp8_gemm.SMALL (64 weight
                                    # rows, 4 warps: twice the wide tile's programs), the wide tile beyond: 0.53-0.61 x
                                    # its time at 16-256 rows (same probe)
    moe_prefill_blocks: tuple[int, int] = (16, 32)   # a prefill's expert blocks (kernels/moe_layout.py) take 16
                                    # pairs, 32 from this mean of pairs an expert, 64 from that: a chunk of 16 / 128 /
                                    # 512 / 2,048 tokens (0.6 / 4.5 / 18 / 72 pairs an expert on the 35B-A3B) in one
                                    # layer's SwiGLU and down, FP8 105 / 238 / 314 / 633 us against blocks of 64's 163 /
                                    # 369 / 382 / 633, bf16 160 / 379 / 404 / 592 against 182 / 403 / 420 / 592 (H200,
                                    # tests/bench/probe_moe_prefill.py)
    int4_moe_prefill_blocks: tuple[int, int] = (32, 128)   # the same over 4-bit experts, each block size on its
                                    # tiles (moe.tiles): 16 / 128 / 512 / 1,024 / 2,048 / 8,192 tokens 70 / 153 / 229 /
                                    # 323 / 550 / 1,535 us against blocks of 64 on the earlier 64 x 128 tile's 518 /
                                    # 1,600 / 1,340 / 961 / 1,046 / 2,033 (the same probe)
    int4_prefill: str = "dense"     # prefill's 4-bit products (kernels/int4_gemm.py): "dense" (a dequantized
                                    # slab, then torch's matmul: 1.27-1.34 x bf16 at 2048 rows, H100), "fp8" (a
                                    # slab requantized to FP8 blocks, x's rows in FP8, cuBLAS's block-scaled product;
                                    # Hopper, groups of 128, else dense) or "fused" (unpacked in the dot's registers:
                                    # 5.3 x; tests/bench/bench_int4.py)

    def __post_init__(self):
        if not 0 <= self.int4_prefill_rows <= PREFILL_ROWS:
            raise ValueError(f"int4_prefill_rows is 0 (off) to {PREFILL_ROWS}, not {self.int4_prefill_rows}")
        for name in ("moe_prefill_blocks", "int4_moe_prefill_blocks"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} are two means of pairs an expert, 0 <= the first <= the second "
                                 f"(0, 0: blocks of 64 always): {lo}, {hi}")

    def depth(self, stages: int, stage_bytes: int, fixed: int = 0) -> int:
        """A tile's pipeline depth `stages`, cut (to 2 at least) until the stages - 1 buffers Triton
        keeps of stage_bytes each, with `fixed` bytes (tiles held through the loop) and
        PIPELINE_SLACK beside them, fit the device's shared memory a program (shared_memory). The
        same sums at any depth."""
        while stages > 2 and (stages - 1) * stage_bytes + fixed > self.shared_memory - PIPELINE_SLACK:
            stages -= 1
        return stages

    def prefill_block_rows(self, pairs: int, experts: int, four_bit: bool) -> int:
        """The pairs a block of a prefill's expert products takes (16, 32 or 64), from the mean number
        of pairs an expert gets: few pairs an expert leave most of a block of 64 empty. A function of
        the chunk's size, never of its routing."""
        lo, hi = self.int4_moe_prefill_blocks if four_bit else self.moe_prefill_blocks
        mean = pairs / max(experts, 1)
        return 16 if mean < lo else 32 if mean < hi else 64

    def rows_of(self, w) -> int:
        """The row tile of a product over w (rows, or int4_rows for a 4-bit weight)."""
        return self.int4_rows if isinstance(w, GroupInt4) else self.rows

    def describe(self) -> dict:
        """The plan as plain values (a rule by its name), for `--dry-run` and benchmark reports."""
        out = dict(self.__dict__)
        for key in ("tiles", "split_tiles", "expert_tiles", "int4_tiles"):
            out[key] = getattr(out[key], "__name__", repr(out[key])) if out[key] is not None else "measured"
        return out


def programs_on(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a program (block) may take on `device`: what the device says, else by
    its compute capability (sm_80 163 KB, sm_90 and sm_100 227 KB, the others 99 KB); the CPU (Triton's
    interpreter) has no limit that matters, so an H100's."""
    if device.type != "cuda":
        return ProductPlan.shared_memory
    given = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    if given:
        return int(given)
    major, minor = torch.cuda.get_device_capability(device)
    return 232448 if major in (9, 10) else 166912 if (major, minor) == (8, 0) else 101376


def default_products(device: torch.device | str) -> ProductPlan:
    """The measured forms for products on `device` (the engine's plan starts from these)."""
    device = torch.device(device)
    return _default(device.type, device.index if device.index is not None or device.type != "cuda"
                    else torch.cuda.current_device())


@functools.cache
def _default(kind: str, index: int | None) -> ProductPlan:
    device = torch.device(kind, index)
    # on an H200 (HBM3e, 4.3 TB/s against an H100's 3.0, the same SMs) the SwiGLUs' tiles measured
    # otherwise: the FP8 one's runs of two scale blocks (they lost on an H100), the FP8 experts' on 16
    # columns, the 4-bit one's 3 deep (fields above). A GH200 is neither: unmeasured, it keeps the H100's
    h200 = kind == "cuda" and re.search(r"\bH200\b", torch.cuda.get_device_name(device)) is not None
    plan = ProductPlan(programs=programs_on(device), shared_memory=block_shared_memory(device))
    if h200:
        plan = dataclasses.replace(plan, fp8_two_blocks=("plain", "swiglu"), fp8_expert_glu_tile=(16, 128, 2, 4),
                                   int4_glu_tile=(32, 512, 2, 3))
    return plan
