"""Causal depthwise conv1d over the GDN q/k/v channels, with a rolling window, silu fused.
Float32 torch reference; the engine runs it on the CPU.

The window buffer `buf` [C, W] (W = K-1 + k_max+1 columns, model dtype) holds pre-conv inputs. The
committed window is the K-1 columns starting at `off` (a device tensor). A call with T new inputs
writes [window | inputs] to the front of the buffer when it fits, so accepting n of the T tokens
commits offset n with no copy; a long prefill call keeps only the last K-1 inputs (offset 0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_update_ref(x: torch.Tensor, buf: torch.Tensor, off: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, C] pre-conv inputs, buf [C, W], off 1-element long tensor, weight [C, K] -> silu(conv) [T, C].

    Each output is an explicit K-term sum, so its value does not depend on T (row invariance).
    """
    T, C = x.shape
    K = weight.shape[1]
    cols = off + torch.arange(K - 1, device=buf.device)
    window = buf.index_select(1, cols)                                  # [C, K-1]
    full = torch.cat([window, x.T.to(buf.dtype)], dim=1)                # [C, K-1+T]
    w = weight.float()
    y = sum(w[:, j, None] * full[:, j:j + T].float() for j in range(K))  # [C, T]
    if K - 1 + T <= buf.shape[1]:
        buf[:, :K - 1 + T] = full
    else:
        buf[:, :K - 1] = full[:, T:]
    return F.silu(y).T.to(x.dtype)


def committed_offset(T: int, used: int, K: int, width: int) -> int:
    """Offset of the committed window after a call of T inputs of which the first `used` are kept."""
    if K - 1 + T <= width:
        return used
    assert used == T, "a call longer than the window can only be committed whole"
    return 0
