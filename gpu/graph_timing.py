"""Timing one call under a CUDA graph: the replay time the GPU scripts report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def capture(fn: Callable[[], Any]) -> Any:
    """`fn` captured in a CUDA graph, after two warm-up calls on a side stream (what
    capture needs: allocations and lazy initialisation happen outside it)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_replay_ms(fn: Callable[[], Any], iters: int = 50) -> float:
    import torch

    graph = capture(fn)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]
