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
    return replay_us(g) / launches


def replay_us(g: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    """us a replay of the captured graph g takes, the median of `replays`."""
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)
