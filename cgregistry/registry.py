"""GraphRegistry: the engine's one object, composed of three collaborators that never call back into it.

- :class:`~cgregistry.entries.EntryStore`: entries, lazy keys, failures, the budget, the counters;
- :class:`~cgregistry.routing.RouteTable`: the matcher and the cached route of each batch shape;
- :class:`~cgregistry.capture.EntryCapture`: the capture of one entry into the shared pool.

The registry owns the static buffers, tells plugins what happened, and holds the hot
path, ``_run``, in one place: route lookup, input checks, copy in, replay, counters,
outputs.  A batch no key covers runs ``step`` eagerly on the live inputs and is counted.
"""

from __future__ import annotations

import _thread
import collections
import gc
import itertools
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import attrs
import torch

from cgregistry import runtime
from cgregistry.adaptive import Adaptation, PlanChange, TrafficHistogram, propose
from cgregistry.background import CaptureWorker
from cgregistry.buffers import InputError, StaticBuffer, StaticInput
from cgregistry.capture import CaptureError, EntryCapture, frozen_gc, paused_gc
from cgregistry.compiler import (
    DEFAULT_MAX_TRACES,
    PiecewiseCompiler,
    PiecewiseModel,
    compile_piecewise,
)
from cgregistry.debug import AddressWatch, checked, plain
from cgregistry.descriptor import BatchDescriptor
from cgregistry.distributed import agree
from cgregistry.entries import Entry, EntryStore, Pair
from cgregistry.errors import CgregistryError
from cgregistry.inspection import (
    EntryInfo,
    Snapshot,
    Stats,
    entries_table,
    filter_entries,
    stats_line,
)
from cgregistry.keyclasses import check_serves
from cgregistry.matcher import (
    DEFAULT_PREFERENCE,
    Explanation,
    Match,
    PaddingCap,
    excluded,
)
from cgregistry.outputs import OutputAxes
from cgregistry.plan import CapturePlan, PlanEntry
from cgregistry.plugins import Plugins
from cgregistry.routing import NO_EXCLUSION, RouteTable, Variant, not_a_descriptor
from cgregistry.runtime import BreakContext
from cgregistry.serving_state import ServingState, ServingStateError

__all__ = ["CaptureError", "ConcurrentRunError", "EntryInfo", "GraphRegistry", "Stats"]  # records re-exported

_names = itertools.count(1)  # default registry names: registry-1, registry-2, ...
_RESERVED_INPUT_NAMES = ("context", "group", "exclude")  # keyword arguments of run() itself
PLAN_CHANGES_KEPT = 256  # GraphRegistry.plan_changes keeps the last this many (stats().plan_changes counts them all)
_WARN_ONCE = ("no_graphs", "above_capacity")  # misses that mean the engine is set up wrong, warned about once


class ConcurrentRunError(CgregistryError, RuntimeError):
    """``run()`` was called while another ``run()`` on the same registry was in progress."""


