"""Loading official-layout checkpoints, and every way a checkpoint can be bad."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpchat.engine import Engine, weights
from mtpchat.engine.config import ConfigError, Int4Format, ModelConfig
from mtpchat.kernels import fp8, int4
from tools.tiny import write_tiny_checkpoint
from mtpchat.engine.weights import WeightsError, mtp_places, text_places


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("pristine"), num_hidden_layers=4, seed=3)


@pytest.fixture
def ckpt(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "ckpt")


def shard_of(folder, name):
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_official_layout_loads_and_skips_vision(ckpt):
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("model.visual.") for n in weight_map)
    assert sum(n.startswith("mtp.") for n in weight_map) == 15
    engine = Engine.load(ckpt)
    assert engine.mtp_available and engine.head is not None
    gate = load_file(shard_of(ckpt, "model.language_model.layers.0.mlp.up_proj.weight"))
    up = gate["model.language_model.layers.0.mlp.up_proj.weight"]
    # fused [gate | up]: the up rows sit after the gate rows
    assert torch.equal(engine.model.layers[0].mlp.gate_up[up.shape[0]:], up)


def test_flat_config_is_accepted(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    flat = {**raw["text_config"], "model_type": "qwen3_5_text"}
    assert ModelConfig.from_dict(flat) == ModelConfig.from_dict(raw)


def test_single_file_checkpoint(ckpt):
    tensors = {}
    for shard in sorted(ckpt.glob("model-*.safetensors")):
        tensors |= load_file(shard)
        shard.unlink()
    (ckpt / "model.safetensors.index.json").unlink()
    save_file(tensors, ckpt / "model.safetensors")
    assert Engine.load(ckpt).logits([1, 2, 3]).shape[0] == 3


def test_unknown_model_type_names_what_is_supported(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["model_type"], raw["text_config"]["model_type"] = "llama", "llama"
    raw["architectures"] = ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"model_type 'llama' \(architectures: LlamaForCausalLM\) is not supported.*qwen3_5"):
        Engine.load(ckpt)


def test_missing_and_broken_config(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="no config.json in"):
        Engine.load(tmp_path)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        Engine.load(ckpt)


def test_missing_required_field(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["text_config"]["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="missing required field.*hidden_size"):
        Engine.load(ckpt)


def test_missing_shard_names_the_file(ckpt):
    shard = shard_of(ckpt, "model.language_model.norm.weight")
    shard.unlink()
    with pytest.raises(WeightsError, match=f"shard {shard.name} is missing.*incomplete"):
        Engine.load(ckpt)


def test_truncated_shard_names_the_file(ckpt):
    shard = shard_of(ckpt, "model.language_model.norm.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=f"{shard.name}.*truncated or corrupt"):
        Engine.load(ckpt)


def test_missing_tensor_is_named(ckpt):
    name = "model.language_model.layers.1.linear_attn.in_proj_z.weight"
    index = ckpt / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    del raw["weight_map"][name]
    index.write_text(json.dumps(raw))
    with pytest.raises(WeightsError, match=f"tensor {name} not found"):
        Engine.load(ckpt)


def test_tensor_listed_but_absent_from_shard(ckpt):
    name = "model.language_model.layers.1.linear_attn.in_proj_z.weight"
    shard = shard_of(ckpt, name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    with pytest.raises(WeightsError, match=f"{shard.name}: tensor {name} is listed in the index but not in the shard"):
        Engine.load(ckpt)


def test_wrong_shape_names_tensor_and_both_shapes(ckpt):
    name = "model.language_model.layers.3.self_attn.k_proj.weight"
    shard = shard_of(ckpt, name)
    tensors = load_file(shard)
    good = list(tensors[name].shape)
    tensors[name] = torch.randn(good[0] + 1, good[1])
    save_file(tensors, shard)
    with pytest.raises(WeightsError, match=rf"tensor {name} has shape \[{good[0] + 1}, {good[1]}\], "
                                           rf"expected \[{good[0]}, {good[1]}\]"):
        Engine.load(ckpt)


def test_checkpoint_without_mtp_runs_with_mtp_off(tmp_path):
    path = write_tiny_checkpoint(tmp_path, mtp=False)
    engine = Engine.load(path)
    assert not engine.mtp_available and not engine.mtp
    assert any("no mtp.* weights" in n for n in engine.notices)


def test_place_tables_cover_the_27b_checkpoint():
    c = ModelConfig.load(Path(__file__).resolve().parents[1] / "engine/configs/qwen3.6-27b.json")
    text, mtp = text_places(c), mtp_places(c)
    assert len(text) == 851 and len(mtp) == 15                       # qwen35-model.md §5
    count = lambda places: sum(torch.Size(p.shape).numel() for p in places.values())
    assert count(text) == 26_895_998_464 and count(mtp) == 424_699_392   # §9


@pytest.mark.parametrize("fmt", ["int4", "fp8", torch.bfloat16])
def test_random_weights_drawn_in_slabs_equal_the_whole_drawn_alike(fmt, monkeypatch):
    # --random-weights draws a big matrix a slab of rows at a time (so a 4-bit load's peak stays
    # near its weights); stored in slabs, it must be what the same draws quantize to whole
    monkeypatch.setattr(weights, "RANDOM_ROWS_AT_ONCE", 128 * 256)        # slabs of 128 rows: 3 of 300
    name, shape, fmt4 = "model.layers.0.mlp.down_proj.weight", (300, 256), Int4Format("rtn", group=64)
    slabs = weights._random_matrix(name, shape, torch.Generator().manual_seed(5), fmt, fmt4)
    dense = weights._random_matrix(name, shape, torch.Generator().manual_seed(5), torch.float32, fmt4)
    assert dense.std() > 0.03 and not torch.equal(dense[:128], dense[128:256])
    if fmt == "int4":
        whole = int4.quantize_ref(dense, 64, True)
        assert slabs.w.shape == (300, 32) and slabs.scale.shape == (300, 4) and slabs.zero is None
        assert torch.equal(slabs.w, whole.w) and torch.equal(slabs.scale, whole.scale)
    elif fmt == "fp8":
        whole = fp8.quantize_ref(dense)
        assert slabs.scale.shape == (3, 2)
        assert torch.equal(slabs.w.view(torch.uint8), whole.w.view(torch.uint8)) and torch.equal(slabs.scale, whole.scale)
    else:
        assert slabs.dtype == torch.bfloat16 and torch.equal(slabs, dense.to(torch.bfloat16))
