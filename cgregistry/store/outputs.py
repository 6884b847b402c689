"""Step outputs: flatten a pytree of tensors, and hand back views sliced to the actual batch.

A step may return a tensor or nested tuples, lists, dicts and named tuples of
tensors (None leaves pass through).  Every tensor's leading dimension is the
padded token count (or request count, with ``output_axis="reqs"``); an
``output_axis`` shaped like the output gives each leaf its own axis (hidden
states per token, logits per request).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from cgregistry.store.buffers import AXES, rows_for
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.errors import OutputError

__all__ = ["OutputAxes", "OutputError", "OutputSlicer", "flatten", "unflatten"]

Spec = Any  # None for a tensor leaf, ("const", None, None) for a None leaf, or (container type, keys, child specs)


def flatten(obj: Any, path: str = "output", leaf: type = torch.Tensor) -> tuple[list[Any], Spec]:
    """``leaf`` instances (tensors) in a fixed order, and the structure to rebuild ``obj``."""
    leaves: list[Any] = []
    spec = _flatten(obj, path, leaves, leaf)
    return leaves, spec


def _flatten(obj: Any, path: str, leaves: list[Any], leaf: type) -> Spec:
    if isinstance(obj, leaf):
        leaves.append(obj)
        return None
    if obj is None:
        return ("const", None, None)
    kind = type(obj)
    what = "tensors" if leaf is torch.Tensor else f"{leaf.__name__} leaves"
    if isinstance(obj, dict):
        if kind not in (dict, OrderedDict):
            raise OutputError(f"{path} is a {kind.__name__}; return a dict (or OrderedDict) of {what}")
        keys = list(obj)
        return (kind, keys, [_flatten(obj[k], f"{path}[{k!r}]", leaves, leaf) for k in keys])
    if isinstance(obj, (tuple, list)):
        if kind not in (tuple, list) and not _rebuildable_tuple(kind):
            raise OutputError(f"{path} is a {kind.__name__}; return a tuple, list or named tuple of {what}")
        return (kind, None, [_flatten(v, f"{path}[{i}]", leaves, leaf) for i, v in enumerate(obj)])
    raise OutputError(f"{path} is a {kind.__name__}; expected {what} (in tuples, lists or dicts) or None")


def _outline(spec: Spec) -> Any:
    """``spec`` with sequence kinds merged and mapping kinds merged: what an axes tree must mirror."""
    if spec is None or spec[0] == "const":
        return spec
    kind, keys, children = spec
    return ("map" if keys is not None else "seq", keys, [_outline(c) for c in children])


class OutputAxes:
    """Which axis each output leaf's leading dimension follows: one for all, or a tree shaped like the output."""

    __slots__ = ("single", "axes", "spec", "given")

    def __init__(self, output_axis: object) -> None:
        self.given = output_axis
        if isinstance(output_axis, str):
            if output_axis not in AXES:
                raise ValueError(f"output_axis must be one of {AXES} or a tree of them shaped like the output, got {output_axis!r}")
            self.single: str | None = output_axis
            self.axes: tuple[str, ...] = ()
            self.spec: Spec = None
            return
        try:
            axes, spec = flatten(output_axis, "output_axis", leaf=str)
        except OutputError as exc:
            raise ValueError(f"{exc}: output_axis is one of {AXES}, or a tuple/list/dict tree of them") from None
        bad = [a for a in axes if a not in AXES]
        if not axes or bad:
            raise ValueError(f"output_axis leaves must be among {AXES}, got {bad or output_axis!r}")
        self.single = None
        self.axes = tuple(axes)
        self.spec = spec

    def rows(self, descriptor: BatchDescriptor) -> int | tuple[int, ...] | None:
        """Live rows of the outputs for ``descriptor``: one count, or one per leaf (None: a relaxed key's requests)."""
        if self.single is not None:
            return rows_for(self.single, descriptor)
        rows = tuple(rows_for(a, descriptor) for a in self.axes)
        return None if None in rows else rows  # type: ignore[return-value]

    def check(self, leaves: list[torch.Tensor], spec: Spec, key: BatchDescriptor, request_slots: int | None = None) -> None:
        """Raise OutputError unless every leaf's leading dimension is its axis's row count for ``key``.

        A relaxed key (any request count) sees every request slot of the static inputs, so its
        per-request outputs have ``request_slots`` rows (None: no input is indexed by requests).
        """
        if self.single is None and _outline(spec) != _outline(self.spec):
            raise OutputError(
                f"output_axis={self.given!r} is not shaped like the step's output (which has {len(leaves)} tensor "
                "leaves); give one axis per tensor leaf, in the same tuples, lists and dict keys, None where the output has None"
            )
        axes = [self.single] * len(leaves) if self.single is not None else self.axes
        for i, (leaf, axis) in enumerate(zip(leaves, axes)):
            rows = rows_for(axis, key)
            if rows is None and request_slots is not None:
                rows = request_slots + (axis == "reqs+1")
            if rows is None:
                raise OutputError(
                    f"output leaf {i} follows output_axis={axis!r}, but {key} has no request count and no static "
                    "input is indexed by requests; give one (axis='reqs') or use keys with a request count"
                )
            if leaf.dim() == 0 or leaf.shape[0] != rows:
                raise OutputError(
                    f"output leaf {i} has shape {tuple(leaf.shape)}; expected a leading dimension of "
                    f"{rows} ({axis} of {key})"
                )


