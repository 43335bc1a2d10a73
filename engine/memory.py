"""The memory plan: what a model needs on its device, computed from the config alone.

Pure arithmetic (no torch), so the CLI can say "this will not fit, here is what would" before a
single weight is read, and `mtpchat run --dry-run` can print it. The parts match the names of
`Engine.memory()`: weights, kv, mtp_kv, gdn_state, graph_pool, workspace.

What each part counts (27B numbers in bf16, see qwen35-model.md §9):
  weights    text params (embedding, layers, final norm, lm_head unless tied) + the MTP head
             (fc, one decoder layer, three norms); 26,895,998,464 + 424,699,392 params; with the
             head, the trimmed draft vocabulary's own copy of its lm_head rows and their token ids
             (engine/draft_vocab.py): 32,768 x (5,120 x 2 + 8) bytes, or in 4 bits where the kernel
             plan keeps them so (`draft_int4`: on a GPU) 32,768 x (2,560 + 80 + 8). In FP8 (`weights="fp8"`, an
             FP8 release) or 4 bits (`weights="int4"`, a GPTQ / compressed-tensors release: the
             products its format quantizes, by the checkpoint's module names, the MTP fc among
             them where the format quantizes `mtp.fc`, as `--weights int4` does) the layers'
             products take their stored form's bytes; the embedding, lm_head and router stay as
             they are, and so does the MTP fc in FP8
  kv         K and V of the main full-attention layers for max_context tokens (plus the k_max+1
             rows a verify step may write past the end): 64 KiB/token
  mtp_kv     the same for the MTP layer(s): 4 KiB/token
  gdn_state  per GDN layer a conv window of K-1 + k_max+1 columns in the model dtype, a float32
             recurrent state, and the tokens of the last step as the recurrence used them (two
             halves of k_max+1 tokens x Hv x (dk + dv + 2) floats); 146.8 MiB for the state alone
  graph_pool activations of the captured decode / verify / draft steps and short prefill chunks
             (an estimate)
  workspace  prefill activations for one chunk, the float32 logits of a verify step and the short
             prefill chunks' attention partials (an estimate);
             with 4-bit weights also what prefill's dense products take (a slab of dequantized weight)
  snapshots  the decode-state snapshots kept for chat turns (engine/snapshots.py): each the GDN state
             as the model defines it plus one hidden row; 4 x 146.8 MiB for the 27B
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from mtpchat.engine.config import Int4Format, ModelConfig, rtn_format
from mtpchat.engine.draft_vocab import DEFAULT_DRAFT_VOCAB, draft_vocab_bytes, four_bit_rows
from mtpchat.engine.units import fmt_bytes
from mtpchat.kernels.attention import split_workspace_floats
from mtpchat.kernels.int4_gemm import dense_workspace
from mtpchat.kernels.plan import ProductPlan

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
PREFILL_CHUNK = 2048         # tokens per prefill chunk on a GPU (the engine's default; the estimate's)
# the chunks a prefill may take where memory allows, largest first: fewer chunks pay everywhere.
# Over 4-bit products each chunk dequantizes every weight once (kernels/int4_gemm.py), and in an MoE
# each chunk reads every expert for the few rows routed to it: an 8,192-token prompt on an H100
# (tests/bench/probe_prefill_chunk.py) in chunks of 2,048 / 4,096 / 8,192, the 27B int4 992 / 922 /
# 881 ms, the 35B-A3B FP8 342 / 292 / 253 and bf16 372 / 295 / 256 (2026-11-26). A dense model's
# bf16 and FP8 products gained little then (the 27B FP8 599 / 592 / 591); with prefill attention in
# our kernel (KernelPlan.prefill_attention), whose programs fill the GPU better the longer the
# chunk, the 27B FP8 502.7 / 501.0 / 486.5 and 504.6 / 494.8 / 488.2, bf16 716.8 / 710.8 / 706.6
# and 723.9 / 716.7 / 708.6 (2026-11-28), for some 0.8-0.9 GiB more at the peak
LARGE_PREFILL_CHUNKS = (8192, 4096)
CONTEXT_STEP = 1024          # suggested context lengths are rounded down to this
HEADROOM_FIXED = 256 << 20   # allocator slack and fragmentation: a fixed part ...
HEADROOM_SHARE = 0.02        # ... plus a share of the plan
DEFAULT_SNAPSHOTS = 4        # decode-state snapshots for chat turns: two turns' worth (engine/snapshots.py)


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype given as a name ("bfloat16") or a torch.dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return DTYPE_BYTES[name]


def mlp_params(cfg: ModelConfig) -> int:
    """One layer's MLP: the SwiGLU (gate, up, down); for an MoE model the router (with the shared
    expert's gate), every routed expert and the shared expert."""
    h = cfg.hidden_size
    if not cfg.is_moe:
        return 3 * h * cfg.intermediate_size
    shared = cfg.shared_expert_intermediate_size
    return ((cfg.num_experts + (1 if shared else 0)) * h
            + 3 * h * (cfg.num_experts * cfg.moe_intermediate_size + shared))


