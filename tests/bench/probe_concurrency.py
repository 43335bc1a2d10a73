"""Whether the 27B's 4-bit interleaved products leave an SM room for more work: two of the same
product (each over its own weights) run one after the other, then side by side on two streams, in
one CUDA graph, at T = 1. Two side by side in the time of one and a bit say the product waits on
latency that more resident warps would hide (more programs a product: a K split of every block, say);
two in twice the time say the SM's issue or the bandwidth is already spent. Plain and SwiGLU
products only: the split products' parts share one arrival-count workspace a device.

    cd tests/bench && python3 probe_concurrency.py"""
from __future__ import annotations

import torch
from graph_timing import replay_us
from mtpchat.engine.bench import copy_bandwidth
from mtpchat.kernels import int4, matvec
from mtpchat.kernels.plan import default_products

SHAPES = [("in_proj", 16384, 5120, "plain"), ("gate_up", 34816, 5120, "swiglu"),
          ("attn qkv", 14336, 5120, "plain"),
          # a product of one program an SM or less: two side by side should take the time of one, if
          # the graph runs them side by side at all
          ("4096 x 5120", 4096, 5120, "plain"), ("2048 x 5120", 2048, 5120, "plain")]
LAUNCHES = 20


def main():
    bw = copy_bandwidth("cuda")
    print(f"copy {bw / 1e12:.3f} TB/s  {torch.cuda.get_device_name()}", flush=True)
    plan = default_products("cuda")
    run = {"plain": lambda x, w: matvec.matvec(x, w, plan=plan), "swiglu": lambda x, w: matvec.matvec_swiglu(x, w, plan)}
    side = [torch.cuda.Stream(), torch.cuda.Stream()]
    with torch.inference_mode():
        for name, N, K, kind in SHAPES:
            q = int4.interleave_ref(int4.quantize_ref(torch.randn(N, K, device="cuda") / K ** 0.5))
            copies = max(2, -(-160 * 2 ** 20 // q.nbytes()))
            ws = [[int4.GroupInt4(torch.randint_like(q.w, -2 ** 15, 2 ** 15), q.scale.clone()) for _ in range(copies)]
                  for _ in range(2)]
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            f = run[kind]
            f(x, ws[0][0]), f(x, ws[1][0])
            torch.cuda.synchronize()
            serial, paired = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(serial):
                for i in range(LAUNCHES):
                    f(x, ws[0][i % copies])
                    f(x, ws[1][i % copies])
            with torch.cuda.graph(paired):
                main_stream = torch.cuda.current_stream()
                for i in range(LAUNCHES):
                    for s, w in zip(side, ws):
                        s.wait_stream(main_stream)
                        with torch.cuda.stream(s):
                            f(x, w[i % copies])
                    for s in side:
                        main_stream.wait_stream(s)
            t_serial = min(replay_us(serial, 7) for _ in range(3)) / LAUNCHES
            t_paired = min(replay_us(paired, 7) for _ in range(3)) / LAUNCHES
            nbytes = 2 * q.nbytes()
            print(f"{name:8s} two products: one after the other {t_serial:7.2f} us ({nbytes / t_serial / 1e6:.2f} TB/s), "
                  f"side by side {t_paired:7.2f} us ({nbytes / t_paired / 1e6:.2f} TB/s): {t_paired / t_serial:.3f} x",
                  flush=True)


if __name__ == "__main__":
    main()
