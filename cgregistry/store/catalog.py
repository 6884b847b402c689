"""The catalog: every key a registry holds (captured entries, lazy keys, keys being captured in the background,
failures), the memory budget, the counters, and the routes that serve batches from them.

Every change goes through a method that keeps the routes consistent (cached routes dropped, the
matcher rebuilt over the new keys) and returns what it removed, so that the caller can tell
observers.  Pure bookkeeping: it never captures, replays or calls a hook.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence

from cgregistry.store.buffers import StaticBuffer
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.store.entries import Entry, Pair
from cgregistry.inspection import MISS_REASONS, ClassStats, Stats
from cgregistry.key.matcher import DEFAULT_PREFERENCE, PaddingCap
from cgregistry.store.outputs import OutputAxes
from cgregistry.store.routing import Chooser, RouteTable

__all__ = ["Catalog", "Counters"]


class Counters:
    """The registry-wide counters ``stats()`` reports beside the entries' own (replays, tokens)."""

    __slots__ = (
        "clock", "misses", "eager_fallbacks", "eager_tokens", "bad_batches", "misses_by_kind", "misses_by_reason",
        "lazy_captures", "evictions", "background_captures", "plan_changes", "stale_captures",
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.clock = itertools.count(1)  # numbers graph replays, for least-recently-used eviction
        self.misses = self.eager_fallbacks = self.eager_tokens = self.bad_batches = 0
        self.misses_by_kind = {"uniform": 0, "mixed": 0}
        self.misses_by_reason = dict.fromkeys(MISS_REASONS, 0)
        self.lazy_captures = self.evictions = self.background_captures = self.plan_changes = self.stale_captures = 0

    def count_miss(self, actual: BatchDescriptor, reason: str | None) -> None:
        """A batch no graph served: counted by kind, and by reason (a ``MISS_REASONS`` key) when one is known."""
        self.misses += 1
        self.misses_by_kind["uniform" if actual.uniform else "mixed"] += 1
        if reason is not None:
            self.misses_by_reason[reason] += 1


class Catalog:
    """Entries by (key, strategy), lazy keys, keys being captured, failures, the budget, counters and routes."""

    __slots__ = (
        "entries", "pending", "failures", "capturing", "asleep", "memory_budget", "routes", "counters", "predicted", "_retired",
        "_deferred", "_dirty", "follows_plans",
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
        self.capturing: tuple[Pair, ...] = ()  # keys queued for, or in, background capture (not served yet)
        self.asleep = False  # reg.sleep(): no graph, every batch eager (miss reason "asleep") until reg.wake()
        self.memory_budget = memory_budget
        self.routes = RouteTable(buffers, self.entries, output_axes, preference, chooser, chooser_names, self.failures, cap)
        self.counters = Counters()
        self.predicted: dict[Pair, int] = {}  # device bytes per key, as the last memory estimate predicted them
        self._retired: dict[str, list[int]] = {}  # counters of removed entries, per key class
        self._deferred = 0  # inside batch(): routes are rebuilt once, at its end
        self._dirty = False

    # ---------------------------------------------------------------- reading

    @property
    def cap(self) -> PaddingCap:
        """The padding cap the routes apply."""
        return self.routes.cap

    def pairs(self) -> list[Pair]:
        """Every key the matcher may choose: captured entries, then pending ones."""
        return [*self.entries, *self.pending]

    def holds(self, pair: Pair) -> bool:
        """Whether ``pair`` is captured, planned lazily or being captured."""
        return pair in self.entries or pair in self.pending or pair in self.capturing

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
            misses=c.misses,
            eager_fallbacks=c.eager_fallbacks,
            graph_tokens=sum(row[2] for row in classes.values()),
            padded_tokens=sum(row[3] for row in classes.values()),
            eager_tokens=c.eager_tokens,
            by_strategy=by_strategy,
            entry_failures=len(self.failures),
            by_class={label: ClassStats(*row) for label, row in sorted(classes.items())},
            misses_by_kind=dict(c.misses_by_kind),
            bad_batches=c.bad_batches,
            lazy_captures=c.lazy_captures,
            evictions=c.evictions,
            misses_by_reason=dict(c.misses_by_reason),
            background_captures=c.background_captures,
            plan_changes=c.plan_changes,
            stale_captures=c.stale_captures,
        )

    def reset_counters(self) -> None:
        """Zero every counter (entries stay)."""
        for entry in self.entries.values():
            entry.replays = entry.padded_tokens = entry.graph_tokens = entry.last_step = 0
        self._retired.clear()
        self.counters.reset()

    # ---------------------------------------------------------------- changes (each keeps the routes consistent)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Make several changes with one rebuild of the routes, at the end."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1
            if not self._deferred and self._dirty:
                self._changed()

    def add(self, entry: Entry, *, background: bool = False) -> list[Entry]:
        """A captured entry goes live (no longer listed as failed, if an earlier capture or replay of its key failed);
        entries evicted to stay under the budget (they become lazy keys) are returned."""
        pair = entry.pair
        self.entries[pair] = entry
        self.pending.pop(pair, None)
        self.failures.pop(pair, None)
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
        """Lazy keys that go to the capture thread instead (listed in ``capturing`` from then on, never in both)."""
        for pair in pairs:
            self.pending.pop(pair, None)
        self._changed()

    def set_capturing(self, pairs: Sequence[Pair]) -> None:
        """The keys the capture thread holds now (their batches' miss reason is ``capturing``)."""
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
        """Remove the entries and lazy keys of ``key`` (under ``strategy``, or any): the removed entries, and how many pairs went.

        KeyError names what is captured when nothing matches.
        """
        pairs = [p for p in self.pairs() if p[0] == key and (strategy is None or p[1] == strategy)]
        if not pairs:
            held = sorted({f"{k} [{s}]" for k, s in self.entries})
            raise KeyError(f"no entry for {key}{'' if strategy is None else f' [{strategy}]'}; captured: {held}")
        return self.release_pairs(pairs), len(pairs)

    def release_pairs(self, pairs: Iterable[Pair]) -> list[Entry]:
        """Remove these entries and lazy keys (absent ones are skipped); the removed entries."""
        removed = []
        for pair in pairs:
            entry = self.entries.get(pair)
            if entry is not None:
                removed.append(self._drop(entry))
            self.pending.pop(pair, None)
        self._changed()
        return removed

    def clear(self) -> tuple[list[Entry], int]:
        """Remove every entry and lazy key: the removed entries, and how many entries and lazy keys went."""
        count = len(self.entries) + len(self.pending)
        removed = [self._drop(entry) for entry in list(self.entries.values())]
        self.pending.clear()
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
        if self._deferred:  # the matcher is rebuilt at the end of batch(); no route cached before this change serves
            self._dirty = True
            self.routes.invalidate()
            return
        self._dirty = False
        self.routes.rebuild(self.pairs(), self.capturing, self.asleep)
