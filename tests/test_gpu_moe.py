"""The MoE models on the GPU: CUDA graphs, greedy MTP on equal to MTP off (a tiny MoE in both
checkpoint layouts and FP8; the 35B-A3B's shapes with random weights, 8 prompts x 256 tokens,
k = 1..4), and the GPU's logits close to the CPU's float32 ones."""
import contextlib
import gc
from pathlib import Path

import pytest
import torch

from mtpchat.engine import Engine, bench
from mtpchat.engine.config import ModelConfig
from mtpchat.engine.plan import KernelPlan
from tools.tiny import write_tiny_checkpoint
from mtpchat.engine.weights import PER_EXPERT, STACKED
from helpers import GPU_MOE_SHAPE as SHAPE, assert_mtp_on_equals_off, gpu_prompts, greedy_tokens, random_ids

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-moe")
    return {STACKED: write_tiny_checkpoint(root / "stacked", moe=True, **SHAPE),
            PER_EXPERT: write_tiny_checkpoint(root / "per", moe=True, experts=PER_EXPERT, fp8=True, **SHAPE)}


def on_equals_off(engine, n_prompts=4, n=96):
    assert_mtp_on_equals_off(engine, gpu_prompts(engine, n_prompts), n, profile_ks=(1, 2, 3, 4), ks=(3,))


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("layout", [STACKED, PER_EXPERT])
def test_greedy_mtp_on_equals_off(ckpts, layout, graphs):
    engine = Engine.load(ckpts[layout], device="cuda", dtype=torch.bfloat16, cuda_graphs=graphs, max_context=1024)
    assert engine.fp8 == (layout == PER_EXPERT)
    on_equals_off(engine)


@pytest.mark.parametrize("layout,forms", [(STACKED, dict(moe_fold=True)), (STACKED, dict(moe_normed=True)),
                                          (STACKED, dict(moe_fold=True, moe_normed=True)),
                                          (PER_EXPERT, dict(moe_fold=True, moe_normed=True)),
                                          (STACKED, dict(combine_normed=True)),
                                          (STACKED, dict(combine_normed=True, moe_normed=True)),
                                          (PER_EXPERT, dict(combine_normed=True, moe_normed=True))])
def test_the_moe_layer_between_normeds(ckpts, layout, forms):
    """KernelPlan.moe_fold (the layer finished in its down kernel), combine_normed (in its combine)
    and moe_normed (the layer reading its norm as a Normed): greedy MTP on == off (CUDA graphs), and
    in float32 the same greedy tokens as the plan without any (they differ only in where the norms'
    1 / rms is applied)."""
    base = Engine.load(ckpts[layout], device="cuda", dtype=torch.bfloat16, max_context=1024)
    without = base.plan.replace(moe_fold=False, combine_normed=False, moe_normed=False)  # moe_normed is a default
    engine = Engine.load(ckpts[layout], device="cuda", dtype=torch.bfloat16, max_context=1024,
                         plan=without.replace(**forms))
    del base
    on_equals_off(engine)
    del engine
    if layout == STACKED:
        plain = Engine.load(ckpts[layout], device="cuda", dtype=torch.float32, max_context=1024, plan=without)
        engine = Engine.load(ckpts[layout], device="cuda", dtype=torch.float32, max_context=1024,
                             plan=without.replace(**forms))
        for ids in gpu_prompts(plain, 3):
            assert greedy_tokens(engine, ids, 64) == greedy_tokens(plain, ids, 64)


def test_gpu_logits_close_to_the_cpu(ckpts):
    gpu = Engine.load(ckpts[STACKED], device="cuda", dtype=torch.float32, max_context=512, cuda_graphs=False)
    cpu = Engine.load(ckpts[STACKED], device="cpu", dtype=torch.float32, max_context=512)
    for ids in gpu_prompts(cpu, 6)[::2]:
        want, got = cpu.logits(ids), gpu.logits(ids).cpu()
        assert ((got - want).norm() / want.norm()).item() < 1e-4


@contextlib.contextmanager
def random_35b_a3b(weights: str, **forms):
    """An engine of the 35B-A3B's shapes on random weights, the default plan with `forms` changed,
    freed after (the bf16 one is 66 GiB: the one before must be gone)."""
    config = ModelConfig.load(Path(bench.__file__).parent / "configs" / "qwen3.5-35b-a3b.json")
    gc.collect()
    torch.cuda.empty_cache()
    plan = KernelPlan.choose("cuda", config, weights == "fp8", weights == "int4").replace(**forms)
    engine = Engine(config, device="cuda", max_context=2048, weights=weights, plan=plan)
    try:
        yield engine
    finally:
        del engine
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_35b_a3b_shapes_mtp_on_equals_off(weights):
    with random_35b_a3b(weights) as engine:
        on_equals_off(engine, n_prompts=8, n=256)


@pytest.mark.slow
@pytest.mark.parametrize("routed", [True, False])
@pytest.mark.parametrize("weights", ["int4"])
def test_35b_a3b_shapes_mtp_on_equals_off_over_either_layout(weights, routed):
    """Greedy MTP on == off at the 35B-A3B's shapes over the layout the routing writes and over the
    derived one: a short form of the bench's exactness check (under the routed layout it once
    failed within 64 tokens of every prompt: a decode's routing weights took other last bits than
    a verify's, tests/kernels/test_moe_routing.py)."""
    with random_35b_a3b(weights, routed_layout=routed) as engine:
        assert_mtp_on_equals_off(engine, gpu_prompts(engine, 2), 64, ks=(3,))


@pytest.mark.parametrize("layout", [STACKED, PER_EXPERT])
def test_prefill_graph_chunks_on_an_moe(ckpts, layout):
    """An MoE's prefill chunks captured as graphs (memory.prefill_graph_sizes), its layout's blocks
    bounded ahead (moe_layout.most_blocks). The capture works, a chunk's replay gives the eager
    run's logits bit for bit, and greedy MTP on == off from prompts that take such chunks; a first
    prompt of 300 tokens likewise through the early chunk of 256 (KernelPlan.prefill_early)."""
    base = Engine.load(ckpts[layout], device="cuda", dtype=torch.bfloat16, max_context=1024)
    plan = base.plan.replace(prefill_graphs=(8, 16, 24))
    assert plan.prefill_early == (256, 512)
    del base
    runs = {}
    for graphs in (True, False):
        engine = Engine.load(ckpts[layout], device="cuda", dtype=torch.bfloat16, max_context=1024,
                             cuda_graphs=graphs, plan=plan)
        assert not graphs or {("prefill", T) for T in (8, 16, 24)} | {("prefill", T, 1024) for T in (256, 512)} \
            <= engine.decoder.runner.graphs.keys()
        ids = gpu_prompts(engine, 2)[1]                     # 28 tokens: 24, then a step piece of 4
        engine.reset()
        engine.decoder.begin(ids)
        runs[graphs] = engine.decoder.last_logits.cpu()
        first = random_ids(300, 3, engine.config.vocab_size - 64)   # 256, then 24, 16 and a step piece of 4
        engine.reset()
        engine.decoder.begin(first)
        runs[graphs, "early"] = engine.decoder.last_logits.cpu()
        if graphs:
            prompts = [p[:n] for p, n in zip(gpu_prompts(engine, 4)[1:], (11, 20, 33))]
            assert_mtp_on_equals_off(engine, prompts, 48, profile_ks=(2, 4), ks=(3,))
        del engine
    assert torch.equal(runs[True], runs[False])
    assert torch.equal(runs[True, "early"], runs[False, "early"])
