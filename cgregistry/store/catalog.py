"""The store: every key a registry holds (captured entries, lazy keys, keys pending capture between steps, failures),
the memory budget, the counters, and the routes that serve batches from them.

An :class:`Entry` is one captured graph with its counters.  A *route* holds what the hot path needs for one actual batch
shape: the entry to replay (or the lazy key to capture first, or nothing: eager), the rows to copy per input, and the
sliced outputs.  Routes come from the matcher (or a ``cgregistry_choose_match`` plugin), cached until the keys change
(the matcher is rebuilt at the next route asked for, never by the change): a plain ``run(actual)``'s by actual batch
(the hot path's one dict lookup), a *variant*'s (a group's agreed batch, excluded strategies) by (own batch, Variant).

Every change goes through a :class:`Catalog` method that keeps the routes consistent and returns what it removed, for
the caller to tell observers.  Pure bookkeeping: it never captures, replays or calls a hook.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from cgregistry.errors import AgreementError, InputError, PluginError
from cgregistry.inspection import MISS_REASONS, CapturePhases, ClassStats, EntryInfo, Stats, key_class
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.key.matcher import DEFAULT_PREFERENCE, Explanation, Match, Matcher, PaddingCap, Verdict
from cgregistry.contracts.runtime import BreakContext
from cgregistry.store.io import OutputAxes, OutputSlicer, StaticBuffer, describe_rows, rows_for, staging

__all__ = ["NO_EXCLUSION", "ROUTE_CACHE_LIMIT", "Catalog", "Chooser", "Counters", "Entry", "Pair", "Route", "RouteTable", "Variant", "check_agreed", "not_a_descriptor"]


Pair = tuple[BatchDescriptor, str]  # (key, strategy name)


class Entry:
    """One captured graph and its counters."""

    __slots__ = (
        "key", "strategy", "graph", "replay", "slicer", "capture_seconds", "memory_bytes",
        "replays", "padded_tokens", "graph_tokens", "last_step", "_key_class", "has_breaks", "weights",
        "generation", "read_live_batch", "device_bytes", "phases", "__weakref__",
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
        self._key_class: str | None = None
        self.has_breaks = bool(getattr(graph, "breaks", 0))  # eager breaks read current_batch() at replay
        self.weights: Mapping[str, Any] = {}  # the watched tensors' layouts at its capture (WeightWatch.seen)
        self.read_live_batch = False  # its recording read current_batch().actual or .payload outside an eager break
        self.generation = 0  # the watch's generation at its capture: a replay in a later one checks the addresses first
        # Device memory its capture took (measured where the backend can: pool growth, warm-up, driver objects), else
        # the graph's own count; what memory_budget sums.
        self.device_bytes = self.memory_bytes
        self.phases: CapturePhases | None = None  # where its capture seconds went (compile, warm-up, record, instantiate)

    @property
    def pair(self) -> Pair:
        return (self.key, self.strategy)

    @property
    def key_class(self) -> str:
        """The class its counters are summed under in ``stats().by_class`` (``full/decode``, ...)."""
        if self._key_class is None:
            self._key_class = key_class(self.key, self.strategy)
        return self._key_class

    def info(self, backend: str, predicted_bytes: int | None = None) -> EntryInfo:
        """This entry as a read-only record (what ``entries()`` and the hooks hand out)."""
        graph = self.graph
        return EntryInfo(
            self.key, self.strategy, backend, self.capture_seconds, self.memory_bytes, self.replays, self.padded_tokens,
            self.last_step, segments=getattr(graph, "num_segments", None), breaks=getattr(graph, "breaks", None),
            device_bytes=self.device_bytes, predicted_bytes=predicted_bytes, phases=self.phases,
        )


# Distinct actual shapes remembered per cache before it starts over.
ROUTE_CACHE_LIMIT = 1 << 16

Chooser = Callable[[BatchDescriptor, list[Match]], object]  # a policy plugin's answer (checked here)


NO_EXCLUSION: frozenset[str] = frozenset()


class Variant(NamedTuple):
    """What makes a run other than a plain ``run(actual)``: a group's agreed batch, excluded strategies."""

    agreed: BatchDescriptor | None
    exclude: frozenset[str] = NO_EXCLUSION


