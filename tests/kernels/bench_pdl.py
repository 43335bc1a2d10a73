"""Experiment: does programmatic dependent launch (PDL) shorten a graph of back-to-back matvecs?

    python tests/kernels/bench_pdl.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from bench_kernels import COUNT, SHAPES, graph_ms

from mtpchat.kernels import matvec


@triton.jit(do_not_specialize=["T"])
def _matvec_pdl_kernel(x, w, y, T, N, K, s_x, s_w, s_y, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       EARLY: tl.constexpr):
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < N, o_t < T
    b_y = tl.zeros([BN, BT], dtype=tl.float32)
    for k in range(0, K, BK):
        o_k = k + tl.arange(0, BK)
        m_k = o_k < K
        b_w = tl.load(w + o_n[:, None] * s_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
        b_x = tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_y = tl.dot(b_w, tl.trans(b_x), b_y, input_precision="ieee")
    tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_y.to(y.dtype.element_ty), mask=m_n[:, None] & m_t[None, :])


def pdl_matvec(x, w, early):
    T, K = x.shape
    N = w.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _matvec_pdl_kernel[(triton.cdiv(N, 64),)](x, w, y, T, N, K, x.stride(0), w.stride(0), y.stride(0), BT=16, BN=64,
                                              BK=256, EARLY=early, num_warps=4, num_stages=4, launch_pdl=True)
    return y


@triton.jit
def _tiny_kernel(x, y, N, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < N) + 1., mask=o < N)


def tiny_chain(a, b, n, pdl):
    for _ in range(n):
        _tiny_kernel[(triton.cdiv(a.numel(), 1024),)](a, b, a.numel(), PDL=pdl, BLOCK=1024, launch_pdl=pdl)
        a, b = b, a


def main():
    a = torch.randn(5120, device="cuda")
    b = torch.empty_like(a)
    for pdl in (False, True):
        ms = graph_ms(lambda: tiny_chain(a, b, 200, pdl))
        print(f"200 dependent tiny kernels in a graph, pdl={pdl}: {ms * 1e3 / 200:.2f} us each")
    weights = {k: [torch.empty(n, kk, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(min(COUNT[k], 16))]
               for k, (n, kk) in SHAPES.items() if k != "lm_head"}
    seq = []
    for i in range(16):
        seq += [weights["gdn_in"][i], weights["gdn_out"][i], weights["mlp_gate_up"][i], weights["mlp_down"][i],
                weights["attn_qkv"][i], weights["attn_o"][i]]
    total = sum(w.numel() * 2 for w in seq)
    xs = {K: torch.randn(1, K, dtype=torch.bfloat16, device="cuda") for K in {w.shape[1] for w in seq}}
    ref = [matvec.matvec(xs[w.shape[1]], w) for w in seq[:6]]
    for early in (False, True):
        got = [pdl_matvec(xs[w.shape[1]], w, early) for w in seq[:6]]
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
    plain = graph_ms(lambda: [matvec.matvec(xs[w.shape[1]], w) for w in seq])
    pdl = graph_ms(lambda: [pdl_matvec(xs[w.shape[1]], w, False) for w in seq])
    early = graph_ms(lambda: [pdl_matvec(xs[w.shape[1]], w, True) for w in seq])
    print(f"{len(seq)} matvecs, {total / 1e9:.2f} GB: plain {plain:.3f} ms ({total / plain / 1e9:.2f} TB/s), "
          f"pdl {pdl:.3f} ms ({total / pdl / 1e9:.2f} TB/s), pdl+early trigger {early:.3f} ms ({total / early / 1e9:.2f} TB/s)")


if __name__ == "__main__":
    main()
