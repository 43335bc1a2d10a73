"""4-bit checkpoints: how GPTQ and compressed-tensors store one linear module, read into the
engine's one 4-bit form (kernels/int4.py: GroupInt4, weight [N, K] as w [N, K / 8] with group
scales [N, K / G], zeros or None, a column order or None).

GPTQ (GPTQModel, AutoGPTQ; the official Qwen "GPTQ-Int4" releases), per module `<m>`:
- `<m>.qweight` int32 [K / 8, N]: weight (k, n) in word k // 8 of column n, bits 4 (k % 8): our
  w transposed;
- `<m>.qzeros` int32 [K / G, N / 8]: group g's zero of row n in word n // 8, bits 4 (n % 8). The
  v1 format (`checkpoint_format` "gptq", the releases') stores zero - 1 (a symmetric checkpoint
  holds 7 in every nibble); v2 stores the zero;
- `<m>.scales` float16 [K / G, N];
- `<m>.g_idx` int32 [K]: the group of each column. In order (k // G) unless desc_act quantized
  the columns in another order; then the columns are sorted by group (kernels/int4.group_order),
  and the product reads x through that order.
compressed-tensors `pack-quantized` (llm-compressor), per module `<m>`:
- `<m>.weight_packed` int32 [N, K / 8]: our w, the values offset by 8 (signed -8 .. 7 stored 0 .. 15);
- `<m>.weight_scale` [N, K / G]; `<m>.weight_shape` [2] = (N, K);
- `<m>.weight_zero_point` int32 [ceil(N / 8), K / G] where asymmetric: packed along the rows
  (row n in word n // 8 of its column), offset by 8 as the weights are;
- `<m>.weight_g_idx` [K] with actorder "group", as GPTQ's g_idx.
"""
from __future__ import annotations

from typing import Callable

import torch

from mtpchat.engine.config import Int4Format
from mtpchat.kernels.int4 import PACK, SYMMETRIC_ZERO, GroupInt4, group_order, pack_ref, permute_columns, unpack_ref

# each method's tensors of one module, the first of them the one that marks a module as 4-bit
TENSORS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"),
           "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                                  "weight_g_idx")}
OPTIONAL = ("g_idx", "weight_g_idx", "weight_zero_point")    # weight_zero_point: required where asymmetric
INT_DTYPES = ("I32", "I64")
SCALE_DTYPES = ("F16", "BF16", "F32")


class Int4TensorError(ValueError):
    """A 4-bit module's tensors are missing, of the wrong type or shape, or inconsistent."""


def tensor_names(fmt: Int4Format, module: str) -> list[str]:
    return [f"{module}.{t}" for t in TENSORS[fmt.method]]


def marker(fmt: Int4Format, module: str) -> str:
    """The tensor whose presence says `module` is stored in 4 bits."""
    return f"{module}.{TENSORS[fmt.method][0]}"


def required(fmt: Int4Format) -> tuple[str, ...]:
    """The tensors every 4-bit module of this format holds (GPTQ writes qzeros even where symmetric)."""
    names = TENSORS[fmt.method]
    return tuple(t for t in names if t not in OPTIONAL or (t == "weight_zero_point" and not fmt.symmetric))


def expected_dtype(tensor: str) -> tuple[str, ...]:
    return SCALE_DTYPES if tensor in ("scales", "weight_scale") else INT_DTYPES


def g_idx_name(fmt: Int4Format, module: str) -> str:
    return f"{module}.{'g_idx' if fmt.method == 'gptq' else 'weight_g_idx'}"


def column_order(g_idx: torch.Tensor | None, group: int, name: str) -> torch.Tensor | None:
    """The columns' order (kernels/int4.group_order) from a g_idx, or None where they are in order."""
    if g_idx is None:
        return None
    try:
        return group_order(g_idx.reshape(-1), group)
    except ValueError as e:
        raise Int4TensorError(f"tensor {name}: {e}; the checkpoint is damaged") from None


def read_module(fmt: Int4Format, module: str, get: Callable[[str], torch.Tensor | None],
                shape: tuple[int, int]) -> GroupInt4:
    """Module `module` (a weight [N, K] = `shape`) as a GroupInt4, its columns in group order. `get`
    gives a tensor by its suffix ("qweight", ...) or None where the checkpoint has none."""
    N, K = shape
    G = fmt.group
    if K % G or K % PACK:
        raise Int4TensorError(f"{module}: {K} columns are not a whole number of groups of {G}; "
                              "config.json's group_size does not belong to this module")

    def need(t: str, want: tuple[int, ...]) -> torch.Tensor:
        x = get(t)
        if x is None:
            raise Int4TensorError(f"tensor {module}.{t} is missing: a 4-bit module of this checkpoint needs "
                                  f"{', '.join(required(fmt))}; the checkpoint is incomplete or damaged")
        if tuple(x.shape) != want:
            raise Int4TensorError(f"tensor {module}.{t} has shape {list(x.shape)}, expected {list(want)} for a "
                                  f"[{N}, {K}] weight in groups of {G}")
        return x

    if fmt.method == "gptq":
        q = unpack_ref(need("qweight", (K // PACK, N)).to(torch.int32).t().contiguous())        # [N, K]
        stored = unpack_ref(need("qzeros", (K // G, -(-N // PACK))).to(torch.int32))[:, :N]     # [K/G, N]
        scale = need("scales", (K // G, N)).t()
        zero = ((stored + 1) & 0xF if fmt.v1_zeros else stored).t()   # v1: zero - 1 (a zero of 0 wrapped to 15)
        g_idx = get("g_idx")
        g_name = "g_idx"
    else:
        q = unpack_ref(need("weight_packed", (N, K // PACK)).to(torch.int32))
        scale = need("weight_scale", (N, K // G))
        dims = get("weight_shape")
        if dims is not None and dims.reshape(-1).tolist() != [N, K]:
            raise Int4TensorError(f"tensor {module}.weight_shape says {dims.reshape(-1).tolist()}, expected {[N, K]}")
        zero = None
        if not fmt.symmetric:
            zero = unpack_ref(need("weight_zero_point", (-(-N // PACK), K // G)).to(torch.int32).t().contiguous())
            zero = zero[:, :N].t()                                                              # [N, K/G]
        g_idx = get("weight_g_idx")
        g_name = "weight_g_idx"
    if g_idx is not None and tuple(g_idx.shape) != (K,):
        raise Int4TensorError(f"tensor {module}.{g_name} has shape {list(g_idx.shape)}, expected [{K}]")
    perm = column_order(g_idx, G, f"{module}.{g_name}")
    if perm is not None:
        q = permute_columns(q, perm)
    if fmt.symmetric:
        if zero is not None and not bool((zero == SYMMETRIC_ZERO).all()):
            raise Int4TensorError(f"tensor {module}.qzeros holds zeros other than {SYMMETRIC_ZERO} (stored as "
                                  f"{SYMMETRIC_ZERO - 1} in GPTQ v1) though config.json says sym: the config "
                                  "does not belong to these weights")
        zero = None
    scale = scale.contiguous() if scale.dtype in (torch.float16, torch.float32) else scale.float().contiguous()
    return GroupInt4(pack_ref(q), scale, None if zero is None else zero.to(torch.uint8).contiguous(), perm)
