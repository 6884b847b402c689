"""What crosses between the engine and a graph: the static inputs the graphs read, and the outputs they write.

Static inputs have fixed addresses: live data is copied in (``staging``: a steady batch size costs its copies and
nothing more) and the padded tail filled.  Each is indexed along the token axis, the request axis, or ``reqs+1`` (one
row per request plus one: ``cu_seqlens``, ``query_start_loc``).  ``fill`` is what every padded row holds, and what
*every* row holds while graphs are warmed up and captured (capture runs the step, which may write engine state such as a
KV cache at the indices it reads): an index input fills with a scratch slot no request owns; integer inputs must say
their fill.

Outputs: a tensor or nested tuples, lists, dicts and named tuples of tensors (None leaves pass through), each leading
dimension the padded token count (or request count: ``output_axis="reqs"``; an ``output_axis`` shaped like the output
gives each leaf its own axis).  ``run()`` hands back views sliced to the actual batch.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
import torch

from cgregistry.errors import InputError, OutputError
from cgregistry.key.descriptor import BatchDescriptor

__all__ = [
    "AXES", "REPEAT_LAST", "UNSET", "InputError", "OutputAxes", "OutputError", "OutputSlicer", "StaticBuffer",
    "StaticInput", "StaticInputs", "capture_inputs", "check_fits", "checked_outputs", "describe_rows", "flatten",
    "key_rows", "output_slicer", "rows_for", "staging",
]


AXES = ("tokens", "reqs", "reqs+1")
_STRIDED = torch.strided


def rows_for(axis: str, descriptor: BatchDescriptor) -> int | None:
    """How many rows of an input (or output) on ``axis`` a batch has; None for a relaxed key's requests."""
    if axis == "tokens":
        return descriptor.num_tokens
    reqs = descriptor.num_reqs
    if axis == "reqs" or reqs is None:
        return reqs
    return reqs + 1  # "reqs+1": offsets such as cu_seqlens, one more than there are requests


def describe_rows(axis: str, rows: int) -> str:
    """``rows`` rows of ``axis`` in words, for error messages ("4 rows: 3 reqs + 1")."""
    if axis == "reqs+1":
        return f"{rows} rows: {rows - 1} reqs + 1"
    return f"{rows} {axis}"


def _shape(value: object) -> tuple[int, ...]:
    shape = tuple(value)  # type: ignore[arg-type]
    if not shape or any(type(d) is not int or d < 1 for d in shape):
        raise ValueError(f"StaticInput.shape must be a non-empty tuple of positive ints, got {value!r}")
    return shape


def _axis(instance: StaticInput, attribute: attrs.Attribute, value: str) -> None:
    if value not in AXES:
        raise ValueError(f"StaticInput.axis must be one of {AXES}, got {value!r}")


def _dtype(instance: StaticInput, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, torch.dtype):
        raise TypeError(f"StaticInput.dtype must be a torch.dtype, got {value!r}")
    if value in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        raise TypeError(f"StaticInput.dtype {value} is quantized; a static input holds plain numbers")


class _Sentinel:
    """A module-level constant that stays one instance across copies and pickles (a config sent to worker processes)."""

    def __init__(self, name: str, text: str) -> None:
        self._name, self._text = name, text

    def __repr__(self) -> str:
        return self._text

    def __reduce__(self) -> str:
        return self._name


# Fill not given: 0 for floating and bool inputs, REPEAT_LAST on "reqs+1", else an error for integers.
UNSET = _Sentinel("UNSET", "<unset>")
# A fill: padded rows repeat the batch's last live row, so padded requests of an offsets input are empty.
REPEAT_LAST = _Sentinel("REPEAT_LAST", "REPEAT_LAST")


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype is torch.bool)


