"""The server: the hot path, ``run()`` and ``match()``, written once.

One ``run()``: the route of the batch's shape (one dict lookup once the shape was seen), every
input checked before anything is touched, then the graph (a lazy key captured first, or the key
being captured in the background waited for) or the eager step; the state check, copy in,
replay, counters, outputs, in one function body (on a seen shape with no inputs, no Python
function runs between taking the turn and the replay).  Debug mode is a subclass chosen at
construction (the way pluggy swaps its call executor) that wraps ``run``, so the plain path
pays nothing for it.  Work beside the step (installing background captures, counting steps
for adaptation) is one flag test when there is none.
"""

from __future__ import annotations

import _thread
import contextlib
import inspect
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from cgregistry.state import runtime
from cgregistry.capture.refit import Adapter
from cgregistry.capture.background import BackgroundCapture
from cgregistry.capture.job import CaptureJob
from cgregistry.store.catalog import NO_EXCLUSION, Catalog, Entry, Route, Variant, not_a_descriptor
from cgregistry.state.debug import checked, check_addresses, plain
from cgregistry.state.weights import WeightWatch
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.distributed import agree
from cgregistry.errors import ConcurrentRunError, InputError
from cgregistry.hooks.events import Events
from cgregistry.key.matcher import Match, excluded
from cgregistry.state.runtime import BreakContext
from cgregistry.warn import warn

__all__ = ["ConcurrentRunError", "DebugServer", "Server"]

_WARN_ONCE = ("no_graphs", "above_capacity", "no_request_count")  # misses that mean the engine is set up wrong, warned about once
# Misses of batches not marked uniform that uniform keys would serve, before the one warning about them.
UNIFORM_HINT_AFTER = 16
# Misses above the largest key of their kind before the one warning, if they are at least half of the steps so far.
ABOVE_LARGEST_HINT_AFTER = 16


