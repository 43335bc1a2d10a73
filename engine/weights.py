"""Checkpoint loading: every quirk of the official layout lives here.

The official checkpoints are sharded safetensors found through model.safetensors.index.json (or one
model.safetensors). Text weights sit under `model.language_model.`, the head at `lm_head.weight`
(absent when tied to the embedding), the draft head under `mtp.`; `model.visual.*` is skipped.
Separate projections are fused into one matrix per layer as they are read: GDN [qkv | z | b | a],
attention [q | k | v], MLP [gate | up]. Each tensor goes straight to its place on the target
device, one at a time, so the host never holds a copy of the model.

FP8 (kernels/fp8.py): the official FP8 releases store the big products' weights in float8_e4m3fn
with a `<name>.weight_scale_inv` of 128 x 128 block scales; everything else stays bf16 (the GDN's
in_proj_b/a among them, so an FP8 model keeps [b | a] apart from [qkv | z]). The products of
FP8_PARAMS are stored in FP8 (the parameter and its block scales as `<param>_scale`) when the
model is, reading FP8 as it is and quantizing bf16 on the device as it is read; a model kept in
bf16 dequantizes FP8 tensors instead. A fused product whose parts do not start on whole blocks of
128 rows cannot share block scales: it is kept in the model dtype.

4 bits (kernels/int4.py: GroupInt4): the products of INT4_PARAMS (the same ones and the MTP fc) are stored as
`<param>` (packed int32), `<param>_scale` and, where present, `<param>_zero` and `<param>_perm`,
read from a GPTQ or compressed-tensors checkpoint (int4_checkpoint.py: each module's tensors in
place of its `.weight`) or quantized on the device as they are read (`--weights int4`: bf16, and
FP8 through float32, by kernels/int4.quantize_ref). Groups run along K, so the parts of a fused
product quantize on their own; but parts a desc_act checkpoint stores in different column orders,
or a part it keeps in bf16, keep the product in the model dtype (its 4-bit parts dequantized), as
does a 4-bit module outside INT4_PARAMS (the GDN's b|a, say) and a product whose K is not a whole
number of groups.

Without a checkpoint, `fill_random` gives the same modules random weights of the same shapes
(`mtpchat bench --random-weights`, Engine.load of a bare ModelConfig); `random_tensor` is its draw,
shared with the tiny test checkpoints so both are one distribution.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mtpchat.engine import int4_checkpoint
from mtpchat.engine.config import Int4Format, ModelConfig, UnsupportedFormat
from mtpchat.engine.events import LoadProgress
from mtpchat.kernels.forms import dense_ref
from mtpchat.kernels.fp8 import BLOCK, FP8, BlockFP8, quantize_ref, scale_shape
from mtpchat.kernels.int4 import PACK, GroupInt4, interleavable, interleave_ref
from mtpchat.kernels.int4 import quantize_ref as int4_quantize

TEXT_PREFIX = "model.language_model."
MTP_PREFIX = "mtp."
SKIP_PREFIXES = ("model.visual.",)


class WeightsError(ValueError):
    """The checkpoint's tensors are missing, truncated or of the wrong shape."""


FLOAT_DTYPES = ("F32", "F16", "BF16")     # safetensors' names of the dtypes a weight may have on disk
DTYPE_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I32": 4, "I64": 8}
SCALE_SUFFIX = "_scale_inv"               # an FP8 tensor's block scales: `<name>_scale_inv`
# the products kept in FP8 in an FP8 model, and in 4 bits in a 4-bit one (our parameter names, by suffix)
FP8_PARAMS = ("mixer.in_proj", "mixer.out_proj", "mixer.qkv", "mixer.o_proj", "mlp.gate_up", "mlp.down",
              "shared.gate_up", "shared.down", "mlp.experts_gate_up", "mlp.experts_down")
MTP_FC = "fc"      # the MTP head's fc (engine/mtp.py MTPHead), 4-bit where the format quantizes `mtp.fc`
INT4_PARAMS = FP8_PARAMS + (MTP_FC,)


def _int4_param(param: str) -> bool:
    """Whether a parameter is among INT4_PARAMS: a layer's product by its name's end, the head's fc
    by its whole name."""
    return param == MTP_FC or param.endswith(FP8_PARAMS)


@dataclass(frozen=True)
class Place:
    param: str              # our parameter, e.g. "layers.3.mixer.qkv"
    offset: int             # first row of this tensor inside the (fused) parameter
    shape: tuple[int, ...]  # the shape in the checkpoint


STACKED, PER_EXPERT = "stacked", "per-expert"     # the two ways checkpoints store an MoE's experts


