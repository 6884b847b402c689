"""The capturer: which keys a registry may capture, and capturing them.

Plan checks (the strategy is registered, serves the key's class, the key fits the static inputs),
the one capture context every capture runs under (the ``context=`` payload and the serving
thread's state, see :mod:`cgregistry.state.serving`), a whole plan now (``capture_all``), a lazy
key at its first use (``capture_lazily``), and the one sequence every path captures a key with
(``capture_key``: the capture lock, the hooks, the context, a failure as ``CaptureError``), on
the serving thread or the capture thread alike.

A hook or the step that calls back into the registry from inside a capture on the same thread is
refused (``refuse_inside_capture``): a ``clear()`` would drop the capture context mid-plan, and a
``capture()`` would wait for the capture lock its own thread holds.  The capture thread's calls are
refused by :class:`~cgregistry.capture.background.BackgroundCapture` the same way.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from cgregistry.capture.entry import EntryCapture, frozen_gc, paused_gc
from cgregistry.store.catalog import Catalog
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.store.entries import Entry, Pair
from cgregistry.hooks.events import Events
from cgregistry.inspection import EntryInfo
from cgregistry.key.kinds import check_serves
from cgregistry.capture.memory import MemoryEstimate, estimate_memory
from cgregistry.plan.build import PlanEntry
from cgregistry.hooks.manager import Plugins
from cgregistry.state.reach import reached
from cgregistry.state.serving import RECORDED_AT_CAPTURE, ServingState, StateTest
from cgregistry.warn import warn
from cgregistry.state.weights import WeightWatch
from cgregistry.errors import CaptureError, ServingStateError, WeightsMovedError

__all__ = ["CaptureContext", "Capturer"]

_log = logging.getLogger("cgregistry")


@attrs.frozen(slots=True)
class CaptureContext:
    """What every capture of a registry runs under, whichever path captures: the payload eager breaks see
    (``capture(context=...)``) and the serving thread's state.

    Two contexts are equal when a capture under either computes the same: the same payload object and equal states
    (the context variables are carried, not compared).  A background capture is installed only while its context
    equals the registry's.
    """

    payload: Any = attrs.field(eq=id)  # identity: an engine's payload may not compare (tensors) or may change in place
    state: ServingState


class Capturer:
    """Checks and captures keys into one catalog, under one capture context."""

    def __init__(self, one: EntryCapture, catalog: Catalog, events: Events, plugins: Plugins, name: str) -> None:
        self._one = one
        self._catalog = catalog
        self._events = events
        self._plugins = plugins
        self._name = name
        self.pool = one.graph_pool  # its lock: one capture at a time into the pool, any thread's, any registry's sharing it
        self.pool.share(self)
        # Per thread: .depth, the captures (one key with its hooks) in progress on it (the pool says which registry's
        # capture holds its lock on this thread: a capture asked for from inside would wait for itself).
        self._here = threading.local()
        self.context: CaptureContext | None = None
        self.state_test = StateTest()  # the hot path's test of the caller's state against the context's (changed in place)
        self.buffers = one.buffers  # the shared static inputs (an entry captured in the background has its own)
        self.watch = WeightWatch()  # the tensors graphs read: each entry keeps where they were at its capture
        self.watch.watch((f"static input {n!r}", buf.tensor) for n, buf in one.buffers.items())
        self._warned_unwatched = False
        self._warned_no_break = False
        self._said_uncovered = False
        self._opaque: list[str] = []  # what the step reads without its contents being looked into
        self.watch_step()

    # ---------------------------------------------------------------- checks

    def check(self, plan: Iterable[object]) -> list[PlanEntry]:
        """Every entry of ``plan`` checked before any is captured (a refused plan changes nothing)."""
        todo = [_plan_entry(e) for e in plan]
        for entry in todo:
            self.check_key(entry.descriptor, entry.strategy)
        return todo

    def strategy_names(self) -> list[str]:
        """The registered strategies, sorted (for error messages)."""
        return sorted(self._plugins.strategies)

    def check_key(self, key: BatchDescriptor, strategy: str) -> None:
        """KeyError for a strategy not registered, ValueError for a class it does not serve or a key too large."""
        check_serves(key, self._plugins.strategy(strategy))
        self._one.check_fits(key)

    def estimate(self, pairs: list[Pair], background: bool, payload: Any = None) -> MemoryEstimate:
        """Measure and predict the capture of ``pairs`` (see :mod:`cgregistry.capture.memory`) under the context a capture from
        this thread would run under (``payload``, else the recorded one), without recording it; one capture at a time;
        the per-key predictions are kept for inspection."""
        held = self.context
        if payload is None and held is not None:
            payload = held.payload
        ctx = CaptureContext(payload, ServingState.current(self._one.device.type))

        def whole_graph(name: str) -> bool:
            return bool(getattr(self._plugins.strategy(name), "whole_graph", False))

        self.pool.refuse_if_held("estimate_memory()", self._name)
        with self.pool.lock:
            found = estimate_memory(self._one, pairs, self._plugins.strategy, ctx.state.run, ctx.payload,
                                    background=background, whole_graph=whole_graph)
        self._catalog.predicted.update({(k.key, k.strategy): k.bytes for k in found.keys})
        return found

    def warn_shadowed(self) -> None:
        """Warn when a strategy's uniform keys rank after a relaxed strategy's: those graphs may never replay."""
        pairs = self._catalog.pairs()
        order = self._catalog.routes.matcher.preference
        with_keys = {s for _, s in pairs}
        relaxed = [s for s in order if s in with_keys and self._plugins.strategy(s).relaxes_num_reqs]
        for strategy in sorted({s for k, s in pairs if k.uniform}):
            first = next((r for r in relaxed if order.index(r) < order.index(strategy)), None)
            if first is not None:
                warn(
                    f"cgregistry: uniform keys of strategy {strategy!r} rank after {first!r} in this registry's "
                    f"preference {tuple(order)}; {first!r} keys cover those batches first, so {strategy!r} graphs may "
                    f"never replay. Put it first: GraphRegistry(..., preference=({strategy!r}, {first!r}, ...))")

    # ---------------------------------------------------------------- the capture context

    def record(self, payload: Any, recorded_at: str = RECORDED_AT_CAPTURE) -> None:
        """The calling thread's state, and ``payload`` (None keeps the one recorded before), become what every later
        capture runs under; refused while the catalog holds keys captured under a state that computes otherwise.
        ``recorded_at`` says where (``capture()``, or a refit): what a replay refused for its state is told to do."""
        state = ServingState.current(self._one.device.type, recorded_at)
        held = self.context
        if held is not None and (self._catalog.entries or self._catalog.pending or self._catalog.capturing):
            found = held.state.differences()
            if found:
                raise ServingStateError(
                    f"capture() on registry {self._name!r} under another state than the graphs it holds were captured "
                    f"under: {'; '.join(found)}; a registry's graphs share one state: reg.clear() first, or capture under "
                    "the held one"
                )
        if payload is None and held is not None:
            payload = held.payload
        self.watch_step()
        self.context = CaptureContext(payload, state)
        self.state_test.take(self._one.device.type)  # on this thread, in the state just recorded

    def current(self, recorded_at: str = RECORDED_AT_CAPTURE) -> CaptureContext:
        """The context every capture runs under (recorded now, on the calling thread, at ``recorded_at``, if no
        capture() gave one)."""
        if self.context is None:
            self.record(None, recorded_at)
        return self.context  # type: ignore[return-value]

    def watch_step(self) -> None:
        """Watch every module and tensor the step reaches (itself, a bound method's object, closure cells, ``partial``
        arguments, the module-level names its code uses); looked for again at each ``capture()``, so one made or rebound
        since is seen."""
        found = reached(self._one.step)
        added = bool(self._catalog.entries or self._catalog.capturing)  # what is new to the step now, its graphs miss
        for name, read in found.modules:
            self.watch.watch(read, prefix=f"{name}.", added=added)
        for name, read in found.tensors:
            self.watch.watch_read(name, read, added=added)
        self._opaque = found.opaque

    def say_uncovered(self, plan: object, cap: Any) -> None:
        """Once per registry, in the ``cgregistry`` log (INFO): the token ranges a plan leaves to eager steps (a default
        ``max_capture_size`` of twice ``max_num_seqs`` leaves most mixed batches of a small engine there).  ``run()``
        warns when such batches turn out to be most of the traffic; ``stats().misses_by_reason`` counts them."""
        uncovered = getattr(plan, "uncovered", None)
        if (self._said_uncovered or uncovered is None or getattr(plan, "max_num_tokens", None) is None
                or not _log.isEnabledFor(logging.INFO)):  # nobody listens: no matcher sweep at every start-up
            return
        ranges = uncovered(max_padding_tokens=cap.max_tokens, max_padding_ratio=cap.max_ratio)
        self._said_uncovered = True
        if ranges:
            said = [f"{r.kind}{'' if r.spec_depth in (None, 0) else f' (spec {r.spec_depth})'}"
                    f"{f' with {r.num_active_loras} LoRAs' if r.num_active_loras else ''} batches of {r.min_tokens}-"
                    f"{r.max_tokens} tokens{' (over the padding cap)' if r.reason == 'padding_cap' else ''}"
                    for r in ranges[:4]]
            more = f" and {len(ranges) - 4} more ranges" if len(ranges) > 4 else ""
            _log.info("registry %r: no key serves %s%s: they run eagerly (plan.uncovered() lists them)",
                      self._name, "; ".join(said), more)

    def warn_unwatched(self) -> None:
        """Once per registry: the step reads values not looked into and no module is watched, so a weight replaced by
        assignment inside them would go unseen."""
        if self.watch.modules_watched or not self._opaque or self._warned_unwatched:
            return
        self._warned_unwatched = True
        warn(
            f"cgregistry: registry {self._name!r} found no module the step reads, and it reads "
            f"{', '.join(map(repr, self._opaque[:4]))} without their contents being looked into; a weight in them "
            "replaced by assignment (load_state_dict(assign=True), a new nn.Parameter) would go unseen and graphs would "
            "read the old memory: name what the step reads with reg.watch(model)")

    def forget(self) -> None:
        """No context (after ``clear()``): the next capture request records one."""
        self.context = None
        self.state_test.passing()

    def refuse_other_state(self) -> None:
        """After ``state_test()`` said no: raise ``ServingStateError`` naming how the caller's state differs from the
        capture context's in what a replay computes; a difference that changes no result (grad mode) becomes the state
        ``state_test`` compares with from now on."""
        if self.context is not None:
            self.context.state.check(self._name)
        self.state_test.take(self._one.device.type)

    def check_weights(self, entry: Entry) -> None:
        """After the watch's generation moved past ``entry``'s: raise ``WeightsMovedError`` naming a watched tensor the
        entry's graph would read at its old address; else the entry is of the current generation from now on."""
        watch = self.watch
        generation = watch.generation
        moved = watch.moved_for(entry.weights)  # what was added to a watched module since is looked for first
        if not moved:
            entry.generation = generation
            return
        more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
        raise WeightsMovedError(
            f"run() on registry {self._name!r}: {moved[0]}{more} since the graph of {entry.key} [{entry.strategy}] was "
            "captured, so it would read the old weights; call reg.refresh() after a weight update (it keeps what reads "
            "the new addresses and captures the rest again), or update weights in place (param.copy_, load_state_dict "
            "without assign=True)"
        )

    # ---------------------------------------------------------------- capturing

    @contextlib.contextmanager
    def _capturing(self) -> Iterator[None]:
        """Mark a capture in progress on this thread for the block: one key, its hooks included (a capture_finished
        hook's run() may capture a lazy key inside it, so they nest)."""
        here = self._here
        here.depth = getattr(here, "depth", 0) + 1
        try:
            yield
        finally:
            here.depth -= 1

    def refuse_inside_capture(self, call: str) -> None:
        """``call`` from a hook or the step inside a capture on this same thread: refused (a ``clear()`` would drop the
        capture context the rest of the plan runs under, a ``capture()`` would wait for the lock this thread holds)."""
        if getattr(self._here, "depth", 0):
            raise RuntimeError(
                f"{call} on registry {self._name!r} from inside one of its captures on the same thread (a hook or the "
                f"step called it while capturing): refused, the capture in progress would wait for itself or lose its "
                f"context; call it after capture() (or the run() that captures) returns"
            )

    def holds_graphs(self) -> bool:
        """Whether this registry holds graphs or has captures in flight (its pool is not to be renewed)."""
        return bool(self._catalog.entries or self._catalog.capturing)

    def renew_if_unused(self) -> None:
        """A fresh pool, and debug mode's addresses recorded again, when no graph holds or will hold the pool
        (on CUDA a pool whose graphs all died takes no new capture); a pool shared with a registry that holds graphs
        is kept."""
        if not self.holds_graphs():
            self.pool.renew_if_unused()
            self.watch.rebase()

    def capture_key(self, pair: Pair, ctx: CaptureContext, *, background: bool = False) -> Entry:
        """Capture one key: between the capture_started and capture_finished hooks, under ``ctx``, one capture at a time.

        In the foreground the entry goes live in the catalog (evictions reported); in the background
        (on the capture thread) it is returned for the serving thread to install.  Whatever the step
        raises is a ``CaptureError`` naming the key (a KeyboardInterrupt in the foreground stays one).
        """
        key, name = pair
        strategy = self._plugins.strategy(name)
        self.pool.refuse_if_held(f"a capture of {key} [{name}]", self._name)
        with self._capturing():  # the hooks' calls back are refused until capture_finished has returned
            with self.pool.lock, paused_gc():
                self.pool.hold(self._name)
                try:
                    self._events.capture_started(key, name)
                    generation = self.watch.generation  # taken first: a move during the capture makes it older
                    weights = self.watch.seen()  # what the graph will read
                    try:
                        entry = ctx.state.run(self._one.capture, key, name, strategy, ctx.payload, background=background)
                        if self.watch.generation != generation:  # the step registered tensors while it warmed up
                            weights = self.watch.joined(weights)
                        entry.weights, entry.generation = weights, generation
                    except BaseException as exc:
                        error = exc if isinstance(exc, CaptureError) else CaptureError(key, name, exc)
                        self._events.capture_finished(key, name, None, error)
                        if error is exc:
                            raise
                        if background or isinstance(exc, Exception):
                            raise error from exc
                        raise
                finally:
                    self.pool.hold(None)
            if (not self._warned_no_break and entry.read_live_batch and not key.uniform
                    and getattr(entry.graph, "breaks", None) == 0):
                self._warn_no_break(entry)
            evicted = [] if background else self._catalog.add(entry)
            self._events.capture_finished(key, name, entry, None)
            self._events.evicted(evicted)
        return entry

    def _warn_no_break(self, entry: Entry) -> None:
        """Once per registry: a mixed key of a strategy that splits at eager breaks was captured with none, while the
        step read the batch's ``actual`` or ``payload`` outside an eager break."""
        self._warned_no_break = True
        warn(
            f"cgregistry: registry {self._name!r} captured the mixed key {entry.key} [{entry.strategy}] with no eager "
            "break, and the step read current_batch().actual or .payload while it was recorded: the whole step is one "
            "graph, and the host code that read the batch ran once, at capture. Mark such functions with "
            "@cgregistry.eager_break"
        )

    def capture_all(self, pairs: list[Pair], progress: bool | None, *, untried_lazily: bool = False) -> list[EntryInfo]:
        """Capture ``pairs`` in order, now.  A failure stops its strategy (its later keys are not tried) but not the
        others, whose keys are all captured; each failed key is kept in the catalog's failures (as on every capture
        path), then the first failure is raised, naming what each other failing strategy raised and what else happened.
        ``untried_lazily``: keys held before (a refresh, a wake) that were not tried are planned lazily, never lost."""
        if progress is None:
            progress = len(pairs) > 1 and sys.stderr.isatty()
        ctx = self.current()
        bar = _progress(pairs, progress)
        captured: list[EntryInfo] = []
        failed: dict[str, CaptureError] = {}  # strategy -> its first failure
        skipped: list[Pair] = []
        self.renew_if_unused()
        try:
            with frozen_gc(), self._catalog.batch():
                for pair in bar:
                    if pair[1] in failed:
                        skipped.append(pair)
                        continue
                    try:
                        captured.append(self.capture_key(pair, ctx).info(self._one.backend.name))
                    except CaptureError as error:
                        self._catalog.fail_capture(pair, error)  # kept as the lazy and background paths keep theirs
                        failed[pair[1]] = error
        finally:
            if hasattr(bar, "close"):
                bar.close()
        if failed:
            if untried_lazily and skipped:
                self._catalog.plan_lazily(skipped)
            raise _summary(failed, skipped, captured, lazily=untried_lazily)
        return captured

    def capture_lazily(self, pair: Pair) -> None:
        """Capture a lazy key on its first use; a failure drops it (its batches go to the next best key, or run eagerly)."""
        self.renew_if_unused()
        try:  # capture_key pauses the collector; no full collection first, which would stall this step for a large heap
            self.capture_key(pair, self.current())
        except CaptureError as exc:
            self._catalog.fail_capture(pair, exc)
            warn(
                f"cgregistry: lazy {exc}; the key is dropped and the step goes on to the next best key (or runs eagerly)")
        else:
            self._catalog.counters.lazy_captures += 1