class Server:
    """Serves batches from a catalog's routes: replay, or the eager step."""

    def __init__(
        self, step: Callable[..., Any], catalog: Catalog, job: CaptureJob, background: BackgroundCapture,
        adapter: Adapter | None, events: Events, input_names: frozenset[str], name: str,
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
        self._background = background
        self._adapter = adapter
        self._events = events
        self._input_names = input_names
        self._name = name
        # The one permission to serve: run() takes it with list.pop() and gives it back with append(), each one atomic
        # (the GIL, or the list's own lock without one), at half a lock's acquire and release.
        self._turn: list[None] = [None]
        self._take, self._give = self._turn.pop, self._turn.append
        background.serve_first(self._turn)  # the capture thread steps aside while a run() is in progress
        self._recovery = threading.Lock()  # one thread at a time decides whether a missing turn was lost
        self._pause: threading.Event | None = None  # set while refresh() holds the turn to change weights in place
        self._exclusions: dict[Any, frozenset[str]] = {}  # exclude= values already checked, to their strategy sets
        self._warned: set[str] = set()  # miss reasons already warned about
        self._unmarked = 0  # misses of batches that uniform keys would serve had they been marked uniform
        self._above = 0  # misses of batches larger than every key of their kind

    # ---------------------------------------------------------------- run

    def running(self) -> bool:
        """Whether a ``run()`` is in progress (a step or a hook calling back would wait for itself)."""
        return not self._turn

    def run(
        self, actual: BatchDescriptor, /, *, context: Any = None, group: Any = None, exclude: Any = None, **inputs: torch.Tensor
    ) -> Any:
        """``GraphRegistry.run``: a registry hands this method out as its own ``run`` (no call in between)."""
        try:
            self._take()
        except IndexError:  # another run() holds the turn, or an interrupt lost it: told apart off the hot path
            self._take_lost_turn()
        try:
            if self._adapter is not None or self._background.active:
                self._between_steps(actual)
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
                if route.pending is not None or route.miss_reason == "capturing":
                    route, inputs = self._graph_for(actual, route, variant, inputs)
                    entry, copies = route.entry, route.copies
                    for buf, rows in copies:  # a background entry's own inputs: checked (and their views made) too
                        buf.check(inputs[buf.name], rows)
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
            self._give(None)

    @contextlib.contextmanager
    def paused(self) -> Iterator[bool]:
        """Hold the turn while the weights the graphs read change in place: a ``run()`` on another thread waits for the
        end of it instead of replaying half-changed weights.  False, holding nothing, while a ``run()`` is in progress."""
        with self._recovery:
            try:
                self._take()
            except IndexError:
                yield False
                return
            self._pause = pause = threading.Event()
        try:
            yield True
        finally:
            with self._recovery:
                self._pause = None
                self._give(None)
            pause.set()

    def _take_lost_turn(self) -> None:
        """The turn was not there: wait while ``paused()`` holds it; refuse (``ConcurrentRunError``) while a ``run()`` of
        this server is in progress on any thread; with none, an asynchronous exception (a signal handler's
        ``KeyboardInterrupt``) landed between taking the turn and the ``try`` that gives it back, or inside that
        ``finally``: the turn is restored and taken."""
        while True:
            pause = self._pause
            if pause is not None:
                pause.wait()
                try:
                    self._take()
                    return
                except IndexError:
                    continue
            with self._recovery:
                if self._pause is not None:  # paused() began meanwhile: wait for it as above
                    continue
                if not self._turn and self._runs_in_progress() <= 1:  # ours, the refused one, is the only run() in progress
                    self._give(None)
                try:
                    self._take()
                    return
                except IndexError:
                    raise self._busy() from None

    def _runs_in_progress(self) -> int:
        """How many ``Server.run`` frames of this server are on any thread's stack (the caller's own included)."""
        code, count = Server.run.__code__, 0
        for frame in list(sys._current_frames().values()):
            while frame is not None:
                count += frame.f_code is code and frame.f_locals.get("self") is self
                frame = frame.f_back
        return count

    def _busy(self) -> ConcurrentRunError:
        """The refusal of a run() while another is in progress: from inside that run() on this thread (the step or a
        hook called back), or beside it on another thread.  Told apart here, off the hot path, by this thread's frames."""
        code = type(self).run.__code__  # Server.run, or the debug wrapper around it
        frame, runs = inspect.currentframe(), 0  # the refused run() is one frame of it; an outer one, another
        while frame is not None and runs < 2:
            runs += frame.f_code is code and frame.f_locals.get("self") is self
            frame = frame.f_back
        if runs == 2:
            return ConcurrentRunError(
                f"run() on registry {self._name!r} called from inside a run() of the same registry on the same thread "
                "(from the step or a hook): the outer run() is using the static buffers and graph outputs, so it is "
                "refused; a step or a hook must not call run() back, have the engine's loop make the next call"
            )
        return ConcurrentRunError(
            f"run() on registry {self._name!r} while another run() is in progress on another thread: a registry's static "
            "buffers and graph outputs serve one step at a time; give each thread its own registry or serialise the calls"
        )

    def _between_steps(self, actual: BatchDescriptor) -> None:
        """Before a step: finished background captures go live, and adaptation counts the step."""
        background = self._background
        background.refuse_on_capture_thread("run()")
        if self._adapter is not None and type(actual) is BatchDescriptor:
            self._adapter.observe(actual)
        if background.active:
            self._job.handover.arm()  # this run() ends the dropped graphs' outputs: their pools may be taken again
            background.runs += 1  # the capture thread stands aside for each run() anew
            background.serving_thread = threading.get_ident()
            background.install()
            background.pace()
            background.share()

    def _graph_for(
        self, actual: BatchDescriptor, route: Route, variant: Variant | None, inputs: dict[str, torch.Tensor]
    ) -> tuple[Route, dict[str, torch.Tensor]]:
        """No live graph serves the batch: capture its lazy key now, or wait for the key the capture thread is taking.

        The route handed back has an entry or a miss reason: a key the wait installed may have been evicted again in
        the same install (under a memory budget), and is then captured lazily like any evicted key."""
        self._background.waiting.append(None)  # a lazy capture or a wait: the capture thread must not step aside
        try:
            return self._find_graph(actual, route, variant, inputs)
        finally:
            self._background.waiting.pop()

    def _find_graph(
        self, actual: BatchDescriptor, route: Route, variant: Variant | None, inputs: dict[str, torch.Tensor]
    ) -> tuple[Route, dict[str, torch.Tensor]]:
        waited = copied = False
        while True:
            if route.pending is not None:
                if not self._state():
                    self._job.refuse_other_state()
                if not copied:  # capture resets the static buffers (and may reuse pool memory) an input can alias
                    inputs, copied = {name: value.clone() for name, value in inputs.items()}, True
                while route.pending is not None:  # a failed lazy capture drops its key: the next best may be lazy too
                    if self._background.busy:  # a capture in flight: the capture thread takes this key (no longer lazy)
                        self._background.submit([route.pending], self._job.current())
                    else:
                        self._capture_lazily(route.pending)
                    route = self._route(actual, variant)
            if waited or route.entry is not None or route.miss_reason != "capturing":
                return route, inputs
            waited = True
            target = actual if variant is None or variant.agreed is None else variant.agreed
            if not self._background.await_cover(target, NO_EXCLUSION if variant is None else variant.exclude):
                return route, inputs
            route = self._route(actual, variant)

    def _capture_lazily(self, key: Any) -> None:
        """Capture a lazy key now, on this thread (it resets the static buffers to their fills)."""
        self._job.capture_lazily(key)

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
        if self._background.active:  # what a step costs eagerly beside a capture: the price of waiting for one instead
            started = time.perf_counter()
            out = self._eager(actual, inputs, context)
            self._background.saw_eager(time.perf_counter() - started)
            return out
        return self._eager(actual, inputs, context)

    def _warn_above_largest(self, actual: BatchDescriptor) -> None:
        """Once: batches larger than every key of their kind are most of the steps so far (the plan's largest key is
        too small for this traffic)."""
        replays = self._catalog.stats().hits  # removed and recaptured entries' replays included
        if self._above * 2 < self._above + replays:
            return
        warn(
            f"cgregistry: registry {self._name!r}: {self._above} of the {self._above + replays} graph-eligible steps so "
            f"far ran eagerly because no key of their kind is that large (such as {actual}); raise the plan's "
            "max_capture_size (CapturePlan.uncovered() lists the ranges left out; shown once; "
            "stats().misses_by_reason['above_largest_key'] counts every such miss)"
        )

    def _warn_miss(self, actual: BatchDescriptor, reason: str) -> None:
        """The first miss of a kind an engine should not meet in steady serving (shown once per registry)."""
        if reason == "no_graphs":
            what = (
                f"run({actual}) with no graph captured or planned (before any capture, after clear() or the release "
                "of every key, or an empty plan): every batch runs eagerly until reg.capture(plan)"
            )
        elif reason == "no_request_count":
            what = (f"{actual} runs eagerly: every key of its kind needs a request count, and the batch gives none; "
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
        """A replay raised: eager, the oracle, tells a bad batch from a broken entry.

        If the step raises on this batch eagerly too, the batch is at fault (an out-of-range
        token id, say): its error goes to the caller and the entry stays.  If eager succeeds,
        the entry is broken: it is removed, and the eager result is returned.
        """
        out = self._eager(actual, inputs, context)  # raises (and counts) when the batch is at fault
        self._counters.count_miss(actual, "failed")  # the step ran eagerly: a miss, for the broken entry
        self._catalog.fail_replay(entry, error)
        warn(
            f"cgregistry: replay of {entry.key} [{entry.strategy}] raised {type(error).__name__}: {error}, while the "
            "same batch ran eagerly; the entry was removed and the step's eager result returned")
        self._events.entry_failed(entry, error)
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

    # ---------------------------------------------------------------- routes of other runs, and match

    def match(self, actual: BatchDescriptor, group: Any, exclude: Any) -> Match | None:
        """The match ``run`` would use for ``actual``; with ``group``, for the batch every rank's fits in (padding relative to it)."""
        skip = self.exclusion(exclude)
        if group is not None:
            actual = agree(actual, group)
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
    """``Server`` with debug mode's checks: moved tensors before a replay, stale outputs after.

    An output passed back as the next input is read before this run overwrites it; a run
    refused for its batch, its inputs, its serving state or moved weights overwrites nothing, nor does
    a miss whose eager step refuses the batch; eager outputs are the caller's own.  It wraps
    ``Server.run`` under a lock of its own (so the clock and the stamps of one run are not interleaved
    with another thread's), leaving the plain path free of debug checks, and learns whether a refused
    run touched the static buffers from the paths that may before raising: a lazy capture and a failed
    replay (an interrupt, which may come anywhere, counts as touching).
    """

    def __init__(self, *args: Any, watch: WeightWatch) -> None:
        super().__init__(*args)
        self._watch = watch
        self._clock = [0]  # run() count, for the stale-output check
        self._here = threading.local()  # .touches: how often this thread's runs wrote the static buffers (only grows)
        self._debug_lock = _thread.allocate_lock()

    def run(
        self, actual: BatchDescriptor, /, *, context: Any = None, group: Any = None, exclude: Any = None, **inputs: torch.Tensor
    ) -> Any:
        if not self._debug_lock.acquire(False):
            raise self._busy()
        try:
            if self._catalog.entries:  # with no graph, nothing reads the watched addresses yet
                if not self._state():  # the serving state first: a model rebound in a context variable is named so
                    self._job.refuse_other_state()
                check_addresses(self._watch)
            inputs = {name: plain(value) for name, value in inputs.items()}  # outputs of earlier runs: read while still fresh
            eager_before = self._counters.eager_fallbacks
            here, clock = self._here, self._clock
            touches = getattr(here, "touches", 0)
            try:
                out = super().run(actual, context=context, group=group, exclude=exclude, **inputs)
            except BaseException as exc:
                if getattr(here, "touches", 0) != touches or not isinstance(exc, Exception):
                    clock[0] += 1  # the static buffers may have been written before the refusal: earlier outputs are stale
                raise
            clock[0] += 1
            if self._counters.eager_fallbacks != eager_before:
                return out
            return checked(out, clock[0], clock)
        finally:
            self._debug_lock.release()

    def _touch(self) -> None:
        self._here.touches = getattr(self._here, "touches", 0) + 1

    def _capture_lazily(self, key: Any) -> None:
        self._touch()  # a lazy capture resets the static buffers
        super()._capture_lazily(key)

    def _replay_failed(self, *args: Any) -> Any:
        self._touch()  # the inputs were copied in and the graph ran
        return super()._replay_failed(*args)


# A registry hands out its server's ``run`` as its own: argument errors name the method the engine called.
Server.run.__qualname__ = DebugServer.run.__qualname__ = "GraphRegistry.run"
