"""The ``breakable`` strategy: graph segments separated by eager breaks, without tracing.

Capture runs the step once: at a function marked ``@eager_break`` (or ``graph_break()``) the segment's capture ends,
the break runs eagerly (its capture stub, if any) and a new segment starts in the same pool.  Replay runs the segments
in order, each break between them with its captured arguments, copying its fresh result into the tensors it returned
at capture.  All segments share the registry's pool and intermediates keep their addresses across segments, so
memory stays proportional to the largest entry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from cgregistry.strategies import breaks
from cgregistry.contracts import runtime
from cgregistry.contracts.protocols import Backend, Graph, SegmentedBackend
from cgregistry.errors import BreakError, OutputError
from cgregistry.builtins import BUILTIN_RELAXES
from cgregistry.contracts.markers import hookimpl
from cgregistry.store.io import flatten

if TYPE_CHECKING:
    from cgregistry.hooks.manager import StrategyRegistrar

__all__ = ["BreakableGraph", "BreakableStrategy", "BreakError", "CaptureSite"]


class _BreakCall:
    """One eager break as captured: the function, its exact arguments, and the tensors it returned."""

    __slots__ = ("fn", "name", "args", "kwargs", "kept")

    def __init__(self, fn: Callable[..., Any], name: str, args: tuple, kwargs: dict, result: Any) -> None:
        self.fn = fn
        self.name = name
        self.args = args
        self.kwargs = kwargs
        try:
            self.kept, _ = flatten(result, f"eager break {name!r} result")  # strong references, on purpose
        except OutputError as exc:
            what = str(exc).split(";", 1)[0]  # "eager break 'f' result is a int"
            raise BreakError(f"{what}; an eager break returns tensors (kept, refreshed at every replay) or None") from None

    def run(self) -> None:
        result = self.fn(*self.args, **self.kwargs)
        kept = self.kept
        if not kept:
            return
        fresh, _ = flatten(result, f"eager break {self.name!r} result")
        if len(fresh) != len(kept):
            raise BreakError(f"eager break {self.name!r} returned {len(fresh)} tensors at replay, {len(kept)} at capture")
        for i, (old, new) in enumerate(zip(kept, fresh)):
            if new.shape != old.shape or new.dtype != old.dtype:
                raise BreakError(
                    f"eager break {self.name!r} returned a tensor of shape {tuple(new.shape)} ({new.dtype}) at replay "
                    f"for result {i}; it returned {tuple(old.shape)} ({old.dtype}) at capture, and code after the "
                    "break reads that buffer"
                )
            old.copy_(new)


class CaptureSite:
    """The capture in progress: ends and starts segments when execution reaches a break."""

    def __init__(self, backend: SegmentedBackend, pool: object, barrier: Callable[[], None] | None) -> None:
        self.backend = backend
        self.pool = pool
        self.barrier = barrier
        self.segments: list[Graph] = []
        self.calls: list[_BreakCall | None] = []
        self.current = backend.begin_capture(pool)
        self.open = True  # a segment is being captured
        self.compiled_runs = 0  # split graphs of the piecewise compiler that ran under this capture

    def _end_segment(self, where: str) -> None:
        self.open = False
        try:
            self.segments.append(self.current.end())
        except Exception as exc:
            if "join" in str(exc).lower():
                raise BreakError(f"{where}: {exc}") from exc
            raise

    def on_break(self, fn: Callable[..., Any] | None, stub: Callable[..., Any] | None, name: str, args: tuple, kwargs: dict) -> Any:
        fake_mode = breaks.fake_mode_of(args, kwargs)
        if fake_mode is not None:  # dynamo (re)tracing a piecewise model inside this capture: not a break
            return breaks.run_for_trace(fn, fake_mode, args, kwargs)
        self._end_segment(f"before eager break {name!r}")
        barrier = self.barrier if self.barrier is not None else runtime.barrier.get()
        if barrier is not None:
            barrier()
        runner = stub if stub is not None else fn
        token = runtime.site.set(None)  # a break's own body runs as plain eager code
        try:
            result = runner(*args, **kwargs) if runner is not None else None
        finally:
            runtime.site.reset(token)
        self.calls.append(_BreakCall(fn, name, args, kwargs, result) if fn is not None else None)
        self.current = self.backend.begin_capture(self.pool)
        self.open = True
        return result

    def finish(self) -> None:
        self._end_segment("at the end of capture")

    def release_intermediates(self) -> None:
        """Hold the breaks' arguments that live in the pool without owning them: the graphs own that memory, and owning
        it here too would make memory grow with the sum of the entries, not the largest.  The rest stays owned."""
        calls = [c for c in self.calls if c is not None]
        if not calls:
            return
        tensors = [t for c in calls for t in tree_flatten((c.args, c.kwargs))[0] if isinstance(t, torch.Tensor)]
        held = {id(t): h for t, h in zip(tensors, self.backend.hold_intermediates(tensors, self.pool))}
        for call in calls:
            call.args, call.kwargs = tree_map_only(torch.Tensor, lambda t: held[id(t)], (call.args, call.kwargs))

    def abort(self) -> None:
        if self.open:
            self.open = False
            self.current.abort()


class BreakableGraph:
    """Segments and breaks, replayed in order."""

    __slots__ = ("segments", "calls", "memory_bytes", "breaks", "_order")

    def __init__(self, segments: list[Graph], calls: list[_BreakCall | None]) -> None:
        self.segments = segments
        self.calls = calls
        kept = sum(t.untyped_storage().nbytes() for c in calls if c is not None for t in c.kept)
        self.memory_bytes = sum(int(s.memory_bytes) for s in segments) + kept
        self.breaks = sum(1 for c in calls if c is not None)
        order: list[Callable[[], None]] = []
        for segment, call in zip(segments, [*calls, None]):
            order.append(segment.replay)
            if call is not None:  # a break that returns nothing is just a call with its captured arguments
                order.append(call.run if call.kept else functools.partial(call.fn, *call.args, **call.kwargs))
        self._order = tuple(order)

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    def replay(self) -> None:
        # Breaks run as they ran at capture: under inference mode (their kept results are inference tensors).
        if torch.is_inference_mode_enabled():  # engines usually run there already: skip the context
            for step in self._order:
                step()
            return
        with torch.inference_mode():
            for step in self._order:
                step()


class BreakableStrategy:
    """Graph segments between eager breaks; keys relax ``num_reqs`` (metadata is built eagerly).  ``barrier`` (or
    ``cgregistry.capture_barrier(fn)`` around ``capture``) runs before each eager break during capture, keeping
    distributed ranks in step between segment finalisation and rank-coupled work."""

    name = "breakable"
    relaxes_num_reqs = BUILTIN_RELAXES["breakable"]
    unsupported_classes: frozenset[str] = frozenset()  # serves every key class (plans of built-in modes rely on it)

    def __init__(self, barrier: Callable[[], None] | None = None) -> None:
        self.barrier = barrier

    def capture(self, body: Callable[[], Any], backend: Backend, pool: object) -> tuple[BreakableGraph, Any]:
        if not isinstance(backend, SegmentedBackend):
            raise TypeError(
                f"backend {backend.name!r} cannot end and resume captures: strategy {self.name!r} needs a "
                "cgregistry.contracts.protocols.SegmentedBackend (capture_context, begin_capture, hold_intermediates)"
            )
        if runtime.site.get() is not None:
            raise BreakError("nested breakable capture: a breakable capture is already in progress on this thread")
        with backend.capture_context():
            site = CaptureSite(backend, pool, self.barrier)
            token = runtime.site.set(site)
            try:
                out = body()
                site.finish()
                self.check_capture(site)
                site.release_intermediates()
            except BaseException:
                site.abort()
                raise
            finally:
                runtime.site.reset(token)
        graph = BreakableGraph(site.segments, site.calls)
        return graph, out

    def check_capture(self, site: CaptureSite) -> None:
        """After the step ran under capture: a subclass's chance to refuse what it saw."""


@hookimpl
def cgregistry_register_strategies(register: StrategyRegistrar) -> None:
    register(BreakableStrategy())