def active_mlp_params(cfg: ModelConfig) -> int:
    """The MLP weights one token reads: all of a dense MLP; the router, the k chosen experts and
    the shared expert of an MoE."""
    if not cfg.is_moe:
        return mlp_params(cfg)
    h, shared = cfg.hidden_size, cfg.shared_expert_intermediate_size
    return ((cfg.num_experts + (1 if shared else 0)) * h
            + 3 * h * (cfg.num_experts_per_tok * cfg.moe_intermediate_size + shared))


def _norms_and_mlp(cfg: ModelConfig) -> int:
    # input_layernorm + post_attention_layernorm, and the MLP
    return 2 * cfg.hidden_size + mlp_params(cfg)


def gdn_block_params(cfg: ModelConfig) -> int:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return (cfg.conv_dim * h                       # in_proj_qkv
            + cfg.value_dim * h                    # in_proj_z
            + 2 * hv * h                           # in_proj_b, in_proj_a
            + cfg.conv_dim * cfg.linear_conv_kernel_dim  # depthwise conv1d, no bias
            + 2 * hv                               # A_log, dt_bias
            + cfg.linear_value_head_dim            # gated norm weight, shared by the heads
            + cfg.hidden_size * cfg.value_dim)     # out_proj


def attention_block_params(cfg: ModelConfig) -> int:
    h = cfg.hidden_size
    return (2 * cfg.q_dim * h                      # q_proj holds [query | gate] per head
            + 2 * cfg.kv_dim * h                   # k_proj, v_proj
            + h * cfg.q_dim                        # o_proj
            + 2 * cfg.head_dim)                    # q_norm, k_norm


def embedding_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size


def text_params(cfg: ModelConfig) -> int:
    """Parameters of the text model; the lm_head is counted once when tied to the embedding."""
    layers = sum(gdn_block_params(cfg) if t == "linear_attention" else attention_block_params(cfg)
                 for t in cfg.layer_types)
    layers += cfg.num_hidden_layers * _norms_and_mlp(cfg)
    heads = 1 if cfg.tie_word_embeddings else 2
    return heads * embedding_params(cfg) + layers + cfg.hidden_size


def mtp_params(cfg: ModelConfig) -> int:
    """The MTP head: fc [H, 2H], its full-attention decoder layer(s), and three norms.
    It reuses the target's embedding and lm_head, so those are not counted again."""
    if not cfg.has_mtp:
        return 0
    h = cfg.hidden_size
    layer = attention_block_params(cfg) + _norms_and_mlp(cfg)
    return 2 * h * h + cfg.mtp_num_hidden_layers * layer + 3 * h


FP8_BLOCK = 128             # rows and columns of one FP8 scale (kernels/fp8.py)
TEXT_LAYERS = "model.language_model.layers"   # the official checkpoints' module names (Int4Format.skip)
MTP_LAYERS = "mtp.layers"


