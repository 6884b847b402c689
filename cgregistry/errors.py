"""The base of cgregistry's own error classes: a leaf module that imports nothing of the package.

Each error class also keeps the builtin base that says what kind of mistake it is
(``InputError`` is a ``ValueError``, ``CaptureError`` a ``RuntimeError``), so
``except ValueError`` keeps working, and ``except CgregistryError`` catches every
one of them.  Invalid arguments to constructors and settings (a ``BatchDescriptor``
field, a ``PlanSettings`` value, an unknown strategy name) raise plain ``ValueError``,
``TypeError`` or ``KeyError`` naming the argument, as Python's own functions do.
"""

from __future__ import annotations

__all__ = ["CgregistryError"]


class CgregistryError(Exception):
    """An error class of cgregistry's own (what a step raises keeps its own type)."""
