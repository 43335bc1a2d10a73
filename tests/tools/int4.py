"""Tiny 4-bit checkpoints in the layouts GPTQ (GPTQModel, the official Qwen "GPTQ-Int4" releases)
and compressed-tensors (`pack-quantized` W4A16) write, each beside its float32 twin: the same
checkpoint with every 4-bit module's weight replaced by exactly its dequantized value and no
quantization_config, the model transformers reads as the oracle.

The 4-bit values are chosen by round to nearest here (kernels/int4.quantize_ref, on the columns in
the order the format's g_idx gives): a test needs the layout, not GPTQ's error feedback.
"""
from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtpchat.kernels.fp8 import BlockFP8, dequantize_ref as fp8_dequantize
from mtpchat.kernels.int4 import GroupInt4, dequantize_ref, pack_ref, quantize_ref, unpack_ref
from mtpchat.engine.weights import PER_EXPERT, STACKED
from tools.tiny import write_tiny_checkpoint

# every linear module of a decoder layer (and of the MTP layer), and the MTP head's fc, by the checkpoint's names
LINEAR = re.compile(r".*\.((q|k|v|o|gate|up|down)_proj|in_proj_(qkv|z|b|a)|out_proj)$|^mtp\.fc$")
# the official releases' dynamic map: attention (GDN and full), the shared expert, the MTP layer
# and the vision tower stay bf16
OFFICIAL_DYNAMIC = {"-:.*attn.*": {}, "-:.*shared_expert.*": {}, "-:.*mtp.*": {}, "-:.*visual.*": {}}
# what --weights int4 leaves in the model dtype (config.RTN_SKIP), as compressed-tensors' ignore
RTN_IGNORE = ["re:.*\\.linear_attn\\.in_proj_[ab]$", "re:.*\\.mlp\\.gate$", "re:.*shared_expert_gate$",
              "lm_head", "re:model\\.visual\\..*"]
# every fused product's parts on whole 128-column groups (the tiny shapes' K of 64 are not)
ALIGNED = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
ALIGNED_MOE = {k: v for k, v in ALIGNED.items() if k != "intermediate_size"} | dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)


def input_key(module: str) -> str:
    """Modules that read one input share a column order in a desc_act checkpoint (GPTQ orders the
    columns by that input's statistics): q|k|v, gate|up, the GDN's in_proj parts."""
    parent, leaf = module.rsplit(".", 1)
    kind = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    return parent + "/" + ("in" if leaf.startswith("in_proj_") else kind.get(leaf, leaf))


