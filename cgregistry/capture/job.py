"""The capture job: which keys a registry may capture, and capturing them, in one sequence for every path.

Plan checks (the strategy is registered, serves the key's class, the key fits the static inputs), the one capture
context every capture runs under (the ``context=`` payload and the serving thread's state, see
:mod:`cgregistry.state.serving`), and ``capture_key``: one key between the capture_started and capture_finished
hooks, under that context, one capture at a time into the pool.  A :class:`Mode` value says where the capture goes:
``FOREGROUND`` (the shared pool and static inputs; the entry goes live at once), ``BACKGROUND`` (beside a serving
thread, on the capture thread; the entry is handed back to be installed) or :func:`scratch` (measured and dropped:
the memory estimate).  A whole plan now is ``capture_plan``; a lazy key at its first use, ``capture_lazily``.

Capture runs the engine's step (a warm-up first, which ``warm_up_again=False`` skips for a key captured again; eager
breaks and the cpu emulator run it for real), and a step writes engine state such as a KV cache at the slots it reads.
So every capture, whenever it happens, runs on buffers reset to their fills (a scratch slot for index inputs), never
on the rows of a batch already served; a failure is a ``CaptureError`` and changes nothing but the pool handle.

A hook or the step that calls back into the registry from inside a capture on the same thread, or from the
registry's capture thread, is refused (``refuse_inside``): a ``clear()`` would drop the capture context mid-plan, and
a ``capture()`` would wait for the capture lock its own thread holds.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import numbers
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar

import attrs
import torch

from cgregistry.capture import phases
from cgregistry.capture.pool import GraphPool, Handover, account_held
from cgregistry.contracts.protocols import Backend
from cgregistry.errors import CaptureError, PluginError, ServingStateError, WeightsMovedError
from cgregistry.hooks.events import Events
from cgregistry.hooks.manager import Plugins
from cgregistry.inspection import CapturePhases, EntryInfo
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.key.kinds import check_serves
from cgregistry.plan.build import CapturePlan, PlanEntry
from cgregistry.state import runtime
from cgregistry.state.runtime import BreakContext
from cgregistry.state.serving import RECORDED_AT_CAPTURE, ServingState, StateTest
from cgregistry.state.weights import WeightWatch
from cgregistry.store.catalog import Catalog, Entry, Pair
from cgregistry.store.io import OutputAxes, StaticBuffer, capture_inputs, check_fits, checked_outputs, output_slicer
from cgregistry.warn import warn

__all__ = ["BACKGROUND", "FOREGROUND", "CaptureContext", "CaptureError", "CaptureJob", "FrozenHeap", "Mode", "PausedGC", "scratch"]

_T = TypeVar("_T")

_log = logging.getLogger("cgregistry")
_UNKNOWN = object()  # no output spec known for a key: its capture warms up first


@attrs.frozen(slots=True)
class Mode:
    """Where a capture goes and what it runs on.

    ``foreground``: the shared pool and static inputs (reset to their fills), on the serving thread.  ``background``:
    beside a serving thread, so static inputs of its own sized for the key (the shared ones hold the live batch), a
    stream of the pool's made current where the backend has them (not the serving thread's), and a pool of its own
    for a strategy that runs eager code during capture (that code really executes and could write memory a graph
    being replayed is using).
    ``scratch``: measured and dropped (a memory estimate), never into the shared pool nor on the shared inputs.
    """

    name: Literal["foreground", "background", "scratch"]
    # scratch: the pool to capture into (None: one of its own), the buffers to capture on, as large as the registry's
    # and reset to their fills (None: inputs of its own sized for the key), and whether it is measured as a background
    # capture would take it (its streams and own inputs) rather than a foreground one.
    pool: Any = None
    inputs: Mapping[str, StaticBuffer] | None = None
    as_background: bool = False

    @property
    def beside_serving(self) -> bool:
        """Captured while a serving thread may run: on streams not the serving thread's, as safe as the background."""
        return self.name != "foreground"


FOREGROUND = Mode("foreground")
BACKGROUND = Mode("background")


def scratch(pool: Any = None, inputs: Mapping[str, StaticBuffer] | None = None, as_background: bool = False) -> Mode:
    """A capture to be measured and dropped (see :class:`Mode`)."""
    return Mode("scratch", pool, inputs, as_background)


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


