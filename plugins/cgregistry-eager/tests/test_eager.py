"""The eager strategy passes cgregistry's conformance suite and serves A/B comparisons."""

from __future__ import annotations

import importlib.metadata

import cgregistry_eager
import pytest
import torch

import cgregistry as cg
from cgregistry.testing import StrategyConformance, make_plugins


class TestEagerConformance(StrategyConformance):
    strategy = "eager"
    plugins = (cgregistry_eager,)


def test_found_through_the_installed_entry_point() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="cgregistry")}
    assert eps.get("eager") == "cgregistry_eager"
    plugins = cg.Plugins()  # autoload: entry points of installed distributions
    assert plugins.strategy_origin["eager"] == "eager"
    info = {p.name: p for p in plugins.describe()}["eager"]
    assert (info.distribution, info.version, info.builtin) == ("cgregistry-eager", "0.1.0", False)
    assert info.hooks == ("cgregistry_register_strategies",)


def test_ab_against_full_gives_the_same_numbers() -> None:
    w = torch.randn(8, 8)

    def step(batch: cg.BatchDescriptor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    results = {}
    for strategy in ("full", "eager"):
        reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16, 8), torch.float32)}, backend="cpu", plugins=make_plugins(cgregistry_eager))
        reg.capture([(cg.BatchDescriptor(16, 16), strategy)])
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
        results[strategy] = reg.run(cg.BatchDescriptor(6, 3), x=x).clone()
        assert reg.stats().by_strategy == {strategy: 1}
    torch.testing.assert_close(results["full"], results["eager"])


def test_plans_that_name_no_plugins_find_the_installed_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan whose mode names a strategy that is not built in looks it up in the installed plugins (its own
    ``relaxes_num_reqs`` decides its mixed keys); with autoload off it is not found, and the error names it."""
    plan = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=16, mode=("full", "eager"))
    assert {e.strategy for e in plan} == {"full", "eager"}
    relaxed = cgregistry_eager.EagerStrategy.relaxes_num_reqs
    assert all((e.descriptor.num_reqs is None) == relaxed for e in plan if e.strategy == "eager")
    monkeypatch.setenv("CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD", "1")
    with pytest.raises(ValueError, match="strategy 'eager' is not registered; available: breakable, full, piecewise"):
        cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=16, mode=("full", "eager"))
