"""Decode/verify attention over the KV cache against decode_attention_ref, and its row invariance:
row t of a T-row call is bit for bit the 1-row call at start + t (GPU)."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import attention, fp8_gemm
from mtpchat.kernels.plan import ProductPlan


def _case(T, Hq, Hkv, D, L, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    q = randn(T, Hq, D, dtype=dtype, device=device, gen=g)
    kc = randn(L, Hkv, D, dtype=dtype, device=device, gen=g)
    vc = randn(L, Hkv, D, dtype=dtype, device=device, gen=g)
    return q, kc, vc


# numpy's matmul treats Triton's bf16 as integers in the interpreter: bf16 runs on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D,L,start", [
    (1, 6, 2, 32, 300, 0),          # first token
    (1, 6, 2, 32, 300, 200),        # one span and a partial second
    (2, 4, 4, 16, 200, 63),         # no GQA; crosses a 64-key block
    (5, 12, 2, 32, 700, 400),       # several spans, 30 rows of query per kv head
    (5, 8, 1, 16, 520, 508),        # the new tokens straddle a span edge, the cache nearly full
    (2, 4, 2, 16, 2600, 2400),      # 20 spans: the combine folds more than one block of spans
])
def test_decode_attention(device, dtype, T, Hq, Hkv, D, L, start):
    q, kc, vc = _case(T, Hq, Hkv, D, L, dtype, device, seed=start + T)
    out = attention.decode_attention_triton(q, kc, vc, torch.tensor([start], device=device), D ** -0.5)
    check(out, attention.decode_attention_ref(q, kc, vc, start, D ** -0.5), TOL[dtype])


@pytest.mark.parametrize("T,start", [(24, 0), (24, 500), (9, 2570)])
def test_decode_attention_in_a_workspace_of_the_callers(device, T, start):
    # a prefill chunk's rows (start on the device) with their partials in one workspace sized for a
    # larger chunk and left dirty: the same bits as in memory of their own
    q, kc, vc = _case(T, 6, 2, 32, 2700, torch.float32, device, seed=T + start)
    at = torch.tensor([start], device=device)
    floats = attention.split_workspace_floats(64, 6, 32, 2700, 4)
    assert floats > attention.split_workspace_floats(T, 6, 32, 2700, 4)
    workspace = torch.full((floats,), float("nan"), device=device)
    out = attention.decode_attention_triton(q, kc, vc, at, 32 ** -0.5, workspace=workspace)
    assert torch.equal(out, attention.decode_attention_triton(q, kc, vc, at, 32 ** -0.5))
    check(out, attention.decode_attention_ref(q, kc, vc, start, 32 ** -0.5), TOL[torch.float32])
    with pytest.raises(AssertionError, match="workspace"):
        attention.decode_attention_triton(q, kc, vc, at, 32 ** -0.5, workspace=workspace[:10])


def test_the_workspace_counted_for_a_cache_never_shrinks_as_it_grows():
    counts = [attention.split_workspace_floats(64, 24, 256, L, 2, most=True) for L in range(1000, 300_000, 211)]
    assert all(a <= b for a, b in zip(counts, counts[1:]))
    assert attention.split_workspace_floats(64, 24, 256, 8329, 2) == 74 * 64 * 24 * 258


def test_decode_attention_ignores_keys_past_the_new_tokens(device):
    # keys past start + T (stale drafts, unwritten cache) must not leak in, even if they are huge
    q, kc, vc = _case(3, 4, 2, 16, 256, torch.float32, device, seed=1)
    kc[40:], vc[40:] = 1e4, 1e4
    out = attention.decode_attention_triton(q, kc, vc, torch.tensor([37], device=device), 0.25)
    check(out, attention.decode_attention_ref(q, kc, vc, 37, 0.25), TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D,L,start", [(1, 6, 2, 32, 300, 200), (3, 12, 2, 16, 700, 401)])
def test_decode_attention_with_the_output_gate(device, dtype, T, Hq, Hkv, D, L, start):
    # the gate is a strided view, as it is inside the fused q|gate projection
    q, kc, vc = _case(T, Hq, Hkv, D, L, dtype, device, seed=start)
    gate = randn(T, Hq, 2 * D, dtype=dtype, device=device, seed=start + 1, scale=2.0)[..., D:]
    start_t = torch.tensor([start], device=device)
    out = attention.decode_attention_triton(q, kc, vc, start_t, D ** -0.5, gate)
    want = attention.decode_attention_ref(q, kc, vc, start, D ** -0.5, gate)
    check(out, want, TOL[dtype])
    plain = attention.decode_attention_ref(q, kc, vc, start, D ** -0.5)
    assert (want - plain).abs().max() > 0.1, "the gate must change the output (a test that cannot fail otherwise)"


def _rows_one_by_one(q, kc, vc, start, scale):
    return torch.cat([attention.decode_attention(q[t:t + 1], kc, vc, torch.tensor([start + t], device=q.device), scale)
                      for t in range(q.shape[0])])


@pytest.mark.gpu
@pytest.mark.parametrize("T,L,start", [(1, 4096, 1000), (5, 4096, 1000), (5, 4096, 4091), (4, 32768, 30000)])
def test_decode_attention_27b_shapes(T, L, start):
    q, kc, vc = _case(T, 24, 4, 256, L, torch.bfloat16, "cuda", seed=T)
    out = attention.decode_attention(q, kc, vc, torch.tensor([start], device="cuda"), 256 ** -0.5)
    check(out, attention.decode_attention_ref(q, kc, vc, start, 256 ** -0.5), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T,Hq,Hkv,start", [(5, 24, 4, 1000), (3, 24, 4, 127), (5, 8, 2, 3000), (2, 16, 16, 50)])
def test_decode_attention_rows_do_not_depend_on_T(T, Hq, Hkv, start):
    q, kc, vc = _case(T, Hq, Hkv, 256, 4096, torch.bfloat16, "cuda", seed=start)
    out = attention.decode_attention(q, kc, vc, torch.tensor([start], device="cuda"), 0.0625)
    assert torch.equal(out, _rows_one_by_one(q, kc, vc, start, 0.0625))


@pytest.mark.parametrize("T,start", [(1, 30), (5, 44), (3, 47), (4, 200)])
def test_decode_attention_two_sizes_of_span(device, T, start):
    # 3 spans of 16 keys, then spans of 32: rows before, across and after the change of size
    q, kc, vc = _case(T, 6, 2, 16, 300, torch.float32, device, seed=start)
    out = attention.decode_attention_triton(q, kc, vc, torch.tensor([start], device=device), 0.25,
                                            config=(3, 32, 16, 4, 2))
    check(out, attention.decode_attention_ref(q, kc, vc, start, 0.25), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,D,tokens", [(1, 2, 64, 16), (21, 3, 128, 4), (37, 2, 256, 16)])
def test_prefill_output_gate(device, dtype, T, H, D, tokens):
    # a prefill's attention output (a transposed view, as SDPA hands it back) times sigmoid of the
    # gate (a strided view of the q|gate projection), as rows
    g = torch.Generator().manual_seed(T + D)
    o = randn(H, T, D, dtype=dtype, device=device, gen=g).transpose(0, 1)
    gate = randn(T, H, 2 * D, dtype=dtype, device=device, gen=g)[..., D:]
    got = attention.gate_rows_triton(o, gate, tokens=tokens)
    assert got.shape == (T, H * D) and got.is_contiguous()
    check(got, attention.gate_rows_ref(o, gate), TOL[dtype])


@pytest.mark.parametrize("T,D", [(21, 128), (37, 256)])
def test_prefill_output_gate_quantized(device, T, D):
    # straight into FP8 rows for o_proj: quantize_rows of the gated rows, bit for bit, padded
    g = torch.Generator().manual_seed(T)
    o = randn(3, T, D, dtype=torch.bfloat16, device=device, gen=g).transpose(0, 1)
    gate = randn(T, 3, 2 * D, dtype=torch.bfloat16, device=device, gen=g)[..., D:]
    got = attention.gate_rows_triton(o, gate, quantize=True, tokens=4)
    xq, xs = fp8_gemm.quantize_rows_triton(attention.gate_rows_triton(o, gate, tokens=4), fp8_gemm.CUBLAS_ROWS)
    assert got.rows == T and got.q.shape == xq.shape
    assert torch.equal(got.q.view(torch.uint8), xq.view(torch.uint8)), "codes"
    assert torch.equal(got.scale, xs) and got.scale.stride() == xs.stride(), "scales"


def test_decode_attention_runs_shallower_where_shared_memory_is_short():
    # head_dim 256 three deep takes 151,552 bytes a program: two deep (86,016) on a 101,376-byte
    # device, the same tiles and spans
    small = ProductPlan(programs=1, shared_memory=101376)
    first, split, BN, warps, stages = attention._config(32768, 2, 256)
    assert stages == 3
    assert attention._config(32768, 2, 256, small) == (first, split, BN, warps, 2)
    assert attention._config(32768, 4, 256, small)[-1] == 1     # float32: one deep anyway
