"""The fused q/k norm + partial RoPE with the k and v cache writes against its float32 reference."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels.rope import norm_rope_ref, qkv_norm_rope_ref, qkv_norm_rope_triton

EPS = 1e-6


def inv_freq(rotary: int, theta: float = 1e7) -> torch.Tensor:
    return theta ** (-torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)


def _qkv(T, Hq, Hkv, D, dtype, device, seed):
    """q, k, v as strided views into one fused projection row, as the model has them."""
    g = torch.Generator().manual_seed(seed)
    row = randn(T, Hq * 2 * D + 2 * Hkv * D, dtype=dtype, device=device, gen=g)
    qg, k, v = row.split([Hq * 2 * D, Hkv * D, Hkv * D], dim=-1)
    q = qg.view(T, Hq, 2 * D)[..., :D]
    return q, k.view(T, Hkv, D), v.view(T, Hkv, D), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,Hq,Hkv,D,R,L", [(1, 3, 1, 64, 16, 40), (5, 4, 2, 48, 12, 23), (3, 6, 2, 256, 64, 1100)])
@pytest.mark.parametrize("rows", [1, 4])      # tokens a program: a step's 1, a prefill's tiles (the last partial)
def test_qkv_norm_rope(device, dtype, T, Hq, Hkv, D, R, L, rows):
    q, k, v, g = _qkv(T, Hq, Hkv, D, dtype, device, seed=T * 10 + Hq)
    qw = randn(D, dtype=dtype, device=device, gen=g, scale=0.3)
    kw = randn(D, dtype=dtype, device=device, gen=g, scale=0.3)
    pos = torch.tensor([L - T - 3 + t for t in range(T)], device=device)
    f = inv_freq(R).to(device)
    kc, vc = randn(L, Hkv, D, dtype=dtype, device=device, gen=g), randn(L, Hkv, D, dtype=dtype, device=device, gen=g)
    want_k, want_v = kc.clone(), vc.clone()
    want_q = qkv_norm_rope_ref(q, k, v, qw, kw, pos, f, EPS, want_k, want_v)
    got_k, got_v = kc.clone(), vc.clone()
    got_q = qkv_norm_rope_triton(q, k, v, qw, kw, pos, f, EPS, got_k, got_v, rows=rows)
    check(got_q, want_q, TOL[dtype], "q")
    check(got_k, want_k, TOL[dtype], "k cache")
    assert torch.equal(got_v, want_v), "v is copied into its cache rows as it is"
    untouched = [i for i in range(L) if i not in pos.tolist()]
    assert torch.equal(got_k[untouched], kc[untouched]) and torch.equal(got_v[untouched], vc[untouched]), \
        "rows other than the positions must not change"
    assert not torch.equal(want_k[pos], k), "the k rows are normalised and rotated, not copied"


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


@pytest.mark.parametrize("T", [2, 4])
@pytest.mark.parametrize("rows", [1, 2])
def test_qkv_norm_rope_consecutive_positions(device, T, rows):
    # positions [1]: the first of T consecutive ones, as a step passes them; the same as spelled out
    q, k, v, g = _qkv(T, 3, 1, 64, torch.float32, device, seed=70 + T)
    qw, kw = randn(64, device=device, gen=g, scale=0.3), randn(64, device=device, gen=g, scale=0.3)
    f, L = inv_freq(16).to(device), 30
    kc, vc = randn(L, 1, 64, device=device, gen=g), randn(L, 1, 64, device=device, gen=g)
    start = torch.tensor([L - T - 2], device=device)
    spelled = start + torch.arange(T, device=device)
    outs = []
    tiles = dict(rows=rows)
    for pos, fn, kw_ in ((spelled, qkv_norm_rope_triton, tiles), (start, qkv_norm_rope_triton, tiles),
                         (start, qkv_norm_rope_ref, {})):
        kk, vv = kc.clone(), vc.clone()
        outs.append((fn(q, k, v, qw, kw, pos, f, EPS, kk, vv, **kw_), kk, vv))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    for a, b in zip(outs[1], outs[2]):
        check(a, b, TOL[torch.float32])
