"""One captured entry: its graph, how ``run()`` replays it and slices its outputs, and its counters.

Plain data, kept by the :class:`~cgregistry.store.catalog.Catalog`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.inspection import EntryInfo, key_class
from cgregistry.store.outputs import OutputSlicer

__all__ = ["Entry", "Pair"]

Pair = tuple[BatchDescriptor, str]  # (key, strategy name)


class Entry:
    """One captured graph and its counters."""

    __slots__ = (
        "key", "strategy", "graph", "replay", "slicer", "capture_seconds", "memory_bytes",
        "replays", "padded_tokens", "graph_tokens", "last_step", "key_class", "has_breaks", "buffers", "weights",
        "generation", "read_live_batch", "device_bytes", "__weakref__",
    )

    def __init__(self, key: BatchDescriptor, strategy: str, graph: Any, slicer: OutputSlicer, seconds: float) -> None:
        self.key = key
        self.strategy = strategy
        self.graph = graph
        self.replay = graph.replay
        self.slicer = slicer
        self.capture_seconds = seconds
        self.memory_bytes = int(graph.memory_bytes)
        self.replays = 0
        self.padded_tokens = 0
        self.graph_tokens = 0
        self.last_step = 0
        self.key_class = key_class(key, strategy)
        self.has_breaks = bool(getattr(graph, "breaks", 0))  # eager breaks read current_batch() at replay
        self.buffers: tuple[Any, ...] | None = None  # static inputs of its own (captured in the background), else shared
        self.weights: Mapping[str, Any] = {}  # the watched tensors' layouts at its capture (WeightWatch.seen)
        self.read_live_batch = False  # its recording read current_batch().actual or .payload outside an eager break
        self.generation = 0  # the watch's generation at its capture: a replay in a later one checks the addresses first
        # Device memory its capture took (measured where the backend can: pool growth, warm-up, driver objects), else
        # the graph's own count; what memory_budget sums.
        self.device_bytes = self.memory_bytes

    @property
    def pair(self) -> Pair:
        return (self.key, self.strategy)

    def info(self, backend: str, predicted_bytes: int | None = None) -> EntryInfo:
        """This entry as a read-only record (what ``entries()`` and the hooks hand out)."""
        graph = self.graph
        return EntryInfo(
            self.key, self.strategy, backend, self.capture_seconds, self.memory_bytes, self.replays, self.padded_tokens,
            self.last_step, segments=getattr(graph, "num_segments", None), breaks=getattr(graph, "breaks", None),
            device_bytes=self.device_bytes, predicted_bytes=predicted_bytes,
        )
