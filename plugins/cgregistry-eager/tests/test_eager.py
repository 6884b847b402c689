"""The eager strategy passes cgregistry's conformance suite and serves A/B comparisons."""

from __future__ import annotations

import importlib.metadata

import cgregistry_eager
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
