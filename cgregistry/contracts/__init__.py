"""What a plugin implements and registers: the strategy and backend protocols, the hook markers, the registrars."""

from __future__ import annotations

from cgregistry.contracts.protocols import Backend, Graph, RegistryView, Segment, SegmentedBackend, Strategy, StrategyLookup

__all__ = ["Backend", "Graph", "RegistryView", "Segment", "SegmentedBackend", "Strategy", "StrategyLookup"]
