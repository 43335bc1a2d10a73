"""Checkpoint loading: every quirk of the official layout lives here.

The official checkpoints are sharded safetensors found through model.safetensors.index.json (or one
model.safetensors). Text weights sit under `model.language_model.`, the head at `lm_head.weight`
(absent when tied to the embedding), the draft head under `mtp.`; `model.visual.*` is skipped.
Separate projections are fused into one matrix per layer as they are read: GDN [qkv | z | b | a],
attention [q | k | v], MLP [gate | up]. Each tensor goes straight to its place on the target
device, one at a time, so the host never holds a copy of the model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mtpchat.engine.config import ModelConfig, UnsupportedFormat

TEXT_PREFIX = "model.language_model."
MTP_PREFIX = "mtp."
SKIP_PREFIXES = ("model.visual.",)


class WeightsError(ValueError):
    """The checkpoint's tensors are missing, truncated or of the wrong shape."""


FLOAT_DTYPES = ("F32", "F16", "BF16")     # safetensors' names of the dtypes a weight may have on disk


@dataclass(frozen=True)
class Place:
    param: str              # our parameter, e.g. "layers.3.mixer.qkv"
    offset: int             # first row of this tensor inside the (fused) parameter
    shape: tuple[int, ...]  # the shape in the checkpoint


def _layer_places(c: ModelConfig, src: str, dst: str, kind: str) -> dict[str, Place]:
    H, I = c.hidden_size, c.intermediate_size
    p = {
        f"{src}.input_layernorm.weight": Place(f"{dst}.input_norm.weight", 0, (H,)),
        f"{src}.post_attention_layernorm.weight": Place(f"{dst}.post_norm.weight", 0, (H,)),
        f"{src}.mlp.gate_proj.weight": Place(f"{dst}.mlp.gate_up", 0, (I, H)),
        f"{src}.mlp.up_proj.weight": Place(f"{dst}.mlp.gate_up", I, (I, H)),
        f"{src}.mlp.down_proj.weight": Place(f"{dst}.mlp.down", 0, (H, I)),
    }
    if kind == "full_attention":
        a, m = f"{src}.self_attn", f"{dst}.mixer"
        p |= {
            f"{a}.q_proj.weight": Place(f"{m}.qkv", 0, (2 * c.q_dim, H)),
            f"{a}.k_proj.weight": Place(f"{m}.qkv", 2 * c.q_dim, (c.kv_dim, H)),
            f"{a}.v_proj.weight": Place(f"{m}.qkv", 2 * c.q_dim + c.kv_dim, (c.kv_dim, H)),
            f"{a}.o_proj.weight": Place(f"{m}.o_proj", 0, (H, c.q_dim)),
            f"{a}.q_norm.weight": Place(f"{m}.q_norm.weight", 0, (c.head_dim,)),
            f"{a}.k_norm.weight": Place(f"{m}.k_norm.weight", 0, (c.head_dim,)),
        }
    else:
        g, m, hv = f"{src}.linear_attn", f"{dst}.mixer", c.linear_num_value_heads
        p |= {
            f"{g}.in_proj_qkv.weight": Place(f"{m}.in_proj", 0, (c.conv_dim, H)),
            f"{g}.in_proj_z.weight": Place(f"{m}.in_proj", c.conv_dim, (c.value_dim, H)),
            f"{g}.in_proj_b.weight": Place(f"{m}.in_proj", c.conv_dim + c.value_dim, (hv, H)),
            f"{g}.in_proj_a.weight": Place(f"{m}.in_proj", c.conv_dim + c.value_dim + hv, (hv, H)),
            f"{g}.conv1d.weight": Place(f"{m}.conv_weight", 0, (c.conv_dim, 1, c.linear_conv_kernel_dim)),
            f"{g}.A_log": Place(f"{m}.A_log", 0, (hv,)),
            f"{g}.dt_bias": Place(f"{m}.dt_bias", 0, (hv,)),
            f"{g}.norm.weight": Place(f"{m}.norm_weight", 0, (c.linear_value_head_dim,)),
            f"{g}.out_proj.weight": Place(f"{m}.out_proj", 0, (H, c.value_dim)),
        }
    return p


def text_places(c: ModelConfig) -> dict[str, Place]:
    """Checkpoint name -> where it goes in engine/model.py's Model."""
    H, V = c.hidden_size, c.vocab_size
    p = {f"{TEXT_PREFIX}embed_tokens.weight": Place("embed", 0, (V, H)),
         f"{TEXT_PREFIX}norm.weight": Place("norm.weight", 0, (H,))}
    for i, kind in enumerate(c.layer_types):
        p |= _layer_places(c, f"{TEXT_PREFIX}layers.{i}", f"layers.{i}", kind)
    if not c.tie_word_embeddings:
        p["lm_head.weight"] = Place("lm_head", 0, (V, H))
    return p


def mtp_places(c: ModelConfig) -> dict[str, Place]:
    """Checkpoint name -> where it goes in engine/mtp.py's MTPHead (the 15 `mtp.*` tensors)."""
    H = c.hidden_size
    p = {"mtp.fc.weight": Place("fc", 0, (H, 2 * H)),
         "mtp.pre_fc_norm_embedding.weight": Place("pre_fc_norm_embedding.weight", 0, (H,)),
         "mtp.pre_fc_norm_hidden.weight": Place("pre_fc_norm_hidden.weight", 0, (H,)),
         "mtp.norm.weight": Place("norm.weight", 0, (H,))}
    return p | _layer_places(c, "mtp.layers.0", "layer", "full_attention")


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            return json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index ({e}); re-download the checkpoint") from None
    single = folder / "model.safetensors"
    if single.exists():
        with _open(single) as f:
            return {name: single.name for name in f.keys()}
    raise WeightsError(f"no model.safetensors.index.json or model.safetensors in {folder}")


