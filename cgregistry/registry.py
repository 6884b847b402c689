"""GraphRegistry: owns static buffers, the pool, entries, the matcher and the counters.

Hot path (``run``): one dict lookup of the actual descriptor gives a *route*
(entry, rows to copy per input, sliced outputs) built the first time that
shape was seen; then one copy per input, the replay, two counter bumps.
A batch no key covers runs ``step`` eagerly on the live inputs and is counted.
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import itertools
import numbers
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import torch

from cgregistry import runtime
from cgregistry.buffers import InputError, StaticBuffer, StaticInput
from cgregistry.debug import AddressWatch, checked, plain
from cgregistry.descriptor import BatchDescriptor
from cgregistry.distributed import agree
from cgregistry.errors import CgregistryError
from cgregistry.inspection import (
    ClassStats,
    EntryInfo,
    Snapshot,
    Stats,
    entries_table,
    filter_entries,
    key_class,
    stats_line,
)
from cgregistry.matcher import DEFAULT_PREFERENCE, Explanation, Match, Matcher
from cgregistry.outputs import OutputError, OutputSlicer, flatten
from cgregistry.piecewise import (
    DEFAULT_MAX_TRACES,
    PiecewiseCompiler,
    PiecewiseModel,
    compile_piecewise,
)
from cgregistry.plan import CapturePlan, PlanEntry
from cgregistry.plugins import PluginError, Plugins, notify
from cgregistry.runtime import BreakContext

_CG_INTERNAL = True

__all__ = ["CaptureError", "ConcurrentRunError", "EntryInfo", "GraphRegistry", "Stats"]  # records re-exported from inspection

# Distinct actual shapes remembered by the route cache before it starts over.
_ROUTE_CACHE_LIMIT = 1 << 16
_names = itertools.count(1)  # default registry names: registry-1, registry-2, ...
_NO_MATCH = object()  # a group agreed on a descriptor no key covers: every rank runs eagerly
_RESERVED_INPUT_NAMES = ("context", "group")  # keyword arguments of run() itself


class ConcurrentRunError(CgregistryError, RuntimeError):
    """``run()`` was called while another ``run()`` on the same registry was in progress."""


class CaptureError(CgregistryError, RuntimeError):
    """Capturing one entry failed; the registry is as it was before that entry."""

    def __init__(self, descriptor: BatchDescriptor, strategy: str, cause: BaseException) -> None:
        super().__init__(f"capturing {descriptor} with strategy {strategy!r} failed: {type(cause).__name__}: {cause}")
        self.descriptor = descriptor
        self.strategy = strategy


class _Entry:
    __slots__ = (
        "key", "strategy", "graph", "replay", "slicer", "capture_seconds", "memory_bytes",
        "replays", "padded_tokens", "graph_tokens", "last_step", "key_class", "has_breaks",
    )

    def __init__(self, key: BatchDescriptor, strategy: str, graph: Any, slicer: OutputSlicer, seconds: float) -> None:
        self.key = key
        self.strategy = strategy
        self.graph = graph
        self.replay = graph.replay
        self.slicer = slicer
        self.capture_seconds = seconds
        self.memory_bytes = int(graph.memory_bytes)
        self.replays = 0
        self.padded_tokens = 0
        self.graph_tokens = 0
        self.last_step = 0
        self.key_class = key_class(key, strategy)
        self.has_breaks = bool(getattr(graph, "breaks", 0))  # eager breaks read current_batch() at replay


class _Route:
    """Everything ``run`` needs for one actual shape, computed once."""

    __slots__ = ("entry", "pending", "match", "copies", "out_rows", "single_output", "real_tokens", "pad_tokens", "batch_context")

    def __init__(self, actual: BatchDescriptor, entry: _Entry | None, match: Match | None, copies: tuple[tuple[StaticBuffer, int], ...], out_rows: int, pending: bool = False) -> None:
        self.entry = entry
        self.pending = pending  # the best key is in a lazy plan and not captured yet
        self.match = match
        self.copies = copies
        self.out_rows = out_rows
        self.real_tokens = actual.num_tokens
        # from the key, not match.padding: a group's agreed match pads relative to the agreed descriptor
        self.pad_tokens = match.key.num_tokens - actual.num_tokens if match is not None else 0
        self.single_output = entry.slicer.sliced(out_rows) if entry is not None and entry.slicer.spec is None else None
        # what eager breaks see through current_batch() when run() gets no payload (built once, not per step)
        self.batch_context = BreakContext(actual, entry.key, None) if entry is not None else None


def _rows(axis: str, descriptor: BatchDescriptor) -> int | None:
    if axis == "tokens":
        return descriptor.num_tokens
    return descriptor.num_reqs


class GraphRegistry:
    """Captured graphs for one step function, keyed by BatchDescriptor.

    ``step(batch, **inputs)`` is the engine's forward: it gets the padded key and
    views of the static buffers sized for it, and returns a tensor or a pytree of
    tensors whose leading dimension is the padded token (or request) count.

    Outputs returned by ``run`` are views of graph memory: valid until the next
    ``run`` on this registry, and only while the registry lives (on CUDA they do
    not own the pool).  Not thread-safe: call ``run`` from one thread.
    """

    def __init__(
        self,
        step: Callable[..., Any],
        inputs: Mapping[str, StaticInput],
        *,
        backend: str = "auto",
        output_axis: str = "tokens",
        preference: Sequence[str] = DEFAULT_PREFERENCE,
        warmup_runs: int = 1,
        plugins: Plugins | None = None,
        name: str | None = None,
        memory_budget: int | None = None,
        debug: bool = False,
    ) -> None:
        if not callable(step):
            raise TypeError(f"step must be callable, got {step!r}")
        if output_axis not in ("tokens", "reqs"):
            raise ValueError(f"output_axis must be 'tokens' or 'reqs', got {output_axis!r}")
        if type(warmup_runs) is not int or warmup_runs < 1:
            raise ValueError(f"warmup_runs must be an int >= 1, got {warmup_runs!r}")
        if memory_budget is not None and (type(memory_budget) is not int or memory_budget < 0):
            raise ValueError(f"memory_budget must be a byte count >= 0 or None, got {memory_budget!r}")
        for input_name, spec in inputs.items():
            if not isinstance(spec, StaticInput):
                raise TypeError(f"inputs[{input_name!r}] must be a cgregistry.StaticInput, got {spec!r}")
            if input_name in _RESERVED_INPUT_NAMES:
                raise ValueError(
                    f"static input name {input_name!r} is reserved for run(..., {input_name}=...); give the input another name"
                )
        self._step = step
        self.name = name if name is not None else f"registry-{next(_names)}"
        self.plugins = plugins if plugins is not None else Plugins()
        self.backend = self.plugins.backend(backend)
        self.device = self.backend.device()
        self.output_axis = output_axis
        self.preference = tuple(preference)
        self.warmup_runs = warmup_runs
        self._buffers = {key: StaticBuffer(key, spec, self.device) for key, spec in inputs.items()}
        self._input_names = frozenset(self._buffers)
        self._pool = self.backend.new_pool()
        self._entries: dict[tuple[BatchDescriptor, str], _Entry] = {}
        self._matcher = Matcher((), self.preference)
        self._routes: dict[BatchDescriptor, _Route] = {}
        self._group_routes: dict[tuple[BatchDescriptor, BatchDescriptor], _Route] = {}
        self._clock = 0
        self._misses = 0
        self._eager_fallbacks = 0
        self._eager_tokens = 0
        self._failures: dict[tuple[BatchDescriptor, str], BaseException] = {}
        self.memory_budget = memory_budget
        self._pending: dict[tuple[BatchDescriptor, str], None] = {}  # lazy keys, captured on first need
        self._retired: dict[str, list[int]] = {}  # counters of removed entries, per key class
        self._misses_by_kind = {"uniform": 0, "mixed": 0}
        self._bad_batches = 0
        self._lazy_captures = 0
        self._evictions = 0
        self._capture_payload: Any = None
        self.debug = bool(debug)
        self._addresses = AddressWatch()
        self._addresses.watch((f"static input {name!r}", buf.tensor) for name, buf in self._buffers.items())
        owner = step if isinstance(step, torch.nn.Module) else getattr(step, "__self__", None)
        if self.debug and isinstance(owner, torch.nn.Module):
            self._addresses.watch(owner, prefix="step.")  # a model as the step: its weights are what graphs read
        self._run_clock = [0]  # run() count, for debug mode's stale-output check
        self._running = _thread.allocate_lock()
        hook = self.plugins.pm.hook
        self._hook = hook
        # Hooks with no implementation cost nothing: the hot path checks a None.
        self._miss_hook = hook.cgregistry_miss if hook.cgregistry_miss.get_hookimpls() else None
        self._choose_hook = hook.cgregistry_choose_match if hook.cgregistry_choose_match.get_hookimpls() else None
        notify(hook.cgregistry_registry_created, registry=self)

    # ------------------------------------------------------------------ piecewise

    def compile_backend(
        self, splitting_ops: Iterable[object] | None = None, *, inductor: bool = False,
        max_traces: int = DEFAULT_MAX_TRACES, include_marked: bool | None = None,
    ) -> PiecewiseCompiler:
        """A torch.compile backend for this registry's ``piecewise`` entries (see :mod:`cgregistry.piecewise`).

        Use it as ``torch.compile(model, backend=reg.compile_backend(), dynamic=True, fullgraph=True)``,
        or let :meth:`compile` do that and also keep views and Python floats from causing retraces.
        """
        return PiecewiseCompiler(splitting_ops, inductor=inductor, max_traces=max_traces, include_marked=include_marked)

    def compile(
        self, model: Callable[..., Any], splitting_ops: Iterable[object] | None = None, *, inductor: bool = False,
        max_traces: int = DEFAULT_MAX_TRACES, include_marked: bool | None = None, specialize_size_one: bool = False,
    ) -> PiecewiseModel:
        """``model`` compiled for ``piecewise`` entries: one dynamic trace, split at ``splitting_ops``
        (default: the ``@eager_break`` functions); call it from the step.  See
        :func:`cgregistry.compile_piecewise` for the options."""
        return compile_piecewise(
            model, splitting_ops, inductor=inductor, max_traces=max_traces, include_marked=include_marked,
            specialize_size_one=specialize_size_one,
        )

    # ------------------------------------------------------------------ capture

    def capture(
        self,
        plan: CapturePlan | Iterable[PlanEntry | tuple[BatchDescriptor, str]],
        *,
        progress: bool | None = None,
        lazy: bool = False,
        context: Any = None,
    ) -> list[EntryInfo]:
        """Capture every entry of ``plan`` not yet captured, in plan order (largest first).

        All entries are checked before any is captured.  If one fails, the
        entries captured before it stay, it is absent, and ``CaptureError``
        names its descriptor and strategy.  With ``lazy=True`` nothing is
        captured now: each key is captured by the first ``run`` it is the best
        match for (counted in ``stats().lazy_captures``).  ``context`` is the payload
        eager breaks see through ``current_batch()`` while capturing.
        """
        self._capture_payload = context
        todo = [self._plan_entry(e) for e in plan]
        for entry in todo:
            self.plugins.strategy(entry.strategy)
            self._check_fits(entry.descriptor)
        todo = [e for e in dict.fromkeys(todo) if (e.descriptor, e.strategy) not in self._entries]
        if lazy:
            for e in todo:
                self._pending[(e.descriptor, e.strategy)] = None
            self._rebuild()
            return []
        if progress is None:
            progress = len(todo) > 1 and _stderr_is_terminal()
        bar = _progress(todo, progress)
        captured: list[EntryInfo] = []
        try:
            with _frozen_gc():
                for entry in bar:
                    captured.append(self._capture_observed(entry.descriptor, entry.strategy))
                    self._enforce_budget(keep=(entry.descriptor, entry.strategy))
        finally:
            self._rebuild()
            if hasattr(bar, "close"):
                bar.close()
        return captured

    def _capture_observed(self, key: BatchDescriptor, strategy: str) -> EntryInfo:
        """Capture one entry between the capture_started and capture_finished hooks."""
        notify(self._hook.cgregistry_capture_started, registry=self, key=key, strategy=strategy)
        try:
            info = self._info(self._capture_one(key, strategy))
        except Exception as exc:
            error = exc if isinstance(exc, CaptureError) else CaptureError(key, strategy, exc)
            notify(self._hook.cgregistry_capture_finished, registry=self, key=key, strategy=strategy, entry=None, error=error)
            if error is exc:
                raise
            raise error from exc
        notify(self._hook.cgregistry_capture_finished, registry=self, key=key, strategy=strategy, entry=info, error=None)
        return info

    @staticmethod
    def _plan_entry(e: object) -> PlanEntry:
        if isinstance(e, PlanEntry):
            return e
        if isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], BatchDescriptor) and isinstance(e[1], str):
            return PlanEntry(e[0], e[1])
        raise TypeError(f"a plan holds PlanEntry or (BatchDescriptor, strategy name) pairs, got {e!r}")

    def _check_fits(self, key: BatchDescriptor) -> None:
        for buf in self._buffers.values():
            rows = self._key_rows(buf, key)
            if rows > buf.capacity:
                raise ValueError(
                    f"key {key} needs {rows} {buf.spec.axis} in static input {buf.name!r}, "
                    f"which holds {buf.capacity}; enlarge its StaticInput shape"
                )

    @staticmethod
    def _key_rows(buf: StaticBuffer, key: BatchDescriptor) -> int:
        rows = _rows(buf.spec.axis, key)
        return buf.capacity if rows is None else rows  # relaxed keys see every request slot

    def _capture_one(self, key: BatchDescriptor, strategy_name: str) -> _Entry:
        strategy = self.plugins.strategy(strategy_name)
        if not self._entries:
            # No live graph holds the pool: on CUDA a pool whose graphs all died cannot take new captures.
            self._pool = self.backend.new_pool()
            if self.debug:
                self._addresses.rebase()  # no graph reads the old addresses
        # Capture runs the step, which may write engine state (a KV cache at the slots it reads):
        # it runs on the fills (scratch slots), never on the rows of a batch already served.
        for buf in self._buffers.values():
            buf.reset()
        views = {name: buf.view(self._key_rows(buf, key)) for name, buf in self._buffers.items()}
        step = self._step

        def body() -> Any:
            return step(key, **views)

        started = time.perf_counter()
        batch_token = runtime.batch.set(BreakContext(key, key, self._capture_payload))
        try:
            with torch.inference_mode():
                warm_leaves, spec = flatten(self.backend.warmup(body, self.warmup_runs))
                self._check_outputs(warm_leaves, key)
                del warm_leaves
                graph, out = strategy.capture(body, self.backend, self._pool)
                leaves, captured_spec = flatten(out)
                del out
                if captured_spec != spec:
                    raise OutputError("the step returned a different output structure at capture than at warm-up")
                self._check_outputs(leaves, key)
                _check_memory_bytes(graph, strategy_name)
            self.backend.synchronize()
        except Exception as exc:
            self._pool = self.backend.recover_pool(self._pool)
            raise CaptureError(key, strategy_name, exc) from exc
        finally:
            runtime.batch.reset(batch_token)
        seconds = time.perf_counter() - started
        entry = _Entry(key, strategy_name, graph, OutputSlicer(self.backend.share_outputs(leaves), spec), seconds)
        self._entries[(key, strategy_name)] = entry
        self._pending.pop((key, strategy_name), None)
        return entry

    def _check_outputs(self, leaves: list[torch.Tensor], key: BatchDescriptor) -> None:
        if not leaves:
            raise OutputError("the step returned no tensor")
        rows = _rows(self.output_axis, key)
        for i, leaf in enumerate(leaves):
            if leaf.dim() == 0 or (rows is not None and leaf.shape[0] != rows):
                raise OutputError(
                    f"output leaf {i} has shape {tuple(leaf.shape)}; expected a leading dimension of "
                    f"{rows} ({self.output_axis} of {key})"
                )
            if leaf.device != self.device:
                raise OutputError(f"output leaf {i} is on {leaf.device}, expected {self.device}")
        if rows is None:
            raise OutputError(f"output_axis='reqs' needs keys with a request count; {key} has none")

    def _rebuild(self) -> None:
        self._matcher = Matcher([*self._entries, *self._pending], self.preference)
        self._routes.clear()
        self._group_routes.clear()

    # ------------------------------------------------------------------ lazy capture and the budget

    def _capture_lazily(self, pair: tuple[BatchDescriptor, str], actual: BatchDescriptor) -> _Route:
        """Capture a pending key on its first use; on failure drop it and fall back to eager."""
        try:
            with _frozen_gc():
                self._capture_observed(*pair)
        except CaptureError as exc:
            self._pending.pop(pair, None)
            self._failures[pair] = exc
            warnings.warn(f"cgregistry: lazy {exc}; the key is dropped and the step runs eagerly", RuntimeWarning, stacklevel=3)
        else:
            self._lazy_captures += 1
            self._enforce_budget(keep=pair)
        self._rebuild()
        return self._route(actual)

    def _enforce_budget(self, keep: tuple[BatchDescriptor, str]) -> None:
        """Evict least-recently-used entries (never ``keep``) while measured memory exceeds the budget."""
        if self.memory_budget is None:
            return
        evicted = False
        while self.memory_bytes() > self.memory_budget:
            victims = [e for pair, e in self._entries.items() if pair != keep]
            if not victims:
                break
            victim = min(victims, key=lambda e: (e.last_step, -e.memory_bytes))
            self._drop(victim)
            self._pending[(victim.key, victim.strategy)] = None  # a later need captures it again
            self._evictions += 1
            evicted = True
            notify(self._hook.cgregistry_evicted, registry=self, key=victim.key, strategy=victim.strategy, memory_bytes=victim.memory_bytes)
        if evicted:
            self._rebuild()

    def _drop(self, entry: _Entry) -> None:
        """Remove an entry, keeping its counters in the statistics."""
        self._entries.pop((entry.key, entry.strategy), None)
        retired = self._retired.setdefault(entry.key_class, [0, 0, 0])
        retired[0] += entry.replays
        retired[1] += entry.graph_tokens
        retired[2] += entry.padded_tokens

    # ------------------------------------------------------------------ run

    def run(self, actual: BatchDescriptor, /, *, context: Any = None, group: Any = None, **inputs: torch.Tensor) -> Any:
        """Match, copy in, pad, replay, and return outputs sliced to ``actual``.

        With no covering key, ``step(actual, **inputs)`` runs eagerly (counted).
        ``context`` is an engine payload that eager breaks (and an eager step)
        read through ``cgregistry.current_batch()``.  Inputs are all checked
        before any is copied.  A ``run`` while another is in progress on another
        thread is refused with ``ConcurrentRunError`` (the static buffers and the
        outputs are shared); calls from several threads in turn are fine.
        With ``group`` (a torch.distributed process group), every rank of the
        group replays the same key: the one for the descriptor all their
        batches fit in (:func:`cgregistry.distributed.agree`, one collective).
        """
        if not self._running.acquire(False):
            raise ConcurrentRunError(
                f"run() on registry {self.name!r} while another run() is in progress: a registry's static buffers "
                "and graph outputs serve one step at a time; give each thread its own registry or serialise the calls"
            )
        try:
            if group is not None:
                return self._run_agreed(actual, context, inputs, group)
            if self.debug:
                return self._run_debug(actual, context, inputs)
            return self._run(actual, context, inputs)
        finally:
            self._running.release()

    def _run_agreed(self, actual: BatchDescriptor, context: Any, inputs: dict[str, torch.Tensor], group: Any) -> Any:
        """``_run`` on the key the whole group agreed on, each rank with its own rows."""
        agreed = agree(actual, group)
        route = self._group_routes.get((actual, agreed))
        if route is None:
            route = self._agreed_route(actual, agreed)
            if route.pending:  # a lazy key: capture it here, then route again on what the group agreed
                self._check_inputs(route, inputs)
                self._capture_lazily((route.match.key, route.match.strategy), actual)  # type: ignore[union-attr]
                route = self._agreed_route(actual, agreed)
        if self.debug:
            return self._run_debug(actual, context, inputs, route)
        return self._run(actual, context, inputs, route)

    def _run_debug(self, actual: BatchDescriptor, context: Any, inputs: dict[str, torch.Tensor], route: _Route | None = None) -> Any:
        """``_run`` with debug checks: moved tensors before replay, stale outputs after.

        An output passed back as the next input is read before this run overwrites it; a run
        refused for its inputs overwrites nothing; eager outputs are the caller's own tensors.
        """
        self._addresses.check()
        inputs = {name: plain(value) for name, value in inputs.items()}
        clock = self._run_clock
        clock[0] += 1
        eager_before = self._eager_fallbacks
        try:
            out = self._run(actual, context, inputs, route)
        except InputError:
            clock[0] -= 1
            raise
        if self._eager_fallbacks != eager_before:
            return out
        return checked(out, clock[0], clock)

    def _agreed_route(self, actual: BatchDescriptor, agreed: BatchDescriptor) -> _Route:
        match = self.match(agreed)
        route = self._route(actual, match if match is not None else _NO_MATCH)
        if len(self._group_routes) >= _ROUTE_CACHE_LIMIT:
            self._group_routes.clear()
        self._group_routes[(actual, agreed)] = route
        return route

    def _run(self, actual: BatchDescriptor, context: Any, inputs: dict[str, torch.Tensor], route: _Route | None = None) -> Any:
        if route is None:
            try:
                route = self._routes.get(actual)
            except TypeError:  # unhashable: not a descriptor
                raise _not_a_descriptor(actual) from None
            if route is None:
                route = self._route(actual)
        self._check_inputs(route, inputs)  # before anything is touched, on the graph and the eager path alike
        entry = route.entry
        if entry is None:
            if route.pending:
                route = self._capture_lazily((route.match.key, route.match.strategy), actual)  # type: ignore[union-attr]
                entry = route.entry
            if entry is None:
                self._misses += 1
                self._misses_by_kind["uniform" if actual.uniform else "mixed"] += 1
                if self._miss_hook is not None:
                    notify(self._miss_hook, registry=self, actual=actual)
                return self._eager(actual, inputs, context)
        for buf, rows in route.copies:
            buf.write(inputs[buf.name], rows)
        try:
            if entry.has_breaks:
                batch = route.batch_context if context is None else BreakContext(actual, entry.key, context)
                token = runtime.batch.set(batch)
                try:
                    entry.replay()
                finally:
                    runtime.batch.reset(token)
            else:
                entry.replay()
        except Exception as exc:
            return self._replay_failed(entry, exc, actual, inputs, context)
        entry.replays += 1
        entry.padded_tokens += route.pad_tokens
        entry.graph_tokens += route.real_tokens
        self._clock += 1
        entry.last_step = self._clock
        out = route.single_output
        if out is not None:
            return out.detach()  # a fresh view per run: a caller's unsqueeze_() or t_() stays with the caller
        return entry.slicer.sliced(route.out_rows)

    def _check_inputs(self, route: _Route, inputs: Mapping[str, torch.Tensor]) -> None:
        """Every input named, shaped, typed and placed for ``route``, or an InputError naming the first that is not."""
        if len(inputs) != len(route.copies):
            raise self._bad_names(inputs)
        try:
            for buf, rows in route.copies:
                buf.check(inputs[buf.name], rows)
        except KeyError:
            raise self._bad_names(inputs) from None

    def _eager(self, actual: BatchDescriptor, inputs: Mapping[str, torch.Tensor], context: Any = None) -> Any:
        self._eager_fallbacks += 1
        self._eager_tokens += actual.num_tokens
        token = runtime.batch.set(BreakContext(actual, None, context))
        try:
            return self._step(actual, **inputs)
        except Exception:
            self._bad_batches += 1  # the step itself refused this batch
            raise
        finally:
            runtime.batch.reset(token)

    def _replay_failed(self, entry: _Entry, error: Exception, actual: BatchDescriptor, inputs: Mapping[str, torch.Tensor], context: Any) -> Any:
        """A replay raised: eager, the oracle, tells a bad batch from a broken entry.

        If the step raises on this batch eagerly too, the batch is at fault (an out-of-range
        token id, say): its error goes to the caller and the entry stays.  If eager succeeds,
        the entry is broken: it is removed, and the eager result is returned.
        """
        out = self._eager(actual, inputs, context)  # raises (and counts) when the batch is at fault
        self._remove_failed(entry, error)
        return out

    def _remove_failed(self, entry: _Entry, error: BaseException) -> None:
        """Drop an entry whose replay raised where eager did not, keep the error for failures(), tell observers."""
        self._drop(entry)
        self._failures[(entry.key, entry.strategy)] = error
        self._rebuild()
        warnings.warn(
            f"cgregistry: replay of {entry.key} [{entry.strategy}] raised {type(error).__name__}: {error}, while the "
            "same batch ran eagerly; the entry was removed and the step's eager result returned",
            RuntimeWarning,
            stacklevel=4,
        )
        notify(self._hook.cgregistry_entry_failed, registry=self, key=entry.key, strategy=entry.strategy, error=error)

    # ------------------------------------------------------------------ release

    def release(self, key: BatchDescriptor, strategy: str | None = None) -> int:
        """Remove the entries captured for ``key`` (under ``strategy``, or any); return how many.

        The graph objects go at once.  Their pool memory stays with the pool while
        other entries share it, and goes back to the allocator when the last entry
        is released (``clear()``); a later capture of the key works as before.
        """
        if not isinstance(key, BatchDescriptor):
            raise TypeError(f"release() needs a BatchDescriptor, got {key!r}")
        pairs = [p for p in [*self._entries, *self._pending] if p[0] == key and (strategy is None or p[1] == strategy)]
        if not pairs:
            held = sorted({f"{k} [{s}]" for k, s in self._entries})
            raise KeyError(f"no entry for {key}{'' if strategy is None else f' [{strategy}]'}; captured: {held}")
        for pair in pairs:
            entry = self._entries.get(pair)
            if entry is not None:
                self._release_entry(entry)
            self._pending.pop(pair, None)
        self._after_release()
        return len(pairs)

    def clear(self) -> int:
        """Remove every entry and pending key; return how many.  The pool goes back to the
        allocator (and to the driver on ``torch.cuda.empty_cache()``); counters are kept."""
        count = len(self._entries) + len(self._pending)
        for entry in list(self._entries.values()):
            self._release_entry(entry)
        self._pending.clear()
        self._after_release()
        return count

    def _release_entry(self, entry: _Entry) -> None:
        self._drop(entry)
        notify(self._hook.cgregistry_released, registry=self, key=entry.key, strategy=entry.strategy, memory_bytes=entry.memory_bytes)

    def _after_release(self) -> None:
        self._rebuild()
        if not self._entries:
            self._pool = self.backend.new_pool()  # drop the handle too: nothing holds the old pool now
        gc.collect()  # a graph in a reference cycle would keep the pool alive

    def watch(self, named: Iterable[tuple[str, torch.Tensor]] | torch.nn.Module, prefix: str = "") -> None:
        """Tensors captured graphs read whose address debug mode checks before each replay: ``(name, tensor)``
        pairs, or a module (every parameter and buffer, looked up by name, so a replaced one is caught too).
        Static inputs are always checked, and so is the step itself when it is a module or a module's method."""
        self._addresses.watch(named, prefix)

    def failures(self) -> dict[tuple[BatchDescriptor, str], BaseException]:
        """Entries removed because their replay raised, with the error (a new capture may replace them)."""
        return dict(self._failures)

    def _bad_names(self, inputs: Mapping[str, Any]) -> InputError:
        missing = sorted(self._input_names - inputs.keys())
        extra = sorted(inputs.keys() - self._input_names)
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"unexpected {extra}")
        return InputError(f"run() inputs do not match the static inputs: {'; '.join(parts)}; expected {sorted(self._input_names)}")

    def _route(self, actual: BatchDescriptor, forced: Match | object | None = None) -> _Route:
        """How ``run`` serves ``actual``: by the matcher, or on ``forced`` (a group's agreed match)."""
        if not isinstance(actual, BatchDescriptor):
            raise _not_a_descriptor(actual)
        if forced is None:
            match = self._matcher.match(actual)
            if match is not None and self._choose_hook is not None:
                match = self._chosen(actual, match)
        else:
            match = None if forced is _NO_MATCH else forced  # type: ignore[assignment]
        entry = self._entries.get((match.key, match.strategy)) if match is not None else None
        pending = match is not None and entry is None
        copies = []
        for buf in self._buffers.values():
            rows = _rows(buf.spec.axis, actual)
            if rows is None:
                raise InputError(f"static input {buf.name!r} is indexed by requests, but {actual} gives num_reqs=None")
            copies.append((buf, rows))
        out_rows = _rows(self.output_axis, actual)
        if out_rows is None:
            raise InputError(f"output_axis='reqs' needs the batch's request count; {actual} gives none")
        route = _Route(actual, entry, match, tuple(copies), out_rows, pending)
        if forced is not None:
            return route  # the caller keeps it, by (actual, agreed)
        if len(self._routes) >= _ROUTE_CACHE_LIMIT:
            self._routes.clear()
        self._routes[actual] = route
        return route

    def _chosen(self, actual: BatchDescriptor, default: Match) -> Match:
        candidates = self._matcher.candidates(actual)
        choice = self._choose_hook(registry=self, actual=actual, candidates=candidates)  # type: ignore[misc]
        if choice is None:
            return default
        if not isinstance(choice, Match) or choice not in candidates:
            impls = ", ".join(i.plugin_name for i in self._hook.cgregistry_choose_match.get_hookimpls())
            raise PluginError(
                f"cgregistry_choose_match (implemented by {impls}) returned {choice!r} for {actual}, "
                "which is not one of the candidates it was given (each a Match)"
            )
        return choice

    # ------------------------------------------------------------------ inspection

    def match(self, actual: BatchDescriptor, *, group: Any = None) -> Match | None:
        """The key, strategy and padding ``run`` would use for ``actual`` (None: eager).

        With ``group``, the match for the descriptor every rank's batch fits in (a
        collective: every rank must call it); its padding is relative to that descriptor.
        """
        if group is not None:
            actual = agree(actual, group)
        try:
            route = self._routes.get(actual)
        except TypeError:  # unhashable: not a descriptor
            raise _not_a_descriptor(actual) from None
        if route is None:
            route = self._route(actual)
        return route.match

    def explain(self, actual: BatchDescriptor) -> Explanation:
        """Every captured key and why it won or lost for ``actual``; ``str()`` gives a table."""
        if not isinstance(actual, BatchDescriptor):
            raise _not_a_descriptor(actual)
        return self._matcher.explain(actual)

    def entries(self, **filters: Any) -> list[EntryInfo]:
        """Captured entries as frozen records, largest first.

        Filters (all optional): ``strategy``, ``uniform``, ``spec_depth``,
        ``num_active_loras``, ``used`` (replayed at least once); ``sort`` is one of
        key, replays, padding, memory, capture, recent.
        """
        return filter_entries((self._info(e) for e in self._entries.values()), **filters)

    def _info(self, entry: _Entry) -> EntryInfo:
        graph = entry.graph
        return EntryInfo(
            entry.key, entry.strategy, self.backend.name, entry.capture_seconds, entry.memory_bytes,
            entry.replays, entry.padded_tokens, entry.last_step,
            segments=getattr(graph, "num_segments", None), breaks=getattr(graph, "breaks", None),
        )

    def pending(self) -> list[tuple[BatchDescriptor, str]]:
        """Keys of lazy plans not captured yet (evicted entries return here)."""
        return list(self._pending)

    def __len__(self) -> int:
        return len(self._entries)

    def memory_bytes(self) -> int:
        """Measured memory of all live captures (pool growth on cuda, held tensors on cpu)."""
        return sum(e.memory_bytes for e in self._entries.values())

    def stats(self) -> Stats:
        """Counters since construction or the last ``reset_stats`` (entries removed since keep counting)."""
        classes: dict[str, list[int]] = {label: [0, *counts] for label, counts in self._retired.items()}
        by_strategy: dict[str, int] = {}
        for entry in self._entries.values():
            row = classes.setdefault(entry.key_class, [0, 0, 0, 0])
            row[0] += 1
            row[1] += entry.replays
            row[2] += entry.graph_tokens
            row[3] += entry.padded_tokens
        for label, row in classes.items():
            strategy = label.split("/", 1)[0]
            by_strategy[strategy] = by_strategy.get(strategy, 0) + row[1]
        return Stats(
            hits=sum(row[1] for row in classes.values()),
            misses=self._misses,
            eager_fallbacks=self._eager_fallbacks,
            graph_tokens=sum(row[2] for row in classes.values()),
            padded_tokens=sum(row[3] for row in classes.values()),
            eager_tokens=self._eager_tokens,
            by_strategy=by_strategy,
            entry_failures=len(self._failures),
            by_class={label: ClassStats(*row) for label, row in sorted(classes.items())},
            misses_by_kind=dict(self._misses_by_kind),
            bad_batches=self._bad_batches,
            lazy_captures=self._lazy_captures,
            evictions=self._evictions,
        )

    def reset_stats(self) -> None:
        """Zero every counter (entries stay captured)."""
        for entry in self._entries.values():
            entry.replays = entry.padded_tokens = entry.graph_tokens = entry.last_step = 0
        self._retired.clear()
        self._misses_by_kind = {"uniform": 0, "mixed": 0}
        self._misses = self._eager_fallbacks = self._eager_tokens = self._clock = self._bad_batches = 0
        self._lazy_captures = self._evictions = 0

    def snapshot(self) -> dict[str, Any]:
        """Entries, counters and pending keys as a JSON-serialisable dict (``cgregistry.inspection``)."""
        return Snapshot(
            name=self.name,
            backend=self.backend.name,
            device=str(self.device),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            preference=tuple(self._matcher.preference),
            entries=tuple(self.entries()),
            stats=self.stats(),
            memory_bytes=self.memory_bytes(),
            pending=tuple(self._pending),
            failures={f"{k} [{s}]": f"{type(e).__name__}: {e}" for (k, s), e in self._failures.items()},
        ).to_dict()

    def table(self, *, used_only: bool = False, sort: str = "key") -> str:
        """Entries as a text table with a summary line."""
        lines = entries_table(self.entries(used=True if used_only else None, sort=sort))
        lines.append(stats_line(self.stats(), len(self._entries), self.backend.name, self.memory_bytes()))
        return "\n".join(lines)


def _not_a_descriptor(value: object) -> TypeError:
    return TypeError(f"a batch must be a cgregistry.BatchDescriptor, got {value!r} ({type(value).__name__})")


def _check_memory_bytes(graph: Any, strategy: str) -> None:
    """A strategy's measured memory feeds the budget: it must be a byte count."""
    memory = getattr(graph, "memory_bytes", None)
    if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory < 0:
        raise PluginError(f"strategy {strategy!r} reported memory_bytes={memory!r} for its graph; expected a byte count >= 0")


@contextlib.contextmanager
def _frozen_gc() -> Iterator[None]:
    """No garbage collection (and no tensor finaliser) while graphs are being captured."""
    freeze = gc.get_freeze_count() == 0  # leave a caller's own frozen heap alone
    if freeze:
        gc.collect()
        gc.freeze()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        if enabled:
            gc.enable()


def _stderr_is_terminal() -> bool:
    import sys

    return sys.stderr.isatty()


def _progress(items: list[PlanEntry], enabled: bool) -> Iterable[PlanEntry]:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc="capturing graphs", unit="graph", leave=False)
