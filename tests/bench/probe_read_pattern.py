"""How fast the GPU streams the bytes of a 4-bit product in the order its programs read them, with
no arithmetic: does the access pattern itself (a tile of BN rows x B bytes a K step, the rows K / 2
bytes apart) fall short of the copy bandwidth, or is it the kernels' work that does?

    cd tests/bench && python3 probe_read_pattern.py

Each kernel reads every byte of a [N, K / 2] weight once and xors it into a word a program writes.
"rows": program p takes rows p BN .. p BN + BN and walks K in steps of B bytes a row (the
interleaved products' order); "tiled": the same blocks, each stored whole one after another (a
layout written for the tile); "persistent": 2 programs an SM walk the row blocks in turn with a
pipelined loop of the given depth, as few programs as the products run. Against torch's copy of the
same bytes (read + written over the time, as the floor's bandwidth is measured)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from graph_timing import graph_time


@triton.jit
def _rows(w, out, S, KS: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr, TILED: tl.constexpr):
    p = tl.program_id(0)
    o_r = tl.arange(0, BN)
    o_c = tl.arange(0, BW)
    acc = tl.zeros([BN, BW], tl.int32)
    for k in range(KS):
        if TILED:
            ptr = w + (p * KS + k) * BN * BW + o_r[:, None] * BW + o_c[None, :]
        else:
            ptr = w + (p * BN + o_r[:, None]) * S + k * BW + o_c[None, :]
        acc ^= tl.load(ptr)
    tl.store(out + p, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _persistent(w, out, S, blocks, KS: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr, STAGES: tl.constexpr):
    p = tl.program_id(0)
    o_r = tl.arange(0, BN)
    o_c = tl.arange(0, BW)
    acc = tl.zeros([BN, BW], tl.int32)
    for b in range(p, blocks, tl.num_programs(0)):
        for k in tl.range(KS, num_stages=STAGES):
            acc ^= tl.load(w + (b * BN + o_r[:, None]) * S + k * BW + o_c[None, :])
    tl.store(out + p, tl.sum(tl.sum(acc, 1), 0))


def main():
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, N, K in [("gate|up", 34816, 5120), ("in_proj", 16384, 5120), ("down", 5120, 17408)]:
        S = K // 8                                              # int32 words a row
        copies = 3
        ws = [torch.randint(-2 ** 31, 2 ** 31 - 1, (N, S), device="cuda", dtype=torch.int32) for _ in range(copies)]
        nbytes = N * S * 4
        dst = torch.empty_like(ws[0])
        t = graph_time(lambda i: dst.copy_(ws[i]), copies)
        print(f"{name} [{N} x {K}] {nbytes / 1e6:.1f} MB: copy {t:.1f} us, {2 * nbytes / t / 1e6:.3f} TB/s "
              f"(read only at that rate: {nbytes / (2 * nbytes / t):.1f} us)", flush=True)
        out = torch.empty(N, device="cuda", dtype=torch.int32)
        for BN, BW in [(32, 64), (32, 128), (64, 64), (16, 64), (32, 256)]:
            KS = S // BW
            if S % BW or N % BN:
                continue
            for warps in (2, 4, 8):
                for tiled in (False, True):
                    f = lambda i: _rows[(N // BN,)](ws[i], out, S, KS, BN, BW, tiled, num_warps=warps)
                    t = graph_time(f, copies)
                    print(f"  {'tiled' if tiled else 'rows '} {BN} x {4 * BW} B, {warps} warps: {t:6.1f} us "
                          f"{nbytes / t / 1e6:.3f} TB/s read", flush=True)
            for stages in (2, 4, 6):
                for per_sm in (2, 4):
                    g = sms * per_sm
                    f = lambda i: _persistent[(g,)](ws[i], out, S, N // BN, KS, BN, BW, stages, num_warps=2)
                    t = graph_time(f, copies)
                    print(f"  persistent {BN} x {4 * BW} B, 2 warps, {per_sm} an SM, {stages} deep: {t:6.1f} us "
                          f"{nbytes / t / 1e6:.3f} TB/s read", flush=True)


if __name__ == "__main__":
    main()