def _mlp_places(c: ModelConfig, src: str, dst: str, experts: str) -> dict[str, Place]:
    """The dense MLP [gate | up], down; or an MoE block: the router with the shared expert's gate
    as its last row, the routed experts stacked ([E * 2F, H] gate|up per expert, [E * H, F] down)
    from either checkpoint layout, and the shared expert as a dense MLP."""
    H = c.hidden_size

    def dense(name: str, param: str, I: int) -> dict[str, Place]:
        return {f"{name}.gate_proj.weight": Place(f"{param}.gate_up", 0, (I, H)),
                f"{name}.up_proj.weight": Place(f"{param}.gate_up", I, (I, H)),
                f"{name}.down_proj.weight": Place(f"{param}.down", 0, (H, I))}
    if not c.is_moe:
        return dense(f"{src}.mlp", f"{dst}.mlp", c.intermediate_size)
    E, Fm, Fs = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    m, d = f"{src}.mlp", f"{dst}.mlp"
    p = {f"{m}.gate.weight": Place(f"{d}.router", 0, (E, H))}
    if Fs:
        p |= dense(f"{m}.shared_expert", f"{d}.shared", Fs)
        p[f"{m}.shared_expert_gate.weight"] = Place(f"{d}.router", E, (1, H))
    if experts == STACKED:
        p[f"{m}.experts.gate_up_proj"] = Place(f"{d}.experts_gate_up", 0, (E, 2 * Fm, H))
        p[f"{m}.experts.down_proj"] = Place(f"{d}.experts_down", 0, (E, H, Fm))
        return p
    for e in range(E):
        x = f"{m}.experts.{e}"
        p[f"{x}.gate_proj.weight"] = Place(f"{d}.experts_gate_up", e * 2 * Fm, (Fm, H))
        p[f"{x}.up_proj.weight"] = Place(f"{d}.experts_gate_up", e * 2 * Fm + Fm, (Fm, H))
        p[f"{x}.down_proj.weight"] = Place(f"{d}.experts_down", e * H, (H, Fm))
    return p


def _layer_places(c: ModelConfig, src: str, dst: str, kind: str, split_ba: bool = False,
                  experts: str = STACKED) -> dict[str, Place]:
    H = c.hidden_size
    p = {
        f"{src}.input_layernorm.weight": Place(f"{dst}.input_norm.weight", 0, (H,)),
        f"{src}.post_attention_layernorm.weight": Place(f"{dst}.post_norm.weight", 0, (H,)),
        **_mlp_places(c, src, dst, experts),
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
            f"{g}.in_proj_b.weight": Place(*((f"{m}.in_proj_ba", 0) if split_ba else
                                             (f"{m}.in_proj", c.conv_dim + c.value_dim)), (hv, H)),
            f"{g}.in_proj_a.weight": Place(*((f"{m}.in_proj_ba", hv) if split_ba else
                                             (f"{m}.in_proj", c.conv_dim + c.value_dim + hv)), (hv, H)),
            f"{g}.conv1d.weight": Place(f"{m}.conv_weight", 0, (c.conv_dim, 1, c.linear_conv_kernel_dim)),
            f"{g}.A_log": Place(f"{m}.A_log", 0, (hv,)),
            f"{g}.dt_bias": Place(f"{m}.dt_bias", 0, (hv,)),
            f"{g}.norm.weight": Place(f"{m}.norm_weight", 0, (c.linear_value_head_dim,)),
            f"{g}.out_proj.weight": Place(f"{m}.out_proj", 0, (H, c.value_dim)),
        }
    return p


def text_places(c: ModelConfig, split_ba: bool = False, experts: str = STACKED,
                prefix: str = TEXT_PREFIX) -> dict[str, Place]:
    """Checkpoint name -> where it goes in engine/model.py's Model (`split_ba`: an FP8 model's GDN
    layers keep [b | a] in their own parameter; `experts`: how an MoE checkpoint stores its
    experts, `expert_layout`; `prefix`: the text weights', `text_prefix`)."""
    H, V = c.hidden_size, c.vocab_size
    p = {f"{prefix}embed_tokens.weight": Place("embed", 0, (V, H)),
         f"{prefix}norm.weight": Place("norm.weight", 0, (H,))}
    for i, kind in enumerate(c.layer_types):
        p |= _layer_places(c, f"{prefix}layers.{i}", f"layers.{i}", kind, split_ba, experts)
    if not c.tie_word_embeddings:
        p["lm_head.weight"] = Place("lm_head", 0, (V, H))
    return p


