"""The adapter: adaptation wired into a registry (``GraphRegistry(adapt=...)``).

On the owner thread it counts the actual shape of every step, now and then harvesting the counts into a
``TrafficHistogram``; when ``Adaptation.due`` says so it queues a refit (the pure policy,
:func:`cgregistry.plan.adapt.propose`) as a piece of the pending captures, and applies its change as that piece ends,
between two steps: cold keys released, new keys pending capture.
"""

from __future__ import annotations

import collections
from typing import Any

import attrs

from cgregistry.plan.adapt import Adaptation, PlanChange, TrafficHistogram, propose
from cgregistry.capture.queue import PendingCaptures
from cgregistry.capture.job import CaptureJob
from cgregistry.store.catalog import Catalog
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.hooks.events import Events
from cgregistry.capture.serving_state import RECORDED_AT_REFIT
from cgregistry.messages import warn

__all__ = ["PLAN_CHANGES_KEPT", "Adapter", "refuse_with_collectives"]

PLAN_CHANGES_KEPT = 256  # GraphRegistry.plan_changes keeps the last this many (stats().plan_changes counts them all)
RANKS_WOULD_DIVERGE = ", and without adaptation (each rank would refit to its own traffic)"


def refuse_with_collectives(what: str = "capture(background=True)", more: str = "") -> None:
    """Pending captures run in pieces at times each rank decides alone (its own budget and step times), so a warm-up's
    collectives would pair with another rank's step.  Adaptation captures that way, and each rank would refit to its
    own traffic (different keys)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            f"{what} with torch.distributed initialized (world size "
            f"{dist.get_world_size()}): pending keys are captured in pieces between steps at times each rank decides "
            f"alone, so a warm-up's collectives would pair with another rank's step on the same communicator (ranks "
            f"would hang); capture in the foreground{more}"
        )


class Adapter:
    """Counts steps, queues refits, applies their changes."""

    __slots__ = (
        "adapt", "plan_changes", "_catalog", "_job", "_pending", "_events", "_name", "_traffic", "_observed",
        "_unharvested", "_harvest_at", "_refit_running", "_warned",
    )

    def __init__(
        self, adapt: Adaptation, catalog: Catalog, job: CaptureJob, pending: PendingCaptures, events: Events, name: str,
    ) -> None:
        refuse_with_collectives("GraphRegistry(adapt=...)", RANKS_WOULD_DIVERGE)
        for entry in adapt.fit({}):  # the widest keys any refit keeps
            try:
                job.check_key(entry.descriptor, entry.strategy)
            except (ValueError, KeyError) as exc:
                raise ValueError(
                    f"adapt: its settings make refits keep the key {entry.descriptor}, which does not fit the static inputs "
                    f"({exc}); lower the settings' max_num_tokens / max_capture_size / max_num_seqs or enlarge the inputs"
                ) from None
        self.adapt: Adaptation | None = adapt  # None once turned off (a process group initialized later)
        # The changes adaptation made, oldest first: the last PLAN_CHANGES_KEPT (a server runs for days).
        self.plan_changes: collections.deque[PlanChange] = collections.deque(maxlen=PLAN_CHANGES_KEPT)
        self._catalog = catalog
        self._job = job
        self._pending = pending
        self._events = events
        self._name = name
        self._traffic = TrafficHistogram()  # what refits fit to
        self._observed: dict[BatchDescriptor, int] = {}  # steps per shape since the last harvest
        self._unharvested = 0
        self._harvest_at = self._next_harvest(False)
        self._refit_running = False
        self._warned: set[Any] = set()  # keys a refit proposed that this registry cannot capture (warned once)

    def observe(self, actual: BatchDescriptor) -> None:
        """Count a step (on the owner thread); harvest when a refit may be due (or every 4096 steps), then queue it."""
        observed = self._observed
        observed[actual] = observed.get(actual, 0) + 1
        self._unharvested += 1
        if self._unharvested >= self._harvest_at:
            self._harvest()

    def reset(self) -> None:
        """After ``clear()``: a refit queued or running was dropped with the rest; observing goes on."""
        self._refit_running = False
        self._harvest_at = self._next_harvest(False)

    def _harvest(self) -> None:
        adapt, traffic = self.adapt, self._traffic
        traffic.add(self._observed)
        self._observed = {}
        self._unharvested = 0
        if adapt is None:
            return
        due = not self._refit_running and not self._catalog.asleep and adapt.due(traffic)
        self._harvest_at = self._next_harvest(due or self._refit_running)
        if not due:
            return
        try:
            refuse_with_collectives("adaptation (GraphRegistry(adapt=...))", RANKS_WOULD_DIVERGE)
        except RuntimeError as exc:  # initialized after the registry was made: stop adapting, say so once
            self.adapt = None
            warn(f"cgregistry: registry {self._name!r}: {exc}; adaptation is off from now on")
            return
        weights = traffic.steps()
        traffic.decay(adapt.decay)
        catalog = self._catalog
        current = list(dict.fromkeys([*catalog.entries, *catalog.pending, *catalog.capturing, *catalog.owed]))
        cap = self._catalog.routes.cap
        preference = self._catalog.routes.matcher.preference  # as the refit is queued
        served = traffic.observed  # every step harvested (the histogram is never replaced): PlanChange.observed
        self._job.current(RECORDED_AT_REFIT)  # a registry that only adapts records its capture context here
        self._refit_running = True
        self._pending.submit_task(
            lambda: propose(weights, current, adapt, preference=preference, observed=served,
                            max_padding_tokens=cap.max_tokens, max_padding_ratio=cap.max_ratio),
            self._apply,
        )

    def _next_harvest(self, busy: bool) -> int:
        """Steps until the next harvest: when a refit next falls due (every_steps since the last one, min_steps in all),
        at most 4096 (the histogram stays small); while a refit runs, every_steps (capped) again."""
        adapt, traffic = self.adapt, self._traffic
        if adapt is None:
            return 4096
        if busy:
            return min(adapt.every_steps, 4096)
        return max(1, min(4096, max(adapt.every_steps - traffic.fresh, adapt.min_steps - traffic.observed)))

    def _apply(self, change: PlanChange | None, error: BaseException | None) -> None:
        """A refit's change, between steps: cold keys released, new ones pending capture.  Keys whose capture failed
        before, or that this registry cannot capture (wider than the static inputs, a class its strategy cannot serve),
        are left out; a change with nothing left is dropped (not recorded, no hook).  Hooks see the routes after the
        change."""
        self._refit_running = False
        if self._catalog.asleep:  # proposed before sleep(): its keys are not captured while asleep
            return
        if error is not None:
            warn(f"cgregistry: registry {self._name!r}: refit failed: {type(error).__name__}: {error}")
            return
        if change is None:
            return
        catalog = self._catalog
        added = []
        for pair in change.added:
            if pair in catalog.failures or pair in catalog.entries:
                continue
            try:
                self._job.check_key(*pair)
            except (ValueError, KeyError) as exc:
                if pair not in self._warned:
                    self._warned.add(pair)
                    warn(f"cgregistry: registry {self._name!r}: a refit proposed {pair[0]} ({pair[1]}), which this registry "
                                  f"cannot capture ({exc}); the key is left out")
                continue
            added.append(pair)
        removed = [p for p in change.removed if catalog.holds(p)]
        if not added and not removed:
            return
        change = attrs.evolve(change, added=tuple(added), removed=tuple(removed))
        released = catalog.release_pairs(removed)
        self._pending.discard(removed)
        self._job.current(RECORDED_AT_REFIT)
        self._pending.submit(added)
        self.plan_changes.append(change)
        catalog.counters.plan_changes += 1
        self._events.released(released)
        self._events.plan_changed(change)
