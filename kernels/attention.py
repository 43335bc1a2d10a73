"""Attention over the KV cache for decode and verify: q_len 1..k+1 new tokens, GQA, causal among
the new tokens. The float32 torch reference, the Triton kernels beside it, and `decode_attention`,
which takes the kernels for CUDA tensors and the reference otherwise. Below them a prefill chunk's
attention (`prefill_attention_triton`, a candidate of the plan's prefill_attention beside torch's
flash kernel) and prefill's output gate.

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
from mtpchat.kernels.plan import PIPELINE_SLACK, ProductPlan, default_products


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


def _combine_config() -> tuple[int, int]:
    """(spans folded at a time, warps) of the combining kernel: 32 or 64 spans, 4 or 8 warps were
    no faster in a 27B decode step (tests/bench/ab_step.py, its since removed --plans attention)."""
    return 16, 4


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            start: torch.Tensor, scale: float, gate: torch.Tensor | None = None,
                            config: tuple | None = None) -> torch.Tensor:
    """decode_attention_ref's contract with `start` a 1-element long tensor on q's device.
    `config` overrides _config(L), for tuning."""
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
    group, BM = Hq // Hkv, 32
    first, split, BN, warps, stages = config or _config(L, q.element_size(), D, default_products(q.device), BM)
    assert split % BN == 0, "a span is whole tiles"
    spans = min(first, triton.cdiv(L, BN)) + triton.cdiv(max(0, L - first * BN), split)
    ws_m = torch.empty(spans, T, Hq, dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_o = torch.empty(spans, T, Hq, D, dtype=torch.float32, device=q.device)
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
                     start: int | torch.Tensor, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention_ref's contract; the Triton kernels for CUDA tensors, where `start` is best
    a device tensor (an int is accepted and copied over)."""
    if use_triton(q, k_cache, v_cache):
        if not isinstance(start, torch.Tensor):
            start = torch.tensor([start], dtype=torch.long, device=q.device)
        return decode_attention_triton(q, k_cache, v_cache, start, scale, gate)
    return decode_attention_ref(q, k_cache, v_cache, int(start), scale, gate)


# --- prefill: a chunk's queries over the keys before and in it ------------------------------------

def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prompt chunk's T queries q [T, Hq, D], the last T of the n keys and
    values k, v [n, Hkv, D] (the cache's first n rows; query head h reads kv head h // (Hq // Hkv)),
    causal aligned to the bottom right (query t sees keys 0 .. n - T + t); float32 throughout,
    -> [T, Hq, D] in q's dtype."""
    T, Hq, D = q.shape
    n, group = k.shape[0], Hq // k.shape[1]
    kf, vf = (t.float().repeat_interleave(group, dim=1) for t in (k, v))          # [n, Hq, D]
    scores = torch.einsum("thd,nhd->htn", q.float(), kf) * scale                   # [Hq, T, n]
    seen = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - T, n, device=q.device)[:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("htn,nhd->thd", scores.softmax(-1), vf).to(q.dtype)


@triton.jit
def _prefill_attn_block(b_q, k, v, j, o_n, o_d, m_d, i_kh, s_kn, s_kh, s_vn, s_vh, b_m, b_l, b_acc, o_last, last,
                        scale2, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """One block of BN keys from key j into a row block's online softmax (base 2; scale2 = the
    softmax scale times log2 e). MASKED: the block holds keys past some rows' last (the causal
    diagonal, or the keys' end), which those rows do not see. EVEN_D: the head dim fills its
    tile, and a block every row sees loads unmasked (whole 16-byte copies). No row meets a masked
    block before its first: key 0, the first block's, is every row's, so a row's max is finite
    from then on and a block it sees none of adds exact zeros."""
    o_j = j + o_n
    m_k = (o_j <= last)[:, None] if MASKED else None
    if not EVEN_D:
        m_k = m_d[None, :] if m_k is None else m_k & m_d[None, :]
    p_k = k + o_j[:, None] * s_kn + i_kh * s_kh + o_d[None, :]
    p_v = v + o_j[:, None] * s_vn + i_kh * s_vh + o_d[None, :]
    if m_k is None:
        b_k = tl.load(p_k)
    else:
        b_k = tl.load(p_k, mask=m_k, other=0.)
    # "ieee": float32 inputs exact (bf16 ones take the tensor cores regardless)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale2           # [BM, BN]
    if MASKED:
        b_s = tl.where(o_j[None, :] <= o_last[:, None], b_s, float("-inf"))
    b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_p = tl.exp2(b_s - b_mn[:, None])
    b_alpha = tl.exp2(b_m - b_mn)
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    if m_k is None:
        b_v = tl.load(p_v)
    else:
        b_v = tl.load(p_v, mask=m_k, other=0.)
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None], input_precision="ieee")
    return b_mn, b_l, b_acc


