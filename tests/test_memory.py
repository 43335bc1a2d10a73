"""The memory plan: the numbers of qwen35-model.md §9, and agreement with what the engine allocates."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from mtpchat.engine import memory
from mtpchat.engine.units import fmt_bytes
from mtpchat.engine.config import Int4Format, ModelConfig
from mtpchat.models import alias_config, lookup_alias

CONFIGS = Path(__file__).resolve().parents[1] / "engine" / "configs"  # the official configs, as shipped
GB, GiB, MiB, KiB = 1e9, 2 ** 30, 2 ** 20, 2 ** 10
DRAFT_27B = (32768 + 2048) * (5120 * 2 + 8)   # the trimmed draft head, context rows included: bf16 rows, int64 ids


@pytest.fixture(scope="module")
def c27():
    return ModelConfig.load(CONFIGS / "qwen3.6-27b.json")


def test_27b_matches_the_fact_sheet(c27):
    assert memory.text_params(c27) == 26_895_998_464
    assert round(memory.text_params(c27) * 2 / GB, 2) == 53.79
    assert round(memory.text_params(c27) * 2 / GiB, 2) == 50.10
    assert memory.mtp_params(c27) == 424_699_392
    assert memory.kv_bytes_per_token(c27, "bfloat16") == 64 * KiB
    assert memory.mtp_kv_bytes_per_token(c27, "bfloat16") == 4 * KiB
    assert round(memory.gdn_state_bytes(c27, "bfloat16") / MiB, 1) == 146.8
    # the per-block figures of §9
    assert memory.gdn_block_params(c27) == 115_876_064
    assert memory.attention_block_params(c27) == 104_858_112
    assert 3 * c27.hidden_size * c27.intermediate_size == 267_386_880
    assert memory.embedding_params(c27) == 1_271_398_400


@pytest.mark.parametrize("alias, text, mtp, kv_kib, gdn_mib", [
    ("Qwen3.5-9B", 8_953_803_264, 243_290_624, 32, 49.1),
    ("Qwen3.5-4B", 4_205_751_296, 120_599_552, 32, 49.1),
    ("Qwen3.5-2B", 1_881_825_088, 60_828_160, 12, 18.6),
    ("Qwen3.5-0.8B", 752_393_024, 20_452_864, 12, 18.6),
])
def test_smaller_sizes_match_the_fact_sheet(alias, text, mtp, kv_kib, gdn_mib):
    cfg = alias_config(lookup_alias(alias))
    assert memory.text_params(cfg) == text
    assert memory.mtp_params(cfg) == mtp
    assert memory.kv_bytes_per_token(cfg) == kv_kib * KiB
    assert round(memory.gdn_state_bytes(cfg) / MiB, 1) == gdn_mib


@pytest.mark.parametrize("alias, file", [("Qwen3.6-27B-MTP", "qwen3.6-27b"), ("Qwen3.5-27B", "qwen3.6-27b"),
                                         ("Qwen3.5-9B", "qwen3.5-9b"), ("Qwen3.5-4B", "qwen3.5-4b"),
                                         ("Qwen3.5-0.8B", "qwen3.5-0.8b")])
def test_alias_shape_equals_the_shipped_config(alias, file):
    assert alias_config(lookup_alias(alias)) == ModelConfig.load(CONFIGS / f"{file}.json")


def test_tied_head_is_counted_once(c27):
    raw = json.loads((CONFIGS / "qwen3.6-27b.json").read_text())
    raw = {**raw, "tie_word_embeddings": True, "text_config": {**raw["text_config"], "tie_word_embeddings": True}}
    tied = ModelConfig.from_dict(raw)
    assert memory.text_params(c27) - memory.text_params(tied) == 248320 * 5120


def test_plan_parts_for_27b(c27):
    plan = memory.plan_memory(c27, max_context=32768, k_max=3, dtype="bfloat16")
    # in bf16, but A_log and dt_bias (48 GDN layers x 2 x 48 heads) in float32, as the engine keeps them
    assert plan.weights == (26_895_998_464 + 424_699_392) * 2 + 48 * 2 * 48 * 2 + DRAFT_27B
    full_head = memory.plan_memory(c27, max_context=32768, k_max=3, dtype="bfloat16", draft_vocab=0)
    assert plan.weights - full_head.weights == DRAFT_27B
    fp8 = memory.plan_memory(c27, max_context=32768, k_max=3, dtype="bfloat16", weights="fp8")
    # embedding and lm_head stay bf16 (5.1 GB), the layers and the MTP layer in FP8: 29.9 GB in all
    assert fp8.weight_format == "fp8" and 29.5e9 < fp8.weights < 30.5e9
    assert plan.kv == (32768 + 4) * 64 * KiB      # room for the k_max+1 rows of a verify step
    assert plan.mtp_kv == (32768 + 4) * 4 * KiB
    # 48 layers x (conv 10240 x (4 + 3) columns bf16 + a float32 state of 48x128x128
    # + the last step's 2 x 4 tokens x 48 heads x (128 + 128 + 2) floats)
    assert plan.gdn_state == 48 * (10240 * 7 * 2 + 48 * 128 * 128 * 4 + 2 * 4 * 48 * 258 * 4)
    assert plan.bytes_per_token == 68 * KiB
    # four turn snapshots: 48 x (conv 10240 x 3 columns bf16 + a float32 state) + one hidden row in bf16
    assert plan.snapshots == 4 * (48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4) + 5120 * 2)
    assert plan.total == (plan.weights + plan.kv + plan.mtp_kv + plan.gdn_state + plan.graph_pool + plan.workspace
                          + plan.snapshots)
    assert 0 < plan.graph_pool < GiB and 0 < plan.workspace < GiB
    assert plan.needed > plan.total
    assert set(plan.as_dict()) == {"weights", "kv", "mtp_kv", "gdn_state", "graph_pool", "workspace", "snapshots"}


def test_plan_without_mtp_or_graphs(c27):
    on = memory.plan_memory(c27, 4096, 3, "bfloat16")
    off = memory.plan_memory(c27, 4096, 3, "bfloat16", mtp=False, cuda_graphs=False)
    assert on.weights - off.weights == 424_699_392 * 2 + DRAFT_27B     # no head, no trimmed head
    assert off.mtp_kv == 0 and off.graph_pool == 0 and not off.mtp
    assert off.gdn_state == on.gdn_state   # the step state is allocated either way


def test_float32_doubles_weights_and_kv(c27):
    bf = memory.plan_memory(c27, 4096, 3, "bfloat16")
    fp = memory.plan_memory(c27, 4096, 3, "torch.float32")
    same = 48 * 2 * 48 * 4 + (32768 + 2048) * 8   # A_log and dt_bias are float32 in both, the draft ids int64
    assert fp.weights - same == 2 * (bf.weights - same) and fp.kv == 2 * bf.kv


def test_the_draft_heads_rows_in_4_bits_where_the_plan_keeps_them_so(c27):
    """On a GPU the kernel plan keeps the trimmed head's rows in 4 bits (draft_head_int4): 2,560
    bytes of weights and 40 float16 scales a row of the 27B's 5,120 where bf16 takes 10,240; rows
    that are not whole groups of 128 stay as they are. The context that fits grows by the bytes."""
    rows = 32768 + 2048
    bf, four = memory.weight_bytes(c27, "bfloat16"), memory.weight_bytes(c27, "bfloat16", draft_int4=True)
    assert bf - four == rows * (5120 * 2 - 5120 // 2 - 40 * 2)
    assert memory.weight_bytes(c27, "bfloat16", draft_vocab=0, draft_int4=True) == \
        memory.weight_bytes(c27, "bfloat16", draft_vocab=0)                   # the full head has no copy
    odd = replace(c27, hidden_size=5120 + 64)
    assert memory.weight_bytes(odd, "bfloat16", draft_int4=True) == memory.weight_bytes(odd, "bfloat16")
    free = 60 * GiB
    assert memory.plan_memory(c27, 4096, 4, draft_int4=True).weights == four
    assert memory.max_context_that_fits(c27, free, 4, draft_int4=True) > memory.max_context_that_fits(c27, free, 4)


def test_max_context_that_fits_is_the_boundary(c27):
    free = 60 * GiB
    ctx = memory.max_context_that_fits(c27, free, 4, "bfloat16")
    assert ctx is not None and ctx % memory.CONTEXT_STEP == 0
    assert memory.plan_memory(c27, ctx, 4, "bfloat16").fits(free)
    assert not memory.plan_memory(c27, ctx + memory.CONTEXT_STEP, 4, "bfloat16").fits(free)
    assert memory.max_context_that_fits(c27, 80 * GiB, 4, "bfloat16") == 262144   # capped by the model
    assert memory.max_context_that_fits(c27, 40 * GiB, 4, "bfloat16") is None      # weights alone do not fit


def test_fmt_bytes_and_describe(c27):
    assert fmt_bytes(64 * KiB) == "64.0 KiB"
    assert fmt_bytes(memory.gdn_state_bytes(c27)) == "146.8 MiB"
    assert fmt_bytes(512) == "512 B"
    text = "\n".join(memory.describe(memory.plan_memory(c27, 4096, 3)))
    assert "51.2 GiB" in text and "256.2 MiB" in text and "68.0 KiB per token" in text


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        memory.dtype_bytes("int8")


@pytest.mark.parametrize("tie, mtp", [(False, True), (True, True), (False, False)])
def test_plan_agrees_with_the_engine(tmp_path, tie, mtp):
    import torch
    from mtpchat.engine import Engine
    from tools.tiny import write_tiny_checkpoint
    folder = write_tiny_checkpoint(tmp_path / "m", tie=tie, mtp=mtp)
    engine = Engine.load(folder, device="cpu", dtype=torch.float32, max_context=300, k_max=4)
    plan = memory.plan_memory(engine.config, 300, 4, "float32", mtp=True, cuda_graphs=False)
    actual = engine.memory()
    for part in ("weights", "kv", "mtp_kv", "gdn_state", "snapshots"):
        assert plan.as_dict()[part] == actual[part], part
    assert (actual["mtp_kv"] > 0) == mtp


# ---- 4-bit weights --------------------------------------------------------------------------------

GPTQ_SKIP = (".*attn.*", ".*shared_expert.*", ".*mtp.*", ".*visual.*")   # the official GPTQ releases'


INT4 = Int4Format("gptq", 128)


def gptq(cfg, **fmt):
    return replace(cfg, quantization="int4", int4=Int4Format("gptq", **{"skip": GPTQ_SKIP, **fmt}))


@pytest.mark.parametrize("symmetric, desc_act", [(True, False), (False, False), (True, True)])
def test_a_4bit_product_counts_what_the_engine_keeps(symmetric, desc_act):
    import torch
    from mtpchat.kernels.int4 import quantize_ref
    w = torch.randn(40, 384, generator=torch.Generator().manual_seed(0))
    q = quantize_ref(w, 128, symmetric)
    if desc_act:
        q = q._replace(perm=torch.randperm(384).to(torch.int32))
    assert memory.int4_bytes(40, 384, Int4Format("gptq", 128, symmetric, desc_act)) == q.nbytes()


def test_27b_in_4_bits_on_load(c27):
    plan = memory.plan_memory(c27, 32768, 4, "bfloat16", weights="int4")
    assert plan.weight_format == "int4" and "weights (int4)" in memory.describe(plan)[1]
    # every product of the 64 layers and of the MTP head (its fc too) at 4.125 bits a weight (a
    # float16 scale per 128); embedding, lm_head, [b | a] and the trimmed draft head in bf16: 17.0 GiB
    assert 16 * GiB < plan.weights < 17.5 * GiB
    four_bit = (memory.text_params(c27) + memory.mtp_params(c27) - 2 * memory.embedding_params(c27)
                - 48 * 2 * 48 * 5120)   # less the embedding and lm_head, [b | a]
    assert plan.weights - memory.plan_memory(c27, 32768, 4, weights="bf16").weights == pytest.approx(
        four_bit * (0.5 + 2 / 128 - 2), rel=1e-3)
    # the target: MTP, 32K context and 4 turn snapshots on a 24 GB GPU (23 GiB of it free)
    assert plan.mtp and plan.snapshots == 4 * memory.snapshot_bytes(c27) and plan.fits(23 * GiB)
    assert not memory.plan_memory(c27, 32768, 4, weights="fp8").fits(23 * GiB)


def test_35b_a3b_in_4_bits_with_16k_fits_24_gb():
    c35 = ModelConfig.load(CONFIGS / "qwen3.5-35b-a3b.json")
    plan = memory.plan_memory(c35, 16384, 4, "bfloat16", weights="int4")
    assert plan.weight_format == "int4" and plan.fits(23 * GiB)
    assert not memory.plan_memory(c35, 16384, 4, "bfloat16", weights="fp8").fits(23 * GiB)
    # a step reads 8 of the 256 routed experts: the floor's bytes, well under the stored weights
    read = memory.step_read_bytes(c35, "bfloat16", "int4")
    assert read < memory.step_read_bytes(c35, "bfloat16", "fp8") < memory.step_read_bytes(c35, "bfloat16")
    assert 2e9 < read < 2.6e9


def test_a_gptq_checkpoint_counts_only_what_its_format_quantizes(c27):
    # the official 27B GPTQ release: the 64 layers' MLPs in 4 bits, attention, GDN and MTP in bf16
    official = memory.plan_memory(gptq(c27), 32768, 4, "bfloat16")
    assert official.weight_format == "int4" and 28 * GB < official.weights < 30 * GB
    mlps = 64 * 3 * 5120 * 17408
    bf16 = memory.plan_memory(c27, 32768, 4, "bfloat16")
    assert bf16.weights - official.weights == mlps * 2 - memory.int4_bytes(5120, 17408, INT4) * 3 * 64
    # weights="int4" keeps the checkpoint's own format; "bf16" dequantizes it
    assert memory.plan_memory(gptq(c27), 32768, 4, weights="int4").weights == official.weights
    assert memory.plan_memory(gptq(c27), 32768, 4, weights="bf16").weights == bf16.weights
    # zeros where not symmetric, the column order where desc_act: counted per product
    assert memory.plan_memory(gptq(c27, symmetric=False), 32768, 4).weights - official.weights == mlps // 128
    assert memory.plan_memory(gptq(c27, desc_act=True), 32768, 4).weights - official.weights == 64 * 4 * (
        2 * 5120 + 17408)


def test_a_4bit_moe_checkpoint_names_each_expert():
    c35 = ModelConfig.load(CONFIGS / "qwen3.5-35b-a3b.json")
    routed = memory.plan_memory(gptq(c35), 16384, 4).weights
    # expert 7 of every layer left in bf16: its gate, up [512, 2048] and down [2048, 512] at 2 bytes
    one_out = memory.plan_memory(gptq(c35, skip=GPTQ_SKIP + (r".*\.experts\.7\.",)), 16384, 4).weights
    four_bit = 2 * memory.int4_bytes(512, 2048, INT4) + memory.int4_bytes(2048, 512, INT4)
    assert one_out - routed == 40 * (3 * 512 * 2048 * 2 - four_bit)
    # the release: every routed expert in 4 bits, the MTP layer's (".*mtp.*") and the shared ones in bf16
    assert memory.plan_memory(c35, 16384, 4, weights="bf16").weights - routed == 40 * 256 * (
        3 * 512 * 2048 * 2 - four_bit)


def test_a_prefill_takes_the_largest_chunk_that_fits(c27):
    """Fewer prefill chunks pay (4-bit products dequantize every weight once a chunk, an MoE reads
    all its experts, prefill attention's programs fill the GPU better): the largest chunk whose
    plan fits, down to the one the CLI checks before loading, in every format and model."""
    plan = lambda chunk, weights="int4", context=32768: memory.plan_memory(c27, context, prefill_chunk=chunk,
                                                                          weights=weights)
    chunk = lambda free, weights="int4", context=32768: memory.prefill_chunk_that_fits(c27, free, context,
                                                                                      weights=weights)
    assert plan(8192).needed > plan(4096).needed > plan(2048).needed
    assert chunk(80 * GB) == 8192 and chunk(plan(8192).needed) == 8192
    assert chunk(plan(8192).needed - 1) == 4096 and chunk(plan(4096).needed - 1) == 2048
    assert chunk(plan(2048).needed) == 2048                   # a card the plan only just fits keeps it
    assert chunk(1 * GB) == memory.PREFILL_CHUNK            # nothing fits: what the CLI would have refused
    assert chunk(80 * GB, context=4096) == 4096 and chunk(80 * GB, context=3000) == 4096
    assert chunk(80 * GB, context=2048) == 2048
    for weights in ("fp8", "bf16", None):
        assert chunk(200 * GB, weights) == 8192
        assert chunk(plan(8192, weights).needed - 1, weights) == 4096
        assert chunk(plan(2048, weights).needed, weights) == memory.PREFILL_CHUNK
    moe = ModelConfig.load(CONFIGS / "qwen3.5-35b-a3b.json")
    for weights in ("fp8", "bf16", "int4"):
        big = memory.plan_memory(moe, 32768, prefill_chunk=8192, weights=weights).needed
        assert memory.prefill_chunk_that_fits(moe, big, 32768, weights=weights) == 8192
        assert memory.prefill_chunk_that_fits(moe, big - 1, 32768, weights=weights) == 4096


@pytest.mark.parametrize("name, chunk, weights, measured", [
    ("qwen3.6-27b", 2048, "bf16", 0.53), ("qwen3.6-27b", 8192, "bf16", 1.85), ("qwen3.6-27b", 8192, "int4", 1.85),
    ("qwen3.5-35b-a3b", 2048, "fp8", 0.33), ("qwen3.5-35b-a3b", 8192, "fp8", 1.22),
    ("qwen3.5-35b-a3b", 8192, "bf16", 1.19)])
def test_the_prefill_workspace_covers_what_was_measured(name, chunk, weights, measured):
    """The plan's prefill workspace against the peak an H100 measured beyond an engine at rest
    (tests/bench/probe_prefill_chunk.py, an 8,192-token prompt, no CUDA graphs), within the
    headroom's fixed part."""
    config = ModelConfig.load(CONFIGS / f"{name}.json")
    plan = memory.plan_memory(config, 8448, prefill_chunk=chunk, weights=weights, cuda_graphs=False)
    assert plan.workspace + memory.HEADROOM_FIXED >= measured * GiB


def test_the_plan_counts_a_first_prompts_early_chunks(c27):
    # every model's graphs of 256 and 512 tokens (KernelPlan.prefill_early) in the pool, their
    # attention's partials over the first EARLY_ROWS rows in the one workspace, which is the larger of
    # theirs and the 128-token chunk's over the whole cache
    from mtpchat.engine.memory import EARLY_GRAPHS, EARLY_ROWS, PREFILL_GRAPHS, chunk_attention_bytes
    act = memory._activation_bytes_per_token(c27, "bfloat16")
    assert EARLY_GRAPHS == (256, 512)
    pools = {w: memory.plan_memory(c27, 32768, weights=w).graph_pool for w in ("bf16", "fp8", "int4")}
    assert pools["bf16"] == pools["fp8"]
    assert pools["bf16"] - pools["int4"] == (sum(PREFILL_GRAPHS) - sum(PREFILL_GRAPHS[:-2])) * act
    # a 4-bit MoE's pool holds its chunks of 96 and 128 too (memory.prefill_graph_sizes)
    c35 = ModelConfig.load(CONFIGS / "qwen3.5-35b-a3b.json")
    moe_pools = {w: memory.plan_memory(c35, 16384, weights=w).graph_pool for w in ("bf16", "int4")}
    assert moe_pools["int4"] == moe_pools["bf16"] > 0
    steps = memory.plan_memory(c27, 32768, weights="bf16", cuda_graphs=False)
    assert steps.graph_pool == 0 and steps.workspace == memory.plan_memory(c27, 32768, weights="bf16").workspace
    assert pools["bf16"] == sum(n * act + memory._logits_bytes(c27, n) for n in [1] + [k + 1 for k in range(1, 5)]
                                + list(range(1, 5))) + sum(PREFILL_GRAPHS + EARLY_GRAPHS) * act
    rows = 32768 + memory.K_MAX + 1
    both = chunk_attention_bytes(c27, PREFILL_GRAPHS, rows, "bfloat16", EARLY_GRAPHS)
    assert both == chunk_attention_bytes(c27, PREFILL_GRAPHS, rows, "bfloat16")          # 128 over 32K is larger
    small = chunk_attention_bytes(c27, PREFILL_GRAPHS, 2048, "bfloat16", EARLY_GRAPHS)  # a short cache: 512 over 1K
    assert small == chunk_attention_bytes(c27, (), EARLY_ROWS, "bfloat16", (512,)) > \
        chunk_attention_bytes(c27, PREFILL_GRAPHS, 2048, "bfloat16")
    assert round(small / MiB, 1) == 193.5 and chunk_attention_bytes(c27, (), 4096, "bfloat16") == 0


def test_the_decoder_sizes_the_chunks_workspace_as_the_plan_counts_it(c27):
    # one formula: the decoder's partials over its own cache (memory.chunk_attention_floats) never
    # exceed what the plan counts at the most spans of any cache up to its size
    from mtpchat.engine.memory import (EARLY_GRAPHS, EARLY_ROWS, PREFILL_GRAPHS, chunk_attention_bytes,
                                       chunk_attention_floats)
    for context in (100, 600, 2048, 5000, 8192, 32768, 131072):
        rows = context + memory.K_MAX + 1
        for sizes in (PREFILL_GRAPHS, PREFILL_GRAPHS[:-2]):
            own = chunk_attention_floats(c27, sizes, rows, 2, EARLY_GRAPHS, EARLY_ROWS)
            assert 0 < 4 * own <= chunk_attention_bytes(c27, sizes, rows, "bfloat16", EARLY_GRAPHS)