def not_a_descriptor(value: object) -> TypeError:
    return TypeError(f"a batch must be a cgregistry.BatchDescriptor, got {value!r} ({type(value).__name__})")


def check_agreed(agreed: BatchDescriptor, actual: BatchDescriptor) -> None:
    """Refuse a group's ``agreed`` descriptor that does not cover this rank's own batch: the key matched to it would be
    replayed for a batch it cannot hold (a truncated output) or of another form.  Any key covering ``agreed`` covers
    ``actual`` when it does, so checking the descriptor checks every key it may be matched to."""
    if not agreed.covers(actual):
        raise AgreementError(
            f"group=...: the group agreed on {agreed}, which does not cover this rank's own batch {actual}; "
            "nothing was replayed. Agreement combines every rank's batch into one covering each of them: every rank "
            "must call it with the descriptor of its own batch, micro-batches split alike, and nothing else may "
            "write the agreement")


class Route:
    """Everything ``run`` needs for one actual shape, computed once."""

    __slots__ = (
        "entry", "pending", "match", "copies", "stage", "out_rows", "single_output", "real_tokens", "pad_tokens", "batch_context",
        "miss_reason", "hint",
    )

    def __init__(
        self, actual: BatchDescriptor, entry: Entry | None, match: Match | None, copies: tuple[tuple[StaticBuffer, int], ...],
        out_rows: int | tuple[int, ...], miss_reason: str | None = None,
    ) -> None:
        self.entry = entry
        self.miss_reason = miss_reason  # why the batch runs eagerly (a MISS_REASONS key), when no key serves it
        self.hint: str | None = None  # how the engine could describe the batch so that a key serves it (Matcher.uniform_hint)
        # the best key is in a lazy plan and not captured yet: run() captures it first
        self.pending: Pair | None = (match.key, match.strategy) if match is not None and entry is None else None
        self.match = match
        self.copies = copies
        self.stage = staging(copies) if entry is not None and copies else None  # how a replay takes the batch's inputs in
        self.out_rows = out_rows
        self.real_tokens = actual.num_tokens
        # from the key, not match.padding: a group's agreed match pads relative to the agreed descriptor
        self.pad_tokens = match.key.num_tokens - actual.num_tokens if match is not None else 0
        self.single_output = entry.slicer.sliced(out_rows) if entry is not None and entry.slicer.spec is None else None
        # what eager breaks see through current_batch() when run() gets no payload (built once, not per step)
        self.batch_context = BreakContext(actual, entry.key, None) if entry is not None else None