def mtp_places(c: ModelConfig, experts: str = STACKED) -> dict[str, Place]:
    """Checkpoint name -> where it goes in engine/mtp.py's MTPHead (the 15 `mtp.*` tensors of a
    dense model; an MoE model's head layer is an MoE layer)."""
    H = c.hidden_size
    p = {"mtp.fc.weight": Place("fc", 0, (H, 2 * H)),
         "mtp.pre_fc_norm_embedding.weight": Place("pre_fc_norm_embedding.weight", 0, (H,)),
         "mtp.pre_fc_norm_hidden.weight": Place("pre_fc_norm_hidden.weight", 0, (H,)),
         "mtp.norm.weight": Place("norm.weight", 0, (H,))}
    return p | _layer_places(c, "mtp.layers.0", "layer", "full_attention", experts=experts)


TEXT_ONLY_PREFIX = "model."     # a text-only save (transformers' *ForCausalLM): `model.layers.*`


def text_prefix(folder: str | Path) -> str:
    """Where the text weights sit: under `model.language_model.` (the official vision-language
    layout) or `model.` (a text-only model saved by transformers)."""
    names = _weight_map(Path(folder))
    if f"{TEXT_PREFIX}embed_tokens.weight" not in names and f"{TEXT_ONLY_PREFIX}embed_tokens.weight" in names:
        return TEXT_ONLY_PREFIX
    return TEXT_PREFIX


def expert_layout(folder: str | Path, prefix: str = TEXT_PREFIX) -> str:
    """How the checkpoint stores an MoE's experts: STACKED (`mlp.experts.gate_up_proj` [E, 2F, H],
    the bf16 releases) or PER_EXPERT (`mlp.experts.{e}.gate_proj` and so on, the FP8 releases, and
    what transformers 5.24's save_pretrained writes)."""
    names = _weight_map(Path(folder))
    return STACKED if any(n.startswith(prefix) and n.endswith(".mlp.experts.gate_up_proj") for n in names) else PER_EXPERT


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
              device, dtype, fp8: bool = False, quantized: bool = False, int4: Int4Format | None = None,
              stored_int4: Int4Format | None = None, progress=None):
    """Fill each module's parameters from the checkpoint. `places[key]` maps checkpoint names to
    parameters of `modules[key]`. Every parameter is allocated on `device` first; each tensor is
    then read, checked and copied into its rows. `fp8`: store the FP8_PARAMS in FP8; `quantized`:
    the checkpoint says it is FP8 (its block scales are read, not refused). `int4`: store the
    INT4_PARAMS in 4 bits (_int4_params), as a 4-bit checkpoint holds them or quantized as they are
    read (method "rtn"); `stored_int4`: the checkpoint's own 4-bit format, whose modules are read
    (int4_checkpoint.py) and, in a parameter kept in the model dtype, dequantized. `progress`, if
    given, is called with a LoadProgress after each tensor (bytes as stored in the checkpoint)."""
    folder = Path(folder)
    weight_map = _weight_map(folder)
    wanted = {name: (key, place) for key, table in places.items() for name, place in table.items()}
    four = _int4_modules(weight_map, wanted, stored_int4)
    missing = sorted(set(wanted) - set(weight_map) - set(four))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{folder}: tensor {', '.join(missing[:3])}{more} not found in the checkpoint; "
                           "it is incomplete or of another architecture")
    if stored_int4 is not None and not four:
        raise UnsupportedFormat(f"{folder}: config.json says the weights are in 4 bits ({stored_int4.method}) but no "
                                "module is stored so; the config does not belong to these weights")
    _refuse_unused(folder, weight_map, wanted, places, quantized, four, stored_int4)
    by_shard: dict[str, list[str]] = {}
    for name in wanted:
        stored_as = int4_checkpoint.marker(stored_int4, four[name]) if name in four else name
        by_shard.setdefault(weight_map[stored_as], []).append(name)
    sizes: dict[str, int] = {}
    half: set[str] = set()
    stored_fp8 = _check_stored(folder, by_shard, weight_map, quantized, sizes)
    if four:
        _check_int4(folder, weight_map, four, stored_int4, sizes, half)
    in_fp8 = _fp8_params(places, fp8, stored_fp8 if quantized else None)
    in_int4 = _int4_params(places, int4, four, _column_orders(folder, weight_map, four, stored_int4), half)
    to_fp8 = any((key, place.param) in in_fp8 and name not in stored_fp8 for name, (key, place) in wanted.items())
    to_int4 = any((key, place.param) in in_int4 and name not in four for name, (key, place) in wanted.items())
    quantizing = "int4" if to_int4 else "fp8" if to_fp8 else ""
    total, done, count = sum(sizes.values()), 0, 0
    params: dict[tuple[str, str], torch.Tensor | BlockFP8 | GroupInt4] = {}
    for key, module in modules.items():
        for name, p in module.named_parameters():
            if (key, name) in in_fp8:
                params[key, name] = BlockFP8(torch.empty(p.shape, device=device, dtype=FP8),
                                             torch.empty(scale_shape(*p.shape), device=device, dtype=torch.float32))
            elif (key, name) in in_int4:
                params[key, name] = _empty_int4(p.shape, int4.group, *in_int4[key, name], device)
            else:
                dt = torch.float32 if name.endswith(FLOAT32_PARAMS) else dtype
                params[key, name] = torch.empty(p.shape, device=device, dtype=dt)
    for shard, names in sorted(by_shard.items()):
        with _open(folder / shard) as f:
            present = set(f.keys())
            for name in names:
                key, place = wanted[name]
                if name in four:
                    t = _read_int4(f, shard, four[name], place, folder, weight_map, stored_int4)
                elif name not in present:
                    raise WeightsError(f"{shard}: tensor {name} is listed in the index but not in the shard; "
                                       "the shard is corrupt or from another download")
                else:
                    t = _read(f, shard, name, place, folder, weight_map)
                _put(params[key, place.param], place.offset, t, device, name)
                done, count = done + sizes.get(name, 0), count + 1
                if progress is not None:
                    progress(LoadProgress("weights", done, total, count, len(wanted), quantizing))
    for (key, name), tensor in params.items():
        _assign_product(modules[key], name, tensor)


