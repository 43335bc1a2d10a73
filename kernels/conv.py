"""Causal depthwise conv1d over the GDN q/k/v channels, with a rolling window, silu fused: the
float32 torch reference, the Triton kernel beside it, and `conv_update`, which picks the kernel for
CUDA tensors and the reference otherwise.

The window buffer `buf` [C, W] (W = K-1 + k_max+1 columns, model dtype) is a ring of pre-conv
inputs: the committed window is the K-1 columns from `off` (a device tensor that only grows;
column j of the window is column (off + j) mod W). A call with T new inputs reads the window and
writes input t at column (off + K-1 + t) mod W, the last W of them where more come (a prefill).
Accepting n of a step's T tokens commits off + n, with nothing copied; a step (T <= W - (K-1))
writes none of the columns it reads, and the window is never copied to the buffer's front. An
optional `live` (1-element long tensor)
of 0 leaves the buffer as it was: a step launched after its generation ended must not touch the
state.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mtpchat.kernels._triton import pdl, pdl_start, tl, triton, use_triton


def window_columns(off: torch.Tensor, K: int, width: int) -> torch.Tensor:
    """The buffer columns of the committed window [K-1] (long) for offset `off` in a ring of `width`."""
    return (off + torch.arange(K - 1, device=off.device)) % width


def conv_update_ref(x: torch.Tensor, buf: torch.Tensor, off: torch.Tensor, weight: torch.Tensor,
                    live: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] pre-conv inputs, buf [C, W], off 1-element long tensor, weight [C, K] -> silu(conv) [T, C].

    Each output is an explicit K-term sum, so its value does not depend on T (row invariance).
    """
    T, C = x.shape
    K, W = weight.shape[1], buf.shape[1]
    window = buf.index_select(1, window_columns(off, K, W))                  # [C, K-1]
    full = torch.cat([window, x.T.to(buf.dtype)], dim=1)                # [C, K-1+T]
    w = weight.float()
    y = sum(w[:, j, None] * full[:, j:j + T].float() for j in range(K))  # [C, T]
    kept = min(T, W)                                                    # the last W inputs (a prefill)
    cols = (off + K - 1 + torch.arange(T - kept, T, device=buf.device)) % W
    new = full[:, K - 1 + T - kept:]
    if live is not None:
        new = torch.where(live > 0, new, buf.index_select(1, cols))
    buf.index_copy_(1, cols, new)
    return F.silu(y).T.contiguous().to(x.dtype)   # [T, C] rows contiguous, as a 1-token call gives