class GraphRegistry:
    """Captured graphs for one step function, keyed by BatchDescriptor.

    ``step(batch, **inputs)`` is the engine's forward: it gets the padded key and
    views of the static buffers sized for it, and returns a tensor or a pytree of
    tensors whose leading dimension is the padded token (or request) count.
    ``output_axis`` names that axis ("tokens", "reqs", "reqs+1"), or is a tree
    shaped like the output with one axis per tensor leaf.

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
        output_axis: Any = "tokens",
        preference: Sequence[str] = DEFAULT_PREFERENCE,
        warmup_runs: int = 1,
        plugins: Plugins | None = None,
        name: str | None = None,
        memory_budget: int | None = None,
        debug: bool = False,
        max_padding_tokens: int | None = None,
        max_padding_ratio: float | None = None,
        adapt: Adaptation | None = None,
    ) -> None:
        if not callable(step):
            raise TypeError(f"step must be callable, got {step!r}")
        output_axes = OutputAxes(output_axis)
        if type(warmup_runs) is not int or warmup_runs < 1:
            raise ValueError(f"warmup_runs must be an int >= 1, got {warmup_runs!r}")
        _check_budget(memory_budget)
        cap = PaddingCap(max_padding_tokens, max_padding_ratio)
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
        self._store = EntryStore(memory_budget)
        self._capturer = EntryCapture(step, self._buffers, self.backend, output_axes, warmup_runs)
        chooser = None
        if self.plugins.observed("cgregistry_choose_match"):
            hook = self.plugins.pm.hook.cgregistry_choose_match
            chooser = lambda actual, candidates: hook(registry=self, actual=actual, candidates=candidates)  # noqa: E731
            names = ", ".join(i.plugin_name for i in hook.get_hookimpls())
        self._routes = RouteTable(
            self._buffers, self._store.entries, output_axes, self.preference, chooser, names if chooser else "", self._store.failures, cap
        )
        self._exclusions: dict[Any, frozenset[str]] = {}  # exclude= values already checked, to their strategy sets
        self._route_cache = self._routes.cache  # the hot path's first lookup (cleared in place, never replaced)
        self._capture_context: CaptureContext | None = None  # what every capture runs under (see _record_context)
        self._state_ok: Callable[[], bool] = _always  # the hot path's test of the caller's state against it
        self.debug = bool(debug)
        self._addresses = AddressWatch()
        self._addresses.watch((f"static input {name!r}", buf.tensor) for name, buf in self._buffers.items())
        owner = step if isinstance(step, torch.nn.Module) else getattr(step, "__self__", None)
        if self.debug and isinstance(owner, torch.nn.Module):
            self._addresses.watch(owner, prefix="step.")  # a model as the step: its weights are what graphs read
        self._run_clock = [0]  # run() count, for debug mode's stale-output check
        self._running = _thread.allocate_lock()
        self._capture_lock = threading.Lock()  # one capture at a time: the serving thread's or the background worker's
        self._worker: CaptureWorker | None = None  # created by the first capture(..., background=True)
        self._background: CaptureWorker | None = None  # the worker while it has work or results to install (run() checks)
        self._warned: set[str] = set()  # miss reasons (and keys a refit could not add) already warned about
        self._miss_observed = self.plugins.observed("cgregistry_miss")  # an unobserved miss costs nothing
        if adapt is not None and not isinstance(adapt, Adaptation):
            raise TypeError(f"adapt must be a cgregistry.Adaptation, got {adapt!r}")
        if adapt is not None:
            _refuse_background_with_collectives("GraphRegistry(adapt=...)", _RANKS_WOULD_DIVERGE)
            for entry in CapturePlan.fit({}, adapt.max_graphs, adapt.settings):  # the widest keys any refit keeps
                try:
                    self._capturer.check_fits(entry.descriptor)
                except ValueError as exc:
                    raise ValueError(
                        f"adapt: its settings make refits keep the key {entry.descriptor}, which does not fit the static inputs "
                        f"({exc}); lower the settings' max_num_tokens / max_capture_size / max_num_seqs or enlarge the inputs"
                    ) from None
        self._adapt = adapt
        self._traffic = TrafficHistogram()  # what refits fit to (adapt=...)
        self._observed: dict[BatchDescriptor, int] = {}  # steps per shape since the last harvest
        self._unharvested = 0
        self._harvest_at = _next_harvest(adapt, self._traffic, False) if adapt is not None else 0
        self._refit_running = False
        # The changes adaptation made, oldest first: the last PLAN_CHANGES_KEPT (a server runs for days).
        self.plan_changes: collections.deque[PlanChange] = collections.deque(maxlen=PLAN_CHANGES_KEPT)
        if adapt is not None:
            self._worker = CaptureWorker(self._capture_in_background, self.name)
            self._background = self._worker  # run() takes the observing path from the first step
        self.plugins.notify("cgregistry_registry_created", registry=self)

    @property
    def padding_cap(self) -> PaddingCap:
        """The most token padding a key may add to a batch (``max_padding_tokens``, ``max_padding_ratio``)."""
        return self._routes.cap

    @property
    def capture_context(self) -> CaptureContext | None:
        """What every capture runs under, whichever path captures (foreground, lazy, background, refit): the payload
        of the latest ``capture(context=...)`` and the state of the thread that called it; None before any."""
        return self._capture_context

    @property
    def memory_budget(self) -> int | None:
        """Bytes of measured graph memory to stay under (least recently replayed entries are evicted); None: no limit."""
        return self._store.memory_budget

    @memory_budget.setter
    def memory_budget(self, value: int | None) -> None:
        _check_budget(value)
        self._store.memory_budget = value

    # ------------------------------------------------------------------ piecewise

    def compile_backend(
        self, splitting_ops: Iterable[object] | None = None, *, inductor: bool = False,
        max_traces: int = DEFAULT_MAX_TRACES, include_marked: bool | None = None,
    ) -> PiecewiseCompiler:
        """A torch.compile backend for this registry's ``piecewise`` entries (see :mod:`cgregistry.compiler`).

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
        background: bool = False,
    ) -> list[EntryInfo]:
        """Capture every entry of ``plan`` not yet captured, in plan order (largest first).

        All entries are checked before any is captured (or planned lazily): the strategy is
        registered, the key fits the static inputs, and the strategy serves the key's class
        (its ``unsupported_classes``); a refused plan leaves the registry as it was.  If a
        capture fails, the entries captured before it stay, it is absent, and ``CaptureError``
        names its descriptor and strategy.  With ``lazy=True`` nothing is
        captured now: each key is captured by the first ``run`` it is the best
        match for (counted in ``stats().lazy_captures``).  ``context`` is the payload
        eager breaks see through ``current_batch()`` while capturing: it must describe
        the all-padding batch capture runs on (see docs/integration.md).  It and the calling
        thread's state (autocast, default dtype and device, CUDA device, context variables)
        become ``capture_context``, which every later capture runs under, whichever path
        captures (``context=None`` keeps the payload recorded before); a replay under another
        state is refused with ``ServingStateError``.

        With ``background=True`` it returns at once and a capture thread takes the entries
        one by one (the largest key of each kind first, then the rest from the smallest up),
        while ``run()`` serves every batch (from the graphs already installed, else
        eagerly, counted as a ``capturing`` miss); each entry goes live at the start of the
        first ``run()`` after its capture.  ``wait_captured()`` waits for all of them.  What
        the engine must not do meanwhile: docs/background.md.
        """
        if lazy and background:
            raise ValueError("capture(lazy=True, background=True): choose one; lazy captures a key at its first use, background ahead of it")
        self._refuse_on_capture_thread("capture()")
        todo = [_plan_entry(e) for e in plan]
        for entry in todo:
            check_serves(entry.descriptor, self.plugins.strategy(entry.strategy))
            self._capturer.check_fits(entry.descriptor)
        if background:
            self._submit(todo, context)
            return []
        self._record_context(context)
        self._install_finished()
        pairs = [(e.descriptor, e.strategy) for e in dict.fromkeys(todo) if (e.descriptor, e.strategy) not in self._store.entries]
        if self._background is not None:  # captured here instead: no longer the capture thread's to do
            self._background.discard(pairs)
            self._routes.capturing = tuple(self._background.queued())
        if lazy:
            self._store.add_pending(pairs)
            self._routes.rebuild(self._store.pairs())
            self._warn_shadowed()
            return []
        if progress is None:
            progress = len(pairs) > 1 and sys.stderr.isatty()
        bar = _progress(pairs, progress)
        captured: list[EntryInfo] = []
        try:
            with frozen_gc():
                for pair in bar:
                    captured.append(self._capture_observed(pair))
        finally:
            self._routes.rebuild(self._store.pairs())
            if hasattr(bar, "close"):
                bar.close()
        self._warn_shadowed()
        return captured

    def _record_context(self, payload: Any) -> None:
        """A capture() call: the calling thread's state, and ``payload`` (None keeps the current one), become what every
        later capture runs under; refused while graphs captured under a state that computes otherwise are held."""
        state = ServingState.current(self.device.type)
        held = self._capture_context
        if held is not None and (self._store.entries or self._store.pending or self.capturing()):
            found = held.state.differences()
            if found:
                raise ServingStateError(
                    f"capture() on registry {self.name!r} under another state than the graphs it holds were captured under: "
                    f"{'; '.join(found)}; a registry's graphs share one state: reg.clear() first, or capture under the held one"
                )
        if payload is None and held is not None:
            payload = held.payload
        self._capture_context = CaptureContext(payload, state)
        self._state_ok = state.checker()

    def _context(self) -> CaptureContext:
        """The one context every capture runs under (recorded now, on the serving thread, if no capture() gave one)."""
        if self._capture_context is None:
            self._record_context(None)
        return self._capture_context  # type: ignore[return-value]

    def _warn_shadowed(self) -> None:
        """Warn when a strategy's uniform keys rank after a relaxed strategy's: those graphs may never replay."""
        pairs = self._store.pairs()
        order = self._routes.matcher.preference
        with_keys = {s for _, s in pairs}
        relaxed = [s for s in order if s in with_keys and self.plugins.strategy(s).relaxes_num_reqs]
        for strategy in sorted({s for k, s in pairs if k.uniform}):
            first = next((r for r in relaxed if order.index(r) < order.index(strategy)), None)
            if first is not None:
                warnings.warn(
                    f"cgregistry: uniform keys of strategy {strategy!r} rank after {first!r} in this registry's "
                    f"preference {tuple(order)}; {first!r} keys cover those batches first, so {strategy!r} graphs may "
                    f"never replay. Put it first: GraphRegistry(..., preference=({strategy!r}, {first!r}, ...))",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _capture_observed(self, pair: Pair) -> EntryInfo:
        """Capture one entry between the capture_started and capture_finished hooks, then keep the budget."""
        key, strategy = pair
        worker = self._background
        with self._capture_lock:  # a capture in flight on the capture thread finishes first
            self.plugins.notify("cgregistry_capture_started", registry=self, key=key, strategy=strategy)
            if not self._store.entries and (worker is None or not worker.busy):
                self._capturer.new_pool()  # no live graph holds the old pool
                if self.debug:
                    self._addresses.rebase()  # no graph reads the old addresses
            try:
                ctx = self._context()
                entry = ctx.state.run(self._capturer.capture, key, strategy, self.plugins.strategy(strategy), ctx.payload)
            except CaptureError as error:
                self.plugins.notify("cgregistry_capture_finished", registry=self, key=key, strategy=strategy, entry=None, error=error)
                raise
        self._store.add(entry)
        info = self._info(entry)
        self.plugins.notify("cgregistry_capture_finished", registry=self, key=key, strategy=strategy, entry=info, error=None)
        for victim in self._store.evict_over_budget(keep=pair):
            self.plugins.notify(
                "cgregistry_evicted", registry=self, key=victim.key, strategy=victim.strategy, memory_bytes=victim.memory_bytes
            )
        return info

    def _capture_lazily(self, pair: Pair) -> None:
        """Capture a pending key on its first use; on failure drop it (the batch then runs eagerly).

        With the capture thread at work, the key goes to its queue instead: capturing it here would wait
        for the capture in flight, and no step waits on a capture.
        """
        worker = self._background
        if worker is not None and worker.busy:
            self._store.pending.pop(pair, None)
            worker.submit([pair], self._context())
            self._routes.capturing = tuple(worker.queued())
            self._routes.rebuild(self._store.pairs())
            return
        try:
            with frozen_gc():
                self._capture_observed(pair)
        except CaptureError as exc:
            self._store.fail_pending(pair, exc)
            warnings.warn(
                f"cgregistry: lazy {exc}; the key is dropped and the step goes on to the next best key (or runs eagerly)",
                RuntimeWarning,
                stacklevel=4,
            )
        else:
            self._store.lazy_captures += 1
        self._routes.rebuild(self._store.pairs())

    # ------------------------------------------------------------------ background capture

    def _submit(self, todo: list[PlanEntry], payload: Any) -> None:
        """Queue plan entries for the capture thread (see ``capture(background=True)``)."""
        _refuse_background_with_collectives()
        self._record_context(payload)
        worker = self._worker
        if worker is None:
            worker = self._worker = CaptureWorker(self._capture_in_background, self.name)
        self._install_finished()
        held = set(self._store.entries)
        pairs = [(e.descriptor, e.strategy) for e in dict.fromkeys(todo) if (e.descriptor, e.strategy) not in held]
        worker.submit(_background_order(pairs), self._context())
        self._background = worker  # even if the capture already finished: its entry waits in ready
        self._routes.capturing = tuple(worker.queued())
        self._routes.rebuild(self._store.pairs())  # eager routes cached before now get their new miss reason

    def _refuse_on_capture_thread(self, call: str) -> None:
        """``call`` from a hook or the step running on the capture thread would wait for that thread itself."""
        worker = self._worker
        if worker is not None and worker.thread_id == threading.get_ident():
            raise RuntimeError(
                f"{call} on registry {self.name!r} from its own capture thread (a hook or the step called it while "
                "capturing) would wait for itself"
            )

    def _capture_in_background(self, pair: Pair, ctx: CaptureContext) -> Entry:
        """One entry, on the capture thread: own static inputs, the serving thread's state, hooks told, the store untouched."""
        key, strategy = pair
        with self._capture_lock:
            self.plugins.notify("cgregistry_capture_started", registry=self, key=key, strategy=strategy)
            try:
                with paused_gc():
                    entry = ctx.state.run(self._capturer.capture, key, strategy, self.plugins.strategy(strategy), ctx.payload, background=True)
            except CaptureError as error:
                self.plugins.notify("cgregistry_capture_finished", registry=self, key=key, strategy=strategy, entry=None, error=error)
                raise
        self.plugins.notify("cgregistry_capture_finished", registry=self, key=key, strategy=strategy, entry=self._info(entry), error=None)
        return entry

    def _install_finished(self) -> None:
        """Install what the capture thread finished (on the serving thread, between steps): entries go live, failures are kept."""
        worker = self._background
        if worker is None:
            return
        if worker.ready:  # else nothing changed: submit, release and clear keep routes.capturing up to date
            self._install_ready(worker)
        if not worker.busy and not worker.ready and self._adapt is None:
            self._background = None

    def _install_ready(self, worker: CaptureWorker) -> None:
        """Everything in ``worker.ready``: entries added, failures kept, refits applied; then the routes rebuilt."""
        changed = False
        while worker.ready:
            pair, entry, error = worker.ready.popleft()
            if pair is None:  # a refit finished
                self._refit_running = False
                if error is not None:
                    warnings.warn(f"cgregistry: registry {self.name!r}: refit failed: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=4)
                elif entry is not None:
                    changed = self._apply(entry) or changed
                continue
            changed = True
            if entry is None:
                self._store.failures[pair] = error  # type: ignore[assignment]
                warnings.warn(
                    f"cgregistry: background {error}; the key is dropped and its batches go to the next best key "
                    "(or run eagerly); reg.failures() keeps the error",
                    RuntimeWarning,
                    stacklevel=4,
                )
                continue
            if pair in self._store.entries:  # captured in the foreground meanwhile
                continue
            self._store.add(entry)
            self._store.background_captures += 1
            for victim in self._store.evict_over_budget(keep=pair):
                self.plugins.notify(
                    "cgregistry_evicted", registry=self, key=victim.key, strategy=victim.strategy, memory_bytes=victim.memory_bytes
                )
        capturing = tuple(worker.queued())
        if changed or capturing != self._routes.capturing:
            self._routes.capturing = capturing
            self._routes.rebuild(self._store.pairs())

    def _observe(self, actual: BatchDescriptor) -> None:
        """Count a step for adaptation; harvest when a refit may be due (or every 4096 steps), then queue it on the capture thread."""
        observed = self._observed
        observed[actual] = observed.get(actual, 0) + 1
        self._unharvested += 1
        if self._unharvested < self._harvest_at:
            return
        adapt = self._adapt
        traffic = self._traffic
        traffic.add(observed)
        self._observed = {}
        self._unharvested = 0
        due = not self._refit_running and adapt.due(traffic)  # type: ignore[union-attr]
        self._harvest_at = _next_harvest(adapt, traffic, due or self._refit_running)  # type: ignore[arg-type]
        if not due:
            return
        try:
            _refuse_background_with_collectives("adaptation (GraphRegistry(adapt=...))", _RANKS_WOULD_DIVERGE)
        except RuntimeError as exc:  # initialized after the registry was made: stop adapting, say so once
            self._adapt = None
            warnings.warn(f"cgregistry: registry {self.name!r}: {exc}; adaptation is off from now on", RuntimeWarning, stacklevel=4)
            return
        weights = traffic.steps()
        traffic.decay(adapt.decay)  # type: ignore[union-attr]
        current = [*self._store.entries, *self._store.pending, *self.capturing()]
        cap = self._routes.cap
        preference = self._routes.matcher.preference  # read here: the task runs on the capture thread
        served = traffic.observed  # every step harvested (the histogram is never replaced): PlanChange.observed
        self._refit_running = True
        self._worker.submit_task(  # type: ignore[union-attr]
            lambda: propose(weights, current, adapt, preference=preference, observed=served,  # type: ignore[arg-type]
                            max_padding_tokens=cap.max_tokens, max_padding_ratio=cap.max_ratio)
        )

    def _apply(self, change: PlanChange) -> bool:
        """A refit's change, on the serving thread: cold keys released, new ones queued for background capture.

        Keys whose capture failed before, or that this registry cannot capture (a key wider than the static
        inputs, a class its strategy declares it cannot serve), are left out of the change; a change with
        nothing left is dropped (not recorded, no hook).  Hooks see the routes after the change.
        """
        added = []
        for pair in change.added:
            if pair in self._store.failures or pair in self._store.entries:
                continue
            try:
                self._capturer.check_fits(pair[0])
                check_serves(pair[0], self.plugins.strategy(pair[1]))
            except (ValueError, KeyError) as exc:
                if f"refit {pair}" not in self._warned:
                    self._warned.add(f"refit {pair}")
                    warnings.warn(f"cgregistry: registry {self.name!r}: a refit proposed {pair[0]} ({pair[1]}), which this registry "
                                  f"cannot capture ({exc}); the key is left out", RuntimeWarning, stacklevel=5)
                continue
            added.append(pair)
        queued = set(self._worker.queued())  # type: ignore[union-attr]
        removed = [p for p in change.removed if p in self._store.entries or p in self._store.pending or p in queued]
        if not added and not removed:
            return False
        change = attrs.evolve(change, added=tuple(added), removed=tuple(removed))
        released = []
        for key, strategy in removed:
            if (key, strategy) in self._store.entries or (key, strategy) in self._store.pending:
                released += self._store.release(key, strategy)[0]
        self._worker.discard(change.removed)  # type: ignore[union-attr]
        self._worker.submit(_background_order(added), self._context())  # type: ignore[union-attr]
        self.plan_changes.append(change)
        self._store.plan_changes += 1
        self._routes.capturing = tuple(self._worker.queued())  # type: ignore[union-attr]
        self._routes.rebuild(self._store.pairs())
        for entry in released:
            self.plugins.notify("cgregistry_released", registry=self, key=entry.key, strategy=entry.strategy, memory_bytes=entry.memory_bytes)
        self.plugins.notify("cgregistry_plan_changed", registry=self, change=change)
        return True

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Wait for every background capture to finish and install them; False if ``timeout`` seconds passed first.

        Call it from the thread that calls ``run()``, never from inside a step or a hook.
        """
        worker = self._background
        if worker is None:
            return True
        self._refuse_on_capture_thread("wait_captured()")
        if self._running.locked():
            raise RuntimeError("wait_captured() while a run() is in progress (from the step or a hook) would wait for itself")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # installing a refit queues its new keys: wait for those too
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = worker.wait(left)
            self._install_finished()
            if not done or not worker.busy:
                return done

    def capturing(self) -> list[Pair]:
        """Keys queued for, or in, background capture, in capture order (not served by a graph yet)."""
        worker = self._worker
        if worker is None:
            return []
        return worker.queued() + [pair for pair, entry, _ in list(worker.ready) if entry is not None]

    # ------------------------------------------------------------------ run

    def run(
        self, actual: BatchDescriptor, /, *, context: Any = None, group: Any = None, exclude: Any = None, **inputs: torch.Tensor
    ) -> Any:
        """Match, copy in, pad, replay, and return outputs sliced to ``actual``.

        With no covering key, ``step(actual, **inputs)`` runs eagerly (counted).
        ``context`` is an engine payload that eager breaks (and an eager step)
        read through ``cgregistry.current_batch()``.  Inputs are all checked
        before anything happens.  A ``run`` while another is in progress on another
        thread is refused with ``ConcurrentRunError`` (the static buffers and the
        outputs are shared); calls from several threads in turn are fine.
        With ``group`` (a torch.distributed process group), every rank of the
        group replays the same key: the one for the descriptor all their
        batches fit in (:func:`cgregistry.distributed.agree`, one collective).
        ``exclude`` (a tuple, list or set of strategy names) keeps this call off those
        strategies: ``exclude=("full",)`` is vLLM's ``disable_full``, for a step that runs
        cascade attention; a batch whose covering keys are all excluded runs eagerly
        (counted as an ``excluded`` miss).  Such runs have their own route cache, so a
        run without ``exclude`` costs what it did.
        """
        if not self._running.acquire(False):
            raise ConcurrentRunError(
                f"run() on registry {self.name!r} while another run() is in progress: a registry's static buffers "
                "and graph outputs serve one step at a time; give each thread its own registry or serialise the calls"
            )
        try:
            if self._background is not None:
                return self._run_beside_capture(actual, context, group, exclude, inputs)
            if group is not None or exclude is not None:
                skip = NO_EXCLUSION if exclude is None else self._exclusion(exclude)
                if group is None and not skip:
                    variant = None  # exclude=(): a plain run
                else:
                    variant = Variant(None if group is None else agree(actual, group), skip)
                if self.debug:
                    return self._run_debug(actual, context, inputs, variant)
                return self._run(actual, context, inputs, variant)
            if self.debug:
                return self._run_debug(actual, context, inputs, None)
            return self._run(actual, context, inputs)
        finally:
            self._running.release()

    def _run_beside_capture(self, actual: BatchDescriptor, context: Any, group: Any, exclude: Any, inputs: dict[str, torch.Tensor]) -> Any:
        """``run()`` while a capture thread works: install what it finished, and keep it paused during the step."""
        worker = self._background
        self._refuse_on_capture_thread("run()")
        if self._adapt is not None and type(actual) is BatchDescriptor:
            self._observe(actual)
        self._install_finished()
        pause = worker.busy  # type: ignore[union-attr]  # an idle worker (adaptation between refits) needs no pause
        if pause:
            worker.step_started()  # type: ignore[union-attr]
        try:
            variant = None
            if group is not None or exclude is not None:
                skip = NO_EXCLUSION if exclude is None else self._exclusion(exclude)
                if group is not None or skip:
                    variant = Variant(None if group is None else agree(actual, group), skip)
            if self.debug:
                return self._run_debug(actual, context, inputs, variant)
            return self._run(actual, context, inputs, variant)
        finally:
            if pause:
                worker.step_ended()  # type: ignore[union-attr]

    def _exclusion(self, exclude: Any) -> frozenset[str]:
        """``run(exclude=...)`` checked once per distinct value: a collection of registered strategy names."""
        try:
            return self._exclusions[exclude]
        except (KeyError, TypeError):  # not seen yet, or unhashable (a list): check it
            pass
        if not isinstance(exclude, (tuple, list, set, frozenset)):
            raise TypeError(
                f"exclude must be a tuple, list or set of strategy names, e.g. exclude=('full',); got {exclude!r}"
                f" ({type(exclude).__name__}); strategies: {', '.join(sorted(self.plugins.strategies))}"
            )
        names = excluded(exclude)
        unknown = sorted(n for n in names if n not in self.plugins.strategies)
        if unknown:
            raise ValueError(
                f"exclude={exclude!r} names {', '.join(map(repr, unknown))}, not a registered strategy; "
                f"strategies: {', '.join(sorted(self.plugins.strategies))}"
            )
        if isinstance(exclude, (tuple, frozenset)):
            if len(self._exclusions) >= 256:
                self._exclusions.clear()
            self._exclusions[exclude] = names
        return names

    def _run(self, actual: BatchDescriptor, context: Any, inputs: dict[str, torch.Tensor], variant: Variant | None = None) -> Any:
        """The hot path, top to bottom: route, check, (capture lazily,) copy in, replay, count, hand out."""
        try:
            route = self._route_cache.get(actual) if variant is None else self._routes.variant_cache.get((actual, variant))
        except TypeError:  # unhashable: not a descriptor
            raise not_a_descriptor(actual) from None
        if route is None:
            route = self._routes.route(actual, variant)
        # Every input is checked before anything is touched, on the graph and the eager path alike.
        if len(inputs) != len(route.copies):
            raise self._bad_names(inputs)
        try:
            for buf, rows in route.copies:
                buf.check(inputs[buf.name], rows)
        except KeyError:
            raise self._bad_names(inputs) from None
        entry = route.entry
        if entry is None:
            if route.pending is not None:
                # Capture resets the static buffers (and may reuse pool memory) an input can alias: keep copies.
                if not self._state_ok():
                    self._context().state.check(self.name)
                inputs = {name: value.clone() for name, value in inputs.items()}
                while route.pending is not None:  # a failed lazy capture drops its key: the next best may be pending too
                    self._capture_lazily(route.pending)
                    route = self._routes.route(actual, variant)
                entry = route.entry
            if entry is None:
                return self._miss(actual, inputs, context, route.miss_reason)
        if not self._state_ok():  # a graph computes what it computed at capture: refuse another autocast or dtype
            self._context().state.check(self.name)
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
        entry.last_step = next(self._store.clock)
        out = route.single_output
        if out is not None:
            return out.detach()  # a fresh view per run: a caller's unsqueeze_() or t_() stays with the caller
        return entry.slicer.sliced(route.out_rows)

    def _run_debug(self, actual: BatchDescriptor, context: Any, inputs: dict[str, torch.Tensor], variant: Variant | None) -> Any:
        """``_run`` with debug checks: moved tensors before replay, stale outputs after.

        An output passed back as the next input is read before this run overwrites it; a run
        refused for its batch or inputs overwrites nothing; eager outputs are the caller's own.
        """
        if not isinstance(actual, BatchDescriptor):
            raise not_a_descriptor(actual)
        if self._store.entries:  # with no graph, nothing reads the watched addresses yet
            self._addresses.check()
        inputs = {name: plain(value) for name, value in inputs.items()}
        route = self._routes.route(actual, variant)  # to know whether this run can touch graph memory at all
        clock = self._run_clock
        clock[0] += 1
        eager_before = self._store.eager_fallbacks
        try:
            out = self._run(actual, context, inputs, variant)
        except Exception as exc:
            if isinstance(exc, InputError) or (route.entry is None and route.pending is None):
                clock[0] -= 1  # refused before anything ran, or refused by the eager step: nothing was overwritten
            raise
        if self._store.eager_fallbacks != eager_before:
            return out
        return checked(out, clock[0], clock)

    def _miss(self, actual: BatchDescriptor, inputs: Mapping[str, torch.Tensor], context: Any, reason: str | None) -> Any:
        self._store.count_miss(actual, reason)
        if reason in _WARN_ONCE and reason not in self._warned:
            self._warned.add(reason)
            self._warn_miss(actual, reason)
        if self._miss_observed:
            self.plugins.notify("cgregistry_miss", registry=self, actual=actual)
        return self._eager(actual, inputs, context)

    def _warn_miss(self, actual: BatchDescriptor, reason: str) -> None:
        """The first miss of a kind an engine should not meet in steady serving (shown once per registry)."""
        if reason == "no_graphs":
            what = (
                f"run({actual}) with no graph captured or planned (before any capture, after clear() or the release "
                "of every key, or an empty plan): every batch runs eagerly until reg.capture(plan)"
            )
        else:
            why = self._routes.too_large(actual) or "another rank's batch does not fit a static input"
            what = f"{actual} runs eagerly: {why}; enlarge that StaticInput to serve such batches"
        warnings.warn(
            f"cgregistry: registry {self.name!r}: {what} (shown once; stats().misses_by_reason counts every such miss)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _eager(self, actual: BatchDescriptor, inputs: Mapping[str, torch.Tensor], context: Any = None) -> Any:
        store = self._store
        store.eager_fallbacks += 1
        store.eager_tokens += actual.num_tokens
        token = runtime.batch.set(BreakContext(actual, None, context))
        try:
            return self._step(actual, **inputs)
        except Exception:
            store.bad_batches += 1  # the step itself refused this batch
            raise
        finally:
            runtime.batch.reset(token)

    def _replay_failed(self, entry: Entry, error: Exception, actual: BatchDescriptor, inputs: Mapping[str, torch.Tensor], context: Any) -> Any:
        """A replay raised: eager, the oracle, tells a bad batch from a broken entry.

        If the step raises on this batch eagerly too, the batch is at fault (an out-of-range
        token id, say): its error goes to the caller and the entry stays.  If eager succeeds,
        the entry is broken: it is removed, and the eager result is returned.
        """
        out = self._eager(actual, inputs, context)  # raises (and counts) when the batch is at fault
        self._store.count_miss(actual, "failed")  # the step ran eagerly: a miss, for the broken entry
        self._store.fail(entry, error)
        self._routes.rebuild(self._store.pairs())
        warnings.warn(
            f"cgregistry: replay of {entry.key} [{entry.strategy}] raised {type(error).__name__}: {error}, while the "
            "same batch ran eagerly; the entry was removed and the step's eager result returned",
            RuntimeWarning,
            stacklevel=4,
        )
        self.plugins.notify("cgregistry_entry_failed", registry=self, key=entry.key, strategy=entry.strategy, error=error)
        return out

    def _bad_names(self, inputs: Mapping[str, Any]) -> InputError:
        missing = sorted(self._input_names - inputs.keys())
        extra = sorted(inputs.keys() - self._input_names)
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"unexpected {extra}")
        return InputError(f"run() inputs do not match the static inputs: {'; '.join(parts)}; expected {sorted(self._input_names)}")

    # ------------------------------------------------------------------ release

    def release(self, key: BatchDescriptor, strategy: str | None = None) -> int:
        """Remove the entries captured for ``key`` (under ``strategy``, or any); return how many.

        The graph objects go at once.  Their pool memory stays with the pool while
        other entries share it, and goes back to the allocator when the last entry
        is released (``clear()``); a later capture of the key works as before.
        """
        if not isinstance(key, BatchDescriptor):
            raise TypeError(f"release() needs a BatchDescriptor, got {key!r}")
        self._install_finished()
        queued = [p for p in self.capturing() if p[0] == key and (strategy is None or p[1] == strategy)]
        if queued:  # not captured yet: dropped from the queue (one in flight is discarded when it finishes)
            self._worker.discard(queued)  # type: ignore[union-attr]
            self._install_finished()
            self._routes.capturing = tuple(self._worker.queued())  # type: ignore[union-attr]
            if not any(p[0] == key and (strategy is None or p[1] == strategy) for p in self._store.pairs()):
                self._routes.rebuild(self._store.pairs())
                return len(queued)
        removed, count = self._store.release(key, strategy)
        self._after_release(removed)
        return count + len(queued)

    def clear(self) -> int:
        """Remove every entry and pending key; return how many.  The pool goes back to the
        allocator (and to the driver on ``torch.cuda.empty_cache()``); counters are kept.
        Background captures queued are dropped (the one in flight is waited for, then discarded)."""
        self._refuse_on_capture_thread("clear()")
        self._install_finished()
        worker = self._background
        dropped = 0
        self._refit_running = False  # a refit queued or running is dropped with the rest
        if worker is not None:
            dropped = len(self.capturing())
            worker.cancel()
            worker.wait()
            worker.ready.clear()
            self._routes.capturing = ()
            self._background = worker if self._adapt is not None else None  # adaptation keeps observing
        removed, count = self._store.clear()
        self._capture_context, self._state_ok = None, _always  # the next capture request records them anew
        count += dropped
        self._after_release(removed)
        return count

    def _after_release(self, removed: list[Entry]) -> None:
        for entry in removed:
            self.plugins.notify(
                "cgregistry_released", registry=self, key=entry.key, strategy=entry.strategy, memory_bytes=entry.memory_bytes
            )
        self._routes.rebuild(self._store.pairs())
        if not self._store.entries:
            self._capturer.new_pool()  # drop the handle too: nothing holds the old pool now
            if self.debug:
                self._addresses.rebase()
        gc.collect()  # a graph in a reference cycle would keep the pool alive

    def watch(self, named: Iterable[tuple[str, torch.Tensor]] | torch.nn.Module, prefix: str = "") -> None:
        """Tensors captured graphs read whose address debug mode checks before each replay: ``(name, tensor)``
        pairs, or a module (every parameter and buffer, looked up by name, so a replaced one is caught too).
        Static inputs are always checked, and so is the step itself when it is a module or a module's method."""
        self._addresses.watch(named, prefix)

    def failures(self) -> dict[Pair, BaseException]:
        """Entries removed because their replay raised where eager did not, and lazy keys whose capture
        failed, with the error (a new capture may replace them)."""
        return dict(self._store.failures)

    # ------------------------------------------------------------------ inspection

    def match(self, actual: BatchDescriptor, *, group: Any = None, exclude: Any = None) -> Match | None:
        """The key, strategy and padding ``run`` would use for ``actual`` (None: eager).

        With ``group``, the match for the descriptor every rank's batch fits in (a
        collective: every rank must call it); its padding is relative to that descriptor.
        ``exclude`` as for ``run``.
        """
        skip = NO_EXCLUSION if exclude is None else self._exclusion(exclude)
        if group is not None:
            actual = agree(actual, group)
        variant = Variant(None, skip) if skip else None
        try:
            route = self._routes.cache.get(actual) if variant is None else self._routes.variant_cache.get((actual, variant))
        except TypeError:  # unhashable: not a descriptor
            raise not_a_descriptor(actual) from None
        if route is None:
            route = self._routes.route(actual, variant)
        return route.match

    def explain(self, actual: BatchDescriptor, *, exclude: Any = None) -> Explanation:
        """Every captured key and why it won or lost for ``actual`` (``exclude`` as for ``run``): excluded keys
        and keys over the padding cap are listed with their reason; ``str()`` gives a table."""
        if not isinstance(actual, BatchDescriptor):
            raise not_a_descriptor(actual)
        return self._routes.explain(actual, NO_EXCLUSION if exclude is None else self._exclusion(exclude))

    def entries(self, **filters: Any) -> list[EntryInfo]:
        """Captured entries as frozen records, largest first.

        Filters (all optional): ``strategy``, ``uniform``, ``spec_depth``,
        ``num_active_loras``, ``used`` (replayed at least once); ``sort`` is one of
        key, replays, padding, memory, capture, recent.
        """
        return filter_entries((self._info(e) for e in self._store.entries.values()), **filters)

    def _info(self, entry: Entry) -> EntryInfo:
        graph = entry.graph
        return EntryInfo(
            entry.key, entry.strategy, self.backend.name, entry.capture_seconds, entry.memory_bytes,
            entry.replays, entry.padded_tokens, entry.last_step,
            segments=getattr(graph, "num_segments", None), breaks=getattr(graph, "breaks", None),
        )

    def pending(self) -> list[Pair]:
        """Keys of lazy plans not captured yet (evicted entries return here)."""
        return list(self._store.pending)

    def __len__(self) -> int:
        return len(self._store.entries)

    def memory_bytes(self) -> int:
        """Measured memory of all live captures (pool growth on cuda, held tensors on cpu)."""
        return self._store.memory_bytes()

    def stats(self) -> Stats:
        """Counters since construction or the last ``reset_stats`` (entries removed since keep counting)."""
        return self._store.stats()

    def reset_stats(self) -> None:
        """Zero every counter (entries stay captured)."""
        self._store.reset_counters()

    def snapshot(self) -> dict[str, Any]:
        """Entries, counters and pending keys as a JSON-serialisable dict (``cgregistry.inspection``)."""
        return Snapshot(
            name=self.name,
            backend=self.backend.name,
            device=str(self.device),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            preference=tuple(self._routes.matcher.preference),
            entries=tuple(self.entries()),
            stats=self.stats(),
            memory_bytes=self.memory_bytes(),
            pending=tuple(self._store.pending),
            failures={f"{k} [{s}]": f"{type(e).__name__}: {e}" for (k, s), e in self._store.failures.items()},
            max_padding_tokens=self._routes.cap.max_tokens,
            max_padding_ratio=self._routes.cap.max_ratio,
            capturing=tuple(self.capturing()),
            plan_changes=tuple(str(c) for c in list(self.plan_changes)[-64:]),
        ).to_dict()

    def table(self, *, used_only: bool = False, sort: str = "key") -> str:
        """Entries as a text table with a summary line."""
        lines = entries_table(self.entries(used=True if used_only else None, sort=sort))
        lines.append(stats_line(self.stats(), len(self), self.backend.name, self.memory_bytes()))
        return "\n".join(lines)


@attrs.frozen(slots=True)
class CaptureContext:
    """What every capture of a registry runs under, whichever path captures: the payload eager breaks see
    (``capture(context=...)``) and the serving thread's state."""

    payload: Any
    state: ServingState


def _always() -> bool:
    return True


def _background_order(pairs: list[Pair]) -> list[Pair]:
    """Capture order beside a serving thread: the largest key of each kind first, so that every batch a kind
    can serve gets a graph soon (padded, but a padded replay beats an eager step), then the others from the
    smallest up, so the padding of the small, frequent batches falls first."""

    def size(pair: Pair) -> tuple[int, int]:
        return (pair[0].num_tokens, pair[0].num_reqs or 0)

    largest: dict[tuple, Pair] = {}
    for pair in pairs:
        key, strategy = pair
        kind = (strategy, key.uniform, key.spec_depth, key.num_active_loras)
        if kind not in largest or size(pair) > size(largest[kind]):
            largest[kind] = pair
    first = sorted(largest.values(), key=size)
    chosen = set(first)
    return first + sorted((p for p in pairs if p not in chosen), key=size)


_RANKS_WOULD_DIVERGE = ", and without adaptation (each rank would refit to its own traffic)"


def _refuse_background_with_collectives(what: str = "capture(background=True)", more: str = "") -> None:
    """Background capture runs the step's warm-up on another thread: its collectives would interleave with the serving
    thread's.  Adaptation captures in the background, and each rank would refit to its own traffic (different keys)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"{what} with torch.distributed initialized (world size "
            f"{dist.get_world_size()}): the capture thread runs the step's warm-up, and its collectives would "
            f"interleave with the serving thread's on the same communicator (ranks would hang); capture in the foreground{more}"
        )


def _next_harvest(adapt: Adaptation, traffic: TrafficHistogram, busy: bool) -> int:
    """Steps until the next harvest: when a refit next falls due (every_steps since the last one, min_steps in all),
    at most 4096 (the histogram stays small); while a refit runs, every_steps (capped) again."""
    if busy:
        return min(adapt.every_steps, 4096)
    return max(1, min(4096, max(adapt.every_steps - traffic.fresh, adapt.min_steps - traffic.observed)))


def _check_budget(value: object) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"memory_budget must be a byte count >= 0 or None, got {value!r}")


def _plan_entry(e: object) -> PlanEntry:
    if isinstance(e, PlanEntry):
        return e
    if isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], BatchDescriptor) and isinstance(e[1], str):
        return PlanEntry(e[0], e[1])
    raise TypeError(f"a plan holds PlanEntry or (BatchDescriptor, strategy name) pairs, got {e!r}")


def _progress(items: list[Pair], enabled: bool) -> Iterable[Pair]:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc="capturing graphs", unit="graph", leave=False)
