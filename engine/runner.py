"""CUDA graphs for the step phases and short prefill chunks, and their timing with CUDA events.

Each phase of a step (draft k, verify k, accept k; engine/decoder.py) is a pure function of
preallocated buffers, and so is a prefill chunk of each of the plan's prefill_graphs and
prefill_early sizes (its start read on the device). At load the runner warms each one up
(compiling the Triton kernels) and captures it once per k (per size) into one shared memory pool;
a step then replays three graphs and records an event between them, so phase times cost no
synchronisation: they are read after the step's one device-to-host copy. With graphs off the same
functions run eagerly between the same events.
"""
from __future__ import annotations

import gc
import time

import torch

from mtpchat.engine.events import LoadProgress


class Runner:
    def __init__(self, decoder, graphs: bool):
        self.decoder, self.graphs_on = decoder, graphs
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.capture_s, self.pool_bytes = 0.0, 0
        self.stream = None                     # the stream the graphs are captured on (capture_stream)

    def run(self, key, fn):
        """Run a phase (its graph if captured); returns a pair of events to time it."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            fn()
        end.record()
        return start, end

    def capture(self, k_max: int, has_head: bool, sampling_params, progress=None):
        """Warm up and capture draft / verify / greedy accept for k = 0..k_max, and the prefill
        chunks of the plan's prefill_graphs and prefill_early sizes that the cache holds. The warm-up
        runs change the state, so the decoder is reset afterwards. `progress` gets a LoadProgress after each phase
        warmed up and each graph captured (two counts per graph)."""
        if not self.graphs_on:
            return
        # capture empties the allocator's cache (torch.cuda.graph): emptied here first and again at
        # the end, the reserved bytes' growth is the graphs' pool, not the load's freed slabs
        torch.cuda.empty_cache()
        t0, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        d = self.decoder
        d.reset()
        d.pos.fill_(1)          # a non-empty context so every kernel path runs
        d.pend_n.fill_(1)
        phases = []
        for k in range(0, k_max + 1):
            if k and has_head:
                phases.append((("draft", k), lambda k=k: d.draft(k)))
            phases.append((("verify", k), lambda k=k: d.verify(k)))
            phases.append((("accept", k), lambda k=k: d.accept(k, sampling_params, None)))
        # the largest first: the smaller ones may then take what it freed in the pool
        for T in sorted((*d.plan.prefill_graphs, *d.plan.prefill_early), reverse=True):
            if T + 1 <= d.state.rows:                # warmed up at position 1
                phases.append((d.chunk_key(T), lambda T=T: d.prefill_chunk_forward(T)))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        total = 2 * len(phases)
        report = (lambda done: progress(LoadProgress("capture", done, total))) if progress else (lambda done: None)
        with torch.cuda.stream(side):
            for i, (_, fn) in enumerate(phases):     # warm-up: compile kernels, settle allocations
                fn()
                d.pos.fill_(1)
                d.pend_n.fill_(1)
                report(i + 1)
        torch.cuda.current_stream().wait_stream(side)
        # No garbage collection inside a capture, where freeing an unreachable engine's tensors (a
        # model switched; a pinned host buffer's free queries the events of its copies) could
        # invalidate it: what is unreachable goes first. (A GPU test's capture failed once at its
        # next launch, "operation failed due to a previous error during capture", loading a model
        # after others in one process; neither its rerun nor a probe without this guard, the
        # collector running at nearly every allocation, reproduced it, so the cause is not known.)
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        self.stream = capture_stream(d.plan)      # one for every capture, so they share the pool's memory
        try:
            for i, (key, fn) in enumerate(phases):  # capture records the kernels without running them
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    fn()
                self.graphs[key] = graph
                report(len(phases) + i + 1)
        finally:
            if collecting:
                gc.enable()
        # the first launch of a graph also uploads it to the device (about 0.4 ms a token over a
        # 128-token reply on a 27B model): done here, once
        for graph in self.graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        d.reset()
        self.capture_s = time.perf_counter() - t0
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved() - reserved


def capture_stream(plan) -> torch.cuda.Stream:
    """The stream a runner captures its graphs on: under the plan's fold_yields one of a higher
    priority than the fold's stream beside the draft (decoder.fold_stream: 0, CUDA's lowest), else
    of that priority too. torch instantiates a graph to run each node at its own priority
    (cudaGraphInstantiateFlagUseNodePriority), which a capture takes from the node's stream
    (tests/test_gpu_draft.py reads them back): when the two streams' kernels contend, the block
    scheduler places the draft's programs before the fold's waiting ones."""
    return torch.cuda.Stream(priority=-1 if plan.fold_yields else 0)


def elapsed_ms(timing) -> float:
    """A phase time: a float already, or a pair of CUDA events (read after the step's sync)."""
    if isinstance(timing, tuple):
        return timing[0].elapsed_time(timing[1])
    return timing
