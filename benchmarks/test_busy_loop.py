"""Capture between the steps of a loop that calls run() back to back with nothing between steps (cpu backend): the
time until every key is captured, against capturing the same plan before serving, both in this process; the table's
two rows are the ratio (the issue's bar: within 2x).  The first graph-served step's index is kept in extra_info.

Run: python -m pytest benchmarks/test_busy_loop.py --benchmark-only
"""

from __future__ import annotations

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B

WIDTH = 32
PLAN = cg.CapturePlan.of([(B.decode(n), "full") for n in (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)])


class Cheap:
    """Eight 32 x 32 matmuls: a step so cheap that an engine calls run() back to back, host-bound."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5 for _ in range(8)]

    def step(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x


@pytest.mark.parametrize("row", ["capture() before serving", "capture(background=True), run() back to back"])
@pytest.mark.benchmark(group="every key of an 11-key plan captured")
def test_every_key_captured(benchmark, row: str) -> None:  # noqa: ANN001
    model = Cheap()
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(64, WIDTH, generator=g)
    sizes = torch.randint(1, 65, (4 * len(PLAN),), generator=g).tolist()
    first: list[int] = []

    def registry() -> cg.GraphRegistry:
        return cg.GraphRegistry(model.step, {"x": cg.StaticInput((64, WIDTH), torch.float32)}, backend="cpu")

    def foreground() -> None:
        registry().capture(PLAN)

    def back_to_back() -> None:
        reg = registry()
        reg.capture(PLAN, background=True)
        steps = 0
        while reg.capturing():
            hits = reg.stats().hits
            n = sizes[steps % len(sizes)]
            reg.run(B.decode(n), x=xs[:n])
            steps += 1
            if len(first) < 1 and reg.stats().hits > hits:
                first.append(steps)
        assert len(reg) == len(PLAN)

    benchmark.pedantic(foreground if row.startswith("capture()") else back_to_back, rounds=5, warmup_rounds=1)
    if first:
        benchmark.extra_info["first graph-served step"] = first[0]
