"""The server: the hot path, ``run()`` and ``match()``, written once; and the thread that owns a registry.

One ``run()``: the owner check, the route of the batch's shape (one dict lookup once seen), every input checked before
anything is touched, then the graph (a lazy key captured first) or the eager step; state check, copy in, replay,
counters and outputs in one function body (on a seen shape with no inputs, no Python function runs between the owner
check and the replay).  Debug mode is a subclass chosen at construction that wraps ``run``, so the plain path pays
nothing for it; work between steps (handed calls, adaptation's count, pending capture pieces) is one flag test when
there is none.

A registry's owner is the thread that serves it: the one that made it, or the last that called ``adopt()`` (one whose
owner ended goes to the next thread that uses it).  Another thread's call is refused with ``OwnerThreadError`` naming
the owner, or handed to the owner's next ``run()`` through ``call_on_owner``: nothing that changes graphs runs beside a
replay.
"""

from __future__ import annotations

import collections
import threading
import time
from _thread import get_ident
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from cgregistry.contracts import runtime
from cgregistry.capture.refit import Adapter
from cgregistry.capture.queue import PendingCaptures
from cgregistry.capture.job import CaptureJob
from cgregistry.store.catalog import NO_EXCLUSION, Catalog, Entry, Route, Variant, check_agreed, not_a_descriptor
from cgregistry.store.debug import Clock, Runs, checked, check_addresses, plain
from cgregistry.weights.watch import WeightWatch
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.distributed import agree
from cgregistry.errors import ConcurrentRunError, InputError, OwnerThreadError
from cgregistry.hooks.events import Events
from cgregistry.key.matcher import Match, excluded
from cgregistry.contracts.runtime import BreakContext
from cgregistry.messages import warn

__all__ = ["ConcurrentRunError", "DebugServer", "Owner", "OwnerThreadError", "Server"]

_WARN_ONCE = ("no_graphs", "above_capacity", "no_request_count")  # misses that mean the engine is set up wrong, warned about once
# Misses of batches not marked uniform that uniform keys would serve, before the one warning about them.
UNIFORM_HINT_AFTER = 16
# Misses above the largest key of their form before the one warning, if they are at least half of the steps so far.
ABOVE_LARGEST_HINT_AFTER = 16


