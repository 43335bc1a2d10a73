"""Tiny random checkpoints in the exact official layout, for the tests (nothing is downloaded).

The folder holds what a Qwen3.5 / Qwen3.6 repo holds: config.json (text settings under
`text_config`, architecture Qwen3_5ForConditionalGeneration), generation_config.json, sharded
safetensors with model.safetensors.index.json (text weights under `model.language_model.`,
`lm_head.weight` unless tied, a few `model.visual.*` tensors to skip, the 15 `mtp.*` tensors), and
a small byte-level BPE tokenizer with Qwen's special tokens and a ChatML template.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtpchat.engine.config import ModelConfig
from mtpchat.engine.weights import STACKED, mtp_places, random_tensor, text_places
from tools.bpe import default_corpus, train_tokenizer, write_tokenizer_files

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)

VISUAL = {"model.visual.patch_embed.proj.weight": (32, 3, 2, 16, 16),
          "model.visual.blocks.0.attn.qkv.weight": (96, 32),
          "model.visual.merger.linear_fc1.weight": (64, 128)}


# a tiny MoE's routing (write_tiny_checkpoint(moe=True)): 6 experts, 3 a token, narrower than the
# dense MLP, and a shared expert as wide as a routed one, as the real ones are
TINY_MOE = dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40, shared_expert_intermediate_size=40)


def text_config(vocab_size: int, tie: bool, mtp: bool, special: dict[str, int], moe: bool = False,
                **overrides) -> dict:
    shape = TINY | (TINY_MOE if moe else {}) | overrides
    if moe:
        shape.pop("intermediate_size", None)
    layers = shape["num_hidden_layers"]
    config = {**shape,
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text", "vocab_size": vocab_size, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "attention_bias": False, "attn_output_gate": True,
            "full_attention_interval": 4, "max_position_embeddings": 262144, "dtype": "float32",
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1 if mtp else 0,
            "mtp_use_dedicated_embeddings": False, "tie_word_embeddings": tie,
            "bos_token_id": special["<|endoftext|>"], "eos_token_id": special["<|endoftext|>"]}
    return config | overrides     # an override of any key wins (max_position_embeddings, say)


# the checkpoint tensors an official FP8 release stores in FP8 (qwen35-model.md; FP8 issue)
FP8_TENSORS = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight",
               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head", "model.visual", "mtp.fc"]}


def is_expert(name: str) -> bool:
    """A routed expert's own weight, stored per expert (FP8 releases hold them in FP8)."""
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def quantize_pow2(w: torch.Tensor):
    """FP8 with block scales rounded up to powers of two: its dequantized weights are exact in bf16
    (a 4-bit mantissa times a power of two), so a bf16 twin of the checkpoint is the same model."""
    from mtpchat.kernels.fp8 import BLOCK, FP8, FP8_MAX, BlockFP8, quantize_ref
    scale = torch.exp2(torch.ceil(torch.log2(quantize_ref(w).scale)))
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:w.shape[0], :w.shape[1]]
    return BlockFP8((w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale)


def write_tiny_checkpoint(folder: str | Path, *, tie: bool = False, mtp: bool = True, shards: int = 3,
                          seed: int = 0, vocab_size: int | None = None, tokenizer_vocab: int = 512,
                          dtype: torch.dtype = torch.float32, fp8: bool = False, moe: bool = False,
                          experts: str = STACKED, **shape) -> Path:
    """Write a random checkpoint to `folder`; `shape` overrides TINY's sizes or any other key of the
    text config. `fp8`: as the official FP8 releases are laid out (FP8_TENSORS in float8_e4m3fn
    with bf16 `_scale_inv` block scales, powers of two here; a quantization_config). `moe`: a
    Qwen3.5-MoE model (TINY_MOE's routing), its experts STACKED or PER_EXPERT. Returns the
    folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(default_corpus(), tokenizer_vocab)
    special = write_tokenizer_files(folder, tok)
    vocab = vocab_size or 64 * math.ceil(tok.get_vocab_size() / 64)   # padded, as the real ones are
    text = text_config(vocab, tie, mtp, special, moe, **shape)
    arch, kind = ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe") if moe else ("Qwen3_5ForConditionalGeneration", "qwen3_5")
    config = {"architectures": [arch], "model_type": kind,
              **({"quantization_config": FP8_CONFIG} if fp8 else {}), "tie_word_embeddings": tie, "text_config": text,
              "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32,
                                "out_hidden_size": text["hidden_size"]},
              "image_token_id": special["<|image_pad|>"], "video_token_id": special["<|video_pad|>"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
         "pad_token_id": special["<|endoftext|>"], "do_sample": True, "temperature": 0.6,
         "top_k": 20, "top_p": 0.95}, indent=2))

    c = ModelConfig.from_dict(config)
    shapes = {name: place.shape for name, place in text_places(c, experts=experts).items()}
    if mtp:
        shapes |= {name: place.shape for name, place in mtp_places(c, experts).items()}
    shapes |= VISUAL
    g = torch.Generator().manual_seed(seed)
    tensors = {name: random_tensor(name, shape, g).to(dtype) for name, shape in shapes.items()}
    for name in [n for n in tensors if fp8 and (n.endswith(FP8_TENSORS) or is_expert(n))]:
        q = quantize_pow2(tensors[name])
        tensors[name], tensors[name + "_scale_inv"] = q.w, q.scale.to(torch.bfloat16)
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(folder / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
        total += sum(tensors[n].numel() * tensors[n].element_size() for n in part)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def write_dequantized_twin(fp8_folder: str | Path, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The same checkpoint with every FP8 tensor dequantized (to `dtype`) and no quantization_config:
    the model an FP8 checkpoint stands for, which transformers reads as the oracle."""
    import shutil
    from safetensors.torch import load_file
    from mtpchat.kernels.fp8 import BlockFP8, dequantize_ref
    fp8_folder, folder = Path(fp8_folder), Path(folder)
    shutil.copytree(fp8_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    scales = {n: t for shard in shards for n, t in load_file(str(folder / shard)).items() if n.endswith("_scale_inv")}
    for shard in shards:
        held = load_file(str(folder / shard))
        out = {n: dequantize_ref(BlockFP8(t, scales[n + "_scale_inv"].float()), dtype) if n + "_scale_inv" in scales
               else t for n, t in held.items() if n not in scales}
        save_file(out, str(folder / shard), metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.endswith("_scale_inv")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder
