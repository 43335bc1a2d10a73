"""Attention over the KV cache for decode and verify: q_len 1..k+1 new tokens, GQA, causal among
the new tokens. The float32 torch reference, the Triton kernels beside it, and `decode_attention`,
which takes the kernels for CUDA tensors and the reference otherwise; below them prefill's output
gate. A prefill chunk's attention is in attention_chunk.py.

q [T, Hq, D] holds the new tokens at positions start..start+T-1, whose keys and values are already
in the cache; k_cache, v_cache [L, Hkv, D]. Query head h reads kv head h // (Hq // Hkv).

The kernels split the keys into fixed spans (a function of the cache size only): the first
FIRST spans of BN keys, the rest of SPLIT keys (so a short context is spread over many programs
and a long one over few spans); one program per (span, kv head, block of query rows) computes a
partial softmax, a second kernel combines the spans of each row in span order. The start is read
from a device tensor, so a CUDA graph captured once serves every length. Row t sees exactly the
spans and blocks it would see in a 1-row call at start + t, and masked keys add exact zeros, so a
row's result does not depend on T.
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import interpreting, pdl, pdl_start, tl, triton, use_triton
from mtpchat.kernels.fp8 import BLOCK, FP8
from mtpchat.kernels.fp8_gemm import CUBLAS_ROWS, QuantizedRows, quantize_tile
from mtpchat.kernels.plan import ProductPlan, default_products


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         start: int, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """-> [T, Hq, D] in q's dtype, times sigmoid(gate [T, Hq, D]) when a gate is given (the output
    gate of Qwen3.5's attention, each step rounded to q's dtype as torch does it). Each row is
    computed on its own (keys 0..start+t), so a row's value does not depend on how many rows the
    call has."""
    T, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    out = []
    for t in range(T):
        n = start + t + 1
        k = k_cache[:n].float().repeat_interleave(group, dim=1)          # [n, Hq, D]
        v = v_cache[:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[t].float(), k) * scale      # [Hq, n]
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    o = torch.stack(out).to(q.dtype)
    return o if gate is None else o * torch.sigmoid(gate)


@triton.jit
def _span_start(i_s, BN: tl.constexpr, FIRST: tl.constexpr, SPLIT: tl.constexpr):
    """The first key of span i_s: FIRST spans of BN keys, then spans of SPLIT."""
    return tl.where(i_s < FIRST, i_s * BN, FIRST * BN + (i_s - FIRST) * SPLIT)


@triton.jit
def _spans_to(last, BN: tl.constexpr, FIRST: tl.constexpr, SPLIT: tl.constexpr):
    """How many spans hold keys 0..last."""
    return tl.where(last < FIRST * BN, last // BN + 1, FIRST + (last - FIRST * BN) // SPLIT + 1)


@triton.jit(do_not_specialize=["T"])
def _attn_split_kernel(q, k_cache, v_cache, start, ws_m, ws_l, ws_o, T, scale,
                       s_qt, s_qh, s_kl, s_kh, s_vl, s_vh,
                       HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, FIRST: tl.constexpr, SPLIT: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_start(PDL)
    i_s, i_kv, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b_start = tl.load(start)
    lo = _span_start(i_s, BN, FIRST, SPLIT)
    hi = tl.minimum(_span_start(i_s + 1, BN, FIRST, SPLIT), b_start + T)
    if lo < hi:
        # rows are (token t, head g of this kv head's group), token-major
        o_r = i_m * BM + tl.arange(0, BM)
        o_t, o_g = o_r // GROUP, o_r % GROUP
        m_r = o_t < T
        o_h = i_kv * GROUP + o_g
        o_d = tl.arange(0, D)
        b_q = tl.load(q + o_t[:, None] * s_qt + o_h[:, None] * s_qh + o_d[None, :], mask=m_r[:, None], other=0.)
        b_last = b_start + o_t                                   # the last key row t may see
        b_m = tl.full([BM], float("-inf"), tl.float32)
        b_l = tl.zeros([BM], tl.float32)
        b_o = tl.zeros([BM, D], tl.float32)
        for n in range(lo, hi, BN):
            o_n = n + tl.arange(0, BN)
            m_n = o_n < hi
            b_k = tl.load(k_cache + o_n[:, None] * s_kl + i_kv * s_kh + o_d[None, :], mask=m_n[:, None], other=0.)
            # "ieee" keeps float32 caches exact (no tf32); bf16 ones take the tensor cores regardless
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale        # [BM, BN]
            b_s = tl.where(o_n[None, :] <= b_last[:, None], b_s, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
            b_ms = tl.where(b_mn == float("-inf"), 0., b_mn)    # a row with no key yet stays at 0
            b_p = tl.exp(b_s - b_ms[:, None])
            b_alpha = tl.exp(b_m - b_ms)
            b_v = tl.load(v_cache + o_n[:, None] * s_vl + i_kv * s_vh + o_d[None, :], mask=m_n[:, None], other=0.)
            b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
            b_o = b_o * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision="ieee")
            b_m = b_mn
        o_w = (i_s * T + o_t) * HQ + o_h                          # partials [span, T, Hq]
        tl.store(ws_m + o_w, b_m, mask=m_r)
        tl.store(ws_l + o_w, b_l, mask=m_r)
        tl.store(ws_o + o_w[:, None] * D + o_d[None, :], b_o, mask=m_r[:, None])


@triton.jit(do_not_specialize=["T"])
def _attn_combine_kernel(start, ws_m, ws_l, ws_o, gate, out, T, s_gt, s_gh, s_ot, s_oh,
                         HQ: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, FIRST: tl.constexpr,
                         SPLIT: tl.constexpr, BS: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr):
    # One program per (token, query head); spans are folded BS at a time into BS lanes, then the
    # lanes are summed: a fixed order for a given number of spans, which depends on the row alone.
    pdl_start(PDL)
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_d = tl.arange(0, D)
    n_spans = _spans_to(tl.load(start) + i_t, BN, FIRST, SPLIT)   # the spans holding keys 0..start+t
    b_mx = tl.full([BS], float("-inf"), tl.float32)
    for i_s in range(0, n_spans, BS):
        o_s = i_s + tl.arange(0, BS)
        b_mx = tl.maximum(b_mx, tl.load(ws_m + (o_s * T + i_t) * HQ + i_h, mask=o_s < n_spans, other=float("-inf")))
    b_max = tl.max(b_mx, axis=0)                                 # finite: span 0 always has keys
    b_l = tl.zeros([BS], tl.float32)
    b_o = tl.zeros([BS, D], tl.float32)
    for i_s in range(0, n_spans, BS):
        o_s = i_s + tl.arange(0, BS)
        m_s = o_s < n_spans
        o_w = (o_s * T + i_t) * HQ + i_h
        b_w = tl.exp(tl.load(ws_m + o_w, mask=m_s, other=float("-inf")) - b_max)   # 0 past the row's spans
        b_l += b_w * tl.load(ws_l + o_w, mask=m_s, other=0.)
        b_o += b_w[:, None] * tl.load(ws_o + o_w[:, None] * D + o_d[None, :], mask=m_s[:, None], other=0.)
    b_out = tl.sum(b_o, axis=0) / tl.sum(b_l, axis=0)
    if HAS_GATE:
        # o * sigmoid(gate), each rounded to the output dtype as the model does it in torch
        b_g = tl.load(gate + i_t * s_gt + i_h * s_gh + o_d).to(tl.float32)
        b_sig = tl.sigmoid(b_g).to(out.dtype.element_ty).to(tl.float32)
        b_out = b_out.to(out.dtype.element_ty).to(tl.float32) * b_sig
    tl.store(out + i_t * s_ot + i_h * s_oh + o_d, b_out.to(out.dtype.element_ty))


MAX_SPANS = 128


def _config(L: int, itemsize: int = 2, D: int = 256, plan: ProductPlan | None = None,
            BM: int = 32) -> tuple[int, int, int, int, int]:
    """(spans of BN keys first, keys per later span, BN, warps, stages) for a cache of L rows: a
    function of L and the dtype alone, never of the length or of T, which keeps rows invariant.
    float32 caches take tiles of 32 keys, one deep: at head_dim 256 the bf16 tiles, three deep,
    would need 296 KB of shared memory in float32 (an H100 has 227 KB a program). At most about
    MAX_SPANS spans of the larger size: on an H100 with a 32K cache this took 15 us per layer at
    1K context and 74 at 32K; 32 spans, 37 and 54. The first 1,024 keys come in spans of 64, so a
    short context still has many programs. The 27B decode step with a 32K cache on an H100
    (tests/bench/ab_step.py, its since removed --plans attention): at 1K context 0.9% faster than
    with the larger spans alone, at 16K 0.7% slower; with the first 2,048 keys in small spans, the
    same at 1K and 0.9% slower at 16K; with spans of 64 or 128 keys throughout, 0.7-0.8% faster at
    1K and 1.8-3.3% slower at 16K. Where a program gets less shared memory than the tiles' stages
    take (the plan's ProductPlan.depth: stages - 1 buffers of a K and a V tile beside q's; at
    head_dim 256 three deep take 151,552 bytes, over the 101,376 of an RTX 3090 or 4090, an A10 or
    an L4), the tiles run shallower: the same sums. `plan` None: an H100's."""
    BN, stages = (64, 3) if itemsize <= 2 else (32, 1)
    stages = (plan or ProductPlan(programs=1)).depth(stages, 2 * BN * D * itemsize, BM * D * itemsize)
    return 16, max(2 * BN, triton.next_power_of_2(triton.cdiv(L, MAX_SPANS))), BN, 4, stages


def _spans(L: int, first: int, split: int, BN: int) -> int:
    """The key spans of a cache of L rows: `first` of BN keys, the rest of `split`."""
    return min(first, triton.cdiv(L, BN)) + triton.cdiv(max(0, L - first * BN), split)


def split_workspace_floats(T: int, Hq: int, D: int, L: int, itemsize: int = 2, most: bool = False) -> int:
    """The float32 partials (each span's maxima, sums and outputs) decode_attention_triton keeps
    for T rows of Hq heads over a cache of L rows: the `workspace` a caller may hand it (the
    decoder's, for its prefill chunks replayed as graphs). `most`: those of the cache up to L with
    the most spans, which never shrinks as L grows (the spans' length doubles at powers of two,
    their count dropping there), as engine/memory.py's search for the longest context needs."""
    first, split, BN, _, _ = _config(L, itemsize, D)
    spans = _spans(L, first, split, BN)
    if most:      # the most spans come at the last size before each doubling of `split`
        sizes = [MAX_SPANS * s for s in (2 * BN << j for j in range(32)) if MAX_SPANS * s <= L]
        spans = max([spans] + [_spans(n, first, _config(n, itemsize, D)[1], BN) for n in sizes])
    return spans * T * Hq * (D + 2)


def _combine_config() -> tuple[int, int]:
    """(spans folded at a time, warps) of the combining kernel: 32 or 64 spans, 4 or 8 warps were
    no faster in a 27B decode step (tests/bench/ab_step.py, its since removed --plans attention)."""
    return 16, 4


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            start: torch.Tensor, scale: float, gate: torch.Tensor | None = None,
                            config: tuple | None = None, workspace: torch.Tensor | None = None,
                            rows: int = 32) -> torch.Tensor:
    """decode_attention_ref's contract with `start` a 1-element long tensor on q's device.
    `config` overrides _config(L), and `rows` the query rows (token x head of a kv head's group) a
    program takes, for tuning. `workspace`: float32 memory for the spans' partials (at least
    split_workspace_floats of them), else allocated here."""
    T, Hq, D = q.shape
    L, Hkv = k_cache.shape[0], k_cache.shape[1]
    assert v_cache.shape == k_cache.shape == (L, Hkv, D) and Hq % Hkv == 0, "caches must be [L, Hkv, D]"
    assert D & (D - 1) == 0 and D >= 16, "head_dim must be a power of two >= 16"
    for t in (q, k_cache, v_cache):
        assert t.stride(2) == 1, "head dims must be contiguous"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the caches must share a dtype"
    assert start.numel() == 1 and start.dtype == torch.long, "start must be a 1-element long tensor"
    if gate is not None:
        assert gate.shape == q.shape and gate.stride(2) == 1 and gate.dtype == q.dtype, "gate must be like q"
    assert rows >= 16 and rows & (rows - 1) == 0, "rows must be a power of two >= 16 (a dot's M)"
    group, BM = Hq // Hkv, rows
    first, split, BN, warps, stages = config or _config(L, q.element_size(), D, default_products(q.device), BM)
    assert split % BN == 0, "a span is whole tiles"
    spans = _spans(L, first, split, BN)
    n = spans * T * Hq
    if workspace is None:
        workspace = torch.empty(n * (D + 2), dtype=torch.float32, device=q.device)
    assert workspace.dtype == torch.float32 and workspace.is_contiguous() and workspace.numel() >= n * (D + 2), \
        "the workspace must be contiguous float32 of split_workspace_floats at least"
    ws_m, ws_l = workspace[:n].view(spans, T, Hq), workspace[n:2 * n].view(spans, T, Hq)
    ws_o = workspace[2 * n:n * (D + 2)].view(spans, T, Hq, D)
    _attn_split_kernel[(spans, Hkv, triton.cdiv(T * group, BM))](
        q, k_cache, v_cache, start, ws_m, ws_l, ws_o, T, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HQ=Hq, GROUP=group, D=D, BM=BM, BN=BN, FIRST=first, SPLIT=split, num_warps=warps, num_stages=stages,
        **pdl(q))
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    g = gate if gate is not None else out
    BS, combine_warps = _combine_config()
    _attn_combine_kernel[(T, Hq)](start, ws_m, ws_l, ws_o, g, out, T, g.stride(0), g.stride(1), out.stride(0),
                                  out.stride(1), HQ=Hq, D=D, BN=BN, FIRST=first, SPLIT=split, BS=BS,
                                  HAS_GATE=gate is not None, num_warps=combine_warps, **pdl(q))
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     start: int | torch.Tensor, scale: float, gate: torch.Tensor | None = None,
                     workspace: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention_ref's contract; the Triton kernels for CUDA tensors, where `start` is best
    a device tensor (an int is accepted and copied over), their partials in `workspace` if given."""
    if use_triton(q, k_cache, v_cache):
        if not isinstance(start, torch.Tensor):
            start = torch.tensor([start], dtype=torch.long, device=q.device)
        return decode_attention_triton(q, k_cache, v_cache, start, scale, gate, workspace=workspace)
    return decode_attention_ref(q, k_cache, v_cache, int(start), scale, gate)


# --- prefill's output gate --------------------------------------------------------------------------

def gate_rows_ref(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """A prefill's attention output o [T, H, D] times sigmoid(gate [T, H, D]), each step rounded to
    o's dtype as torch does it, as rows [T, H * D]."""
    return (o * torch.sigmoid(gate)).reshape(o.shape[0], -1)


@triton.jit
def _gate_rows_kernel(o, gate, y, ys, T, TP, s_ot, s_oh, s_gt, s_gh, s_y, s_sm, s_sk,
                      D: tl.constexpr, BT: tl.constexpr, QUANT: tl.constexpr, SCALE_GROUP: tl.constexpr,
                      INTERPRET: tl.constexpr):
    # program (i_t, i_h): BT tokens of head i_h. QUANT: y the FP8 codes [T', H * D] and ys their
    # scales [T', H * D / 128] (fp8_gemm.quantize_rows_triton's layout; rows T .. T' the padding)
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, D)
    m = (o_t < T)[:, None]
    b_o = tl.load(o + (o_t * s_ot + i_h * s_oh)[:, None] + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_g = tl.load(gate + (o_t * s_gt + i_h * s_gh)[:, None] + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_s = tl.sigmoid(b_g).to(o.dtype.element_ty).to(tl.float32)
    b_y = (b_o * b_s).to(o.dtype.element_ty)
    p_y = y + (o_t * s_y + i_h * D)[:, None] + o_d[None, :]
    if QUANT:
        G: tl.constexpr = D // SCALE_GROUP
        b_q, b_sc = quantize_tile(tl.reshape(b_y.to(tl.float32), (BT * G, SCALE_GROUP)), INTERPRET)
        m_p = (o_t < TP)[:, None]                 # the padding rows too: zeros, scale 1
        tl.store(p_y, tl.reshape(b_q, (BT, D)).to(y.dtype.element_ty), mask=m_p)
        o_g = tl.arange(0, G)
        tl.store(ys + o_t[:, None] * s_sm + (i_h * G + o_g)[None, :] * s_sk, tl.reshape(b_sc, (BT, G)), mask=m_p)
    else:
        tl.store(p_y, b_y, mask=m)


def gate_rows_triton(o: torch.Tensor, gate: torch.Tensor, quantize: bool = False, tokens: int = 16):
    """gate_rows_ref's contract in one pass (torch takes three: the sigmoid, the product, the copy
    of a transposed o into rows); `quantize` (D a multiple of 128): the rows come quantized for an
    FP8 product (fp8_gemm.QuantizedRows, padded for cuBLAS), quantize_rows of the rows bit for bit."""
    T, H, D = o.shape
    assert gate.shape == o.shape and o.stride(2) == 1 and gate.stride(2) == 1, \
        f"o and gate must be [T, H, D] with contiguous heads, got {tuple(o.shape)}, {tuple(gate.shape)}"
    assert D & (D - 1) == 0 and tokens & (tokens - 1) == 0, "D and tokens a program must be powers of two"
    if quantize:
        assert D % BLOCK == 0, f"quantize: D must be a multiple of {BLOCK}"
        TP = triton.cdiv(T, CUBLAS_ROWS) * CUBLAS_ROWS
        yq = torch.empty(TP, H * D, dtype=FP8, device=o.device)
        ys = torch.empty(H * D // BLOCK, TP, dtype=torch.float32, device=o.device).T
        out, y = QuantizedRows(yq, ys, T, o.dtype), yq
    else:
        out = y = ys = torch.empty(T, H * D, dtype=o.dtype, device=o.device)
        TP = T
    _gate_rows_kernel[(triton.cdiv(TP, tokens), H)](
        o, gate, y, ys, T, TP, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1), y.stride(0),
        ys.stride(0) if quantize else 0, ys.stride(1) if quantize else 0, D=D, BT=tokens, QUANT=quantize,
        SCALE_GROUP=BLOCK, INTERPRET=interpreting(), num_warps=min(8, max(1, tokens * D // 1024)))
    return out


def gate_rows(o: torch.Tensor, gate: torch.Tensor, quantize: bool = False, tokens: int = 16):
    """gate_rows_ref's contract; the kernel for CUDA tensors (its rows quantized with `quantize`)."""
    if use_triton(o, gate):
        return gate_rows_triton(o, gate, quantize, tokens)
    assert not quantize, "quantized rows come from the kernel only"
    return gate_rows_ref(o, gate)
