"""Debug mode: catch the two silent failures of graph replay, each named.

1. A tensor a graph reads moved: ``param.data = ...``, or a module whose parameter was replaced (``load_state_dict(sd,
   assign=True)``, ``module.weight = nn.Parameter(...)``): the graph still reads the old address.  Debug mode records
   the address of every static input and every watched tensor or module slot, and compares them before each replay.  A
   watched module is looked up by name each time, so a replaced parameter is seen, not just a moved one.
2. An output of an earlier ``run()`` read after a later ``run()`` overwrote it. Debug mode returns outputs as
   :class:`CheckedOutput` tensors, which raise :class:`StaleOutputError` when any torch operation reads them, or a view
   derived from them (``out[:2]``, ``out.detach()``), after the next ``run()``. Reading metadata (``.shape``,
   ``.dtype``) is always fine.  (Poisoning the old outputs' memory instead was rejected: an output may alias a static
   input or a weight, which poison would corrupt, and a NaN read is found late and unnamed.) Registries that share a
   graph pool (a drafter beside its target) share one :class:`Clock`: on CUDA a graph's outputs are memory of the pool
   that any graph captured into it may reuse, so the next ``run()`` of any of them may overwrite the outputs of all (the
   cpu backend keeps each graph's memory apart, yet the check is the same, so that it catches there what would be
   garbage on CUDA).

Both checks cost a few microseconds per ``run()``; leave debug mode off in serving.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from cgregistry.errors import DebugError, MovedTensorError, StaleOutputError
from cgregistry.weights.watch import WeightWatch

__all__ = ["CheckedOutput", "Clock", "DebugError", "MovedTensorError", "Runs", "StaleOutputError", "check_addresses"]


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
    """What wrote graph memory last, for the debug registries of one graph pool: ``version`` grows with each replay and
    each change between runs (a capture, a release) of any of them, which may overwrite every one's outputs (on CUDA
    their graphs reuse one pool's memory); ``writer`` says which came last; ``registries``: how many share it."""

    __slots__ = ("version", "writer", "registries")

    def __init__(self) -> None:
        self.version = 0
        self.writer = ""
        self.registries = 0

    @property
    def shared(self) -> bool:
        return self.registries > 1

    def wrote(self, writer: str) -> None:
        """``writer`` (a replay, a change) may have overwritten every output handed out so far."""
        self.version += 1
        self.writer = writer


class Runs:
    """One registry's runs, on the :class:`Clock` of its graph pool.  Its outputs are valid until its next ``run()``
    (``version``, its own), and until the next replay or change of graphs of any registry on the clock (the clock's
    ``version``): an eager step writes no graph memory, so it stales only its own registry's outputs."""

    __slots__ = ("clock", "name", "runs", "version", "writer")

    def __init__(self, clock: Clock, name: str) -> None:
        self.clock = clock
        self.name = name
        self.runs = 0
        self.version = 0
        self.writer = ""
        clock.registries += 1

    def ran(self, replayed: bool = True) -> None:
        """A run; ``replayed``: it may have written graph memory (a replay, a capture, anything but a plain eager step)."""
        self.runs += 1
        self._wrote(f"run {self.runs}" + (f" of registry {self.name!r}" if self.clock.shared else ""), replayed)

    def changed(self) -> None:
        of = f" of registry {self.name!r} after its run" if self.clock.shared else " after run"
        self._wrote(f"a change to the graphs{of} {self.runs} (a capture, a release or a refresh between steps)", True)

    def _wrote(self, writer: str, graphs: bool) -> None:
        self.version += 1
        self.writer = writer
        if graphs:
            self.clock.wrote(writer)


class CheckedOutput(torch.Tensor):
    """A view of graph output memory that refuses to be read after the next ``run()`` of its registry, or the next
    replay of a registry sharing its graph pool."""

    _cg_label: str
    _cg_runs: Runs  # its registry's runs
    _cg_run: str  # the run that made it ("run 3", or "run 3 of registry 'draft'" on a shared clock)
    _cg_own: int  # its registry's version then
    _cg_version: int  # the pool clock's version then

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
                return t if source is None else _mark(t, source._cg_label, source._cg_runs, source._cg_run, source._cg_own,
                                                      source._cg_version)

            return tree_map_only(torch.Tensor, derived, result)


def _check_fresh(leaf: CheckedOutput, reader: object) -> None:
    runs = leaf._cg_runs
    clock = runs.clock
    if clock.version != leaf._cg_version:
        writer = clock.writer  # a replay or change in the pool (its own registry's, or another's)
    elif runs.version != leaf._cg_own:
        writer = runs.writer  # its registry ran again (eagerly)
    else:
        return
    raise StaleOutputError(
        f"{leaf._cg_label} of {leaf._cg_run} was read (by {reader}) after {writer} overwrote it; clone() what you keep "
        "past the next run()" + (" of any registry sharing its graph pool (their graphs reuse one memory)" if clock.shared else "")
    )


def _mark(tensor: torch.Tensor, label: str, runs: Runs, run: str, own: int, version: int) -> CheckedOutput:
    out = tensor.as_subclass(CheckedOutput)
    out._cg_label = label
    out._cg_runs = runs
    out._cg_run = run
    out._cg_own = own
    out._cg_version = version
    return out


def plain(value: Any) -> Any:
    """A CheckedOutput as a plain tensor (checked once, now); anything else as it is."""
    if not isinstance(value, CheckedOutput):
        return value
    _check_fresh(value, "run() as an input")
    with torch._C.DisableTorchFunctionSubclass():
        return value.as_subclass(torch.Tensor)


def checked(outputs: Any, runs: Runs) -> Any:
    """``outputs`` of the run just counted on ``runs``, each tensor leaf as a CheckedOutput."""
    leaves, spec = tree_flatten(outputs)
    wrapped = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaf = _mark(leaf, "output" if len(leaves) == 1 else f"output leaf {i}", runs, runs.writer, runs.version,
                         runs.clock.version)
        wrapped.append(leaf)
    return spec.unflatten(wrapped)