class RouteTable:
    """The matcher over the store's keys, and the routes built from it."""

    __slots__ = (
        "_buffers", "_entries", "_pending", "_failures", "_output_axes", "_chooser", "_chooser_names", "preference", "cap",
        "_matcher", "cache", "variant_cache", "capturing", "asleep", "_lock", "_generation",
    )

    def __init__(
        self, buffers: Mapping[str, StaticBuffer], entries: Mapping[Pair, Entry], output_axes: OutputAxes,
        preference: Sequence[str], chooser: Chooser | None = None, chooser_names: str = "",
        failures: Mapping[Pair, BaseException] | None = None, cap: PaddingCap = PaddingCap(),
        pending: Mapping[Pair, None] | None = None,
    ) -> None:
        self._buffers = tuple(buffers.values())
        self._entries = entries  # the store's live dict
        self._pending = pending if pending is not None else {}  # the store's live dict of lazy keys
        self._failures = failures if failures is not None else {}  # the store's live dict of removed keys
        self._output_axes = output_axes
        self._chooser = chooser
        self._chooser_names = chooser_names
        self.preference = tuple(preference)
        self.cap = cap
        self._matcher: Matcher | None = None  # over the keys as they were at its build; None: built at the next need
        self.cache: dict[BatchDescriptor, Route] = {}  # plain runs, by actual batch
        self.variant_cache: dict[tuple[BatchDescriptor, Variant], Route] = {}  # other runs, by (actual, variant)
        self.capturing: tuple[Pair, ...] = ()  # keys pending capture between steps (not served yet)
        self.asleep = False  # the registry sleeps: every miss is "asleep"
        # Changes so far: a route built across a change (a match() on another thread racing the owner
        # thread's changes) is handed back but never cached.  The lock orders that check and the cache write with
        # the change; the hot path's cache reads take no lock.
        self._lock = threading.Lock()
        self._generation = 0

    @property
    def matcher(self) -> Matcher:
        """The matcher over every captured and lazy key, built at the first need after a change."""
        with self._lock:
            matcher = self._matcher
            if matcher is None:
                matcher = self._matcher = Matcher([*self._entries, *self._pending], self.preference,
                                                  max_padding_tokens=self.cap.max_tokens,
                                                  max_padding_ratio=self.cap.max_ratio, capturing=self.capturing,
                                                  failed=tuple(self._failures))
            return matcher

    def changed(self, capturing: Sequence[Pair] = (), asleep: bool = False) -> None:
        """The keys changed (``capturing``: keys not served yet, and ``asleep``: for miss reasons): every cached route is
        dropped (the caches are cleared in place), and the matcher is built anew when next needed."""
        with self._lock:
            self._generation += 1
            self._matcher = None
            self.capturing = tuple(capturing)
            self.asleep = asleep
            self.cache.clear()
            self.variant_cache.clear()

    def route(self, actual: BatchDescriptor, variant: Variant | None = None) -> Route:
        """Build and cache the route for ``actual`` (under ``variant``: a group's agreed batch, excluded strategies).
        Safe from any thread: a route built across a change is returned but not cached, so a cached route always
        reflects the keys as they are."""
        if not isinstance(actual, BatchDescriptor):
            raise not_a_descriptor(actual)
        generation = self._generation
        copies = []
        for buf in self._buffers:
            rows = rows_for(buf.spec.axis, actual)
            if rows is None:
                raise InputError(f"static input {buf.name!r} is indexed by requests, but {actual} gives num_reqs=None")
            copies.append((buf, rows))
        out_rows = self._output_axes.rows(actual)
        if out_rows is None:
            raise InputError(f"output_axis={self._output_axes.given!r} needs the batch's request count; {actual} gives none")
        target, exclude = actual, NO_EXCLUSION
        if variant is not None:
            target = actual if variant.agreed is None else variant.agreed
            exclude = variant.exclude
            check_agreed(target, actual)  # once per route: the hot path finds the checked route cached
        if self.too_large(actual) is not None:  # more requests than a relaxed key's buffers hold: eager
            verdict = Verdict(None, "above_capacity")
        else:
            verdict = self.matcher.verdict(target, exclude)  # the one question: the key, or why none
        match = self._chosen(target, exclude, verdict.match)
        entry = self._entries.get((match.key, match.strategy)) if match is not None else None
        reason = None if match is not None else "asleep" if self.asleep else verdict.reason
        route = Route(actual, entry, match, tuple(copies), out_rows, reason)
        route.hint = verdict.hint
        cache, cache_key = (self.cache, actual) if variant is None else (self.variant_cache, (actual, variant))
        with self._lock:
            if generation == self._generation:
                if len(cache) >= ROUTE_CACHE_LIMIT:
                    cache.clear()
                cache[cache_key] = route  # type: ignore[index]
        return route

    def too_large(self, actual: BatchDescriptor) -> str | None:
        """Why no graph can take ``actual`` whatever the keys (a static input too small for it), or None."""
        for buf in self._buffers:
            rows = rows_for(buf.spec.axis, actual)
            if rows is not None and rows > buf.capacity:
                return f"{describe_rows(buf.spec.axis, rows)} do not fit static input {buf.name!r}, which holds {buf.capacity}"
        return None

    def explain(self, actual: BatchDescriptor, exclude: frozenset[str] = NO_EXCLUSION) -> Explanation:
        """The matcher's explanation, the keys pending capture between steps listed as such (miss reason ``capturing``),
        refused as a whole when no graph can take the batch.  Read-only, from any thread: it reads the tuple
        ``capturing`` (replaced whole by the owner thread), never the queue."""
        capturing = self.capturing
        explanation = self.matcher.explain(actual, exclude, capturing)
        refused = self.too_large(actual)
        if refused is None:
            return explanation
        candidates = tuple(attrs.evolve(c, chosen=False) for c in explanation.candidates)
        return attrs.evolve(explanation, match=None, candidates=candidates, refused=refused, capturing=None)

    def _chosen(self, actual: BatchDescriptor, exclude: frozenset[str], match: Match | None) -> Match | None:
        """The matcher's best covering key (outside ``exclude``), unless a policy plugin picks another candidate."""
        if match is None or self._chooser is None:
            return match
        candidates = self.matcher.candidates(actual, exclude)
        choice = self._chooser(actual, candidates)
        if choice is None:
            return match
        if not isinstance(choice, Match) or choice not in candidates:
            raise PluginError(
                f"cgregistry_choose_match (implemented by {self._chooser_names}) returned {choice!r} for {actual}, "
                "which is not one of the candidates it was given (each a Match)"
            )
        return choice


