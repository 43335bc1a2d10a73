"""Attention of a prefill chunk: its T queries over the n keys and values before and in it, the
cache's first n rows, GQA, causal aligned to the bottom right (query t sees keys 0 .. n - T + t).
The float32 torch reference and the Triton kernel beside it (`prefill_attention_triton`, the plan's
prefill_attention "triton", the default; torch's flash kernel the other form, engine/model.py), the
way gdn_chunk.py holds the GDN's chunked form beside gdn.py's steps.

One program takes a block of rows of one kv head's query heads, token-major, so a group reads its
keys and values once, and walks the keys in blocks with the softmax online (base 2, float32; P
rounded to the inputs' dtype for its product with V, as flash attention does). The key blocks every
row of the block sees run unmasked, the diagonal ones masked.
"""
from __future__ import annotations

import torch

from mtpchat.kernels._triton import tl, triton
from mtpchat.kernels.plan import PIPELINE_SLACK, ProductPlan, default_products


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


def prefill_attention_fills(T: int, n: int, Hq: int, Hkv: int, D: int, itemsize: int, plan: ProductPlan) -> bool:
    """Whether the prefill kernel suits a chunk of T queries over n keys: its programs fill the GPU
    twice (plan.programs, one an SM), or once where the keys before the chunk are twice its own or
    more. Fewer programs each walk all their keys, where torch's flash kernel splits them over more:
    64 queries of the 27B (12 programs) took ours 2-4 x flash's time over 64 to 8,192 keys, and 700
    (132 programs, one wave on an H100) 2.4 x over 700 keys, 1.4 x over 1,400, 0.95 x over 2,100 and
    0.67-0.75 x over 2,800 to 7,700 (tests/bench/probe_attention.py, an H100, 2026-11-28)."""
    BM = prefill_attention_config(D, itemsize, plan)[0]
    programs = Hkv * triton.cdiv(T * (Hq // Hkv), BM)
    return programs >= 2 * plan.programs or (programs >= plan.programs and n >= 3 * T)


def _head_tile(D: int) -> int:
    """The prefill kernel's tile of head dims: a power of two, 16 at least (a tensor-core product's K)."""
    return max(16, triton.next_power_of_2(D))
