"""Debug mode: catch the two silent failures of graph replay, each named.

1. A tensor a graph reads moved (a weight reassigned by ``load_state_dict`` with
   ``assign=True``, say): the graph still reads the old address.  Debug mode
   records the address of every static input and every watched tensor at
   capture and compares them before each replay.
2. An output of an earlier ``run()`` read after a later ``run()`` overwrote it.
   Debug mode returns outputs as :class:`CheckedOutput` tensors, which raise
   :class:`StaleOutputError` when any torch operation touches them after the
   next ``run()``.  (Poisoning the old outputs' memory instead was rejected: an
   output may alias a static input or a weight, which poison would corrupt, and
   a NaN read is found late and unnamed.)

Both checks cost a few microseconds per ``run()``; leave debug mode off in serving.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["AddressWatch", "CheckedOutput", "DebugError", "StaleOutputError"]


class DebugError(RuntimeError):
    """A tensor a graph reads is no longer where it was at capture (names it)."""


class StaleOutputError(RuntimeError):
    """An output of an earlier ``run()`` was read after a later one overwrote it (names it)."""


class AddressWatch:
    """Addresses of tensors graphs read, recorded once and compared before each replay."""

    def __init__(self) -> None:
        self._watched: dict[str, tuple[torch.Tensor, int]] = {}

    def watch(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"watch() takes (name, tensor) pairs, got {name!r}: {type(tensor).__name__}")
            self._watched[name] = (tensor, tensor.data_ptr())

    def check(self) -> None:
        for name, (tensor, ptr) in self._watched.items():
            now = tensor.data_ptr()
            if now != ptr:
                raise DebugError(
                    f"{name} moved from {ptr:#x} to {now:#x} since capture; captured graphs still read the old "
                    "address. Update it in place (tensor.copy_(new)) instead of replacing it, or capture again"
                )

    def __len__(self) -> int:
        return len(self._watched)


class CheckedOutput(torch.Tensor):
    """A view of graph output memory that refuses to be read after the next ``run()``."""

    _cg_label: str
    _cg_run: int
    _cg_clock: list[int]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, CheckedOutput) and leaf._cg_clock[0] != leaf._cg_run:
                raise StaleOutputError(
                    f"{leaf._cg_label} of run {leaf._cg_run} was read (by {getattr(func, '__name__', func)}) after run "
                    f"{leaf._cg_clock[0]} overwrote it; clone() what you keep past the next run()"
                )
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return tree_map_only(CheckedOutput, lambda t: t.as_subclass(torch.Tensor), result)


def checked(outputs: Any, run: int, clock: list[int]) -> Any:
    """``outputs`` with each tensor leaf as a CheckedOutput of run number ``run``."""
    leaves, spec = tree_flatten(outputs)
    wrapped = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            out = leaf.as_subclass(CheckedOutput)
            out._cg_label = "output" if len(leaves) == 1 else f"output leaf {i}"
            out._cg_run = run
            out._cg_clock = clock
            leaf = out
        wrapped.append(leaf)
    return spec.unflatten(wrapped)
