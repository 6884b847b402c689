"""Every hook a cgregistry plugin can implement, and nothing else.

Hooks are prefixed ``cgregistry_``.  Registration hooks receive a typed
``Registrar`` (call it with each object) so that cgregistry owns storage,
protocol checks and duplicate rules.  Observer hooks are called on events and
their return values are ignored; they run outside the per-step hot path (``run``
calls ``cgregistry_miss`` only on a miss), one implementation at a time, and one
that raises is reported as a warning while the others still run
(``cgregistry.hooks.events.notify``).  The one policy hook, ``cgregistry_choose_match``, is
``firstresult``.

Ordering: pluggy calls the most recently registered implementation first;
built-ins are registered after entry points, so a plugin's observer runs after
the built-ins' (the built-ins implement none).
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
    """Register capture strategies by calling ``register(strategy)`` once per strategy.

    :param register: a ``Registrar``; takes an object implementing
        :class:`cgregistry.contracts.protocols.Strategy`: ``name: str``, ``relaxes_num_reqs: bool``
        and ``capture(body, backend, pool) -> (graph, outputs)``, where ``graph``
        is a :class:`cgregistry.contracts.protocols.Graph` (``replay()``, ``memory_bytes``,
        optionally ``num_segments`` and ``breaks``); optionally ``unsupported_classes``
        (key classes it cannot serve), checked here.  A name already registered by another plugin is a
        ``PluginError`` naming both plugins; a missing attribute is a
        ``PluginError`` naming the plugin.
    :return: ignored.

    Called once per plugin manager, each plugin in registration order.  Since 0.1.
    """


@hookspec
def cgregistry_register_backends(register: BackendRegistrar) -> None:
    """Register graph backends by calling ``register(backend)`` once per backend.

    :param register: a ``Registrar``; takes an object implementing
        :class:`cgregistry.contracts.protocols.Backend` (``name``, ``is_available``, ``device``,
        ``new_pool``, ``warmup``, ``capture``, ``share_outputs``, ``recover_pool``,
        ``synchronize``), and :class:`cgregistry.contracts.protocols.SegmentedBackend` too
        (``capture_context``, ``begin_capture``, ``hold_intermediates``) for the
        ``breakable`` and ``piecewise`` strategies to run on it.
        Duplicate names are a ``PluginError`` naming both plugins.
    :return: ignored.

    Called once per plugin manager, each plugin in registration order.  Since 0.1.
    """


# --------------------------------------------------------------- policy


@hookspec(firstresult=True)
def cgregistry_choose_match(registry: RegistryView, actual: BatchDescriptor, candidates: Sequence[Match]) -> Match | None:
    """Choose which captured key serves ``actual``, overriding the matcher's ranking.

    :param registry: the registry asking.
    :param actual: the batch to serve.
    :param candidates: every covering key as a ``Match``, best first by the
        built-in rule (preferred strategy, then least padding), less keys of
        strategies the run excluded and keys over the padding cap; never empty.
    :return: one of ``candidates``, or None to leave the choice to the next
        implementation (and finally to the built-in rule).  Returning anything
        else is an error naming the plugin.

    ``firstresult``: the first non-None answer wins.  Called once per distinct
    actual shape (the answer is cached until entries change), never per step.
    Since 0.1.
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

    :param registry: the capturing registry.
    :param key: the descriptor being captured.
    :param strategy: the strategy's name.
    :return: ignored.  An exception raised here is reported as a warning; the capture goes on.  Since 0.1.
    """


@hookspec
def cgregistry_capture_finished(
    registry: RegistryView, key: BatchDescriptor, strategy: str, entry: EntryInfo | None, error: BaseException | None
) -> None:
    """Capture of one entry ended, successfully (``entry``) or not (``error``).

    :param registry: the capturing registry.
    :param key: the descriptor captured.
    :param strategy: the strategy's name.
    :param entry: the new entry's record, or None on failure.
    :param error: the ``CaptureError`` raised to the caller, or None on success.
    :return: ignored.  Since 0.1.
    """


@hookspec
def cgregistry_miss(registry: RegistryView, actual: BatchDescriptor) -> None:
    """``run`` found no covering key and is about to run the step eagerly.

    :param registry: the registry.
    :param actual: the batch that missed.
    :return: ignored.  Called on every miss, so keep it cheap.  Since 0.1.
    """


@hookspec
def cgregistry_entry_failed(registry: RegistryView, key: BatchDescriptor, strategy: str, error: BaseException) -> None:
    """An entry's replay raised where the same batch ran eagerly: the entry was removed, the eager result returned.

    A replay that raises where eager raises too is a bad batch, not a broken entry: nothing is
    removed and this hook is not called.

    :param registry: the registry.
    :param key: the failed entry's descriptor.
    :param strategy: its strategy.
    :param error: what the replay raised.
    :return: ignored.  Since 0.1.
    """


@hookspec
def cgregistry_evicted(registry: RegistryView, key: BatchDescriptor, strategy: str, memory_bytes: int) -> None:
    """An entry was evicted to keep the registry under its ``memory_budget``.

    :param registry: the registry.
    :param key: the evicted entry's descriptor (it is pending again: a later
        batch that needs it captures it anew).
    :param strategy: its strategy.
    :param memory_bytes: the measured memory the entry accounted for.
    :return: ignored.  Least recently replayed entries go first.  Since 0.1.
    """


@hookspec
def cgregistry_released(registry: RegistryView, key: BatchDescriptor, strategy: str, memory_bytes: int) -> None:
    """An entry was removed on request, by ``release(key)`` or ``clear()``.

    :param registry: the registry.
    :param key: the released entry's descriptor (not pending: only a new
        ``capture`` brings it back).
    :param strategy: its strategy.
    :param memory_bytes: the measured memory the entry accounted for.
    :return: ignored.  With ``evicted`` and ``entry_failed``, every way an entry
        goes is observed.  Since 0.1.
    """


@hookspec
def cgregistry_plan_changed(registry: RegistryView, change: PlanChange) -> None:
    """Adaptation (``GraphRegistry(adapt=...)``) changed the plan to follow the traffic.

    Called on the owner thread, as the refit (a piece of the pending captures, run between two
    steps) ends, after the removed keys were released (each also reported by
    ``cgregistry_released``) and the added ones became pending.

    :param registry: the registry.
    :param change: what changed and why (``cgregistry.plan.adapt.PlanChange``: keys added and
        removed, padding before and after on the observed traffic, the reason).
    :return: ignored.  Since 0.2.
    """


@hookspec
def cgregistry_refreshed(registry: RegistryView, result: Refreshed) -> None:
    """``reg.refresh()`` ran after a weight update.

    Called on the thread that called ``refresh()``, after the stale entries were released (each
    also reported by ``cgregistry_released``) and captured again (or made pending).

    :param registry: the registry.
    :param result: ``cgregistry.inspection.Refreshed``: the keys kept, the keys captured again, the
        watched tensors that had moved, and whether the new captures run between the steps that follow.
    :return: ignored.  Since 0.2.
    """


@hookspec
def cgregistry_slept(registry: RegistryView, slept: Slept) -> None:
    """``reg.sleep()`` released every graph, the pool and the static inputs.

    :param registry: the registry.
    :param slept: ``cgregistry.inspection.Slept``: the keys ``wake()`` will capture again (hottest
        first), the graphs' measured memory, and the static inputs' bytes.
    :return: ignored.  Since 0.2.
    """


@hookspec
def cgregistry_woke(registry: RegistryView, keys: Sequence[tuple[BatchDescriptor, str]]) -> None:
    """``reg.wake()`` took the static inputs back and queued (or captured) the plan it slept with.

    :param registry: the registry.
    :param keys: the keys captured again, hottest first (each also reported by the capture hooks).
    :return: ignored.  Since 0.2.
    """