def _summary(failed: dict[str, CaptureError], skipped: list[Pair], captured: list[EntryInfo], lazily: bool = False) -> CaptureError:
    """The first failure of a plan's capture (its cause as ``__cause__``), with what each other failing strategy raised,
    what was not tried and what was captured."""
    first = next(iter(failed.values()))
    notes = []
    for strategy, e in list(failed.items())[1:]:
        cause = _cause(e)
        notes.append(f"; strategy {strategy!r} failed too, capturing {e.descriptor}: {type(cause).__name__}: {cause}")
    by_strategy: dict[str, int] = {}
    for _, strategy in skipped:
        by_strategy[strategy] = by_strategy.get(strategy, 0) + 1
    then = " (planned lazily: captured at first use)" if lazily else ""
    notes += [f"; {n} later key{'s' if n > 1 else ''} of strategy {s!r} not tried{then}" for s, n in by_strategy.items()]
    kept = sorted({info.strategy for info in captured})
    notes.append(f"; {len(captured)} entries captured" + (f" ({', '.join(kept)})" if kept else "") + ", and they stay")
    error = CaptureError(first.descriptor, first.strategy, _cause(first), note="".join(notes))
    error.__cause__ = first.__cause__
    return error


def _cause(error: CaptureError) -> BaseException:
    """What the step or strategy raised under a ``CaptureError`` (the error itself if it has no cause)."""
    return error.__cause__ if error.__cause__ is not None else error


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
