"""Debug mode: catch the two silent failures of graph replay, each named.

1. A tensor a graph reads moved: ``param.data = ...``, or a module whose
   parameter was replaced (``load_state_dict(sd, assign=True)``,
   ``module.weight = nn.Parameter(...)``): the graph still reads the old
   address.  Debug mode records the address of every static input and every
   watched tensor or module slot, and compares them before each replay.  A
   watched module is looked up by name each time, so a replaced parameter is
   seen, not just a moved one.
2. An output of an earlier ``run()`` read after a later ``run()`` overwrote it.
   Debug mode returns outputs as :class:`CheckedOutput` tensors, which raise
   :class:`StaleOutputError` when any torch operation reads them, or a view
   derived from them (``out[:2]``, ``out.detach()``), after the next ``run()``.
   Reading metadata (``.shape``, ``.dtype``) is always fine.  (Poisoning the old
   outputs' memory instead was rejected: an output may alias a static input or a
   weight, which poison would corrupt, and a NaN read is found late and unnamed.)

Both checks cost a few microseconds per ``run()``; leave debug mode off in serving.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from cgregistry.errors import DebugError, MovedTensorError, StaleOutputError
from cgregistry.weights.watch import WeightWatch

__all__ = ["AddressWatch", "CheckedOutput", "Clock", "DebugError", "MovedTensorError", "StaleOutputError", "check_addresses"]


# The address watch lives in cgregistry.state.weights (refresh() compares addresses too); its old name stays here.
AddressWatch = WeightWatch


def check_addresses(watch: WeightWatch) -> None:
    """Raise ``DebugError`` naming the first watched tensor that moved since capture (debug mode, before each replay)."""
    moved = watch.moved()
    if moved:
        raise MovedTensorError(
            f"{moved[0]} since capture; captured graphs still read the old address. Update it in place "
            "(tensor.copy_(new), load_state_dict without assign=True) instead of replacing it, or call reg.refresh()"
        )


def _metadata_readers() -> frozenset[Any]:
    """Tensor attributes and methods that read metadata only: allowed on a stale output."""
    base = torch._C.TensorBase
    getters = ("shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_sparse", "is_quantized", "is_meta",
               "nbytes", "itemsize", "is_leaf", "is_nested", "grad")
    methods = ("size", "dim", "numel", "stride", "is_contiguous", "element_size", "data_ptr", "storage_offset",
               "is_floating_point", "is_complex", "is_inference", "get_device")
    return frozenset([*(getattr(base, g).__get__ for g in getters), *(getattr(base, m) for m in methods), torch.Tensor.__len__])


_METADATA = _metadata_readers()


class Clock:
    """What wrote graph memory last: ``version`` grows with each run() and each change between runs (a capture, a
    release) that may overwrite earlier outputs; ``runs`` numbers the runs; ``writer`` says which came last."""

    __slots__ = ("version", "runs", "writer")

    def __init__(self) -> None:
        self.version = 0
        self.runs = 0
        self.writer = ""

    def ran(self) -> None:
        self.runs += 1
        self.version += 1
        self.writer = f"run {self.runs}"

    def changed(self) -> None:
        self.version += 1
        self.writer = f"a change to the graphs after run {self.runs} (a capture, a release or a refresh between steps)"


class CheckedOutput(torch.Tensor):
    """A view of graph output memory that refuses to be read after the next ``run()``."""

    _cg_label: str
    _cg_run: int  # the run that made it
    _cg_version: int  # the clock's version then
    _cg_clock: Clock

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func in _METADATA:
                return func(*args, **kwargs)
            sources = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, CheckedOutput)]
            name = getattr(func, "__name__", "")
            for leaf in sources:
                _check_fresh(leaf, name or func)
            if name.endswith("_") and not name.startswith("_") and any(leaf.is_inference() for leaf in sources):
                # In place on a graph output: allowed on the plain view run() hands out, which this
                # subclass is not (as_subclass drops view-ness), so do it as inference mode allows.
                with torch.inference_mode():
                    result = func(*args, **kwargs)
            else:
                result = func(*args, **kwargs)
            storages = {leaf.untyped_storage().data_ptr(): leaf for leaf in sources}

            def derived(t: torch.Tensor) -> torch.Tensor:
                """A result over an output's memory (a view, detach, in-place) stays checked; anything else is the caller's."""
                if isinstance(t, CheckedOutput):
                    return t
                source = storages.get(t.untyped_storage().data_ptr()) if t.untyped_storage().nbytes() else None
                return t if source is None else _mark(t, source._cg_label, source._cg_clock, source._cg_run, source._cg_version)

            return tree_map_only(torch.Tensor, derived, result)


def _check_fresh(leaf: CheckedOutput, reader: object) -> None:
    clock = leaf._cg_clock
    if clock.version != leaf._cg_version:
        raise StaleOutputError(
            f"{leaf._cg_label} of run {leaf._cg_run} was read (by {reader}) after {clock.writer} "
            "overwrote it; clone() what you keep past the next run()"
        )


def _mark(tensor: torch.Tensor, label: str, clock: Clock, run: int, version: int) -> CheckedOutput:
    out = tensor.as_subclass(CheckedOutput)
    out._cg_label = label
    out._cg_clock = clock
    out._cg_run = run
    out._cg_version = version
    return out


def plain(value: Any) -> Any:
    """A CheckedOutput as a plain tensor (checked once, now); anything else as it is."""
    if not isinstance(value, CheckedOutput):
        return value
    _check_fresh(value, "run() as an input")
    with torch._C.DisableTorchFunctionSubclass():
        return value.as_subclass(torch.Tensor)


def checked(outputs: Any, clock: Clock) -> Any:
    """``outputs`` of the run just counted on ``clock``, each tensor leaf as a CheckedOutput."""
    leaves, spec = tree_flatten(outputs)
    wrapped = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaf = _mark(leaf, "output" if len(leaves) == 1 else f"output leaf {i}", clock, clock.runs, clock.version)
        wrapped.append(leaf)
    return spec.unflatten(wrapped)
