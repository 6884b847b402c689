"""The plugin contract, typed: what a graph, a backend and a strategy provide, and what plugins see of a registry.

Plugin authors implement these protocols; the plugin manager checks registered objects against them (the lists of
required members are derived from the protocols, never copied).  ``SegmentedBackend`` is what the ``breakable`` and
``piecewise`` strategies need on top of ``Backend``: ending a capture at an eager break and resuming it in the same
pool.  Imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import typing
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Backend", "Graph", "RegistryView", "Segment", "SegmentedBackend", "Strategy", "StrategyLookup", "protocol_members"]


@runtime_checkable
class Graph(Protocol):
    """A captured, replayable unit of work."""

    memory_bytes: int  # measured growth of the pool (or held tensors) caused by this capture; an int >= 0

    def replay(self) -> None: ...


@runtime_checkable
class Segment(Protocol):
    """One capture in progress (a segment of a breakable entry)."""

    def end(self) -> Graph:
        """Finish the capture; the graph it recorded."""

    def abort(self) -> None:
        """Abandon the capture after an error (never raises the capture's own error again)."""


@runtime_checkable
class Backend(Protocol):
    """What every strategy needs from a graph primitive."""

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

    # Optional, read with getattr (not part of the protocol's members):
    # - ``collects_before_capture``, whether a plan's capture runs a full collection first, to free device memory that
    #   garbage holds (default True; the cpu emulator says False);
    # - ``keep_pool(pool)``, what keeps ``pool`` taking captures once its graphs died, made on the calling thread (the
    #   cuda backend: a one-kernel graph in it), so that keys captured again reuse the dropped graphs' memory; where it
    #   raises, the pool is used as one nothing keeps (warned once);
    # - ``streams_of(owner)``, a context manager under which a capture runs on the streams kept for ``owner`` (a
    #   registry's pool), whichever registry captures.


@runtime_checkable
class SegmentedBackend(Backend, Protocol):
    """A backend that can end a capture at an eager break and resume it (``breakable``, ``piecewise``)."""

    def capture_context(self) -> contextlib.AbstractContextManager[None]:
        """Where the segments of one entry and the eager work between them run (a side stream on CUDA)."""

    def begin_capture(self, pool: object) -> Segment:
        """Start capturing into ``pool``; ``end()`` on the result gives the graph."""

    def hold_intermediates(self, tensors: list[torch.Tensor], pool: object) -> list[torch.Tensor]:
        """The tensors eager breaks keep between replays, held without owning what lives in ``pool``."""


@runtime_checkable
class Strategy(Protocol):
    """A plugin-provided way to turn a step into a replayable graph."""

    name: str
    relaxes_num_reqs: bool  # True when attention metadata is built eagerly, so keys need no request count
    # Optional ``whole_graph = True``: the step is captured as one graph with nothing eager inside, so a
    # piecewise-compiled model runs whole for it, splits inline (read with getattr; not part of the protocol's members).
    # Optional ``unsupported_classes = frozenset({...})``: key classes ("mixed", "spec_decode", "decode")
    # it cannot serve; plans downgrade them and the registry refuses such keys (read with getattr too).

    def capture(self, body: Callable[[], Any], backend: Backend, pool: object) -> tuple[Graph, Any]:
        """Capture ``body`` (the step on static views) into ``pool``; return the graph and its outputs."""


@runtime_checkable
class StrategyLookup(Protocol):
    """Where plans look up strategies that are not built in (a ``Plugins``)."""

    def strategy(self, name: str) -> Any:
        """The registered strategy called ``name`` (KeyError naming the registered ones if none)."""


@runtime_checkable
class RegistryView(Protocol):
    """What hooks and policy plugins are given of a registry (a ``GraphRegistry`` is one): its name and its inspection
    calls.  Hooks should read it, not drive it (a hook that captures, runs or clears from inside a capture or a step is
    refused)."""

    name: str

    def match(self, actual: Any, *, group: Any = None, exclude: Any = None) -> Any: ...

    def explain(self, actual: Any, *, exclude: Any = None) -> Any: ...

    def entries(self, **filters: Any) -> list[Any]: ...

    def pending(self) -> list[Any]: ...

    def capturing(self) -> list[Any]: ...

    def failures(self) -> dict[Any, BaseException]: ...

    def stats(self) -> Any: ...

    def snapshot(self) -> dict[str, Any]: ...

    def memory_bytes(self) -> int: ...


def protocol_members(protocol: type) -> tuple[str, ...]:
    """The attributes and methods a protocol requires, in declaration order, its bases' first."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls in (object, typing.Protocol, typing.Generic) or not getattr(cls, "_is_protocol", False):
            continue
        names += [n for n in (*cls.__dict__.get("__annotations__", {}), *cls.__dict__) if not n.startswith("_")]
    return tuple(dict.fromkeys(names))
