"""Every hook a cgregistry plugin can implement, and nothing else.

Registration hooks receive a typed ``Registrar`` (call it with each object): cgregistry owns storage, protocol
checks and duplicate rules.  Observer hooks' return values are ignored; they run outside the per-step hot path
(``cgregistry_miss`` only on a miss), and one that raises is warned about while the others still run
(``cgregistry.hooks.events.notify``).  The one policy hook, ``cgregistry_choose_match``, is ``firstresult``.
Pluggy calls the most recently registered implementation first; built-ins are registered after entry points.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cgregistry.contracts.markers import PROJECT, hookimpl, hookspec

if TYPE_CHECKING:  # annotations only: hook specifications import nothing of the registry at run time
    from cgregistry.contracts.protocols import RegistryView
    from cgregistry.key.descriptor import BatchDescriptor
    from cgregistry.inspection import EntryInfo, PlanChange, Refreshed, Slept
    from cgregistry.key.matcher import Match
    from cgregistry.contracts.registrars import BackendRegistrar, StrategyRegistrar

__all__ = ["PROJECT", "hookimpl", "hookspec"]


# --------------------------------------------------------------- registration


@hookspec
def cgregistry_register_strategies(register: StrategyRegistrar) -> None:
    """Register capture strategies, calling ``register(strategy)`` once each; once per plugin manager.

    :param register: takes a :class:`cgregistry.contracts.protocols.Strategy` (``name``, ``relaxes_num_reqs``,
        ``capture(body, backend, pool) -> (graph, outputs)``; optionally ``unsupported_classes``, checked here).  A name
        another plugin registered, or a missing attribute, is a ``PluginError`` naming the plugin(s).
    :return: ignored.  Since 0.1.
    """


@hookspec
def cgregistry_register_backends(register: BackendRegistrar) -> None:
    """Register graph backends, calling ``register(backend)`` once each; once per plugin manager.

    :param register: takes a :class:`cgregistry.contracts.protocols.Backend` (a ``SegmentedBackend`` too for
        ``breakable`` and ``piecewise`` to run on it).  A duplicate name is a ``PluginError`` naming both plugins.
    :return: ignored.  Since 0.1.
    """


# --------------------------------------------------------------- policy


@hookspec(firstresult=True)
def cgregistry_choose_match(registry: RegistryView, actual: BatchDescriptor, candidates: Sequence[Match]) -> Match | None:
    """Choose which captured key serves ``actual``, overriding the matcher's ranking; called once per distinct actual
    shape (cached until entries change), never per step.

    :param candidates: every covering key, best first by the built-in rule (preferred strategy, then least padding),
        less excluded strategies' keys and keys over the padding cap; never empty.
    :return: one of ``candidates``, or None to leave the choice to the next implementation (finally the built-in
        rule); anything else is an error naming the plugin.  Since 0.1.
    """


# --------------------------------------------------------------- observers


@hookspec
def cgregistry_registry_created(registry: RegistryView) -> None:
    """A registry was constructed (telemetry plugins attach here).

    :param registry: the new registry; hold it weakly.
    :return: ignored.  Since 0.1.
    """


@hookspec
def cgregistry_capture_started(registry: RegistryView, key: BatchDescriptor, strategy: str) -> None:
    """Capture of one entry is about to start (after the plan was checked).

    :param key: the descriptor being captured, under ``strategy``.
    :return: ignored.  An exception raised here is reported as a warning; the capture goes on.  Since 0.1.
    """


@hookspec
def cgregistry_capture_finished(
    registry: RegistryView, key: BatchDescriptor, strategy: str, entry: EntryInfo | None, error: BaseException | None
) -> None:
    """Capture of one entry ended, successfully (``entry``) or not (``error``).

    :param entry: the new entry's record, or None on failure; ``error``: the ``CaptureError`` raised, or None.
    :return: ignored.  Since 0.1.
    """


@hookspec
def cgregistry_miss(registry: RegistryView, actual: BatchDescriptor) -> None:
    """``run`` found no covering key and is about to run the step eagerly.

    :param actual: the batch that missed.
    :return: ignored.  Called on every miss, so keep it cheap.  Since 0.1.
    """


@hookspec
def cgregistry_entry_failed(registry: RegistryView, key: BatchDescriptor, strategy: str, error: BaseException) -> None:
    """An entry's replay raised where the same batch ran eagerly: the entry was removed, the eager result returned (a
    replay that raises where eager raises too is a bad batch: nothing removed, no call).

    :param error: what the replay raised.
    :return: ignored.  Since 0.1.
    """


@hookspec
def cgregistry_evicted(registry: RegistryView, key: BatchDescriptor, strategy: str, memory_bytes: int) -> None:
    """An entry was evicted to keep the registry under its ``memory_budget``, least recently replayed first.

    :param key: pending again: a later batch that needs it captures it anew.  ``memory_bytes``: what it accounted for.
    :return: ignored.  Since 0.1.
    """


@hookspec
def cgregistry_released(registry: RegistryView, key: BatchDescriptor, strategy: str, memory_bytes: int) -> None:
    """An entry was removed on request, by ``release(key)`` or ``clear()``; with ``evicted`` and ``entry_failed``,
    every way an entry goes is observed.

    :param key: not pending: only a new ``capture`` brings it back.  ``memory_bytes``: what it accounted for.
    :return: ignored.  Since 0.1.
    """


@hookspec
def cgregistry_plan_changed(registry: RegistryView, change: PlanChange) -> None:
    """Adaptation (``GraphRegistry(adapt=...)``) changed the plan; called on the owner thread as the refit ends, after
    the removed keys were released (each reported by ``cgregistry_released``) and the added ones became pending.

    :param change: keys added and removed, padding before and after on the observed traffic, the reason.
    :return: ignored.  Since 0.2.
    """


@hookspec
def cgregistry_refreshed(registry: RegistryView, result: Refreshed) -> None:
    """``reg.refresh()`` ran after a weight update; called on its caller's thread after the stale entries were released
    (each reported by ``cgregistry_released``) and captured again (or made pending).

    :param result: the keys kept and captured again, the watched tensors that had moved, whether captures are pending.
    :return: ignored.  Since 0.2.
    """


@hookspec
def cgregistry_slept(registry: RegistryView, slept: Slept) -> None:
    """``reg.sleep()`` released every graph, the pool and the static inputs.

    :param slept: the keys ``wake()`` will capture again (hottest first), the graphs' memory, the static inputs' bytes.
    :return: ignored.  Since 0.2.
    """


@hookspec
def cgregistry_woke(registry: RegistryView, keys: Sequence[tuple[BatchDescriptor, str]]) -> None:
    """``reg.wake()`` took the static inputs back and queued (or captured) the plan it slept with.

    :param keys: the keys captured again, hottest first (each also reported by the capture hooks).
    :return: ignored.  Since 0.2.
    """