class Counters:
    """The registry-wide counters ``stats()`` reports beside the entries' own (replays, tokens)."""

    # The plain counts, each a ``Stats`` field of the same name.
    COUNTS = ("misses", "eager_fallbacks", "eager_tokens", "bad_batches", "lazy_captures", "evictions",
              "background_captures", "plan_changes", "stale_captures")
    __slots__ = ("clock", "misses_by_form", "misses_by_reason", *COUNTS)

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.clock = itertools.count(1)  # numbers graph replays, for least-recently-used eviction
        self.misses = self.eager_fallbacks = self.eager_tokens = self.bad_batches = 0
        self.misses_by_form = {"uniform": 0, "mixed": 0}
        self.misses_by_reason = dict.fromkeys(MISS_REASONS, 0)
        self.lazy_captures = self.evictions = self.background_captures = self.plan_changes = self.stale_captures = 0

    def count_miss(self, actual: BatchDescriptor, reason: str | None) -> None:
        """A batch no graph served: counted by form (uniform or mixed), and by reason (a ``MISS_REASONS`` key) when one is known."""
        self.misses += 1
        self.misses_by_form["uniform" if actual.uniform else "mixed"] += 1
        if reason is not None:
            self.misses_by_reason[reason] += 1


class Catalog:
    """Entries by (key, strategy), lazy keys, keys being captured, failures, the budget, counters and routes."""

    __slots__ = (
        "entries", "pending", "failures", "capturing", "owed", "asleep", "memory_budget", "routes", "counters", "predicted",
        "_retired", "follows_plans",
    )

    def __init__(
        self, buffers: Mapping[str, StaticBuffer], output_axes: OutputAxes, preference: Sequence[str] | None, cap: PaddingCap,
        memory_budget: int | None, chooser: Chooser | None = None, chooser_names: str = "",
    ) -> None:
        self.follows_plans = preference is None  # no preference given: captured plans' strategy orders are adopted
        preference = DEFAULT_PREFERENCE if preference is None else preference
        self.entries: dict[Pair, Entry] = {}
        self.pending: dict[Pair, None] = {}  # lazy keys, captured on first need (evicted ones return here)
        self.failures: dict[Pair, BaseException] = {}
        self.capturing: tuple[Pair, ...] = ()  # keys pending capture between steps (not served yet)
        self.owed: dict[Pair, None] = {}  # keys a refresh or wake dropped to capture again, until captured or released
        self.asleep = False  # reg.sleep(): no graph, every batch eager (miss reason "asleep") until reg.wake()
        self.memory_budget = memory_budget
        self.routes = RouteTable(buffers, self.entries, output_axes, preference, chooser, chooser_names, self.failures, cap,
                                 self.pending)
        self.counters = Counters()
        self.predicted: dict[Pair, int] = {}  # device bytes per key, as the last memory estimate predicted them
        self._retired: dict[str, list[int]] = {}  # counters of removed entries, per key class

    # ---------------------------------------------------------------- reading

    @property
    def cap(self) -> PaddingCap:
        """The padding cap the routes apply."""
        return self.routes.cap

    def pairs(self) -> list[Pair]:
        """Every key the matcher may choose: captured entries, then pending ones."""
        return [*self.entries, *self.pending]

    def holds(self, pair: Pair) -> bool:
        """Whether ``pair`` is captured, planned lazily, being captured or owed (a refresh's or wake's, to capture)."""
        return pair in self.entries or pair in self.pending or pair in self.capturing or pair in self.owed

    def memory_bytes(self) -> int:
        return sum(e.memory_bytes for e in tuple(self.entries.values()))

    def stats(self) -> Stats:
        """Every counter, the entries' summed by key class (safe to call from another thread: it reads copies)."""
        classes: dict[str, list[int]] = {label: [0, *counts] for label, counts in tuple(self._retired.items())}
        for entry in tuple(self.entries.values()):
            row = classes.setdefault(entry.key_class, [0, 0, 0, 0])
            row[0] += 1
            row[1] += entry.replays
            row[2] += entry.graph_tokens
            row[3] += entry.padded_tokens
        by_strategy: dict[str, int] = {}
        for label, row in classes.items():
            strategy = label.split("/", 1)[0]
            by_strategy[strategy] = by_strategy.get(strategy, 0) + row[1]
        c = self.counters
        return Stats(
            hits=sum(row[1] for row in classes.values()),
            graph_tokens=sum(row[2] for row in classes.values()),
            padded_tokens=sum(row[3] for row in classes.values()),
            by_strategy=by_strategy,
            entry_failures=len(self.failures),
            by_class={label: ClassStats(*row) for label, row in sorted(classes.items())},
            misses_by_form=dict(c.misses_by_form),
            misses_by_reason=dict(c.misses_by_reason),
            **{name: getattr(c, name) for name in Counters.COUNTS},
        )

    def reset_counters(self) -> None:
        """Zero every counter (entries stay)."""
        for entry in self.entries.values():
            entry.replays = entry.padded_tokens = entry.graph_tokens = entry.last_step = 0
        self._retired.clear()
        self.counters.reset()

    # ---------------------------------------------------------------- changes (each keeps the routes consistent)

    def add(self, entry: Entry, *, background: bool = False) -> list[Entry]:
        """A captured entry goes live (no longer listed as failed, if an earlier capture or replay of its key failed);
        entries evicted to stay under the budget (they become lazy keys) are returned."""
        pair = entry.pair
        self.entries[pair] = entry
        self.pending.pop(pair, None)
        self.failures.pop(pair, None)
        self.owed.pop(pair, None)
        if background:
            self.counters.background_captures += 1
        evicted = self._evict_over_budget(keep=pair)
        self._changed()
        return evicted

    def follow_plan(self, pairs: Iterable[Pair]) -> tuple[str, ...]:
        """A registry given no preference ranks a plan's strategies as the plan does: the strategy whose keys are all
        uniform (the plan's decode strategy) before the one that serves mixed batches (it would cover decode batches
        too), ahead of the rest; the preference now."""
        if not self.follows_plans:
            return self.routes.preference
        keys: dict[str, bool] = {}
        for key, strategy in pairs:
            keys[strategy] = keys.get(strategy, True) and key.uniform
        order = sorted(keys, key=lambda s: not keys[s])  # stable: the plan's order otherwise
        preference = tuple(dict.fromkeys([*order, *self.routes.preference]))
        if preference != self.routes.preference:
            self.routes.preference = preference
            self._changed()
        return preference

    def plan_lazily(self, pairs: Iterable[Pair]) -> None:
        """Keys captured by the first ``run()`` they are the best match for."""
        for pair in pairs:
            self.pending[pair] = None
        self._changed()

    def unplan(self, pairs: Iterable[Pair]) -> None:
        """Lazy keys that go to the pending captures instead (listed in ``capturing`` from then on, never in both)."""
        for pair in pairs:
            self.pending.pop(pair, None)
        self._changed()

    def set_capturing(self, pairs: Sequence[Pair]) -> None:
        """The keys pending capture now (their batches' miss reason is ``capturing``)."""
        pairs = tuple(pairs)
        if pairs != self.capturing:
            self.capturing = pairs
            self._changed()

    def set_asleep(self, asleep: bool) -> None:
        """Asleep (every batch runs eagerly, counted as ``asleep``) or awake again."""
        self.asleep = asleep
        self._changed()

    def fail_capture(self, pair: Pair, error: BaseException) -> None:
        """A key whose capture failed: dropped (if planned), its error kept."""
        self.pending.pop(pair, None)
        self.failures[pair] = error
        self._changed()

    def fail_replay(self, entry: Entry, error: BaseException) -> None:
        """An entry found broken at replay: removed, its error kept."""
        self._drop(entry)
        self.failures[entry.pair] = error
        self._changed()

    def release(self, key: BatchDescriptor, strategy: str | None) -> tuple[list[Entry], int]:
        """Remove the entries and lazy keys of ``key`` (under ``strategy``, or any): the removed entries, and how many
        pairs went; KeyError naming what is captured when nothing matches."""
        pairs = [p for p in self.pairs() if p[0] == key and (strategy is None or p[1] == strategy)]
        if not pairs:
            held = sorted({f"{k} [{s}]" for k, s in self.entries})
            raise KeyError(f"no entry for {key}{'' if strategy is None else f' [{strategy}]'}; captured: {held}")
        return self.release_pairs(pairs), len(pairs)

    def release_pairs(self, pairs: Iterable[Pair]) -> list[Entry]:
        """Remove these entries, lazy keys and owed keys (absent ones are skipped); the removed entries."""
        removed = []
        for pair in pairs:
            entry = self.entries.get(pair)
            if entry is not None:
                removed.append(self._drop(entry))
            self.pending.pop(pair, None)
            self.owed.pop(pair, None)
        self._changed()
        return removed

    def swap_out(self, stale: Iterable[Pair], owed: Iterable[Pair]) -> list[Entry]:
        """Entries of ``stale`` keys dropped to be captured again, every key of ``owed`` (theirs included) owed until it
        is captured or released: marked owed first, so that nothing between the two loses a key; the removed entries."""
        self.owed.update(dict.fromkeys(owed))
        removed = [self._drop(self.entries[pair]) for pair in stale if pair in self.entries]
        self._changed()
        return removed

    def clear(self) -> tuple[list[Entry], int]:
        """Remove every entry and lazy key: the removed entries, and how many entries and lazy keys went."""
        count = len(self.entries) + len(self.pending)
        removed = [self._drop(entry) for entry in list(self.entries.values())]
        self.pending.clear()
        self.owed.clear()
        self._changed()
        return removed, count

    def _evict_over_budget(self, keep: Pair) -> list[Entry]:
        """Evict least-recently-replayed entries (never ``keep``) while the device memory their captures took exceeds the
        budget (the figures a memory estimate predicts per key); they become lazy keys."""
        evicted: list[Entry] = []
        if self.memory_budget is None:
            return evicted
        while sum(e.device_bytes for e in self.entries.values()) > self.memory_budget:
            victims = [e for pair, e in self.entries.items() if pair != keep]
            if not victims:
                break
            victim = min(victims, key=lambda e: (e.last_step, -e.memory_bytes))
            self._drop(victim)
            self.pending[victim.pair] = None  # a later need captures it again
            self.counters.evictions += 1
            evicted.append(victim)
        return evicted

    def _drop(self, entry: Entry) -> Entry:
        """Remove an entry, keeping its counters in the statistics."""
        self.entries.pop(entry.pair, None)
        retired = self._retired.setdefault(entry.key_class, [0, 0, 0])
        retired[0] += entry.replays
        retired[1] += entry.graph_tokens
        retired[2] += entry.padded_tokens
        return entry

    def _changed(self) -> None:
        self.routes.changed(self.capturing, self.asleep)
