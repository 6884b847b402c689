"""GraphRegistry: the engine's one object, a facade that checks arguments and wires single-job parts together.

- :class:`~cgregistry.store.catalog.Catalog`: entries, lazy keys, keys being captured, failures, budget, counters, routes;
- :class:`~cgregistry.hooks.events.Events`: every hook call, one typed method each;
- :class:`~cgregistry.capture.job.CaptureJob`: plan checks, the capture context, the one capture sequence (its mode a value);
- :class:`~cgregistry.capture.pool.GraphPool`: the pool graphs go into, shareable between registries;
- :class:`~cgregistry.capture.queue.PendingCaptures`: keys captured between steps, in pieces, on the owner thread;
- :class:`~cgregistry.capture.refit.Adapter`: adaptation (counting steps, refits, applying changes);
- :class:`~cgregistry.server.Server`: the hot path, ``run()`` and ``match()`` (``DebugServer`` in debug mode), and
  :class:`~cgregistry.server.Owner`, the thread the registry belongs to.

Each part owns its state and keeps it consistent; none imports this module.  See docs/architecture.md.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import threading
import time
import weakref
from _thread import get_ident
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from datetime import datetime, timezone
from typing import Any

import torch

from cgregistry.capture.refit import PLAN_CHANGES_KEPT, Adapter, refuse_with_collectives
from cgregistry.arguments import Delegated, check_budget, check_capture_budget, check_flag, check_inputs, check_pool, check_timeout
from cgregistry.plan.adapt import Adaptation, PlanChange
from cgregistry.capture.queue import PendingCaptures
from cgregistry.store.io import OutputAxes, StaticBuffer, StaticInput, StaticInputs
from cgregistry.capture.job import CaptureJob
from cgregistry.capture.pool import GraphPool
from cgregistry.store.catalog import Catalog, Pair, not_a_descriptor
from cgregistry.strategies.compiler import PiecewiseCompiler, compile_piecewise
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.hooks.events import Events
from cgregistry.lifecycle import Lifecycle
from cgregistry.inspection import EntryInfo, Refreshed, Slept, Snapshot, Stats, entries_table, filter_entries, stats_line
from cgregistry.key.matcher import Explanation, Match, PaddingCap
from cgregistry.capture.memory import MemoryEstimate, Part, PoolEstimate, estimate
from cgregistry.plan.build import CapturePlan, PlanEntry
from cgregistry.hooks.manager import Plugins
from cgregistry.server import DebugServer, Owner, Server
from cgregistry.store.debug import Clock
from cgregistry.errors import CaptureError, ConcurrentRunError, OwnerThreadError
from cgregistry.messages import warn
from cgregistry.weights.load import load_in_place

__all__ = ["CaptureError", "ConcurrentRunError", "EntryInfo", "GraphRegistry", "OwnerThreadError", "Stats", "estimate_pool_memory"]  # records re-exported

_names = itertools.count(1)  # default registry names: registry-1, registry-2, ...
_joining = threading.Lock()  # registries joining a pool (GraphPool.registries, its debug clock), from any thread


class GraphRegistry:
    """Captured graphs for one step function, keyed by BatchDescriptor.

    ``step(batch, **inputs)`` is the engine's forward: it gets the padded key and views of the static buffers sized
    for it, and returns a tensor or pytree of tensors whose leading dimension is the padded token (or request) count,
    named by ``output_axis`` ("tokens", "reqs", "reqs+1", or a tree of them shaped like the output).  ``preference``:
    strategies, most preferred first; left out, each captured plan's order is adopted.  Outputs of ``run`` are views
    of graph memory, valid until the next ``run`` while the registry lives.  A registry belongs to one thread (its
    maker; ``adopt()`` moves it): another thread's ``run()`` or change raises ``OwnerThreadError``; ``call_on_owner``
    hands a call over.  ``watch``: modules or ``(name, tensor)`` pairs the step reads beside what it is given (a
    module-level model).  ``capture_budget``: seconds each ``run()`` may spend capturing pending keys before its step;
    None: an eager step's measured time; 0: never while serving (``capture_pending()`` in idle time instead).
    ``pool``: another registry's ``pool`` to capture into (a drafter's graphs beside its target's share memory).
    ``warm_up_again=False``: a key captured again skips its warm-up on a thread that warmed it up before (about half
    the time); only for a step that makes nothing lazily on a first run that may have been freed since, and calls no
    ``torch.compile`` of its own (docs/lifecycle.md).
    """

    def __init__(
        self,
        step: Callable[..., Any],
        inputs: Mapping[str, StaticInput],
        *,
        backend: str = "auto",
        output_axis: Any = "tokens",
        preference: Sequence[str] | None = None,
        warmup_runs: int = 1,
        plugins: Plugins | None = None,
        name: str | None = None,
        memory_budget: int | None = None,
        debug: bool = False,
        max_padding_tokens: int | None = None,
        max_padding_ratio: float | None = None,
        adapt: Adaptation | None = None,
        pool: GraphPool | None = None,
        warm_up_again: bool = True,
        capture_budget: float | None = None,
        watch: Any = None,
    ) -> None:
        if not callable(step):
            raise TypeError(f"step must be callable, got {step!r}")
        output_axes = OutputAxes(output_axis)
        if type(warmup_runs) is not int or warmup_runs < 1:
            raise ValueError(f"warmup_runs must be an int >= 1, got {warmup_runs!r}")
        check_flag("GraphRegistry", "warm_up_again", warm_up_again)
        check_budget(memory_budget)
        check_capture_budget(capture_budget)
        cap = PaddingCap(max_padding_tokens, max_padding_ratio)
        check_inputs(inputs)
        if adapt is not None and not isinstance(adapt, Adaptation):
            raise TypeError(f"adapt must be a cgregistry.Adaptation, got {adapt!r}")
        self.name = name if name is not None else f"registry-{next(_names)}"
        self.plugins = plugins if plugins is not None else Plugins()
        self.backend = self.plugins.backend(backend)
        if pool is not None:  # capture on the pool's backend object: its capture streams, since the caching allocator
            self.backend = check_pool(pool, self.backend).backend  # reuses a pool's free blocks only on their stream
        self.device = self.backend.device()
        self.output_axis = output_axis
        self.warmup_runs = warmup_runs
        self.debug = bool(debug)
        buffers = {key: StaticBuffer(key, spec, self.device) for key, spec in inputs.items()}
        events = Events(self.plugins, self, self.backend.name)
        chooser, chooser_names = events.chooser()
        self._catalog = catalog = Catalog(buffers, output_axes, preference, cap, memory_budget, chooser, chooser_names)
        self.pool = pool if pool is not None else GraphPool(self.backend)
        self._job = job = CaptureJob(step, buffers, self.backend, output_axes, warmup_runs, self.pool, catalog, events,
                                     self.plugins, self.name, warm_up_again=warm_up_again)
        if watch is not None:
            job.watch.watch(watch)
            job.watch.named = True
        if self.debug:  # debug mode also watches the module-level models the step's code names (checked every replay)
            job.watch.module_level = True
            job.watch_step()
        self._pending = pending = PendingCaptures(job, catalog, self.name, capture_budget)
        adapter = Adapter(adapt, catalog, job, pending, events, self.name) if adapt is not None else None
        # The changes adaptation made, oldest first: the last 256 (stats().plan_changes counts them all).
        self.plan_changes: collections.deque[PlanChange] = (
            adapter.plan_changes if adapter is not None else collections.deque(maxlen=PLAN_CHANGES_KEPT)
        )
        self._owner = owner = Owner(self.name)
        weakref.finalize(self, owner.cancel_handed)  # calls handed over to a registry that is gone never run
        parts = (step, catalog, job, pending, adapter, events, frozenset(buffers), self.name, owner)
        clock = self._join_pool()
        self._server = DebugServer(*parts, watch=job.watch, clock=clock) if self.debug else Server(*parts)
        self._lifecycle = Lifecycle(catalog, job, pending, adapter, events, buffers, self.backend, self.name)
        if type(self).run is _DEFINED_RUN:  # not overridden by a subclass (nor patched on the class): see run()
            self.run = self._server.run  # type: ignore[method-assign]  # the hot path itself: no call in between
        events.registry_created()

    def _join_pool(self) -> Clock | None:
        """This registry captures into its pool from now on; in debug mode, on the stale-output clock of the pool's
        debug registries (on CUDA a replay of any may overwrite the outputs of all).  A pool shared by registries in
        debug mode and others is warned about: the check does not see the others' replays."""
        pool = self.pool
        with _joining:
            others = [r for r in list(pool.registries) if r is not self]
            pool.registries.add(self)
            clock = None
            if self.debug:
                if pool.debug_clock is None:
                    pool.debug_clock = Clock()
                clock = pool.debug_clock
        unlike = [r.name for r in others if r.debug != self.debug]
        if unlike:
            debug, plain = ([self.name], unlike) if self.debug else (unlike, [self.name])
            warn(f"cgregistry: registr{'ies' if len(debug) > 1 else 'y'} {', '.join(map(repr, debug))} (debug=True) and "
                 f"{', '.join(map(repr, plain))} (debug=False) share one graph pool: a replay of any of them may overwrite "
                 "the outputs of all, and debug mode's stale-output check sees the replays of registries in debug mode "
                 "only; give every registry of a pool the same debug setting")
        return clock

    # Bytes of measured graph memory to stay under (least recently replayed entries are evicted); None: no limit.
    memory_budget = Delegated("_catalog", "memory_budget", check=check_budget)
    # Seconds each run() may spend capturing pending keys before its step; None: an eager step's time; 0: none.
    capture_budget = Delegated("_pending", "budget", check=check_capture_budget)
    # The most token padding a key may add to a batch (max_padding_tokens, max_padding_ratio).
    padding_cap = Delegated("_catalog", "cap")
    # What every capture runs under, whichever path captures: the payload of the latest ``capture(context=...)`` and
    # the state of the thread that recorded it (a ``CaptureContext``); None before any capture request or after clear().
    capture_context = Delegated("_job", "context")

    @property
    def preference(self) -> tuple[str, ...]:
        """Strategies, most preferred first: as given, or (given none) adopted from each captured plan, its decode
        strategy first."""
        return self._catalog.routes.preference

    @property
    def static_inputs(self) -> Mapping[str, torch.Tensor]:
        """The static input tensors that graphs captured in the foreground read, by name (read them to inspect
        padding or fills; a write changes what the next replay reads)."""
        return StaticInputs(self._job.buffers, self.name)

    # A torch.compile backend for this registry's ``piecewise`` entries (see cgregistry.strategies.compiler):
    # ``torch.compile(model, backend=reg.compile_backend(), dynamic=True, fullgraph=True)``.
    compile_backend = staticmethod(PiecewiseCompiler)
    # ``model`` compiled for ``piecewise`` entries: one dynamic trace, split at the eager breaks; call it from the step
    # (see cgregistry.compile_piecewise for the options).
    compile = staticmethod(compile_piecewise)

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

        Every entry is checked first (strategy registered, key fits the static inputs, class served): a refused plan
        changes nothing.  A failed key is absent (kept in ``failures()``) and its strategy's later keys are not tried;
        every other key is captured, then ``CaptureError`` names it (and the other failures); captured entries stay.
        ``lazy=True``: each key is captured by the first ``run`` it is the best match for (``stats().lazy_captures``).
        ``context``: the payload eager breaks see through ``current_batch()``, describing the all-padding batch capture
        runs on (docs/integration.md).  It and the calling thread's state (autocast, default dtype and device, CUDA
        device, context variables) become the capture context every later capture runs under (``context=None`` keeps the
        payload recorded before); a replay under another state raises ``ServingStateError``.

        ``background=True`` returns at once: keys are captured on this thread in pieces (warm-up, recording), each
        ``run()`` taking some before its step within ``capture_budget`` (largest key of each family first, then from the
        smallest up, a key a step needs first), ``capture_pending(seconds)`` in idle time; ``wait_captured()`` captures
        the rest now (docs/background.md).
        """
        if type(lazy) is not bool or type(background) is not bool or (progress is not None and type(progress) is not bool):
            check_flag("capture", "lazy", lazy)  # the checks run only when a flag is off (no calls on the usual path)
            check_flag("capture", "background", background)
            if progress is not None:
                check_flag("capture", "progress", progress)
        if lazy and background:
            raise ValueError("capture(lazy=True, background=True): choose one; lazy captures a key at its first use, background ahead of it")
        with self._busy("capture()", touches=not (lazy or background)):  # only a capture now writes the buffers
            return self._capture(plan, progress, lazy, context, background)

    def _capture(self, plan: CapturePlan | Iterable[PlanEntry | tuple[BatchDescriptor, str]], progress: bool | None,
                 lazy: bool, context: Any, background: bool) -> list[EntryInfo]:
        if self._lifecycle.asleep is not None:
            self._lifecycle.refuse_asleep("capture()")
        if not (lazy or background or self._pending.busy):
            return self._job.capture_plan(plan, context, progress)  # the foreground: one job, nothing pending
        job = self._job
        if background:
            refuse_with_collectives()
        prepared = job.prepare(plan, context)
        pairs = [p for p in prepared if p not in self._catalog.entries]
        if background:
            job.renew_if_unused()
            self._pending.submit(pairs)
            return []
        self._pending.discard(pairs)  # captured here instead: no longer pending
        if lazy:
            self._catalog.plan_lazily(pairs)
            job.warn_shadowed()
            return []
        try:
            return job.capture_all(pairs, progress)
        finally:
            job.warn_shadowed()

    def capture_pending(self, seconds: float | None) -> bool:
        """Capture pending keys for up to ``seconds`` of idle time the engine has (a piece is never cut short: one starts
        only while it is expected to fit in the time left); True when nothing is left pending.  Calls handed over with
        ``call_on_owner`` run first.  None: until nothing is left.  On the owner thread, between steps."""
        check_timeout("capture_pending", seconds, name="seconds")
        self._server.guard("capture_pending()")
        self._job.refuse_inside("capture_pending()")
        self._owner.run_handed()
        with self._busy("capture_pending()"):
            self._pending.work(math.inf if seconds is None else seconds)
        return not self._pending.busy

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Every pending key captured: on the owner thread, now (calls handed over first); on another thread, by the
        owner's steps, waited for.  False if ``timeout`` seconds passed first.  Never from inside a step or a hook."""
        check_timeout("wait_captured", timeout)
        owner = self._owner
        if owner.elsewhere():
            return self._pending.wait(timeout)
        self._server.guard("wait_captured()")
        self._job.refuse_inside("wait_captured()")
        self.pool.refuse_if_held("wait_captured()", self.name)
        owner.run_handed()
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._busy("wait_captured()"):
            while self._pending.busy:  # a piece is never cut short: the last one may end past the deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pending.work(left, first=True)
        return True

    def call_on_owner(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Hand ``fn(*args, **kwargs)`` to the owner thread, from any thread: it runs at the start of the owner's next
        ``run()`` (or ``capture_pending()``, ``wait_captured()``), before that step, so it never runs beside a replay (a
        weight sync and ``reg.refresh()``, say).  A ``concurrent.futures.Future`` of its result; an error goes there."""
        if not callable(fn):
            raise TypeError(f"call_on_owner() takes a callable, got {fn!r}")
        return self._owner.hand(fn, args, kwargs)

    def adopt(self) -> None:
        """The calling thread owns the registry from now on (it serves it, and changes its graphs): the engine moved
        its serving loop to this thread.  Refused while a ``run()`` is in progress."""
        if self._owner.busy:
            raise ConcurrentRunError(f"adopt() on registry {self.name!r} while a run() or a capture is in progress: call "
                                     "it once the old owner has stopped serving")
        self._owner.take()

    @property
    def owner(self) -> str:
        """The name of the thread the registry belongs to: it serves the registry and changes its graphs."""
        return self._owner.name

    def _busy(self, call: str, *, touches: bool = True) -> _Busy:
        """``call`` runs the step or changes graphs: checked for the owner thread (or one that takes over from an owner
        thread that has ended) and refused from inside a ``run()`` or another such call; busy while it runs."""
        owner = self._owner
        if owner.ident != get_ident() or owner.busy:
            self._server.guard(call)
        return _Busy(self, touches)

    def capturing(self) -> list[Pair]:
        """Keys pending capture between steps, in capture order (not served by a graph yet); from any thread."""
        return list(self._catalog.capturing)

    def estimate_memory(self, plan: CapturePlan | Iterable[PlanEntry | tuple[BatchDescriptor, str]], *,
                        context: Any = None, sample: bool = False) -> MemoryEstimate:
        """The device memory and seconds ``capture(plan)`` (or ``background=True``) will take, per key and in all,
        measured by capturing the plan into a scratch pool on static inputs of its own and dropping it (no engine state
        touched, no capture context recorded).  ``sample``: capture a sample of each family's ``full`` keys, pricing the
        rest; ``context``: as ``capture(context=...)``.  Runs the step: on the owner thread (docs/integration.md)."""
        check_flag("estimate_memory", "sample", sample)
        todo = self._estimate_check(plan, "estimate_memory()")
        with self._busy("estimate_memory()", touches=False):
            return estimate([self._estimate_part(todo, context)], sample)[0]

    def _estimate_check(self, plan: CapturePlan | Iterable[PlanEntry | tuple[BatchDescriptor, str]], call: str) -> list[PlanEntry]:
        """``plan`` checked for an estimate (``call``): refused on another thread than the owner, asleep or from inside
        a run() or a capture; nothing changes."""
        self._server.guard(call)
        self._lifecycle.refuse_asleep(call)
        self._job.refuse_inside(call)
        return self._job.check(plan)

    def _estimate_part(self, todo: list[PlanEntry], context: Any) -> Part:
        """This registry's share of an estimate of a checked plan: the plan's keys less the ones it holds."""
        return Part(self._job, [p for p in dict.fromkeys((e.descriptor, e.strategy) for e in todo)
                                if p not in self._catalog.entries], context)

    # ------------------------------------------------------------------ run

    def run(
        self, actual: BatchDescriptor, /, *, context: Any = None, group: Any = None, exclude: Any = None, **inputs: torch.Tensor
    ) -> Any:
        """Match, copy in, pad, replay, and return outputs sliced to ``actual``; with no covering key, ``step(actual,
        **inputs)`` runs eagerly (counted).  Inputs are all checked before anything happens.

        ``context``: the engine payload eager breaks (and an eager step) read through ``current_batch()``.  A ``run``
        while another is in progress on another thread raises ``ConcurrentRunError``.  ``group`` (a process group):
        every rank replays the key for the descriptor all their batches fit in (``distributed.agree``, one collective).
        ``exclude`` (strategy names; ``("full",)`` is vLLM's ``disable_full``) keeps this call off those strategies: a
        batch whose covering keys are all excluded runs eagerly (an ``excluded`` miss); such runs have their own route
        cache.  A class that does not override ``run`` gets its server's method bound at construction, so this
        definition only documents it and serves ``super().run(...)``.
        """
        return self._server.run(actual, context=context, group=group, exclude=exclude, **inputs)

    # ------------------------------------------------------------------ release

    def release(self, key: BatchDescriptor, strategy: str | None = None) -> int:
        """Remove the entries captured for ``key`` (under ``strategy``, or any), queued captures included: how many.
        The graphs go at once; their pool memory goes back with the last entry (``clear()``).  Asleep: it leaves the
        plan ``wake()`` captures."""
        if not isinstance(key, BatchDescriptor):
            raise TypeError(f"release() needs a BatchDescriptor, got {key!r}")
        with self._busy("release()"):
            return self._lifecycle.release(key, strategy)

    def clear(self) -> int:
        """Remove every entry and pending key; return how many.  The pool goes back to the
        allocator (and to the driver on ``torch.cuda.empty_cache()``); counters are kept.
        Pending captures are dropped.  Asleep: it empties the plan ``wake()`` would capture."""
        with self._busy("clear()"):
            return self._lifecycle.clear()

    def refresh(self, background: bool = False) -> Refreshed:
        """Call after a weight update by assignment (``load_state_dict(assign=True)``, a replaced module): graphs that
        read the watched weights where they are now stay; the others are dropped and captured again, now or, with
        ``background``, between the steps ``run()`` serves (eagerly meanwhile).  Until then a replay against moved
        weights raises ``WeightsMovedError``.  On the owner thread (``reg.call_on_owner(sync_and_refresh)``)."""
        check_flag("refresh", "background", background)
        with self._busy("refresh()"):
            return self._lifecycle.refresh(background)

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     module: torch.nn.Module | None = None) -> tuple[str, ...]:
        """A weight sync that keeps every graph: copy ``weights`` (a state dict or ``(name, tensor)`` pairs) into the
        parameters and buffers of ``module`` (default: the one module the step reads) in place; the names loaded.
        Every name, shape, dtype and device is checked before anything is written (``ValueError``); tied parameters get
        one copy.  The copies are queued on the current stream: keep the sources unchanged until it reaches them.  On
        the owner thread (``reg.call_on_owner(reg.load_weights, weights)``)."""
        with self._busy("load_weights()", touches=False):
            return load_in_place(self._job.watch.the_module(module), weights)

    def sleep(self) -> Slept:
        """Release every graph, the pool and the static inputs to the device; the plan, counters and adaptation's history
        stay.  ``run()`` serves eagerly meanwhile (miss reason ``asleep``); ``capture()`` is refused until ``wake()``."""
        with self._busy("sleep()"):
            return self._lifecycle.sleep()

    def wake(self, background: bool = True) -> tuple[Pair, ...]:
        """Take the static inputs back and capture again what was captured (or pending) at ``sleep()``, hottest first
        (``background``: in pieces between the steps ``run()`` serves; lazy keys stay lazy); the keys it captures.
        Awake, it captures what an interrupted or failed ``wake()`` or ``refresh()`` left to capture again."""
        check_flag("wake", "background", background)
        with self._busy("wake()"):
            return self._lifecycle.wake(background)

    def watch(self, named: Iterable[tuple[str, torch.Tensor]] | torch.nn.Module, prefix: str = "") -> None:
        """Tensors graphs read beside what the step is given (a module-level model, say): ``(name, tensor)`` pairs, a
        module or a list of modules (tensors by name: a replaced one is caught); compared from their addresses now (no
        graph goes stale).  On the owner thread, between steps."""
        with self._busy("watch()", touches=False):
            self._job.watch.watch(named, prefix)
            self._job.watch.named = True

    def watched(self) -> list[str]:
        """The names of the tensors replays check: static inputs, what the step reaches, what ``watch()`` named."""
        return self._job.watch.names()

    def failures(self) -> dict[Pair, BaseException]:
        """Entries removed because their replay raised where eager did not, and keys whose capture failed (in
        ``capture(plan)``, lazily or in the background), with the error; a key captured later leaves this list."""
        return dict(self._catalog.failures)

    # ------------------------------------------------------------------ inspection

    def match(self, actual: BatchDescriptor, *, group: Any = None, exclude: Any = None) -> Match | None:
        """The key, strategy and padding ``run`` would use for ``actual`` (None: eager).  With ``group`` (a collective),
        the match for the descriptor every rank's batch fits in, its padding relative to that; ``exclude`` as for ``run``."""
        return self._server.match(actual, group, exclude)

    def explain(self, actual: BatchDescriptor, *, exclude: Any = None) -> Explanation:
        """Every captured key and why it won or lost for ``actual`` (``exclude`` as for ``run``): excluded keys
        and keys over the padding cap are listed with their reason; ``str()`` gives a table."""
        if not isinstance(actual, BatchDescriptor):
            raise not_a_descriptor(actual)
        return self._catalog.routes.explain(actual, self._server.exclusion(exclude))

    def entries(self, **filters: Any) -> list[EntryInfo]:
        """Captured entries as frozen records, largest first; filters as ``inspection.filter_entries`` (``strategy``,
        ``uniform``, ``spec_depth``, ``num_active_loras``, ``used``, ``sort``)."""
        backend, predicted = self.backend.name, self._catalog.predicted
        return filter_entries((e.info(backend, predicted.get(e.pair)) for e in tuple(self._catalog.entries.values())), **filters)

    def pending(self) -> list[Pair]:
        """Keys of lazy plans not captured yet (evicted entries return here)."""
        return list(self._catalog.pending)

    def __len__(self) -> int:
        return len(self._catalog.entries)

    def memory_bytes(self) -> int:
        """Measured memory of all live captures (pool growth on cuda, held tensors on cpu)."""
        return self._catalog.memory_bytes()

    def stats(self) -> Stats:
        """Counters since construction or the last ``reset_stats`` (entries removed since keep counting)."""
        return self._catalog.stats()

    def reset_stats(self) -> None:
        """Zero every counter (entries stay captured)."""
        self._catalog.reset_counters()

    def snapshot(self) -> dict[str, Any]:
        """Entries, counters and pending keys as a JSON-serialisable dict (``cgregistry.inspection``)."""
        catalog = self._catalog
        return Snapshot(
            name=self.name,
            backend=self.backend.name,
            device=str(self.device),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            preference=tuple(catalog.routes.matcher.preference),
            entries=tuple(self.entries()),
            stats=self.stats(),
            memory_bytes=self.memory_bytes(),
            pending=tuple(catalog.pending),
            failures={f"{k} [{s}]": f"{type(e).__name__}: {e}" for (k, s), e in tuple(catalog.failures.items())},
            max_padding_tokens=catalog.routes.cap.max_tokens,
            max_padding_ratio=catalog.routes.cap.max_ratio,
            capturing=tuple(self.capturing()),
            plan_changes=tuple(str(c) for c in list(self.plan_changes)[-64:]),
        ).to_dict()

    def table(self, *, used_only: bool = False, sort: str = "key") -> str:
        """Entries as a text table with a summary line."""
        lines = entries_table(self.entries(used=True if used_only else None, sort=sort))
        lines.append(stats_line(self.stats(), len(self), self.backend.name, self.memory_bytes()))
        return "\n".join(lines)


class _Busy:
    """A call that runs the step or changes graphs, in progress: a ``run()`` or such a call the step or a hook makes
    meanwhile is refused; after it, debug mode hears that earlier outputs may be overwritten."""

    __slots__ = ("_registry", "_touches")

    def __init__(self, registry: GraphRegistry, touches: bool) -> None:
        self._registry = registry
        self._touches = touches

    def __enter__(self) -> None:
        self._registry._owner.busy = True

    def __exit__(self, *exc: object) -> None:
        registry = self._registry
        registry._owner.busy = False
        if self._touches and registry.debug:
            registry._server.touched()


# ``GraphRegistry.run`` as defined above: a registry whose class still has it binds its server's run instead (__init__).
_DEFINED_RUN = GraphRegistry.run


def estimate_pool_memory(
    plans: Sequence[tuple[GraphRegistry, CapturePlan | Iterable[PlanEntry | tuple[BatchDescriptor, str]]]], *,
    contexts: Mapping[str, Any] | None = None, sample: bool = False,
) -> PoolEstimate:
    """What capturing each registry's plan, in order, into the one pool they share will take, measured as
    ``estimate_memory``; each part is what its keys add after the registries before.  ``contexts``: payload per
    registry name.  Estimate before capturing: held keys are left out and what follows them is priced as in an empty
    pool (an upper bound).  ``sample`` as for ``estimate_memory``."""
    call = "estimate_pool_memory()"
    check_flag("estimate_pool_memory", "sample", sample)
    pairs = list(plans) if isinstance(plans, Sequence) and not isinstance(plans, str) else None
    if not pairs or any(not (isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], GraphRegistry)) for p in pairs):
        raise TypeError(f"{call} takes a non-empty list of (registry, plan) pairs, got {plans!r}")
    if contexts is None:
        contexts = {}
    elif not isinstance(contexts, Mapping) or any(not isinstance(name, str) for name in contexts):
        raise TypeError(f"{call} takes contexts as a mapping from registry name to payload, got {contexts!r}")
    names = [reg.name for reg, _ in pairs]
    first = pairs[0][0]
    for i, (reg, _) in enumerate(pairs):
        if any(reg is other for other, _ in pairs[:i]):
            raise ValueError(f"registry {reg.name!r} is given twice: give each registry once, with its whole plan")
        if reg.name in names[:i]:
            raise ValueError(f"two registries are named {reg.name!r}: an estimate's parts and contexts are keyed by "
                             "name, so give each registry its own (GraphRegistry(..., name=...))")
        if reg.pool is not first.pool:
            raise ValueError(f"registry {reg.name!r} captures into another pool than registry {first.name!r}: "
                             f"{call} prices registries sharing one pool (GraphRegistry(..., pool=...)); "
                             "estimate registries with a pool each one by one, with reg.estimate_memory(plan)")
    unknown = sorted(set(contexts) - set(names))
    if unknown:
        raise ValueError(f"contexts names registries {unknown} not given: the registries are {names}")
    checked = []
    for reg, plan in pairs:  # every plan checked before anything changes
        try:
            checked.append(reg._estimate_check(plan, call))
        except (ValueError, TypeError) as exc:  # the plans of a pair differ: say whose plan was refused
            named = _naming(exc, reg.name)
            if named is exc:
                raise
            raise named from exc
    parts = [reg._estimate_part(todo, contexts.get(reg.name)) for (reg, _), todo in zip(pairs, checked)]
    held = [reg.name for reg, _ in pairs if len(reg)]
    if held and any(part.pairs for part in parts[names.index(held[0]) + 1:]):
        warn(f"cgregistry: {call}: registry {held[0]!r} already holds graphs in the pool; the keys of the registries "
             "after it are priced as in an empty pool, which overstates what they add beside those graphs: estimate "
             "before capturing")
    with contextlib.ExitStack() as busy:  # it runs every registry's step: each busy meanwhile, as estimate_memory() is
        for reg, _ in pairs:
            busy.enter_context(reg._busy(call, touches=False))
        return PoolEstimate(tuple(names), tuple(estimate(parts, sample)))


def _naming(exc: BaseException, registry: str) -> BaseException:
    """``exc`` again, its message led by the registry it concerns; ``exc`` itself for an error type built otherwise."""
    try:
        return type(exc)(f"registry {registry!r}: {exc}")
    except Exception:
        return exc
