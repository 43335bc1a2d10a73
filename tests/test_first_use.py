"""What a new user meets first, through `mtpchat run` as typed: a model with a short context started
with no flags, and checkpoints this build cannot read (a quantization method, tensors with no place)
refused in one line with exit status 2, never loaded as garbage."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpchat import cli, loader
from mtpchat.engine import Engine, memory
from mtpchat.engine.config import ModelConfig, UnsupportedFormat
from tools.tiny import write_tiny_checkpoint
from helpers import isolated  # noqa: F401  (autouse: a settings file and a hub cache of the test's own)

CONFIGS = Path(__file__).resolve().parents[1] / "engine" / "configs"
GiB = 2 ** 30


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A small fine-tune's shape: the tiny model with a 4,096-token position limit."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("short") / "short", max_position_embeddings=4096)


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# ---- the context when none is asked for -----------------------------------------------------------

def test_no_flags_on_a_model_with_a_short_context(capsys, short):
    code, out, err = run(capsys, "run", "--model", short, "--prompt", "hi", "--max-tokens", "4", "--json")
    assert code == 0, err
    assert err.count(f"context: 4,096 tokens, the most {short} supports") == 1
    assert json.loads(out)["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("kind", ["moe stacked", "moe per expert, fp8", "odd vocab"])
def test_no_flags_on_other_checkpoints(capsys, tmp_path, kind):
    # the defaults (draft vocabulary, adaptive k, snapshots, context) on an MoE in either layout, an
    # FP8 release (dequantized on the CPU), and a vocabulary of no round size
    shapes = {"moe stacked": dict(moe=True), "moe per expert, fp8": dict(moe=True, experts="per-expert", fp8=True),
              "odd vocab": dict(vocab_size=331, tokenizer_vocab=300)}
    folder = write_tiny_checkpoint(tmp_path / "m", **shapes[kind], **(dict(
        hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        moe_intermediate_size=128, shared_expert_intermediate_size=128) if "fp8" in kind else {}))
    code, out, err = run(capsys, "run", "--model", folder, "--prompt", "hi", "--max-tokens", "12", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["finish_reason"] in ("stop", "length") and result["mtp"] and result["stats"]["new_tokens"] > 0


def test_the_plan_of_a_short_model_uses_its_context(capsys, short):
    code, out, _ = run(capsys, "run", "--model", short, "--dry-run")
    assert code == 0 and "context 4,096 tokens" in out


@pytest.mark.parametrize("where", ["flag", "file"])
def test_a_context_the_user_asked_for_is_still_refused(capsys, short, tmp_path, where):
    extra = ["--max-context", "8192"] if where == "flag" else []
    if where == "file":
        (tmp_path / "settings.toml").write_text("max_context = 8192\n")
    code, _, err = run(capsys, "run", "--model", short, "--prompt", "hi", *extra)
    said = "--max-context 8192" if where == "flag" else f"max_context = 8192 in {tmp_path / 'settings.toml'}"
    assert code == 1 and f"{said} is longer than {short} supports (4,096 tokens)" in err


def test_the_default_context_shrinks_to_what_fits(capsys, tmp_path, monkeypatch):
    # the 27B's plan in bf16 on a GPU whose free memory holds its weights but not 8K of context
    folder = tmp_path / "big"
    folder.mkdir()
    shutil.copy(CONFIGS / "qwen3.6-27b.json", folder / "config.json")
    cfg = ModelConfig.load(folder)
    # on a GPU, whose kernel plan keeps the trimmed draft head's rows in 4 bits
    free = memory.plan_memory(cfg, 5 * 1024, memory.K_MAX, "bfloat16", draft_int4=True).needed + 1
    assert not memory.plan_memory(cfg, 8192, memory.K_MAX, "bfloat16", draft_int4=True).fits(free)
    monkeypatch.setattr(loader, "pick_device", lambda requested, said=None: ("cuda", False))
    monkeypatch.setattr(loader, "device_memory", lambda device: (free, 80 * GiB))
    monkeypatch.setattr(loader.models, "resolve", lambda spec, **kw: type("R", (), dict(
        name="big", path=folder, has_mtp=True))())
    code, out, err = run(capsys, "--model", folder, "--dry-run")         # the app's plan (with turn snapshots)
    assert code == 0 and "context 5,120 tokens" in out and "fits" in out
    assert "context: 5,120 tokens, what fits in the" in err


def test_the_engine_defaults_to_what_the_model_supports(short):
    engine = Engine.load(short)
    assert engine.max_context == 4096
    with pytest.raises(ValueError, match="max_context 8,192 is longer than this model supports"):
        Engine.load(short, max_context=8192)


# ---- checkpoints this build cannot read -----------------------------------------------------------

def _edit_config(folder: Path, **top):
    config = json.loads((folder / "config.json").read_text())
    config.update(top)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("quant", [
    {"quant_method": "awq", "bits": 4, "group_size": 128},
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
])
def test_a_quantization_config_is_refused_by_name(capsys, copy, quant):
    _edit_config(copy, quantization_config=quant)
    code, _, err = run(capsys, "run", "--model", copy, "--prompt", "x")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"quant_method '{quant['quant_method']}' is not supported" in lines[0]
    assert "use the GPTQ Int4, FP8 or unquantized (bf16) release" in lines[0]


@pytest.mark.parametrize("change, message", [
    ({"fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
    ({"weight_block_size": [64, 64]}, "FP8 weight_block_size [64, 64] is not supported"),
    ({"activation_scheme": "static"}, "FP8 activation_scheme 'static' is not supported"),
])
def test_fp8_forms_other_than_the_official_one_are_refused(capsys, copy, change, message):
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    _edit_config(copy, quantization_config=quant | change)
    code, _, err = run(capsys, "run", "--model", copy, "--prompt", "x")
    assert code == 2 and message in err


def test_a_quantization_config_inside_text_config_is_refused(copy):
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["quantization_config"] = {"quant_method": "bitsandbytes"}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedFormat, match="'bitsandbytes' is not supported"):
        ModelConfig.load(copy)


def _add_tensors(folder: Path, tensors: dict):
    """Put extra tensors into the first shard and the index, as a quantized or foreign export would."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    held = load_file(str(folder / shard)) | tensors
    save_file(held, str(folder / shard), metadata={"format": "pt"})
    index["weight_map"] |= {name: shard for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_tensors_with_no_place_are_refused(capsys, copy):
    # the block scales of an FP8 export whose config lost its quantization_config
    g = torch.Generator().manual_seed(0)
    scales = {f"model.language_model.layers.{i}.mlp.down_proj.weight_scale_inv": torch.rand(1, 1, generator=g)
              for i in range(4)}
    _add_tensors(copy, scales)
    code, _, err = run(capsys, "run", "--model", copy, "--device", "cpu", "--prompt", "x")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert "4 tensor(s) have no place" in lines[0] and "layers.0.mlp.down_proj.weight_scale_inv" in lines[0]
    assert "(and 1 more)" in lines[0]


def test_a_float8_weight_without_its_config_is_refused(capsys, copy):
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    shard = index["weight_map"][name]
    held = load_file(str(copy / shard))
    held[name] = held[name].to(torch.float8_e4m3fn)
    save_file(held, str(copy / shard), metadata={"format": "pt"})
    code, _, err = run(capsys, "run", "--model", copy, "--prompt", "x")
    assert code == 2 and f"tensor {name} is stored as FP8 (F8_E4M3) but config.json has no quantization_config" in err


def test_known_extra_tensors_still_load(tmp_path):
    # the vision tower is skipped; a tied checkpoint may carry its embedding again as lm_head.weight;
    # the draft head's tensors are left when the config has no MTP layer
    tied = write_tiny_checkpoint(tmp_path / "tied", tie=True)
    embed = load_file(str(tied / json.loads((tied / "model.safetensors.index.json").read_text())
                          ["weight_map"]["model.language_model.embed_tokens.weight"]))
    _add_tensors(tied, {"lm_head.weight": embed["model.language_model.embed_tokens.weight"].clone()})
    Engine.load(tied)
    no_head = write_tiny_checkpoint(tmp_path / "no-head", mtp_num_hidden_layers=0)   # its mtp.* stay
    assert any(n.startswith("mtp.") for n in json.loads((no_head / "model.safetensors.index.json").read_text())
               ["weight_map"])
    assert Engine.load(no_head).mtp_available is False


def test_not_enough_memory_names_the_fp8_release(capsys, monkeypatch):
    # an alias with an FP8 release: the plan that would fit is that release
    monkeypatch.setattr(loader, "pick_device", lambda requested, said=None: ("cuda", False))
    monkeypatch.setattr(loader, "device_memory", lambda device: (40 * GiB, 80 * GiB))
    code, out, _ = run(capsys, "run", "--model", "Qwen3.6-27B-MTP", "--dry-run")
    assert code == 1 and "what fits: --model Qwen3.6-27B-FP8, or --model Qwen3.5-9B" in out
    code, out, _ = run(capsys, "run", "--model", "Qwen3.6-27B-FP8", "--dry-run")
    assert code == 0 and "weights (FP8)" in out and "FP8 weights" in out and "fits" in out


def test_fp8_where_it_cannot_run(capsys, tmp_path, monkeypatch):
    fp8 = write_tiny_checkpoint(tmp_path / "fp8", fp8=True)
    # asked for on the CPU: refused in one line; left to the checkpoint: dequantized, with a notice
    code, _, err = run(capsys, "run", "--model", fp8, "--device", "cpu", "--weights", "fp8", "--prompt", "x")
    assert code == 2 and "--weights fp8: FP8 weights run on Ada or Hopper GPUs, not on the CPU" in err
    code, out, err = run(capsys, "run", "--model", fp8, "--device", "cpu", "--prompt", "x", "--max-tokens", "3",
                         "--json")
    assert code == 0 and "stores FP8 weights, which this device cannot multiply" in err
    # an Ampere GPU: the plan suggests 4 bits or a smaller model, never FP8
    monkeypatch.setattr(loader, "pick_device", lambda requested, said=None: ("cuda", False))
    monkeypatch.setattr(loader, "device_memory", lambda device: (40 * GiB, 80 * GiB))
    monkeypatch.setattr(loader, "fp8_capable", lambda device: False)
    code, out, _ = run(capsys, "run", "--model", "Qwen3.6-27B-MTP", "--dry-run")
    assert code == 1 and "what fits: --weights int4, or --model Qwen3.5-9B" in out
    assert "fp8" not in out.lower().split("what fits")[1]


def test_bench_on_a_model_with_a_short_context(capsys, short):
    code, out, err = run(capsys, "bench", "--model", short, "--device", "cpu", "--tokens", "6", "--context", "24",
                         "--exactness-tokens", "6", "--policy-tokens", "6", "--policy-repeats", "1", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert set(result["ttft_ms"]) == {"512"} and result["second_turn"]["second_reused"] == 512
    assert result["kernel_plan"]["fc_split"] and result["kernel_plan"]["products"]["programs"] == 6
