"""Capture strategies: how one registry entry is captured and replayed (``full``, ``breakable``,
``piecewise``; others are plugins).  The contract is :class:`cgregistry.contracts.protocols.Strategy`."""

from __future__ import annotations

from cgregistry.contracts.protocols import Strategy

__all__ = ["Strategy"]
