"""cgregistry: CUDA graphs for batched inference engines, keyed by BatchDescriptor."""

from cgregistry.backends.cpu import GraphUnsafeOpError
from cgregistry.breaks import (
    BreakContext,
    capture_barrier,
    current_batch,
    eager_break,
    graph_break,
)
from cgregistry.buffers import InputError, StaticInput
from cgregistry.compiler import PiecewiseCompiler, PiecewiseError, compile_piecewise
from cgregistry.debug import DebugError, StaleOutputError
from cgregistry.descriptor import BatchDescriptor, Padding
from cgregistry.hookspecs import hookimpl, hookspec
from cgregistry.inspection import ClassStats, Snapshot, SnapshotError, load_snapshot
from cgregistry.matcher import Candidate, Explanation, Match, Matcher
from cgregistry.outputs import OutputError
from cgregistry.plan import MODES, CapturePlan, PlanEntry, UncoveredRange
from cgregistry.plugins import PluginError, Plugins, make_plugin_manager
from cgregistry.registry import (
    CaptureError,
    ConcurrentRunError,
    EntryInfo,
    GraphRegistry,
    Stats,
)
from cgregistry.runtime import eager_batch
from cgregistry.strategies.breakable import BreakError
from cgregistry.version import __version__

__all__ = [
    "MODES",
    "BatchDescriptor",
    "BreakContext",
    "BreakError",
    "Candidate",
    "CaptureError",
    "ClassStats",
    "ConcurrentRunError",
    "DebugError",
    "CapturePlan",
    "EntryInfo",
    "Explanation",
    "GraphRegistry",
    "GraphUnsafeOpError",
    "InputError",
    "Match",
    "Matcher",
    "OutputError",
    "Padding",
    "PiecewiseCompiler",
    "PiecewiseError",
    "PlanEntry",
    "PluginError",
    "Plugins",
    "Snapshot",
    "SnapshotError",
    "StaticInput",
    "StaleOutputError",
    "Stats",
    "UncoveredRange",
    "__version__",
    "capture_barrier",
    "compile_piecewise",
    "current_batch",
    "eager_batch",
    "eager_break",
    "graph_break",
    "hookimpl",
    "hookspec",
    "load_snapshot",
    "make_plugin_manager",
]
