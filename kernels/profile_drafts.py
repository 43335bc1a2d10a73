"""The drafts of engine/spec.py's ProfileDrafter, from its draws: the float32/int64 torch reference,
the Triton kernel beside it, and `profile_drafts`, which takes the kernel for CUDA tensors and the
reference otherwise.

The drafter stands in for the MTP head's tokens on random weights, so that a benchmark meets a
chosen acceptance: draft i is the reference continuation's token at position + i when draws
0..i all fell under their thresholds, and a wrong token otherwise. It runs eagerly between a step's
draft and its verify, on the GPU's time but not a real head's: torch's uniform draws (so a seed
gives the drafts it gave before), then here one kernel that writes the drafts in place, where torch
took six small kernels and the decoder a copy.

table [2 (n + 1)] long holds the wrong tokens, then the true ones, each followed by a token for
positions past the end of the reference's n: draft i is table[right_i * (n + 1) + min(position + i, n)].
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import tl, triton, use_triton


def profile_drafts_ref(u: torch.Tensor, cond: torch.Tensor, position: torch.Tensor, table: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """u [k] float32 draws, cond [>= k] float32 thresholds, position [1] long -> out [k] long, in place:
    right_i = all(u_j < cond_j for j <= i)."""
    k, n = out.shape[0], table.shape[0] // 2 - 1
    right = (u < cond[:k]).long().cumprod(0)                    # 1 while every draft so far is right
    at = (position.view(-1)[:1] + torch.arange(k, device=out.device)).clamp(max=n)
    return out.copy_(table.index_select(0, at + right * (n + 1)))


@triton.jit(do_not_specialize=["k", "n"])    # one compiled kernel for every k up to 16 and every reference
def _profile_drafts_kernel(u, cond, position, table, out, k, n, BK: tl.constexpr):
    o_i = tl.arange(0, BK)
    m_i = o_i < k
    # a draft is right while no draw up to it failed: the failures counted so far are 0
    b_fail = (tl.load(u + o_i, mask=m_i, other=1.) >= tl.load(cond + o_i, mask=m_i, other=0.)).to(tl.int32)
    b_right = tl.cumsum(b_fail, axis=0) == 0
    b_at = tl.minimum(tl.load(position) + o_i, n)
    b_tok = tl.load(table + b_at + tl.where(b_right, n + 1, 0), mask=m_i)
    tl.store(out + o_i, b_tok, mask=m_i)


def profile_drafts_triton(u: torch.Tensor, cond: torch.Tensor, position: torch.Tensor, table: torch.Tensor,
                          out: torch.Tensor) -> torch.Tensor:
    k = out.shape[0]
    assert u.shape == (k,) and u.dtype == cond.dtype == torch.float32 and cond.numel() >= k, \
        "u must be [k] float32 draws and cond float32 thresholds for at least k drafts"
    assert position.numel() >= 1 and position.dtype == torch.long, "position must be a long tensor"
    assert table.dim() == 1 and table.shape[0] % 2 == 0 and table.dtype == out.dtype == torch.long, \
        "table must hold the wrong then the true tokens (long), out the k drafts (long)"
    assert u.is_contiguous() and cond.is_contiguous() and table.is_contiguous() and out.is_contiguous(), \
        "the kernel reads and writes contiguous tensors"
    _profile_drafts_kernel[(1,)](u, cond, position, table, out, k, table.shape[0] // 2 - 1,
                                 BK=max(16, triton.next_power_of_2(k)), num_warps=1)
    return out


def profile_drafts(u: torch.Tensor, cond: torch.Tensor, position: torch.Tensor, table: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """profile_drafts_ref's contract: the kernel for CUDA tensors, the reference otherwise."""
    if use_triton(out):
        return profile_drafts_triton(u, cond, position, table, out)
    return profile_drafts_ref(u, cond, position, table, out)
