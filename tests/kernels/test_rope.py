"""The fused q/k norm + partial RoPE (+ cache write) against its float32 reference."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels.rope import norm_rope_ref, norm_rope_triton

EPS = 1e-6


def inv_freq(rotary: int, theta: float = 1e7) -> torch.Tensor:
    return theta ** (-torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,D,R", [(1, 3, 64, 16), (5, 2, 48, 12), (3, 4, 256, 64)])
def test_norm_rope(device, dtype, T, H, D, R):
    g = torch.Generator().manual_seed(T * 10 + H)
    qg = randn(T, H, 2 * D, dtype=dtype, device=device, gen=g)
    x = qg[..., :D]                                           # a strided view, as q inside q|gate
    w = randn(D, dtype=dtype, device=device, gen=g, scale=0.3)
    pos = torch.tensor([1000 + 37 * t for t in range(T)], device=device)
    f = inv_freq(R).to(device)
    check(norm_rope_triton(x, w, pos, f, EPS), norm_rope_ref(x, w, pos, f, EPS), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_writes_the_cache_rows(device, dtype):
    T, H, D, R, L = 4, 2, 32, 8, 23
    g = torch.Generator().manual_seed(7)
    x = randn(T, H, D, dtype=dtype, device=device, gen=g)
    w = randn(D, dtype=dtype, device=device, gen=g, scale=0.3)
    pos = torch.tensor([9, 10, 11, 12], device=device)
    f = inv_freq(R).to(device)
    cache = randn(L, H, D, dtype=dtype, device=device, gen=g)
    want = norm_rope_ref(x, w, pos, f, EPS, cache.clone(), pos)
    got = norm_rope_triton(x, w, pos, f, EPS, cache.clone(), pos)
    check(got, want, TOL[dtype], "cache")
    untouched = [i for i in range(L) if i not in (9, 10, 11, 12)]
    assert torch.equal(got[untouched], cache[untouched]), "rows other than the positions must not change"


def test_reference_matches_the_model_formula():
    # rmsnorm (1+w) per head, then rotate_half-style RoPE on the first R dims, as qwen35-model.md §4
    T, H, D, R = 3, 2, 16, 8
    x, w = randn(T, H, D, seed=1), randn(D, seed=2, scale=0.3)
    pos = torch.tensor([0, 5, 17])
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1 + w)
    ang = pos[:, None].float() * inv_freq(R)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = y[..., :R]
    half = torch.cat([-rot[..., R // 2:], rot[..., :R // 2]], -1)
    want = torch.cat([rot * cos + half * sin, y[..., R:]], -1)
    check(norm_rope_ref(x, w, pos, inv_freq(R), EPS), want, 1e-6)
