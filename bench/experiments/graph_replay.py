"""One GPU call timed as a CUDA graph replays it, the way the server runs a decode step (the
shared harness of small_work_floor.py and split_tile_probe.py)."""

from __future__ import annotations

import statistics

import torch

FLUSH_BYTES = 256 * 1024 * 1024      # larger than any L2 measured here (H100/H200: 50-60 MB)


def replay_median_us(fn, reps: int, cold_l2: bool = False, warmup: int = 3) -> float:
    """Median microseconds of `reps` replays of `fn` captured in one CUDA graph, CUDA events
    around each replay; `cold_l2`: a buffer larger than L2 is written before each replay (outside
    the events), so the call reads its data from HBM."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):       # warm-up on a side stream, as CUDA-graph capture wants
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda") if cold_l2 else None
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)
