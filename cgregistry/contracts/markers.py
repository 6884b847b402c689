"""The pluggy markers of the ``cgregistry`` project: a leaf module that imports nothing of the package.

Built-in strategies and backends, hook specifications and third-party plugins all import their markers from here, so
marking an implementation never pulls in the registry.
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "cgregistry"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
