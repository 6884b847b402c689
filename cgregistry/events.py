"""Events: every hook a registry calls, one typed method each, and the only place that builds hook arguments.

Observer hooks go through ``Plugins.notify`` (one implementation at a time, a raising one reported
as a warning); an event nobody observes costs an attribute test.  Hooks are given the registry as a
:class:`~cgregistry.contracts.RegistryView`: something to read, not to drive.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cgregistry.adaptive import PlanChange
from cgregistry.capture import CaptureError
from cgregistry.contracts import RegistryView
from cgregistry.descriptor import BatchDescriptor
from cgregistry.entries import Entry
from cgregistry.inspection import Refreshed, Slept
from cgregistry.matcher import Match
from cgregistry.plugins import Plugins
from cgregistry.routing import Chooser

__all__ = ["Events"]


class Events:
    """Tells plugins what a registry did."""

    __slots__ = ("_plugins", "_notify", "_registry", "_backend", "miss_observed")

    def __init__(self, plugins: Plugins, registry: RegistryView, backend: str) -> None:
        self._plugins = plugins
        self._notify = plugins.notify
        self._registry = registry
        self._backend = backend  # the backend name EntryInfo records carry
        self.miss_observed = plugins.observed("cgregistry_miss")  # an unobserved miss costs nothing

    def chooser(self) -> tuple[Chooser | None, str]:
        """The ``cgregistry_choose_match`` policy, if a plugin implements it, and the implementing plugins' names."""
        if not self._plugins.observed("cgregistry_choose_match"):
            return None, ""
        hook = self._plugins.pm.hook.cgregistry_choose_match
        registry = self._registry

        def choose(actual: BatchDescriptor, candidates: list[Match]) -> Any:
            return hook(registry=registry, actual=actual, candidates=candidates)

        return choose, ", ".join(i.plugin_name for i in hook.get_hookimpls())

    def registry_created(self) -> None:
        self._notify("cgregistry_registry_created", registry=self._registry)

    def capture_started(self, key: BatchDescriptor, strategy: str) -> None:
        self._notify("cgregistry_capture_started", registry=self._registry, key=key, strategy=strategy)

    def capture_finished(self, key: BatchDescriptor, strategy: str, entry: Entry | None, error: CaptureError | None) -> None:
        info = entry.info(self._backend) if entry is not None else None
        self._notify("cgregistry_capture_finished", registry=self._registry, key=key, strategy=strategy, entry=info, error=error)

    def miss(self, actual: BatchDescriptor) -> None:
        if self.miss_observed:
            self._notify("cgregistry_miss", registry=self._registry, actual=actual)

    def entry_failed(self, entry: Entry, error: BaseException) -> None:
        self._notify("cgregistry_entry_failed", registry=self._registry, key=entry.key, strategy=entry.strategy, error=error)

    def evicted(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            self._notify(
                "cgregistry_evicted", registry=self._registry, key=entry.key, strategy=entry.strategy, memory_bytes=entry.memory_bytes
            )

    def released(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            self._notify(
                "cgregistry_released", registry=self._registry, key=entry.key, strategy=entry.strategy, memory_bytes=entry.memory_bytes
            )

    def plan_changed(self, change: PlanChange) -> None:
        self._notify("cgregistry_plan_changed", registry=self._registry, change=change)

    def refreshed(self, result: Refreshed) -> None:
        self._notify("cgregistry_refreshed", registry=self._registry, result=result)

    def slept(self, slept: Slept) -> None:
        self._notify("cgregistry_slept", registry=self._registry, slept=slept)

    def woke(self, keys: tuple[tuple[BatchDescriptor, str], ...]) -> None:
        self._notify("cgregistry_woke", registry=self._registry, keys=keys)
