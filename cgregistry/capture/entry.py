"""Capture of one entry: static buffers reset to their fills, views sized for the key, warm-up, the
strategy's capture into the shared pool, output checks.

Capture runs the engine's step (warm-up always; eager breaks and the cpu emulator
run it for real), and a step writes engine state such as a KV cache at the slots
it reads.  So every capture, whenever it happens, runs on buffers reset to their
fills (a scratch slot for index inputs), never on the rows of a batch already
served.  Knows nothing of the registry; a failure is a ``CaptureError`` and
changes nothing but the pool handle (``recover_pool``).
"""

from __future__ import annotations

import contextlib
import gc
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from cgregistry.state import runtime
from cgregistry.capture.pool import GraphPool
from cgregistry.contracts.protocols import Backend
from cgregistry.store.buffers import StaticBuffer, describe_rows, rows_for
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.store.entries import Entry
from cgregistry.errors import CaptureError, OutputError, PluginError
from cgregistry.store.outputs import OutputAxes, OutputSlicer, flatten
from cgregistry.state.runtime import BreakContext

__all__ = ["CaptureError", "EntryCapture", "frozen_gc", "paused_gc"]


class EntryCapture:
    """Captures entries of one step into one pool (shared by every entry of a registry, and by the registries given
    the same ``GraphPool``)."""

    def __init__(
        self, step: Callable[..., Any], buffers: Mapping[str, StaticBuffer], backend: Backend, output_axes: OutputAxes, warmup_runs: int,
        pool: GraphPool,
    ) -> None:
        self.step = step  # the engine's step: what every capture runs
        self.buffers = buffers
        self.backend = backend
        self.device = backend.device()
        self._output_axes = output_axes
        self._warmup_runs = warmup_runs
        self.graph_pool = pool
        slots = [b.capacity - (b.spec.axis == "reqs+1") for b in buffers.values() if b.spec.axis != "tokens"]
        self._request_slots = min(slots) if slots else None  # request rows a relaxed key's step sees

    def check_fits(self, key: BatchDescriptor) -> None:
        """Refuse a key larger than a static input, before anything is captured."""
        for buf in self.buffers.values():
            rows = self._key_rows(buf, key)
            if rows > buf.capacity:
                raise ValueError(
                    f"key {key} needs {describe_rows(buf.spec.axis, rows)} in static input {buf.name!r}, "
                    f"which holds {buf.capacity}; enlarge its StaticInput shape"
                )

    @staticmethod
    def _key_rows(buf: StaticBuffer, key: BatchDescriptor) -> int:
        rows = rows_for(buf.spec.axis, key)
        return buf.capacity if rows is None else rows  # relaxed keys see every request slot

    def capture(
        self, key: BatchDescriptor, strategy_name: str, strategy: Any, payload: Any, *, background: bool = False, scratch: bool = False,
        scratch_pool: Any = None, scratch_inputs: Mapping[str, StaticBuffer] | None = None,
    ) -> Entry:
        """Warm up and capture ``step(key, **views)`` with ``strategy``; ``payload`` is what eager breaks see.

        ``background``: captured beside a serving thread.  The entry gets static inputs of its own
        (sized for the key, at their fills), since the shared ones hold the live batch being served;
        and a strategy that runs eager code during capture (breaks) gets a pool of its own, since
        that code really executes and could write memory a graph being replayed now is using.
        ``scratch``: captured to be measured and dropped (a memory estimate), never into the shared pool nor on the
        shared static inputs: into ``scratch_pool`` (a pool of its own if None), on ``scratch_inputs`` (buffers as
        large as the registry's, reset to their fills, as a foreground capture uses the shared ones) or, if None, on
        inputs of its own sized for the key (as in the background).  It is as safe beside a serving thread as a
        background capture, and warmed up on the streams ``background`` says, so that it takes what that capture would.
        """
        if background or scratch:  # on streams of the capturing thread's own where the backend has them (cuda)
            with getattr(self.backend, "background_context", contextlib.nullcontext)():
                return self._capture(key, strategy_name, strategy, payload, background, scratch, scratch_pool, scratch_inputs)
        return self._capture(key, strategy_name, strategy, payload, False, False)

    def _capture(self, key: BatchDescriptor, strategy_name: str, strategy: Any, payload: Any, background: bool, scratch: bool,
                 scratch_pool: Any = None, scratch_inputs: Mapping[str, StaticBuffer] | None = None) -> Entry:
        device_memory = getattr(self.backend, "device_memory", None)  # (used, reserved) bytes, where the backend measures them
        used_before = device_memory()[0] if device_memory is not None else 0
        buffers = self.buffers
        pool = self.graph_pool.for_capture()
        own_inputs = background or (scratch and scratch_inputs is None)
        if scratch:
            pool = scratch_pool if scratch_pool is not None else self.backend.new_pool()
        elif background and not getattr(strategy, "whole_graph", False):
            pool = self.backend.new_pool()
        if own_inputs:
            buffers = {name: buf.sized(self._key_rows(buf, key)) for name, buf in buffers.items()}
        else:
            if scratch_inputs is not None:
                buffers = scratch_inputs
            for buf in buffers.values():
                buf.reset()  # never an earlier batch's rows: the step may write engine state at them
        views = {name: buf.view(self._key_rows(buf, key)) for name, buf in buffers.items()}
        step = self.step

        def body() -> Any:
            return step(key, **views)

        started = time.perf_counter()
        token = runtime.batch.set(BreakContext(key, key, payload))
        rows_token = runtime.axis_rows.set(frozenset(v.shape[0] for v in views.values()) | {key.num_tokens})
        strategy_token = runtime.capture_strategy.set(strategy)
        background_token = runtime.background_capture.set(background or scratch)
        layout_token = runtime.foreground_layout.set(scratch and not background)
        try:
            with torch.inference_mode():
                warm_leaves, spec = flatten(self.backend.warmup(body, self._warmup_runs))
                self._check_outputs(warm_leaves, spec, key)
                del warm_leaves
                recording = runtime.Recording()
                recording_token = runtime.recording.set(recording)
                try:
                    graph, out = strategy.capture(body, self.backend, pool)
                finally:
                    runtime.recording.reset(recording_token)
                leaves, captured_spec = flatten(out)
                del out
                if captured_spec != spec:
                    raise OutputError("the step returned a different output structure at capture than at warm-up")
                self._check_outputs(leaves, spec, key)
                _check_memory_bytes(graph, strategy_name)
            self.backend.synchronize()
        except BaseException as exc:  # a KeyboardInterrupt too leaves the pool to recover
            if pool is self.graph_pool.handle:
                self.graph_pool.recover()
            if not isinstance(exc, Exception):
                raise
            raise CaptureError(key, strategy_name, exc) from exc
        finally:
            runtime.background_capture.reset(background_token)
            runtime.foreground_layout.reset(layout_token)
            runtime.capture_strategy.reset(strategy_token)
            runtime.axis_rows.reset(rows_token)
            runtime.batch.reset(token)
        seconds = time.perf_counter() - started
        entry = Entry(key, strategy_name, graph, OutputSlicer(self.backend.share_outputs(leaves), spec), seconds)
        if device_memory is not None:  # what the device gave this capture: pool, warm-up, driver objects, own inputs
            entry.device_bytes = max(0, device_memory()[0] - used_before)
        entry.read_live_batch = recording.live_batch_reads > 0
        if own_inputs:
            entry.buffers = tuple(buffers.values())  # in the registry's input order, as routes copy them
        if pool is self.graph_pool.handle:
            self.graph_pool.add(entry)
        return entry

    def _check_outputs(self, leaves: list[torch.Tensor], spec: Any, key: BatchDescriptor) -> None:
        if not leaves:
            raise OutputError("the step returned no tensor")
        self._output_axes.check(leaves, spec, key, self._request_slots)
        for i, leaf in enumerate(leaves):
            if leaf.device != self.device:
                raise OutputError(f"output leaf {i} is on {leaf.device}, expected {self.device}")


def _check_memory_bytes(graph: Any, strategy: str) -> None:
    """A strategy's measured memory feeds the budget: it must be a byte count."""
    memory = getattr(graph, "memory_bytes", None)
    if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory < 0:
        raise PluginError(f"strategy {strategy!r} reported memory_bytes={memory!r} for its graph; expected a byte count >= 0")


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """No garbage collection (and no tensor finaliser) while graphs are being captured."""
    freeze = gc.get_freeze_count() == 0  # leave a caller's own frozen heap alone
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        with paused_gc():
            yield
    finally:
        if freeze:
            gc.unfreeze()


_gc_lock = threading.Lock()
_gc_pauses = [0, False]  # pauses in force (any thread), and whether the collector was on before the first


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No garbage collection while one entry is captured, on any thread: the collector comes back on when the
    last pause ends (a capture thread's pause ending must not turn it on under a foreground capture).

    ``frozen_gc`` collects first, which would hold the GIL (and stall a serving thread) for as
    long as a full collection takes; this only pauses the collector.
    """
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()
