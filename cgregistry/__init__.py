"""cgregistry: CUDA graphs for batched inference engines, keyed by BatchDescriptor.

The names an engine writer types, grouped by task.  The rest lives in its wing: records and explanations in
:mod:`cgregistry.inspection`, plan details in :mod:`cgregistry.plan`, the key's parts in :mod:`cgregistry.key`, every
error in :mod:`cgregistry.errors`, and what plugin authors need in :mod:`cgregistry.plugin`.
"""

# ruff: noqa: I001  (grouped by task on purpose)

# Describe batches and plan what to capture
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.key.matcher import Matcher
from cgregistry.plan.build import CapturePlan, PlanSettings
from cgregistry.plan.adapt import Adaptation

# The registry and its static inputs
from cgregistry.store.io import REPEAT_LAST, StaticInput
from cgregistry.registry import GraphRegistry, estimate_pool_memory

# Models with eager parts: attention as an eager break, piecewise compilation
from cgregistry.strategies.breaks import capture_barrier, eager_break, graph_break
from cgregistry.strategies.compiler import compile_piecewise
from cgregistry.contracts.runtime import FrozenReadWarning, current_batch, eager_batch

# Snapshots written by reg.snapshot() (the other records: cgregistry.inspection)
from cgregistry.inspection import load_snapshot

# The plugin set a registry uses (GraphRegistry(plugins=...)); plugin authors: cgregistry.plugin
from cgregistry import plugin
from cgregistry.hooks.manager import Plugins

# The errors an engine catches (each is a CgregistryError and keeps its builtin base; all of them: cgregistry.errors)
from cgregistry.errors import (
    CaptureError, CgregistryError, ConcurrentRunError, DebugError, InputError, PluginError, ServingStateError, SnapshotError,
    StaleOutputError, WeightsMovedError,
)

from cgregistry.version import __version__


__all__ = [
    # batches and plans
    "Adaptation", "BatchDescriptor", "CapturePlan", "Matcher", "PlanSettings",
    # the registry
    "GraphRegistry", "REPEAT_LAST", "StaticInput", "estimate_pool_memory",
    # eager parts
    "capture_barrier", "compile_piecewise", "current_batch", "eager_batch", "eager_break", "graph_break",
    # snapshots and plugins
    "load_snapshot", "Plugins", "plugin",
    # errors and warnings
    "CaptureError", "CgregistryError", "ConcurrentRunError", "DebugError", "InputError", "PluginError", "ServingStateError",
    "SnapshotError", "StaleOutputError", "WeightsMovedError", "FrozenReadWarning",
    "__version__",
]
