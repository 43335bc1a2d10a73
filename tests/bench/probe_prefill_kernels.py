"""Prefill's small kernels at one chunk of the 27B's shapes, in each candidate form of the kernel
plan (engine/plan.py: prefill_rows, prefill_conv_tokens, prefill_quant), against the bytes each
must move at the copy bandwidth of the same run.

    cd tests/bench && python3 probe_prefill_kernels.py [--tokens 2048] [--sections norm,rope,...]

Each launch reads and writes its own copy of the buffers (three, rotating: more than L2 holds),
captured in a CUDA graph (graph_timing.py). Rows:
- the GDN output norm (gated, per head of 128), one row to 32 rows a program;
- the attention layer's q/k norm + RoPE with the cache writes, one token to 16 tokens a program;
- the GDN causal conv (10240 channels of the in_proj's rows), 16 to 64 tokens a block and 1 to 16
  blocks a program (KernelPlan.prefill_conv_blocks);
- the GDN's chunked form in three kernels and with the output written by the scan (fused_out),
  its prep at 4 or 8 warps, what its kernels hand each other in float32 or bf16; (`prep`) the
  prep's forms alone beside the plan's; and
  (`gdntiles`) the scan's and the output kernel's tiles; (`fla`) the same chunk through the
  flash-linear-attention library's `chunk_gated_delta_rule` (norms and gates in its kernels, bf16
  between them), where it imports (on PYTHONPATH; not a dependency of the package), with its
  output's and final state's distance from ours;
- attention's output gate: torch's sigmoid, product and copy into rows against one kernel
  (attention.gate_rows), and that kernel writing FP8 rows for o_proj;
- the MLP's gating then the FP8 rows for down (silu_mul, quantize_rows) against the two in one
  pass (fp8_gemm.quantized_swiglu), and the GDN norm then quantize_rows against the norm that
  quantizes (norm.gated_rmsnorm quantize=True); the residual add and norm then quantize_rows
  against the norm that quantizes (norm.add_rmsnorm quantize=True).
"""
from __future__ import annotations

import argparse

import torch

from mtpchat.engine.bench import copy_bandwidth
from mtpchat.engine.plan import KernelPlan
from mtpchat.kernels import attention, conv, fp8_gemm, gdn_chunk, norm
from mtpchat.kernels.matvec import silu_mul
from mtpchat.kernels.plan import default_products
from mtpchat.kernels.rope import qkv_norm_rope
from graph_timing import graph_time

H, I = 5120, 17408
HK, HV, DK, DV, CONV = 16, 48, 128, 128, 10240
IN_PROJ = CONV + HV * DV + 2 * HV
HQ, HKV, HD, ROTARY = 24, 4, 256, 64
COPIES = 3
SECTIONS = ("norm", "rope", "conv", "gdn", "prep", "gdntiles", "fla", "gate", "gating", "quant", "addnorm")


def registers(*kernels):
    """Registers and spills of each compiled variant of these Triton kernels (a spilling variant's
    time says more about its registers than its form), where this Triton tells them."""
    for fn in kernels:
        for cache in getattr(fn, "device_caches", {}).values():
            for compiled in cache[0].values():
                try:
                    compiled._init_handles()
                    print(f"  {fn.__name__}: {compiled.n_regs} registers, {compiled.n_spills} spilled, "
                          f"{compiled.metadata.num_warps} warps")
                except Exception as e:        # a Triton whose compiled kernels say it otherwise
                    print(f"  {fn.__name__}: registers not known here ({type(e).__name__})")


