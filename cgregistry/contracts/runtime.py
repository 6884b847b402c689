"""The runtime context: what is running now, shared by the registry, the strategies, the piecewise compiler and the cpu
emulator; every name here is public to the package, so no module reaches into another's private state.

Users read it through :func:`current_batch`, and run a model eagerly as the registry would with :func:`eager_batch`.
Imports nothing of the package but the descriptor.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import attrs

from cgregistry.key.descriptor import BatchDescriptor

__all__ = [
    "BreakContext", "BreakSite", "FrozenReadWarning", "Recording", "RecordingBatch", "axis_rows", "barrier", "between_steps", "batch", "begin_phase", "capture_strategy", "cpu_capturing", "current_batch", "eager_batch", "end_phase", "marked",
    "on_mark", "phase_clock", "recording", "see_compiled", "site", "timed_phase", "unrecorded",
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
# whole, its splits inline instead of breaking, for one whose ``whole_graph`` is true.
capture_strategy: contextvars.ContextVar[Any] = contextvars.ContextVar("cgregistry_capture_strategy", default=None)
# Row counts of the batch axes (tokens, requests, requests + 1) in the step being warmed up or captured,
# as its static input views have them: what the piecewise compiler makes symbolic.
axis_rows: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("cgregistry_axis_rows", default=frozenset())
# The capture on this thread runs between the engine's steps (a piece inside run() or capture_pending(), a lazy key):
# the cuda backend then waits for the capture's own streams only, not for the steps the engine has queued.
between_steps: contextvars.ContextVar[bool] = contextvars.ContextVar("cgregistry_between_steps", default=False)


@attrs.define(slots=True)
class Recording:
    """A strategy recording the step into a graph on this thread (warm-up excluded): what host code outside an eager
    break reads now is frozen into the graph.  Counts the reads of the batch's ``actual`` and ``payload`` there."""

    live_batch_reads: int = 0


# The phase clock of the capture in progress on this thread (None outside one): seconds it spent compiling and ending
# its graphs (the driver instantiates them then), added by the code that does it (``timed_phase``, or inline on the
# hot path of a capture, which must not walk into more modules).
phase_clock: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("cgregistry_phase_clock", default=None)


def begin_phase(name: str) -> None:
    """Start timing phase ``name`` of the capture in progress on this thread, if any; a span begun inside another of
    the same phase (a compile inside dynamo's) counts once, in the outer one."""
    clock = phase_clock.get()
    if clock is not None and not clock.get(f"{name} depth", 0):
        clock[f"{name} depth"], clock[f"{name} since"] = 1, time.perf_counter()


def end_phase(name: str) -> None:
    """Add the span ``begin_phase(name)`` began to the capture in progress on this thread (none begun: nothing)."""
    clock = phase_clock.get()
    if clock is not None and clock.get(f"{name} depth", 0):
        clock[name] = clock.get(name, 0.0) + time.perf_counter() - clock[f"{name} since"]
        clock[f"{name} depth"] = 0


def ran_compiled() -> None:
    """The capture in progress on this thread runs dynamo-compiled code: its key warms up at every capture (a guard
    that fails after a weight update compiles again, which must happen in a warm-up, not inside a capture)."""
    clock = phase_clock.get()
    if clock is not None:
        clock["compiled runs"] = clock.get("compiled runs", 0.0) + 1


@contextlib.contextmanager
def timed_phase(name: str) -> Iterator[None]:
    """Add the time of this block to phase ``name`` of the capture in progress on this thread (``begin_phase``)."""
    clock = phase_clock.get()
    if clock is None or clock.get(f"{name} depth", 0):  # none, or inside a span of the phase: the outer one counts
        yield
        return
    begin_phase(name)
    try:
        yield
    finally:
        end_phase(name)


# The recording in progress on this thread; None outside one, and inside an eager break's body.
recording: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("cgregistry_recording", default=None)
# The cpu emulator records compiled code's ops (a piecewise capture) instead of running models uncompiled.
see_compiled: contextvars.ContextVar[bool] = contextvars.ContextVar("cgregistry_cpu_see_compiled", default=False)

