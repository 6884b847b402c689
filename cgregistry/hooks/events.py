"""Events: every hook a registry calls, one typed method each, and the only place that builds hook arguments.

Observer hooks are called one implementation at a time (``notify``), a raising one reported as a warning; an event
nobody observes builds no argument.  Hooks get the registry as a read-only
:class:`~cgregistry.contracts.protocols.RegistryView`, held weakly: events never keep a dropped registry alive (hooks
of a collected one are not called).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

from cgregistry.contracts.protocols import RegistryView
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.store.catalog import Chooser, Entry
from cgregistry.inspection import PlanChange, Refreshed, Slept
from cgregistry.key.matcher import Match
from cgregistry.hooks.manager import Plugins
from cgregistry.errors import CaptureError

__all__ = ["Events", "notify"]


class Events:
    """Tells plugins what a registry did."""

    __slots__ = ("_plugins", "_hook", "_pm", "_registry", "_backend", "miss_observed")

    def __init__(self, plugins: Plugins, registry: RegistryView, backend: str) -> None:
        self._plugins = plugins
        self._pm = plugins.pm
        self._hook = plugins.pm.hook
        self._registry = weakref.ref(registry)
        self._backend = backend  # the backend name EntryInfo records carry
        self.miss_observed = plugins.observed("cgregistry_miss")  # an unobserved miss costs nothing

    def chooser(self) -> tuple[Chooser | None, str]:
        """The ``cgregistry_choose_match`` policy, if a plugin implements it, and the implementing plugins' names."""
        if not self._plugins.observed("cgregistry_choose_match"):
            return None, ""
        hook = self._pm.hook.cgregistry_choose_match
        registry = self._registry

        def choose(actual: BatchDescriptor, candidates: list[Match]) -> Any:
            return hook(registry=registry(), actual=actual, candidates=candidates)

        return choose, ", ".join(i.plugin_name for i in hook.get_hookimpls())

    def _observed(self, hook_name: str) -> bool:  # here, not Plugins.observed: a capture enters no other module
        return bool(getattr(self._hook, hook_name).get_hookimpls())

    def _tell(self, hook_name: str, **kwargs: Any) -> None:
        registry = self._registry()
        if registry is not None:
            notify(self._pm, hook_name, registry=registry, **kwargs)

    def registry_created(self) -> None:
        self._tell("cgregistry_registry_created")

    def capture_started(self, key: BatchDescriptor, strategy: str) -> None:
        self._tell("cgregistry_capture_started", key=key, strategy=strategy)

    def capture_finished(self, key: BatchDescriptor, strategy: str, entry: Entry | None, error: CaptureError | None) -> None:
        if self._observed("cgregistry_capture_finished"):
            info = entry.info(self._backend) if entry is not None else None
            self._tell("cgregistry_capture_finished", key=key, strategy=strategy, entry=info, error=error)

    def miss(self, actual: BatchDescriptor) -> None:
        if self.miss_observed:
            self._tell("cgregistry_miss", actual=actual)

    def entry_failed(self, entry: Entry, error: BaseException) -> None:
        self._tell("cgregistry_entry_failed", key=entry.key, strategy=entry.strategy, error=error)

    def evicted(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            self._tell("cgregistry_evicted", key=entry.key, strategy=entry.strategy, memory_bytes=entry.memory_bytes)

    def released(self, entries: Iterable[Entry]) -> None:
        for entry in entries:
            self._tell("cgregistry_released", key=entry.key, strategy=entry.strategy, memory_bytes=entry.memory_bytes)

    def plan_changed(self, change: PlanChange) -> None:
        self._tell("cgregistry_plan_changed", change=change)

    def refreshed(self, result: Refreshed) -> None:
        self._tell("cgregistry_refreshed", result=result)

    def slept(self, slept: Slept) -> None:
        self._tell("cgregistry_slept", slept=slept)

    def woke(self, keys: tuple[tuple[BatchDescriptor, str], ...]) -> None:
        self._tell("cgregistry_woke", keys=keys)


def notify(pm: Any, hook_name: str, **kwargs: Any) -> None:
    """Call an observer hook one implementation at a time: one that raises is reported as a ``RuntimeWarning`` naming
    its plugin, and the others still run.  Observers watch; they cannot stop a capture or a step."""
    hook = getattr(pm.hook, hook_name)
    for impl in reversed(hook.get_hookimpls()):  # pluggy's order: the last registered first
        try:
            if impl.hookwrapper or impl.wrapper:  # a wrapper needs pluggy's own call, on its plugin alone
                others = [p for p in pm.get_plugins() if p is not impl.plugin]
                pm.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)
            else:
                impl.function(*[kwargs[name] for name in impl.argnames])
        except Exception as exc:
            warnings.warn(
                f"cgregistry: {hook_name} of plugin {impl.plugin_name!r} raised {type(exc).__name__}: {exc}; "
                "ignored (an observer hook cannot change what the registry does)",
                RuntimeWarning,
                stacklevel=3,
            )