def _open(path: Path):
    from safetensors import safe_open
    if not path.exists():
        raise WeightsError(f"shard {path.name} is missing from {path.parent}; the download is incomplete")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise WeightsError(f"shard {path} cannot be read ({e}); it is truncated or corrupt: "
                           "delete it and download again") from None


def has_mtp_weights(folder: str | Path) -> bool:
    return any(name.startswith(MTP_PREFIX) for name in _weight_map(Path(folder)))


# Small per-channel parameters kept in float32 whatever the model dtype (the reference upcasts them).
FLOAT32_PARAMS = ("A_log", "dt_bias")


def load_into(modules: dict[str, nn.Module], places: dict[str, dict[str, Place]], folder: str | Path,
              device, dtype):
    """Fill each module's parameters from the checkpoint. `places[key]` maps checkpoint names to
    parameters of `modules[key]`. Every parameter is allocated on `device` first; each tensor is
    then read, checked and copied into its rows."""
    folder = Path(folder)
    weight_map = _weight_map(folder)
    params: dict[tuple[str, str], torch.Tensor] = {}
    for key, module in modules.items():
        for name, p in module.named_parameters():
            dt = torch.float32 if name.endswith(FLOAT32_PARAMS) else dtype
            params[key, name] = torch.empty(p.shape, device=device, dtype=dt)
    wanted = {name: (key, place) for key, table in places.items() for name, place in table.items()}
    missing = sorted(set(wanted) - set(weight_map))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{folder}: tensor {', '.join(missing[:3])}{more} not found in the checkpoint; "
                           "it is incomplete or of another architecture")
    _refuse_unused(folder, weight_map, wanted, places)
    by_shard: dict[str, list[str]] = {}
    for name in wanted:
        by_shard.setdefault(weight_map[name], []).append(name)
    for shard, names in sorted(by_shard.items()):
        with _open(folder / shard) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise WeightsError(f"{shard}: tensor {name} is listed in the index but not in the shard; "
                                       "the shard is corrupt or from another download")
                key, place = wanted[name]
                info = f.get_slice(name)
                shape, stored = tuple(info.get_shape()), info.get_dtype()
                if stored not in FLOAT_DTYPES:
                    raise UnsupportedFormat(f"{shard}: tensor {name} is stored as {stored}, not a float type "
                                            f"({', '.join(FLOAT_DTYPES)}); quantized weights need their "
                                            "quantization_config, which this checkpoint's config.json lacks")
                if shape != place.shape:
                    raise WeightsError(f"{shard}: tensor {name} has shape {list(shape)}, expected "
                                       f"{list(place.shape)} from config.json")
                dest = params[key, place.param]
                t = f.get_tensor(name).reshape(-1, *dest.shape[1:]) if dest.dim() > 1 else f.get_tensor(name)
                dest[place.offset:place.offset + t.shape[0]].copy_(t)
    for (key, name), tensor in params.items():
        _assign(modules[key], name, tensor)


def _refuse_unused(folder: Path, weight_map: dict[str, str], wanted: dict, places: dict):
    """Every tensor of the checkpoint must have a place, or be one we know to leave: the vision
    tower, the draft head when it is not loaded, a tied checkpoint's copy of the embedding as
    `lm_head.weight`. Anything else (block scales of a quantized checkpoint, layers of another
    architecture) means the checkpoint is not what config.json says: refused, never dropped."""
    known = [*SKIP_PREFIXES, *(() if "mtp" in places else (MTP_PREFIX,))]
    if "lm_head.weight" not in wanted:
        known.append("lm_head.weight")
    unused = sorted(n for n in weight_map if n not in wanted and not n.startswith(tuple(known)))
    if unused:
        more = f" (and {len(unused) - 3} more)" if len(unused) > 3 else ""
        raise UnsupportedFormat(f"{folder}: {len(unused)} tensor(s) have no place in a Qwen3.5/3.6 model as "
                                f"config.json describes it: {', '.join(unused[:3])}{more}; the checkpoint is "
                                "quantized or of another architecture")


def fill_random(modules: dict[str, nn.Module], places: dict[str, dict[str, Place]], device, dtype, seed: int):
    """Random weights of the checkpoint's shapes drawn on the device (benchmarks at real sizes)."""
    from mtpchat.engine.tiny import random_tensor
    g = torch.Generator(device=device).manual_seed(seed)
    for key, module in modules.items():
        names = {place.param: name for name, place in places[key].items()}   # a representative name
        for pname, p in list(module.named_parameters()):
            dt = torch.float32 if pname.endswith(FLOAT32_PARAMS) else dtype
            shape = tuple(p.shape) if p.dim() != 2 or "conv" not in pname else (p.shape[0], 1, p.shape[1])
            t = random_tensor(names[pname], shape, g).reshape(p.shape).to(dt)
            _assign(module, pname, t)


def _assign(module: nn.Module, name: str, tensor: torch.Tensor):
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))
