"""Shared GPU timing helper for the benchmark scripts."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable

import torch


def per_step_on_gpu(fn: Callable[[], object], steps: int = 20, top: int = 0) -> tuple[float, float, float]:
    """GPU kernel µs, kernels and device-to-device copies a step; with ``top``, print the ``top`` kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(1 for e in kernels if "emcpy" in e.name)
    if top:
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.device_time)
        ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
        for name, times in ranked:
            print(f"    {sum(times) / steps:8.1f} us a step, {len(times) / steps:5.1f} a step, {name[:110]}")
    return sum(e.device_time for e in kernels) / steps, len(kernels) / steps, copies / steps


def per_call_us(fn: Callable[[], object], iters: int, repeats: int = 7) -> float:
    """Median over repeats of wall time per call, GPU drained before and after each repeat."""
    for _ in range(max(iters // 10, 3)):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def doubling_graph(rows: int, static_rows: int = 64, width: int = 256) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """A one-kernel graph, ``out = static[:rows] * 2``, captured by hand after a side-stream warm-up: the bare replay
    the overhead benchmarks hold ``run()`` against.  Returns the graph, its static input and its output."""
    static = torch.zeros(static_rows, width, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static[:rows] * 2
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = static[:rows] * 2
    return graph, static, out


def copy_replay_slice(graph: torch.cuda.CUDAGraph, static: torch.Tensor, out: torch.Tensor, live: torch.Tensor) -> Callable[[], torch.Tensor]:
    """What an engine writes by hand around ``doubling_graph``: copy the live rows in, replay, slice the output."""
    rows = live.shape[0]

    def hand() -> torch.Tensor:
        static[:rows].copy_(live)
        graph.replay()
        return out[:rows]

    return hand


def static_graph(
    model: Callable[..., torch.Tensor],
    batch: object,
    inputs: dict[str, torch.Tensor],
    graph: object,
    capture: Callable[[object], object],
) -> Callable[[], torch.Tensor]:
    """The hand-written pattern: static copies of the inputs, side-stream warm-up, capture, copy in + replay.

    ``capture(graph)`` is the capture context for ``graph`` (``torch.cuda.graph`` or a peer library's).
    """
    static = {k: v.clone() for k, v in inputs.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            model(batch, **static)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.inference_mode(), capture(graph):
        out = model(batch, **static)

    def run() -> torch.Tensor:
        for k, v in inputs.items():
            static[k].copy_(v)
        graph.replay()  # type: ignore[attr-defined]
        return out

    return run


def reduce_overhead_warmed(model: Callable[..., object], cfg: object, sizes: Iterable[int], gen: torch.Generator) -> tuple[Callable[..., object], float]:
    """``torch.compile(model, mode="reduce-overhead", dynamic=True)`` warmed up at each token size (three calls
    per size: what records its graph) on the demo decoder's random batches, and the seconds that took."""
    from cgregistry import BatchDescriptor
    from cgregistry.demo_model import random_batch

    ro = torch.compile(model, mode="reduce-overhead", dynamic=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        for n in sizes:
            inputs = random_batch(cfg, BatchDescriptor(n, min(n, cfg.max_num_seqs)), "cuda", gen)  # type: ignore[attr-defined]
            for _ in range(3):
                ro(**inputs)
    torch.cuda.synchronize()
    return ro, time.perf_counter() - start


def used_device_bytes() -> int:
    """Device memory in use now, by anyone (``mem_get_info``), after the work queued so far."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def clean_device() -> None:
    """What is garbage collected, and the caching allocator's free blocks given back to the driver."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def transition_floor_us(breaks: int = 12, iters: int = 500) -> float:
    """What one graph-to-eager-to-graph transition costs from Python: ``breaks + 1`` one-matmul graphs replayed with one
    eager kernel between each, against one graph of the same kernels, per break.  The floor a piecewise step pays per
    split whatever does the splitting (each graph here is a few µs of GPU work, so the host's cost shows in full)."""
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x @ w
            x.add_(0)
    torch.cuda.current_stream().wait_stream(side)
    pieces = []
    for _ in range(breaks + 1):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x @ w
        pieces.append(graph)
    whole = torch.cuda.CUDAGraph()
    with torch.cuda.graph(whole):
        for i in range(breaks + 1):
            x @ w
            if i < breaks:
                x.add_(0)

    def split() -> None:
        for graph in pieces[:-1]:
            graph.replay()
            x.add_(0)
        pieces[-1].replay()

    return (per_call_us(split, iters) - per_call_us(whole.replay, iters)) / breaks
