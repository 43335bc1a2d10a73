"""A prefill chunk's attention (kernels/attention_chunk.py) against prefill_attention_ref: odd
sizes under the interpreter in float32, the 27B's heads on the GPU in bf16 and fp16, the cache's
rows read as they lie, and the tiles and the launch rule it takes."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, check, randn

from mtpchat.kernels import attention_chunk
from mtpchat.kernels.plan import ProductPlan

# numpy's matmul treats Triton's bf16 as integers in the interpreter: bf16 runs on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,before,Hq,Hkv,D,config", [
    (1, 0, 2, 1, 16, (16, 16, 4, 1)),        # one token, the first
    (100, 0, 2, 1, 16, (16, 16, 4, 1)),      # the first chunk over many row blocks
    (9, 3, 2, 1, 8, (16, 16, 4, 1)),         # a head dim below the tensor cores' 16
    (5, 0, 6, 2, 32, (16, 16, 4, 1)),        # the first chunk, fewer rows than a block
    (63, 1, 3, 3, 40, (32, 16, 4, 1)),       # no GQA, head dim not a power of two, one key before
    (130, 77, 4, 1, 16, (32, 32, 4, 2)),     # rows over several blocks, keys before not a block's multiple
    (37, 200, 6, 2, 24, (16, 64, 4, 1)),     # key blocks wider than the row blocks
    (20, 45, 2, 2, 32, None),                # the device's own tiles
])
def test_prefill_attention(device, dtype, T, before, Hq, Hkv, D, config):
    g = torch.Generator().manual_seed(T + before)
    q = randn(T, Hq, D, dtype=dtype, device=device, gen=g)
    k, v = (randn(before + T, Hkv, D, dtype=dtype, device=device, gen=g) for _ in range(2))
    out = attention_chunk.prefill_attention_triton(q, k, v, D ** -0.5, config)
    check(out, attention_chunk.prefill_attention_ref(q, k, v, D ** -0.5), TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,before,config", [(300, 1000, None), (300, 1000, (64, 32, 4, 2)), (700, 0, None)])
def test_prefill_attention_27b_shapes(dtype, T, before, config):
    # the 27B's heads (24 query, 4 kv, 256 dims) on the tiles the engine takes (and an A100's):
    # the paths only compiled elsewhere, wgmma on an H100
    g = torch.Generator().manual_seed(T + before)
    q = randn(T, 24, 256, dtype=dtype, device="cuda", gen=g)
    k, v = (randn(before + T, 4, 256, dtype=dtype, device="cuda", gen=g) for _ in range(2))
    out = attention_chunk.prefill_attention_triton(q, k, v, 256 ** -0.5, config)
    check(out, attention_chunk.prefill_attention_ref(q, k, v, 256 ** -0.5), TOL[torch.bfloat16])


def test_prefill_attention_reads_the_cache_as_it_lies(device):
    # q a view of a wider projection, k and v the first n rows of a longer cache: the same as
    # contiguous copies, and no key past n read (the rows past it hold NaN)
    g = torch.Generator().manual_seed(5)
    T, n, Hq, Hkv, D = 21, 50, 4, 2, 16
    qg = randn(T, Hq, 2 * D, device=device, gen=g)
    cache = randn(80, Hkv, D, device=device, gen=g), randn(80, Hkv, D, device=device, gen=g)
    for c in cache:
        c[n:] = float("nan")
    q, k, v = qg[..., :D], cache[0][:n], cache[1][:n]
    out = attention_chunk.prefill_attention_triton(q, k, v, 0.3, (16, 16, 4, 1))
    assert torch.equal(out, attention_chunk.prefill_attention_triton(q.contiguous(), k.clone(), v.clone(), 0.3,
                                                               (16, 16, 4, 1)))
    check(out, attention_chunk.prefill_attention_ref(q, k, v, 0.3), TOL[torch.float32])


def test_prefill_attention_fills_the_gpu_with_long_chunks_only():
    # the 27B's heads on an H100 (132 SMs, 128-row tiles): 4 kv heads x ceil(6 T / 128) programs,
    # two waves from 1,387 queries, one from 683 where the keys before the chunk are twice its own
    h100 = ProductPlan(programs=132)
    fills = lambda T, n: attention_chunk.prefill_attention_fills(T, n, 24, 4, 256, 2, h100)
    assert fills(2048, 2048) and fills(8192, 8192) and fills(1387, 1387) and not fills(1386, 1386)
    assert fills(700, 2100) and not fills(700, 2099) and not fills(700, 1400) and not fills(700, 700)
    assert fills(683, 2049) and not fills(682, 8192) and not fills(50, 8192)


def test_prefill_attention_tiles_follow_shared_memory():
    # 128 x 64 on 8 warps where a program has the room (an H100), 64 x 32 on an A100, one deep on
    # a 99 KB card
    tiles = lambda room: attention_chunk.prefill_attention_config(256, 2, ProductPlan(programs=1, shared_memory=room))
    assert tiles(232448) == (128, 64, 8, 2)
    assert tiles(166912) == (64, 32, 4, 2)
    assert tiles(101376) == (64, 32, 4, 1)
