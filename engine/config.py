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


# quant_method values the loader implements: FP8 (block-scaled) and two 4-bit layouts (Int4Format)
SUPPORTED_QUANTIZATION = ("fp8", "gptq", "compressed-tensors")
INT4_ADVICE = "use the GPTQ Int4, FP8 or unquantized (bf16) release of this model, or --weights int4 on a bf16 one"


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
    v1_zeros: bool = False           # GPTQ's v1 checkpoint_format: the stored zeros are zero - 1

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint's linear module `module` is (or, on load, becomes) 4-bit."""
        return not any(re.match(pattern, module) for pattern in self.skip)


# The modules a quantization on load (`--weights int4`, method "rtn") leaves in the model dtype:
# the embeddings and the head (not products of the layers), the GDN's b|a rows and the MoE router
# with the shared expert's gate (a few rows each, read whole by the recurrence and the routing),
# the vision tower. Every other linear module of the decoder layers and of the MTP head becomes
# 4-bit, the head's fc among them: a draft reads it whole (the 27B's [5120 x 10240], 105 MB in
# bf16, more than a quarter of a draft's bytes), and it can change which token a draft proposes,
# never the output.
RTN_SKIP = (r".*embed_tokens$", r"lm_head$", r".*\.linear_attn\.in_proj_[ab]$", r".*\.mlp\.gate$",
            r".*\.mlp\.shared_expert_gate$", r"model\.visual\.")


def rtn_format(group: int = 128) -> "Int4Format":
    """`--weights int4`: symmetric round-to-nearest in groups of `group` (kernels/int4.quantize_ref)."""
    return Int4Format("rtn", group, True, False, RTN_SKIP)


def _refuse(source: str, what: str, why: str = "", do: str = INT4_ADVICE):
    """UnsupportedFormat in one line: what the config holds, why it cannot be read, what to do."""
    raise UnsupportedFormat(f"{source}: {what} is not supported{f' ({why})' if why else ''}; {do}")


