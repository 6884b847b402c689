"""The base of every error cgregistry raises on purpose: a leaf module that imports nothing of the package.

Each error also keeps the builtin base that says what kind of mistake it is
(``InputError`` is a ``ValueError``, ``CaptureError`` a ``RuntimeError``), so
``except ValueError`` keeps working; ``except CgregistryError`` catches them all.
"""

from __future__ import annotations

__all__ = ["CgregistryError"]


class CgregistryError(Exception):
    """An error raised by cgregistry itself (never a wrapped step exception's own type)."""
