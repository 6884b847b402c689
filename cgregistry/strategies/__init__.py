"""Capture strategies: how one registry entry is captured and replayed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from cgregistry.backends import Backend, Graph

__all__ = ["Strategy"]


class Strategy(Protocol):
    """A plugin-provided way to turn a step into a replayable graph."""

    name: str
    relaxes_num_reqs: bool  # True when attention metadata is built eagerly, so keys need no request count

    def capture(self, body: Callable[[], Any], backend: Backend, pool: object) -> tuple[Graph, Any]:
        """Capture ``body`` (the step on static views) into ``pool``; return the graph and its outputs."""
