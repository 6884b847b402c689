"""Everything a plugin author needs, in one namespace: ``import cgregistry.plugin as cgp`` (or ``cg.plugin``).

- markers: ``hookimpl`` (mark an implementation), ``hookspec``, ``PROJECT`` (the entry-point group);
- the contract: ``Strategy``, ``Backend``, ``SegmentedBackend``, ``Segment``, ``Graph``;
- registration: ``StrategyRegistrar`` and ``BackendRegistrar`` (what registration hooks receive);
- built-ins to build on: ``FullStrategy``, ``BreakableStrategy``;
- the manager: ``Plugins``, ``make_plugin_manager``, ``PluginInfo``, ``PluginError``;
- the live batch an eager break reads: ``BreakContext`` (what ``cgregistry.current_batch()`` returns).

The conformance suite for a new strategy is :mod:`cgregistry.testing`.
"""

from cgregistry.contracts.protocols import Backend, Graph, Segment, SegmentedBackend, Strategy
from cgregistry.contracts.markers import PROJECT, hookimpl, hookspec
from cgregistry.hooks.manager import (
    BackendRegistrar,
    PluginError,
    PluginInfo,
    Plugins,
    Registrar,
    StrategyRegistrar,
    make_plugin_manager,
)
from cgregistry.contracts.runtime import BreakContext
from cgregistry.strategies.breakable import BreakableStrategy
from cgregistry.strategies.full import FullStrategy

__all__ = [
    "PROJECT",
    "Backend",
    "BackendRegistrar",
    "BreakContext",
    "BreakableStrategy",
    "FullStrategy",
    "Graph",
    "PluginError",
    "PluginInfo",
    "Plugins",
    "Registrar",
    "Segment",
    "SegmentedBackend",
    "Strategy",
    "StrategyRegistrar",
    "hookimpl",
    "hookspec",
    "make_plugin_manager",
]
