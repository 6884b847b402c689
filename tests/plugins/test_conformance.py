"""cgregistry.testing's conformance suite run against the built-in strategies (and its fixtures used)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map_only

import cgregistry as cg
from cgregistry.testing import StrategyConformance


class TestFullConformance(StrategyConformance):
    strategy = "full"


@pytest.mark.cuda
class TestFullConformanceOnCuda(StrategyConformance):
    strategy = "full"
    backend = "cuda"


def test_fixtures_give_a_fresh_cpu_registry(cg_registry: cg.GraphRegistry, cg_tiny_model: torch.nn.Module) -> None:
    assert cg_registry.backend.name == "cpu" and len(cg_registry) == 0
    assert set(cg_registry.plugins.strategies) == {"full", "breakable", "piecewise"}, "no entry points: only the built-ins"


def test_cg_plugins_registers_for_one_test(cg_plugins) -> None:  # noqa: ANN001
    class Named:
        name = "named"
        relaxes_num_reqs = True

        def capture(self, body, backend, pool):  # noqa: ANN001, ANN201
            return backend.capture(body, pool)

    class Plugin:
        @cg.plugin.hookimpl
        def cgregistry_register_strategies(self, register):  # noqa: ANN001, ANN201
            register(Named())

    assert "named" in cg_plugins(Plugin()).strategies
    assert "named" not in cg_plugins().strategies


class TestBreakableConformance(StrategyConformance):
    strategy = "breakable"


@pytest.mark.cuda
class TestBreakableConformanceOnCuda(StrategyConformance):
    strategy = "breakable"
    backend = "cuda"


@cg.eager_break
def handed_to_host(t: torch.Tensor) -> torch.Tensor:
    """Host code a step hands its outputs to (an eager break): where a piecewise trace splits."""
    return t.clone()


class TestPiecewiseConformance(StrategyConformance):
    """``piecewise`` graphs the pieces of a compiled trace between splitting ops: the suite's tensor code runs compiled
    with ``cgregistry.compile_piecewise``, its outputs handed to host code (an eager break) for a split."""

    strategy = "piecewise"

    def compiled(self, body: Callable[..., Any]) -> Callable[..., Any]:
        return cg.compile_piecewise(lambda **inputs: tree_map_only(torch.Tensor, handed_to_host, body(**inputs)))
