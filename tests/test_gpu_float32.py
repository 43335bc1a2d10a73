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

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
             linear_key_head_dim=32, linear_value_head_dim=32)
CONFIGS = Path(__file__).resolve().parents[1] / "engine" / "configs"


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want.float()).abs().max() / want.float().abs().max()).item()


def greedy(engine, ids, n, mtp=False, k=3):
    engine.reset()
    engine.mtp, engine.draft_tokens = mtp, k
    return list(list(engine.generate(ids, SamplingParams(max_tokens=n, stop_token_ids=())))[-1].token_ids)


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab - 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu32"), **SHAPE)


@pytest.mark.parametrize("n,chunk", [(1, None), (63, None), (130, None), (130, 48)])
def test_float32_logits_equal_the_cpu(ckpt, n, chunk):
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.float32, max_context=512, prefill_chunk=chunk)
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = prompt(n, cpu.config.vocab_size, seed=n)
    err = relative(gpu.logits(ids), cpu.logits(ids))
    assert err < 1e-4, err


def test_float32_decode_equals_the_cpu(ckpt):
    gpu = Engine.load(ckpt, device="cuda", dtype=torch.float32, max_context=512)
    cpu = Engine.load(ckpt, device="cpu", dtype=torch.float32, max_context=512)
    ids = prompt(40, cpu.config.vocab_size, seed=7)
    want = greedy(cpu, ids, 48)
    assert greedy(gpu, ids, 48) == want
    for k in (1, 3, 4):
        assert greedy(gpu, ids, 48, mtp=True, k=k) == want, k


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
    ids = prompt(70, cfg.vocab_size, seed=3)
    err = relative(gpu.logits(ids), cpu.logits(ids))
    assert err < 1e-4, err
    want = greedy(gpu, ids, 24)
    assert greedy(gpu, ids, 24, mtp=True, k=4) == want
    assert greedy(cpu, ids, 24) == want


@pytest.mark.parametrize("mtp", [False, True])
def test_a_turn_resumed_from_a_snapshot_equals_a_fresh_prefill(ckpt, mtp):
    # on the GPU with CUDA graphs: the first turn keeps the state where its conversation ends; the
    # next turn leaves the first's reply out (as the templates drop thinking) and resumes there
    engine = Engine.load(ckpt, device="cuda", dtype=torch.float32, max_context=512, mtp=mtp)
    fresh = Engine.load(ckpt, device="cuda", dtype=torch.float32, max_context=512, mtp=mtp, snapshots=0)
    vocab = engine.config.vocab_size
    convo, gen, tail = prompt(150, vocab, 1), prompt(3, vocab, 2), prompt(40, vocab, 3)
    params = SamplingParams(max_tokens=32, stop_token_ids=())
    list(engine.generate(convo + gen, params, snapshot_at=(len(convo),)))
    for follow in (tail, tail[:25] + gen):
        events = list(engine.generate(convo + follow, params, snapshot_at=(len(convo) + len(follow) - 3,)))
        assert events[0].cached_tokens == len(convo)
        assert list(events[-1].token_ids) == list(list(fresh.generate(convo + follow, params))[-1].token_ids)
