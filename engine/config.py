"""Model configuration, read from a checkpoint's config.json and generation_config.json.

The official Qwen3.5 / Qwen3.6 checkpoints are vision-language repos: the text settings sit under
`text_config`. A flat config (the text settings at the top level) is accepted too. Field names are
the checkpoint's own; unknown keys are dropped; derived sizes are computed once in __post_init__.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM",
                           "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")


class ConfigError(ValueError):
    """A checkpoint's configuration cannot be used; the message says what and what to do."""


class UnsupportedFormat(ConfigError):
    """The checkpoint stores its weights in a form this engine does not read (a quantization method,
    tensors it has no place for): refused before anything is loaded, never read as garbage."""


SUPPORTED_QUANTIZATION = ("fp8",)   # quant_method values the loader implements


def _fp8_format(quant: dict, source: str) -> None:
    """The official FP8 releases' form (kernels/fp8.py); anything else is refused by name."""
    fmt, block = quant.get("fmt", "e4m3"), quant.get("weight_block_size")
    if fmt != "e4m3":
        raise UnsupportedFormat(f"{source}: FP8 format {fmt!r} is not supported; only 'e4m3' is")
    if block is not None and list(block) != [128, 128]:
        raise UnsupportedFormat(f"{source}: FP8 weight_block_size {list(block)} is not supported; only [128, 128] is")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedFormat(f"{source}: FP8 activation_scheme {quant['activation_scheme']!r} is not supported; "
                                "only 'dynamic' (no stored activation scales) is")


