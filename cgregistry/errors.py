"""Every error class of cgregistry's own, in one module that imports nothing of the package.

Each keeps the builtin base that says what kind of mistake it is (``InputError`` is a ``ValueError``, ``CaptureError`` a
``RuntimeError``), so ``except ValueError`` keeps working, and ``except CgregistryError`` catches every one.  Invalid
arguments to constructors and settings (a ``BatchDescriptor`` field, a ``PlanSettings`` value, an unknown strategy name)
raise plain ``ValueError``, ``TypeError`` or ``KeyError`` naming the argument, as Python's own functions do.  Every one
pickles, message, class and attributes alike (a multi-process engine forwards a worker's error).
"""

from __future__ import annotations

import copyreg
from typing import Any

__all__ = [
    "CgregistryError", "InputError", "OutputError", "CaptureError", "PluginError", "BreakError", "PiecewiseError", "GraphUnsafeOpError", "ServingStateError", "WeightsMovedError", "DebugError", "MovedTensorError", "StaleOutputError", "ConcurrentRunError", "OwnerThreadError", "SnapshotError", "AgreementError",
]


class CgregistryError(Exception):
    """An error class of cgregistry's own (what a step raises keeps its own type)."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles as ``cls(*self.args)``, which fails for a subclass whose constructor takes other arguments
        # than its message (CaptureError's descriptor, strategy and cause): ``cls.__new__(cls, *self.args)`` instead,
        # without calling ``__init__``, and the attributes restored.
        return (copyreg.__newobj__, (type(self), *self.args), self.__dict__ or None)


class InputError(CgregistryError, ValueError):
    """A live input does not fit its static buffer (name, shape, dtype or device)."""


class OutputError(CgregistryError, TypeError):
    """A step returned something the registry cannot slice (names the leaf)."""


class CaptureError(CgregistryError, RuntimeError):
    """Capturing one entry failed; the registry is as it was before that entry (``descriptor``: the key, a ``BatchDescriptor``)."""

    def __init__(self, descriptor: Any, strategy: str, cause: BaseException, note: str = "") -> None:
        super().__init__(f"capturing {descriptor} with strategy {strategy!r} failed: {type(cause).__name__}: {cause}{note}")
        self.descriptor = descriptor
        self.strategy = strategy


class PluginError(CgregistryError, ValueError):
    """A plugin registered something invalid (names the plugin)."""


class BreakError(CgregistryError, RuntimeError):
    """An eager break misbehaved (names the break): wrong return at replay, unjoined stream, nesting."""


class PiecewiseError(CgregistryError, RuntimeError):
    """The model could not be traced or split as asked; the message says where and what to do."""


class GraphUnsafeOpError(CgregistryError, RuntimeError):
    """An op that a CUDA graph capture cannot contain; names the op and where it was called."""

    def __init__(self, op: str, why: str, where: str) -> None:
        super().__init__(f"graph-unsafe op {op} at {where}: {why}")
        self.op = op
        self.why = why
        self.where = where


class ServingStateError(CgregistryError, RuntimeError):
    """A graph would be replayed under another state (autocast, default dtype, matmul flags) than it was captured under."""


class WeightsMovedError(CgregistryError, RuntimeError):
    """A graph would read a watched weight where it was at capture, after the weight moved (call ``reg.refresh()``)."""


class DebugError(CgregistryError, RuntimeError):
    """A tensor a graph reads is no longer where it was at capture (names it)."""


class MovedTensorError(DebugError, WeightsMovedError):
    """Debug mode's check found a watched tensor moved: a ``DebugError`` and a ``WeightsMovedError`` alike, so an engine's
    ``except cg.WeightsMovedError`` catches it whether debug mode is on or not."""


class StaleOutputError(CgregistryError, RuntimeError):
    """An output of an earlier ``run()`` was read after a later one overwrote it (names it)."""


class ConcurrentRunError(CgregistryError, RuntimeError):
    """A call that would run beside one of the registry's ``run()`` calls: from inside it (the step or a hook calling
    back), or from a thread that does not own the registry (``OwnerThreadError``)."""


class OwnerThreadError(ConcurrentRunError):
    """A call from another thread than the one that owns the registry (its serving thread): ``run()``, or a call that
    changes its graphs.  Names the owner; ``reg.call_on_owner(fn, ...)`` hands such a call over."""


class SnapshotError(CgregistryError, ValueError):
    """A snapshot that cannot be read (names the field or the schema version)."""


class AgreementError(CgregistryError, RuntimeError):
    """The ranks of a group could not agree on one key: their batches differ where they must be the same, or a rank
    did not take part in time (names the ranks and what each brought)."""