class CaptureJob:
    """Checks and captures keys of one step into one catalog and one pool, under one capture context."""

    def __init__(
        self, step: Callable[..., Any], buffers: Mapping[str, StaticBuffer], backend: Backend, output_axes: OutputAxes,
        warmup_runs: int, pool: GraphPool, catalog: Catalog, events: Events, plugins: Plugins, name: str, *,
        warm_up_again: bool = True,
    ) -> None:
        self.step = step  # the engine's step: what every capture runs
        self.buffers = buffers  # the shared static inputs (an entry captured in the background has its own)
        self.backend = backend
        self.device = backend.device()
        self._output_axes = output_axes
        self._warmup_runs = warmup_runs
        self.pool = pool  # its lock: one capture at a time into the pool, any thread's, any registry's sharing it
        self.pool.share(self)
        self.handover = Handover(backend, pool)  # pools of their own that dropped entries leave to their keys' captures
        self._catalog = catalog
        self._events = events
        self._plugins = plugins
        self._strategies = plugins.strategies  # looked up by name at each capture
        self.name = name
        slots = [b.capacity - (b.spec.axis == "reqs+1") for b in buffers.values() if b.spec.axis != "tokens"]
        self._request_slots = min(slots) if slots else None  # request rows a relaxed key's step sees
        # Per thread: .depth, the captures (one key with its hooks) in progress on it, and .capture_thread, whether it
        # is this registry's capture thread (the pool says which registry's capture holds its lock on this thread).
        self._here = threading.local()
        self.context: CaptureContext | None = None
        self.state_test = StateTest()  # the hot path's test of the caller's state against the context's (changed in place)
        self.watch = WeightWatch()  # the tensors graphs read: each entry keeps where they were at its capture
        self.watch.watch((f"static input {n!r}", buf.tensor) for n, buf in buffers.items())
        # With warm_up_again off, the output spec of each key captured with nothing compiled or compiling: a later
        # capture of it on a thread that has warmed up a key before (its lazy per-thread state made) skips the warm-up.
        self._warm_up_again = warm_up_again
        self._warm_specs: dict[Pair, Any] = {}
        self._warned_unwatched = False
        self._warned_no_break = False
        self._said_uncovered = False
        self._opaque: list[str] = []  # what the step reads without its contents being looked into
        self._bound: Any = None  # what the state test compares through context variables
        self.watch_step()

    # ---------------------------------------------------------------- checks

    def check(self, plan: Iterable[object]) -> list[PlanEntry]:
        """Every entry of ``plan`` checked before any is captured (a refused plan changes nothing)."""
        todo = [e if type(e) is PlanEntry else _plan_entry(e) for e in plan]
        for entry in todo:
            self.check_key(entry.descriptor, entry.strategy)
        return todo

    def strategy(self, name: str) -> Any:
        """The strategy registered as ``name`` (KeyError naming the registered ones)."""
        found = self._strategies.get(name)
        return found if found is not None else self._plugins.strategy(name)

    def strategy_names(self) -> list[str]:
        """The registered strategies, sorted (for error messages)."""
        return sorted(self._strategies)

    def check_key(self, key: BatchDescriptor, strategy: str) -> None:
        """KeyError for a strategy not registered, ValueError for a class it does not serve or a key too large."""
        found = self.strategy(strategy)
        if getattr(found, "unsupported_classes", ()):  # a strategy that declares none serves every class
            check_serves(key, found)
        check_fits(self.buffers, key)

    def predicted(self, keys: Iterable[Any]) -> None:
        """Keep a memory estimate's per-key predictions (``KeyMemory`` records) for inspection."""
        self._catalog.predicted.update({(k.key, k.strategy): k.bytes for k in keys})

    def warn_shadowed(self) -> None:
        """Warn when a strategy's uniform keys rank after a relaxed strategy's: those graphs may never replay."""
        pairs = [*self._catalog.entries, *self._catalog.pending]
        order = list(dict.fromkeys([*self._catalog.routes.preference, *(s for _, s in pairs)]))  # as the matcher ranks them
        with_keys = {s for _, s in pairs}
        relaxed = [s for s in order if s in with_keys and self.strategy(s).relaxes_num_reqs]
        if not relaxed:
            return
        for strategy in sorted({s for k, s in pairs if k.uniform}):
            first = next((r for r in relaxed if order.index(r) < order.index(strategy)), None)
            if first is not None:
                warn(
                    f"cgregistry: uniform keys of strategy {strategy!r} rank after {first!r} in this registry's "
                    f"preference {tuple(order)}; {first!r} keys cover those batches first, so {strategy!r} graphs may "
                    f"never replay. Put it first: GraphRegistry(..., preference=({strategy!r}, {first!r}, ...))")

    # ---------------------------------------------------------------- the capture context

    def record(self, payload: Any, recorded_at: str = RECORDED_AT_CAPTURE, rebase: bool = False) -> None:
        """The calling thread's state, and ``payload`` (None keeps the one recorded before), become what every later
        capture runs under; refused while the catalog holds keys captured under a state that computes otherwise.
        ``recorded_at`` says where (``capture()``, or a refit): what a replay refused for its state is told to do."""
        held = self.context
        if held is not None and (self._catalog.entries or self._catalog.pending or self._catalog.capturing):
            found = held.state.differences(self.watch.through)
            if found:
                raise ServingStateError(
                    f"capture() on registry {self.name!r} under another state than the graphs it holds were captured "
                    f"under: {'; '.join(found)}; a registry's graphs share one state: reg.clear() first, or capture under "
                    "the held one"
                )
        if payload is None and held is not None:
            payload = held.payload
        state = self.state_test.take(self.device.type, recorded_at)  # on this thread: the hot path's test of this state
        self.context = CaptureContext(payload, state)
        self.watch_step(rebase)

    def current(self, recorded_at: str = RECORDED_AT_CAPTURE) -> CaptureContext:
        """The context every capture runs under (recorded now, on the calling thread, at ``recorded_at``, if no
        capture() gave one)."""
        if self.context is None:
            self.record(None, recorded_at)
        return self.context  # type: ignore[return-value]

    def context_for(self, payload: Any) -> CaptureContext:
        """The context a capture from this thread would run under (``payload``, else the recorded one), not recorded."""
        held = self.context
        if payload is None and held is not None:
            payload = held.payload
        return CaptureContext(payload, ServingState.current(self.device.type))

    def watch_step(self, rebase: bool = False) -> None:
        """Watch every module and tensor the step reaches (itself, a bound method's object, closure cells, ``partial``
        arguments, the module-level names its code uses); looked for again at each ``capture()``, so one made or rebound
        since is seen.  ``rebase``: where no graph is held, every watched address is taken anew as its baseline."""
        held = bool(self._catalog.entries or self._catalog.capturing)  # what is new to the step now, its graphs miss
        self._opaque = self.watch.watch_step(self.step, added=held, rebase=rebase and not held)
        through = self.watch.through  # a replay reaching another module through a context variable is refused
        if self.context is not None and (through.groups or self._bound is not None):  # (each walk makes a new check)
            self._bound = through
            self.state_test.bind(through)

    def say_uncovered(self, plan: object) -> None:
        """Once per registry, in the ``cgregistry`` log (INFO): the token ranges a plan leaves to eager steps (a default
        ``max_capture_size`` of twice ``max_num_seqs`` leaves most mixed batches of a small engine there).  ``run()``
        warns when such batches turn out to be most of the traffic; ``stats().misses_by_reason`` counts them."""
        uncovered = getattr(plan, "uncovered", None)
        if (self._said_uncovered or uncovered is None or getattr(plan, "max_num_tokens", None) is None
                or not _log.isEnabledFor(logging.INFO)):  # nobody listens: no matcher sweep at every start-up
            return
        cap = self._catalog.routes.cap
        ranges = uncovered(max_padding_tokens=cap.max_tokens, max_padding_ratio=cap.max_ratio)
        self._said_uncovered = True
        if ranges:
            said = [f"{r.kind}{'' if r.spec_depth in (None, 0) else f' (spec {r.spec_depth})'}"
                    f"{f' with {r.num_active_loras} LoRAs' if r.num_active_loras else ''} batches of {r.min_tokens}-"
                    f"{r.max_tokens} tokens{' (over the padding cap)' if r.reason == 'padding_cap' else ''}"
                    for r in ranges[:4]]
            more = f" and {len(ranges) - 4} more ranges" if len(ranges) > 4 else ""
            _log.info("registry %r: no key serves %s%s: they run eagerly (plan.uncovered() lists them)",
                      self.name, "; ".join(said), more)

    def warn_unwatched(self) -> None:
        """Once per registry: the step reads values not looked into and no module is watched, so a weight replaced by
        assignment inside them would go unseen."""
        if self.watch.modules_watched or not self._opaque or self._warned_unwatched:
            return
        self._warned_unwatched = True
        warn(
            f"cgregistry: registry {self.name!r} found no module the step reads, and it reads "
            f"{', '.join(map(repr, self._opaque[:4]))} without their contents being looked into; a weight in them "
            "replaced by assignment (load_state_dict(assign=True), a new nn.Parameter) would go unseen and graphs would "
            "read the old memory: name what the step reads with reg.watch(model)")

    def forget(self) -> None:
        """No context (after ``clear()``): the next capture request records one, and every key warms up again."""
        self.context = None
        self.state_test.passing()
        self._bound = None
        self.watch.forget_through()  # nothing of the old binding is held once no graph reads it
        self._warm_specs.clear()

    def in_recorded_context(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` in a copy of the context variables capture() recorded (as every capture of this registry runs):
        a refresh from a thread that binds none of them reads what the graphs read."""
        return self.context.state.context.copy().run(fn) if self.context is not None else fn()

    def refuse_rebound(self, what: str) -> None:
        """Raise ``ServingStateError`` where the calling context binds a context variable the step reaches a module
        through to another object than capture() saw (``what``, a refresh, would capture again under the old one)."""
        if self.context is None:
            return
        found = self.context.state.rebound(self.watch.through, bound_only=True)
        if found:
            raise ServingStateError(
                f"{what} on registry {self.name!r} in a context that binds another object than capture() saw: "
                f"{'; '.join(found)}. Its graphs, and every capture it makes, read what capture() saw through it; "
                "reg.clear() and capture() again under the new binding")

    def refuse_other_state(self) -> None:
        """After ``state_test()`` said no: raise ``ServingStateError`` naming how the caller's state differs from the
        capture context's in what a replay computes; a difference that changes no result (grad mode) becomes the state
        ``state_test`` compares with from now on."""
        if self.context is not None:
            self.context.state.check(self.name, self.watch.through)
        self.state_test.take(self.device.type)

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
            f"run() on registry {self.name!r}: {moved[0]}{more} since the graph of {entry.key} [{entry.strategy}] was "
            "captured, so it would read the old weights; call reg.refresh() after a weight update (it keeps what reads "
            "the new addresses and captures the rest again), or update weights in place (param.copy_, load_state_dict "
            "without assign=True)"
        )

    # ---------------------------------------------------------------- threads

    def refuse_inside(self, call: str) -> None:
        """``call`` from a hook or the step inside a capture on this same thread, or on this registry's capture thread:
        refused (a ``clear()`` would drop the capture context the rest of the plan runs under, a ``capture()`` or a wait
        would wait for the lock or the thread that is running it)."""
        here = self._here
        if getattr(here, "capture_thread", False):
            raise RuntimeError(
                f"{call} on registry {self.name!r} from its own capture thread (a hook or the step called it while "
                "capturing) would wait for itself"
            )
        if getattr(here, "depth", 0):
            raise RuntimeError(
                f"{call} on registry {self.name!r} from inside one of its captures on the same thread (a hook or the "
                f"step called it while capturing): refused, the capture in progress would wait for itself or lose its "
                f"context; call it after capture() (or the run() that captures) returns"
            )

    def on_capture_thread(self) -> bool:
        """Whether the caller runs on this registry's capture thread (a hook or the step during a capture)."""
        return getattr(self._here, "capture_thread", False)

    def mark_capture_thread(self, marked: bool) -> None:
        """The calling thread is (or, with False, is no longer) this registry's capture thread."""
        self._here.capture_thread = marked

    def holds_graphs(self) -> bool:
        """Whether this registry holds graphs or has captures in flight (its pool is not to be renewed)."""
        return bool(self._catalog.entries or self._catalog.capturing)

    def renew_if_unused(self, release: bool = False) -> None:
        """Debug mode's addresses recorded again, and a fresh pool (``GraphPool.renew_if_unused``: to ``release`` its
        memory, or where the old one takes no more captures), when no graph holds or will hold the pool; a pool shared
        with a registry that holds graphs is kept."""
        if not (self._catalog.entries or self._catalog.capturing):
            if self.pool.used or (release and self.pool.kept):
                self.pool.renew_if_unused(release)
            self.watch.rebase()

    # ---------------------------------------------------------------- capturing

    def prepare(self, plan: Any, payload: Any, rebase: bool = False) -> list[Pair]:
        """What ``capture(plan)`` does before it captures or queues anything: refuse a call from inside a capture, check
        every entry, adopt the plan's strategy order where the registry follows plans, record the capture context
        (``rebase``: where no graph is held, the watched addresses taken anew), say what the plan leaves uncovered;
        the plan's (key, strategy) pairs, each once, in plan order."""
        self.refuse_inside("capture()")
        todo = self.check(plan)
        if self._catalog.follows_plans and isinstance(plan, CapturePlan):  # its decode strategy first
            self._catalog.follow_plan((e.descriptor, e.strategy) for e in todo)
        self.record(payload, rebase=rebase)
        self.warn_unwatched()
        self.say_uncovered(plan)
        return list(dict.fromkeys((e.descriptor, e.strategy) for e in todo))

    def capture_plan(self, plan: Any, payload: Any, progress: bool | None) -> list[EntryInfo]:
        """``capture(plan)`` in the foreground with no capture thread at work: ``prepare``, then capture what is not
        captured yet (``capture_all``)."""
        entries = self._catalog.entries
        pairs = [p for p in self.prepare(plan, payload, rebase=True) if p not in entries]
        if self.pool.used and not self.holds_graphs():  # the addresses were taken anew by prepare's record
            self.pool.renew_if_unused()
        try:
            return self._capture_all(pairs, progress)
        finally:
            self.warn_shadowed()

    def capture_key(self, pair: Pair, ctx: CaptureContext, mode: Mode = FOREGROUND) -> Entry:
        """Capture one key: between the capture_started and capture_finished hooks, under ``ctx``, one capture at a time.

        In the foreground the entry goes live in the catalog (evictions reported); in the background
        (on the capture thread) it is returned for the serving thread to install.  Whatever the step
        raises is a ``CaptureError`` naming the key (a KeyboardInterrupt in the foreground stays one).
        """
        key, name = pair
        strategy = self.strategy(name)
        pool = self.pool
        here = self._here
        here.depth = getattr(here, "depth", 0) + 1  # the hooks' calls back are refused until capture_finished has returned
        try:
            with PausedGC():
                pool.begin(self.name, key, name, mode.beside_serving)  # its lock, held for this capture (refused if this thread holds it)
                entry = None
                try:
                    self._events.capture_started(key, name)
                    generation = self.watch.generation  # taken first: a move during the capture makes it older
                    try:
                        with self.pool_streams():  # the pool's own streams, whichever thread captures into it
                            entry = ctx.state.run(self._capture_read, key, name, strategy, ctx.payload, mode, generation)
                        entry.generation = generation
                    except BaseException as exc:
                        error = exc if isinstance(exc, CaptureError) else CaptureError(key, name, exc)
                        self._events.capture_finished(key, name, None, error)
                        if error is exc:
                            raise
                        if mode.beside_serving or isinstance(exc, Exception):
                            raise error from exc
                        raise
                finally:
                    pool.end(entry if entry is not None and _shares_pool(mode, strategy) else None)
            if (not self._warned_no_break and entry.read_live_batch and not key.uniform
                    and getattr(entry.graph, "breaks", None) == 0):
                self._warn_no_break(entry)
            evicted = self._catalog.add(entry) if mode is FOREGROUND else []
            self._events.capture_finished(key, name, entry, None)
            if evicted:
                self._events.evicted(evicted)
        finally:
            here.depth -= 1
        return entry

    def _capture_read(self, key: BatchDescriptor, name: str, strategy: Any, payload: Any, mode: Mode,
                      generation: int) -> Entry:
        """``capture_entry``, with what its graph reads (``entry.weights``) read in the capture context, where the
        step's context variables are the engine's (a model in a ContextVar, read from the capture thread)."""
        weights = self.watch.seen()
        entry = self.capture_entry(key, name, strategy, payload, mode)
        if self.watch.generation != generation:  # the step registered tensors while it was captured
            weights = self.watch.joined(weights)
        entry.weights = weights
        return entry

    def _warn_no_break(self, entry: Entry) -> None:
        """Once per registry: a mixed key of a strategy that splits at eager breaks was captured with none, while the
        step read the batch's ``actual`` or ``payload`` outside an eager break."""
        self._warned_no_break = True
        warn(
            f"cgregistry: registry {self.name!r} captured the mixed key {entry.key} [{entry.strategy}] with no eager "
            "break, and the step read current_batch().actual or .payload while it was recorded: the whole step is one "
            "graph, and the host code that read the batch ran once, at capture. Mark such functions with "
            "@cgregistry.eager_break"
        )

    def pool_streams(self) -> contextlib.AbstractContextManager[Any]:
        """Where the backend keeps streams per owner (cuda: ``streams_of``), a capture into this job's pool, or one
        measured for it (``estimate_memory``), runs on the pool's streams: the pool's free blocks, and the warm-up's
        cached ones, are reused only on the stream they came from."""
        streams_of = getattr(self.backend, "streams_of", None)
        return streams_of(self.pool) if streams_of is not None else contextlib.nullcontext()

    def capture_all(self, pairs: list[Pair], progress: bool | None, *, untried_lazily: bool = False) -> list[EntryInfo]:
        """Capture ``pairs`` in order, now.  A failure stops its strategy (its later keys are not tried) but not the
        others, whose keys are all captured; each failed key is kept in the catalog's failures (as on every capture
        path), then the first failure is raised, naming what each other failing strategy raised and what else happened.
        ``untried_lazily``: keys held before (a refresh, a wake) that were not tried are planned lazily, never lost (the
        caller keeps them owed to its next refresh)."""
        self.renew_if_unused()
        return self._capture_all(pairs, progress, untried_lazily=untried_lazily)

    def _capture_all(self, pairs: list[Pair], progress: bool | None, *, untried_lazily: bool = False) -> list[EntryInfo]:
        if progress is None:
            progress = len(pairs) > 1 and sys.stderr.isatty()
        ctx = self.current()
        bar = _progress(pairs, progress)
        captured: list[EntryInfo] = []
        failed: dict[str, CaptureError] = {}  # strategy -> its first failure
        skipped: list[Pair] = []
        backend = self.backend.name
        try:
            with _FrozenGC(getattr(self.backend, "collects_before_capture", True)):
                for pair in bar:
                    if pair[1] in failed:
                        skipped.append(pair)
                        continue
                    try:
                        captured.append(self.capture_key(pair, ctx).info(backend))
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

    def capture_entry(self, key: BatchDescriptor, strategy_name: str, strategy: Any, payload: Any, mode: Mode = FOREGROUND) -> Entry:
        """Warm up and capture ``step(key, **views)`` with ``strategy`` where ``mode`` says; ``payload`` is what eager
        breaks see.  Takes no lock and calls no hook (``capture_key`` does); a scratch capture is warmed up on the
        streams ``mode.as_background`` says, so that it takes what that capture would."""
        if mode.beside_serving:  # on a stream of the pool's, not the serving thread's, where the backend has them (cuda)
            with getattr(self.backend, "background_context", contextlib.nullcontext)():
                return self._capture_warm_or_not(key, strategy_name, strategy, payload, mode)
        return self._capture_warm_or_not(key, strategy_name, strategy, payload, mode)

    def _capture_warm_or_not(self, key: BatchDescriptor, strategy_name: str, strategy: Any, payload: Any, mode: Mode) -> Entry:
        """With ``warm_up_again`` off, a key captured again (a refresh, a wake) on a thread that has warmed up before
        skips its warm-up: the step ran eagerly for that key already, and its output spec is known.  The warm-up is
        about half a capture's time on the 1B engine.  Should such a capture fail (state the step makes on a first run,
        a handle say, cannot be made inside a capture), the key is warmed up and captured again, unless ranks of a
        process group would then run collectives the others do not; a key whose capture compiled or ran compiled code
        always warms up (a guard that fails after a weight update would compile inside the capture)."""
        pair = (key, strategy_name)
        spec = (self._warm_specs.get(pair, _UNKNOWN) if not self._warm_up_again and mode.name != "scratch"
                and getattr(self._here, "warmed", False) else _UNKNOWN)
        if spec is _UNKNOWN:
            return self._capture_entry(key, strategy_name, strategy, payload, mode)
        started = time.perf_counter()
        try:
            return self._capture_entry(key, strategy_name, strategy, payload, mode, spec)
        except CaptureError as exc:
            self._warm_specs.pop(pair, None)
            if _in_process_group():  # a warm-up on this rank alone would pair its collectives with other steps'
                raise
            _log.info("registry %r: %s [%s] captured without a warm-up failed (%s: %s); warming it up and capturing "
                      "again", self.name, key, strategy_name, type(exc.__cause__).__name__, exc.__cause__)
        failed_s = time.perf_counter() - started
        entry = self._capture_entry(key, strategy_name, strategy, payload, mode)
        entry.capture_seconds += failed_s  # the failed recording is part of what capturing the key took
        if entry.phases is not None:
            entry.phases = attrs.evolve(entry.phases, record=entry.phases.record + failed_s)
        return entry

    def _capture_entry(self, key: BatchDescriptor, strategy_name: str, strategy: Any, payload: Any, mode: Mode,
                       spec: Any = _UNKNOWN) -> Entry:
        """One capture; ``spec``: the key's output spec from an earlier capture, whose warm-up this one skips (a bare
        tensor's spec is None itself: ``_UNKNOWN`` says there is none)."""
        backend = self.backend
        device_memory = getattr(backend, "device_memory", None)  # (used, reserved) bytes, where the backend measures them
        used_before = device_memory()[0] if device_memory is not None else 0
        graph_pool = self.pool
        own_inputs = mode.name == "background" or (mode.name == "scratch" and mode.inputs is None)
        keeper, held = None, (0, 0)  # a pool of its own: what keeps it, what its dropped entry accounted for
        if mode.name == "scratch":
            pool = mode.pool if mode.pool is not None else backend.new_pool()
        elif _shares_pool(mode, strategy):
            pool = graph_pool.handle  # renewed (and kept, where the backend keeps pools) as the capture began (what
            # dropped entries left in it is accounted for as it ends: GraphPool.end)
        else:
            pool, keeper, held = self.handover.own_pool((key, strategy_name))
        buffers, views = capture_inputs(self.buffers if mode.inputs is None else mode.inputs, key, own_inputs)
        step = self.step

        def body() -> Any:
            return step(key, **views)

        axes, slots = self._output_axes, self._request_slots
        _watch_compiles()
        clock = {"compile": 0.0, "instantiate": 0.0}  # added to by compiles and graph ends (capture/phases.py)
        clock_token = runtime.phase_clock.set(clock)
        started = time.perf_counter()
        recording = runtime.Recording()
        tokens = (
            runtime.batch.set(BreakContext(key, key, payload)),
            runtime.axis_rows.set(frozenset(v.shape[0] for v in views.values()) | {key.num_tokens}),
            runtime.capture_strategy.set(strategy),
            runtime.background_capture.set(mode.beside_serving),
            runtime.foreground_layout.set(mode.name == "scratch" and not mode.as_background),
        )
        try:
            with torch.inference_mode():
                warmed = 0.0
                if spec is _UNKNOWN:
                    warm_leaves, spec = checked_outputs(backend.warmup(body, self._warmup_runs), axes, key, slots, self.device)
                    del warm_leaves
                    self._here.warmed = True
                    warmed = time.perf_counter() - started
                compiled_warming = clock["compile"]
                recording_token = runtime.recording.set(recording)
                try:
                    graph, out = strategy.capture(body, backend, pool)
                finally:
                    runtime.recording.reset(recording_token)
                backend.synchronize()
                slicer = output_slicer(out, axes, key, slots, self.device, spec, backend.share_outputs)
                del out
                memory = getattr(graph, "memory_bytes", None)  # it feeds the budget: a byte count
                if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory < 0:
                    raise PluginError(f"strategy {strategy_name!r} reported memory_bytes={memory!r} for its graph; "
                                      "expected a byte count >= 0")
        except BaseException as exc:  # a KeyboardInterrupt too leaves the pool to recover
            if pool is graph_pool.handle:
                graph_pool.recover()
            pool = keeper = None  # a pool of its own goes with the failed capture (the error's frames outlive it)
            if not isinstance(exc, Exception):
                raise
            raise CaptureError(key, strategy_name, exc) from exc
        finally:
            runtime.phase_clock.reset(clock_token)
            for var, token in zip(_CAPTURE_VARS, tokens):
                var.reset(token)
        seconds = time.perf_counter() - started
        _watch_compiles()  # again: the step may have loaded dynamo
        if mode.name != "scratch" and not self._warm_up_again:
            if clock["compile"] or clock.get("compiled runs"):
                self._warm_specs.pop((key, strategy_name), None)
            else:
                self._warm_specs[(key, strategy_name)] = spec
        entry = Entry(key, strategy_name, graph, slicer, seconds)
        # the rest of the warm-up once its compiling is taken out; record: the rest (recording, checking the outputs)
        warmup = max(0.0, warmed - compiled_warming)
        entry.phases = CapturePhases(clock["compile"], warmup, max(0.0, seconds - clock["compile"] - warmup - clock["instantiate"]),
                                     clock["instantiate"])
        if device_memory is not None:  # what the device gave this capture: pool, warm-up, driver objects, own inputs
            entry.device_bytes = max(0, device_memory()[0] - used_before)
        entry.read_live_batch = recording.live_batch_reads > 0
        if keeper is not None:
            entry.own_pool = (pool, keeper)
            account_held(entry, held)  # its dropped entry's pool, taken again
        if own_inputs:
            entry.buffers = tuple(buffers.values())  # in the registry's input order, as routes copy them
        return entry


def _in_process_group() -> bool:
    """Whether torch.distributed runs with more than one rank (a rank's own retry would desynchronise collectives)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _watch_compiles() -> None:
    """Have dynamo's compiles timed into captures (capture/phases.py) once the process has loaded dynamo."""
    # phases.watching(), read here: a capture enters no module for it once the callbacks are set.
    callback = sys.modules.get("torch._dynamo.callback")
    if callback is not None and phases.compile_started not in callback.callback_handler.start_callbacks:
        phases.watch_dynamo_compiles()


def _shares_pool(mode: Mode, strategy: Any) -> bool:
    """Whether a capture goes into the registry's pool: in the foreground, and in the background for a strategy that
    runs no eager code during capture (a scratch capture never does)."""
    return mode.name == "foreground" or (mode.name == "background" and bool(getattr(strategy, "whole_graph", False)))


# The context variables a capture sets, in the order _capture_entry sets them.
_CAPTURE_VARS = (runtime.batch, runtime.axis_rows, runtime.capture_strategy, runtime.background_capture, runtime.foreground_layout)


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
    if lazily:
        notes.append("; the next refresh() captures every key not captured again")
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


_gc_lock = threading.Lock()
_gc_pauses = [0, False]  # pauses in force (any thread), and whether the collector was on before the first


class PausedGC:
    """No garbage collection while one entry is captured, on any thread: the collector comes back on when the
    last pause ends (a capture thread's pause ending must not turn it on under a foreground capture).

    ``_FrozenGC`` collects first, which would hold the GIL (and stall a serving thread) for as
    long as a full collection takes; this only pauses the collector.
    """

    def __enter__(self) -> None:
        with _gc_lock:
            if _gc_pauses[0] == 0:
                _gc_pauses[1] = gc.isenabled()
                gc.disable()
            _gc_pauses[0] += 1

    def __exit__(self, *exc: object) -> None:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


_heap_lock = threading.Lock()
# capture threads at work, whether the first froze the heap, how many objects it froze, and the collector's third
# threshold before it put the full collection off (None: it did not)
_heap_holds: list[Any] = [0, False, 0, None]
_NO_FULL = 2**30  # a third threshold no count of young collections reaches: the full collection waits


class FrozenHeap:
    """No full collection while capture threads work beside a serving thread: a capture makes many objects, and a
    full collection they set off, on either thread, would hold the GIL for the whole heap (0.2 s with a 1B model
    loaded).  A heap nobody froze is frozen (``gc.freeze``: collections then look only at objects made since) and
    thawed when the last capture thread runs out of work, before a wait for it returns.  A heap frozen before (by the
    engine, or by the interpreter's start-up) is not the capture's to thaw: the full collection is put off instead
    (the collector's third threshold) and that threshold is restored then.  A heap the engine froze once the capture
    was waited for stays frozen; one it froze while the capture ran is thawed with it, unless that froze more objects
    than the capture had (nothing tells the two freezes apart)."""

    def __enter__(self) -> None:
        with _heap_lock:
            if _heap_holds[0] == 0:
                _heap_holds[1] = gc.get_freeze_count() == 0
                if _heap_holds[1]:
                    gc.freeze()
                    _heap_holds[2] = gc.get_freeze_count()
                else:
                    first, second, _heap_holds[3] = gc.get_threshold()
                    gc.set_threshold(first, second, max(_heap_holds[3], _NO_FULL))
            _heap_holds[0] += 1

    def __exit__(self, *exc: object) -> None:
        with _heap_lock:
            _heap_holds[0] -= 1
            if _heap_holds[0] == 0 and _heap_holds[1]:
                _heap_holds[1] = False
                if gc.get_freeze_count() <= _heap_holds[2]:  # frozen objects only die meanwhile, unless someone froze more
                    gc.unfreeze()
            elif _heap_holds[0] == 0 and _heap_holds[3] is not None:
                first, second, third = gc.get_threshold()  # the first two as the engine may have set them meanwhile
                if third == max(_heap_holds[3], _NO_FULL):  # unless someone set the third meanwhile
                    gc.set_threshold(first, second, _heap_holds[3])
                _heap_holds[3] = None


class _FrozenGC:
    """No garbage collection (and no tensor finaliser) while graphs are being captured: the heap frozen (a caller's
    own frozen heap is left alone) and the collector paused.  First a collection: a full one where ``collect`` says
    garbage may hold device memory the capture could use (a backend's ``collects_before_capture``), else of the young
    generations alone (their garbage would otherwise be frozen, and thawed into the oldest generation, where only a
    full collection reaches it)."""

    def __init__(self, collect: bool = True) -> None:
        self._collect = collect

    def __enter__(self) -> None:
        self._freeze = gc.get_freeze_count() == 0
        if self._freeze:
            gc.collect(2 if self._collect else 1)
            gc.freeze()
        self._pause = PausedGC()
        self._pause.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self._pause.__exit__()
        finally:
            if self._freeze:
                gc.unfreeze()