@dataclass(frozen=True)
class Int4Format:
    """How a model's products are kept in 4 bits (kernels/int4.py): a 4-bit checkpoint's
    quantization_config (GPTQ, compressed-tensors pack-quantized W4A16), or quantization on load
    ("rtn": `--weights int4`). `skip` are regular expressions over the checkpoint's module names
    (e.g. "model.language_model.layers.3.self_attn.q_proj", "mtp.layers.0.mlp.experts.7.up_proj"),
    each tried with re.match: a module one of them matches stays unquantized."""
    method: str                      # "gptq", "compressed-tensors" or "rtn"
    group: int = 128                 # columns a scale (and zero) covers
    symmetric: bool = True           # False: a stored zero per group
    desc_act: bool = False           # GPTQ's columns quantized out of order (a g_idx per product)
    skip: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint's linear module `module` is (or, on load, becomes) 4-bit."""
        return not any(re.match(pattern, module) for pattern in self.skip)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mtp_num_hidden_layers: int = 0
    max_position_embeddings: int = 262144
    hidden_act: str = "silu"
    attn_output_gate: bool = True
    attention_bias: bool = False
    dtype: str = "bfloat16"
    quantization: str | None = None   # "fp8": block-scaled FP8 linear weights in the checkpoint;
                                      # "int4": group-scaled 4-bit ones (described by int4)
    int4: Int4Format | None = None    # a 4-bit checkpoint's format
    intermediate_size: int = 0        # the dense MLP's (a dense model needs it)
    # the MoE models (qwen3_5_moe): every MLP a sparse block of routed experts plus a shared one
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # derived
    rotary_dim: int = field(init=False)
    key_dim: int = field(init=False)      # GDN: Hk * dk
    value_dim: int = field(init=False)    # GDN: Hv * dv
    conv_dim: int = field(init=False)     # GDN: 2 * key_dim + value_dim
    q_dim: int = field(init=False)        # full attention: heads * head_dim
    kv_dim: int = field(init=False)       # full attention: kv_heads * head_dim

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if not self.layer_types:
            every = self.full_attention_interval
            set_("layer_types", tuple("full_attention" if (i + 1) % every == 0 else "linear_attention"
                                      for i in range(self.num_hidden_layers)))
        else:
            set_("layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"config lists {len(self.layer_types)} layer_types for "
                              f"{self.num_hidden_layers} layers; they must agree")
        unknown = sorted(set(self.layer_types) - {"full_attention", "linear_attention"})
        if unknown:
            raise ConfigError(f"unsupported layer type(s) {unknown}; "
                              "supported: full_attention, linear_attention")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple "
                              f"of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                              f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                                  f"num_experts ({self.num_experts})")
            if self.moe_intermediate_size <= 0:
                raise ConfigError("an MoE config needs moe_intermediate_size > 0")
        elif self.intermediate_size <= 0:
            raise ConfigError("missing required field intermediate_size (the MLP's width; an MoE config "
                              "gives num_experts and moe_intermediate_size instead)")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; only 'silu' is")
        rotary = int(self.head_dim * self.partial_rotary_factor)
        if rotary % 2:
            raise ConfigError(f"rotary dim {rotary} (head_dim x partial_rotary_factor) must be even")
        set_("rotary_dim", rotary)
        set_("key_dim", self.linear_num_key_heads * self.linear_key_head_dim)
        set_("value_dim", self.linear_num_value_heads * self.linear_value_head_dim)
        set_("conv_dim", 2 * self.key_dim + self.value_dim)
        set_("q_dim", self.num_attention_heads * self.head_dim)
        set_("kv_dim", self.num_key_value_heads * self.head_dim)

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type is None and not raw.get("text_config"):
            keys = "it is empty" if not raw else "it has no model_type"
            raise ConfigError(f"{source}: {keys}, so it does not say what model this is; the download may be "
                              "incomplete (fetch the checkpoint's config.json again)")
        text = raw.get("text_config", raw)
        text_type = text.get("model_type", model_type)
        if model_type not in SUPPORTED_MODEL_TYPES and text_type not in SUPPORTED_MODEL_TYPES:
            archs = ", ".join(raw.get("architectures") or []) or "none listed"
            raise ConfigError(f"{source}: model_type {model_type!r} (architectures: {archs}) is not supported; "
                              f"mtpchat runs Qwen3.5 / Qwen3.6 hybrid models (model_type "
                              f"{' or '.join(SUPPORTED_MODEL_TYPES)})")
        quant = raw.get("quantization_config") or text.get("quantization_config")
        if quant is not None:
            method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else repr(quant)
            if method not in SUPPORTED_QUANTIZATION:
                have = ", ".join(SUPPORTED_QUANTIZATION) or "none yet"
                raise UnsupportedFormat(
                    f"{source}: quantization_config quant_method {method!r} is not supported (supported "
                    f"quantization: {have}); use the unquantized (bf16) or the FP8 release of this model")
            _fp8_format(quant, source)
        flat = dict(text)
        flat["quantization"] = "fp8" if quant is not None else None
        rope = flat.pop("rope_parameters", None) or flat.pop("rope_scaling", None) or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise ConfigError(f"{source}: rope_type {rope['rope_type']!r} is not supported; only 'default' is")
        flat.setdefault("rope_theta", rope.get("rope_theta", 1e7))
        flat.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        # tie_word_embeddings is set at the top level of the official configs, and repeated inside.
        if "tie_word_embeddings" in raw and "tie_word_embeddings" not in flat:
            flat["tie_word_embeddings"] = raw["tie_word_embeddings"]
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.init and f.default is dataclasses.MISSING and f.name not in flat]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        try:
            return cls(**{k: v for k, v in flat.items() if k in names})
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise ConfigError(f"no config.json in {path}; a checkpoint folder holds config.json, "
                              "the safetensors shards and the tokenizer files")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON ({e}); the download may be incomplete") from None
        return cls.from_dict(raw, source=str(file))


@dataclass(frozen=True)
class GenerationConfig:
    """Stop ids and the checkpoint's sampling defaults (generation_config.json); all optional."""
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    @classmethod
    def load(cls, folder: str | Path, model_config: dict | None = None) -> "GenerationConfig":
        file = Path(folder) / "generation_config.json"
        try:
            raw = json.loads(file.read_text()) if file.exists() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file} is not valid JSON ({e}); the download may be incomplete: download it "
                              "again, or delete it (it is optional: the sampling defaults then come from the flags)"
                              ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file} holds a JSON {type(raw).__name__}, not an object of generation settings")
        eos = raw.get("eos_token_id")
        if eos is None and model_config is not None:
            eos = model_config.get("text_config", model_config).get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(eos_token_ids=tuple(eos), pad_token_id=raw.get("pad_token_id"),
                   temperature=raw.get("temperature"), top_k=raw.get("top_k"), top_p=raw.get("top_p"))
