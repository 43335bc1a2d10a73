"""RMSNorm variants of Qwen3.5. Float32 torch references; the engine runs them on the CPU.

rmsnorm:       y = x * rsqrt(mean(x²) + eps) * (1 + w), computed in float32, cast to x's dtype
               (the weights are stored zero-centred).
gated_rmsnorm: the GDN output norm, per head: normalise in float32, cast, times w (plain, not 1+w),
               times silu(z) in float32, cast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add fused with the next norm: returns (norm(x + residual), x + residual)."""
    h = x + residual
    return rmsnorm_ref(h, weight, eps), h


def gated_rmsnorm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z [..., D]; weight [D]."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y * F.silu(z.float())).to(x.dtype)