@triton.jit(do_not_specialize=["T", "n"])
def _prefill_attn_kernel(q, k, v, o, T, n, scale2, s_qt, s_qh, s_kn, s_kh, s_vn, s_vh, s_ot, s_oh,
                         GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr):
    # program (i_kh, i_m): rows i_m BM .. + BM of kv head i_kh's GROUP query heads, rows token-major
    # (row r: token r // GROUP, head i_kh GROUP + r % GROUP), so the group reads K and V once; row t
    # sees keys 0 .. n - T + t. The key blocks every row of the block sees whole run unmasked, the
    # rest (the diagonal) masked. Axis 0 runs fastest: the last row blocks, which see the most
    # keys, go first, every kv head's side by side.
    i_kh, i_m = tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1)
    o_r = i_m * BM + tl.arange(0, BM)
    o_t, o_h = o_r // GROUP, i_kh * GROUP + o_r % GROUP
    o_n, o_d = tl.arange(0, BN), tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    b_q = tl.load(q + o_t[:, None] * s_qt + o_h[:, None] * s_qh + o_d[None, :], mask=m_t[:, None] & m_d[None, :],
                  other=0.)
    o_last = n - T + o_t                     # each row's last key (padding rows': past n, masked by `last`)
    last = n - T + tl.minimum((i_m * BM + BM - 1) // GROUP, T - 1)     # the block's last key
    whole = (n - T + i_m * BM // GROUP + 1) // BN * BN                  # keys before this every row sees
    b_m = tl.full([BM], float("-inf"), tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    b_acc = tl.zeros([BM, BD], tl.float32)
    for j in range(0, whole, BN):
        b_m, b_l, b_acc = _prefill_attn_block(b_q, k, v, j, o_n, o_d, m_d, i_kh, s_kn, s_kh, s_vn, s_vh, b_m, b_l,
                                              b_acc, o_last, last, scale2, False, BD == D)
    for j in range(whole, last + 1, BN):
        b_m, b_l, b_acc = _prefill_attn_block(b_q, k, v, j, o_n, o_d, m_d, i_kh, s_kn, s_kh, s_vn, s_vh, b_m, b_l,
                                              b_acc, o_last, last, scale2, True, BD == D)
    b_o = b_acc / b_l[:, None]
    tl.store(o + o_t[:, None] * s_ot + o_h[:, None] * s_oh + o_d[None, :], b_o.to(o.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


def prefill_attention_config(D: int, itemsize: int = 2, plan: ProductPlan | None = None) -> tuple[int, int, int, int]:
    """(BM query rows, BN keys, warps, stages) of the prefill kernel for head_dim D: the first of
    128 x 64 on 8 warps, 64 x 64 and 64 x 32 on 4, two deep, then 64 x 32 one deep, whose q tile
    and `stages` K and V tiles fit a program's shared memory (compiled for sm_90 at head_dim 256:
    196,608, 163,840, 98,304 and 49,152 bytes; sm_86 takes less). So an H100 takes 128 x 64, an
    A100 64 x 32 two deep, a 99 KB card (RTX 30/40/50, A10, L4) one deep. The sizes are sm_90's
    for every target, which on sm_8x (106,496 and 69,632 bytes for the second and third there)
    errs on the safe side by a tile. Candidate tiles, not yet timed (tests/bench/probe_attention.py)."""
    room = (plan or ProductPlan(programs=1)).shared_memory - PIPELINE_SLACK
    BD = _head_tile(D)
    for BM, BN, warps, stages in ((128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)):
        if (BM + 2 * stages * BN) * BD * itemsize <= room:
            return BM, BN, warps, stages
    return 64, 32, 4, 1


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             config: tuple | None = None, plan: ProductPlan | None = None) -> torch.Tensor:
    """prefill_attention_ref's contract in one kernel, the softmax online over blocks of keys in
    float32, P rounded to the inputs' dtype for its product with V (as flash attention does). q, k, v
    views with contiguous head dims (k, v the cache's rows as they lie), the output [T, Hq, D] made
    here. `config` overrides prefill_attention_config (on `plan`, None: the device's), for tuning."""
    T, Hq, D = q.shape
    n, Hkv = k.shape[0], k.shape[1]
    assert v.shape == k.shape and k.shape[2] == D and Hq % Hkv == 0, "k, v must be [n, Hkv, D] like q's heads"
    assert n >= T, "the keys include the chunk's own"
    for t in (q, k, v):
        assert t.stride(2) == 1, "head dims must be contiguous"
    assert q.dtype == k.dtype == v.dtype, "q, k and v must share a dtype"
    BM, BN, warps, stages = config or prefill_attention_config(D, q.element_size(),
                                                               plan or default_products(q.device))
    o = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return o
    group = Hq // Hkv
    _prefill_attn_kernel[(Hkv, triton.cdiv(T * group, BM))](
        q, k, v, o, T, n, scale * 1.4426950408889634, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), o.stride(0), o.stride(1), GROUP=group, D=D, BD=_head_tile(D), BM=BM, BN=BN,
        num_warps=warps, num_stages=stages)
    return o


def prefill_attention_fills(T: int, Hq: int, Hkv: int, D: int, itemsize: int, plan: ProductPlan) -> bool:
    """Whether the prefill kernel's programs for a chunk of T queries fill the GPU once (one an SM,
    plan.programs): a short chunk makes few (a 50-token turn of the 27B: 3 row blocks x 4 kv heads),
    each over every key, where torch's flash kernel splits the keys over more."""
    BM = prefill_attention_config(D, itemsize, plan)[0]
    return Hkv * triton.cdiv(T * (Hq // Hkv), BM) >= plan.programs


def _head_tile(D: int) -> int:
    """The prefill kernel's tile of head dims: a power of two, 16 at least (a tensor-core product's K)."""
    return max(16, triton.next_power_of_2(D))


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