def column_groups(module: str, K: int, group: int, desc_act: bool, mixed: bool) -> torch.Tensor:
    """g_idx [K] int32: in order, or (desc_act) the groups of a column order seeded by the module's
    input (`mixed`: by the module itself, so the parts of a fused product disagree)."""
    if not desc_act:
        return (torch.arange(K) // group).to(torch.int32)
    key = module if mixed else input_key(module)
    order = torch.randperm(K, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // group).to(torch.int32)      # the j-th column quantized falls in group j // G
    return g_idx


def quantize(w: torch.Tensor, g_idx: torch.Tensor, group: int, symmetric: bool, scale_dtype) -> tuple:
    """-> (q [N, K] in the checkpoint's column order, scale [N, K/G], zero [N, K/G] (8 where
    symmetric), the dequantized weight [N, K])."""
    perm = torch.sort(g_idx.long(), stable=True).indices
    ours = quantize_ref(w.float()[:, perm], group, symmetric, scale_dtype)      # columns sorted by group
    q = torch.empty_like(unpack_ref(ours.w))
    q[:, perm] = unpack_ref(ours.w)
    zero = ours.zero if ours.zero is not None else torch.full_like(ours.scale, 8, dtype=torch.uint8)
    dense = dequantize_ref(GroupInt4(ours.w, ours.scale, ours.zero, perm.to(torch.int32)))
    return q, ours.scale, zero, dense


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[N, M] nibbles -> [ceil(N / 8), M] int32, row n in word n // 8 (padded with zeros)."""
    N = values.shape[0]
    padded = torch.zeros(-(-N // 8) * 8, values.shape[1], dtype=torch.int32)
    padded[:N] = values.to(torch.int32)
    return pack_ref(padded.t().contiguous()).t().contiguous()


def gptq_tensors(module: str, w: torch.Tensor, group: int, symmetric: bool, desc_act: bool, mixed: bool,
                 v2: bool) -> tuple[dict, torch.Tensor]:
    g_idx = column_groups(module, w.shape[1], group, desc_act, mixed)
    q, scale, zero, dense = quantize(w, g_idx, group, symmetric, torch.float16)
    stored = (zero.to(torch.int32) - (0 if v2 else 1)) & 0xF         # v1: zero - 1 (a zero of 0 wraps to 15)
    return {f"{module}.qweight": pack_ref(q).t().contiguous(),               # [K / 8, N]
            f"{module}.qzeros": pack_rows(stored).t().contiguous(),    # [K / G, N / 8]
            f"{module}.scales": scale.t().contiguous(), f"{module}.g_idx": g_idx}, dense


def compressed_tensors(module: str, w: torch.Tensor, group: int, symmetric: bool, desc_act: bool, mixed: bool,
                       scale_dtype=torch.bfloat16) -> tuple[dict, torch.Tensor]:
    N, K = w.shape
    g_idx = column_groups(module, K, group, desc_act, mixed)
    q, scale, zero, dense = quantize(w, g_idx, group, symmetric, scale_dtype)
    out = {f"{module}.weight_packed": pack_ref(q), f"{module}.weight_scale": scale,
           f"{module}.weight_shape": torch.tensor([N, K], dtype=torch.int64)}
    if not symmetric:
        out[f"{module}.weight_zero_point"] = pack_rows(zero)
    if desc_act:
        out[f"{module}.weight_g_idx"] = g_idx
    return out, dense


def convert(src: Path, folder: Path, twin: Path | None, quantized, encode, quantization_config: dict) -> Path:
    """Copy checkpoint `src` to `folder` with each module `quantized(module)` picks (of LINEAR)
    stored as `encode(module, w)` gives, and (if `twin`) to `twin` with its dequantized weight.
    FP8 tensors are dequantized to float32 first."""
    shutil.copytree(src, folder)
    if twin is not None:
        shutil.copytree(src, twin)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    scales = {n: t for shard in shards for n, t in load_file(str(src / shard)).items() if n.endswith("_scale_inv")}
    for shard in shards:
        held = load_file(str(src / shard))
        out, plain = {}, {}
        for name, t in held.items():
            if name.endswith("_scale_inv"):
                continue
            if name + "_scale_inv" in scales:
                t = fp8_dequantize(BlockFP8(t, scales[name + "_scale_inv"].float()))
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and LINEAR.match(module) and quantized(module):
                tensors, dense = encode(module, t)
                out |= tensors
                plain[name] = dense
            else:
                out[name] = plain[name] = t
        save_file(out, str(folder / shard), metadata={"format": "pt"})
        if twin is not None:
            save_file(plain, str(twin / shard), metadata={"format": "pt"})
        for name in held:
            del index["weight_map"][name]
        index["weight_map"] |= {name: shard for name in out}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if twin is not None:
        (twin / "config.json").write_text(json.dumps(config, indent=2))
        plain_index = json.loads((src / "model.safetensors.index.json").read_text())
        plain_index["weight_map"] = {n: f for n, f in plain_index["weight_map"].items() if not n.endswith("_scale_inv")}
        (twin / "model.safetensors.index.json").write_text(json.dumps(plain_index, indent=2))
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _float_source(root: Path, moe: bool, seed: int, shape: dict) -> Path:
    src = root / "float"
    if not src.exists():
        write_tiny_checkpoint(src, moe=moe, experts=PER_EXPERT if moe else STACKED, seed=seed,
                              **((ALIGNED_MOE if moe else ALIGNED) | shape))
    return src


def write_gptq_checkpoint(root: str | Path, *, desc_act: bool = False, mixed_orders: bool = False,
                          symmetric: bool = True, v2: bool = False, group: int = 128, dynamic: dict | None = None,
                          moe: bool = False, seed: int = 0, **shape) -> tuple[Path, Path]:
    """(GPTQ checkpoint, float32 twin) under `root`, laid out as the official releases are (v1 zeros,
    a dynamic map: OFFICIAL_DYNAMIC unless given; an MoE's experts per expert)."""
    root = Path(root)
    src = _float_source(root, moe, seed, shape)
    dynamic = OFFICIAL_DYNAMIC if dynamic is None else dynamic
    skip = [k[2:] for k in dynamic if k.startswith("-:")]
    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": symmetric, "desc_act": desc_act,
              "checkpoint_format": "gptq_v2" if v2 else "gptq", "dynamic": dynamic, "lm_head": False,
              "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
    encode = lambda module, w: gptq_tensors(module, w, group, symmetric, desc_act, mixed_orders, v2)
    keep = lambda module: not any(re.match(p, module) for p in skip)
    return convert(src, root / "gptq", root / "twin", keep, encode, config), root / "twin"


def compressed_config(group: int, symmetric: bool, ignore: list[str], actorder: str | None = None) -> dict:
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": symmetric,
               "dynamic": False, "actorder": actorder, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ignore, "kv_cache_scheme": None}


def _ignored(ignore: list[str], module: str) -> bool:
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in ignore)


def write_compressed_checkpoint(root: str | Path, *, symmetric: bool = True, desc_act: bool = False,
                                group: int = 128, ignore: list[str] | None = None, moe: bool = False,
                                seed: int = 0, **shape) -> tuple[Path, Path]:
    """(compressed-tensors pack-quantized checkpoint, float32 twin) under `root`: bf16 scales, zero
    points where asymmetric, every linear module in 4 bits but those `ignore`d (the MTP layer's too)."""
    root = Path(root)
    src = _float_source(root, moe, seed, shape)
    ignore = ["lm_head", "re:.*\\.mlp\\.gate$", "re:.*shared_expert_gate$", "mtp.fc", "re:model\\.visual\\..*"] \
        if ignore is None else ignore
    encode = lambda module, w: compressed_tensors(module, w, group, symmetric, desc_act, False)
    config = compressed_config(group, symmetric, ignore, "group" if desc_act else None)
    return (convert(src, root / "ct", root / "twin", lambda m: not _ignored(ignore, m), encode, config),
            root / "twin")


def write_rtn_checkpoint(src: str | Path, folder: str | Path) -> Path:
    """Checkpoint `src` (float or FP8) quantized offline as `--weights int4` quantizes on load:
    kernels/int4.quantize_ref (symmetric, groups of 128, float16 scales) on every product it
    quantizes (FP8 dequantized to float32 first), stored as compressed-tensors pack-quantized."""
    def encode(module, w):
        q = quantize_ref(w.float(), 128, True, torch.float16)
        N, K = w.shape
        return {f"{module}.weight_packed": q.w, f"{module}.weight_scale": q.scale,
                f"{module}.weight_shape": torch.tensor([N, K], dtype=torch.int64)}, None
    return convert(Path(src), Path(folder), None, lambda m: not _ignored(RTN_IGNORE, m), encode,
                   compressed_config(128, True, RTN_IGNORE))