def _fill_problem(fill: object, dtype: torch.dtype) -> str | None:
    """Why ``fill`` cannot be stored exactly in ``dtype`` (None: it can)."""
    if dtype is torch.bool:
        return None if type(fill) is bool else "a bool"
    if isinstance(fill, bool) or not isinstance(fill, numbers.Number):
        return "a number" if not _is_integer(dtype) else "an int"
    if _is_integer(dtype):
        if not isinstance(fill, numbers.Integral):
            return "an int (it would be truncated)"
        info = torch.iinfo(dtype)
        if not info.min <= int(fill) <= info.max:
            return f"an int in [{info.min}, {info.max}]"
        return None
    if dtype.is_floating_point:
        if isinstance(fill, numbers.Complex) and not isinstance(fill, numbers.Real):
            return "a real number"
        value = float(fill)  # type: ignore[arg-type]
        try:
            stored = torch.tensor(value, dtype=dtype).item()
        except (RuntimeError, OverflowError):  # float8 types refuse values out of range
            return f"a number within {dtype}'s range"
        if math.isfinite(value) and not math.isfinite(stored):
            return f"a number within {dtype}'s range (it would overflow to {stored})"
        if value != 0 and stored == 0:
            return f"a number {dtype} can tell from 0 (it would underflow)"
        if isinstance(fill, numbers.Integral) and stored != value:
            return f"an integer {dtype} holds exactly (it would become {stored:g})"
        if math.isfinite(value) and abs(stored - value) > abs(value) * torch.finfo(dtype).eps:
            return f"a number within {dtype}'s range and precision (it would become {stored:g})"
    return None


@attrs.frozen(slots=True)
class StaticInput:
    """Declares one static input: capacity shape, dtype, indexing axis and padding fill.

    ``shape[0]`` is the capacity along ``axis``: max tokens, max requests, or max requests + 1 (``axis="reqs+1"``,
    offsets such as ``cu_seqlens``).  ``fill`` goes into padded rows, and into every row before a graph is warmed up and
    captured; None leaves padded rows as they are (capture sees zeros).  Integer inputs must give it: an index input
    (slot mapping, block table) fills with a scratch slot no request owns, so padded rows and capture write only there;
    token ids or positions may fill with 0.  ``REPEAT_LAST`` (the default and only fill on ``reqs+1``) repeats the last
    live row into the padded rows, so the padded requests of an offsets input are empty (a constant would make the
    offsets decrease); capture then runs on zeros.
    """

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: torch.dtype = attrs.field(validator=_dtype)
    axis: Literal["tokens", "reqs", "reqs+1"] = attrs.field(default="tokens", validator=_axis)
    fill: int | float | bool | None | _Sentinel = attrs.field(default=UNSET)

    def __attrs_post_init__(self) -> None:
        fill = self.fill
        if fill is UNSET and self.axis == "reqs+1":
            object.__setattr__(self, "fill", REPEAT_LAST)
            return
        if fill is REPEAT_LAST:
            if self.axis != "reqs+1":
                raise ValueError(
                    f"StaticInput(shape={self.shape}, axis={self.axis!r}) fill=REPEAT_LAST is for offsets (axis='reqs+1'): "
                    "on other inputs padded rows would repeat a live row (an index input would write a live request's "
                    "slot) and capture would run on zeros; give a fill"
                )
            return
        if self.axis == "reqs+1":
            raise ValueError(
                f"StaticInput(shape={self.shape}, dtype={self.dtype}, axis='reqs+1') fill={fill!r}: padded rows would "
                f"hold {'whatever an earlier batch left' if fill is None else fill!r} after the batch's last offset, so the "
                "offsets would decrease (..., 6, 0, 0) and padded requests get negative lengths; an offsets input "
                "(cu_seqlens, query_start_loc) takes fill=cgregistry.REPEAT_LAST, its default: padded rows repeat the "
                "last live offset, so padded requests are empty"
            )
        if fill is UNSET:
            if _is_integer(self.dtype):
                raise ValueError(
                    f"StaticInput(shape={self.shape}, dtype={self.dtype}) needs an explicit fill: padded rows, and every "
                    "row while graphs are captured, hold it. For an index input (slot mapping, block table) give a "
                    "scratch slot that no request owns; for token ids or positions, fill=0"
                )
            object.__setattr__(self, "fill", False if self.dtype is torch.bool else 0)
            return
        if fill is None:
            if _is_integer(self.dtype):
                raise ValueError(
                    f"StaticInput(shape={self.shape}, dtype={self.dtype}, fill=None): an integer input needs a fill; "
                    "rows left as they are would index the slots of an earlier batch"
                )
            return
        problem = _fill_problem(fill, self.dtype)
        if problem is not None:
            raise ValueError(
                f"StaticInput(shape={self.shape}, dtype={self.dtype}) fill={fill!r} cannot be stored exactly; "
                f"expected {problem}"
            )

    @property
    def capacity(self) -> int:
        return self.shape[0]

    @property
    def capture_fill(self) -> int | float | bool:
        """What every row holds while graphs are warmed up and captured."""
        fill = self.fill
        return 0 if fill is None or fill is REPEAT_LAST else fill  # type: ignore[return-value]


