"""Capture strategies: how one registry entry is captured and replayed (``full``, ``breakable``,
``piecewise``; others are plugins).  The contract is :class:`cgregistry.contracts.Strategy`."""

from __future__ import annotations

from cgregistry.contracts import Strategy

__all__ = ["Strategy"]
