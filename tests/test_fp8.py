"""FP8 checkpoints in the official layout, and FP8 on load from bf16 (float32, CPU): the FP8 model is
the model of its dequantized weights, which transformers reads as the oracle; quantizing on load
gives the weights an offline quantization gives; greedy MTP on equals MTP off."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpchat.engine import Engine, SamplingParams, memory
from tools.tiny import FP8_TENSORS, write_dequantized_twin, write_tiny_checkpoint
from mtpchat.engine.weights import WeightsError
from mtpchat.kernels.fp8 import quantize_ref
from helpers import assert_mtp_on_equals_off, random_ids, rel_err

transformers = pytest.importorskip("transformers")

# every fused product's parts on whole 128-row blocks, so each is stored in FP8; K over two blocks
ALIGNED = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    fp8 = write_tiny_checkpoint(root / "fp8", fp8=True, **ALIGNED)
    return fp8, write_dequantized_twin(fp8, root / "bf16")


def fp8_params(engine) -> list[str]:
    return [n for n, p in engine.model.named_parameters() if p.dtype == torch.float8_e4m3fn]


def test_the_checkpoint_is_laid_out_as_the_official_fp8_release(pair):
    fp8, _ = pair
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    scaled = [n for n in index if n.endswith("_scale_inv")]
    assert scaled and all(n.removesuffix("_scale_inv").endswith(FP8_TENSORS) for n in scaled)
    assert "model.language_model.layers.0.linear_attn.in_proj_b.weight_scale_inv" not in index
    assert any(index[n] != index[n.removesuffix("_scale_inv")] for n in scaled)   # scales in other shards too


@pytest.mark.parametrize("n", [1, 63, 130, 257])
def test_fp8_logits_equal_transformers_on_the_dequantized_weights(pair, n):
    fp8, twin = pair
    engine = Engine.load(fp8, max_context=512, prefill_chunk=48, weights="fp8")
    assert engine.fp8 and len(fp8_params(engine)) == 4 * 4     # per layer: two mixer products, gate|up, down
    ref = transformers.Qwen3_5ForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    ids = random_ids(n, n, engine.config.vocab_size)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert rel_err(engine.logits(ids), want) < 1e-4


def test_weights_fp8_on_load_equals_quantizing_offline(pair, tmp_path):
    _, twin = pair
    offline = Path(tmp_path / "offline")
    import shutil
    shutil.copytree(twin, offline)
    index = json.loads((offline / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        held = load_file(str(offline / shard))
        for name in [n for n in held if n.endswith(FP8_TENSORS)]:
            q = quantize_ref(held[name])
            held[name], held[name + "_scale_inv"] = q.w, q.scale
            index["weight_map"][name + "_scale_inv"] = shard
        save_file(held, str(offline / shard), metadata={"format": "pt"})
    (offline / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((offline / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (offline / "config.json").write_text(json.dumps(config))
    on_load, from_disk = Engine.load(twin, weights="fp8"), Engine.load(offline, weights="fp8")
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    mine, theirs = dict(on_load.model.named_parameters()), dict(from_disk.model.named_parameters())
    assert mine.keys() == theirs.keys() and fp8_params(on_load)
    for name in mine:
        assert torch.equal(bits(mine[name]), bits(theirs[name])), name
    for (name, a), (_, b) in zip(on_load.head.named_parameters(), from_disk.head.named_parameters()):
        assert torch.equal(bits(a), bits(b)), name


def test_on_the_cpu_an_fp8_checkpoint_is_dequantized_as_it_loads(pair):
    # nothing on the CPU multiplies FP8: without weights="fp8" the weights are dequantized once
    fp8, twin = pair
    engine = Engine.load(fp8)
    assert not engine.fp8 and not fp8_params(engine)
    assert any("dequantized to float32 as they load" in n for n in engine.notices)
    ids = random_ids(40, 3, engine.config.vocab_size)
    assert rel_err(engine.logits(ids), Engine.load(twin).logits(ids)) < 1e-6


def test_weights_bf16_dequantizes_an_fp8_checkpoint(pair):
    fp8, twin = pair
    plain = Engine.load(fp8, weights="bf16")
    assert not plain.fp8 and not fp8_params(plain)
    ids = random_ids(40, 1, plain.config.vocab_size)
    assert rel_err(plain.logits(ids), Engine.load(twin).logits(ids)) < 1e-6


def test_unaligned_products_stay_in_the_model_dtype(tmp_path):
    # the tiny shapes: q|gate|k|v parts of 256, 64 and 64 rows cannot share 128-row blocks
    fp8 = write_tiny_checkpoint(tmp_path / "fp8", fp8=True)
    twin = write_dequantized_twin(fp8, tmp_path / "bf16")
    engine = Engine.load(fp8, weights="fp8")
    kept = dict(engine.model.named_parameters())
    assert kept["layers.3.mixer.qkv"].dtype == torch.float32 and "layers.3.mixer.qkv_scale" not in kept
    ids = random_ids(50, 2, engine.config.vocab_size)
    assert rel_err(engine.logits(ids), Engine.load(twin).logits(ids)) < 1e-4


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_mtp_on_equals_off_in_fp8(pair, k):
    fp8, _ = pair
    engine = Engine.load(fp8, max_context=512, weights="fp8")
    prompts = [random_ids(17 + 30 * seed, seed, engine.config.vocab_size) for seed in range(2)]
    assert_mtp_on_equals_off(engine, prompts, 40, ks=(k,))


def test_a_scale_of_the_wrong_shape_is_named(pair, tmp_path):
    import shutil
    fp8 = Path(shutil.copytree(pair[0], tmp_path / "bad"))
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.language_model.layers.0.mlp.down_proj.weight_scale_inv"
    held = load_file(str(fp8 / index[name]))
    held[name] = torch.ones(3, 3, dtype=torch.bfloat16)
    save_file(held, str(fp8 / index[name]), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"down_proj.weight_scale_inv has shape \[3, 3\], expected \[2, 3\]"):
        Engine.load(fp8)


def test_the_memory_plan_knows_the_weight_format(pair):
    fp8, _ = pair
    engine = Engine.load(fp8, max_context=300, weights="fp8")
    plan = memory.plan_memory(engine.config, 300, 4, "float32", weights="fp8")
    assert plan.weights == engine.memory()["weights"] and plan.weight_format == "fp8"
    assert plan.weights == memory.plan_memory(engine.config, 300, 4, "float32").weights   # the checkpoint says FP8
    assert plan.weights < memory.plan_memory(engine.config, 300, 4, "float32", weights="bf16").weights


def test_products_the_checkpoint_keeps_in_bf16_stay_so(tmp_path):
    # an FP8 release that leaves the MTP layer unconverted: it loads as stored, not quantized here
    full = write_tiny_checkpoint(tmp_path / "fp8", fp8=True, **ALIGNED)
    twin = write_dequantized_twin(full, tmp_path / "bf16")
    index = json.loads((full / "model.safetensors.index.json").read_text())
    scales = [n for n in index["weight_map"] if n.startswith("mtp.") and n.endswith("_scale_inv")]
    weights = {n.removesuffix("_scale_inv") for n in scales}
    for shard in sorted(set(index["weight_map"].values())):
        held, plain = load_file(str(full / shard)), load_file(str(twin / shard))
        held = {n: plain[n] if n in weights else t for n, t in held.items() if n not in scales}
        save_file(held, str(full / shard), metadata={"format": "pt"})
    for name in scales:
        del index["weight_map"][name]
    (full / "model.safetensors.index.json").write_text(json.dumps(index))
    engine = Engine.load(full, weights="fp8")
    assert fp8_params(engine) and not any(p.dtype == torch.float8_e4m3fn for p in engine.head.parameters())
    ids = random_ids(60, 4, engine.config.vocab_size)
    ref = Engine.load(twin)
    # the layers multiply block-scaled FP8 (a float32 rounding apart from the dequantized twin)
    assert rel_err(engine.logits(ids), ref.logits(ids)) < 1e-4
    params = SamplingParams(max_tokens=24, stop_token_ids=())
    assert list(engine.generate(ids, params))[-1].token_ids == list(ref.generate(ids, params))[-1].token_ids
