"""The kernel plan (engine/plan.py): chosen at load from the device, the weight format and the
model; owned by each engine (two in one process may differ); carried by every forward context."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.dispatch import Ctx
from mtpchat.engine.memory import EARLY_GRAPHS, EARLY_ROWS, PREFILL_GRAPHS
from mtpchat.engine.plan import KernelPlan
from mtpchat.kernels.plan import CPU_PROGRAMS, ProductPlan
from tools.tiny import write_tiny_checkpoint

MOE = dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40, shared_expert_intermediate_size=40)


@pytest.mark.parametrize("fp8", [False, True])
def test_choose_follows_the_weight_format(gqa3, fp8):
    plan = KernelPlan.choose("cpu", ModelConfig.load(gqa3), fp8)
    assert plan.products.programs == CPU_PROGRAMS
    assert plan.products.small_split and plan.products.tail_split
    assert not plan.products.widen_bits                  # no FP8 product runs on the CPU
    assert plan.split_norm and plan.fc_split and plan.draft_pick and plan.head_input and plan.draft_chain and plan.pending_rows == 512
    assert not plan.shared_as_expert                     # a dense model


@pytest.mark.parametrize("fp8,int4,late", [(False, False, False), (True, False, True), (False, True, True)])
def test_fp8_and_4_bit_products_place_the_next_kernel_late_on_a_gpu(gqa3, monkeypatch, fp8, int4, late):
    # measured on an H100 (ab_step.py --plans release): a gain for FP8 and 4-bit models, none for bf16
    from mtpchat.engine import plan as plan_module
    monkeypatch.setattr(plan_module, "default_products", lambda device: ProductPlan(programs=132))
    monkeypatch.setattr(plan_module, "fp8_runs_on", lambda device: True)
    monkeypatch.setattr(plan_module, "fp8_form_runs_on", lambda device: False)
    config = ModelConfig.load(gqa3)
    assert KernelPlan.choose("cuda", config, fp8, int4).products.late_release is late
    assert not KernelPlan.choose("cpu", config, fp8, int4).products.late_release   # no PDL on the CPU


@pytest.mark.parametrize("room, form", [(232448, "triton"), (166912, "flash"), (101376, "flash")])
def test_prefill_attention_takes_our_kernel_where_its_timed_tiles_fit(monkeypatch, room, form):
    # timed on an H100 (128 x 64 tiles two deep, 192 KB at head_dim 256): an A100 (163 KB a program)
    # and the 99 KB cards would take smaller, untimed tiles, and keep flash
    from pathlib import Path
    from mtpchat.engine import plan as plan_module
    monkeypatch.setattr(plan_module, "default_products", lambda device: ProductPlan(programs=108, shared_memory=room))
    monkeypatch.setattr(plan_module, "fp8_form_runs_on", lambda device: False)
    config = ModelConfig.load(Path(__file__).resolve().parents[1] / "engine" / "configs" / "qwen3.6-27b.json")
    assert KernelPlan.choose("cuda", config, fp8=False).prefill_attention == form


def test_a_gpu_prefills_a_few_tokens_through_the_step_graphs(gqa3, monkeypatch):
    # on a GPU the graphs save a short prefill's eager launches; a CPU has no graphs to replay
    from mtpchat.engine import plan as plan_module
    monkeypatch.setattr(plan_module, "default_products", lambda device: ProductPlan(programs=132))
    monkeypatch.setattr(plan_module, "fp8_form_runs_on", lambda device: False)
    monkeypatch.setattr(plan_module, "fp8_runs_on", lambda device: True)
    config = ModelConfig.load(gqa3)
    gpu, cpu = KernelPlan.choose("cuda", config, fp8=False), KernelPlan.choose("cpu", config, fp8=False)
    assert (gpu.step_prefill, gpu.prefill_graphs, gpu.prefill_pieces) == (2, PREFILL_GRAPHS, 3)
    assert (cpu.step_prefill, cpu.prefill_graphs) == (0, ())
    # the chunks captured as graphs: every size for a model in bf16 or FP8, dense or MoE, and for a
    # 4-bit MoE; a dense 4-bit model's up to the plan's int4_prefill_rows (64)
    assert KernelPlan.choose("cuda", config, fp8=True).prefill_graphs == PREFILL_GRAPHS
    assert KernelPlan.choose("cuda", config, fp8=False, int4=True).prefill_graphs == PREFILL_GRAPHS[:-2]
    assert PREFILL_GRAPHS[-3:] == (64, 96, 128)
    moe = dataclasses.replace(config, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32)
    assert moe.is_moe and KernelPlan.choose("cuda", moe, fp8=False).prefill_graphs == PREFILL_GRAPHS
    assert KernelPlan.choose("cuda", moe, fp8=False, int4=True).prefill_graphs == PREFILL_GRAPHS
    assert KernelPlan.choose("cuda", moe, fp8=False).step_prefill == 2
    # and a first prompt's larger chunks, every model's; none on a CPU
    assert gpu.prefill_early == EARLY_GRAPHS == (256, 512) and gpu.prefill_early_rows == EARLY_ROWS == 1024
    assert cpu.prefill_early == ()
    for model, fp8, int4 in [(config, True, False), (moe, False, False), (moe, True, False), (config, False, True),
                             (moe, False, True)]:
        assert KernelPlan.choose("cuda", model, fp8=fp8, int4=int4).prefill_early == EARLY_GRAPHS
    # an early size's graph reads the first rows alone: no size may be both
    with pytest.raises(ValueError, match="share sizes"):
        gpu.replace(prefill_early=(128, 256))
    with pytest.raises(ValueError, match="must hold the largest early chunk"):
        gpu.replace(prefill_early_rows=256)                   # 512 could never end within it
    assert gpu.replace(prefill_early=(), prefill_early_rows=0).prefill_early == ()
    assert gpu.prefill_early_beside == 0                      # a candidate, off until timed
    with pytest.raises(ValueError, match="prefill_early_beside"):
        gpu.replace(prefill_early_beside=-1)


def test_4_bit_prefill_chunks_follow_the_few_row_kernels_rows(gqa3, monkeypatch):
    # ProductPlan.int4_prefill_rows: a dense 4-bit model's graph chunks up to that many tokens (its
    # products in the few-row kernel), a 4-bit MoE's all of them (its dense products a small part);
    # none where it is 0
    from mtpchat.engine import plan as plan_module
    from mtpchat.engine.memory import prefill_graph_sizes
    monkeypatch.setattr(plan_module, "fp8_runs_on", lambda device: True)
    monkeypatch.setattr(plan_module, "fp8_form_runs_on", lambda device: False)
    config = ModelConfig.load(gqa3)
    moe = dataclasses.replace(config, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32)
    assert ProductPlan.int4_prefill_rows == 64 and prefill_graph_sizes(config, True) == PREFILL_GRAPHS[:-2]
    assert prefill_graph_sizes(moe, True) == PREFILL_GRAPHS and PREFILL_GRAPHS[-2:] == (96, 128)
    assert prefill_graph_sizes(config, True, 0) == prefill_graph_sizes(moe, True, 0) == ()
    for rows, chunks in [(64, PREFILL_GRAPHS[:-2]), (24, (8, 16, 24)), (7, ()), (0, ())]:
        monkeypatch.setattr(plan_module, "default_products",
                            lambda device, rows=rows: ProductPlan(programs=132, int4_prefill_rows=rows))
        assert KernelPlan.choose("cuda", config, fp8=False, int4=True).prefill_graphs == chunks
        assert KernelPlan.choose("cuda", moe, fp8=False, int4=True).prefill_graphs == (PREFILL_GRAPHS if rows else ())
        assert KernelPlan.choose("cuda", config, fp8=True).prefill_graphs == PREFILL_GRAPHS    # not 4 bits
        assert KernelPlan.choose("cuda", moe, fp8=True).prefill_graphs == PREFILL_GRAPHS
    # every model's prefill takes three graph chunks at most, a 4-bit MoE's too (its expert blocks
    # as wide as a chunk's pairs an expert: ProductPlan.prefill_block_rows)
    for model, fp8, int4 in [(config, False, True), (config, True, False), (moe, True, False), (moe, False, False),
                             (moe, False, True)]:
        assert KernelPlan.choose("cuda", model, fp8=fp8, int4=int4).prefill_pieces == 3
    assert KernelPlan.choose("cuda", dataclasses.replace(moe, quantization="int4"), fp8=False).prefill_pieces == 3


def test_a_4_bit_checkpoint_loaded_dequantized_plans_as_bf16(gqa3, monkeypatch):
    # a 4-bit checkpoint loaded with weights "bf16" keeps its products in bf16: the plan's chunks
    # and pieces are a bf16 model's (KernelPlan.choose's four_bit, as the engine passes it), and the
    # memory plan counts the chunks the decoder then sizes its buffers for (the largest, 128)
    from mtpchat.engine import plan as plan_module
    from mtpchat.engine.memory import plan_memory
    monkeypatch.setattr(plan_module, "fp8_runs_on", lambda device: True)
    monkeypatch.setattr(plan_module, "fp8_form_runs_on", lambda device: False)
    monkeypatch.setattr(plan_module, "default_products", lambda device: ProductPlan(programs=132))
    config = ModelConfig.load(gqa3)
    moe = dataclasses.replace(config, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32)
    for model in (config, moe):
        stored = dataclasses.replace(model, quantization="int4")
        kept = KernelPlan.choose("cuda", stored, fp8=False)
        loaded = KernelPlan.choose("cuda", stored, fp8=False, four_bit=False)
        assert kept.prefill_graphs == (PREFILL_GRAPHS if model.is_moe else PREFILL_GRAPHS[:-2]) and kept.prefill_pieces == 3
        assert (loaded.prefill_graphs, loaded.prefill_pieces) == (PREFILL_GRAPHS, 3)
        assert kept.prefill_early == loaded.prefill_early == EARLY_GRAPHS
        assert plan_memory(stored, 4096, weights="bf16").workspace == plan_memory(model, 4096).workspace
        assert plan_memory(stored, 4096, weights="int4").workspace != plan_memory(model, 4096).workspace


def test_a_short_4_bit_prefill_takes_the_few_row_kernel(monkeypatch):
    # engine/dispatch.linear: a prefill (not rowwise) of at most int4_prefill_rows rows over a 4-bit
    # weight on the GPU; more rows, a step's rows, other weights and the CPU as before
    from mtpchat.engine import dispatch
    from mtpchat.kernels import int4
    calls = []
    monkeypatch.setattr(dispatch, "matvec_prefill", lambda x, w, plan: calls.append(("few", x.shape[0])) or "few")
    monkeypatch.setattr(dispatch.int4_gemm, "gemm", lambda x, w, plan=None: calls.append(("slab", x.shape[0])) or "slab")
    monkeypatch.setattr(dispatch, "matvec", lambda x, w, plan=None, conv=None: calls.append(("step", x.shape[0])) or "step")
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    w = int4.quantize_ref(torch.randn(64, 128))
    plan = ProductPlan(programs=132, int4_prefill_rows=32)
    x = lambda T, K=128: type("Rows", (), {"shape": (T, K), "is_cuda": True, "element_size": lambda self: 2})()
    assert dispatch.linear(x(32), w, False, plan) == "few"
    assert dispatch.linear(x(33), w, False, plan) == "slab"
    assert dispatch.linear(x(5), w, True, plan) == "step"
    assert dispatch.linear(x(5), w, False, dataclasses.replace(plan, int4_prefill_rows=0)) == "slab"
    most = dataclasses.replace(plan, int4_prefill_rows=64)           # matvec_prefill takes 64 rows at most
    assert dispatch.linear(x(64), w, False, most) == "few" and dispatch.linear(x(65), w, False, most) == "slab"
    # groups whose tile does not fit the device's shared memory even one buffer deep: the slab forms
    wide = int4.quantize_ref(torch.randn(64, 2048), group=1024)
    small = dataclasses.replace(most, shared_memory=101376)         # an RTX 4090's
    assert dispatch.linear(x(64, 2048), wide, False, most) == "few"
    assert dispatch.linear(x(64, 2048), wide, False, small) == "slab"
    assert dispatch.linear(x(16, 2048), wide, False, small) == "few"    # x's tile of 16 rows leaves room
    assert calls == [("few", 32), ("slab", 33), ("step", 5), ("slab", 5), ("few", 64), ("slab", 65),
                     ("few", 64), ("slab", 64), ("few", 16)]
    for bad in (65, 128, -1):                                         # refused where the plan is made
        with pytest.raises(ValueError, match="int4_prefill_rows is 0"):
            dataclasses.replace(plan, int4_prefill_rows=bad)


@pytest.mark.parametrize("hopper", [True, False])
def test_4_bit_prefill_takes_the_fp8_tensor_cores_where_they_serve(gqa3, monkeypatch, hopper):
    # measured on an H100 (kernels/int4_gemm.py): the 27B int4's 8K prompt 606 against 814 ms
    from mtpchat.engine import plan as plan_module
    monkeypatch.setattr(plan_module, "default_products", lambda device: ProductPlan(programs=132))
    monkeypatch.setattr(plan_module, "fp8_form_runs_on", lambda device: hopper and torch.device(device).type == "cuda")
    plan = KernelPlan.choose("cuda", ModelConfig.load(gqa3), False, True)
    assert plan.products.int4_prefill == ("fp8" if hopper else "dense")
    assert KernelPlan.choose("cpu", ModelConfig.load(gqa3), False, True).products.int4_prefill == "dense"


@pytest.mark.parametrize("name,glu", [("NVIDIA H200", True), ("NVIDIA H100 80GB HBM3", False),
                                      ("NVIDIA GH200 480GB", False)])
def test_the_swiglus_take_the_h200s_tiles_on_an_h200_only(monkeypatch, name, glu):
    # measured (ab_step.py --plans fp8tiles / int4tiles): the FP8 SwiGLU's two scale blocks a step
    # 0.965 x on an H200, 1.011 x on an H100; the plain products' everywhere; the FP8 experts' SwiGLU
    # on 16 columns and the 4-bit SwiGLU 3 deep timed on an H200 alone; a GH200 (unmeasured) as an H100
    from mtpchat.kernels import plan as kplan
    cpu = kplan.default_products("cpu")
    assert (cpu.fp8_two_blocks, cpu.fp8_expert_glu_tile, cpu.int4_glu_tile) == (("plain",), (32, 128, 4, 3), None)
    monkeypatch.setattr(kplan, "programs_on", lambda device: 132)
    monkeypatch.setattr(kplan, "block_shared_memory", lambda device: 232448)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    kplan._default.cache_clear()
    try:
        plan = kplan._default("cuda", 0)
        assert plan.fp8_two_blocks == (("plain", "swiglu") if glu else ("plain",))
        assert plan.fp8_expert_glu_tile == ((16, 128, 2, 4) if glu else (32, 128, 4, 3))
        assert plan.int4_glu_tile == ((32, 512, 2, 3) if glu else None)
    finally:
        kplan._default.cache_clear()          # no plan made under the patches outlives the test


def test_the_shared_expert_joins_the_routed_ones_only_as_wide(tmp_path):
    alike = ModelConfig.load(write_tiny_checkpoint(tmp_path / "a", moe=True, **MOE))
    wide = ModelConfig.load(write_tiny_checkpoint(tmp_path / "b", moe=True, **{**MOE, "shared_expert_intermediate_size": 80}))
    assert KernelPlan.choose("cpu", alike, False).shared_as_expert
    assert not KernelPlan.choose("cpu", wide, False).shared_as_expert


def test_a_gpu_finishes_the_moe_layer_in_its_combine_and_drafts_from_4_bit_rows(tmp_path, gqa3, monkeypatch):
    """combine_normed over an MoE and draft_head_int4, every weight format, on a GPU only (a CPU
    keeps the plain combine and the head's own rows, which its tests compare against)."""
    from mtpchat.engine import plan as plan_module
    monkeypatch.setattr(plan_module, "default_products", lambda device: ProductPlan(programs=132))
    monkeypatch.setattr(plan_module, "fp8_runs_on", lambda device: True)
    monkeypatch.setattr(plan_module, "fp8_form_runs_on", lambda device: False)
    moe = ModelConfig.load(write_tiny_checkpoint(tmp_path / "a", moe=True, **MOE))
    dense = ModelConfig.load(gqa3)
    for fp8, int4 in ((False, False), (True, False), (False, True)):
        gpu, cpu = KernelPlan.choose("cuda", moe, fp8, int4), KernelPlan.choose("cpu", moe, fp8, int4)
        assert gpu.combine_normed and gpu.draft_head_int4 and not gpu.moe_fold
        assert not cpu.combine_normed and not cpu.draft_head_int4
        assert not KernelPlan.choose("cuda", dense, fp8, int4).combine_normed
        assert KernelPlan.choose("cuda", dense, fp8, int4).draft_head_int4


def test_a_gpu_folds_beside_the_draft_at_a_lower_priority(gqa3, monkeypatch):
    """fold_beside_draft and fold_yields on a GPU (a CPU folds in the step, its tests' reference)."""
    from mtpchat.engine import plan as plan_module
    monkeypatch.setattr(plan_module, "default_products", lambda device: ProductPlan(programs=132))
    monkeypatch.setattr(plan_module, "fp8_runs_on", lambda device: True)
    monkeypatch.setattr(plan_module, "fp8_form_runs_on", lambda device: False)
    config = ModelConfig.load(gqa3)
    for fp8, int4 in ((False, False), (True, False), (False, True)):
        gpu, cpu = KernelPlan.choose("cuda", config, fp8, int4), KernelPlan.choose("cpu", config, fp8, int4)
        assert gpu.fold_beside_draft == 1 and gpu.fold_yields
        assert cpu.fold_beside_draft == 0 and not cpu.fold_yields


def test_the_moe_layer_reads_a_normed_over_bf16_and_fp8_experts_only(tmp_path, gqa3):
    moe = ModelConfig.load(write_tiny_checkpoint(tmp_path / "a", moe=True, **MOE))
    assert KernelPlan.choose("cpu", moe, False).moe_normed and KernelPlan.choose("cpu", moe, True).moe_normed
    assert not KernelPlan.choose("cpu", moe, False, int4=True).moe_normed         # --weights int4
    four_bit = dataclasses.replace(moe, quantization="int4")                      # a GPTQ / compressed-tensors one
    assert not KernelPlan.choose("cpu", four_bit, False).moe_normed
    assert not KernelPlan.choose("cpu", ModelConfig.load(gqa3), True).moe_normed  # a dense model has no MoE layer
    assert KernelPlan.choose("cpu", moe, False).products.routed_layout            # the layout the routing writes


def test_replace_and_describe(gqa3):
    plan = KernelPlan.choose("cpu", ModelConfig.load(gqa3), False)
    other = plan.replace(fc_split=False, tail_parts=5)           # a products field by name too
    assert not other.fc_split and other.products.tail_parts == 5 and plan.fc_split and plan.products.tail_parts == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.fc_split = False
    with pytest.raises(TypeError):
        plan.replace(no_such_choice=1)

    def my_tiles(N, K, itemsize, swiglu, fp8):
        return None
    d = plan.replace(tiles=my_tiles).describe()
    assert d["products"]["tiles"] == "my_tiles" and d["products"]["split_tiles"] == "measured"
    assert d["fc_split"] is True and d["products"]["programs"] == CPU_PROGRAMS


def test_a_prefills_expert_blocks_follow_its_pairs_an_expert():
    """ProductPlan.prefill_block_rows: 16 pairs a block below the first mean of pairs an expert, 32
    below the second, 64 beyond; 4-bit experts on their own means; thresholds out of order refused."""
    plan = ProductPlan(programs=132)
    E = 257                                               # the 35B-A3B's experts and its shared one
    assert [plan.prefill_block_rows(9 * T, E, False) for T in (16, 128, 512, 2048)] == [16, 16, 32, 64]
    assert [plan.prefill_block_rows(9 * T, E, True) for T in (16, 512, 1024, 2048, 8192)] == [16, 16, 32, 32, 64]
    assert dataclasses.replace(plan, moe_prefill_blocks=(1, 1)).prefill_block_rows(E, E, False) == 64
    with pytest.raises(ValueError, match="moe_prefill_blocks"):
        ProductPlan(programs=1, moe_prefill_blocks=(32, 16))
    with pytest.raises(ValueError, match="int4_moe_prefill_blocks"):
        ProductPlan(programs=1, int4_moe_prefill_blocks=(-1, 16))
    assert ProductPlan(programs=1, int4_moe_prefill_blocks=(0, 0)).prefill_block_rows(1, E, True) == 64


def test_two_engines_in_one_process_keep_their_own_plans(gqa3, monkeypatch):
    config = ModelConfig.load(gqa3)
    small = KernelPlan.choose("cpu", config, False).replace(pending_rows=8, split_norm=False)
    a = Engine.load(gqa3, max_context=256, plan=small)
    b = Engine.load(gqa3, max_context=256)
    assert a.plan is small and a.decoder.plan is small and b.plan == KernelPlan.choose("cpu", config, False)
    seen = []
    ctx_init = Ctx.__init__

    def record(self, *args, **kw):
        ctx_init(self, *args, **kw)
        seen.append(self.plan)
    monkeypatch.setattr(Ctx, "__init__", record)           # every forward's context carries its engine's plan
    ids = list(range(5, 40))
    params = SamplingParams(max_tokens=24, stop_token_ids=())
    out_a = list(a.generate(ids, params))[-1].token_ids
    assert seen and all(p is small for p in seen)
    seen.clear()
    out_b = list(b.generate(ids, params))[-1].token_ids
    assert seen and all(p is b.plan for p in seen)
    assert out_a == out_b                                  # on the CPU the references run either way


def test_products_default_for_a_device():
    from mtpchat.kernels.plan import default_products
    assert default_products("cpu") == ProductPlan(programs=CPU_PROGRAMS)
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert default_products("cuda").programs == sms


def test_prefill_attention_reaches_its_kernel(gqa3, monkeypatch):
    # prefill_attention "triton" (the default) sends a prefill chunk's attention (bf16 rows where the kernels run)
    # to kernels/attention_chunk.py's kernel with the cache's first n rows; here the kernel stands in as
    # its float32 reference, which the flash path agrees with to bf16's rounding
    from mtpchat.engine import model
    from mtpchat.kernels import attention_chunk
    calls = []

    def kernel(q, k, v, scale, plan):
        assert plan is engine.plan.products          # its tiles from the plan that chose it
        calls.append((q.shape[0], k.shape[0], v.shape[0]))
        return attention_chunk.prefill_attention_ref(q, k, v, scale)
    engine = Engine.load(gqa3, dtype=torch.bfloat16, max_context=256, prefill_chunk=16)
    ids = list(range(5, 45))
    flash = engine.logits(ids).float()
    monkeypatch.setattr(attention_chunk, "prefill_attention_triton", kernel)
    default = engine.plan
    assert default.prefill_attention == "triton"                          # the default (measured)
    engine.plan = engine.decoder.plan = default.replace(programs=1)
    assert torch.equal(engine.logits(ids).float(), flash) and not calls   # where the kernels do not run
    monkeypatch.setattr(model, "use_triton", lambda *t: True)
    engine.plan = engine.decoder.plan = default.replace(prefill_attention="flash", programs=1)
    assert torch.equal(engine.logits(ids).float(), flash) and not calls   # "flash" never calls it
    # chunks too short to fill the device's programs stay with flash (prefill_attention_fills)
    engine.plan = engine.decoder.plan = default.replace(prefill_attention="triton", programs=10_000)
    assert torch.equal(engine.logits(ids).float(), flash) and not calls
    engine.plan = engine.decoder.plan = default.replace(prefill_attention="triton", programs=1)
    got = engine.logits(ids).float()
    layers = sum(kind == "full_attention" for kind in engine.config.layer_types)
    # each attention layer in each chunk: 16 rows over 16 keys, 16 over 32, the last 8 over 40
    assert layers and sorted(calls) == sorted([(16, 16, 16), (16, 32, 32), (8, 40, 40)] * layers), calls
    assert (got - flash).abs().max() <= 0.05 * flash.abs().max()
    with pytest.raises(ValueError, match="prefill_attention"):
        default.replace(prefill_attention="Triton")
