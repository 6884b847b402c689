"""The installed distribution's version, read from package metadata (a leaf module)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("cgregistry")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
