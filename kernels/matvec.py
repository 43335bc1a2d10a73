"""Matrix-vector products for a few rows (decode, verify, draft): y [T, N] = x [T, K] @ w [N, K]ᵀ,
and the same with the SwiGLU product fused into the input (the MLP's down projection).

Float32 torch references, the Triton kernel beside them, and `matvec` / `matvec_glu`, which take
the kernel for CUDA tensors and the reference otherwise.

The kernel streams w once: one program per block of BN output columns walks K in BK steps and
multiplies its w tile with all rows of x at once (rows padded to BT = 16, the smallest tensor-core
tile). The compiled kernel is the same for every T <= BT (T is a run-time argument, never a
specialisation), each output is accumulated over K in the same order whatever the other rows
hold, so row i of a T-row call is bit-for-bit the 1-row call of row i.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtpchat.kernels._triton import tl, triton

MAX_ROWS = 16


def matvec_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ in float32, cast back to x's dtype."""
    return (x.float() @ w.float().T).to(x.dtype)


def matvec_glu_ref(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ w [N, K]ᵀ for gate_up = [gate | up] [T, 2K], rounded as torch does it
    in gate_up's dtype (silu, then the product)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return matvec_ref(F.silu(gate) * up, w)


@triton.jit(do_not_specialize=["T"])
def _matvec_kernel(x, w, y, T, N, K, s_x, s_w, s_y,
                   BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GLU: tl.constexpr):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_t = tl.arange(0, BT)
    m_n, m_t = o_n < N, o_t < T
    b_y = tl.zeros([BN, BT], dtype=tl.float32)
    for k in range(0, K, BK):
        o_k = k + tl.arange(0, BK)
        m_k = o_k < K
        m_x = m_t[:, None] & m_k[None, :]
        b_w = tl.load(w + o_n[:, None] * s_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.)
        p_x = x + o_t[:, None] * s_x + o_k[None, :]
        b_x = tl.load(p_x, mask=m_x, other=0.)
        if GLU:
            # x holds [gate | up]: silu(gate), rounded, times up, rounded (torch's bf16 steps)
            b_g = b_x.to(tl.float32)
            b_s = (b_g * tl.sigmoid(b_g)).to(x.dtype.element_ty).to(tl.float32)
            b_x = (b_s * tl.load(p_x + K, mask=m_x, other=0.).to(tl.float32)).to(x.dtype.element_ty)
        # "ieee" keeps float32 inputs exact (no tf32); bf16 inputs take the tensor cores regardless
        b_y = tl.dot(b_w, tl.trans(b_x), b_y, input_precision="ieee")
    tl.store(y + o_t[None, :] * s_y + o_n[:, None], b_y.to(y.dtype.element_ty), mask=m_n[:, None] & m_t[None, :])


def _config(N: int, K: int, itemsize: int) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages): never a function of T. One tile suits every 27B decode matrix in
    bf16: on an H100 it was the fastest or within 1% of it for each (bench_kernels.py --sweep-matvec).
    float32 tiles take half the K to fit the same shared memory."""
    return 64, 512 // itemsize, 4, 4


def _launch(x: torch.Tensor, w: torch.Tensor, glu: bool) -> torch.Tensor:
    T = x.shape[0]
    N, K = w.shape
    assert 1 <= T <= MAX_ROWS, f"matvec takes 1..{MAX_ROWS} rows, got {T}"
    assert x.shape[1] == (2 * K if glu else K), f"x must be [T, {2 * K if glu else K}] for w [{N}, {K}]"
    assert w.stride(1) == 1 and x.stride(1) == 1, "x and w rows must be contiguous"
    assert x.dtype == w.dtype, "x and w must share a dtype"
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    BN, BK, warps, stages = _config(N, K, x.element_size())
    _matvec_kernel[(triton.cdiv(N, BN),)](x, w, y, T, N, K, x.stride(0), w.stride(0), y.stride(0),
                                          BT=MAX_ROWS, BN=BN, BK=BK, GLU=glu, num_warps=warps, num_stages=stages)
    return y


def matvec_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _launch(x, w, glu=False)


def matvec_glu_triton(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _launch(gate_up, w, glu=True)


def matvec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K]ᵀ: the Triton kernel for CUDA tensors, the float32 reference otherwise."""
    return matvec_triton(x, w) if x.is_cuda else matvec_ref(x, w)


def matvec_glu(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(silu(gate) * up) @ wᵀ for gate_up = [gate | up]: one kernel instead of three on CUDA."""
    return matvec_glu_triton(gate_up, w) if gate_up.is_cuda else matvec_glu_ref(gate_up, w)
