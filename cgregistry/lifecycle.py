"""The lifecycle of a registry's graphs: release and clear, refresh after a weight update, sleep and wake.

Engines serve next to training (RL weight sync) and on GPUs they give back while idle, and graphs read the addresses
they saw at capture.  ``refresh()`` after a weight update keeps every graph an in-place update left valid; entries
captured while a watched tensor was elsewhere are dropped at once and captured again (between the following steps if
asked, eagerly meanwhile), a replay refused until then (``WeightsMovedError``), never stale.  Keys to capture again stay
owed until captured or released: a failed or interrupted capture loses none.  ``sleep()`` gives every graph, the pool
and the static inputs back to the device, keeping the plan, counters and adaptation's history (``run()`` serves eagerly,
miss reason ``asleep``); ``wake()`` takes the inputs back and captures the plan again, hottest keys first.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from cgregistry.capture.refit import Adapter
from cgregistry.capture.queue import PendingCaptures
from cgregistry.store.io import StaticBuffer
from cgregistry.capture.job import CaptureJob
from cgregistry.store.catalog import Catalog, Entry, Pair
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.hooks.events import Events
from cgregistry.inspection import Refreshed, Slept

__all__ = ["Lifecycle"]


def _heat(entry: Entry) -> tuple[int, int]:
    return (entry.replays, entry.key.num_tokens)


def _of(pairs: Iterable[Pair], key: BatchDescriptor, strategy: str | None) -> set[Pair]:
    """The pairs of ``key`` (under ``strategy``, or any)."""
    return {pair for pair in pairs if pair[0] == key and (strategy is None or pair[1] == strategy)}


def _drop(entries: list[Entry]) -> list[weakref.ref[Entry]]:
    """Drop ``entries`` (the list held their last references), one at a time; what a reference cycle keeps alive, with
    its pool, is handed back."""
    left = [weakref.ref(entry) for entry in entries]
    entries.clear()
    return [ref for ref in left if ref() is not None]


class Lifecycle:
    """Removes, refreshes, puts to sleep and wakes a registry's graphs."""

    def __init__(
        self, catalog: Catalog, job: CaptureJob, pending: PendingCaptures, adapter: Adapter | None, events: Events,
        buffers: Mapping[str, StaticBuffer], backend: Any, name: str,
    ) -> None:
        self._catalog = catalog
        self._job = job
        self._pending = pending
        self._adapter = adapter
        self._events = events
        self._buffers = buffers
        self._backend = backend
        self._name = name
        self.asleep: Slept | None = None

    def refuse_asleep(self, call: str) -> None:
        """``call`` runs the step: refused while the registry sleeps (the engine may have offloaded what the step reads)."""
        if self.asleep is not None:
            raise RuntimeError(f"{call} on registry {self._name!r} while it sleeps: reg.wake() first (it captures the plan it slept with)")

    # ---------------------------------------------------------------- release, clear

    def release(self, key: BatchDescriptor, strategy: str | None) -> int:
        """Remove the entries and keys of ``key`` (under ``strategy``, or any), queued ones included, and from the plan
        slept with; how many (key, strategy) pairs went, each counted once."""
        if self.asleep is not None:
            return self._release_slept(key, strategy)
        wanted = _of(self._pending.queued(), key, strategy)
        self._pending.discard(wanted)  # not captured yet: dropped
        owed = _of(self._catalog.owed, key, strategy)
        if owed:  # a refresh's or wake's key, failed or planned lazily: no longer to capture again
            self._catalog.release_pairs(owed)
        held = _of(self._catalog.pairs(), key, strategy)
        if (wanted or owed) and not held:
            return len(wanted | owed)
        removed, _ = self._catalog.release(key, strategy)  # KeyError naming what is held when nothing matches
        self._released(removed)
        return len(wanted | held | owed)

    def _release_slept(self, key: BatchDescriptor, strategy: str | None) -> int:
        """``release()`` while asleep: the key leaves the plan ``wake()`` captures (KeyError naming the plan if absent)."""
        slept = self.asleep
        assert slept is not None
        gone = _of((*slept.keys, *slept.lazy), key, strategy)
        if not gone:
            held = sorted({f"{k} [{s}]" for k, s in (*slept.keys, *slept.lazy)})
            raise KeyError(f"no entry for {key}{'' if strategy is None else f' [{strategy}]'} in the plan slept with: {held}")
        self.asleep = attrs.evolve(slept, keys=tuple(p for p in slept.keys if p not in gone),
                                   lazy=tuple(p for p in slept.lazy if p not in gone))
        return len(gone)

    def clear(self) -> int:
        """Remove every entry, lazy key and queued capture, and the plan slept with; how many.  Counters stay."""
        self._job.refuse_inside("clear()")
        if self.asleep is not None:  # nothing is captured: the plan wake() would capture is what there is to clear
            slept = self.asleep
            self.asleep = attrs.evolve(slept, keys=(), lazy=())
            self._job.forget()
            return len(slept.keys) + len(slept.lazy)
        dropped = self._pending.cancel()
        if self._adapter is not None:
            self._adapter.reset()  # a refit queued was dropped with the rest; adaptation keeps observing
        removed, count = self._catalog.clear()
        self._job.forget()  # the next capture request records the capture context anew
        self._released(removed)
        return count + dropped

    def _released(self, removed: list[Entry], release: bool = True) -> None:
        """``removed`` (the caller's list, emptied here: it held the last references) went, with their graphs; a full
        collection (0.1-0.3 s with a real model loaded) runs only when one outlived its references in a cycle that would
        keep its pool alive.  ``release``: the pool's memory goes back once nothing holds it (else kept for reuse)."""
        self._events.released(removed)
        self._job.renew_if_unused(release)  # drop the pool handle too when nothing holds the old pool
        if _drop(removed):
            gc.collect()

    # ---------------------------------------------------------------- weights

    def refresh(self, background: bool) -> Refreshed:
        """After a weight update: keep the graphs that read the weights where they are, capture the others again."""
        self._job.refuse_inside("refresh()")
        watch = self._job.watch

        def read() -> dict[str, Any]:
            self._job.watch_step()  # a module the step is given since (a rebound attribute)
            return watch.now()  # one read of every address (what was added to a watched module since included)

        now = read()
        moved = tuple(watch.moved(now))
        verdicts: dict[int, bool] = {}  # entries captured in one generation share what they read: compared once
        stale = []
        for pair, entry in self._catalog.entries.items():
            current = verdicts.get(id(entry.weights))
            if current is None:
                current = verdicts[id(entry.weights)] = watch.reads_current(entry.weights, now)
            if not current:
                stale.append(pair)
        queued = self._pending.queued()  # pending: perhaps warmed up with the old weights
        again = list(dict.fromkeys([*stale, *queued, *self._catalog.owed]))  # owed: what a failed refresh or wake left
        removed = self._catalog.swap_out(stale, again)  # owed before anything goes: an interrupt loses no key
        self._pending.discard(queued)
        kept = tuple(self._catalog.entries)
        seen = watch.rebase(now)
        generation = watch.generation
        for pair in kept:  # they read every watched tensor where it is: of the new generation
            entry = self._catalog.entries[pair]
            entry.weights, entry.generation = seen, generation
        entry = None  # the loops' last entry, perhaps a stale one: its last reference goes in _released
        self._job.pool.left_by(removed)  # what they held in the kept pool, the keys captured again account for
        self._released(removed, release=False)  # the keys captured again reuse the pool
        if again and self.asleep is None:
            self._recapture(again, background, ordered=False)
        result = Refreshed(kept, tuple(again), moved, background)
        self._events.refreshed(result)
        return result

    def _recapture(self, pairs: list[Pair], background: bool, ordered: bool) -> None:
        """Capture again keys a refresh or wake owes (``Catalog.owed``, until captured or released, so that a failed or
        interrupted capture loses none: the next ``refresh()`` or ``wake()`` captures what is left, and untried ones are
        planned lazily meanwhile): pending, for the steps that follow, or now."""
        if background:
            self._job.renew_if_unused()
            self._pending.submit(pairs, ordered=ordered)
            return
        self._job.capture_all(pairs, progress=None, untried_lazily=True)

    # ---------------------------------------------------------------- sleep, wake

    def sleep(self) -> Slept:
        """Release every graph, the pool and the static inputs; keep the plan (hottest first), counters and history."""
        self._job.refuse_inside("sleep()")
        if self.asleep is not None:
            return self.asleep
        entries = sorted(self._catalog.entries.values(), key=_heat, reverse=True)
        keys = [e.pair for e in entries] + self._pending.queued()  # what was (being) captured: captured again
        keys += [p for p in self._catalog.owed if p not in keys]  # and what a failed refresh or wake did not capture again
        lazy = [p for p in self._catalog.pending if p not in keys]  # never used, or evicted: lazy again
        memory = sum(e.memory_bytes for e in entries)
        del entries  # the entries' last references go with the catalog's (see _released)
        self.asleep = Slept(tuple(dict.fromkeys(keys)), memory, 0, tuple(lazy))  # first: an interrupt loses no key
        self._pending.cancel()
        if self._adapter is not None:
            self._adapter.reset()
        removed, _ = self._catalog.clear()
        self._catalog.set_asleep(True)
        self._released(removed)
        inputs = sum(buf.release() for buf in self._buffers.values())
        release = getattr(self._backend, "release_cached", None)  # cuda: the allocator's cached blocks back to the driver
        if release is not None:
            release()
        self.asleep = attrs.evolve(self.asleep, input_bytes=inputs)
        self._events.slept(self.asleep)
        return self.asleep

    def wake(self, background: bool) -> tuple[Pair, ...]:
        """Give the static inputs back and capture the plan slept with, hottest key first; the keys queued or captured.
        Awake: the keys an interrupted or failed wake or refresh left owed."""
        self._job.refuse_inside("wake()")
        slept = self.asleep
        if slept is None:
            owed = [p for p in self._catalog.owed if p not in self._catalog.entries]
            if owed:
                self._recapture(owed, background, ordered=True)
            return tuple(owed)
        keys = [p for p in slept.keys if p not in self._catalog.entries]
        self._catalog.owed.update(dict.fromkeys(keys))  # owed before it wakes: an interrupt from here on loses none
        for buf in self._buffers.values():
            buf.restore()
        self.asleep = None
        self._catalog.set_asleep(False)
        self._catalog.plan_lazily(p for p in slept.lazy if p not in self._catalog.entries)
        if not background:
            keys.sort(key=lambda p: (-p[0].num_tokens, -(p[0].num_reqs or 0)))
        self._recapture(keys, background, ordered=True)
        self._events.woke(tuple(keys))
        return tuple(keys)
