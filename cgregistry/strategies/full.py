"""The ``full`` strategy: the whole step is one graph.  Fastest replay, but attention metadata is frozen into the
graph, so keys carry an exact request count."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cgregistry.backends import Backend, Graph
from cgregistry.builtins import BUILTIN_RELAXES
from cgregistry.contracts.markers import hookimpl

if TYPE_CHECKING:
    from cgregistry.hooks.manager import StrategyRegistrar

__all__ = ["FullStrategy"]


class FullStrategy:
    """One backend graph for the whole step."""

    name = "full"
    relaxes_num_reqs = BUILTIN_RELAXES["full"]
    whole_graph = True  # a piecewise-compiled model runs whole for it (its pieces with the splits inline, or the model itself)
    unsupported_classes: frozenset[str] = frozenset()  # serves every key class (plans of built-in modes rely on it)

    def capture(self, body: Callable[[], Any], backend: Backend, pool: object) -> tuple[Graph, Any]:
        return backend.capture(body, pool)


@hookimpl
def cgregistry_register_strategies(register: StrategyRegistrar) -> None:
    register(FullStrategy())