def _module(name: str) -> str:
    """A checkpoint tensor's module: `...q_proj.weight` -> `...q_proj` (stacked experts: the name)."""
    return name.removesuffix(".weight")


def _int4_modules(weight_map: dict[str, str], wanted: dict, fmt: Int4Format | None) -> dict[str, str]:
    """The wanted tensors (`<module>.weight`) that a 4-bit checkpoint stores in 4 bits -> their module."""
    if fmt is None:
        return {}
    return {name: _module(name) for name in wanted if name not in weight_map and name.endswith(".weight")
            and int4_checkpoint.marker(fmt, _module(name)) in weight_map}


def _int4_params(places: dict[str, dict[str, Place]], fmt: Int4Format | None, four: dict[str, str],
                 orders: dict[str, torch.Tensor | None] | None = None, half: set[str] = frozenset()) -> dict:
    """The (module key, parameter) pairs stored in 4 bits, each with (scale dtype, zeros or not, the
    columns' order or None): the INT4_PARAMS of a 4-bit model whose columns are whole groups. From a
    4-bit checkpoint (`four`: its 4-bit tensors), those whose every part is 4-bit, all in one column
    order (`orders`, from their g_idx; an MoE's stacked experts one order an expert): a product
    with a part kept in bf16, or parts of different orders, stays in the model dtype (its 4-bit
    parts dequantized). Scales stay float16 where the checkpoint's all are. On load (method "rtn"),
    those whose parts' modules fmt.quantizes, with float16 scales (kernels/int4.quantize_ref)."""
    if fmt is None:
        return {}
    orders = orders or {}
    parts: dict[tuple[str, str], list[tuple[str, Place]]] = {}
    for key, table in places.items():
        for name, place in table.items():
            parts.setdefault((key, place.param), []).append((name, place))
    out = {}
    for (key, param), named in parts.items():
        if not _int4_param(param) or named[0][1].shape[-1] % fmt.group:
            continue
        if fmt.method == "rtn":
            if all(fmt.quantizes(_module(n)) for n, _ in named):
                out[key, param] = (torch.float16, False, None)
            continue
        if not all(n in four for n, _ in named):
            continue
        alike, perm = _shared_order(named, orders)
        if alike:
            scale = torch.float16 if all(n in half for n, _ in named) else torch.float32
            out[key, param] = (scale, not fmt.symmetric, perm)
    return out


def _shared_order(named: list[tuple[str, Place]], orders: dict) -> tuple[bool, torch.Tensor | None]:
    """Whether a product's 4-bit parts can share one column order, and that order: [K], or [E, K]
    for stacked experts (`experts.{e}.` in the names: an expert's gate and up share one), or None
    where every part's columns are in order."""
    perms = [orders.get(n) for n, _ in named]
    if all(p is None for p in perms):
        return True, None
    K = named[0][1].shape[-1]
    experts = [re.search(r"\.experts\.(\d+)\.", n) for n, _ in named]
    if all(experts):
        each: dict[int, torch.Tensor] = {}
        for m, p in zip(experts, perms):
            p = torch.arange(K, dtype=torch.int32) if p is None else p
            e = int(m[1])
            if e in each and not torch.equal(each[e], p):
                return False, None
            each[e] = p
        return True, torch.stack([each[e] for e in range(len(each))])
    same = all(p is not None and torch.equal(p, perms[0]) for p in perms)
    return (True, perms[0]) if same else (False, None)


