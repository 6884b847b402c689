"""The capture job: which keys a registry may capture, and capturing them, in one sequence for every path.

It checks plans (the strategy is registered and serves the key's class, the key fits the static inputs), holds the one
capture context every capture runs under (the ``context=`` payload and the serving thread's state, see
:mod:`cgregistry.capture.serving_state`), and captures a key in two pieces: ``warm_up``, then ``record_graph`` (between
the capture_started and capture_finished hooks, one capture at a time into the pool, the entry live as it ends).
``capture_key`` runs both at once (a plan now: ``capture_plan``; a lazy key: ``capture_lazily``), the pending captures
of :mod:`cgregistry.capture.queue` in separate steps.  A :class:`Mode` says where a capture goes: ``FOREGROUND``, or
:func:`scratch` (measured and dropped: the memory estimate).

Capture runs the engine's step for real (a warm-up first, unless ``warm_up_again=False`` skips it for a key captured
again), which writes engine state such as a KV cache at the slots it reads: so every capture runs on buffers reset to
their fills (a scratch slot for index inputs), never on a served batch's rows.  A failure is a ``CaptureError`` and
changes nothing but the pool handle; the collector is paused while a piece runs, and nothing else is touched.  A hook or
the step calling back into the registry from inside a capture is refused (``refuse_inside``): a ``clear()`` would drop
the capture context mid-plan, a ``capture()`` would wait for the capture lock its own thread holds.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import numbers
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, NoReturn

import attrs
import torch

from cgregistry.capture.pool import GraphPool
from cgregistry.contracts.protocols import Backend
from cgregistry.errors import CaptureError, ConcurrentRunError, PluginError, ServingStateError, WeightsMovedError
from cgregistry.hooks.events import Events
from cgregistry.hooks.manager import Plugins
from cgregistry.inspection import CapturePhases, EntryInfo
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.key.classes import check_serves
from cgregistry.plan.build import CapturePlan, PlanEntry
from cgregistry.contracts import runtime
from cgregistry.contracts.runtime import BreakContext
from cgregistry.capture.serving_state import RECORDED_AT_CAPTURE, ServingState, StateTest
from cgregistry.weights.watch import Reached, WeightWatch
from cgregistry.store.catalog import Catalog, Entry, Pair
from cgregistry.store.io import OutputAxes, StaticBuffer, capture_inputs, check_fits, checked_outputs, output_slicer
from cgregistry.messages import warn

__all__ = ["FOREGROUND", "UNWARMED", "CaptureContext", "CaptureError", "CaptureJob", "Mode", "Warmed", "paused_gc", "scratch"]

_log = logging.getLogger("cgregistry")


@attrs.frozen(slots=True)
class Mode:
    """Where a capture goes and what it runs on: ``foreground``, the shared pool and static inputs (reset to their
    fills), the entry going live; ``scratch``, measured and dropped (a memory estimate), into ``pool`` (None: one of its
    own) on ``inputs`` (buffers as large as the registry's, at their fills; None: its own, sized for the key)."""

    name: Literal["foreground", "scratch"]
    pool: Any = None
    inputs: Mapping[str, StaticBuffer] | None = None


FOREGROUND = Mode("foreground")


def scratch(pool: Any = None, inputs: Mapping[str, StaticBuffer] | None = None) -> Mode:
    """A capture to be measured and dropped (see :class:`Mode`)."""
    return Mode("scratch", pool, inputs)


@attrs.define(slots=True)
class Warmed:
    """A key's capture between its two pieces: what its recording (``CaptureJob.record_graph``) needs of its warm-up
    (``spec`` ``UNWARMED``: none ran, the recording warms the key up first, a capture in one call)."""

    pair: Pair
    context: CaptureContext
    spec: Any  # the output spec the warm-up found, the one known from an earlier capture where it was skipped, or UNWARMED
    seconds: float = 0.0  # what the warm-up took, compiling included
    compile_seconds: float = 0.0
    compiled: bool = False  # it compiled or ran compiled code: the key warms up at every capture
    used_before: int = 0  # device bytes in use as it began (what the key's capture takes is measured from there)
    skipped: bool = False  # no warm-up ran (warm_up_again=False and a spec known): a failed recording warms up and retries


UNWARMED = object()  # a Warmed whose warm-up has not run


class paused_gc:
    """No collection while a piece of a capture runs on this thread (a finaliser freeing memory beside the recording);
    the collector as it was afterwards (a class: a capture walks no other module for it)."""

    def __enter__(self) -> None:
        self._enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            gc.enable()


@attrs.frozen(slots=True)
class CaptureContext:
    """What every capture of a registry runs under, whichever path captures: the payload eager breaks see
    (``capture(context=...)``) and the serving thread's state.  Equal when a capture under either computes the same (the
    same payload object, equal states; context variables are carried, not compared): a key warmed up under another
    context than the registry's now is warmed up again before it is recorded."""

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
        self.buffers = buffers  # the shared static inputs every graph reads
        self.backend = backend
        self.device = backend.device()
        self._output_axes = output_axes
        self._warmup_runs = warmup_runs
        self.pool = pool  # its lock: one capture at a time into the pool, any registry's sharing it
        self.pool.share(self)
        self._catalog = catalog
        self._events = events
        self._plugins = plugins
        self._strategies = plugins.strategies  # looked up by name at each capture
        self.name = name
        slots = [b.capacity - (b.spec.axis == "reqs+1") for b in buffers.values() if b.spec.axis != "tokens"]
        self._request_slots = min(slots) if slots else None  # request rows a relaxed key's step sees
        # Per thread: .depth, the captures (one piece with its hooks) in progress on it, and .warmed, whether a key was
        # warmed up on it (its lazy per-thread state made: cuBLAS handles, say).
        self._here = threading.local()
        self.context: CaptureContext | None = None
        self.state_test = StateTest()  # the hot path's test of the caller's state against the context's (changed in place)
        self.watch = WeightWatch()  # the tensors graphs read: each entry keeps where they were at its capture
        self.watch.watch((f"static input {n!r}", buf.tensor) for n, buf in buffers.items())
        # With warm_up_again off, the output spec of each key captured with nothing compiled or compiling: a later
        # capture of it on a thread that has warmed up a key before (its lazy per-thread state made) skips the warm-up.
        self._warm_up_again = warm_up_again
        self._warm_specs: dict[Pair, Any] = {}
        self._said_unseen = False
        self._warned_no_break = False
        self._said_uncovered = False
        self._reached: Reached = Reached([], [], [])  # what the step is given, and what the registry cannot see
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
            found = held.state.differences()
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
        """Watch every module and tensor the step is given (itself, a bound method's object, closure cells, ``partial``
        arguments, and what they hold); looked for again at each ``capture()`` and ``refresh()``, so one made or rebound
        since is seen.  ``rebase``: where no graph is held, every watched address is taken anew as its baseline."""
        held = self.holds_graphs()  # what is new to the step now, its graphs miss
        self._reached = self.watch.watch_step(self.step, added=held, rebase=rebase and not held)

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
            said = [f"{r.key_class}{'' if r.spec_depth in (None, 0) else f' (spec {r.spec_depth})'}"
                    f"{f' with {r.num_active_loras} LoRAs' if r.num_active_loras else ''} batches of {r.min_tokens}-"
                    f"{r.max_tokens} tokens{' (over the padding cap)' if r.reason == 'padding_cap' else ''}"
                    for r in ranges[:4]]
            more = f" and {len(ranges) - 4} more ranges" if len(ranges) > 4 else ""
            _log.info("registry %r: no key serves %s%s: they run eagerly (plan.uncovered() lists them)",
                      self.name, "; ".join(said), more)

    def say_unseen(self) -> None:
        """Once per registry, a warning naming what ``run()`` cannot check: what the registry cannot see (a module-level
        model or tensor, a context variable, a table too large to look into), and the modules the step reads through
        attributes of plain objects (a rebound attribute, ``engine.model = new``, is found by ``refresh()`` only). Where
        the engine named what its step reads (``watch=``), the ``cgregistry`` log (INFO) says it instead."""
        if self._said_unseen:
            return
        self._said_unseen = True
        unseen, attributes = self._reached.unseen, self._reached.attributes
        said = []
        if unseen:
            said.append(f"the step reads {', '.join(unseen[:4])}, which the registry cannot see: a weight replaced there "
                        "goes unseen and graphs would read the old memory; name it with GraphRegistry(..., watch=[...]) "
                        "(then an assign sync there is refused until reg.refresh())")
        if attributes:
            said.append(f"the step reads {', '.join(attributes[:4])} through attributes of plain objects: a weight "
                        "replaced inside is caught, but the attribute rebound to another module (engine.model = "
                        "new_model) is found by reg.refresh() only, so call it after such a rebind; GraphRegistry(..., "
                        "watch=[...]) naming the modules says the engine knows")
        if not said:
            return
        if self.watch.named:
            _log.info("registry %r: %s", self.name, "; ".join(said))
            return
        warn(f"cgregistry: registry {self.name!r}: {'; '.join(said)}. Weights loaded in place (reg.load_weights) keep "
             "every graph valid whatever holds them; debug=True checks every watched address before each replay")

    def forget(self) -> None:
        """No context (after ``clear()``): the next capture request records one, and every key warms up again."""
        self.context = None
        self.state_test.passing()
        self._warm_specs.clear()

    def refuse_other_state(self) -> None:
        """After ``state_test()`` said no: ``ServingStateError`` naming how the caller's state differs in what a replay
        computes; a difference that changes no result (grad mode) is compared with from now on."""
        if self.context is not None:
            self.context.state.check(self.name)
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

    # ---------------------------------------------------------------- calls back

    def refuse_inside(self, call: str) -> None:
        """``call`` from a hook or the step inside a capture on this same thread: refused (a ``clear()`` would drop the
        capture context the rest of the plan runs under, a ``capture()`` would wait for the lock its capture holds)."""
        if getattr(self._here, "depth", 0):
            raise ConcurrentRunError(
                f"{call} on registry {self.name!r} from inside one of its captures on the same thread (a hook or the "
                f"step called it while capturing): refused, the capture in progress would wait for itself or lose its "
                f"context; call it after capture() (or the run() that captures) returns"
            )

    def holds_graphs(self) -> bool:
        """Whether this registry holds graphs or has captures in flight (its pool is not to be renewed)."""
        return bool(self._catalog.entries or self._catalog.capturing)

    def renew_if_unused(self, release: bool = False) -> None:
        """When no graph holds or will hold the pool: debug mode's addresses recorded again, and a fresh pool
        (``GraphPool.renew_if_unused``) to ``release`` its memory or where the old one takes no more captures."""
        if not self.holds_graphs():
            if self.pool.used or (release and self.pool.kept):
                self.pool.renew_if_unused(release)
            self.watch.rebase()

    # ---------------------------------------------------------------- capturing

    def prepare(self, plan: Any, payload: Any, rebase: bool = False) -> list[Pair]:
        """What ``capture(plan)`` does before it captures or queues anything: refuse a call from inside a capture, check
        every entry, adopt the plan's strategy order (where the registry follows plans), record the capture context
        (``rebase``: as ``watch_step``), say what the plan leaves uncovered; the plan's pairs, each once, in order."""
        self.refuse_inside("capture()")
        todo = self.check(plan)
        if self._catalog.follows_plans and isinstance(plan, CapturePlan):  # its decode strategy first
            self._catalog.follow_plan((e.descriptor, e.strategy) for e in todo)
        self.record(payload, rebase=rebase)
        self.say_unseen()
        self.say_uncovered(plan)
        return list(dict.fromkeys((e.descriptor, e.strategy) for e in todo))

    def capture_plan(self, plan: Any, payload: Any, progress: bool | None) -> list[EntryInfo]:
        """``capture(plan)`` in the foreground with nothing pending: ``prepare``, then capture what is not captured
        yet (``capture_all``)."""
        entries = self._catalog.entries
        pairs = [p for p in self.prepare(plan, payload, rebase=True) if p not in entries]
        try:
            return self._capture_all(pairs, progress)
        finally:
            self.warn_shadowed()

    def capture_key(self, pair: Pair, ctx: CaptureContext) -> Entry:
        """Capture one key now, warm-up and recording in one piece; the entry is live (evictions reported).  What the
        step raises is a ``CaptureError`` naming the key (a KeyboardInterrupt stays one)."""
        return self.record_graph(self.warm_up(pair, ctx, now=False))

    def warm_up(self, pair: Pair, ctx: CaptureContext, between_steps: bool = False, now: bool = True) -> Warmed:
        """A key's first piece: the step run eagerly under ``ctx`` on buffers at their fills, its outputs checked (a
        failure: the key's ``CaptureError``, told to the capture hooks); skipped with ``warm_up_again=False`` for a key
        captured before on a thread that warmed one up, left to the recording with ``now=False``.  ``between_steps``:
        inside ``run()`` or ``capture_pending()`` (the backend waits for the capture's streams only)."""
        key, name = pair
        used_before = self._device_used()
        spec = (self._warm_specs.get(pair, UNWARMED) if not self._warm_up_again and getattr(self._here, "warmed", False)
                else UNWARMED)
        if spec is not UNWARMED or not now:
            return Warmed(pair, ctx, spec, used_before=used_before, skipped=spec is not UNWARMED)
        with _Piece(self, between_steps):
            try:
                warmed = ctx.state.run(self._warm, pair, ctx, used_before)
            except BaseException as exc:
                self._events.capture_started(key, name)
                self._raise_failure(pair, exc)
        return warmed

    def record_graph(self, warmed: Warmed, between_steps: bool = False, queued: bool = False) -> Entry:
        """A key's second piece: between the capture_started and capture_finished hooks, one capture at a time into the
        pool, its graph recorded under the context it warmed up under (warmed up first where it was not; a skipped
        warm-up runs after a failed recording, which is retried, unless in a process group); the entry goes live
        (evictions reported).  ``queued``: a pending key (``stats().background_captures``)."""
        key, name = pair = warmed.pair
        pool = self.pool
        with _Piece(self, between_steps):
            pool.begin(self.name, key, name)  # its lock, held for this capture (refused if this thread holds it)
            entry = None
            try:
                self._events.capture_started(key, name)
                generation = self.watch.generation  # taken first: a move during the capture makes it older
                with self.pool_streams():  # the pool's own streams, whichever registry captures into it
                    entry = self._record_or_retry(warmed)
                entry.generation = generation
            except BaseException as exc:
                self._raise_failure(pair, exc)
            finally:
                pool.end(entry)
            if not self._warned_no_break and entry.read_live_batch and not key.uniform and getattr(entry.graph, "breaks", None) == 0:
                self._warned_no_break = True  # once: a mixed key that read the batch outside an eager break
                warn(
                    f"cgregistry: registry {self.name!r} captured the mixed key {key} [{name}] with no eager break, "
                    "and the step read current_batch().actual or .payload while it was recorded: the whole step is "
                    "one graph, and the host code that read the batch ran once, at capture. Mark such functions with "
                    "@cgregistry.eager_break"
                )
            evicted = self._catalog.add(entry, background=queued)
            self._events.capture_finished(key, name, entry, None)
            if evicted:
                self._events.evicted(evicted)
        return entry

    def _raise_failure(self, pair: Pair, exc: BaseException) -> NoReturn:
        """A piece of ``pair``'s capture raised ``exc`` (being handled): capture_finished told, then a ``CaptureError``
        naming the key raised (an interrupt stays itself)."""
        error = CaptureError(*pair, exc) if isinstance(exc, Exception) and not isinstance(exc, CaptureError) else exc
        self._events.capture_finished(*pair, None, error if isinstance(error, CaptureError) else CaptureError(*pair, exc))
        if error is exc:
            raise
        raise error from exc

    def pool_streams(self) -> contextlib.AbstractContextManager[Any]:
        """A capture into this job's pool, or one measured for it, runs on the pool's streams where the backend keeps
        them (cuda: ``streams_of``): free blocks are reused only on the stream they came from."""
        streams_of = getattr(self.backend, "streams_of", None)
        return streams_of(self.pool) if streams_of is not None else contextlib.nullcontext()

    def capture_all(self, pairs: list[Pair], progress: bool | None, *, untried_lazily: bool = False) -> list[EntryInfo]:
        """Capture ``pairs`` in order, now.  A failure stops its strategy's later keys, not the other strategies'; each
        failed key is kept in the catalog's failures, then the first failure is raised, naming the others.
        ``untried_lazily``: keys held before (a refresh, a wake) that were not tried are planned lazily, never lost (the
        caller keeps them owed)."""
        self.renew_if_unused()
        return self._capture_all(pairs, progress, untried_lazily=untried_lazily)

    def _capture_all(self, pairs: list[Pair], progress: bool | None, *, untried_lazily: bool = False) -> list[EntryInfo]:
        if progress is None:
            progress = len(pairs) > 1 and sys.stderr.isatty()
        ctx = self.current()
        bar: Iterable[Pair] = pairs
        if progress:
            from tqdm import tqdm

            bar = tqdm(pairs, desc="capturing graphs", unit="graph", leave=False)
        captured: list[EntryInfo] = []
        failed: dict[str, CaptureError] = {}  # strategy -> its first failure
        skipped: list[Pair] = []
        backend = self.backend.name
        if getattr(self.backend, "collects_before_capture", True):
            gc.collect()  # garbage may hold device memory the graphs would otherwise be captured beside
        try:
            for pair in bar:
                if pair[1] in failed:
                    skipped.append(pair)
                    continue
                try:
                    captured.append(self.capture_key(pair, ctx).info(backend))
                except CaptureError as error:
                    self._catalog.fail_capture(pair, error)  # kept as the lazy and pending paths keep theirs
                    failed[pair[1]] = error
        except BaseException:  # an interrupt: keys held before that are not captured yet stay planned, never lost
            if untried_lazily:
                entries = self._catalog.entries
                self._catalog.plan_lazily(p for p in pairs if p not in entries and p[1] not in failed)
            raise
        finally:
            if hasattr(bar, "close"):
                bar.close()
        if failed:
            if untried_lazily and skipped:
                self._catalog.plan_lazily(skipped)
            raise _summary(failed, skipped, captured, lazily=untried_lazily)
        return captured

    def capture_lazily(self, pair: Pair) -> None:
        """Capture a lazy key on its first use, inside ``run()``; a failure drops it (its batches go to the next best
        key, or run eagerly)."""
        self.renew_if_unused()
        try:
            self.record_graph(self.warm_up(pair, self.current(), now=False), between_steps=True)
        except CaptureError as exc:
            self._catalog.fail_capture(pair, exc)
            warn(
                f"cgregistry: lazy {exc}; the key is dropped and the step goes on to the next best key (or runs eagerly)")
        else:
            self._catalog.counters.lazy_captures += 1

    def capture_entry(self, key: BatchDescriptor, strategy_name: str, strategy: Any, payload: Any, mode: Mode) -> Entry:
        """Warm up and record ``step(key, **views)`` with ``strategy`` where ``mode`` says (a scratch capture: the
        memory estimate); ``payload`` is what eager breaks see.  Takes no lock and calls no hook."""
        warmed = Warmed((key, strategy_name), None, UNWARMED, used_before=self._device_used())  # type: ignore[arg-type]
        return self._record(strategy, payload, mode, warmed)

    def _device_used(self) -> int:
        """Bytes in use on the device where the backend measures them, else 0."""
        device_memory = getattr(self.backend, "device_memory", None)
        return device_memory()[0] if device_memory is not None else 0

    def _warm(self, pair: Pair, ctx: CaptureContext, used_before: int) -> Warmed:
        """The warm-up piece's work, under the capture context: ``pair``'s step run eagerly on its buffers at their
        fills, as a capture's step sees its batch."""
        key, name = pair
        strategy = self.strategy(name)
        views = capture_inputs(self.buffers, key)
        with _CaptureVars(key, strategy, ctx.payload, views) as clock:
            spec, seconds = self._run_warm_up(key, views)
        return Warmed(pair, ctx, spec, seconds, clock["compile"], bool(clock["compile"] or clock.get("compiled runs")),
                      used_before)

    def _run_warm_up(self, key: BatchDescriptor, views: Mapping[str, torch.Tensor]) -> tuple[Any, float]:
        """The step run eagerly for ``key`` on ``views`` (``warmup_runs`` times, on the backend's warm-up stream), its
        outputs checked: their spec and the seconds it took."""
        step = self.step
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.backend.warmup(lambda: step(key, **views), self._warmup_runs)
            _, spec = checked_outputs(out, self._output_axes, key, self._request_slots, self.device)
            del out
        self._here.warmed = True
        return spec, time.perf_counter() - started

    def _record_or_retry(self, warmed: Warmed) -> Entry:
        """``warmed``'s recording under its context; one whose warm-up was skipped and that failed (a handle the step
        makes on a first run cannot be made inside a capture) is warmed up and recorded again, unless ranks of a process
        group would then run collectives the others do not."""
        (key, name), ctx = warmed.pair, warmed.context
        if not warmed.skipped:
            return ctx.state.run(self._record_read, warmed)
        started = time.perf_counter()
        try:
            return ctx.state.run(self._record_read, warmed)
        except CaptureError as exc:
            self._warm_specs.pop(warmed.pair, None)
            if _in_process_group():  # a warm-up on this rank alone would pair its collectives with other steps'
                raise
            _log.info("registry %r: %s [%s] captured without a warm-up failed (%s: %s); warming it up and capturing "
                      "again", self.name, key, name, type(exc.__cause__).__name__, exc.__cause__)
        again = Warmed(warmed.pair, ctx, UNWARMED, time.perf_counter() - started, used_before=warmed.used_before)
        return ctx.state.run(self._record_read, again)

    def _record_read(self, warmed: Warmed) -> Entry:
        """``_record`` into the registry's pool, with what its graph reads (``entry.weights``) read in the capture
        context, where the step's context variables are the engine's (a model in a ContextVar)."""
        generation, first = self.watch.generation, not self._catalog.entries
        weights = self.watch.seen()
        entry = self._record(self.strategy(warmed.pair[1]), warmed.context.payload, FOREGROUND, warmed)
        if self.watch.generation != generation:  # the step registered tensors while it was captured
            weights = self.watch.joined(weights)
        if first:  # no graph before this one: what it reads is there from the start
            self.watch.settle(weights)
        entry.weights = weights
        return entry

    def _record(self, strategy: Any, payload: Any, mode: Mode, warmed: Warmed) -> Entry:
        """The step recorded into a graph for ``warmed``'s key with ``strategy`` on buffers at their fills (warmed up
        first where it was not), outputs checked against the warm-up's spec: the entry, not live yet."""
        key, strategy_name = warmed.pair
        backend = self.backend
        graph_pool = self.pool
        pool = (mode.pool if mode.pool is not None else backend.new_pool()) if mode.name == "scratch" else graph_pool.handle
        views = capture_inputs(self.buffers if mode.inputs is None else mode.inputs, key)
        step = self.step
        recording = runtime.Recording()
        with _CaptureVars(key, strategy, payload, views) as clock:
            try:
                warm_s, spec = warmed.seconds, warmed.spec
                if spec is UNWARMED:  # warmed up here, on the same buffers: a capture in one piece
                    spec, warm_s = self._run_warm_up(key, views)
                    warmed = Warmed(warmed.pair, warmed.context, spec, warmed.seconds + warm_s, clock["compile"],
                                    bool(clock["compile"] or clock.get("compiled runs")), warmed.used_before)
                started, compiled_before = time.perf_counter(), clock["compile"]
                with torch.inference_mode():
                    recording_token = runtime.recording.set(recording)
                    try:
                        graph, out = strategy.capture(lambda: step(key, **views), backend, pool)
                    finally:
                        runtime.recording.reset(recording_token)
                    backend.synchronize()
                    slicer = output_slicer(out, self._output_axes, key, self._request_slots, self.device, spec,
                                           backend.share_outputs)
                    del out
                    memory = getattr(graph, "memory_bytes", None)  # it feeds the budget: a byte count
                    if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory < 0:
                        raise PluginError(f"strategy {strategy_name!r} reported memory_bytes={memory!r} for its graph; "
                                          "expected a byte count >= 0")
            except BaseException as exc:  # a KeyboardInterrupt too leaves the pool to recover
                if pool is graph_pool.handle:
                    graph_pool.recover()
                pool = None  # a scratch pool goes with the failed capture (the error's frames outlive it)
                if not isinstance(exc, Exception):
                    raise
                raise CaptureError(key, strategy_name, exc) from exc
            seconds = time.perf_counter() - started
            compiled = clock["compile"] - compiled_before
        if mode.name != "scratch" and not self._warm_up_again:
            if compiled or clock.get("compiled runs") or warmed.compiled:
                self._warm_specs.pop(warmed.pair, None)  # a guard failing later would compile inside a capture
            else:
                self._warm_specs[warmed.pair] = spec
        entry = Entry(key, strategy_name, graph, slicer, warmed.seconds + seconds)
        entry.phases = CapturePhases(warmed.compile_seconds + compiled, max(0.0, warmed.seconds - warmed.compile_seconds),
                                     max(0.0, seconds - compiled - clock["instantiate"]), clock["instantiate"])
        if getattr(backend, "device_memory", None) is not None:  # what the device gave this capture: pool, warm-up, driver objects
            entry.device_bytes = max(0, self._device_used() - warmed.used_before)
        entry.read_live_batch = recording.live_batch_reads > 0
        return entry


class _Piece:
    """One piece of a capture on this thread: the hooks' and the step's calls back refused meanwhile, the collector
    paused, and where it runs (between the engine's steps, or in a capture() of its own) told to the backend."""

    def __init__(self, job: CaptureJob, between_steps: bool) -> None:
        self._here = job._here
        self._between_steps = between_steps
        self._gc = paused_gc()

    def __enter__(self) -> None:
        here = self._here
        here.depth = getattr(here, "depth", 0) + 1
        self._token = runtime.between_steps.set(self._between_steps)
        self._gc.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._gc.__exit__()
        runtime.between_steps.reset(self._token)
        self._here.depth -= 1


class _CaptureVars:
    """What the step sees while a capture runs it (the batch with the payload eager breaks read, the axes' row counts
    the piecewise compiler makes symbolic, the strategy), and the phase clock that fills ``entry.phases``."""

    def __init__(self, key: BatchDescriptor, strategy: Any, payload: Any, views: Mapping[str, torch.Tensor]) -> None:
        self._values = ({"compile": 0.0, "instantiate": 0.0}, BreakContext(key, key, payload),
                        frozenset(v.shape[0] for v in views.values()) | {key.num_tokens}, strategy)

    def __enter__(self) -> dict[str, float]:
        _watch_compiles()
        self._tokens = [var.set(value) for var, value in zip(_CAPTURE_VARS, self._values)]
        return self._values[0]

    def __exit__(self, *exc: object) -> None:
        for var, token in zip(_CAPTURE_VARS, self._tokens):
            var.reset(token)
        _watch_compiles()  # again: the step may have loaded dynamo


def _in_process_group() -> bool:
    """Whether torch.distributed runs with more than one rank (a rank's own retry would desynchronise collectives)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


_watch_lock = threading.Lock()


def _watch_compiles() -> None:
    """Time dynamo's compiles (``torch.compile``, ``reg.compile``) into the capture in progress on their thread, through
    dynamo's compile callbacks, registered once dynamo is imported (``torch._dynamo.reset()`` clears them; the next
    capture registers them again). Outside a capture they do nothing."""
    callback = sys.modules.get("torch._dynamo.callback")
    if callback is None or _compile_started in callback.callback_handler.start_callbacks:
        return
    with _watch_lock:
        if _compile_started not in callback.callback_handler.start_callbacks:
            callback.callback_handler.register_start_callback(_compile_started)
            callback.callback_handler.register_end_callback(_compile_ended)


def _compile_started(args: Any = None) -> None:
    runtime.begin_phase("compile")


def _compile_ended(args: Any = None) -> None:
    runtime.end_phase("compile")


# The context variables a capture sets, in the order _CaptureVars sets them.
_CAPTURE_VARS = (runtime.phase_clock, runtime.batch, runtime.axis_rows, runtime.capture_strategy)


def _summary(failed: dict[str, CaptureError], skipped: list[Pair], captured: list[EntryInfo], lazily: bool = False) -> CaptureError:
    """The first failure of a plan's capture (its cause as ``__cause__``), with what each other failing strategy raised,
    what was not tried and what was captured."""
    first = next(iter(failed.values()))
    notes = []
    for strategy, e in list(failed.items())[1:]:
        cause = _cause(e)
        notes.append(f"; strategy {strategy!r} failed too, capturing {e.descriptor}: {type(cause).__name__}: {cause}")
    by_strategy = collections.Counter(strategy for _, strategy in skipped)
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
