"""Graph backends: the primitive a strategy drives (``cuda``, ``cpu``; others are plugins).

A backend runs a callable eagerly for warm-up, captures it into a replayable
graph inside a shared pool, and says how captured outputs are held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Backend", "Graph"]


@runtime_checkable
class Graph(Protocol):
    """A captured, replayable unit of work."""

    memory_bytes: int  # measured growth of the pool (or held tensors) caused by this capture

    def replay(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """What a strategy needs from a graph primitive."""

    name: str

    def is_available(self) -> bool: ...

    def device(self) -> torch.device: ...

    def new_pool(self) -> object: ...

    def warmup(self, fn: Callable[[], Any], runs: int) -> Any:
        """Run ``fn`` eagerly ``runs`` times as capture would see it; return the last output."""

    def capture(self, fn: Callable[[], Any], pool: object) -> tuple[Graph, Any]:
        """Capture one call of ``fn`` into ``pool``; return the graph and ``fn``'s output."""

    def share_outputs(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Hold captured outputs so that graphs sharing the pool may reuse their memory."""

    def recover_pool(self, pool: object) -> object:
        """After a failed capture: the pool the next capture should use (``pool`` unless it is unusable)."""

    def synchronize(self) -> None: ...