def _column_orders(folder: Path, weight_map: dict[str, str], four: dict[str, str],
                   fmt: Int4Format | None) -> dict[str, torch.Tensor | None]:
    """Before anything is allocated, where the checkpoint's columns may be out of order (desc_act):
    each 4-bit tensor's column order from its g_idx (small: K integers a module)."""
    if fmt is None or not fmt.desc_act:
        return {}
    by_shard: dict[str, list[tuple[str, str]]] = {}
    for name, module in four.items():
        g = int4_checkpoint.g_idx_name(fmt, module)
        if g in weight_map:
            by_shard.setdefault(weight_map[g], []).append((name, g))
    orders = {}
    for shard, items in sorted(by_shard.items()):
        with _open(folder / shard) as f:
            for name, g in items:
                try:
                    orders[name] = int4_checkpoint.column_order(f.get_tensor(g), fmt.group, g)
                except int4_checkpoint.Int4TensorError as e:
                    raise WeightsError(f"{shard}: {e}") from None
    return orders


def _check_int4(folder: Path, weight_map: dict[str, str], four: dict[str, str], fmt: Int4Format,
                sizes: dict[str, int], half: set[str]):
    """From the shards' headers, before anything is allocated: every 4-bit module has the tensors
    its format needs, each of an integer or float type as it should. Adds their bytes to `sizes`
    and the names whose scales are float16 to `half`."""
    where: dict[str, list[tuple[str, str, str]]] = {}
    for name, module in four.items():
        for t in int4_checkpoint.TENSORS[fmt.method]:
            tensor = f"{module}.{t}"
            if tensor in weight_map:
                where.setdefault(weight_map[tensor], []).append((name, tensor, t))
            elif t in int4_checkpoint.required(fmt):
                raise WeightsError(f"{folder}: the 4-bit module {module} has no {tensor} (a {fmt.method} module holds "
                                   f"{', '.join(int4_checkpoint.required(fmt))}); the checkpoint is incomplete or "
                                   "damaged: download it again")
    for shard, items in sorted(where.items()):
        with _open(folder / shard) as f:
            present = set(f.keys())
            for name, tensor, t in items:
                if tensor not in present:
                    raise WeightsError(f"{shard}: tensor {tensor} is listed in the index but not in the shard; "
                                       "the shard is corrupt or from another download")
                info = f.get_slice(tensor)
                stored, want = info.get_dtype(), int4_checkpoint.expected_dtype(t)
                if stored not in want:
                    raise WeightsError(f"{shard}: tensor {tensor} is stored as {stored}, expected "
                                       f"{' or '.join(want)}; the checkpoint is damaged")
                sizes[name] = sizes.get(name, 0) + math.prod(info.get_shape()) * DTYPE_SIZE.get(stored, 0)
                if t in ("scales", "weight_scale") and stored == "F16":
                    half.add(name)


def _read_int4(f, shard: str, module: str, place: Place, folder: Path, weight_map: dict[str, str],
               fmt: Int4Format) -> GroupInt4:
    """A 4-bit module's tensors (from any shard) as a GroupInt4, its columns in group order."""
    def get(t: str) -> torch.Tensor | None:
        tensor = f"{module}.{t}"
        if tensor not in weight_map:
            return None
        if weight_map[tensor] == shard:
            return f.get_tensor(tensor)
        with _open(folder / weight_map[tensor]) as g:
            return g.get_tensor(tensor)
    if len(place.shape) != 2:
        raise WeightsError(f"{shard}: module {module} is stored in 4 bits, but its place holds a {len(place.shape)}-D "
                           "weight; this layout of 4-bit weights is not read")
    try:
        return int4_checkpoint.read_module(fmt, module, get, place.shape)
    except int4_checkpoint.Int4TensorError as e:
        raise WeightsError(f"{shard}: {e}") from None


