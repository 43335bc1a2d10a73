"""Timing a kernel launch as the decode step sees it: captured in a CUDA graph, `launches` launches
over rotating weight copies (more bytes than L2 holds), the median of 5 replays. Shared by the
product benches and probes of this folder (run from it: `cd tests/bench && python3 NAME.py`)."""
from __future__ import annotations

import statistics

import torch


def graph_time(fn, copies: int, launches: int = 20) -> float:
    """us a launch of fn(i) (i: which of `copies` weight copies), the median of 5 graph replays."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            fn(i % copies)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    return statistics.median(times)
