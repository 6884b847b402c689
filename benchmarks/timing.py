"""Shared GPU timing helper for the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


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
