"""refresh() after a weight sync (cpu backend).

- By assign, at 500 and 2,000 stale keys: the call drops every graph and makes the keys pending capture;
  its cost should grow with the key count, not its square: the 2,000-key row near 4x the 500-key row, not 16x.
- In place, 32 decoder-shaped layers: every graph is kept; the call reads every watched address once, against the
  engine reading them itself (1.7-1.9x that on this machine; 4.5x before each submodule was looked up once a read).

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


class Block(torch.nn.Module):
    """A decoder layer's parameter tree: attention and MLP projections, two norms (9 tensors over 7 modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(8, 8, bias=False) for _ in range(4))
        self.gate, self.up, self.down = (torch.nn.Linear(8, 8, bias=False) for _ in range(3))
        self.norm1, self.norm2 = torch.nn.RMSNorm(8), torch.nn.RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.o(self.v(self.norm1(x)))
        return x + h + self.down(self.up(self.norm2(x)) * self.gate(x))


@pytest.mark.parametrize("row", ["every address read by hand", "refresh() in place"])
@pytest.mark.benchmark(group="refresh after an in-place sync, 32 layers (288 tensors), 8 keys")
def test_refresh_in_place(benchmark, row: str) -> None:  # noqa: ANN001
    """An RL sync that copies into the weights (load_state_dict, no assign) leaves every graph valid; refresh() then
    reads every watched address and keeps every graph. The baseline: the engine reading every address itself."""
    model = torch.nn.Sequential(*(Block() for _ in range(32)))
    reg = cg.GraphRegistry(lambda batch, x: model(x), {"x": cg.StaticInput((64, 8), torch.float32)}, backend="cpu")
    with torch.no_grad():
        reg.capture([(B(i), "full") for i in range(1, 9)])
        model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    if row == "refresh() in place":
        results = benchmark(reg.refresh)
        assert len(results.kept) == 8 and not results.recaptured
    else:
        benchmark(lambda: [p.data_ptr() for p in model.parameters()])
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(reg.run(B(5), x=x), model(x))
