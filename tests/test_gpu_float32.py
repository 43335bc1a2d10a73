"""The engine on the GPU in float32: the kernels take tiles that fit float32 (a 27B layer's attention
would otherwise ask for more shared memory than an SM has), and the GPU's logits are the CPU's, the
float32 references', within 1e-4 relative, at the tiny checkpoint's shapes and at the 27B's."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mtpchat.engine import Engine, SamplingParams
from mtpchat.engine.config import ModelConfig
from tools.tiny import write_tiny_checkpoint
from helpers import GPU_SHAPE, assert_mtp_on_equals_off, greedy_tokens, random_ids, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIGS = Path(__file__).resolve().parents[1] / "engine" / "configs"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu32"), **GPU_SHAPE)


@pytest.mark.parametrize("n,chunk", [(1, None), (63, None), (130, None), (130, 48)])
def test_float32_logits_equal_the_cpu(ckpt, n, chunk):
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.float32, max_context=512, prefill_chunk=chunk)
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = random_ids(n, n, cpu.config.vocab_size - 64)
    err = rel_err(gpu.logits(ids), cpu.logits(ids))
    assert err < 1e-4, err


def test_float32_decode_equals_the_cpu(ckpt):
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.float32, max_context=512)
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = random_ids(40, 7, cpu.config.vocab_size - 64)
    assert greedy_tokens(gpu, ids, 48) == greedy_tokens(cpu, ids, 48)
    assert_mtp_on_equals_off(gpu, [ids], 48, ks=(1, 3, 4))


def test_float32_at_the_27b_layer_shapes():
    # four 27B layers (three GDN, one attention) with the MTP head and a short vocabulary: every
    # kernel of prefill, decode, verify and draft compiles in float32 and matches the CPU
    raw = json.loads((CONFIGS / "qwen3.6-27b.json").read_text())
    base = ModelConfig.from_dict(raw)
    cfg = dataclasses.replace(base, num_hidden_layers=4, vocab_size=4096,
                              layer_types=("linear_attention",) * 3 + ("full_attention",))
    gpu = Engine(cfg, device="cuda", dtype=torch.float32, max_context=256)
    cpu = Engine(cfg, device="cpu", dtype=torch.float32, max_context=256, cuda_graphs=False)
    for mine, theirs in ((cpu.model, gpu.model), (cpu.head, gpu.head)):
        ours = dict(theirs.named_parameters())
        for name, p in mine.named_parameters():
            p.data.copy_(ours[name].data.cpu())
    ids = random_ids(70, 3, cfg.vocab_size - 64)
    err = rel_err(gpu.logits(ids), cpu.logits(ids))
    assert err < 1e-4, err
    want = greedy_tokens(gpu, ids, 24)
    assert greedy_tokens(gpu, ids, 24, mtp=True, k=4) == want
    assert greedy_tokens(cpu, ids, 24) == want


@pytest.mark.parametrize("mtp", [False, True])
def test_a_turn_resumed_from_a_snapshot_equals_a_fresh_prefill(ckpt, mtp):
    # on the GPU with CUDA graphs: the first turn keeps the state where its conversation ends; the
    # next turn leaves the first's reply out (as the templates drop thinking) and resumes there
    engine = Engine.load(ckpt, device="cuda", dtype=torch.float32, max_context=512, mtp=mtp)
    fresh = Engine.load(ckpt, device="cuda", dtype=torch.float32, max_context=512, mtp=mtp, snapshots=0)
    vocab = engine.config.vocab_size
    convo, gen, tail = (random_ids(n, seed, vocab - 64) for n, seed in ((150, 1), (3, 2), (40, 3)))
    params = SamplingParams(max_tokens=32, stop_token_ids=())
    list(engine.generate(convo + gen, params, snapshot_at=(len(convo),)))
    for follow in (tail, tail[:25] + gen):
        events = list(engine.generate(convo + follow, params, snapshot_at=(len(convo) + len(follow) - 3,)))
        assert events[0].cached_tokens == len(convo)
        assert list(events[-1].token_ids) == list(list(fresh.generate(convo + follow, params))[-1].token_ids)
