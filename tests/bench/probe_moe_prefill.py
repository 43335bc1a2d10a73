"""What a prefill chunk's expert products cost at the 35B-A3B's shapes (H 2048, 256 experts of 512, 8
a token, the shared expert as a ninth choice), by weight format and by the tile of the 4-bit ones:
the chat turn of a 4-bit MoE (probe_turn.py, `--model qwen3.5-35b-a3b --weights int4`) spends most
of its time in them, where an FP8 one does not.

    cd tests/bench && python3 probe_moe_prefill.py [--tokens 16,50,128] [--bm 64,32,16]
                                                   [--tiles "64,128,4,3 32,128,4,3"]

For each chunk of T tokens (random routing, the layout a prefill takes: blocks of BM pairs, launched
for the most blocks the pairs can take, as a graph chunk does) the SwiGLU and the down product in
us (graph replays) for bf16, FP8 and 4-bit (interleaved, group 128) experts, the 4-bit ones under
each tile of --tiles (the plan's int4_tiles rule for a prefill's expert products) and each BM.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch
from graph_timing import graph_time

from mtpchat.kernels import fp8, int4, moe, moe_layout
from mtpchat.kernels.plan import default_products

E, F, H, TOP_K = 256, 512, 2048, 8
DEVICE = "cuda"


def int4_stack(N: int, K: int, gen: torch.Generator) -> int4.GroupInt4:
    """Random words and group scales of N rows, interleaved as the engine stores its 4-bit experts."""
    w = torch.randint(-2 ** 31, 2 ** 31 - 1, (N, K // 8), device=DEVICE, generator=gen, dtype=torch.int32)
    scale = (torch.rand(N, K // 128, device=DEVICE, generator=gen) * 0.01 + 0.001).half()
    return int4.interleave_ref(int4.GroupInt4(w, scale))


def fp8_stack(N: int, K: int, gen: torch.Generator) -> fp8.BlockFP8:
    bytes_ = torch.randint(0, 256, (N, K), device=DEVICE, generator=gen, dtype=torch.uint8) & 0x7E    # no NaN
    scale = torch.rand(N // 128, K // 128, device=DEVICE, generator=gen) * 0.01 + 0.001
    return fp8.BlockFP8(bytes_.view(fp8.FP8), scale)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="16,50,128")
    p.add_argument("--bm", default="64,32,16", help="the pairs a block takes (moe_layout.PREFILL_ROWS: 64)")
    p.add_argument("--dry", action="store_true", help="each variant once at small shapes, untimed (no GPU: the interpreter)")
    p.add_argument("--tiles", default="64,128,4,3 32,128,4,3 64,256,4,3 32,256,4,3 128,128,8,3 64,128,4,2",
                   help="4-bit prefill tiles BN,BK,warps,stages (the first is the engine's)")
    a = p.parse_args()
    global E, F, H, DEVICE, graph_time
    if a.dry:
        E, F, H, DEVICE = 6, 128, 256, "cpu"
        graph_time = lambda fn, copies: (fn(0), 0.0)[1]          # noqa: E731 (run once, untimed)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    base = default_products(DEVICE)
    tiles = [tuple(int(v) for v in t.split(",")) for t in a.tiles.split()]
    weights = {
        "bf16": ((torch.randn(E * 2 * F, H, device=DEVICE, generator=gen) * 0.02).bfloat16(),
                 (torch.randn(E * H, F, device=DEVICE, generator=gen) * 0.02).bfloat16(),
                 (torch.randn(2 * F, H, device=DEVICE, generator=gen) * 0.02).bfloat16(),
                 (torch.randn(H, F, device=DEVICE, generator=gen) * 0.02).bfloat16()),
        "fp8": (fp8_stack(E * 2 * F, H, gen), fp8_stack(E * H, F, gen), fp8_stack(2 * F, H, gen), fp8_stack(H, F, gen)),
        "int4": (int4_stack(E * 2 * F, H, gen), int4_stack(E * H, F, gen), int4_stack(2 * F, H, gen),
                 int4_stack(H, F, gen)),
    }
    print(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE}; us a chunk's expert SwiGLU + down (graph replays), "
          f"35B-A3B shapes, {TOP_K} experts a token + the shared one", flush=True)
    for T in (int(t) for t in a.tokens.split(",")):
        ids = torch.stack([torch.randperm(E, device=DEVICE, generator=gen)[:min(TOP_K, E)] for _ in range(T)]).int()
        ids = torch.cat([ids, torch.full((T, 1), E, dtype=torch.int32, device=DEVICE)], 1)
        k = ids.shape[1]
        x = torch.randn(T, H, device=DEVICE, generator=gen).bfloat16()
        h = torch.randn(T * k, F, device=DEVICE, generator=gen).bfloat16()
        distinct = len(set(ids[:, :TOP_K].flatten().tolist()))
        print(f"  {T} tokens, {distinct} distinct experts", flush=True)
        for bm in (int(b) for b in a.bm.split(",")):
            layout = moe_layout.layout_ref(ids, E + 1, bm, moe_layout.most_blocks(ids.numel(), E + 1, bm))
            for name, (wgu, wd, sgu, sd) in weights.items():
                variants = [(None, base)]
                if name == "int4":
                    variants = [(t, dataclasses.replace(base, int4_tiles=lambda prod, N, K, G, t=t: t)) for t in tiles]
                for tile, vplan in variants:
                    t_glu = graph_time(lambda i: moe.expert_swiglu_triton(x, wgu, layout, k, E, shared=sgu,
                                                                          plan=vplan), 1)
                    t_down = graph_time(lambda i: moe.expert_down_triton(h, wd, layout, E, shared=sd, plan=vplan), 1)
                    label = name + (f" tile {tile}" if tile else "")
                    print(f"    BM {bm:3d} {label:28s} swiglu {t_glu:8.1f}  down {t_down:8.1f}  "
                          f"sum {t_glu + t_down:8.1f}", flush=True)


if __name__ == "__main__":
    main()
