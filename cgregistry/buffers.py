"""Static input buffers: fixed addresses the graphs read, live data copied in, padded tail filled.

Each input is indexed along the token axis or the request axis.  ``write`` copies
the live rows in and re-fills only the rows that an earlier, larger batch left
dirty, so a steady batch size costs one copy per input and nothing more.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch

__all__ = ["AXES", "InputError", "StaticBuffer", "StaticInput"]

AXES = ("tokens", "reqs")


class InputError(ValueError):
    """A live input does not fit its static buffer (name, shape, dtype or device)."""


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


@attrs.frozen(slots=True)
class StaticInput:
    """Declares one static input: capacity shape, dtype, indexing axis and padding fill.

    ``shape[0]`` is the capacity along ``axis`` (max tokens or max requests);
    ``fill`` is written into padded rows (None: leave whatever is there).
    """

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: torch.dtype = attrs.field(validator=_dtype)
    axis: Literal["tokens", "reqs"] = attrs.field(default="tokens", validator=_axis)
    fill: int | float | bool | None = 0

    @property
    def capacity(self) -> int:
        return self.shape[0]


class StaticBuffer:
    """One allocated static input and the views of it that graphs and copies use."""

    __slots__ = ("name", "spec", "tensor", "dirty", "_views", "_shapes", "_device", "dtype")

    def __init__(self, name: str, spec: StaticInput, device: torch.device) -> None:
        self.name = name
        self.spec = spec
        self.dtype = spec.dtype
        fill = 0 if spec.fill is None else spec.fill
        self.tensor = torch.full(spec.shape, fill, dtype=spec.dtype, device=device)
        self.dirty = 0  # rows [0, dirty) may hold live data rather than the fill value
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
                    f"static input {self.name!r} holds {self.capacity} {self.spec.axis}, asked for {rows}"
                )
            v = self._views[rows] = self.tensor[:rows]
            self._shapes[rows] = v.shape
        return v

    def check(self, live: torch.Tensor, rows: int) -> None:
        """Raise InputError unless ``live`` is exactly ``rows`` rows of this input's dtype and device."""
        if rows not in self._shapes:
            self.view(rows)
        try:
            ok = (
                live.shape == self._shapes[rows]
                and live.dtype is self.dtype
                and live.device == self._device  # the type too: a meta tensor has the cpu's index
            )
        except AttributeError:
            ok = False
        if not ok:
            raise self._mismatch(live, rows)

    def write(self, live: torch.Tensor, rows: int) -> None:
        """Copy ``live`` (already checked: exactly ``rows`` rows) in and restore the fill value below it."""
        self._views[rows].copy_(live)
        if self.dirty > rows and self.spec.fill is not None:
            self.tensor[rows : self.dirty].fill_(self.spec.fill)
        self.dirty = rows

    def _mismatch(self, live: object, rows: int) -> InputError:
        if not isinstance(live, torch.Tensor):
            return InputError(f"input {self.name!r} must be a torch.Tensor, got {type(live).__name__}")
        expected = (rows, *self.spec.shape[1:])
        if tuple(live.shape) != expected:
            return InputError(
                f"input {self.name!r} has shape {tuple(live.shape)}, expected {expected} "
                f"({rows} {self.spec.axis} in this batch)"
            )
        if live.dtype is not self.dtype:
            return InputError(f"input {self.name!r} has dtype {live.dtype}, expected {self.dtype}")
        return InputError(f"input {self.name!r} is on {live.device}, expected {self.tensor.device}")
