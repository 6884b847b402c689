"""The ``eager`` strategy: registry bookkeeping without a graph, to A/B a suspected graph bug.

"Capture" runs the step once on the padded static inputs and keeps its outputs;
each "replay" runs the step again and copies the fresh outputs into those
tensors, so ``run`` hands back the same kind of views a graph entry does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cgregistry.store.io import flatten
from cgregistry.plugin import StrategyRegistrar, hookimpl

__all__ = ["EagerGraph", "EagerStrategy"]
__version__ = "0.1.0"


class EagerGraph:
    """Runs the step on every replay; holds the output tensors the registry slices."""

    def __init__(self, body: Callable[[], Any], outputs: list[torch.Tensor]) -> None:
        self.body = body
        self.outputs = outputs  # strong references: the registry's views point here
        self.memory_bytes = sum(t.untyped_storage().nbytes() for t in outputs)
        self.num_segments = 0  # no graph at all

    def replay(self) -> None:
        with torch.inference_mode():
            fresh, _ = flatten(self.body())
            for held, new in zip(self.outputs, fresh):
                held.copy_(new)


class EagerStrategy:
    """Strategy ``eager``: same keys as ``full`` (exact request counts), no capture."""

    name = "eager"
    relaxes_num_reqs = False

    def capture(self, body: Callable[[], Any], backend: Any, pool: object) -> tuple[EagerGraph, Any]:
        out = body()
        leaves, _ = flatten(out)
        return EagerGraph(body, leaves), out


@hookimpl
def cgregistry_register_strategies(register: StrategyRegistrar) -> None:
    register(EagerStrategy())