def _gptq_format(quant: dict, source: str) -> "Int4Format":
    """GPTQ (GPTQModel / AutoGPTQ): 4 bits in groups, v1 or v2 zeros, `dynamic` rules whose "-:"
    keys leave the modules they match unquantized (the official releases: attention, the shared
    expert, the MTP layer, the vision tower). Rules that change a module's bits or group are refused."""
    bits, group = quant.get("bits", 4), quant.get("group_size", 128)
    if bits != 4:
        _refuse(source, f"GPTQ bits {bits}", "only 4-bit GPTQ is read")
    if not isinstance(group, int) or group <= 0 or group % 8:
        _refuse(source, f"GPTQ group_size {group}", "only groups of a multiple of 8 columns; per-channel (-1) is not read")
    fmt = quant.get("checkpoint_format", quant.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        _refuse(source, f"GPTQ checkpoint_format {fmt!r}", "only 'gptq' and 'gptq_v2' are read")
    if quant.get("lm_head", False):
        _refuse(source, "a GPTQ-quantized lm_head (lm_head: true)", "the head is read in bf16 only")
    sym, desc_act = bool(quant.get("sym", True)), bool(quant.get("desc_act", False))
    skip = []
    for key, override in (quant.get("dynamic") or {}).items():
        if key.startswith("-:"):
            skip.append(key[2:])
            continue
        changed = {k: v for k, v in (override or {}).items()
                   if k in ("bits", "group_size", "sym", "desc_act")
                   and v != {"bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act}[k]}
        if changed:
            _refuse(source, f"GPTQ dynamic rule {key!r} changing {changed}",
                    "one bits, group_size, sym and desc_act hold for every module")
    return Int4Format("gptq", group, sym, desc_act, tuple(skip), v1_zeros=fmt == "gptq")


def _compressed_format(quant: dict, source: str) -> "Int4Format":
    """compressed-tensors `pack-quantized` W4A16: int weights of 4 bits in groups, symmetric or
    with packed zero points, no activation quantization; `ignore` holds module names and "re:"
    regular expressions."""
    groups = quant.get("config_groups") or {}
    if not groups:
        _refuse(source, "a compressed-tensors config without config_groups")
    schemes = []
    for name, scheme in groups.items():
        fmt = scheme.get("format") or quant.get("format")
        if fmt != "pack-quantized":
            _refuse(source, f"compressed-tensors format {fmt!r} (config group {name!r})",
                    "only 'pack-quantized' int4 weights are read, not NVFP4 or FP8 ones")
        w = scheme.get("weights") or {}
        if scheme.get("input_activations") or scheme.get("output_activations"):
            _refuse(source, f"compressed-tensors activation quantization (config group {name!r})",
                    "only W4A16, the weights alone in 4 bits, is read")
        if w.get("num_bits") != 4 or w.get("type", "int") != "int":
            _refuse(source, f"compressed-tensors weights of {w.get('num_bits')} bits of type {w.get('type')!r} "
                    f"(config group {name!r})", "only 4-bit int weights are read")
        if w.get("strategy") != "group" or not isinstance(w.get("group_size"), int) or w["group_size"] % 8:
            _refuse(source, f"compressed-tensors strategy {w.get('strategy')!r} with group_size {w.get('group_size')} "
                    f"(config group {name!r})", "only 'group' of a multiple of 8 columns is read")
        if w.get("dynamic", False) or w.get("actorder") not in (None, "static", "group"):
            _refuse(source, f"compressed-tensors weights with dynamic {w.get('dynamic')} / actorder "
                    f"{w.get('actorder')!r} (config group {name!r})")
        schemes.append((w["group_size"], bool(w.get("symmetric", True)), w.get("actorder") == "group"))
    if len(set(schemes)) > 1:
        _refuse(source, f"compressed-tensors config groups of different schemes {sorted(set(schemes))}",
                "one group size and symmetry hold for every module")
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        _refuse(source, f"a compressed-tensors checkpoint in status {status!r}", "its weights are not packed")
    skip = tuple(n[3:] if n.startswith("re:") else re.escape(n) + "$" for n in quant.get("ignore") or ())
    group, sym, desc_act = schemes[0]
    return Int4Format("compressed-tensors", group, sym, desc_act, skip)


def _quantization(quant, source: str) -> tuple[str, "Int4Format | None"]:
    """config.json's quantization_config -> ("fp8" | "int4", the 4-bit format or None), or refused."""
    method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else repr(quant)
    algo = str(quant.get("quant_algo", "")) if isinstance(quant, dict) else ""
    if method == "modelopt" or "fp4" in algo.lower():
        _refuse(source, f"NVIDIA ModelOpt quantization {algo or 'modelopt'}", "NVFP4 and ModelOpt checkpoints are not read")
    if method == "gguf":
        _refuse(source, "GGUF quantization", "GGUF files are not read")
    if method not in SUPPORTED_QUANTIZATION:
        _refuse(source, f"quantization_config quant_method {method!r}", "",
                f"the supported ones are {', '.join(SUPPORTED_QUANTIZATION)}: {INT4_ADVICE}")
    if method == "fp8":
        _fp8_format(quant, source)
        return "fp8", None
    return "int4", (_gptq_format if method == "gptq" else _compressed_format)(quant, source)


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
        flat = dict(text)
        flat["quantization"], flat["int4"] = _quantization(quant, source) if quant is not None else (None, None)
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
        gguf = sorted(path.glob("*.gguf")) if path.is_dir() else [path] if path.suffix == ".gguf" else []
        if gguf and not file.exists() or file.suffix == ".gguf":
            _refuse(str(path), f"a GGUF checkpoint ({gguf[0].name})", "GGUF files are not read; only safetensors "
                    "checkpoints with their config.json are")
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