class StaticInputs(Mapping[str, torch.Tensor]):
    """The static input tensors by name, as ``reg.static_inputs`` shows them: a read while they are released
    (``sleep()``) raises, naming why, instead of handing out a tensor with no memory."""

    __slots__ = ("_buffers", "_registry")

    def __init__(self, buffers: Mapping[str, StaticBuffer], registry: str) -> None:
        self._buffers = buffers
        self._registry = registry

    def __getitem__(self, name: str) -> torch.Tensor:
        buf = self._buffers[name]
        if buf.released:
            raise RuntimeError(f"static input {name!r} of registry {self._registry!r} was released by sleep(): it has no "
                               "memory until wake() (a view taken before sleep() keeps what it held)")
        return buf.tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)


class StaticBuffer:
    """One allocated static input and the views of it that graphs and copies use."""

    __slots__ = ("name", "spec", "tensor", "dirty", "released", "_views", "_shapes", "_device", "dtype")

    def __init__(self, name: str, spec: StaticInput, device: torch.device) -> None:
        self.name = name
        self.spec = spec
        self.dtype = spec.dtype
        self.tensor = torch.full(spec.shape, spec.capture_fill, dtype=spec.dtype, device=device)
        self.dirty = 0  # rows [0, dirty) may hold live data rather than the fill value
        self.released = False  # its memory was given back (sleep()): no tensor to read until restore()
        self._views: dict[int, torch.Tensor] = {}
        self._shapes: dict[int, torch.Size] = {}
        self._device = self.tensor.device

    @property
    def capacity(self) -> int:
        return self.spec.shape[0]

    def view(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows: a stable view, cached so the hot path does not slice."""
        v = self._views.get(rows)
        if v is None:
            if not 0 < rows <= self.capacity:
                raise InputError(
                    f"static input {self.name!r} holds {describe_rows(self.spec.axis, self.capacity)}, asked for {rows}"
                )
            v = self._views[rows] = self.tensor[:rows]
            self._shapes[rows] = v.shape
        return v

    def sized(self, rows: int) -> StaticBuffer:
        """A new buffer like this one holding ``rows`` rows, at the capture fill (a memory estimate's own input)."""
        return StaticBuffer(self.name, attrs.evolve(self.spec, shape=(rows, *self.spec.shape[1:])), self._device)

    def reset(self) -> None:
        """Every row back to the capture fill: what warm-up and capture run on, never an earlier batch."""
        self.tensor.fill_(self.spec.capture_fill)
        self.dirty = 0

    def release(self) -> int:
        """Give the memory back: the tensor is emptied (its memory goes once nothing else holds it; a view the engine
        kept goes on reading the memory it holds, never freed memory); the bytes it held."""
        if self.released:
            return 0
        freed = self.tensor.untyped_storage().nbytes()
        self._views.clear()
        self.tensor.set_(torch.empty(0, dtype=self.dtype, device=self._device))
        self.released = True
        return freed

    def restore(self) -> None:
        """Memory again after ``release`` (a new address, at the capture fill): views and copies work as before."""
        if self.released:
            self.tensor.set_(torch.empty(self.spec.shape, dtype=self.dtype, device=self._device))
            self.released = False
            self.reset()

    def check(self, live: torch.Tensor, rows: int) -> None:
        """Raise InputError unless ``live`` is exactly ``rows`` dense rows of this input's dtype and device (``rows``
        may exceed the capacity: a batch that runs eagerly)."""
        shape = self._shapes.get(rows)
        if shape is None:
            shape = torch.Size((rows, *self.spec.shape[1:]))  # an oversize batch's (it runs eagerly): never kept
            if rows <= self.capacity and self.tensor.untyped_storage().nbytes():  # released (asleep): made at restore()
                self.view(rows)  # caches the shape too
        try:
            ok = (
                live.layout is _STRIDED  # sparse and other layouts would be densified or refused by copy_
                and live.shape == shape
                and live.dtype is self.dtype
                and live.device == self._device  # the type too: a meta tensor has the cpu's index
            )
        except (AttributeError, RuntimeError):  # not a tensor; a nested tensor has no shape
            ok = False
        if not ok:
            raise self._mismatch(live, rows)

    def _mismatch(self, live: object, rows: int) -> InputError:
        if not isinstance(live, torch.Tensor):
            return InputError(f"input {self.name!r} must be a torch.Tensor, got {type(live).__name__}")
        if live.layout is not _STRIDED or live.is_nested:
            layout = "nested" if live.is_nested else str(live.layout).removeprefix("torch.")
            return InputError(f"input {self.name!r} is a {layout} tensor; expected a dense (strided) tensor")
        expected = (rows, *self.spec.shape[1:])
        if tuple(live.shape) != expected:
            return InputError(
                f"input {self.name!r} has shape {tuple(live.shape)}, expected {expected} "
                f"({describe_rows(self.spec.axis, rows)} in this batch)"
            )
        if live.dtype is not self.dtype:
            return InputError(f"input {self.name!r} has dtype {live.dtype}, expected {self.dtype}")
        return InputError(f"input {self.name!r} is on {live.device}, expected {self.tensor.device}")


def staging(copies: tuple[tuple[StaticBuffer, int], ...]) -> Callable[[Mapping[str, torch.Tensor]], None]:
    """How one route's live inputs (checked already) reach its static buffers; built once per route, after the buffers'
    latest ``restore()`` (a wake changes the catalog, so routes are rebuilt).

    In order: an input inside one of the route's static buffers (the engine handed a buffer's rows back) is cloned, so
    every input is read as it was at ``run()``; the rows an earlier, larger batch left get their fill back (before any
    copy: a copy that raises leaves no row unaccounted for); the live rows are copied in, one ``_foreach_copy_`` per
    dtype that several inputs share (one kernel on CUDA where each input is laid out as its view) and ``copy_`` for the
    others; a ``REPEAT_LAST`` input's padded rows repeat its last staged row.  An input that needs grad is detached
    (outside inference mode the copy would chain the caller's autograd graph onto the buffer).
    """
    by_dtype: dict[torch.dtype, tuple[list[str], list[torch.Tensor]]] = {}
    for buf, rows in copies:
        names, views = by_dtype.setdefault(buf.dtype, ([], []))
        names.append(buf.name)
        views.append(buf.view(rows))
    groups = tuple((tuple(names), views) for names, views in by_dtype.values() if len(names) > 1)
    singles = tuple((names[0], views[0]) for names, views in by_dtype.values() if len(names) == 1)
    # REPEAT_LAST: every padded row repeats the last live one, whatever key replays (offsets stay monotonic)
    tails = tuple((buf.tensor[rows - 1 : rows], buf.tensor[rows:]) for buf, rows in copies
                  if buf.spec.fill is REPEAT_LAST and rows < buf.capacity)
    fills = tuple((buf, rows, buf.spec.fill) for buf, rows in copies
                  if buf.spec.fill is not None and buf.spec.fill is not REPEAT_LAST)
    names = tuple(buf.name for buf, _ in copies)
    spans = tuple(sorted({(buf.tensor.data_ptr(), buf.tensor.data_ptr() + buf.tensor.untyped_storage().nbytes())
                          for buf, _ in copies}))  # each buffer's memory (its own allocation, from offset 0)
    low, high = spans[0][0], max(end for _, end in spans)

    def snapshot(inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``inputs``, each one inside a static buffer cloned (read before any buffer is written)."""
        cloned = dict(inputs)
        for name in names:
            start = cloned[name].data_ptr()
            if low <= start < high and any(a <= start < b for a, b in spans):
                cloned[name] = cloned[name].detach().clone()
        return cloned

    def stage(inputs: Mapping[str, torch.Tensor]) -> None:
        for name in names:
            start = inputs[name].data_ptr()
            if low <= start < high:
                inputs = snapshot(inputs)
                break
        for buf, rows, fill in fills:
            if buf.dirty > rows:
                buf.tensor[rows : buf.dirty].fill_(fill)
            buf.dirty = rows
        for group, views in groups:
            live = [inputs[name] for name in group]
            for i, tensor in enumerate(live):
                if tensor.requires_grad:
                    live[i] = tensor.detach()
            torch._foreach_copy_(views, live)
        for name, view in singles:
            tensor = inputs[name]
            view.copy_(tensor.detach() if tensor.requires_grad else tensor)
        for last, tail in tails:
            tail.copy_(last.expand_as(tail))

    if groups or tails or len(singles) != 1 or len(fills) > 1:
        return stage
    (name, view), = singles  # one input, the common case of a small step: no loop
    filled = fills[0] if fills else None

    def stage_one(inputs: Mapping[str, torch.Tensor]) -> None:
        tensor = inputs[name]
        if low <= tensor.data_ptr() < high:  # rows of its own buffer (a strided view would overwrite what it reads)
            inputs = snapshot(inputs)
            tensor = inputs[name]
        if filled is not None:
            buf, rows, fill = filled
            if buf.dirty > rows:
                buf.tensor[rows : buf.dirty].fill_(fill)
            buf.dirty = rows
        view.copy_(tensor.detach() if tensor.requires_grad else tensor)

    return stage_one


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
    container = type(obj)
    what = "tensors" if leaf is torch.Tensor else f"{leaf.__name__} leaves"
    if isinstance(obj, dict):
        if container not in (dict, OrderedDict):
            raise OutputError(f"{path} is a {container.__name__}; return a dict (or OrderedDict) of {what}")
        keys = list(obj)
        return (container, keys, [_flatten(obj[k], f"{path}[{k!r}]", leaves, leaf) for k in keys])
    if isinstance(obj, (tuple, list)):
        if container not in (tuple, list) and not _rebuildable_tuple(container):
            raise OutputError(f"{path} is a {container.__name__}; return a tuple, list or named tuple of {what}")
        return (container, None, [_flatten(v, f"{path}[{i}]", leaves, leaf) for i, v in enumerate(obj)])
    raise OutputError(f"{path} is a {container.__name__}; expected {what} (in tuples, lists or dicts) or None")


def _outline(spec: Spec) -> Any:
    """``spec`` with sequence containers merged and mapping containers merged: what an axes tree must mirror."""
    if spec is None or spec[0] == "const":
        return spec
    container, keys, children = spec
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
        """Raise OutputError unless every leaf's leading dimension is its axis's row count for ``key`` (a relaxed key
        sees every request slot: its per-request outputs have ``request_slots`` rows; None: no input is indexed by
        requests)."""
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
                    f"{leaf_paths(spec)[i]} (output leaf {i}) follows output_axis={axis!r}, but {key} has no request "
                    "count and no static input is indexed by requests; give one (axis='reqs') or use keys with a "
                    "request count"
                )
            if leaf.dim() == 0 or leaf.shape[0] != rows:
                per_request = axis == "tokens" and leaf.dim() > 0 and leaf.shape[0] in (key.num_reqs, request_slots)
                raise OutputError(
                    f"{leaf_paths(spec)[i]} (output leaf {i}) has shape {tuple(leaf.shape)}; expected a leading "
                    f"dimension of {rows} ({axis} of {key})"
                    + ("; an output with a row per request needs output_axis='reqs' for it (GraphRegistry(..., "
                       "output_axis=...): one axis, or a tree of them shaped like the output)" if per_request else "")
                )


def leaf_paths(spec: Spec, path: str = "output") -> list[str]:
    """Where each tensor leaf of an output ``flatten`` recorded as ``spec`` is, as the step's code would index it
    (``output['logits']``, ``output[1]``), in leaf order."""
    if spec is None:
        return [path]
    container, keys, children = spec
    if container == "const":
        return []
    names = [f"{path}[{k!r}]" for k in keys] if keys is not None else [f"{path}[{i}]" for i in range(len(children))]
    return [leaf for name, child in zip(names, children) for leaf in leaf_paths(child, name)]


def _rebuildable_tuple(container: type) -> bool:
    """A named tuple, or a torch.return_types structseq (``topk``'s values and indices, say)."""
    return issubclass(container, tuple) and (hasattr(container, "_make") or hasattr(container, "n_fields"))


def _builder(spec: Spec, leaf_index: list[int]) -> Callable[[list[torch.Tensor]], Any]:
    """A function from fresh leaves to the structure ``spec`` records, with the walk over ``spec`` done once."""
    if spec is None:
        i = leaf_index[0]
        leaf_index[0] += 1
        return lambda leaves: leaves[i]
    container, keys, children = spec
    if container == "const":
        return lambda leaves: None
    parts = [_builder(c, leaf_index) for c in children]
    if keys is not None:
        return lambda leaves: container(zip(keys, [part(leaves) for part in parts]))
    if hasattr(container, "_make"):
        return lambda leaves: container._make([part(leaves) for part in parts])  # named tuple
    return lambda leaves: container([part(leaves) for part in parts])  # tuple, list, torch.return_types structseq


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


# ---------------------------------------------------------------- what a capture reads and returns


def key_rows(buf: StaticBuffer, key: BatchDescriptor) -> int:
    """The rows of ``buf`` a graph for ``key`` reads (a relaxed key, of any request count, sees every request slot)."""
    rows = rows_for(buf.spec.axis, key)
    return buf.capacity if rows is None else rows


def check_fits(buffers: Mapping[str, StaticBuffer], key: BatchDescriptor) -> None:
    """Refuse a key larger than a static input, before anything is captured."""
    for buf in buffers.values():
        rows = key_rows(buf, key)
        if rows > buf.capacity:
            raise ValueError(
                f"key {key} needs {describe_rows(buf.spec.axis, rows)} in static input {buf.name!r}, "
                f"which holds {buf.capacity}; enlarge its StaticInput shape"
            )


def capture_inputs(buffers: Mapping[str, StaticBuffer], key: BatchDescriptor) -> dict[str, torch.Tensor]:
    """Views sized for ``key`` of the buffers a capture of it runs on, reset to their capture fills first (the step may
    write engine state at the indices it reads, so never an earlier batch's rows)."""
    for buf in buffers.values():
        buf.reset()
    return {name: buf.view(key_rows(buf, key)) for name, buf in buffers.items()}


def checked_outputs(
    out: Any, axes: OutputAxes, key: BatchDescriptor, request_slots: int | None, device: torch.device, spec: Spec = None,
    compare: bool = False,
) -> tuple[list[torch.Tensor], Spec]:
    """A step's output flattened and checked: tensors on ``device``, each leading dimension its axis's rows for ``key``;
    with ``compare``, shaped as ``spec`` (the warm-up's)."""
    leaves, found = flatten(out)
    if compare and found != spec:
        raise OutputError("the step returned a different output structure at capture than at warm-up")
    if not leaves:
        raise OutputError("the step returned no tensor")
    axes.check(leaves, found, key, request_slots)
    for i, leaf in enumerate(leaves):
        if leaf.device != device:
            raise OutputError(f"output leaf {i} is on {leaf.device}, expected {device}")
    return leaves, found


def output_slicer(
    out: Any, axes: OutputAxes, key: BatchDescriptor, request_slots: int | None, device: torch.device, spec: Spec,
    share: Callable[[list[torch.Tensor]], list[torch.Tensor]],
) -> OutputSlicer:
    """A captured step's output, checked as ``checked_outputs`` does (shaped as the warm-up's ``spec``), its tensors
    handed to ``share`` (the backend's ``share_outputs``), and sliced per batch from then on."""
    leaves, _ = checked_outputs(out, axes, key, request_slots, device, spec, compare=True)
    return OutputSlicer(share(leaves), spec)
