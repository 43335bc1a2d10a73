"""Experiment (not kept): does an in-loop sum of squares (the norm folded in as a per-row scale after the product) or a residual add in the epilogue slow the decode products? Run: python3 exp_norm_scale.py"""
import statistics, sys, time, json
import torch
from mtpchat.kernels._triton import tl, triton
from mtpchat.kernels import matvec

@triton.jit(do_not_specialize=["T"])
def k_rms(x, w, y, r, T, N, K, s_x, s_w, s_y, eps, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          RMS: tl.constexpr, RES: tl.constexpr):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < N, o_t < T
    b_y = tl.zeros([BN, BT], dtype=tl.float32)
    b_ss = tl.zeros([BT], dtype=tl.float32)
    for k in range(0, K, BK):
        o_k = k + tl.arange(0, BK)
        m_k = o_k < K
        b_w = tl.load(w + o_n[:, None] * s_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
        b_x = tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        if RMS:
            b_xf = b_x.to(tl.float32)
            b_ss += tl.sum(b_xf * b_xf, axis=1)
        b_y = tl.dot(b_w, tl.trans(b_x), b_y, input_precision="ieee")
    if RMS:
        b_y = b_y * tl.rsqrt(b_ss / K + eps)[None, :]
    b_o = b_y.to(y.dtype.element_ty)
    if RES:
        b_r = tl.load(r + o_t[None, :] * s_y + o_n[:, None], mask=m_n[:, None] & m_t[None, :], other=0.)
        b_o = (b_o.to(tl.float32) + b_r.to(tl.float32)).to(y.dtype.element_ty)
    tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_o, mask=m_n[:, None] & m_t[None, :])


@triton.jit(do_not_specialize=["T"])
def k_rms_col(x, w, y, r, T, N, K, s_x, s_w, s_y, eps, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # sum of squares from a second, tiny load of x in a row layout (not the dot operand)
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < N, o_t < T
    b_y = tl.zeros([BN, BT], dtype=tl.float32)
    b_ss = tl.zeros([BT, BK], dtype=tl.float32)
    for k in range(0, K, BK):
        o_k = k + tl.arange(0, BK)
        m_k = o_k < K
        b_w = tl.load(w + o_n[:, None] * s_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
        b_x = tl.load(x + o_t[:, None] * s_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_xf = b_x.to(tl.float32)
        b_ss += b_xf * b_xf
        b_y = tl.dot(b_w, tl.trans(b_x), b_y, input_precision="ieee")
    b_y = b_y * tl.rsqrt(tl.sum(b_ss, axis=1) / K + eps)[None, :]
    tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_y.to(y.dtype.element_ty), mask=m_n[:, None] & m_t[None, :])


def graph_ms(fn, reps=9):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)

H, I = 5120, 17408
SHAPES = {"gdn_in": (16480, H), "gdn_out": (H, 6144), "attn_qkv": (14336, H), "down": (H, I), "gate_up": (2 * I, H)}
res = {}
for name, (N, K) in SHAPES.items():
    ws = [torch.empty(N, K, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(16)]
    for T in (1, 4):
        x = torch.randn(T, K, dtype=torch.bfloat16, device="cuda")
        r = torch.randn(T, N, dtype=torch.bfloat16, device="cuda")
        ys = [torch.empty(T, N, dtype=torch.bfloat16, device="cuda") for _ in ws]
        def launch(kern, **kw):
            def f():
                for w, y in zip(ws, ys):
                    kern[(triton.cdiv(N, 64),)](x, w, y, r, T, N, K, x.stride(0), w.stride(0), y.stride(0), 1e-6,
                                                BT=16, BN=64, BK=256, num_warps=4, num_stages=4, **kw)
            return f
        row = {}
        for rep in range(2):
            row.setdefault("plain", []).append(graph_ms(launch(k_rms, RMS=False, RES=False)) / 16 * 1e3)
            row.setdefault("rms", []).append(graph_ms(launch(k_rms, RMS=True, RES=False)) / 16 * 1e3)
            row.setdefault("res", []).append(graph_ms(launch(k_rms, RMS=False, RES=True)) / 16 * 1e3)
            row.setdefault("rms_col", []).append(graph_ms(launch(k_rms_col)) / 16 * 1e3)
            row.setdefault("current", []).append(graph_ms(lambda: [matvec.matvec(x, w) for w in ws]) / 16 * 1e3)
        # correctness of the rms variant
        y = torch.empty(T, N, dtype=torch.bfloat16, device="cuda")
        k_rms[(triton.cdiv(N, 64),)](x, ws[0], y, r, T, N, K, x.stride(0), ws[0].stride(0), y.stride(0), 1e-6,
                                     BT=16, BN=64, BK=256, num_warps=4, num_stages=4, RMS=True, RES=False)
        xf = x.float(); ref = (xf @ ws[0].float().T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        res[f"{name} T={T}"] = {k: round(min(v), 2) for k, v in row.items()} | {"rms_err": err}
        print(name, T, res[f"{name} T={T}"], flush=True)
print(json.dumps(res))