class Owner:
    """The thread a registry belongs to, and the calls other threads hand it (``call_on_owner``)."""

    __slots__ = ("ident", "busy", "_thread", "handed", "_registry", "_draining")

    def __init__(self, registry: str) -> None:
        self.ident = 0  # the owner thread's identity
        self._thread = threading.current_thread()
        self.take()  # the thread that makes the registry, until another adopts it
        # A run() or a call that changes graphs is in progress (on the owner thread: no other thread gets that far); a
        # run() or a change asked for meanwhile (from the step or a hook) is refused.
        self.busy = False
        self.handed: collections.deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = collections.deque()
        self._registry = registry
        self._draining = False  # handed calls are running: one they hand over waits for the next step

    @property
    def name(self) -> str:
        """The owner thread's name."""
        return self._live().name

    def _live(self) -> threading.Thread:
        """The owner thread: the one recorded, or, once it ended, a running thread that has its identity now (the
        system hands a finished thread's identity to a later one, which then passes the owner test as the owner)."""
        if not self._thread.is_alive():
            successor = next((t for t in threading.enumerate() if t.ident == self.ident), None)
            if successor is not None:
                self._thread = successor
        return self._thread

    def check(self, call: str) -> None:
        """The calling thread may make ``call``: it owns the registry, or takes it over from an owner thread that has
        ended; any other thread is refused with ``OwnerThreadError``."""
        if self.ident == get_ident():
            return
        if self._live().is_alive():
            raise self.refusal(call)
        self.take()

    def elsewhere(self) -> bool:
        """Whether another thread, still running, owns the registry."""
        return self.ident != get_ident() and self._live().is_alive()

    def take(self) -> None:
        """The calling thread owns the registry from now on."""
        self._thread = threading.current_thread()
        self.ident = get_ident()

    def refusal(self, call: str) -> OwnerThreadError:
        return OwnerThreadError(
            f"{call} on registry {self._registry!r} from thread {threading.current_thread().name!r}, while the registry "
            f"belongs to thread {self.name!r}, which serves it (the thread that made it, or the last that called "
            "reg.adopt()): its steps and every change to its graphs happen there, never beside a replay. "
            "Hand the call over with reg.call_on_owner(fn, *args) (it runs at the owner's next run() or "
            "capture_pending(), and returns a Future), or call reg.adopt() on this thread once the owner has stopped "
            "serving")

    def hand(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[Any]:
        """``fn(*args, **kwargs)`` to run on the owner thread, before its next step; its future.  Called on the owner
        thread between calls, or once the owner thread has ended (the caller takes the registry), it runs now."""
        future: Future[Any] = Future()
        self.handed.append((future, fn, args, kwargs))
        if not self.busy and not self._draining and not self.elsewhere():
            self.take()
            self.run_handed()
        return future

    def run_handed(self) -> None:
        """The calls handed over before this call, in order, on the owner thread: each one's result or error goes to
        its future (an interrupt also goes on to the caller); one they hand over meanwhile waits for the next step."""
        draining, self._draining = self._draining, True
        try:
            for _ in range(len(self.handed)):
                if not self.handed:  # a handed call ran the rest (its capture_pending(), say)
                    break
                future, fn, args, kwargs = self.handed.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
                else:
                    future.set_result(result)
        finally:
            self._draining = draining

    def cancel_handed(self) -> None:
        """The registry is gone: the calls still handed over never run (their futures are cancelled)."""
        while self.handed:
            self.handed.popleft()[0].cancel()


class Server:
    """Serves batches from a catalog's routes: replay, or the eager step."""

    def __init__(
        self, step: Callable[..., Any], catalog: Catalog, job: CaptureJob, pending: PendingCaptures,
        adapter: Adapter | None, events: Events, input_names: frozenset[str], name: str, owner: Owner,
    ) -> None:
        self._step = step
        self._catalog = catalog
        self._routes = catalog.routes
        self._cache = catalog.routes.cache  # the hot path's first lookup (cleared in place, never replaced)
        self._variants = catalog.routes.variant_cache
        self._counters = catalog.counters
        self._job = job
        self._state = job.state_test  # changed in place by the capture job: its parts read as one tuple below
        self._weights = job.watch  # its generation moves when a watched tensor may have moved
        self._pending = pending
        self._adapter = adapter
        self._events = events
        self._input_names = input_names
        self._name = name
        self._owner = owner
        self._exclusions: dict[Any, frozenset[str]] = {}  # exclude= values already checked, to their strategy sets
        self._warned: set[str] = set()  # miss reasons already warned about
        self._unmarked = 0  # misses of batches that uniform keys would serve had they been marked uniform
        self._above = 0  # misses of batches larger than every key of their form

    # ---------------------------------------------------------------- run

    def guard(self, call: str) -> None:
        """``call`` changes graphs or runs the step: only on the owner thread, and never from inside a ``run()``."""
        self._owner.check(call)
        if self._owner.busy:
            raise ConcurrentRunError(
                f"{call} on registry {self._name!r} from inside one of its calls (a run(), or a capture: from the step or "
                "a hook): the call in progress is using the static buffers and graphs; call it between steps")

    def run(
        self, actual: BatchDescriptor, /, *, context: Any = None, group: Any = None, exclude: Any = None, **inputs: torch.Tensor
    ) -> Any:
        """``GraphRegistry.run``: a registry hands this method out as its own ``run`` (no call in between)."""
        owner = self._owner
        if owner.busy or get_ident() != owner.ident:
            self._enter()
        try:
            owner.busy = True  # set inside the try: an interrupt anywhere after the check leaves it cleared
            if self._adapter is not None or self._pending.busy or owner.handed:
                inputs = self._between_steps(actual, inputs)
            if group is None and exclude is None:
                variant = None
                try:
                    route = self._cache.get(actual)
                except TypeError:  # unhashable: not a descriptor
                    raise not_a_descriptor(actual) from None
                if route is None:
                    route = self._routes.route(actual)
            else:
                variant = self._variant(actual, group, exclude)
                route = self._route(actual, variant)
            # Every input is checked before anything is touched, on the graph and the eager path alike.
            copies = route.copies
            if inputs or copies:
                if len(inputs) != len(copies):
                    raise self._bad_names(inputs)
                try:
                    for buf, rows in copies:
                        buf.check(inputs[buf.name], rows)
                except KeyError:
                    raise self._bad_names(inputs) from None
            entry = route.entry
            if entry is None:
                if route.pending is not None:
                    route, inputs = self._capture_lazily(actual, route, variant, inputs)
                    entry, copies = route.entry, route.copies
                if entry is None:
                    return self._miss(actual, inputs, context, route.miss_reason, route.hint)
            guard, flag, flag_was = self._state.parts  # a graph computes what it computed at capture: refuse another autocast or dtype
            if not (guard() and flag() == flag_was):
                self._job.refuse_other_state()
            if entry.generation != self._weights.generation:  # a watched tensor may have moved since its capture
                self._job.check_weights(entry)
            if copies:
                route.stage(inputs)
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
                # The eager answer reads the inputs as staged: a partial replay may have written over what the caller
                # handed in (an earlier run's output, in the pool the graphs share); the static inputs it only reads.
                staged = {buf.name: buf.view(rows).clone() for buf, rows in copies} if copies else inputs
                return self._replay_failed(entry, exc, actual, staged, context)
            entry.replays += 1
            entry.padded_tokens += route.pad_tokens
            entry.graph_tokens += route.real_tokens
            entry.last_step = next(self._counters.clock)
            out = route.single_output
            if out is not None:
                return out.detach()  # a fresh view per run: a caller's unsqueeze_() or t_() stays with the caller
            return entry.slicer.sliced(route.out_rows)
        finally:
            owner.busy = False

    def _enter(self) -> None:
        """The hot path's one test failed: a ``run()`` from inside one in progress (the step or a hook called back) is
        refused; one from a thread that does not own the registry is refused, or takes an unowned registry."""
        if self._owner.busy and get_ident() == self._owner.ident:
            raise ConcurrentRunError(
                f"run() on registry {self._name!r} called from inside a run() of the same registry, or one of its "
                "captures (from the step or a hook): the call in progress is using the static buffers and graph "
                "outputs, so it is refused; a step or a hook must not call run() back, have the engine's loop make the "
                "next call")
        self._owner.check("run()")

    def _between_steps(self, actual: BatchDescriptor, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Before a step: the calls other threads handed over, adaptation counting the step, and pieces of the pending
        captures within the budget (the key this batch needs first); the inputs to serve the step with."""
        owner, pending = self._owner, self._pending
        pieces = pending.busy and pending.budget != 0
        if owner.handed or pieces:
            # a handed call or a piece may reset the static buffers and record into the pool, which an input may alias
            # (an earlier output, a view of a static buffer): the inputs are read as they are now
            inputs = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
        if owner.handed:  # between steps: they may change graphs (this step's route is looked up after them)
            owner.busy = False
            try:
                owner.run_handed()
            finally:
                owner.busy = True
            self._touched()
        if self._adapter is not None and type(actual) is BatchDescriptor:
            self._adapter.observe(actual)
        if pieces:
            if type(actual) is BatchDescriptor:
                route = self._cache.get(actual) or self._routes.route(actual)
                if route.entry is None and route.miss_reason == "capturing":
                    pending.to_front(actual)
            if pending.before_step():
                self._touched()
        return inputs

    def _touched(self) -> None:
        """The static buffers were written outside a replay (a capture reset them), or graphs changed: earlier outputs
        may be overwritten (debug mode's stale-output check hears of it)."""

    def touched(self) -> None:
        """A call between steps changed graphs or the static buffers (a capture, a release): ``_touched``."""
        self._touched()

    def _capture_lazily(
        self, actual: BatchDescriptor, route: Route, variant: Variant | None, inputs: dict[str, torch.Tensor]
    ) -> tuple[Route, dict[str, torch.Tensor]]:
        """No live graph serves the batch and its best key is lazy: capture it now, on this thread, and hand back the
        route to serve with (a failed capture drops its key, and the next best may be lazy too) and the inputs."""
        if not self._state():
            self._job.refuse_other_state()
        inputs = {name: value.clone() for name, value in inputs.items()}  # capture resets the static buffers (and may
        while route.pending is not None:  # reuse pool memory) an input can alias
            self._touched()
            self._job.capture_lazily(route.pending)
            route = self._route(actual, variant)
        return route, inputs

    def _miss(
        self, actual: BatchDescriptor, inputs: Mapping[str, torch.Tensor], context: Any, reason: str | None, hint: str | None = None,
    ) -> Any:
        self._counters.count_miss(actual, reason)
        if reason in _WARN_ONCE and reason not in self._warned:
            self._warned.add(reason)  # type: ignore[arg-type]
            self._warn_miss(actual, reason)  # type: ignore[arg-type]
        if reason == "above_largest_key":
            self._above += 1
            if self._above == ABOVE_LARGEST_HINT_AFTER:
                self._warn_above_largest(actual)
        if hint is not None:
            self._unmarked += 1
            if self._unmarked == UNIFORM_HINT_AFTER:
                warn(
                    f"cgregistry: registry {self._name!r}: {UNIFORM_HINT_AFTER} batches ran eagerly as mixed batches while "
                    f"uniform keys would serve them, such as {hint} (shown once; reg.explain(batch) says it for each)")
        self._events.miss(actual)
        started = time.perf_counter()
        out = self._eager(actual, inputs, context)
        self._pending.saw_eager(time.perf_counter() - started)  # what a step may spend on pending captures
        return out

    def _warn_above_largest(self, actual: BatchDescriptor) -> None:
        """Once: batches larger than every key of their form are most of the steps so far (the plan's largest key is
        too small for this traffic)."""
        replays = self._catalog.stats().hits  # removed and recaptured entries' replays included
        if self._above * 2 < self._above + replays:
            return
        warn(
            f"cgregistry: registry {self._name!r}: {self._above} of the {self._above + replays} graph-eligible steps so "
            f"far ran eagerly because no key of their form is that large (such as {actual}); raise the plan's "
            "max_capture_size (CapturePlan.uncovered() lists the ranges left out; shown once; "
            "stats().misses_by_reason['above_largest_key'] counts every such miss)"
        )

    def _warn_miss(self, actual: BatchDescriptor, reason: str) -> None:
        """The first miss of a sort an engine should not meet in steady serving (shown once per registry)."""
        if reason == "no_graphs":
            what = (
                f"run({actual}) with no graph captured or planned (before any capture, after clear() or the release "
                "of every key, or an empty plan): every batch runs eagerly until reg.capture(plan)"
            )
        elif reason == "no_request_count":
            what = (f"{actual} runs eagerly: every key of its form needs a request count, and the batch gives none; "
                    "pass num_reqs to its BatchDescriptor (BatchDescriptor.from_query_lens counts them)")
        else:
            why = self._routes.too_large(actual) or "another rank's batch does not fit a static input"
            what = f"{actual} runs eagerly: {why}; enlarge that StaticInput to serve such batches"
        warn(
            f"cgregistry: registry {self._name!r}: {what} (shown once; stats().misses_by_reason counts every such miss)")

    def _eager(self, actual: BatchDescriptor, inputs: Mapping[str, torch.Tensor], context: Any = None) -> Any:
        counters = self._counters
        counters.eager_fallbacks += 1
        counters.eager_tokens += actual.num_tokens
        token = runtime.batch.set(BreakContext(actual, None, context))
        try:
            return self._step(actual, **inputs)
        except Exception:
            counters.bad_batches += 1  # the step itself refused this batch
            raise
        finally:
            runtime.batch.reset(token)

    def _replay_failed(self, entry: Entry, error: Exception, actual: BatchDescriptor, inputs: Mapping[str, torch.Tensor], context: Any) -> Any:
        """A replay raised: eager, the oracle, tells a bad batch from a broken entry.  If the step raises on this batch
        eagerly too (an out-of-range token id, say), its error goes to the caller and the entry stays; if eager
        succeeds, the entry is removed and the eager result returned."""
        out = self._eager(actual, inputs, context)  # raises (and counts) when the batch is at fault
        self._counters.count_miss(actual, "failed")  # the step ran eagerly: a miss, for the broken entry
        self._catalog.fail_replay(entry, error)
        warn(
            f"cgregistry: replay of {entry.key} [{entry.strategy}] raised {type(error).__name__}: {error}, while the "
            "same batch ran eagerly; the entry was removed and the step's eager result returned")
        self._events.entry_failed(entry, error)
        return out

    def _bad_names(self, inputs: Mapping[str, Any]) -> InputError:
        missing, extra = sorted(self._input_names - inputs.keys()), sorted(inputs.keys() - self._input_names)
        parts = [f"{what} {names}" for what, names in (("missing", missing), ("unexpected", extra)) if names]
        return InputError(f"run() inputs do not match the static inputs: {'; '.join(parts)}; expected {sorted(self._input_names)}")

    # ---------------------------------------------------------------- routes of other runs, and match

    def match(self, actual: BatchDescriptor, group: Any, exclude: Any) -> Match | None:
        """The match ``run`` would use for ``actual``; with ``group``, for the batch every rank's fits in (padding relative to it)."""
        skip = self.exclusion(exclude)
        if group is not None:
            agreed = agree(actual, group)
            check_agreed(agreed, actual)
            actual = agreed
        return self._route(actual, Variant(None, skip) if skip else None).match

    def exclusion(self, exclude: Any) -> frozenset[str]:
        """``exclude=`` checked once per distinct value: a collection of registered strategy names (None: none)."""
        if exclude is None:
            return NO_EXCLUSION
        try:
            return self._exclusions[exclude]
        except (KeyError, TypeError):  # not seen yet, or unhashable (a list): check it
            pass
        strategies = self._job.strategy_names()
        if not isinstance(exclude, (tuple, list, set, frozenset)):
            raise TypeError(
                f"exclude must be a tuple, list or set of strategy names, e.g. exclude=('full',); got {exclude!r}"
                f" ({type(exclude).__name__}); strategies: {', '.join(strategies)}"
            )
        names = excluded(exclude)
        unknown = sorted(n for n in names if n not in strategies)
        if unknown:
            raise ValueError(
                f"exclude={exclude!r} names {', '.join(map(repr, unknown))}, not a registered strategy; "
                f"strategies: {', '.join(strategies)}"
            )
        if isinstance(exclude, (tuple, frozenset)):
            if len(self._exclusions) >= 256:
                self._exclusions.clear()
            self._exclusions[exclude] = names
        return names

    def _variant(self, actual: BatchDescriptor, group: Any, exclude: Any) -> Variant | None:
        """What makes a run other than a plain ``run(actual)`` (None when nothing does: ``exclude=()``)."""
        skip = self.exclusion(exclude)
        if group is None and not skip:
            return None
        return Variant(None if group is None else agree(actual, group), skip)

    def _route(self, actual: BatchDescriptor, variant: Variant | None) -> Route:
        try:
            route = self._cache.get(actual) if variant is None else self._variants.get((actual, variant))
        except TypeError:  # unhashable: not a descriptor
            raise not_a_descriptor(actual) from None
        return route if route is not None else self._routes.route(actual, variant)


class DebugServer(Server):
    """``Server`` with debug mode's checks, wrapping ``Server.run``: moved tensors before a replay, stale outputs after.
    An output passed back as the next input is read before this run overwrites it; a run refused for its batch, inputs,
    serving state or moved weights overwrites nothing, nor does a miss whose eager step refuses the batch; eager outputs
    are the caller's own.  A refused run counts as touching the static buffers when a capture piece, a lazy capture or a
    failed replay ran first, or an interrupt came."""

    def __init__(self, *args: Any, watch: WeightWatch, clock: Clock | None = None) -> None:
        super().__init__(*args)
        self._watch = watch
        # For the stale-output check: its runs on the clock of its graph pool's debug registries (its own if none given).
        self._runs = Runs(clock if clock is not None else Clock(), self._name)
        self._touches = 0  # how often runs wrote the static buffers outside a replay (only grows)

    def run(
        self, actual: BatchDescriptor, /, *, context: Any = None, group: Any = None, exclude: Any = None, **inputs: torch.Tensor
    ) -> Any:
        if self._owner.busy or get_ident() != self._owner.ident:
            self._enter()  # another thread's call is refused before it reads anything
        if self._catalog.entries:  # with no graph, nothing reads the watched addresses yet
            if not self._state():  # the serving state first: a model rebound in a context variable is named so
                self._job.refuse_other_state()
            check_addresses(self._watch)
        inputs = {name: plain(value) for name, value in inputs.items()}  # outputs of earlier runs: read while still fresh
        eager_before = self._counters.eager_fallbacks
        runs = self._runs
        touches = self._touches
        try:
            out = super().run(actual, context=context, group=group, exclude=exclude, **inputs)
        except BaseException as exc:
            if self._touches != touches or not isinstance(exc, Exception):
                runs.ran()  # the static buffers may have been written before the refusal: earlier outputs are stale
            raise
        if self._counters.eager_fallbacks != eager_before:  # an eager step: graph memory untouched, unless a capture
            runs.ran(replayed=self._touches != touches)  # or a failed replay ran first
            return out
        runs.ran()
        return checked(out, runs)

    def _touched(self) -> None:
        self._touches += 1

    def touched(self) -> None:
        self._touches += 1
        self._runs.changed()  # between steps: the outputs of the runs so far are stale from now on

    def _replay_failed(self, *args: Any) -> Any:
        self._touched()  # the inputs were copied in and the graph ran
        return super()._replay_failed(*args)


# A registry hands out its server's ``run`` as its own: argument errors name the method the engine called.
Server.run.__qualname__ = DebugServer.run.__qualname__ = "GraphRegistry.run"