def _fp8_bytes(N: int, K: int) -> int:
    """An FP8 product: a byte a weight and a float32 scale per 128 x 128 block."""
    return N * K + -(-N // FP8_BLOCK) * -(-K // FP8_BLOCK) * 4


def int4_bytes(N: int, K: int, fmt: Int4Format) -> int:
    """A 4-bit product as the engine keeps it (kernels/int4.py GroupInt4): half a byte a weight, a
    float16 scale per row and group, a byte zero per row and group unless symmetric, and the int32
    column order of a desc_act GPTQ weight."""
    groups = -(-K // fmt.group)
    return N * K // 2 + N * groups * (2 if fmt.symmetric else 3) + (4 * K if fmt.desc_act else 0)


def _fused(parts: list[int], K: int, nbytes: int, fp8: bool) -> int:
    """A fused product of parts (rows) over K columns: FP8 when every part but the last fills
    whole blocks of rows (they share the block scales; engine/weights.py), else the model dtype."""
    if fp8 and all(rows % FP8_BLOCK == 0 for rows in parts[:-1]):
        return _fp8_bytes(sum(parts), K)
    return sum(parts) * K * nbytes


def _product(parts: list[tuple[str, int]], K: int, nbytes: int, fp8: bool, int4: Int4Format | None) -> int:
    """One (fused) product of the layers: its parts as (checkpoint module name, rows) over K columns.
    In 4 bits each part the format quantizes (the others stay in the model dtype), else _fused."""
    if int4 is not None:
        return sum(int4_bytes(rows, K, int4) if int4.quantizes(name) else rows * K * nbytes for name, rows in parts)
    return _fused([rows for _, rows in parts], K, nbytes, fp8)


def _layer_weight_bytes(cfg: ModelConfig, kind: str, nbytes: int, fp8: bool, prefix: str = f"{TEXT_LAYERS}.0",
                        int4: Int4Format | None = None, experts: int | None = None) -> int:
    """One decoder layer's weights as the engine stores them (FP8: the products of FP8_PARAMS; 4
    bits: the products `int4` quantizes, named as in the checkpoint under `prefix`). `experts`:
    count only that many of an MoE layer's routed experts (what one token reads), else all."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    product = lambda parts, K, fp8=fp8: _product(parts, K, nbytes, fp8, int4)
    norms = 2 * h * nbytes
    mlp = f"{prefix}.mlp"
    if cfg.is_moe:
        # the router (bf16), then each routed expert (its gate and up parts on whole blocks for
        # FP8) and the shared expert; stacked, so per expert's blocks
        E, Fm, Fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        expert = lambda e: (product([(f"{mlp}.experts.{e}.gate_proj", Fm), (f"{mlp}.experts.{e}.up_proj", Fm)], h,
                                    fp8 and Fm % FP8_BLOCK == 0)
                            + product([(f"{mlp}.experts.{e}.down_proj", h)], Fm, fp8 and h % FP8_BLOCK == 0))
        # every expert's own name only where a 4-bit format could skip some of them
        routed = sum(map(expert, range(E))) if int4 is not None and int4.skip else E * expert(0)
        routed = routed if experts is None else routed * experts // E
        shared = (product([(f"{mlp}.shared_expert.gate_proj", Fs), (f"{mlp}.shared_expert.up_proj", Fs)], h)
                  + product([(f"{mlp}.shared_expert.down_proj", h)], Fs)) if Fs else 0
        mlp_bytes = (E + (1 if Fs else 0)) * h * nbytes + routed + shared
    else:
        F = cfg.intermediate_size
        mlp_bytes = product([(f"{mlp}.gate_proj", F), (f"{mlp}.up_proj", F)], h) + product([(f"{mlp}.down_proj", h)], F)
    if kind == "full_attention":
        p = f"{prefix}.self_attn"
        mixer = (product([(f"{p}.q_proj", 2 * cfg.q_dim), (f"{p}.k_proj", cfg.kv_dim), (f"{p}.v_proj", cfg.kv_dim)], h)
                 + product([(f"{p}.o_proj", h)], cfg.q_dim) + 2 * cfg.head_dim * nbytes)
    else:
        # [qkv | z], [b | a] in the model dtype (fused with them where neither FP8 nor 4 bits keeps
        # them apart: the same bytes), the conv, the gated norm, A_log and dt_bias in float32, out_proj
        p = f"{prefix}.linear_attn"
        inputs = product([(f"{p}.in_proj_qkv", cfg.conv_dim), (f"{p}.in_proj_z", cfg.value_dim)], h) + 2 * hv * h * nbytes
        mixer = (inputs + (cfg.conv_dim * cfg.linear_conv_kernel_dim + cfg.linear_value_head_dim) * nbytes
                 + 2 * hv * 4 + product([(f"{p}.out_proj", h)], cfg.value_dim))
    return mixer + mlp_bytes + norms


def _mtp_fc_bytes(cfg: ModelConfig, nbytes: int, int4: Int4Format | None) -> int:
    """The MTP head's fc [H, 2H]: in 4 bits where the format quantizes it (engine/weights.py
    INT4_PARAMS), else in the model dtype (FP8 keeps it so too)."""
    h = cfg.hidden_size
    return _product([("mtp.fc", h)], 2 * h, nbytes, False, int4)


def int4_format(cfg: ModelConfig, weights: str | None) -> Int4Format | None:
    """The 4-bit format the engine keeps the products in for Engine's `weights`: a 4-bit
    checkpoint's own (None or "int4"), config.rtn_format() for "int4" on any other; else None."""
    if cfg.quantization == "int4" and weights in (None, "int4"):
        return cfg.int4 or rtn_format()
    return rtn_format() if weights == "int4" else None


def weight_bytes(cfg: ModelConfig, dtype="bfloat16", mtp: bool = True, fp8: bool = False,
                 draft_vocab: int | None = DEFAULT_DRAFT_VOCAB, int4: Int4Format | None = None,
                 draft_int4: bool = False) -> int:
    """What the engine allocates for the weights: the products of FP8_PARAMS in FP8 with `fp8`, or
    those `int4` quantizes in 4 bits (the MTP fc among them), the rest (embedding, lm_head, norms,
    the GDN's conv, [b | a], the router) in the model dtype, A_log and dt_bias in float32; the trimmed draft
    head's rows in 4 bits with `draft_int4` (the kernel plan's draft_head_int4)."""
    nbytes = dtype_bytes(dtype)
    heads = 1 if cfg.tie_word_embeddings else 2
    total = heads * embedding_params(cfg) * nbytes + cfg.hidden_size * nbytes
    total += sum(_layer_weight_bytes(cfg, kind, nbytes, fp8, f"{TEXT_LAYERS}.{i}", int4)
                 for i, kind in enumerate(cfg.layer_types))
    if mtp and cfg.has_mtp:
        h = cfg.hidden_size
        total += _mtp_fc_bytes(cfg, nbytes, int4) + 3 * h * nbytes + sum(
            _layer_weight_bytes(cfg, "full_attention", nbytes, fp8, f"{MTP_LAYERS}.{j}", int4)
            for j in range(cfg.mtp_num_hidden_layers))
        # each row quantized on its own where the plan keeps them in 4 bits (DraftRows)
        row = int4_bytes(1, h, rtn_format()) if draft_int4 and four_bit_rows(h) else h * nbytes
        total += draft_vocab_bytes(cfg.vocab_size, draft_vocab, row)
    return total


def step_read_bytes(cfg: ModelConfig, dtype="bfloat16", weights: str | None = None) -> int:
    """The weight bytes one decode step of the target reads, as the memory plan stores them: every
    layer (of an MoE layer's routed experts the k one token chooses), the final norm and the
    lm_head; of the embedding only the looked-up row (nothing, next to the rest), unless it is the
    tied lm_head. `weights`: as plan_memory's."""
    nbytes, fp8, int4 = dtype_bytes(dtype), _is_fp8(cfg, weights), int4_format(cfg, weights)
    k = cfg.num_experts_per_tok if cfg.is_moe else None
    layers = sum(_layer_weight_bytes(cfg, kind, nbytes, fp8, f"{TEXT_LAYERS}.{i}", int4, experts=k)
                 for i, kind in enumerate(cfg.layer_types))
    return layers + (embedding_params(cfg) + cfg.hidden_size) * nbytes


def head_read_bytes(cfg: ModelConfig, dtype="bfloat16", weights: str | None = None) -> int:
    """The weight bytes one MTP draft step reads of the head, its lm_head rows aside: the fc, the
    norms and the head's layer(s) (of their routed experts the k one token chooses)."""
    nbytes, fp8, int4 = dtype_bytes(dtype), _is_fp8(cfg, weights), int4_format(cfg, weights)
    k, h = (cfg.num_experts_per_tok if cfg.is_moe else None), cfg.hidden_size
    return _mtp_fc_bytes(cfg, nbytes, int4) + 3 * h * nbytes + sum(
        _layer_weight_bytes(cfg, "full_attention", nbytes, fp8, f"{MTP_LAYERS}.{j}", int4, experts=k)
        for j in range(cfg.mtp_num_hidden_layers))


def _is_fp8(cfg: ModelConfig, weights: str | None) -> bool:
    return weights == "fp8" or (weights is None and cfg.quantization == "fp8")


def kv_bytes_per_token(cfg: ModelConfig, dtype="bfloat16") -> int:
    """K and V of every main full-attention layer, for one token."""
    return len(cfg.full_layers) * 2 * cfg.kv_dim * dtype_bytes(dtype)


def mtp_kv_bytes_per_token(cfg: ModelConfig, dtype="bfloat16") -> int:
    return cfg.mtp_num_hidden_layers * 2 * cfg.kv_dim * dtype_bytes(dtype)


def gdn_state_bytes(cfg: ModelConfig, dtype="bfloat16") -> int:
    """The GDN state of one sequence as the model defines it: per GDN layer the last K-1 conv
    inputs (model dtype) and one float32 recurrent state. 146.8 MiB for the 27B in bf16."""
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * dtype_bytes(dtype)
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(cfg.linear_layers) * (conv + ssm)


def gdn_step_state_bytes(cfg: ModelConfig, dtype="bfloat16", k_max: int = 0) -> int:
    """What the engine allocates for it (engine/state.py): a conv window of K-1 history columns
    plus room for the k_max+1 tokens of a verify step, one float32 recurrent state, and the last
    step's tokens kept for folding in (2 x (k_max+1) x Hv x (dk + dv + 2) float32)."""
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = (cfg.linear_conv_kernel_dim + k_max) * cfg.conv_dim * dtype_bytes(dtype)
    pend = 2 * (k_max + 1) * hv * (dk + dv + 2) * 4
    return len(cfg.linear_layers) * (conv + hv * dk * dv * 4 + pend)


def snapshot_bytes(cfg: ModelConfig, dtype="bfloat16") -> int:
    """One decode-state snapshot: the GDN state (conv inputs and float32 recurrent state) and the
    hidden of its last position."""
    return gdn_state_bytes(cfg, dtype) + cfg.hidden_size * dtype_bytes(dtype)


GDN_CHUNK = 64              # tokens of the GDN's chunked prefill form (kernels/gdn_chunk.py)


def _activation_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    # The widest point of a layer for one token of a prefill chunk: the residual and its normed
    # copy, the float32 norm temporaries, and the largest of
    # - the GDN mixer: qkv before and after the conv, z, its output, and the chunked form's float32
    #   work per chunk of GDN_CHUNK tokens and value head (the chunk's decays and their products
    #   [C, C], w [C, dk], u and v [C, dv], gates [C], the state [dk, dv]; the form whose scan writes
    #   the output (KernelPlan.chunk_fused_out) keeps a second [C, C] instead of v and the state:
    #   the larger of the two);
    # - attention: q with gate, k, v, output;
    # - the MLP: gate, up and their product;
    # - an MoE: per chosen expert (and the shared one) its gate | up and SwiGLU rows and its float32
    #   output row, the router's float32 logits.
    b = dtype_bytes(dtype)
    hv, dk, dv, C = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, GDN_CHUNK
    chunk_work = max(C + dk + 2 * dv + 1 + dk * dv // C, 2 * C + dk + dv + 1)
    gdn = (2 * cfg.conv_dim + 2 * cfg.value_dim) * b + hv * chunk_work * 4
    attention = (3 * cfg.q_dim + 2 * cfg.kv_dim) * b
    mlp = 3 * cfg.intermediate_size * b
    moe = 0
    if cfg.is_moe:
        rows = cfg.num_experts_per_tok + (1 if cfg.shared_expert_intermediate_size else 0)
        F = max(cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size)
        moe = rows * (3 * F * b + cfg.hidden_size * 4) + cfg.num_experts * 4
    return 2 * cfg.hidden_size * (b + 4) + max(gdn, attention, mlp, moe)


def _logits_bytes(cfg: ModelConfig, rows: int) -> int:
    # float32 logits, probabilities, and a sort (values + int64 indices) for top-p
    return rows * cfg.vocab_size * (4 + 4 + 12)


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv: int
    mtp_kv: int
    gdn_state: int
    graph_pool: int
    workspace: int
    snapshots: int
    max_context: int
    k_max: int
    mtp: bool
    dtype: str
    bytes_per_token: int          # kv + mtp_kv for one more token of context
    weight_format: str = "bf16"   # "fp8": the big products in block-scaled FP8; "int4": (some of) them in
                                  # 4 bits; else the model dtype's name

    @property
    def total(self) -> int:
        return (self.weights + self.kv + self.mtp_kv + self.gdn_state + self.graph_pool + self.workspace
                + self.snapshots)

    @property
    def headroom(self) -> int:
        """Slack kept free on top of the plan (allocator rounding, fragmentation)."""
        return HEADROOM_FIXED + int(HEADROOM_SHARE * self.total)

    @property
    def needed(self) -> int:
        return self.total + self.headroom

    def fits(self, free: int) -> bool:
        return self.needed <= free

    def as_dict(self) -> dict[str, int]:
        d = asdict(self)
        return {k: d[k] for k in ("weights", "kv", "mtp_kv", "gdn_state", "graph_pool", "workspace", "snapshots")}


# Drafts a step can carry at most, whatever k a model starts with: the MTP head predicts one token
# ahead, so chained drafts compound its misses (past 8, at the acceptance published for Qwen3.6's
# head, a draft is kept under 10% of the time and costs more than it gains), and a verify of k+1
# rows must stay within the few-row products' 16 rows (kernels/matvec.py MAX_ROWS). What it costs
# is small: 4 more rows of KV, conv window and pending tokens than k = 4.
K_MAX = 8
# Steps of up to this many drafts are fast: captured as CUDA graphs at load, timed at load, and the
# head catches up over CAPTURED_K+1 rows inside the step. Larger k run eagerly (no graph), the head
# catching up first where more rows wait: load time, graph memory and the usual step stay as for k 4.
CAPTURED_K = 4
# A short prefill goes as chunks of these sizes, each replayed from a CUDA graph captured at load
# (with pieces of a step's rows for the rest; engine/decoder.py prefill_pieces), where a GPU's plan
# takes them (KernelPlan.prefill_graphs). 96 and 128 since the few-row FP8 products run in cuBLAS:
# the 27B FP8's turns of 100 / 128 / 200 / 256 tokens after 8K in 71.2 / 58.7 / 98.8 / 74.7 ms against
# 88.3 / 71.7 / 165.2 / 147.7 with chunks of 64 at most (the last two then eager), the graphs' pool
# unchanged (98 MiB: the largest is captured first and the others reuse its memory), the chunks'
# shared attention workspace twice as large (224 MiB at 8K; an H200, tests/bench/probe_turn.py).
PREFILL_GRAPHS = (8, 16, 24, 32, 40, 48, 56, 64, 96, 128)
# Larger chunks captured too, replayed only where they end within the cache's first EARLY_ROWS rows
# (KernelPlan.prefill_early): a conversation's first prompt of a few hundred tokens, which an eager
# chunk's launches would hold on the host. Their attention reads those rows alone, so their partials
# (the 27B's: 194 MiB for 512 tokens) stay under the 128-token chunk's over an 8K cache (224 MiB).
# Every model's, 4-bit too: the 27B int4's 512-token first prompt 154.5 -> 59.8 ms, its graphs' pool
# 96 -> 242 MiB (an H200, tests/bench/probe_turn.py --history 8, 2026-11-28).
EARLY_GRAPHS = (256, 512)
EARLY_ROWS = 1024


def chunk_attention_bytes(cfg: ModelConfig, sizes: tuple[int, ...], cache_rows: int, dtype,
                          early: tuple[int, ...] = (), early_rows: int = EARLY_ROWS) -> int:
    """The decoder's one attention workspace for the prefill chunks replayed as graphs (engine/
    decoder.py): the partials of the largest over the cache, counted at the most spans of any cache
    up to its size so that the plan never shrinks as the context grows (at 32K: 140 spans counted,
    79 taken). Kept apart, the graphs of chunks of 8..64 by 8, 96 and 128 grew the 27B FP8's pool
    by 950 MiB over a cache of 8,329 rows, their partials 895 (an H200, mtpchat bench, 2026-11-28).
    `early`: the larger chunks that read the first `early_rows` rows alone (EARLY_GRAPHS); the one
    workspace is the larger of the two (from about 8K up the regular chunks'; below it the early
    ones': on the 27B at 2K 194 MiB against 76)."""
    return 4 * chunk_attention_floats(cfg, sizes, cache_rows, dtype_bytes(dtype), early, early_rows, most=True)


def chunk_attention_floats(cfg: ModelConfig, sizes: tuple[int, ...], cache_rows: int, itemsize: int,
                           early: tuple[int, ...] = (), early_rows: int = EARLY_ROWS, most: bool = False) -> int:
    """The float32 partials of that workspace: the decoder's own over its cache (`most` False), the
    plan's at the most spans of any cache up to cache_rows."""
    return max((split_workspace_floats(max(s), cfg.num_attention_heads, cfg.head_dim, rows, itemsize, most=most)
                for s, rows in ((sizes, cache_rows), (early, min(early_rows, cache_rows))) if s), default=0)


def prefill_graph_sizes(cfg: ModelConfig, four_bit: bool, four_bit_rows: int = ProductPlan.int4_prefill_rows
                        ) -> tuple[int, ...]:
    """The prefill chunks a GPU captures as graphs: every PREFILL_GRAPHS size for a model in bf16 or
    FP8, dense or MoE (an MoE layer's prefill layout takes as many blocks as its pairs could need,
    so no count waits for the host: kernels/moe_layout.py most_blocks). The 35B-A3B FP8's turn of
    16 / 50 / 128 tokens after 8K took 0.37 / 0.39 / 0.59 x the wall time of eager chunks with
    chunks of up to 64 tokens, and with chunks of 96 and 128 too its turns of 128 / 200 tokens 50.8
    / 99.7 ms against 76.8 / 159.5 (an H200, tests/bench/probe_turn.py; the 200 tokens' GPU time
    grew, 35.1 -> 75.8 ms, since each chunk reads most of the experts: the gain is the host's
    launches). A dense 4-bit model's chunks are captured up to `four_bit_rows` tokens (the plan's
    int4_prefill_rows: those products stream the weight in the few-row kernel, where the slab forms
    would keep a dense copy of it in the graphs' pool); a 4-bit MoE's all of them, its dense products
    being a small part of it (the 35B-A3B int4's pool 180 -> 228 MiB, and its turn of 128 / 200
    tokens after 8K 121.4 / 112.8 ms eager -> 39.0 / 69.8 through chunks of 128 and 128 + 64 + 8,
    an H200, probe_turn.py); none where four_bit_rows is 0."""
    if not four_bit or (cfg.is_moe and four_bit_rows > 0):
        return PREFILL_GRAPHS
    return tuple(T for T in PREFILL_GRAPHS if T <= four_bit_rows)


def _int4_prefill_bytes(cfg: ModelConfig, chunk: int, itemsize: int) -> int:
    """What prefill's dense 4-bit products take beside their outputs (kernels/int4_gemm.py): the
    products' columns run from the hidden size up to the widest input (the MLP's, the GDN's values,
    the attention's heads, the MTP fc's two rows side by side)."""
    widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.value_dim, cfg.q_dim,
                 2 * cfg.hidden_size if cfg.has_mtp else 0)
    return dense_workspace(chunk, cfg.hidden_size, widest, itemsize)


def plan_memory(cfg: ModelConfig, max_context: int, k_max: int = K_MAX, dtype="bfloat16",
                mtp: bool = True, cuda_graphs: bool = True,
                prefill_chunk: int = PREFILL_CHUNK, snapshots: int = DEFAULT_SNAPSHOTS,
                weights: str | None = None, draft_vocab: int | None = DEFAULT_DRAFT_VOCAB,
                draft_int4: bool = False) -> MemoryPlan:
    """The plan for one sequence of up to max_context tokens, with room for up to k_max drafts per
    step. `mtp` says whether the MTP head is loaded (its weights, KV and the graphs of the
    speculative steps); the GDN step state is the same either way, as the engine allocates it.
    `weights`: "fp8", "int4", "bf16", or None for the checkpoint's own format (Engine's `weights`;
    "int4" keeps a 4-bit checkpoint's own format, and quantizes any other as config.rtn_format());
    `draft_vocab`: Engine's (the trimmed draft head's rows; 0 or None: the full head);
    `draft_int4`: those rows kept in 4 bits (the kernel plan's draft_head_int4: on a GPU)."""
    mtp = mtp and cfg.has_mtp
    fp8, int4 = _is_fp8(cfg, weights), int4_format(cfg, weights)
    act = _activation_bytes_per_token(cfg, dtype)
    drafts = range(1, min(k_max, CAPTURED_K) + 1) if mtp else range(0)
    # one captured graph per step shape: decode (1 token), then verify (k+1) and draft (k) per k, and
    # per short prefill chunk (a GPU's plan; no logits)
    shapes = [1] + [k + 1 for k in drafts] + list(drafts)
    per_token = kv_bytes_per_token(cfg, dtype) + (mtp_kv_bytes_per_token(cfg, dtype) if mtp else 0)
    rows = max_context + k_max + 1   # a verify step may write k_max+1 rows past the last position
    chunks = prefill_graph_sizes(cfg, bool(int4))       # (a 4-bit checkpoint may load dequantized)
    return MemoryPlan(
        weights=weight_bytes(cfg, dtype, mtp, fp8, draft_vocab, int4, draft_int4),
        kv=kv_bytes_per_token(cfg, dtype) * rows,
        mtp_kv=mtp_kv_bytes_per_token(cfg, dtype) * rows if mtp else 0,
        gdn_state=gdn_step_state_bytes(cfg, dtype, k_max),
        graph_pool=sum(n * act + _logits_bytes(cfg, n) for n in shapes)
        + sum(chunks + EARLY_GRAPHS) * act if cuda_graphs else 0,
        workspace=min(prefill_chunk, max_context) * act + _logits_bytes(cfg, max(shapes))
        + chunk_attention_bytes(cfg, chunks, rows, dtype, EARLY_GRAPHS)
        + (_int4_prefill_bytes(cfg, min(prefill_chunk, max_context), dtype_bytes(dtype)) if int4 else 0),
        snapshots=snapshots * snapshot_bytes(cfg, dtype),
        max_context=max_context, k_max=k_max, mtp=mtp, dtype=str(dtype).removeprefix("torch."),
        bytes_per_token=per_token, weight_format="fp8" if fp8 else "int4" if int4 else str(dtype).removeprefix("torch."))


def prefill_chunk_that_fits(cfg: ModelConfig, free: int, max_context: int, k_max: int = K_MAX, dtype="bfloat16",
                            mtp: bool = True, cuda_graphs: bool = True, snapshots: int = DEFAULT_SNAPSHOTS,
                            weights: str | None = None, draft_vocab: int | None = DEFAULT_DRAFT_VOCAB,
                            draft_int4: bool = False) -> int:
    """The prefill chunk of an engine that finds `free` bytes on its device before it loads: the
    largest of LARGE_PREFILL_CHUNKS whose plan fits in `free`, else PREFILL_CHUNK (the plan the CLI
    checked before loading). A chunk that half of holds every prompt (max_context) is passed over
    for the next."""
    for chunk in LARGE_PREFILL_CHUNKS:
        if chunk // 2 < max_context and plan_memory(cfg, max_context, k_max, dtype, mtp, cuda_graphs, chunk,
                                                    snapshots, weights, draft_vocab, draft_int4).fits(free):
            return chunk
    return PREFILL_CHUNK