@triton.jit
def _conv_block(x, buf, w, y, T, WIDTH, s_x, s_y, i_t, i_off, o_c, m_c, p_buf,
                K: tl.constexpr, BT: tl.constexpr):
    """Token block i_t's outputs for channels o_c (m_c): silu of the K-term causal sums over
    [window | inputs], the window (buffer columns from i_off) read by block 0 only."""
    o_t = i_t * BT + tl.arange(0, BT)
    b_y = tl.zeros([BT, o_c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(K):
        # column t + j of [window | inputs]: a window column while it is < K-1, else input t+j-(K-1)
        o_src = o_t + j - (K - 1)
        m_x = (o_src >= 0)[:, None] & (o_src < T)[:, None] & m_c[None, :]
        b_x = tl.load(x + o_src[:, None] * s_x + o_c[None, :], mask=m_x, other=0.)
        b_x = b_x.to(buf.dtype.element_ty).to(tl.float32)
        if i_t == 0:
            m_w = (o_src < 0)[:, None] & m_c[None, :]
            b_x += tl.load(p_buf[None, :] + (i_off + K - 1 + o_src)[:, None] % WIDTH, mask=m_w,
                           other=0.).to(tl.float32)
        b_y += tl.load(w + o_c * K + j, mask=m_c, other=0.).to(tl.float32)[None, :] * b_x
    b_y = b_y * tl.sigmoid(b_y)
    tl.store(y + o_t[:, None] * s_y + o_c[None, :], b_y.to(y.dtype.element_ty), mask=(o_t < T)[:, None] & m_c[None, :])


@triton.jit(do_not_specialize=["T"])
def _conv_update_kernel(x, buf, off, live, w, y, T, C, WIDTH, s_x, s_y, s_buf,
                        K: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, WP: tl.constexpr,
                        HAS_LIVE: tl.constexpr, PDL: tl.constexpr, NBT: tl.constexpr = 1):
    # One program per (BC channels, NBT blocks of BT tokens, in turn: with more than one, a loop
    # the compiler pipelines two deep; blocks past T store nothing). Only the first token block
    # reads the committed window, and only its program writes the buffer, after its own reads (a
    # prefill's last inputs may land on the window's columns): no other program touches the
    # buffer, so there is no ordering to arrange between programs. One block (a step, and prefill
    # by default) runs without the loop, the code it had before blocks came.
    pdl_start(PDL)
    i_c, i_s = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    i_off = tl.load(off)
    p_buf = buf + o_c * s_buf
    if NBT == 1:
        _conv_block(x, buf, w, y, T, WIDTH, s_x, s_y, i_s, i_off, o_c, m_c, p_buf, K, BT)
    else:
        for i in tl.range(0, NBT, num_stages=2):
            _conv_block(x, buf, w, y, T, WIDTH, s_x, s_y, i_s * NBT + i, i_off, o_c, m_c, p_buf, K, BT)
    if HAS_LIVE:
        m_c = m_c & (tl.zeros([BC], dtype=tl.int64) + tl.load(live) > 0)   # an ended generation's step writes nothing
    if i_s == 0:
        # the last min(T, W) inputs, input t at column (off + K-1 + t) mod W
        o_w = tl.arange(0, WP)
        kept = tl.minimum(T, WIDTH)
        o_in = T - kept + o_w
        m_in = m_c[:, None] & (o_w < kept)[None, :]
        b_in = tl.load(x + o_in[None, :] * s_x + o_c[:, None], mask=m_in, other=0.)
        tl.debug_barrier()   # every read of the old window is done before the buffer is written
        tl.store(p_buf[:, None] + ((i_off + K - 1 + o_in) % WIDTH)[None, :], b_in.to(buf.dtype.element_ty), mask=m_in)


class ConvStep(NamedTuple):
    """A step's causal conv handed to the product that makes its inputs (matvec's `conv`, the GDN
    in_proj): the product's first `channels` output columns are the pre-conv q | k | v, and its
    kernel, once a column block's sums are stored, reads them back with the window, writes them
    into the ring and replaces them with silu(conv), as conv_update does: no kernel of its own.
    Each output is the same K-term sum in the same order as _conv_block's, so a token takes the
    same bits through either."""
    buf: torch.Tensor                   # [C, W] the window's ring (conv_update's buf)
    off: torch.Tensor                   # [1] long: the committed window's offset
    weight: torch.Tensor                # [C, K]
    live: torch.Tensor | None           # [1] long, or None
    channels: int                       # C: the product's columns that go through the conv

    def check(self, T: int, dtype: torch.dtype) -> None:
        C, K, W = self.channels, self.weight.shape[1], self.buf.shape[1]
        assert self.buf.shape[0] == C and self.buf.stride(1) == 1 and self.buf.dtype == dtype, \
            f"the conv's buf must be [{C}, W] in the rows' dtype with contiguous rows"
        assert self.weight.shape == (C, K) and self.weight.is_contiguous(), f"the conv's weight must be [{C}, K] contiguous"
        assert T <= W - (K - 1), f"a product's conv takes a step ({W - (K - 1)} tokens at most), not {T}"
        assert self.off.numel() == 1 and self.off.dtype == torch.long, "off must be a 1-element long tensor"
        assert self.live is None or (self.live.numel() == 1 and self.live.dtype == torch.long), \
            "live must be a 1-element long tensor"

    def args(self) -> dict:
        """The product kernel's launch arguments for it (conv_columns')."""
        return dict(cbuf=self.buf, coff=self.off, clive=self.live if self.live is not None else self.off,
                    cw=self.weight, CC=self.channels, CWIDTH=self.buf.shape[1], s_cbuf=self.buf.stride(0),
                    CK=self.weight.shape[1], CLIVE=self.live is not None)


def conv_step_ref(y: torch.Tensor, conv: ConvStep) -> torch.Tensor:
    """A product's output y [T, N] after its conv (ConvStep): the first C columns through
    conv_update_ref (the window updated), the rest as they were."""
    C = conv.channels
    out = y.clone()
    out[:, :C] = conv_update_ref(y[:, :C], conv.buf, conv.off, conv.weight, conv.live)
    return out


@triton.jit
def conv_columns(y, o_n, m_n, T, s_y, buf, off, live, w, C, WIDTH, s_buf,
                 K: tl.constexpr, BT: tl.constexpr, HAS_LIVE: tl.constexpr):
    """A product program's conv (ConvStep), after it stored y's columns o_n (m_n) for rows 0 .. T-1:
    for the columns below C, each row's K-term causal sum over [window | the rows] (the window's
    K-1 columns from the ring at off), silu, written over y; the rows' pre-conv values written into
    the ring at (off + K-1 + t) mod WIDTH (not for an ended generation's step: live 0). A step writes
    no column of the ring it reads (T <= WIDTH - (K-1)). The sums as _conv_block's, term by term."""
    tl.debug_barrier()      # the block's stores, by all its threads, are read back below
    m_c = m_n & (o_n < C)
    o_t = tl.arange(0, BT)
    m_t = o_t < T
    i_off = tl.load(off)
    p_buf = buf + o_n * s_buf
    b_y = tl.zeros([o_n.shape[0], BT], dtype=tl.float32)
    for j in tl.static_range(K):
        o_src = o_t + j - (K - 1)       # column t + j of [window | rows]: a window column while < 0
        m_x = m_c[:, None] & (o_src >= 0)[None, :] & (o_src < T)[None, :]
        b_x = tl.load(y + o_src[None, :] * s_y + o_n[:, None], mask=m_x, other=0.)
        b_x = b_x.to(buf.dtype.element_ty).to(tl.float32)
        m_w = m_c[:, None] & (o_src < 0)[None, :]
        b_x += tl.load(p_buf[:, None] + ((i_off + K - 1 + o_src) % WIDTH)[None, :], mask=m_w, other=0.).to(tl.float32)
        b_y += tl.load(w + o_n * K + j, mask=m_c, other=0.).to(tl.float32)[:, None] * b_x
    b_y = b_y * tl.sigmoid(b_y)
    m_y = m_c[:, None] & m_t[None, :]
    b_in = tl.load(y + o_t[None, :] * s_y + o_n[:, None], mask=m_y, other=0.)
    m_b = m_y
    if HAS_LIVE:
        m_b = m_b & (tl.zeros([o_n.shape[0], BT], dtype=tl.int64) + tl.load(live) > 0)
    tl.debug_barrier()      # every read of the pre-conv values is done before they are overwritten
    tl.store(p_buf[:, None] + ((i_off + K - 1 + o_t) % WIDTH)[None, :], b_in.to(buf.dtype.element_ty), mask=m_b)
    tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_y.to(y.dtype.element_ty), mask=m_y)


def _tile() -> tuple[int, int]:
    """(channels a program, warps)."""
    return 64, 4


def conv_update_triton(x: torch.Tensor, buf: torch.Tensor, off: torch.Tensor, weight: torch.Tensor,
                       live: torch.Tensor | None = None, tokens: int = 16, blocks: int = 1) -> torch.Tensor:
    """conv_update_ref's contract, `tokens` tokens a block (a power of two, at least K-1: only the
    first token block reads the window; a prefill may take more than a step's 16:
    KernelPlan.prefill_conv_tokens) and `blocks` blocks a program, in turn
    (KernelPlan.prefill_conv_blocks). An output's value depends on neither."""
    T, C = x.shape
    K = weight.shape[1]
    assert x.stride(1) == 1, "x rows must be contiguous"
    assert buf.shape[0] == C and buf.stride(1) == 1, f"buf must be [{C}, W] with contiguous rows"
    assert buf.shape[1] >= K - 1, f"buf must hold the window's {K - 1} columns"
    assert weight.shape == (C, K) and weight.is_contiguous(), f"weight must be [{C}, K] contiguous"
    assert off.numel() == 1 and off.dtype == torch.long, "off must be a 1-element long tensor"
    assert live is None or (live.numel() == 1 and live.dtype == torch.long), "live must be a 1-element long tensor"
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    assert tokens >= K - 1 and tokens & (tokens - 1) == 0, \
        f"tokens a program must be a power of two of at least {K - 1} (the window), got {tokens}"
    assert blocks >= 1, f"token blocks a program: at least 1, got {blocks}"
    (BC, warps), BT = _tile(), tokens
    # `blocks` as it is, not capped by T: one compiled variant for every prompt length
    _conv_update_kernel[(triton.cdiv(C, BC), triton.cdiv(T, BT * blocks))](
        x, buf, off, live if live is not None else off, weight, y, T, C, buf.shape[1], x.stride(0), y.stride(0),
        buf.stride(0), K=K, BC=BC, BT=BT, WP=triton.next_power_of_2(buf.shape[1]),
        HAS_LIVE=live is not None, NBT=blocks, num_warps=warps, **pdl(x))
    return y


def conv_update(x: torch.Tensor, buf: torch.Tensor, off: torch.Tensor, weight: torch.Tensor,
                live: torch.Tensor | None = None, tokens: int = 16, blocks: int = 1) -> torch.Tensor:
    """conv_update_ref's contract; the Triton kernel for CUDA tensors (`tokens` a block, `blocks`
    blocks a program)."""
    if use_triton(x, weight):
        return conv_update_triton(x, buf, off, weight, live, tokens, blocks)
    return conv_update_ref(x, buf, off, weight, live)