def _rebuildable_tuple(kind: type) -> bool:
    """A named tuple, or a torch.return_types structseq (``topk``'s values and indices, say)."""
    return issubclass(kind, tuple) and (hasattr(kind, "_make") or hasattr(kind, "n_fields"))


def unflatten(leaves: list[torch.Tensor], spec: Spec) -> Any:
    """Rebuild the structure ``flatten`` recorded, with ``leaves`` in place of its tensors."""
    return _builder(spec, [0])(leaves)


def _builder(spec: Spec, leaf_index: list[int]) -> Callable[[list[torch.Tensor]], Any]:
    """A function from fresh leaves to the structure ``spec`` records, with the walk over ``spec`` done once."""
    if spec is None:
        i = leaf_index[0]
        leaf_index[0] += 1
        return lambda leaves: leaves[i]
    kind, keys, children = spec
    if kind == "const":
        return lambda leaves: None
    parts = [_builder(c, leaf_index) for c in children]
    if keys is not None:
        return lambda leaves: kind(zip(keys, [part(leaves) for part in parts]))
    if kind is tuple or kind is list:
        return lambda leaves: kind([part(leaves) for part in parts])
    if hasattr(kind, "_make"):
        return lambda leaves: kind._make([part(leaves) for part in parts])  # named tuple
    return lambda leaves: kind([part(leaves) for part in parts])  # torch.return_types structseq


class OutputSlicer:
    """Full-size output tensors of one entry, sliced (and cached) per actual row count."""

    __slots__ = ("leaves", "spec", "_cache", "_single", "_build")

    def __init__(self, leaves: list[torch.Tensor], spec: Spec) -> None:
        self.leaves = leaves
        self.spec = spec
        self._single = spec is None
        self._build = _builder(spec, [0])
        self._cache: dict[int | tuple[int, ...], list[torch.Tensor]] = {}

    def sliced(self, rows: int | tuple[int, ...]) -> Any:
        """Outputs cut to ``rows`` (one count, or one per leaf): fresh views each call over cached slices,
        so a caller's in-place metadata change (``unsqueeze_``, ``t_``) never reaches a later run's outputs."""
        views = self._cache.get(rows)
        if views is None:
            if isinstance(rows, tuple):
                views = [leaf[:n] for leaf, n in zip(self.leaves, rows)]
            else:
                views = [leaf[:rows] for leaf in self.leaves]
            self._cache[rows] = views
        if self._single:
            return views[0].detach()
        return self._build([v.detach() for v in views])
