"""Prefill attention at the 27B's shapes (24 query heads, 4 kv heads, head dim 256, bf16) in each
form torch offers on this GPU, against the flash kernel the engine calls (engine/model.py
prefill_attention), and what a new shape costs the first time.

    cd tests/bench && python3 probe_attention.py [--tokens 2048] [--context 8192]

A prompt's chunk of T queries attends to the n keys before and including it, causal aligned to the
bottom right (query t sees keys up to n - T + t). Forms:
- flash: aten's flash kernel as the engine calls it, kv heads as they are;
- cuDNN whole: one cuDNN call; only where T == n (its causal mask is aligned to the top left);
- cuDNN split: the keys before the chunk (no mask) and the chunk's own keys (causal, square) in
  two calls that return their log-sum-exp, merged in float32; the kv heads as they are, or
  repeated to the query heads where cuDNN refuses them;
- efficient: the memory-efficient kernel with the lower-right causal bias;
- triton: our kernel (kernels/attention_chunk.py prefill_attention_triton, KernelPlan.prefill_attention
  "triton") on its default tiles, and `--tiles` "BM,BN,warps,stages;..." beside them, over keys
  laid out as the cache holds them ([n, Hkv, D]; every form reads them so since 2026-11-28, the
  rows before it took contiguous [1, Hkv, n, D] copies).
Each row checks its output against flash's (max |difference|, relative to the largest |output|).
Times: CUDA events around 10 launches after a warm-up, the median of 5. "first call": the
wall time of one call at a key length not seen before (a cuDNN graph is built per shape).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from mtpchat.kernels import attention_chunk

HQ, HKV, HD = 24, 4, 256


def flash(q, k, v, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]


def cudnn(q, k, v, causal, scale):
    """(out [1, Hq, T, D], lse [1, Hq, T] float32) of one cuDNN call, kv heads repeated if it refuses GQA."""
    if k.shape[1] != q.shape[1] and not cudnn.gqa:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].view(q.shape[0], q.shape[1], q.shape[2])


cudnn.gqa = True


def cudnn_split(q, k, v, scale):
    T, n = q.shape[2], k.shape[2]
    if T == n:
        return cudnn(q, k, v, True, scale)[0]
    o1, l1 = cudnn(q, k[:, :, :n - T], v[:, :, :n - T], False, scale)
    o2, l2 = cudnn(q, k[:, :, n - T:], v[:, :, n - T:], True, scale)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp(), (l2 - m).exp()
    out = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return out.to(q.dtype)


def efficient(q, k, v, scale):
    g = q.shape[1] // k.shape[1]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)


def ours(config=None):
    """Our kernel over [1, H, n, D] inputs (q's and the cache's rows as views), [1, Hq, T, D] out."""
    def run(q, k, v, scale):
        rows = lambda t: t[0].transpose(0, 1)
        return attention_chunk.prefill_attention_triton(rows(q), rows(k), rows(v), scale, config).transpose(0, 1)[None]
    return run


def timed(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def first_call(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--forms", default="flash,cuDNN split,efficient,triton", help="which forms, comma-separated")
    p.add_argument("--tiles", default="", help="our kernel's tiles beside its default: 'BM,BN,warps,stages;...'")
    a = p.parse_args()
    T, N = a.tokens, a.context
    torch.manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    scale = HD ** -0.5
    # the keys and values laid out as the cache holds them, [N, Hkv, D], seen as [1, Hkv, N, D]
    k_all, v_all = (torch.randn(N, HKV, HD, **bf16).transpose(0, 1)[None] for _ in range(2))
    try:
        cudnn(torch.randn(1, HQ, 64, HD, **bf16), k_all[:, :, :64], v_all[:, :, :64], True, scale)
    except RuntimeError as e:
        cudnn.gqa = False
        print(f"cuDNN refuses the kv heads as they are ({str(e).splitlines()[0][:100]}); it gets them repeated")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"T {T}, head dim {HD}, {HQ} / {HKV} heads")
    forms = {"flash": flash, "cuDNN split": cudnn_split, "efficient": efficient, "triton": ours()}
    unknown = set(a.forms.split(",")) - set(forms)
    assert not unknown, f"forms are {', '.join(forms)}, not {', '.join(sorted(unknown))}"
    forms = {name: fn for name, fn in forms.items() if name in a.forms.split(",")}
    for tile in filter(None, a.tiles.split(";")):
        forms[f"triton {tile}"] = ours(tuple(int(x) for x in tile.split(",")))
    for n in range(T, N + 1, T):
        q = torch.randn(T, HQ, HD, **bf16).transpose(0, 1)[None]        # laid out as the engine has it
        k, v = k_all[:, :, :n], v_all[:, :, :n]
        flops = 4 * HQ * HD * (T * (n - T) + T * T / 2)
        ref = flash(q, k, v, scale).float()
        base = None
        for name, fn in forms.items():
            try:
                us = timed(lambda: fn(q, k, v, scale))
                err = (fn(q, k, v, scale).float() - ref).abs().max().item() / ref.abs().max().item()
            except RuntimeError as e:
                print(f"  n {n:6d} {name:12s} refused: {str(e).splitlines()[0][:120]}")
                continue
            base = base or us
            print(f"  n {n:6d} {name:12s} {us:9.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  {us / base:.3f} x the first form"
                  f"  max diff {err:.2e}", flush=True)
    # what a key length not seen before costs the first time
    for name, fn in forms.items():
        walls = []
        for i in range(3):
            n = N - 64 * (i + 1) - 7
            q = torch.randn(T, HQ, HD, **bf16).transpose(0, 1)[None]        # laid out as the engine has it
            try:
                walls.append(first_call(lambda: fn(q, k_all[:, :, :n], v_all[:, :, :n], scale)))
                again = first_call(lambda: fn(q, k_all[:, :, :n], v_all[:, :, :n], scale))
            except RuntimeError as e:
                print(f"  first call {name}: refused ({str(e).splitlines()[0][:100]})")
                break
        else:
            print(f"  first call at a new key length, {name}: {', '.join(f'{w / 1e3:.1f}' for w in walls)} ms "
                  f"(again: {again / 1e3:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