def _empty_int4(shape, group: int, scale_dtype, zeros: bool, perm, device) -> GroupInt4:
    N, K = shape
    return GroupInt4(torch.empty(N, K // PACK, device=device, dtype=torch.int32),
                     torch.empty(N, K // group, device=device, dtype=scale_dtype),
                     torch.empty(N, K // group, device=device, dtype=torch.uint8) if zeros else None,
                     None if perm is None else perm.to(device))


def _fp8_params(places: dict[str, dict[str, Place]], fp8: bool,
                stored_fp8: set[str] | None = None) -> set[tuple[str, str]]:
    """The (module key, parameter) pairs stored in FP8: the FP8_PARAMS of an FP8 model whose parts
    each start on a whole block of rows (offsets only: a part's last block may be partial only at
    the end of the parameter, where its block is its own). `stored_fp8`: the checkpoint's FP8
    tensors, when it is an FP8 checkpoint; a product it keeps in bf16 (its
    modules_to_not_convert) stays so, rather than be quantized here."""
    if not fp8:
        return set()
    parts: dict[tuple[str, str], list[tuple[str, Place]]] = {}
    for key, table in places.items():
        for name, place in table.items():
            parts.setdefault((key, place.param), []).append((name, place))

    def aligned(named: list[tuple[str, Place]]) -> bool:
        ps = [p for _, p in named]
        if any(len(p.shape) == 3 for p in ps):    # stacked experts: each expert's parts on whole blocks
            return all(p.offset % BLOCK == 0 and p.shape[1] % (2 * BLOCK if "gate_up" in n else BLOCK) == 0
                       for n, p in named)
        end = max(q.offset + q.shape[0] for q in ps)
        return all(p.offset % BLOCK == 0 and (p.offset + p.shape[0] == end or p.shape[0] % BLOCK == 0) for p in ps)
    return {k for k, named in parts.items() if k[1].endswith(FP8_PARAMS) and aligned(named)
            and (stored_fp8 is None or all(n in stored_fp8 for n, _ in named))}


def _check_stored(folder: Path, by_shard: dict[str, list[str]], weight_map: dict[str, str],
                  quantized: bool, sizes: dict[str, int] | None = None) -> set[str]:
    """Before anything is allocated, from the shards' headers: every tensor a float type, or FP8
    with its block scales in a checkpoint whose config says FP8. Returns the FP8 ones; fills
    `sizes` with each tensor's bytes as stored."""
    fp8: set[str] = set()
    sizes = {} if sizes is None else sizes
    for shard, names in sorted(by_shard.items()):
        with _open(folder / shard) as f:
            present = set(f.keys())
            for name in (n for n in names if n in present):
                info = f.get_slice(name)
                stored = info.get_dtype()
                sizes[name] = math.prod(info.get_shape()) * DTYPE_SIZE.get(stored, 0)
                if stored in FLOAT_DTYPES:
                    continue
                if stored != "F8_E4M3":
                    raise UnsupportedFormat(f"{shard}: tensor {name} is stored as {stored}, not a float type "
                                            f"({', '.join(FLOAT_DTYPES)}) or FP8; this build cannot read it")
                if not quantized:
                    raise UnsupportedFormat(f"{shard}: tensor {name} is stored as FP8 ({stored}) but config.json has "
                                            "no quantization_config; the config does not belong to these weights")
                if name + SCALE_SUFFIX not in weight_map:
                    raise WeightsError(f"{shard}: FP8 tensor {name} has no {name + SCALE_SUFFIX} in the checkpoint; "
                                       "it is incomplete: download it again")
                fp8.add(name)
    return fp8


def _read(f, shard: str, name: str, place: Place, folder: Path, weight_map: dict[str, str]):
    """The checkpoint tensor (its stored type checked by _check_stored): a float tensor, or an FP8
    one with its block scales."""
    info = f.get_slice(name)
    shape, stored = tuple(info.get_shape()), info.get_dtype()
    if shape != place.shape:
        raise WeightsError(f"{shard}: tensor {name} has shape {list(shape)}, expected {list(place.shape)} "
                           "from config.json")
    scale_name = name + SCALE_SUFFIX
    if stored == "F8_E4M3":
        with _open(folder / weight_map[scale_name]) as g:
            scale = g.get_tensor(scale_name)
        rows = shape[0] if len(shape) == 2 else -1
        if len(shape) != 2 or tuple(scale.shape) != scale_shape(rows, shape[1]):
            raise WeightsError(f"{weight_map[scale_name]}: tensor {scale_name} has shape {list(scale.shape)}, "
                               f"expected {list(scale_shape(*shape)) if len(shape) == 2 else 'none'} for "
                               f"{name} {list(shape)} in 128 x 128 blocks")
        return BlockFP8(f.get_tensor(name), scale.float())
    return f.get_tensor(name)


def _on(t, device):
    """A BlockFP8's or GroupInt4's tensors on `device`."""
    return type(t)(*(None if x is None else x.to(device) for x in t))


def _put(dest, offset: int, t, device, name: str = ""):
    """Copy one checkpoint tensor into rows offset.. of its parameter: FP8 or 4 bits as they are,
    bf16 (and FP8, through float32) quantized on the device into an FP8 or 4-bit parameter, FP8 and
    4 bits dequantized into a model-dtype one."""
    if isinstance(dest, GroupInt4):
        if isinstance(t, GroupInt4):
            if t.perm is not None and dest.perm is None:
                raise WeightsError(f"tensor {name}: its g_idx puts the columns out of order, though config.json "
                                   "says desc_act false; the config does not belong to these weights")
            q = t
        else:
            w = dense_ref(_on(t, device)) if isinstance(t, BlockFP8) else t.to(device)
            q = int4_quantize(w.reshape(-1, w.shape[-1]), dest.group, True, dest.scale.dtype)
        rows = q.w.shape[0]
        for part, value in zip(dest[:3], q[:3]):
            if part is not None:
                part[offset:offset + rows].copy_(value)
        return
    if isinstance(dest, BlockFP8):
        q = t if isinstance(t, BlockFP8) else quantize_ref(t.to(device).reshape(-1, t.shape[-1]))
        b = offset // BLOCK
        dest.w[offset:offset + q.w.shape[0]].copy_(q.w)
        dest.scale[b:b + q.scale.shape[0]].copy_(q.scale)
        return
    if isinstance(t, (GroupInt4, BlockFP8)):
        t = dense_ref(_on(t, device), dest.dtype)
    t = t.reshape(-1, *dest.shape[1:]) if dest.dim() > 1 else t
    dest[offset:offset + t.shape[0]].copy_(t)


def _refuse_unused(folder: Path, weight_map: dict[str, str], wanted: dict, places: dict, quantized: bool,
                   four: dict[str, str] | None = None, stored_int4: Int4Format | None = None):
    """Every tensor of the checkpoint must have a place, or be one we know to leave: the vision
    tower, the draft head when it is not loaded, a tied checkpoint's copy of the embedding as
    `lm_head.weight` (in 4 bits: its tensors). Anything else (block scales of a quantized
    checkpoint, layers of another architecture) means the checkpoint is not what config.json says:
    refused, never dropped."""
    known = [*SKIP_PREFIXES, *(() if "mtp" in places else (MTP_PREFIX,))]
    if "lm_head.weight" not in wanted:
        known.append("lm_head.")
    used = {t for module in (four or {}).values() for t in int4_checkpoint.tensor_names(stored_int4, module)}
    unused = sorted(n for n in weight_map if n not in wanted and n not in used and not n.startswith(tuple(known))
                    and not (quantized and n.removesuffix(SCALE_SUFFIX) in wanted))
    if unused:
        more = f" (and {len(unused) - 3} more)" if len(unused) > 3 else ""
        raise UnsupportedFormat(f"{folder}: {len(unused)} tensor(s) have no place in a Qwen3.5/3.6 model as "
                                f"config.json describes it: {', '.join(unused[:3])}{more}; the checkpoint is "
                                "quantized or of another architecture")


def random_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A random value for checkpoint tensor `name`, on g's device, that keeps activations in a sane
    range; norms and gates random, never zero."""
    randn = lambda: torch.randn(shape, generator=g, device=g.device)
    if name.endswith("A_log"):
        return torch.empty(shape, device=g.device).uniform_(1.0, 16.0, generator=g).log()
    if name.endswith(("dt_bias", "conv1d.weight")):
        return randn() * 0.5
    if len(shape) == 1:   # RMSNorm weights (zero-centred, and the GDN norm's plain one)
        return randn() * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0)
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return randn()
    return randn() / math.sqrt(shape[-1])


def fill_random(modules: dict[str, nn.Module], places: dict[str, dict[str, Place]], device, dtype, seed: int,
                fp8: bool = False, int4: Int4Format | None = None, progress=None):
    """Random weights of the checkpoint's shapes drawn on the device (benchmarks at real sizes);
    with `fp8` the FP8_PARAMS quantized, block scales and all, as an FP8 checkpoint holds them;
    with `int4` the INT4_PARAMS its format quantizes in 4 bits: as `--weights int4` quantizes a
    checkpoint (method "rtn"), or those a 4-bit release holds in 4 bits (its `skip` map: the 27B
    GPTQ release's MLPs), symmetric with float16 scales as the official releases store them.
    `progress` as in load_into, counting parameters and their bytes in `dtype`."""
    g = torch.Generator(device=device).manual_seed(seed)
    in_fp8 = _fp8_params(places, fp8)
    # a release's parts chosen as "rtn" chooses them: by the modules its format quantizes
    in_int4 = _int4_params(places, int4 if int4 is None else dataclasses.replace(int4, method="rtn"), {})
    width = torch.empty((), dtype=dtype).element_size()
    params = [(key, name, p.numel()) for key, module in modules.items() for name, p in module.named_parameters()]
    total, done, count = sum(n for *_, n in params) * width, 0, 0
    for key, module in modules.items():
        names = {place.param: name for name, place in places[key].items()}   # a representative name
        for pname, p in list(module.named_parameters()):
            dt = torch.float32 if pname.endswith(FLOAT32_PARAMS) else dtype
            if p.dim() == 2 and "conv" not in pname:
                # a matrix drawn and stored a slab of rows at a time: drawn whole in float32 (the
                # 35B-A3B's stack of one layer's experts: 4.3 GB with its scaling) it would add
                # several GB to the peak of a load that must fit a 24 GB card in 4 bits
                fmt = "fp8" if (key, pname) in in_fp8 else "int4" if (key, pname) in in_int4 else dt
                _assign_product(module, pname, _random_matrix(names[pname], tuple(p.shape), g, fmt, int4))
            else:
                assert (key, pname) not in in_fp8 and (key, pname) not in in_int4, f"{pname}: only matrices quantize"
                shape = tuple(p.shape) if p.dim() != 2 else (p.shape[0], 1, p.shape[1])
                _assign(module, pname, random_tensor(names[pname], shape, g).reshape(p.shape).to(dt))
            done, count = done + p.numel() * width, count + 1
            if progress is not None:
                progress(LoadProgress("weights", done, total, count, len(params),
                                      "int4" if in_int4 else "fp8" if in_fp8 else ""))


RANDOM_ROWS_AT_ONCE = 1 << 24     # weights a slab of a random matrix holds (64 MB of float32)


def _random_matrix(name: str, shape: tuple[int, int], g: torch.Generator, fmt: torch.dtype | str,
                   int4: Int4Format | None):
    """A random matrix for checkpoint tensor `name` (random_tensor's values), drawn in slabs of whole
    rows (FP8: of whole 128-row blocks) and stored as it goes: in `fmt`, a dtype, "fp8" (block
    scaled) or "int4" (int4's group, symmetric)."""
    N, K = shape
    rows = max(BLOCK, RANDOM_ROWS_AT_ONCE // K // BLOCK * BLOCK)
    if fmt not in ("fp8", "int4"):
        out = torch.empty(shape, dtype=fmt, device=g.device)
        for i in range(0, N, rows):
            out[i:i + rows] = random_tensor(name, (min(rows, N - i), K), g)
        return out
    quantize = quantize_ref if fmt == "fp8" else lambda t: int4_quantize(t, int4.group, True)
    parts = [quantize(random_tensor(name, (min(rows, N - i), K), g)) for i in range(0, N, rows)]
    return type(parts[0])(*(None if ts[0] is None else torch.cat(ts) for ts in zip(*parts)))


def interleave_int4(root: nn.Module, together) -> None:
    """The 4-bit weights under `root` stored interleaved (kernels/int4.py interleave_ref) where their
    layout allows (int4.interleavable: no perm, groups of 64 or 128 columns). The 4-bit weights
    under a module that `together` names (an MoE block, whose expert kernels take the shared
    expert with the routed ones in one layout) convert all or none. A weight is converted on its
    device in place of the old one."""
    def fours(module: nn.Module):
        # (name, the weight, or None where its layout does not interleave) of module's own 4-bit weights
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dtype != torch.int32 or not hasattr(module, name + "_scale"):
                continue
            q = GroupInt4(p.data, getattr(module, name + "_scale"), getattr(module, name + "_zero", None))
            yield name, q if interleavable(q) and not hasattr(module, name + "_perm") else None

    def visit(module: nn.Module):
        if together(module):
            found = [(m, name, q) for m in module.modules() for name, q in fours(m)]
            if all(q is not None for _, _, q in found):
                for m, name, q in found:
                    _assign(m, name, interleave_ref(q).w)
            return
        for name, q in fours(module):
            if q is not None:
                _assign(module, name, interleave_ref(q).w)
        for child in module.children():
            visit(child)
    visit(root)


def _assign_product(module: nn.Module, name: str, tensor: torch.Tensor | BlockFP8 | GroupInt4):
    """A parameter as the model keeps it: a tensor, an FP8 one as `<name>` and `<name>_scale`, a
    4-bit one as `<name>` (the packed int32 weights), `<name>_scale` and, where it has them,
    `<name>_zero` and `<name>_perm` (engine/dispatch.py: weight() puts them together again)."""
    if isinstance(tensor, (BlockFP8, GroupInt4)):
        for suffix, part in zip(("", "_scale", "_zero", "_perm"), tensor):
            if part is not None:
                _assign(module, name + suffix, part)
    else:
        _assign(module, name, tensor)


def _assign(module: nn.Module, name: str, tensor: torch.Tensor):
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))
