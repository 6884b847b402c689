"""The entry store: captured entries, lazy keys, failures, the memory budget and the counters.

Pure bookkeeping: it never captures, replays or calls a hook.  Methods that remove
entries return them, so the registry can tell observers.
"""

from __future__ import annotations

import itertools
from typing import Any

from cgregistry.descriptor import BatchDescriptor
from cgregistry.inspection import MISS_REASONS, ClassStats, Stats, key_class
from cgregistry.outputs import OutputSlicer

__all__ = ["Entry", "EntryStore", "Pair"]

Pair = tuple[BatchDescriptor, str]  # (key, strategy name)


class Entry:
    """One captured graph and its counters."""

    __slots__ = (
        "key", "strategy", "graph", "replay", "slicer", "capture_seconds", "memory_bytes",
        "replays", "padded_tokens", "graph_tokens", "last_step", "key_class", "has_breaks", "buffers",
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
        self.buffers: tuple[Any, ...] | None = None  # static inputs of its own (captured in the background), else shared

    @property
    def pair(self) -> Pair:
        return (self.key, self.strategy)


class EntryStore:
    """Entries by (key, strategy), pending lazy keys, failures, and every counter ``stats()`` reports."""

    __slots__ = (
        "entries", "pending", "failures", "memory_budget", "_retired", "clock", "misses", "eager_fallbacks",
        "eager_tokens", "bad_batches", "misses_by_kind", "misses_by_reason", "lazy_captures", "evictions",
        "background_captures", "plan_changes",
    )

    def __init__(self, memory_budget: int | None) -> None:
        self.entries: dict[Pair, Entry] = {}
        self.pending: dict[Pair, None] = {}  # lazy keys, captured on first need (evicted ones return here)
        self.failures: dict[Pair, BaseException] = {}
        self.memory_budget = memory_budget
        self._retired: dict[str, list[int]] = {}  # counters of removed entries, per key class
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero every counter (entries stay)."""
        for entry in self.entries.values():
            entry.replays = entry.padded_tokens = entry.graph_tokens = entry.last_step = 0
        self._retired.clear()
        self.clock = itertools.count(1)  # numbers graph replays, for least-recently-used eviction
        self.misses = self.eager_fallbacks = self.eager_tokens = self.bad_batches = 0
        self.misses_by_kind = {"uniform": 0, "mixed": 0}
        self.misses_by_reason = dict.fromkeys(MISS_REASONS, 0)
        self.lazy_captures = self.evictions = self.background_captures = self.plan_changes = 0

    def count_miss(self, actual: BatchDescriptor, reason: str | None) -> None:
        """A batch no graph served: counted by kind, and by reason (a ``MISS_REASONS`` key) when one is known."""
        self.misses += 1
        self.misses_by_kind["uniform" if actual.uniform else "mixed"] += 1
        if reason is not None:
            self.misses_by_reason[reason] += 1

    # ---------------------------------------------------------------- membership

    def pairs(self) -> list[Pair]:
        """Every key the matcher may choose: captured entries, then pending ones."""
        return [*self.entries, *self.pending]

    def add(self, entry: Entry) -> None:
        self.entries[entry.pair] = entry
        self.pending.pop(entry.pair, None)

    def add_pending(self, pairs: list[Pair]) -> None:
        for pair in pairs:
            self.pending[pair] = None

    def fail_pending(self, pair: Pair, error: BaseException) -> None:
        """A lazy key whose capture failed: dropped, its error kept."""
        self.pending.pop(pair, None)
        self.failures[pair] = error

    def fail(self, entry: Entry, error: BaseException) -> None:
        """An entry found broken at replay: removed, its error kept."""
        self._drop(entry)
        self.failures[entry.pair] = error

    def release(self, key: BatchDescriptor, strategy: str | None) -> tuple[list[Entry], int]:
        """Remove the entries and pending keys of ``key`` (under ``strategy``, or any): the removed entries, and how many pairs went."""
        pairs = [p for p in self.pairs() if p[0] == key and (strategy is None or p[1] == strategy)]
        if not pairs:
            held = sorted({f"{k} [{s}]" for k, s in self.entries})
            raise KeyError(f"no entry for {key}{'' if strategy is None else f' [{strategy}]'}; captured: {held}")
        removed = [self._drop(self.entries[p]) for p in pairs if p in self.entries]
        for pair in pairs:
            self.pending.pop(pair, None)
        return removed, len(pairs)

    def clear(self) -> tuple[list[Entry], int]:
        """Remove everything: the removed entries, and how many entries and pending keys went."""
        count = len(self.entries) + len(self.pending)
        removed = [self._drop(entry) for entry in list(self.entries.values())]
        self.pending.clear()
        return removed, count

    def evict_over_budget(self, keep: Pair) -> list[Entry]:
        """Evict least-recently-replayed entries (never ``keep``) while memory exceeds the budget; they become pending."""
        evicted: list[Entry] = []
        if self.memory_budget is None:
            return evicted
        while self.memory_bytes() > self.memory_budget:
            victims = [e for pair, e in self.entries.items() if pair != keep]
            if not victims:
                break
            victim = min(victims, key=lambda e: (e.last_step, -e.memory_bytes))
            self._drop(victim)
            self.pending[victim.pair] = None  # a later need captures it again
            self.evictions += 1
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

    # ---------------------------------------------------------------- reading

    def memory_bytes(self) -> int:
        return sum(e.memory_bytes for e in self.entries.values())

    def stats(self) -> Stats:
        classes: dict[str, list[int]] = {label: [0, *counts] for label, counts in self._retired.items()}
        for entry in self.entries.values():
            row = classes.setdefault(entry.key_class, [0, 0, 0, 0])
            row[0] += 1
            row[1] += entry.replays
            row[2] += entry.graph_tokens
            row[3] += entry.padded_tokens
        by_strategy: dict[str, int] = {}
        for label, row in classes.items():
            strategy = label.split("/", 1)[0]
            by_strategy[strategy] = by_strategy.get(strategy, 0) + row[1]
        return Stats(
            hits=sum(row[1] for row in classes.values()),
            misses=self.misses,
            eager_fallbacks=self.eager_fallbacks,
            graph_tokens=sum(row[2] for row in classes.values()),
            padded_tokens=sum(row[3] for row in classes.values()),
            eager_tokens=self.eager_tokens,
            by_strategy=by_strategy,
            entry_failures=len(self.failures),
            by_class={label: ClassStats(*row) for label, row in sorted(classes.items())},
            misses_by_kind=dict(self.misses_by_kind),
            bad_batches=self.bad_batches,
            lazy_captures=self.lazy_captures,
            evictions=self.evictions,
            misses_by_reason=dict(self.misses_by_reason),
            background_captures=self.background_captures,
            plan_changes=self.plan_changes,
        )