def kernel_times(fn, copies: int, repeats: int = 6) -> dict[str, float]:
    """us a call of fn(i) spends in each of its kernels (by name), from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(repeats):
            fn(i % copies)
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / repeats for e in prof.key_averages() if e.device_time_total > 0}


def report(name: str, us: float, nbytes: int, bw: float, base: float | None = None):
    floor = nbytes / bw * 1e6
    ratio = f", {us / base:.3f} x the first" if base else ""
    print(f"{name:58s} {us:8.1f} us  floor {floor:6.1f} us ({us / floor:.2f} x){ratio}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"which rows, of {','.join(SECTIONS)}")
    a = p.parse_args()
    T, sections = a.tokens, set(a.sections.split(","))
    assert sections <= set(SECTIONS), f"sections are {SECTIONS}"
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s, {T} tokens")
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    eps = 1e-6

    # the GDN output norm: o [T, 48, 128], z a view of in_proj's rows
    o = [torch.randn(T, HV, DV, **bf16) for _ in range(COPIES)]
    proj = [torch.randn(T, IN_PROJ, **bf16) for _ in range(COPIES)]
    z = [t[:, CONV:CONV + HV * DV].view(T, HV, DV) for t in proj]
    wn = 1 + 0.1 * torch.randn(DV, **bf16)
    if "norm" in sections:
        nbytes = 3 * T * HV * DV * 2
        base = None
        for rows in (1, 2, 4, 8, 16, 32):
            us = graph_time(lambda i: norm.gated_rmsnorm(o[i], z[i], wn, eps, rows=rows), COPIES)
            report(f"GDN output norm, {rows} rows a program", us, nbytes, bw, base)
            base = base or us

    # q/k norm + RoPE: q, k, v views of the fused projection, k and v into the caches
    width = 2 * HQ * HD + 2 * HKV * HD
    qkv = [torch.randn(T, width, **bf16) for _ in range(COPIES)]
    views = [(t[:, :2 * HQ * HD].view(T, HQ, 2 * HD)[..., :HD], t[:, 2 * HQ * HD:(2 * HQ + HKV) * HD].view(T, HKV, HD),
              t[:, (2 * HQ + HKV) * HD:].view(T, HKV, HD)) for t in qkv]
    caches = [(torch.empty(T, HKV, HD, **bf16), torch.empty(T, HKV, HD, **bf16)) for _ in range(COPIES)]
    qw, kw = 0.1 * torch.randn(HD, **bf16), 0.1 * torch.randn(HD, **bf16)
    pos = torch.arange(T, device="cuda")
    inv_freq = 1e7 ** (-torch.arange(0, ROTARY, 2, dtype=torch.float32, device="cuda") / ROTARY)
    if "rope" in sections:
        nbytes = 2 * T * (HQ + 2 * HKV) * HD * 2
        base = None
        for rows in (1, 2, 4, 8, 16):
            us = graph_time(lambda i: qkv_norm_rope(*views[i], qw, kw, pos, inv_freq, eps, *caches[i], rows=rows), COPIES)
            report(f"q/k norm + RoPE, {rows} tokens a program", us, nbytes, bw, base)
            base = base or us

    # the causal conv over the in_proj's first 10240 columns, the window ring of a k_max 4 state
    x = [t[:, :CONV] for t in proj]
    bufs = [torch.randn(CONV, 3 + 5, **bf16) for _ in range(COPIES)]
    cw = 0.3 * torch.randn(CONV, 4, **bf16)
    off = torch.zeros(1, dtype=torch.long, device="cuda")
    if "conv" in sections:
        nbytes = 2 * T * CONV * 2
        base = None
        for tokens, blocks in ((16, 1), (32, 1), (64, 1), (16, 4), (16, 8), (16, 16), (32, 4), (32, 8)):
            us = graph_time(lambda i: conv.conv_update(x[i], bufs[i], off, cw, tokens=tokens, blocks=blocks), COPIES)
            report(f"causal conv, {tokens} tokens a block, {blocks} blocks a program", us, nbytes, bw, base)
            base = base or us

    # the GDN's chunked form: q, k, v views of the conv's output, the gates of in_proj's last columns
    mixed = [torch.randn(T, CONV, **bf16) for _ in range(COPIES)]
    qkv_heads = [(m[:, :HK * DK].view(T, HK, DK), m[:, HK * DK:2 * HK * DK].view(T, HK, DK),
                  m[:, 2 * HK * DK:].view(T, HV, DV)) for m in mixed]
    gates = [(t[:, -HV:], t[:, -2 * HV:-HV]) for t in proj]           # a, b of [... | b | a]
    A_log, dt_bias = 0.5 * torch.randn(HV, **bf16), torch.randn(HV, **bf16)
    states = [0.1 * torch.randn(HV, DK, DV, device="cuda") for _ in range(COPIES)]
    bf16_between = dict(solved="bfloat16", terms="bfloat16")
    low = dict(bf16_between, normed=True, state_dot="bf16")         # its tiles gdn_chunk.BF16_TILES
    forms = []
    if "gdn" in sections:
        forms += [{}, dict(fused_out=True), bf16_between, dict(bf16_between, fused_out=True),
                  dict(bf16_between, normed=True), dict(state_dot="bf16"), low, dict(low, scan_bv=64, scan_warps=8),
                  dict(low, out_bv=64), dict(low, fused_out=True), dict(low, fused_out=True, scan_bv=64, scan_warps=8),
                  dict(low, prep_warps=2), dict(low, dot="bf16"), dict(low, fused_out=True, dot="bf16")]
    if "prep" in sections:
        # the prep's forms beside the plan's (low, fused, its products of keys in bf16)
        forms += [dict(low, fused_out=True), dict(low, fused_out=True, dot="bf16"),
                  dict(low, fused_out=True, dot="bf16", prep_warps=8), dict(low, dot="bf16")]
    if forms:
        nbytes = T * (2 * HK * DK + 2 * HV * DV) * 2
        base = None
        o_ref, s_ref = gdn_chunk.chunk_ref(*(t.float() for t in qkv_heads[0]), *(t.float() for t in gates[0]),
                                           A_log.float(), dt_bias.float(), states[0])
        rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
        for config in forms:
            run = lambda i: gdn_chunk.chunk_triton(*qkv_heads[i], *gates[i], A_log, dt_bias, states[i], config=config)
            try:
                us = graph_time(run, COPIES)
            except Exception as e:              # a tile past the shared memory, and the like
                print(f"GDN chunk, {config}: {type(e).__name__} {str(e)[:100]}", flush=True)
                continue
            o, s_end = run(0)
            report(f"GDN chunk, {config or 'as configured'}", us, nbytes, bw, base)
            base = base or us
            print(f"    from float32: o {rel(o, o_ref):.2e}, state {rel(s_end, s_ref):.2e}; "
                  + ", ".join(f"{k} {v:.1f} us" for k, v in kernel_times(run, COPIES).items()))
        registers(gdn_chunk._chunk_prep_kernel, gdn_chunk._chunk_scan_kernel, gdn_chunk._chunk_out_kernel)
    if "gdntiles" in sections:
        # the serial scan's and the output's tiles (value columns a program, warps, depth), the rest
        # as CHUNK_CONFIG has them
        nbytes = T * (2 * HK * DK + 2 * HV * DV) * 2
        base = None
        tiles = [{}, dict(scan_bv=32), dict(scan_bv=32, scan_warps=4), dict(scan_stages=3), dict(scan_warps=4),
                 dict(scan_bv=128), dict(out_bv=128), dict(out_bv=32), dict(out_warps=8), dict(out_warps=2)]
        for config in tiles:
            run = lambda i: gdn_chunk.chunk_triton(*qkv_heads[i], *gates[i], A_log, dt_bias, states[i], config=config)
            try:
                us = graph_time(run, COPIES)
            except Exception as e:              # a tile past the shared memory, and the like
                print(f"GDN chunk, {config}: {type(e).__name__} {str(e)[:100]}", flush=True)
                continue
            report(f"GDN chunk, {config or 'as configured'}", us, nbytes, bw, base)
            base = base or us
            print("    " + ", ".join(f"{k} {v:.1f} us" for k, v in kernel_times(run, COPIES).items()))

    if "fla" in sections:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        nbytes = T * (2 * HK * DK + 2 * HV * DV) * 2
        whole = [tuple(t.contiguous()[None] for t in h) for h in qkv_heads]
        raw = [(g_a.contiguous()[None], g_b.contiguous()[None]) for g_a, g_b in gates]

        def run_fla(i):
            (q, k, v), (g_a, g_b) = whole[i], raw[i]
            return chunk_gated_delta_rule(q, k, v, g_a, g_b, initial_state=states[i][None], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                          use_gate_in_kernel=True, A_log=A_log.float(), dt_bias=dt_bias.float())
        ours = lambda i: gdn_chunk.chunk_triton(*qkv_heads[i], *gates[i], A_log, dt_bias, states[i])
        plan = KernelPlan(products=default_products("cuda"))
        engine_form = lambda i: gdn_chunk.chunk(*qkv_heads[i], *gates[i], A_log, dt_bias, states[i],
                                                fused_out=plan.chunk_fused_out, solved=plan.chunk_solved,
                                                terms=plan.chunk_terms, products=plan.chunk_products,
                                                normed=plan.chunk_normed, prep_products=plan.chunk_prep_products)
        o_ours, s_ours = ours(0)
        o_plan, s_plan = engine_form(0)
        o_fla, s_fla = run_fla(0)
        o_ref, s_ref = gdn_chunk.chunk_ref(*(t.float() for t in qkv_heads[0]), *(t.float() for t in gates[0]),
                                           A_log.float(), dt_bias.float(), states[0])
        rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
        print(f"GDN chunk vs float32 reference, relative L2: ours o {rel(o_ours, o_ref):.2e} state "
              f"{rel(s_ours, s_ref):.2e}; the plan's form o {rel(o_plan, o_ref):.2e} state {rel(s_plan, s_ref):.2e}; "
              f"fla o {rel(o_fla[0], o_ref):.2e} state {rel(s_fla[0], s_ref):.2e}")
        base = graph_time(ours, COPIES)
        report("GDN chunk: ours, the kernels' own defaults (float32, tf32)", base, nbytes, bw)
        print("    " + ", ".join(f"{k} {v:.1f} us" for k, v in kernel_times(ours, COPIES).items()))
        report("GDN chunk: ours, the engine plan's form", graph_time(engine_form, COPIES), nbytes, bw, base)
        print("    " + ", ".join(f"{k} {v:.1f} us" for k, v in kernel_times(engine_form, COPIES).items()))
        us = graph_time(run_fla, COPIES)
        report("GDN chunk: flash-linear-attention", us, nbytes, bw, base)
        print("    " + ", ".join(f"{k[:40]} {v:.1f} us" for k, v in kernel_times(run_fla, COPIES).items()))

    # attention's output gate: o as SDPA hands it back (transposed), the gate a view of q|gate
    att = [torch.randn(HQ, T, HD, **bf16).transpose(0, 1) for _ in range(COPIES)]
    gate = [t[:, :2 * HQ * HD].view(T, HQ, 2 * HD)[..., HD:] for t in qkv]
    if "gate" in sections:
        nbytes = 3 * T * HQ * HD * 2
        torch_us = graph_time(lambda i: (att[i] * torch.sigmoid(gate[i])).reshape(T, HQ * HD), COPIES)
        report("attention output gate, torch", torch_us, nbytes, bw)
        for tokens in (4, 16):
            us = graph_time(lambda i: attention.gate_rows(att[i], gate[i], tokens=tokens), COPIES)
            report(f"attention output gate, one kernel, {tokens} tokens a program", us, nbytes, bw, torch_us)
        two = graph_time(lambda i: fp8_gemm.quantize_rows_triton((att[i] * torch.sigmoid(gate[i])).reshape(T, HQ * HD),
                                                                 fp8_gemm.CUBLAS_ROWS), COPIES)
        one = graph_time(lambda i: attention.gate_rows(att[i], gate[i], quantize=True), COPIES)
        report("attention output gate (torch), then quantize_rows", two, T * HQ * HD * (2 + 2 + 2 + 2 + 1), bw)
        report("attention output gate into FP8 rows", one, T * HQ * HD * (2 + 2 + 1), bw, two)

    # the MLP's gating and the FP8 rows of down, in two passes and in one
    gate_up = [torch.randn(T, 2 * I, **bf16) for _ in range(COPIES)]
    if "gating" in sections:
        two = graph_time(lambda i: fp8_gemm.quantize_rows_triton(silu_mul(gate_up[i]), fp8_gemm.CUBLAS_ROWS), COPIES)
        one = graph_time(lambda i: fp8_gemm.quantized_swiglu(gate_up[i]), COPIES)
        report("gating, then quantize_rows", two, T * I * (4 + 2 + 2 + 1), bw)
        report("gating into FP8 rows (quantized_swiglu)", one, T * I * (4 + 1), bw, two)

    # the GDN output norm then the FP8 rows of out_proj, in two passes and in one
    if "quant" in sections:
        for rows in (1, 16):
            two = graph_time(lambda i: fp8_gemm.quantize_rows_triton(
                norm.gated_rmsnorm(o[i], z[i], wn, eps, rows=rows).view(T, HV * DV), fp8_gemm.CUBLAS_ROWS), COPIES)
            one = graph_time(lambda i: norm.gated_rmsnorm(o[i], z[i], wn, eps, rows=rows, quantize=True), COPIES)
            report(f"GDN output norm ({rows} rows), then quantize_rows", two, T * HV * DV * (2 + 2 + 2 + 2 + 1), bw)
            report(f"GDN output norm ({rows} rows) into FP8 rows", one, T * HV * DV * (2 + 2 + 1), bw, two)

    # the residual add and norm before an FP8 product, then the rows quantized, in two passes and in one
    xs_ = [torch.randn(T, H, **bf16) for _ in range(COPIES)]
    rs_ = [torch.randn(T, H, **bf16) for _ in range(COPIES)]
    wr = 0.1 * torch.randn(H, **bf16)
    if "quant" in sections:
        two = graph_time(lambda i: fp8_gemm.quantize_rows_triton(norm.add_rmsnorm(xs_[i], rs_[i], wr, eps)[0],
                                                                 fp8_gemm.CUBLAS_ROWS), COPIES)
        one = graph_time(lambda i: norm.add_rmsnorm(xs_[i], rs_[i], wr, eps, quantize=True), COPIES)
        report("add + norm, then quantize_rows", two, T * H * (2 + 2 + 2 + 2 + 2 + 1), bw)
        report("add + norm into FP8 rows", one, T * H * (2 + 2 + 2 + 1), bw, two)

    if "addnorm" in sections:
        # the residual add and norm of a prefill (5,120 wide), one row a program, on 4 to 16 warps
        for warps in (4, 8, 16):
            us = graph_time(lambda i: norm.add_rmsnorm_triton(xs_[i], rs_[i], wr, eps, warps=warps), COPIES)
            report(f"add + norm, {warps} warps", us, T * H * (2 + 2 + 2 + 2), bw)
            us = graph_time(lambda i: norm.add_rmsnorm_triton(xs_[i], rs_[i], wr, eps, quantize=True, warps=warps),
                            COPIES)
            report(f"add + norm into FP8 rows, {warps} warps", us, T * H * (2 + 2 + 2 + 1), bw)
        registers(norm._rmsnorm_kernel)


if __name__ == "__main__":
    main()
