"""Prefill's products over 4-bit weights (kernels/int4.py): y [T, N] = x [T, K] @ w [N, K]ᵀ for many
rows, in one Triton kernel that dequantizes each weight tile in registers (int4.dot_int4, as the
few-row products do) and never writes a dense copy of the weight.

Why a kernel of its own and not a dequantize kernel with torch's matmul after it: the dense bf16
copy of a 27B product (the MLP's gate|up, 34816 x 5120) is 356 MB written and read again each
call, four times the 4-bit weight's bytes, and memory the 4-bit model was chosen to save. Here a
program takes a tile of BM rows of x by BN rows of w; the weight tiles are unpacked to exact bf16
integers, multiplied with x's rows one group at a time, and each group's float32 result is scaled
in float32. The x tile is read through perm where the weight has one (GPTQ's desc_act).

First correct, not yet tuned: the tile (BM, BN, BK, warps, stages) is one sensible choice; the
weight rows are the dot's M ([BN, G] @ [G, BM]), as in the few-row kernels.
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import tl, triton, use_triton
from mtpchat.kernels.int4 import GroupInt4, check_int4, dequantize_ref, dot_int4, form_args
from mtpchat.kernels.plan import ProductPlan

TILE = (64, 128, 128, 8, 3)      # BM rows of x, BN rows of w, BK columns, warps, stages


def gemm_ref(x: torch.Tensor, w: GroupInt4) -> torch.Tensor:
    """x @ dequantize_ref(w)ᵀ in float32, cast to x's dtype."""
    return (x.float() @ dequantize_ref(w).T).to(x.dtype)


@triton.jit
def _gemm_kernel(x, w, sw, y, T, N, K, s_x, s_w, s_sw, s_y, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, zw=None, perm=None, SLICES: tl.constexpr = False):
    # program (i_m, i_n): rows i_m BM.. of x, weight rows i_n BN..; acc [BN, BM] is yᵀ's tile
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < T, o_n < N
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k in range(0, K, BK):
        acc = dot_int4(acc, w, sw, zw, perm, o_n, m_n, s_w, s_sw, x + o_m[None, :] * s_x, m_m, k, K, BK, G, BG,
                       SLICES)
    tl.store(y + o_m[None, :] * s_y + o_n[:, None], acc.to(y.dtype.element_ty), mask=m_n[:, None] & m_m[None, :])


def gemm_triton(x: torch.Tensor, w: GroupInt4, tile: tuple[int, int, int, int, int] = TILE,
                plan: ProductPlan | None = None) -> torch.Tensor:
    """`plan`: its int4_form (int4.form_args); the reshape form where it names none."""
    T, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and x.stride(1) == 1, f"x [T, K] and w [N, K] disagree: {tuple(x.shape)}, {tuple(w.shape)}"
    check_int4(w, K)
    assert w.perm is None or w.perm.dim() == 1, "a product's perm is [K]"
    BM, BN, BK, warps, stages = tile
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _gemm_kernel[(triton.cdiv(T, BM), triton.cdiv(N, BN))](
        x, w.w, w.scale, y, T, N, K, x.stride(0), w.w.stride(0), w.scale.stride(0), y.stride(0),
        BM=BM, BN=BN, BK=BK, G=w.group, zw=w.zero, perm=w.perm,
        **form_args(BK, w.group, plan.int4_form if plan is not None and plan.int4_form is not None else "reshape"),
        num_warps=warps, num_stages=stages)
    return y


def gemm(x: torch.Tensor, w: GroupInt4, plan: ProductPlan | None = None) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ -> [T, N] in x's dtype, for any number of rows: the Triton kernel for
    CUDA tensors, the float32 reference otherwise."""
    return gemm_triton(x, w, plan=plan) if use_triton(x, w.w) else gemm_ref(x, w)
