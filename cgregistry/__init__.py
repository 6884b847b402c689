"""cgregistry: CUDA graphs for batched inference engines, keyed by BatchDescriptor.

The names an engine writer needs, grouped by task and sorted within each group;
plugin authors find theirs in :mod:`cgregistry.plugin` (``cg.plugin.hookimpl``,
the contracts, the registrars).
"""

# ruff: noqa: I001  (grouped by task on purpose)

# Describe batches and plan what to capture
from cgregistry.key.descriptor import BatchDescriptor, Padding
from cgregistry.plan.build import MODES, CapturePlan, Downgrade, PlanEntry, PlanSettings, UncoveredRange
from cgregistry.plan.adapt import Adaptation, PlanChange

# The registry and its static inputs
from cgregistry.store.buffers import REPEAT_LAST, StaticInput
from cgregistry.registry import GraphRegistry

# Models with eager parts: attention as an eager break, piecewise compilation
from cgregistry.strategies.breaks import capture_barrier, eager_break, graph_break
from cgregistry.strategies.compiler import PiecewiseCompiler, compile_piecewise
from cgregistry.state.runtime import BreakContext, FrozenReadWarning, current_batch, eager_batch

# Inspection: entries, statistics, explanations, snapshots
from cgregistry.inspection import ClassStats, EntryInfo, Refreshed, Slept, Snapshot, Stats, load_snapshot
from cgregistry.key.matcher import Candidate, Explanation, Match, Matcher, PaddingCap

# The plugin set a registry uses (GraphRegistry(plugins=...)); plugin authors: cgregistry.plugin
from cgregistry import plugin
from cgregistry.hooks.manager import Plugins, make_plugin_manager

# Errors: each is a CgregistryError and keeps its builtin base (ValueError, RuntimeError, ...)
from cgregistry.errors import BreakError, CaptureError, CgregistryError, ConcurrentRunError, DebugError, GraphUnsafeOpError, InputError, MovedTensorError, OutputError, PiecewiseError, PluginError, ServingStateError, SnapshotError, StaleOutputError, WeightsMovedError

from cgregistry.version import __version__

from cgregistry.plan.build import use_installed_plugins

use_installed_plugins(Plugins)  # plans find installed plugin strategies without importing the plugin manager

def __getattr__(name: str) -> object:
    """``cgregistry.hookimpl`` / ``hookspec`` of 0.1 plugins still work, with a warning: they live in cgregistry.plugin."""
    if name in ("hookimpl", "hookspec"):
        import warnings

        warnings.warn(
            f"cgregistry.{name} moved to cgregistry.plugin.{name} (plugin-author names live there)", DeprecationWarning, stacklevel=2
        )
        return getattr(plugin, name)
    raise AttributeError(f"module 'cgregistry' has no attribute {name!r}")


__all__ = [
    # batches and plans
    "MODES", "Adaptation", "BatchDescriptor", "CapturePlan", "Downgrade", "Padding", "PlanChange", "PlanEntry", "PlanSettings",
    "UncoveredRange",
    # the registry
    "GraphRegistry", "REPEAT_LAST", "StaticInput",
    # eager parts
    "BreakContext", "PiecewiseCompiler", "capture_barrier", "compile_piecewise", "current_batch", "eager_batch",
    "eager_break", "graph_break",
    # inspection
    "Candidate", "ClassStats", "EntryInfo", "Explanation", "Match", "Matcher", "PaddingCap", "Refreshed", "Slept", "Snapshot", "Stats",
    "load_snapshot",
    # plugins in use
    "Plugins", "make_plugin_manager", "plugin",
    # errors
    "BreakError", "CaptureError", "CgregistryError", "ConcurrentRunError", "DebugError", "GraphUnsafeOpError",
    "InputError", "MovedTensorError", "OutputError", "PiecewiseError", "PluginError", "ServingStateError", "SnapshotError", "StaleOutputError",
    "WeightsMovedError",
    # warnings
    "FrozenReadWarning",
    "__version__",
]
