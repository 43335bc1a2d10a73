"""Attention over the KV cache for decode and verify: q_len 1..k+1 new tokens, GQA, causal among
the new tokens. Float32 torch reference; the engine runs it on the CPU.

q [T, Hq, D] holds the new tokens at positions start..start+T-1, whose keys and values are already
in the cache; k_cache, v_cache [L, Hkv, D]. Query head h reads kv head h // (Hq // Hkv).
"""
from __future__ import annotations

import torch


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         start: int, scale: float) -> torch.Tensor:
    """-> [T, Hq, D] in q's dtype. Each row is computed on its own (keys 0..start+t), so a row's
    value does not depend on how many rows the call has."""
    T, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    out = []
    for t in range(T):
        n = start + t + 1
        k = k_cache[:n].float().repeat_interleave(group, dim=1)          # [n, Hq, D]
        v = v_cache[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[t].float(), k) * scale      # [Hq, n]
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out).to(q.dtype)
