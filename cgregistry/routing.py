"""The route table: how ``run()`` serves each actual batch shape, decided once and cached.

A *route* holds everything the hot path needs for one shape: the entry to replay
(or the lazy key to capture first, or nothing: eager), the rows to copy per
input, and the sliced outputs.  Routes come from the matcher (or a
``cgregistry_choose_match`` plugin) and are cached until the entries change.
A group's routes are keyed by (own batch, agreed batch): the key comes from the
agreed batch, the rows from the rank's own.  Knows nothing of the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from cgregistry.buffers import InputError, StaticBuffer, describe_rows, rows_for
from cgregistry.descriptor import BatchDescriptor
from cgregistry.entries import Entry, Pair
from cgregistry.matcher import Explanation, Match, Matcher
from cgregistry.outputs import OutputAxes
from cgregistry.plugins import PluginError
from cgregistry.runtime import BreakContext

__all__ = ["ROUTE_CACHE_LIMIT", "Route", "RouteTable", "not_a_descriptor"]

# Distinct actual shapes remembered per cache before it starts over.
ROUTE_CACHE_LIMIT = 1 << 16

Chooser = Callable[[BatchDescriptor, list[Match]], object]  # a policy plugin's answer (checked here)


def not_a_descriptor(value: object) -> TypeError:
    return TypeError(f"a batch must be a cgregistry.BatchDescriptor, got {value!r} ({type(value).__name__})")


class Route:
    """Everything ``run`` needs for one actual shape, computed once."""

    __slots__ = (
        "entry", "pending", "match", "copies", "out_rows", "single_output", "real_tokens", "pad_tokens", "batch_context", "miss_reason",
    )

    def __init__(
        self, actual: BatchDescriptor, entry: Entry | None, match: Match | None, copies: tuple[tuple[StaticBuffer, int], ...],
        out_rows: int | tuple[int, ...], miss_reason: str | None = None,
    ) -> None:
        self.entry = entry
        self.miss_reason = miss_reason  # why the batch runs eagerly (a MISS_REASONS key), when no key serves it
        # the best key is in a lazy plan and not captured yet: run() captures it first
        self.pending: Pair | None = (match.key, match.strategy) if match is not None and entry is None else None
        self.match = match
        self.copies = copies
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
        "_buffers", "_entries", "_failures", "_keys", "_output_axes", "_chooser", "_chooser_names", "preference", "matcher", "cache", "group_cache",
    )

    def __init__(
        self, buffers: Mapping[str, StaticBuffer], entries: Mapping[Pair, Entry], output_axes: OutputAxes,
        preference: Sequence[str], chooser: Chooser | None = None, chooser_names: str = "",
        failures: Mapping[Pair, BaseException] | None = None,
    ) -> None:
        self._buffers = tuple(buffers.values())
        self._entries = entries  # the store's live dict
        self._failures = failures if failures is not None else {}  # the store's live dict of removed keys
        self._output_axes = output_axes
        self._chooser = chooser
        self._chooser_names = chooser_names
        self.preference = tuple(preference)
        self.matcher = Matcher((), self.preference)
        self._keys: list[BatchDescriptor] = []  # every key the matcher chooses from (captured or pending)
        self.cache: dict[BatchDescriptor, Route] = {}  # by actual batch
        self.group_cache: dict[tuple[BatchDescriptor, BatchDescriptor], Route] = {}  # by (actual, agreed)

    def rebuild(self, pairs: Sequence[Pair]) -> None:
        """A new matcher over ``pairs``; every cached route is dropped (the caches are cleared in place)."""
        self.matcher = Matcher(pairs, self.preference)
        self._keys = [key for key, _ in pairs]
        self.cache.clear()
        self.group_cache.clear()

    def route(self, actual: BatchDescriptor, agreed: BatchDescriptor | None = None) -> Route:
        """Build and cache the route for ``actual`` (keyed by the ``agreed`` batch of a group, if given)."""
        if not isinstance(actual, BatchDescriptor):
            raise not_a_descriptor(actual)
        copies = []
        for buf in self._buffers:
            rows = rows_for(buf.spec.axis, actual)
            if rows is None:
                raise InputError(f"static input {buf.name!r} is indexed by requests, but {actual} gives num_reqs=None")
            copies.append((buf, rows))
        out_rows = self._output_axes.rows(actual)
        if out_rows is None:
            raise InputError(f"output_axis={self._output_axes.given!r} needs the batch's request count; {actual} gives none")
        fits = self.too_large(actual) is None  # more requests than a relaxed key's buffers hold: eager
        match = self.choose(actual if agreed is None else agreed) if fits else None
        entry = self._entries.get((match.key, match.strategy)) if match is not None else None
        reason = None if match is not None else self.miss_reason(actual if agreed is None else agreed)
        route = Route(actual, entry, match, tuple(copies), out_rows, reason)
        cache, cache_key = (self.cache, actual) if agreed is None else (self.group_cache, (actual, agreed))
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

    def miss_reason(self, actual: BatchDescriptor) -> str:
        """Why no key serves ``actual`` (a ``MISS_REASONS`` key); computed once per route, off the hot path."""
        if self.too_large(actual) is not None:
            return "above_capacity"
        keys = self._keys
        if not keys:
            return "no_graphs" if not self._failures else "failed"
        if any(key.covers(actual) for key, _ in self._failures):
            return "failed"
        return "above_largest_key" if any(_same_kind(key, actual) for key in keys) else "no_key_for_class"

    def explain(self, actual: BatchDescriptor) -> Explanation:
        """The matcher's explanation, refused as a whole when no graph can take the batch."""
        explanation = self.matcher.explain(actual)
        refused = self.too_large(actual)
        if refused is None:
            return explanation
        candidates = tuple(attrs.evolve(c, chosen=False) for c in explanation.candidates)
        return attrs.evolve(explanation, match=None, candidates=candidates, refused=refused)

    def choose(self, actual: BatchDescriptor) -> Match | None:
        """The matcher's best covering key, unless a policy plugin picks another candidate."""
        match = self.matcher.match(actual)
        if match is None or self._chooser is None:
            return match
        candidates = self.matcher.candidates(actual)
        choice = self._chooser(actual, candidates)
        if choice is None:
            return match
        if not isinstance(choice, Match) or choice not in candidates:
            raise PluginError(
                f"cgregistry_choose_match (implemented by {self._chooser_names}) returned {choice!r} for {actual}, "
                "which is not one of the candidates it was given (each a Match)"
            )
        return choice


def _same_kind(key: BatchDescriptor, actual: BatchDescriptor) -> bool:
    """Whether ``key`` would cover ``actual`` if it had enough tokens and requests."""
    if key.num_active_loras < actual.num_active_loras:
        return False
    return not key.uniform or (actual.uniform and actual.spec_depth == key.spec_depth)