# Every marked function still alive (weakly: marking must not keep a model alive), and
# callbacks told of each new one (the piecewise compiler keeps them opaque to dynamo).
marked: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
on_mark: list[Callable[[Callable[..., Any]], None]] = []
# The torch custom ops marked as eager breaks, by name ("namespace::name"), to their label and capture stub: a trace
# records the op itself, and the piecewise compiler splits at every call of it.
marked_ops: dict[str, tuple[str, Callable[..., Any] | None]] = {}


def unrecorded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` as host code that runs eagerly at every replay (an eager break, a piecewise split): the
    recording in progress, if any, is set aside, so what it reads of the live batch is not reported as frozen."""
    if recording.get() is None:
        return fn(*args, **kwargs)
    token = recording.set(None)
    try:
        return fn(*args, **kwargs)
    finally:
        recording.reset(token)


class FrozenReadWarning(RuntimeWarning):
    """Host code read the live batch's payload while a graph was being recorded, outside an eager break: what it read
    is baked into the graph, and every replay reuses it."""


class RecordingBatch(BreakContext):
    """``current_batch()`` while a graph is being recorded outside an eager break: a ``BreakContext`` whose ``actual``
    and ``payload`` (what capture runs on and was given, never a live batch's) warn when read
    (:class:`FrozenReadWarning`), naming the line that read them; ``key`` reads freely."""

    __slots__ = ("_recording",)

    def __init__(self, context: BreakContext, recording: Recording) -> None:
        for field in ("actual", "key", "payload"):  # the slots themselves, under the warning properties
            getattr(BreakContext, field).__set__(self, getattr(context, field))
        object.__setattr__(self, "_recording", recording)

    @property  # type: ignore[override]
    def actual(self) -> BatchDescriptor:
        self._frozen("actual")
        return _ACTUAL.__get__(self)

    @property  # type: ignore[override]
    def payload(self) -> Any:
        self._frozen("payload")
        return _PAYLOAD.__get__(self)

    def _frozen(self, field: str) -> None:
        from cgregistry.messages import warn

        self._recording.live_batch_reads += 1
        strategy = getattr(capture_strategy.get(), "name", None)
        where = f" [{strategy}]" if isinstance(strategy, str) else ""
        warn(
            f"cgregistry: current_batch().{field} read while capturing {self.key}{where}, outside an eager break: what it "
            "returns now is frozen into the graph and every replay reuses it (a live batch's lengths, say). Mark the "
            "function that reads it with @cgregistry.eager_break, so that the breakable strategy runs it eagerly at "
            "each replay, or read only .key and static inputs there",
            FrozenReadWarning,
        )

    def __repr__(self) -> str:
        return f"RecordingBatch(actual={_ACTUAL.__get__(self)!r}, key={self.key!r})"


_ACTUAL, _PAYLOAD = BreakContext.__dict__["actual"], BreakContext.__dict__["payload"]  # the slots of the fields


def current_batch() -> BreakContext | RecordingBatch | None:
    """The live batch (actual, key, payload) while a step or an eager break runs under a registry.

    While a graph is being recorded outside an eager break, its ``payload`` warns when read (see ``RecordingBatch``)."""
    context = batch.get()
    if context is not None:
        live = recording.get()
        if live is not None:
            return RecordingBatch(context, live)
    return context


@contextlib.contextmanager
def eager_batch(actual: BatchDescriptor, payload: Any = None) -> Iterator[BreakContext]:
    """Run a model eagerly inside this block exactly as ``run()`` does on a miss (a reference forward outside the
    registry): ``current_batch()`` gives ``(actual, None, payload)`` to eager breaks, and a model compiled with
    ``reg.compile`` runs as itself (no trace)."""
    if not isinstance(actual, BatchDescriptor):
        raise TypeError(f"eager_batch() needs a BatchDescriptor, got {actual!r}")
    context = BreakContext(actual, None, payload)
    token = batch.set(context)
    try:
        yield context
    finally:
        batch.reset(token)
