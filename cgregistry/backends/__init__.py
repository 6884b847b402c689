"""Graph backends: the primitive a strategy drives (``cuda``, ``cpu``; others are plugins).

A backend runs a callable eagerly for warm-up, captures it into a replayable graph inside a shared pool, and says how
captured outputs are held.  The contract is :class:`cgregistry.contracts.protocols.Backend` (and ``SegmentedBackend``
for strategies that capture in segments); the names are re-exported here.
"""

from __future__ import annotations

from cgregistry.contracts.protocols import Backend, Graph, Segment, SegmentedBackend

__all__ = ["Backend", "Graph", "Segment", "SegmentedBackend"]
