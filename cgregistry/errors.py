"""The base of cgregistry's own error classes: a leaf module that imports nothing of the package.

Each error class also keeps the builtin base that says what kind of mistake it is
(``InputError`` is a ``ValueError``, ``CaptureError`` a ``RuntimeError``), so
``except ValueError`` keeps working, and ``except CgregistryError`` catches every
one of them.  Invalid arguments to constructors and settings (a ``BatchDescriptor``
field, a ``PlanSettings`` value, an unknown strategy name) raise plain ``ValueError``,
``TypeError`` or ``KeyError`` naming the argument, as Python's own functions do.

Every one of them pickles (a multi-process engine forwards a worker's error to its
front end): message, class and attributes survive, whatever the class's constructor takes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CgregistryError"]


def _rebuild(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    """An error of class ``cls`` with ``args`` (its message), made without calling ``cls.__init__``."""
    return cls.__new__(cls, *args)


class CgregistryError(Exception):
    """An error class of cgregistry's own (what a step raises keeps its own type)."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles as ``cls(*self.args)``, which fails for a subclass whose constructor takes
        # other arguments than its message (CaptureError's descriptor, strategy and cause); rebuild
        # from the message and restore the attributes instead.
        return (_rebuild, (type(self), self.args), self.__dict__ or None)
