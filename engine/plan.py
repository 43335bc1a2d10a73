"""The kernel plan: which form each product, routing and draft step of one engine takes, decided
once at load from the device, the weight format and the model, stored on the engine, carried by
every forward's context (engine/dispatch.py: Ctx) and passed to the kernels as an argument.

A benchmark compares forms by building one plan per form (tests/bench/ab_step.py); a test that
wants another form builds an engine or a context with that plan. Nothing chooses a kernel through
a module-level switch, so two engines in one process may differ, and a captured CUDA graph can
never be stale against a flag flipped after it.

The defaults are the forms measured fastest on an H100 in whole decode steps (docs/PERFORMANCE.md,
"The kernel plan's defaults"): every product's form in `products` (kernels/plan.py), and here:
- split_norm: a block's last product (o_proj, out_proj, MLP down) split over K, each column block
  finished by the norm after it, the normalised rows handed on as a Normed;
- shared_as_expert: an MoE's shared expert run by the expert kernels as expert E (two launches
  fewer a layer), where it is as wide as a routed expert and stored alike;
- fc_split: the MTP head's fc split over K and finished by its layer's input norm (the draft step
  0.97-0.99 x);
- draft_pick: the draft's argmax and its map to a token id as two PDL kernels (draft 0.93-0.97 x);
- head_input: the MTP head's input (its tokens' embedding rows and the hidden rows, each normalised,
  side by side) in one PDL kernel (kernels/norm.py head_input), where the lookup, the two norms and
  the concatenation took four launches, two of them torch's, without PDL: draft 3 0.952 x on the
  35B-A3B FP8, 0.968 x on the 27B int4, the same bits (an H200, tests/bench/ab_step.py --plans draft);
- draft_chain: the hand-off from the head's catch-up to the chained drafts (its last live row and
  their positions, kernels/accept.py chain_start) in one PDL kernel where torch took three (a
  subtraction, a row lookup, an addition; the fourth, the catch-up's start L - pend_n, runs before
  the head): draft 3 0.986 x on the 35B-A3B FP8, 0.992 x on the 27B int4, decode and verify
  unchanged, the same logits (an H200, tests/bench/ab_step.py --plans draft, 2026-11-29);
- moe_normed (over bf16 and FP8 experts): a step's MoE layer reads the norm before it as a
  Normed (its router and shared expert as any product does, its expert SwiGLU scaling each pair by
  its row's 1 / rms), a launch a layer fewer. Over the layout the routing writes (ProductPlan.routed_layout),
  end to end on the 35B-A3B: FP8 decode 0.975 x, MTP k = 3 0.985 x a token; int4 1.009 x and
  1.004 x, so not in the --weights int4 plan nor a 4-bit checkpoint's (one H100 run each,
  docs/PERFORMANCE.md 2026-11-27);
  bf16 steps 0.991 / 0.998 / 1.000 x (decode / verify 3 / draft 3, tests/bench/ab_step.py
  --plans moefold). Over the derived layout (routed_layout off) a verify's SwiGLU took 143
  registers where 127 let 4 programs share an SM, and verify 3 some 1.15 x; its 1 / rms now adds
  the sums a block at a time (128 registers), not timed there;
- combine_normed (on a GPU, over an MoE): a step's MoE layer finished in its combine kernel (the
  residual add and the next norm's two pieces, kernels/moe.py combine with a Fold): each program,
  a row's block of 512 columns, writes its block's share of the Normed, so the norm kernel after
  the layer goes (40 launches a step on the 35B-A3B) with no arrival count and no program waiting
  for another, where moe_fold's and the combine folded into the norm (2026-11-26, 1.01 x) lost.
  The next layer's products read the Normed as the dense models' do after their split MLP down.
  The 35B-A3B's steps (decode / verify 3): FP8 0.995 / 0.991 x, bf16 0.992 / 0.991 x, int4
  0.991 / 0.984 x (an H200, tests/bench/ab_step.py --plans combine, 2026-11-29). Under moe_fold
  it does nothing;
- draft_head_int4 (on a GPU): the trimmed draft head (engine/draft_vocab.py DraftRows) kept in 4
  bits, each row quantized on its own (symmetric, groups of 128), interleaved where 4-bit weights
  are: each draft reads a quarter of its bytes (the 27B's 34,816 rows x 5,120: 357 MB in bf16,
  half of a draft's, against 92 MB), the draft's argmax taken over the 4-bit rows' logits. Draft 3
  0.814 x on the 27B int4, 0.870 x on the 35B-A3B FP8, decode and verify unchanged (an H200,
  ab_step.py --plans drafthead, 2026-11-29). It can change which token a draft proposes
  (tests/bench/quality_int4.py --draft-head: on the demo model acceptance at k = 3 3.018 with
  float32 rows, 3.048 with 4-bit ones), never the output. Rows that are not whole groups of 128
  keep the head as it is. The memory plan counts the rows as kept (draft_head_int4_on below).
- fold_beside_draft (on a GPU; the layers a program of its launch, 0: off): the last step's
  accepted tokens run into every GDN layer's state while the MTP head drafts, in one launch on a
  second stream of the draft's graph (kernels/gdn.py fold_pending_layers: the kernel a step folds
  with, the same bits), so that the verify after it folds none. A verify of k = 3 ran the last
  step's accepted tokens (3.26 at the benchmark's profile) before its own 4, one after another in
  each GDN layer's recurrence. In one process, engines alternated (an H200, 2026-11-29): the 27B
  int4's verify 3 7.350 -> 7.171 ms, its draft 0.173 -> 0.212 ms a token, MTP k = 1 / 3 / 4
  steps 0.998 / 0.992 / 0.993 x; the 35B-A3B int4's k = 1 / 3 / 4 0.995 / 0.987 / 0.988 x. A
  layer a program (18,432 programs of a warp on the 27B) beat 8 (0.996 x at k = 3) and 48 (1.005
  x): the draft's kernels slow while a fold runs under them, so the fastest fold wins.
- fold_yields (on a GPU): under fold_beside_draft, the fold's programs yield the SMs to the
  draft's: the step graphs are captured on a stream of a higher priority than the fold's
  (engine/runner.py capture_stream), and torch instantiates a graph with its nodes' own priorities,
  which a capture takes from the stream each kernel was launched on (tests/test_gpu_draft.py reads
  them back). With one priority the fold, launched first, had its 18,432 programs placed before
  the draft's first kernel got an SM: the 27B int4's draft grew by 91-117 us a cycle with the fold
  beside it at k = 1..4. With it, in one process, engines alternated (an H200, 2026-11-29,
  ab_generate.py --plans "fold_yields=0;fold_yields=1"): the draft 0.212 -> 0.202 ms a token at
  k = 3, MTP k = 1 / 3 / 4 steps 0.997 / 0.998 / 0.996 x, k = 3 2.410 -> 2.405 ms a token; with
  8 layers a program 1.002 x (the fastest fold still wins). Only graphs take it: an eager draft
  runs on the default stream, of CUDA's lowest priority, which the fold's already has.

Candidates, off:
- moe_fold: a step's MoE layer finished in its down kernel (the combine, the residual add and the
  next norm's two pieces: kernels/moe.py Fold), two launches a layer fewer. With moe_normed,
  against moe_normed alone: the 35B-A3B's FP8 steps 0.994 / 0.995 / 1.002 x, int4 1.008 / 1.033 /
  1.000 x (decode / verify 3 / draft 3): the tail of each column block's last program costs what
  the launches saved.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mtpchat.engine.config import ModelConfig
from mtpchat.engine.memory import EARLY_GRAPHS, EARLY_ROWS, prefill_graph_sizes
from mtpchat.kernels.attention_chunk import prefill_attention_config
from mtpchat.kernels.fp8 import fp8_runs_on
from mtpchat.kernels.int4_gemm import fp8_form_runs_on
from mtpchat.kernels.plan import ProductPlan, default_products


def draft_head_int4_on(device: torch.device | str) -> bool:
    """Where choose() keeps the trimmed draft head in 4 bits (draft_head_int4, above): on a GPU. The
    memory plan asks it too (mtpchat/loader.py), so that it counts the rows as the engine keeps them."""
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class KernelPlan:
    products: ProductPlan
    split_norm: bool = True
    shared_as_expert: bool = True
    moe_normed: bool = False        # choose() turns it on over bf16 and FP8 experts (above)
    moe_fold: bool = False
    combine_normed: bool = False    # choose() turns it on over an MoE on a GPU (above)
    draft_head_int4: bool = False   # choose() turns it on on a GPU (above)
    fc_split: bool = True
    draft_pick: bool = True
    head_input: bool = True
    draft_chain: bool = True
    fold_beside_draft: int = 0
    fold_yields: bool = False
    # The MTP head's rows kept while MTP is off (hidden_size x 2 bytes each: 5 MiB for the 27B), run
    # through it when MTP comes back on or when they fill up. A flush waits for the steps in flight
    # and runs the head eagerly: at 64 rows it cost a 27B decode some 2.5 ms every 63 tokens.
    pending_rows: int = 512
    # Prefill's small kernels: rows (a token's heads) a program of the GDN output norm and of the
    # q/k norm + RoPE (kernels/norm.py, kernels/rope.py), and tokens a program of the causal conv
    # (kernels/conv.py). One row a program made some 100,000 programs of 256 bytes for a 2,048-token
    # chunk: the 27B's 8K prompt spent 22.9 ms in the GDN output norm, 16.8 in the conv and 5.4 in
    # the q/k norm, some 4.8 / 3 / 4 x what their bytes take at the copy bandwidth (an H100,
    # tests/bench/profile_step.py). Eight rows a program took those two norms to 1.08 and 1.13 x
    # (probe_prefill_kernels.py); 16 tokens a program stayed the conv's best (32: 1.07 x its time).
    # Steps keep one row and 16 tokens a program.
    prefill_rows: int = 8
    prefill_conv_tokens: int = 16
    # Token blocks (of prefill_conv_tokens) a program of prefill's causal conv takes in turn, its
    # loop pipelined: one block a program made 20,480 programs of 1,024 outputs for a 2,048-token
    # chunk, 2.67 x what the conv's bytes take (16.8 ms of the 27B's 8K prompt; 73.8 us a chunk
    # against a floor of 27.6: probe_prefill_kernels.py, 2026-11-26). The same bits at any count
    # (tests/kernels/test_conv.py), and with 1 the kernel compiles for sm_90 to the SASS of before
    # but for one add's operand order. Measured (an H100, 2026-11-28): 32 tokens x 4 blocks took the
    # chunk's conv 73.3 -> 56.3 us, but the 27B FP8's 8K prompt did not move beyond its spread (3.3
    # ms expected of 510) and a 50-token turn after it read 63.5 / 92.5 / 108.6 ms against 61.6-64.3:
    # off until a longer A/B settles both.
    prefill_conv_blocks: int = 1
    # Prefill's MLP gating, GDN output norm and the norms before attention's q|k|v and a dense MLP's
    # gate|up hand an FP8 product (FP8 weights; 4-bit ones in the fp8 form) their rows quantized
    # (kernels/fp8_gemm.py QuantizedRows), the same codes and scales as the product's own
    # quantization of their bf16 rows, with one pass over the rows fewer: the 27B FP8's 8K prompt
    # spent 20.3 ms quantizing rows and 18.5 in the gating.
    prefill_quant: bool = True
    # Prefill's attention output gate, o * sigmoid(gate) into rows, in one kernel (kernels/attention.py
    # gate_rows) rather than torch's sigmoid, product and copy of the transposed output (4.6 ms of
    # the 27B's 8K prompt: 112 us a 2,048-token chunk, 27 us in one kernel); with prefill_quant its
    # rows go to an FP8 o_proj quantized. The three together: the 27B FP8's 8K prompt 0.95 x
    # (probe_prefill_chunk.py, 2026-11-26, docs/PERFORMANCE.md).
    prefill_gate: bool = True
    # Prefill's attention (a bf16 or fp16 chunk's queries over the cache's keys before and in it, on
    # the GPU): torch's flash kernel ("flash"; 219-292 TFLOP/s at the 27B's head_dim of 256) or our
    # Triton kernel ("triton": kernels/attention_chunk.py prefill_attention_triton; its output
    # [T, Hq, D] straight, no transposed copies; a kv head's query heads read its keys once). A
    # 2,048-token chunk of the 27B's attention over 2,048 / 4,096 / 6,144 / 8,192 keys took 133.8 /
    # 324.6 / 517.6 / 714.2 us against flash's 239.1 / 575.3 / 884.0 / 1,202.6 (0.56-0.59 x,
    # tests/bench/probe_attention.py); the 27B's 8K prompt in 2,048-token chunks, FP8 513.6 /
    # 521.5 / 521.3 -> 500.8 / 495.7 / 492.6 ms, bf16 748.6 / 733.5 / 736.8 -> 714.7 / 710.1 /
    # 717.1 (tests/bench/probe_prefill_chunk.py; an H100, 2026-11-28). A chunk too short for its
    # programs to fill the GPU twice, or once over keys twice its own before it, stays with flash,
    # which splits its keys (attention_chunk.prefill_attention_fills: on the 27B and an H100, under
    # 1,387 tokens, or 683 after a history of twice the chunk). Only the H100's tiles (128 x 64, two
    # deep) were timed: a device with less shared memory a program (an A100, the 99 KB cards) takes
    # flash until its smaller tiles are (KernelPlan.choose).
    prefill_attention: str = "triton"
    # The GDN's chunked form (kernels/gdn_chunk.py) with its output written by the scan
    # ("fused_out"): the chunks' start states and writes never go through memory, and a kernel
    # fewer. What its kernels hand each other: w and u of the prep's solve, from which the scan
    # builds the state ("solved"), and the output's terms ("terms"), in bfloat16 as fla keeps them,
    # or float32. The products of the scan and the output kernel on bf16 operands ("products", as
    # fla's; "tf32": float32 operands in tf32), and q and k made unit rows once by the prep
    # ("normed") rather than by each kernel again. A float32 model keeps float32 and tf32x3
    # whatever the plan says. One 2,048-token chunk of the 27B on an H100
    # (probe_prefill_kernels.py, 2026-11-28): 460 us all float32 and tf32, 374 fused with bf16
    # between the kernels, 283 with bf16 products and unit rows too (its tiles: gdn_chunk.BF16_TILES;
    # flash-linear-attention's chunk_gated_delta_rule 232 us in the same run); from the float32
    # reference the output 2.5e-3 -> 3.5e-3 and the state 1.1e-3 -> 3.0e-3 (fla's: 4.1e-3, 3.1e-3).
    # The 27B's 8K prompt (probe_prefill_chunk.py, two rounds): FP8 565.5 / 561.9 -> 546.3 / 533.7
    # ms, bf16 806.1 / 798.9 -> 784.7 / 777.3 ms (unfused: 602.7 / 540.6, 793.8 / 780.5), the
    # prompt's peak 0.52 -> 0.36 GiB beyond the engine. Random-weight models that discretise their
    # activations amplify the rounding (the FP8 wide-head model of tests/test_gpu_fp8.py moved its
    # logits by 0.15 with bf16 between the kernels, 2026-11-26); a bf16 model stays within bf16's
    # own distance from float32 (tests/test_gpu_engine.py), and the demo model's held-out
    # perplexity over 8,190-token prefills moved 33.3802 -> 33.3854 with bf16 between the kernels
    # (quality_int4.py --plans, 2026-11-26).
    chunk_fused_out: bool = True
    chunk_solved: str = "bfloat16"
    chunk_terms: str = "bfloat16"
    chunk_products: str = "bf16"
    chunk_normed: bool = True
    # The chunk's prep takes all its products (the keys' A, the blocked solve's merges and diagonal
    # inverses, w, u and, fused, the output's scores) on bf16 operands ("tf32": float32 operands in
    # tf32); fla's products of keys are bf16 too, its solve's merges not. One 2,048-token chunk
    # of the 27B on an H100 (probe_prefill_kernels.py --sections prep, 2026-11-28): 290.8 -> 256.3
    # us (the prep 186.5 -> 148.7), from the float32 reference the output 3.50e-3 -> 4.18e-3 and the
    # state 3.08e-3 -> 3.12e-3; the 27B FP8's 8K prompt (probe_prefill_chunk.py, three rounds in one
    # process) 523.1 / 511.6 / 512.5 -> 521.8 / 504.9 / 503.1 ms.
    chunk_prep_products: str = "bf16"
    # A step's causal conv, in a kernel of its own between the in_proj and the recurrence, unless
    # one of two forms takes it in:
    # - conv_in_product (on): a step of at most this many tokens (and no more than its in_proj's one
    #   launch takes: ProductPlan.rows_of) has its conv computed by the product that makes its
    #   inputs, the GDN in_proj (kernels/conv.py ConvStep, in matvec's kernel): each column block's
    #   program, once it has stored the block's pre-conv values, reads them back with the window and
    #   writes silu(conv) over them, the same sums as the conv kernel's, so a token takes the same
    #   bits either way (tests/kernels/test_conv_in_product.py). Alone the conv kernel took 4.5 us
    #   a launch, 215 us of the 27B int4's verify 3 in 48 (profile_step.py). In every step, against
    #   the recurrence's conv in decode and the conv kernel in verify (tests/bench/ab_step.py
    #   --plans conv, an H200, 2026-11-29, with the recurrence's any-stride form below): the 27B
    #   int4's decode 0.990 x, verify 3 0.983 x; the 35B-A3B FP8's 0.980 x and 0.966 x; draft 3
    #   unchanged. The recurrence then reads q | k | v as views of the in_proj's rows, whose row
    #   stride Triton compiles into the kernel where it is a multiple of 16, and a one-token step's
    #   views have another (the heads' width) than a longer step's (N, 776 on the GPU tests' tiny
    #   MoE model): two compiled forms, which at dk = 64 summed q's and k's squares in other
    #   orders, and greedy MTP on differed from off there (tests/kernels/test_gdn_step_forms.py).
    #   So under it steps and folds take the kernel's form that compiles in no row stride
    #   (any_stride, below), which rounds otherwise than the default form: the logits move against
    #   the other conv forms' (3.6e-2 on the 27B int4's random weights), MTP on == off holds
    #   (tests/test_gpu_draft.py, tests/test_gpu_engine.py). 0: never.
    # - conv_in_recurrence: a step of at most this many tokens, where the product does not take it,
    #   has its conv computed by the GDN recurrence kernel (kernels/gdn.py conv_recurrent): each
    #   program first writes the conv of the channels it reads, then runs the same loop as after
    #   the conv kernel, the same bits (tests/kernels/test_gdn_conv_step.py); 0: never. Kept at
    #   one-token steps for a plan whose product does not take them. In one-token steps the FP8
    #   27B's decode step 0.994 x, verify 3 1.000 x; in every step verify 3 1.007 x: the conv of
    #   four tokens for every channel a program reads costs more than the launch it saves (an
    #   H200, ab_step.py --plans conv, 2026-11-27).
    conv_in_product: int = 1 << 10
    conv_in_recurrence: int = 1
    # Short prefills through CUDA graphs rather than eager forwards, whose time the host's launches
    # set: 16 tokens of the 27B FP8 after an 8K history took 61-71 ms of wall time for 24.6 ms of
    # kernels in 924 launches (an H100, tests/bench/probe_turn.py, 2026-11-28).
    # - step_prefill: a prefill of at most this many pieces of a step's rows (CAPTURED_K + 1 tokens
    #   each, engine/memory.py) runs in the step form, each piece a verify of its tokens (its
    #   captured graph) all kept as an acceptance keeps them: a chat turn's generation prompt (3-8
    #   tokens after the snapshot at the end of the user's message) and a short message. The step
    #   form's kernels give a row the same bits whatever the rows beside it (MTP's exactness rests
    #   on it), so greedy MTP on == off holds through it. A turn of 4 new tokens and a 5-token
    #   generation prompt after 8K, the 27B FP8: 187.7 -> 36.7 ms (an H200, probe_turn.py
    #   --generation-prompt 5, 2026-11-28).
    # - prefill_graphs: chunk sizes whose prefill forward is captured at load (memory.PREFILL_GRAPHS;
    #   every size for a bf16 or FP8 model, dense or MoE, and for a 4-bit MoE; a dense 4-bit
    #   model's up to its plan's int4_prefill_rows: memory.prefill_graph_sizes), its start read on the device
    #   (attention by the steps' kernel, which splits the keys); a longer prefill goes as at most
    #   prefill_pieces of them, the largest that fit, then at most step_prefill step pieces for the
    #   rest (decoder.prefill_pieces). Such a turn of 16 / 50 / 120 tokens then the generation
    #   prompt: 249.4 / 276.0 / 266.6 ms eager, 120.7 / 158.1 / 142.4 with step pieces alone, 55.0 /
    #   73.2 / 102.4 with graph chunks too (the same H200 instance). A chunk's kernels take some
    #   27-30 ms of the 27B FP8 at 16-96 tokens (a step piece 12), so two at most then: four 128-token
    #   replays took a 512-token prompt 134.8 ms to its first token, one eager chunk 78.3. (Since
    #   then the FP8 products of a few rows run in cuBLAS: ProductPlan.fp8_cublas_rows.) The 35B-A3B
    #   FP8's turns of 16 / 50 / 128 tokens: 95.8 / 126.6 / 121.1 ms eager, 35.4 / 49.7 / 71.4
    #   through graph chunks (an H200). Three chunks, now that they are cheaper: the 27B FP8's turn
    #   of 200 tokens (128 + 64 + 8) 83.0 ms against 97.7 as 128 + 64 and step pieces; 150 and 230
    #   tokens went the same way under both (an H200, probe_turn.py --plans ";prefill_pieces=3").
    # - prefill_early: larger chunks captured too (memory.EARLY_GRAPHS), replayed only where the
    #   chunk ends within the cache's first prefill_early_rows rows (a conversation's first prompt
    #   or two), their attention over those rows alone, so that the keys' partials stay as small as
    #   the 128-token chunk's over an 8K cache. An eager chunk waits on the host's launches (some
    #   1,050 a chunk of the 27B): on an H200's host its 400 / 512-token prompts took 135.8 / 138.9 ms
    #   of wall time for 31.9 / 33.0 ms of kernels, the 27B int4's 248.2 / 233.6 for 52.1 / 53.7
    #   (tests/bench/probe_turn.py --history 8, 2026-11-28). With them 512 tokens took the 27B FP8
    #   36.5 ms, its int4 59.8 (154.5 eager in that run; its products of 512 rows in the slab form
    #   inside the graph), the 35B-A3B FP8 36.5 (129.2), its int4 73.2 (184.2). They count among
    #   prefill_pieces' chunks, so a first prompt of 459-511, 715-735, 747-767 or 843 tokens and more
    #   goes eager (512 + 128 + 96 would leave 15 of 751).
    # - prefill_early_beside (a candidate, 0: off): that many early chunks beside prefill_pieces
    #   rather than among them (1: a first prompt of 11..1,034 tokens through graphs but for 42
    #   lengths from 971, four chunks at most). It lost where timed: the 27B FP8's first prompts of
    #   470 / 500 / 740 / 800 tokens 92.0 / 83.8 / 87.6 / 77.9 ms against 59.0 / 67.2 / 83.0 / 74.3
    #   (one eager chunk at 470 and 500: a fourth chunk reads every weight again), on an H200 whose
    #   host launched at 26-33 us (tests/bench/probe_turn.py, 2026-11-28); a slower host might differ.
    # 0 / () : every prefill chunked (a CPU, where no graph saves the launches).
    step_prefill: int = 0
    prefill_graphs: tuple = ()
    prefill_pieces: int = 3
    prefill_early: tuple = ()
    prefill_early_rows: int = EARLY_ROWS
    prefill_early_beside: int = 0

    def __post_init__(self):
        if self.prefill_attention not in ("flash", "triton"):
            raise ValueError(f"prefill_attention is 'flash' or 'triton', not {self.prefill_attention!r}")
        if set(self.prefill_early) & set(self.prefill_graphs):
            # an early size's graph reads the caches' first rows alone: never a later chunk's
            raise ValueError(f"prefill_early {self.prefill_early} and prefill_graphs {self.prefill_graphs} share sizes")
        if self.prefill_early_beside < 0:
            raise ValueError(f"prefill_early_beside counts chunks: 0 or more, not {self.prefill_early_beside}")
        if self.prefill_early and self.prefill_early_rows < max(self.prefill_early):
            raise ValueError(f"prefill_early_rows {self.prefill_early_rows} must hold the largest early chunk, "
                             f"{max(self.prefill_early)}")

    @classmethod
    def choose(cls, device: torch.device | str, config: ModelConfig, fp8: bool, int4: bool = False,
               four_bit: bool | None = None) -> "KernelPlan":
        """The measured forms for this device, model and weight format (`fp8`: the big products in
        block-scaled FP8; `int4`: every product in 4 bits, --weights int4; 4-bit products take the
        same plan, their tiles in products.int4_tiles; `four_bit`: whether the products are kept in 4
        bits, by default with `int4` or a 4-bit checkpoint, which may also load dequantized). FP8
        and 4-bit products place the next kernel late (products.late_release: the 35B-A3B's FP8
        decode step 0.881 x, int4 0.951 x, the 27B's int4 0.990 x, its FP8 1.00 x; bf16 1.00 x on
        the 27B, verify 3 1.044 x on the 35B-A3B: off).
        FP8 tiles are widened by moving bits where the GPU runs FP8 at all; the products split by
        the device's SMs; the shared expert among the routed ones where the shapes allow (and, at
        run time, where it is stored as they are: SparseMoE). The other forms won or tied on
        every model measured (27B and 35B-A3B, bf16 and FP8; the small split on the 35B-A3B in bf16
        measured 0.986 x, 1.000 x and 1.006 x on three H100s: kept, a tie). Prefill's 4-bit products
        take the fp8 form on Hopper (int4_gemm.py; the dense form elsewhere). Prefill attention takes
        our kernel where a program has the shared memory of its H100 tiles, flash elsewhere. A GPU
        prefills a few tokens in the step form (step_prefill), through the step graphs, and a few
        more in chunks captured as graphs (prefill_graphs): three at most (prefill_pieces), a first
        prompt's larger ones among them (prefill_early)."""
        device = torch.device(device)
        products = default_products(device)
        bits = fp8 and device.type == "cuda" and fp8_runs_on(device)
        # the expert kernels take the shared expert only as wide as a routed one
        alike = config.shared_expert_intermediate_size == config.moe_intermediate_size
        late = (fp8 or int4) and device.type == "cuda"
        # 4-bit prefill on the FP8 tensor cores where cuBLAS's block-scaled product runs (Hopper): the
        # 27B int4's 8K prompt in 606 against 814 ms in chunks of 8,192, 688 against 921 in chunks
        # of 2,048 (kernels/int4_gemm.py; an H100)
        prefill = "fp8" if fp8_form_runs_on(device) else products.int4_prefill
        # the MoE layer between Normeds where its experts are bf16 or FP8: over 4-bit experts it
        # measured 1.009 x (--weights int4), and a 4-bit checkpoint's (its shared expert in bf16,
        # apart from the 4-bit routed ones) is neither timed nor tested with it on the GPU
        normed = config.is_moe and not int4 and config.quantization != "int4"
        # prefill attention in our kernel where it gets the tiles timed on an H100 (128 x 64)
        timed = prefill_attention_config(config.head_dim, 2, products)[:2] == (128, 64)
        # an MoE chunk reads most of the experts whatever its size (64 tokens some 221 of 256 a layer,
        # 128 some 251), so two chunks read them twice: when a 4-bit MoE's chunks stopped at 64 its
        # 128 tokens as two chunks took 169.7 ms against 147.8 eager, and its prefill one chunk; since
        # its expert blocks follow the chunk (ProductPlan.prefill_block_rows) and its chunks go to 128
        # (memory.prefill_graph_sizes), three like every model's: its turns of 128 / 200 tokens after
        # 8K 121.4 / 112.8 ms eager -> 39.0 / 69.8. The 27B int4's turns of 96 / 128 / 192 tokens in up
        # to three 111.3 / 115.5 / 116.7 -> 67.7 / 74.4 / 102.2 (an H200, tests/bench/probe_turn.py)
        four_bit = (int4 or config.quantization == "int4") if four_bit is None else four_bit
        return cls(products=dataclasses.replace(products, widen_bits=bits, late_release=late, int4_prefill=prefill),
                   shared_as_expert=config.is_moe and alike, moe_normed=normed,
                   combine_normed=config.is_moe and device.type == "cuda",
                   draft_head_int4=draft_head_int4_on(device),
                   fold_beside_draft=1 if device.type == "cuda" else 0,
                   fold_yields=device.type == "cuda",
                   prefill_attention="triton" if timed else "flash",
                   step_prefill=2 if device.type == "cuda" else 0,
                   prefill_graphs=prefill_graph_sizes(config, four_bit, products.int4_prefill_rows)
                   if device.type == "cuda" else (),
                   prefill_early=EARLY_GRAPHS if device.type == "cuda" else ())

    @property
    def any_stride(self) -> bool:
        """Whether the GDN recurrence, in steps and folds alike, runs in the form of its kernel that
        takes no row stride into its code (kernels/gdn.py _ROW_STRIDES): under conv_in_product,
        whose q | k | v are views of the in_proj's rows, a one-token step's views have another row
        stride than a longer step's, and the stride-specialised forms of the two summed q's and
        k's squares in other orders at dk = 64 (greedy MTP on != off on a tiny MoE model)."""
        return self.conv_in_product > 0

    def replace(self, **changes) -> "KernelPlan":
        """This plan with some choices changed; products' fields may be given by name too."""
        mine = {f.name for f in dataclasses.fields(self)}
        products = {k: changes.pop(k) for k in list(changes) if k not in mine}
        plan = dataclasses.replace(self, **changes)
        return dataclasses.replace(plan, products=dataclasses.replace(plan.products, **products)) if products else plan

    def describe(self) -> dict:
        """The plan as plain values, for `mtpchat run --dry-run` and `mtpchat bench --json`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "products"}
        return {**out, "products": self.products.describe()}
