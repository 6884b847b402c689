"""pytest helpers for cgregistry plugin authors.

Opt in from a ``conftest.py`` with ``pytest_plugins = ["cgregistry.testing"]``.

- ``cg_tiny_model``: a 2-layer demo decoder on the CPU.
- ``cg_plugins``: ``cg_plugins(*plugins)`` gives a fresh ``Plugins`` with your plugins (and the built-ins) registered
  for this test only, entry points not loaded.
- ``cg_registry``: a fresh registry on the CPU backend around the tiny model.
- ``StrategyConformance``: subclass it as ``class TestMine(StrategyConformance)`` with ``strategy = "mine"`` and
  ``plugins = (my_plugin,)`` to run the suite every strategy must pass; a strategy that graphs compiled code overrides
  ``compiled(body)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytest
import torch

from cgregistry.store.io import StaticInput
from cgregistry.demo_model import DemoConfig, DemoDecoder, demo_inputs, random_batch
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.plan.build import CapturePlan
from cgregistry.hooks.manager import Plugins, make_plugin_manager
from cgregistry.registry import GraphRegistry
from cgregistry.errors import CaptureError

__all__ = ["TINY", "StrategyConformance", "cg_plugins", "cg_registry", "cg_tiny_model", "make_plugins"]

TINY = DemoConfig(
    layers=2, hidden=32, heads=2, ffn=64, vocab=128, max_num_seqs=8, max_num_tokens=32, context=8, dtype=torch.float32
)


def make_plugins(*plugins: object) -> Plugins:
    """A fresh plugin set: ``plugins`` plus the built-ins, no entry points."""
    return Plugins(make_plugin_manager(plugins, autoload=False))


@pytest.fixture
def cg_tiny_model() -> DemoDecoder:
    """A small demo decoder on the CPU (2 layers, hidden 32), seeded."""
    return DemoDecoder(TINY, "cpu", seed=0)


@pytest.fixture
def cg_plugins() -> Callable[..., Plugins]:
    """``cg_plugins(*plugins)``: a Plugins with these plugins registered for this test only."""
    return make_plugins


@pytest.fixture
def cg_registry(cg_tiny_model: DemoDecoder) -> GraphRegistry:
    """A fresh registry on the CPU backend around the tiny model (nothing captured yet)."""
    return GraphRegistry(cg_tiny_model, demo_inputs(TINY), backend="cpu", plugins=make_plugins())


class StrategyConformance:
    """What every strategy must do; subclass with ``strategy`` (and ``plugins``) set.  Uses the CPU backend unless
    ``backend`` says otherwise."""

    strategy: ClassVar[str]
    plugins: ClassVar[Sequence[object]] = ()
    backend: ClassVar[str] = "cpu"

    # -- how the suite builds its steps (override for a strategy that needs its step compiled)

    def compiled(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """What the suite's steps call to run a test's tensor code, ``body(**inputs)`` (the step's host-side code, a
        check of the batch, runs before it, outside): ``body`` itself.  A strategy whose graphs come from compiled
        code overrides it; the built-in ``piecewise``, say, returns ``cgregistry.compile_piecewise(...)`` of it."""
        return body

    # -- helpers

    def _plugins(self) -> Plugins:
        return make_plugins(*self.plugins)

    def _keys(self, plugins: Plugins) -> list[BatchDescriptor]:
        if plugins.strategy(self.strategy).relaxes_num_reqs:
            return [BatchDescriptor(t) for t in (32, 16, 8, 4)]
        return [BatchDescriptor(t, min(t, TINY.max_num_seqs)) for t in (32, 16, 8, 4)] + [
            BatchDescriptor.decode(r) for r in (8, 4, 2, 1)
        ]

    def _step(self, body: Callable[..., Any], host: Callable[[BatchDescriptor], None] | None = None) -> Callable[..., Any]:
        """A step that runs ``host(batch)``, then ``body`` as ``compiled`` makes it."""
        run = self.compiled(body)

        def step(batch: BatchDescriptor, **inputs: Any) -> Any:
            if host is not None:
                host(batch)
            return run(**inputs)

        return step

    def _registry(self) -> tuple[GraphRegistry, Any]:
        """A registry around the tiny demo decoder, and the decoder (eager: the oracle)."""
        plugins = self._plugins()
        model = DemoDecoder(TINY, plugins.backend(self.backend).device(), seed=0)

        def body(input_ids: torch.Tensor, req_idx: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
            return model(None, input_ids, req_idx, seq_lens)  # the demo decoder reads no field of the batch

        reg = GraphRegistry(self._step(body), demo_inputs(TINY), backend=self.backend, plugins=plugins, preference=(self.strategy,))
        return reg, model

    # -- the suite

    def test_strategy_is_registered(self) -> None:
        plugins = self._plugins()
        strategy = plugins.strategy(self.strategy)
        assert strategy.name == self.strategy
        assert isinstance(strategy.relaxes_num_reqs, bool)

    def test_matches_eager_across_the_plan(self) -> None:
        reg, model = self._registry()
        keys = self._keys(reg.plugins)
        reg.capture(CapturePlan.of((k, self.strategy) for k in keys))
        assert {e.key for e in reg.entries(strategy=self.strategy)} == set(keys)
        gen = torch.Generator().manual_seed(0)
        shapes = [BatchDescriptor.decode(r) for r in (1, 3, 8)] + [BatchDescriptor(t, r) for t, r in ((5, 2), (13, 6), (32, 8))]
        with torch.inference_mode():
            for batch in shapes:
                inputs = random_batch(TINY, batch, reg.device, gen)
                got = reg.run(batch, **inputs)
                assert got.shape[0] == batch.num_tokens, "outputs are sliced to the actual batch"
                torch.testing.assert_close(got, model(batch, **inputs), rtol=1e-4, atol=1e-4)
        stats = reg.stats()
        assert stats.hits == len(shapes) and stats.misses == 0
        assert stats.by_strategy.get(self.strategy) == len(shapes)

    def test_replays_read_fresh_inputs(self) -> None:
        reg, model = self._registry()
        batch = BatchDescriptor.decode(4)
        reg.capture([(self._keys(reg.plugins)[0], self.strategy)])
        gen = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            first = random_batch(TINY, batch, reg.device, gen)
            second = random_batch(TINY, batch, reg.device, gen)
            a = reg.run(batch, **first).clone()
            b = reg.run(batch, **second).clone()
            torch.testing.assert_close(a, model(batch, **first), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(b, model(batch, **second), rtol=1e-4, atol=1e-4)
        assert not torch.equal(a, b)

    def test_capture_failure_is_contained(self) -> None:
        plugins = self._plugins()
        broken = self._keys(plugins)[1]

        def fail_at_broken(batch: BatchDescriptor) -> None:
            if batch == broken:
                raise RuntimeError("step failed for this key")

        reg = GraphRegistry(self._step(lambda x: x * 2 + 1, host=fail_at_broken), {"x": StaticInput((32, 4), torch.float32)},
                            backend=self.backend, plugins=plugins)
        keys = self._keys(plugins)[:3]
        with pytest.raises(CaptureError, match="step failed for this key") as info:
            reg.capture([(k, self.strategy) for k in keys])
        assert info.value.descriptor == broken and info.value.strategy == self.strategy
        assert [e.key for e in reg.entries()] == [keys[0]]
        x = torch.ones(3, 4, device=reg.device)
        torch.testing.assert_close(reg.run(BatchDescriptor(3, 1), x=x), x * 2 + 1)

    def test_pytree_outputs(self) -> None:
        def body(x: torch.Tensor) -> dict[str, Any]:
            return {"h": x + 1, "pair": (x * 3, None)}

        reg = GraphRegistry(self._step(body), {"x": StaticInput((32, 4), torch.float32)}, backend=self.backend, plugins=self._plugins())
        reg.capture([(self._keys(reg.plugins)[0], self.strategy)])
        x = torch.randn(5, 4, device=reg.device)
        out = reg.run(BatchDescriptor(5, 2), x=x)
        torch.testing.assert_close(out["h"], x + 1)
        torch.testing.assert_close(out["pair"][0], x * 3)
        assert out["pair"][1] is None

    def test_entries_report_time_and_memory(self) -> None:
        reg, _ = self._registry()
        reg.capture([(k, self.strategy) for k in self._keys(reg.plugins)[:2]])
        for info in reg.entries():
            assert info.strategy == self.strategy
            assert info.capture_seconds > 0
            assert isinstance(info.memory_bytes, int) and info.memory_bytes >= 0
