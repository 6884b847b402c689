"""The runtime context: what is running now, shared by the registry, the strategies, the piecewise
compiler and the cpu emulator.

Every name here is public to the package, so no module reaches into another's private
state.  Users read it through :func:`current_batch` and run a model eagerly as the
registry would with :func:`eager_batch`.  Imports nothing of the package but the descriptor.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import attrs

from cgregistry.descriptor import BatchDescriptor

__all__ = [
    "BreakContext", "BreakSite", "axis_rows", "background_capture", "barrier", "batch", "capture_strategy", "cpu_capturing", "current_batch", "eager_batch", "foreground_layout", "marked",
    "on_mark", "see_compiled", "site",
]


@attrs.frozen(slots=True)
class BreakContext:
    """The batch a step or an eager break is running for."""

    actual: BatchDescriptor  # the batch the engine asked for
    key: BatchDescriptor | None  # the padded key being captured or replayed (None when the step runs eagerly)
    payload: Any = None  # whatever the engine passed as run(..., context=...)


class BreakSite(Protocol):
    """What a breakable capture (or a trace) does when execution reaches an eager break."""

    def on_break(self, fn: Callable[..., Any] | None, stub: Callable[..., Any] | None, name: str, args: tuple, kwargs: dict) -> Any: ...


# The batch being served, captured or run eagerly (None outside a registry).
batch: contextvars.ContextVar[BreakContext | None] = contextvars.ContextVar("cgregistry_batch", default=None)
# The breakable capture (or tracing site) eager breaks report to; None: breaks run as plain calls.
site: contextvars.ContextVar[BreakSite | None] = contextvars.ContextVar("cgregistry_break_site", default=None)
# What runs before each eager break while capturing (capture_barrier).
barrier: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("cgregistry_barrier", default=None)
# The cpu emulator is recording a capture on this thread.
cpu_capturing: contextvars.ContextVar[bool] = contextvars.ContextVar("cgregistry_cpu_capturing", default=False)
# The strategy warming up or capturing an entry now (None outside a capture): a compiled model runs
# whole, without its splits, for one whose ``whole_graph`` is true.
capture_strategy: contextvars.ContextVar[Any] = contextvars.ContextVar("cgregistry_capture_strategy", default=None)
# Row counts of the batch axes (tokens, requests, requests + 1) in the step being warmed up or captured,
# as its static input views have them: what the piecewise compiler makes symbolic.
axis_rows: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("cgregistry_axis_rows", default=frozenset())
# The entry being captured is captured beside a serving thread (the cuda backend then captures in
# thread-local mode, so that thread's CUDA calls stay legal).
background_capture: contextvars.ContextVar[bool] = contextvars.ContextVar("cgregistry_background_capture", default=False)
# The entry is a foreground estimate's scratch capture: as safe as a background one, but warmed up on the
# capture's own stream, as a foreground capture is (the caching allocator keeps a cache per stream, so the
# background's warm-up stream would make the memory measured differ from what the capture then takes).
foreground_layout: contextvars.ContextVar[bool] = contextvars.ContextVar("cgregistry_foreground_layout", default=False)
# The cpu emulator records compiled code's ops (a piecewise capture) instead of running models uncompiled.
see_compiled: contextvars.ContextVar[bool] = contextvars.ContextVar("cgregistry_cpu_see_compiled", default=False)

# Every marked function still alive (weakly: marking must not keep a model alive), and
# callbacks told of each new one (the piecewise compiler keeps them opaque to dynamo).
marked: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
on_mark: list[Callable[[Callable[..., Any]], None]] = []


def current_batch() -> BreakContext | None:
    """The live batch (actual, key, payload) while a step or an eager break runs under a registry."""
    return batch.get()


@contextlib.contextmanager
def eager_batch(actual: BatchDescriptor, payload: Any = None) -> Iterator[BreakContext]:
    """Run a model eagerly inside this block exactly as ``run()`` does on a miss.

    ``current_batch()`` gives ``(actual, None, payload)`` to eager breaks, and a model
    compiled with ``reg.compile`` runs as itself (no trace).  Use it for a reference
    forward outside the registry.
    """
    if not isinstance(actual, BatchDescriptor):
        raise TypeError(f"eager_batch() needs a BatchDescriptor, got {actual!r}")
    context = BreakContext(actual, None, payload)
    token = batch.set(context)
    try:
        yield context
    finally:
        batch.reset(token)