def max_context_that_fits(cfg: ModelConfig, free: int, k_max: int = K_MAX, dtype="bfloat16",
                          mtp: bool = True, cuda_graphs: bool = True,
                          snapshots: int = DEFAULT_SNAPSHOTS, weights: str | None = None,
                          draft_vocab: int | None = DEFAULT_DRAFT_VOCAB, draft_int4: bool = False) -> int | None:
    """The longest context (a multiple of CONTEXT_STEP, at most max_position_embeddings) whose
    plan fits in `free` bytes, or None when not even CONTEXT_STEP tokens fit."""
    best = None
    lo, hi = 1, cfg.max_position_embeddings // CONTEXT_STEP
    while lo <= hi:  # the plan grows with the context, so bisect on it
        mid = (lo + hi) // 2
        if plan_memory(cfg, mid * CONTEXT_STEP, k_max, dtype, mtp, cuda_graphs, snapshots=snapshots,
                       weights=weights, draft_vocab=draft_vocab, draft_int4=draft_int4).fits(free):
            best, lo = mid * CONTEXT_STEP, mid + 1
        else:
            hi = mid - 1
    return best


def describe(plan: MemoryPlan) -> list[str]:
    """The plan as aligned lines for a terminal."""
    weights = "weights" + {"fp8": " (FP8)", "int4": " (int4)"}.get(plan.weight_format, "")
    rows = [(weights, plan.weights), ("KV cache", plan.kv), ("MTP KV cache", plan.mtp_kv),
            ("GDN state", plan.gdn_state), ("graph pools", plan.graph_pool),
            ("workspace", plan.workspace), ("turn snapshots", plan.snapshots), ("headroom", plan.headroom),
            ("total", plan.needed)]
    lines = [f"  {name:<18}{fmt_bytes(n):>10}" for name, n in rows]
    drafts = f"up to {plan.k_max} drafts a step" if plan.mtp else "MTP off"
    lines.insert(0, f"memory plan: {plan.dtype}, context {plan.max_context:,} tokens, {drafts}, "
                    f"{fmt_bytes(plan.bytes_per_token)} per token")
    return lines
