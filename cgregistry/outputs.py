"""Step outputs: flatten a pytree of tensors, and hand back views sliced to the actual batch.

A step may return a tensor or nested tuples, lists, dicts and named tuples of
tensors (None leaves pass through).  Every tensor's leading dimension is the
padded token count (or request count, with ``output_axis="reqs"``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from cgregistry.errors import CgregistryError

__all__ = ["OutputError", "OutputSlicer", "flatten", "unflatten"]

Spec = Any  # None for a tensor leaf, ("const", None, None) for a None leaf, or (container type, keys, child specs)


class OutputError(CgregistryError, TypeError):
    """A step returned something the registry cannot slice (names the leaf)."""


def flatten(obj: Any, path: str = "output") -> tuple[list[torch.Tensor], Spec]:
    """Tensor leaves in a fixed order, and the structure to rebuild ``obj``."""
    leaves: list[torch.Tensor] = []
    spec = _flatten(obj, path, leaves)
    return leaves, spec


def _flatten(obj: Any, path: str, leaves: list[torch.Tensor]) -> Spec:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return None
    if obj is None:
        return ("const", None, None)
    kind = type(obj)
    if isinstance(obj, dict):
        if kind not in (dict, OrderedDict):
            raise OutputError(f"{path} is a {kind.__name__}; return a dict (or OrderedDict) of tensors")
        keys = list(obj)
        return (kind, keys, [_flatten(obj[k], f"{path}[{k!r}]", leaves) for k in keys])
    if isinstance(obj, (tuple, list)):
        if kind not in (tuple, list) and not _rebuildable_tuple(kind):
            raise OutputError(f"{path} is a {kind.__name__}; return a tuple, list or named tuple of tensors")
        return (kind, None, [_flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(obj)])
    raise OutputError(f"{path} is a {kind.__name__}; expected tensors (in tuples, lists or dicts) or None")


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
        self._cache: dict[int, list[torch.Tensor]] = {}

    def sliced(self, rows: int) -> Any:
        """Outputs cut to ``rows``: fresh views each call over cached slices, so a caller's in-place
        metadata change (``unsqueeze_``, ``t_``) never reaches a later run's outputs."""
        views = self._cache.get(rows)
        if views is None:
            views = self._cache[rows] = [leaf[:rows] for leaf in self.leaves]
        if self._single:
            return views[0].detach()
        return self._build([v.detach() for v in views])
