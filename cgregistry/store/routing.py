"""The route table: how ``run()`` serves each actual batch shape, decided once and cached.

A *route* holds everything the hot path needs for one shape: the entry to replay
(or the lazy key to capture first, or nothing: eager), the rows to copy per
input, and the sliced outputs.  Routes come from the matcher (or a
``cgregistry_choose_match`` plugin) and are cached until the entries change.
Routes of a plain ``run(actual)`` are cached by actual batch alone (the hot
path's one dict lookup).  Any other run is a *variant*: a group's agreed batch
and/or strategies excluded for the call; its routes are cached apart, keyed by
(own batch, Variant): the key comes from the agreed batch, the rows from the
rank's own, the match skips the excluded strategies.  Knows nothing of the registry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import attrs

from cgregistry.store.buffers import StaticBuffer, describe_rows, rows_for
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.store.entries import Entry, Pair
from cgregistry.key.matcher import Explanation, Match, Matcher, PaddingCap
from cgregistry.store.outputs import OutputAxes
from cgregistry.state.runtime import BreakContext
from cgregistry.errors import InputError, PluginError

__all__ = ["NO_EXCLUSION", "ROUTE_CACHE_LIMIT", "Chooser", "Route", "RouteTable", "Variant", "not_a_descriptor"]

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


class Route:
    """Everything ``run`` needs for one actual shape, computed once."""

    __slots__ = (
        "entry", "pending", "match", "copies", "out_rows", "single_output", "real_tokens", "pad_tokens", "batch_context", "miss_reason",
        "hint",
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
        "_buffers", "_entries", "_failures", "_pairs", "_output_axes", "_chooser", "_chooser_names", "preference", "cap", "matcher", "cache",
        "variant_cache", "capturing", "asleep", "_lock", "_generation",
    )

    def __init__(
        self, buffers: Mapping[str, StaticBuffer], entries: Mapping[Pair, Entry], output_axes: OutputAxes,
        preference: Sequence[str], chooser: Chooser | None = None, chooser_names: str = "",
        failures: Mapping[Pair, BaseException] | None = None, cap: PaddingCap = PaddingCap(),
    ) -> None:
        self._buffers = tuple(buffers.values())
        self._entries = entries  # the store's live dict
        self._failures = failures if failures is not None else {}  # the store's live dict of removed keys
        self._output_axes = output_axes
        self._chooser = chooser
        self._chooser_names = chooser_names
        self.preference = tuple(preference)
        self.cap = cap
        self.matcher = self._matcher(())
        self._pairs: list[Pair] = []  # every (key, strategy) the matcher chooses from (captured or pending)
        self.cache: dict[BatchDescriptor, Route] = {}  # plain runs, by actual batch
        self.variant_cache: dict[tuple[BatchDescriptor, Variant], Route] = {}  # other runs, by (actual, variant)
        self.capturing: tuple[Pair, ...] = ()  # keys being captured in the background (not served yet)
        self.asleep = False  # the registry sleeps: every miss is "asleep"
        # Rebuilds so far: a route built across a rebuild (a hook's match() on another thread racing the serving
        # thread's changes) is handed back but never cached.  The lock orders that check and the cache write with
        # the rebuild; the hot path's cache reads take no lock.
        self._lock = threading.Lock()
        self._generation = 0

    def _matcher(self, pairs: Sequence[Pair]) -> Matcher:
        return Matcher(pairs, self.preference, max_padding_tokens=self.cap.max_tokens, max_padding_ratio=self.cap.max_ratio)

    def rebuild(self, pairs: Sequence[Pair], capturing: Sequence[Pair] = (), asleep: bool = False) -> None:
        """A new matcher over ``pairs`` (``capturing``: keys not served yet, and ``asleep``: for miss reasons); every
        cached route is dropped (the caches are cleared in place)."""
        with self._lock:
            self._generation += 1
            self.matcher = self._matcher(pairs)
            self._pairs = list(pairs)
            self.capturing = tuple(capturing)
            self.asleep = asleep
            self.cache.clear()
            self.variant_cache.clear()

    def invalidate(self) -> None:
        """The entries changed while the matcher's rebuild waits (a plan being captured): drop every cached route, so
        the next run builds one from the entries as they are (a lazy key captured since is no longer pending)."""
        with self._lock:
            self._generation += 1
            self.cache.clear()
            self.variant_cache.clear()

    def route(self, actual: BatchDescriptor, variant: Variant | None = None) -> Route:
        """Build and cache the route for ``actual`` (under ``variant``: a group's agreed batch, excluded strategies).

        Safe from any thread: a route whose building overlapped a ``rebuild()`` (its keys may be gone since) is
        returned but not cached, so a cached route always reflects the keys as they are."""
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
        fits = self.too_large(actual) is None  # more requests than a relaxed key's buffers hold: eager
        match = self.choose(target, exclude) if fits else None
        entry = self._entries.get((match.key, match.strategy)) if match is not None else None
        if entry is not None and entry.buffers is not None:  # captured in the background: its own static inputs
            copies = [(own, rows) for own, (_, rows) in zip(entry.buffers, copies)]
        reason = None if match is not None else self.miss_reason(target, exclude)
        route = Route(actual, entry, match, tuple(copies), out_rows, reason)
        if reason == "no_key_for_class":
            route.hint = self.matcher.uniform_hint(target, exclude)
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

    def miss_reason(self, actual: BatchDescriptor, exclude: frozenset[str] = NO_EXCLUSION) -> str:
        """Why no key serves ``actual`` (a ``MISS_REASONS`` key); computed once per route, off the hot path.

        ``capturing``: a key being captured would serve it (its strategy allowed, within the padding cap).
        A key covers the batch yet none serves it: the padding cap refused every allowed
        strategy (``padding_cap``), or every covering key's strategy is excluded (``excluded``).
        """
        if self.asleep:
            return "asleep"
        if self.too_large(actual) is not None:
            return "above_capacity"
        if any(strategy not in exclude and self.cap.serves(key, actual) for key, strategy in self.capturing):
            return "capturing"
        pairs = [*self._pairs, *self.capturing]  # keys being captured count as keys for the reasons below
        if not pairs:
            return "no_graphs" if not self._failures else "failed"
        covering = {strategy for key, strategy in pairs if key.covers(actual)}
        if covering - exclude:
            return "padding_cap"
        if covering:
            return "excluded"
        if any(key.covers(actual) for key, _ in self._failures):
            return "failed"
        return "above_largest_key" if any(_same_kind(key, actual) for key, _ in pairs) else "no_key_for_class"

    def explain(self, actual: BatchDescriptor, exclude: frozenset[str] = NO_EXCLUSION) -> Explanation:
        """The matcher's explanation, refused as a whole when no graph can take the batch."""
        explanation = self.matcher.explain(actual, exclude)
        refused = self.too_large(actual)
        if refused is None:
            return explanation
        candidates = tuple(attrs.evolve(c, chosen=False) for c in explanation.candidates)
        return attrs.evolve(explanation, match=None, candidates=candidates, refused=refused)

    def choose(self, actual: BatchDescriptor, exclude: frozenset[str] = NO_EXCLUSION) -> Match | None:
        """The matcher's best covering key (outside ``exclude``), unless a policy plugin picks another candidate."""
        match = self.matcher.match(actual, exclude)
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


def _same_kind(key: BatchDescriptor, actual: BatchDescriptor) -> bool:
    """Whether ``key`` would cover ``actual`` if it had enough tokens and requests."""
    return key.num_active_loras >= actual.num_active_loras and key.serves_kind(actual)
