"""A CUDA graph of a function, recorded as torch requires: one warm-up run on a side
stream first. The GPU tests and ``benchmarks/gpu_capture.py`` record captures with it."""

from __future__ import annotations

from typing import Callable

import torch


def record(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Run ``fn()`` once on a side stream (torch's graph capture needs its allocations
    warmed up outside the graph), then record it into a graph and return the graph;
    ``graph.replay()`` reruns its device work without Python."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
