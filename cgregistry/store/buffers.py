"""Static input buffers: fixed addresses the graphs read, live data copied in, padded tail filled.

Each input is indexed along the token axis, the request axis, or ``reqs+1`` (one
row per request plus one: ``cu_seqlens``, ``query_start_loc``).  ``write`` copies
the live rows in and re-fills only the rows that an earlier, larger batch left
dirty, so a steady batch size costs one copy per input and nothing more; an input
whose padding repeats its last live row (``REPEAT_LAST``) costs one more copy.

``fill`` is what every padded row holds, and what *every* row holds while graphs
are warmed up and captured (capture runs the step, which may write engine state
such as a KV cache at the indices it reads).  An index input therefore fills with
a scratch slot that belongs to no request; integer inputs must say their fill.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal

import attrs
import torch

from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.errors import InputError

__all__ = ["AXES", "REPEAT_LAST", "UNSET", "InputError", "StaticBuffer", "StaticInput", "describe_rows", "rows_for"]

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


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self) -> str:
        return "UNSET"  # one instance, across copies and pickles


UNSET = _Unset()  # fill not given: 0 for floating and bool inputs, REPEAT_LAST on "reqs+1", else an error for integers


class _RepeatLast:
    def __repr__(self) -> str:
        return "REPEAT_LAST"

    def __reduce__(self) -> str:
        return "REPEAT_LAST"  # one instance, across copies and pickles (a config sent to worker processes)


# A fill: padded rows repeat the batch's last live row, so padded requests of an offsets input are empty.
REPEAT_LAST = _RepeatLast()


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

    ``shape[0]`` is the capacity along ``axis``: max tokens, max requests, or max
    requests + 1 for ``axis="reqs+1"`` (offsets such as ``cu_seqlens``).
    ``fill`` is written into padded rows, and into every row before a graph is
    warmed up and captured; None leaves padded rows as they are (capture then
    sees zeros).  Integer inputs must give it: an index input (slot mapping,
    block table) fills with a scratch slot no request owns, so padded rows and
    capture write only there; token ids or positions may fill with 0.
    ``REPEAT_LAST`` (the default on ``reqs+1``, and the only fill allowed there) repeats the last live
    row into the padded rows, so the padded requests of an offsets input are empty (a constant would
    make the offsets decrease); capture then runs on zeros (a batch of empty requests).
    """

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: torch.dtype = attrs.field(validator=_dtype)
    axis: Literal["tokens", "reqs", "reqs+1"] = attrs.field(default="tokens", validator=_axis)
    fill: int | float | bool | None | _RepeatLast = attrs.field(default=UNSET)

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


class StaticBuffer:
    """One allocated static input and the views of it that graphs and copies use."""

    __slots__ = ("name", "spec", "tensor", "dirty", "_views", "_tails", "_shapes", "_device", "dtype", "_repeat_last")

    def __init__(self, name: str, spec: StaticInput, device: torch.device) -> None:
        self.name = name
        self.spec = spec
        self.dtype = spec.dtype
        self.tensor = torch.full(spec.shape, spec.capture_fill, dtype=spec.dtype, device=device)
        self.dirty = 0  # rows [0, dirty) may hold live data rather than the fill value
        self._views: dict[int, torch.Tensor] = {}
        self._tails: dict[int, torch.Tensor] = {}  # rows [n, capacity), for REPEAT_LAST
        self._repeat_last = spec.fill is REPEAT_LAST
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
        """A new buffer like this one holding ``rows`` rows, at the capture fill (a background entry's own input)."""
        return StaticBuffer(self.name, attrs.evolve(self.spec, shape=(rows, *self.spec.shape[1:])), self._device)

    def reset(self) -> None:
        """Every row back to the capture fill: what warm-up and capture run on, never an earlier batch."""
        self.tensor.fill_(self.spec.capture_fill)
        self.dirty = 0

    def release(self) -> int:
        """Give the memory back (its storage emptied; the tensor and its views stay, for ``restore``); the bytes freed."""
        storage = self.tensor.untyped_storage()
        freed = storage.nbytes()
        storage.resize_(0)
        return freed

    def restore(self) -> None:
        """Memory again after ``release`` (a new address, at the capture fill): views and copies work as before."""
        storage = self.tensor.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.tensor.numel() * self.tensor.element_size())
            self.reset()

    def check(self, live: torch.Tensor, rows: int) -> None:
        """Raise InputError unless ``live`` is exactly ``rows`` dense rows of this input's dtype and device.

        ``rows`` may exceed the capacity (a batch that runs eagerly); the graph path never asks for that.
        """
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

    def write(self, live: torch.Tensor, rows: int) -> None:
        """Copy ``live`` (already checked: exactly ``rows`` rows) in and restore the fill value below it."""
        if live.requires_grad:  # outside inference mode copy_ would chain the caller's autograd graph onto the buffer
            live = live.detach()
        self._views[rows].copy_(live)
        if self._repeat_last:
            if rows < self.capacity:  # every padded row, whatever key replays: offsets stay monotonic
                tail = self._tails.get(rows)
                if tail is None:
                    tail = self._tails[rows] = self.tensor[rows:]
                tail.copy_(live[-1:].expand_as(tail))
            return
        if self.dirty > rows and self.spec.fill is not None:
            self.tensor[rows : self.dirty].fill_(self.spec.fill)
        self.dirty = rows

    def _mismatch(self, live: object, rows: int) -> InputError:
        if not isinstance(live, torch.Tensor):
            return InputError(f"input {self.name!r} must be a torch.Tensor, got {type(live).__name__}")
        if live.layout is not _STRIDED or live.is_nested:
            kind = "nested" if live.is_nested else str(live.layout).removeprefix("torch.")
            return InputError(f"input {self.name!r} is a {kind} tensor; expected a dense (strided) tensor")
        expected = (rows, *self.spec.shape[1:])
        if tuple(live.shape) != expected:
            return InputError(
                f"input {self.name!r} has shape {tuple(live.shape)}, expected {expected} "
                f"({describe_rows(self.spec.axis, rows)} in this batch)"
            )
        if live.dtype is not self.dtype:
            return InputError(f"input {self.name!r} has dtype {live.dtype}, expected {self.dtype}")
        return InputError(f"input {self.name!r} is on {live.device}, expected {self.tensor.device}")
