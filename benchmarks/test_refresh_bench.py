"""refresh() after an assign-style weight sync, at 500 and 2,000 stale keys (cpu backend).

The call drops every graph and hands the keys to the background thread; its cost should grow with the
key count, not its square: the 2,000-key row near 4x the 500-key row, not 16x.
Run: python -m pytest benchmarks/test_refresh_bench.py --benchmark-only
"""

from __future__ import annotations

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B


@pytest.mark.parametrize("n_keys", [500, 2_000])
@pytest.mark.benchmark(group="refresh after an assign sync")
def test_refresh_after_assign(benchmark, n_keys: int) -> None:  # noqa: ANN001
    lin = torch.nn.Linear(4, 4)
    reg = cg.GraphRegistry(lambda batch, x: lin(x), {"x": cg.StaticInput((n_keys, 4), torch.float32)}, backend="cpu")
    reg.capture([(B(i), "full") for i in range(1, n_keys + 1)])

    def assign_new_weights() -> None:
        reg.wait_captured()  # the previous round's keys are back (not timed)
        assert len(reg.entries()) == n_keys
        lin.weight = torch.nn.Parameter(torch.randn(4, 4))

    results = []
    benchmark.pedantic(lambda: results.append(reg.refresh(background=True)), setup=assign_new_weights, rounds=5)
    reg.wait_captured()
    assert all(len(r.kept) == 0 and len(r.recaptured) == n_keys for r in results)
    x = torch.randn(3, 4)
    torch.testing.assert_close(reg.run(B(3), x=x), lin(x))
