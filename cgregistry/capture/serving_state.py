"""The serving thread's state a step's result depends on: taken when a capture is asked for, put back for every capture,
whichever call makes it, and checked where graphs are replayed.

What a step computes depends on the state of the thread running it: autocast (on or off, its dtype), the default device,
the current CUDA device, the context variables.  A key captured between steps runs inside whatever ``run()`` or
``capture_pending()`` takes its piece, a ``refresh()`` may be called outside the engine's autocast block, and an engine
may serve under another state than it captured under.  So a registry records one ``ServingState`` (at ``capture()``, or
at the first refit of a registry that only adapts), every capture runs under it, and a replay under a state whose
results would differ (autocast, the default dtype, the TF32 and reduced-precision matmul flags) is refused with
:class:`ServingStateError`, for two C calls per replay (``StateTest``).  The default dtype and the matmul flags are
process-wide, so a capture cannot set them: one that starts or ends while they differ from the record fails with the
same error.  Grad mode is not part of it: captures run under ``torch.inference_mode()``, and grad mode does not change
what a replayed graph computes.  Imports nothing of the package but ``errors``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any

import attrs
import torch

from cgregistry.errors import ServingStateError

__all__ = ["AUTOCAST_DEVICE_TYPES", "RECORDED_AT_CAPTURE", "RECORDED_AT_REFIT", "ServingState", "ServingStateError", "StateTest"]

# The device types whose autocast state is recorded (the registry's own device type is added).
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")

try:  # one C call comparing grad mode, autocast, the default dtype and the cuBLAS matmul flags with a snapshot
    from torch._C._dynamo.guards import GlobalStateGuard
except ImportError:  # pragma: no cover - builds without it: the Python comparison below
    GlobalStateGuard = None

# What GlobalStateGuard compares of a record (torch/csrc/dynamo/guards.cpp): autocast of these device types, the
# default dtype and the cuBLAS flags below.  StateTest compares the rest of the record itself.
_GUARDED_AUTOCAST = ("cpu", "cuda")
_GUARDED_FLAGS = frozenset({
    "torch.backends.cuda.matmul.allow_tf32",
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
})

# Process-wide flags that change what a matmul computes (TF32, reduced-precision reductions): a graph keeps the
# kernels it was captured with, eager follows the flags.  cuDNN's TF32 flag is read through its C getter where torch
# has one (StateTest reads it on every replay; the module property costs three times as much).
_MATMUL_FLAGS: tuple[tuple[str, Callable[[], bool]], ...] = (
    ("torch.backends.cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
    ("torch.backends.cudnn.allow_tf32",
     getattr(torch._C, "_get_cudnn_allow_tf32", None) or (lambda: torch.backends.cudnn.allow_tf32)),
    ("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
     lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
    ("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
     lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
)

# Where a record was taken, and what ``check`` then tells the engine to do about a refused replay.
RECORDED_AT_CAPTURE = "capture"
RECORDED_AT_REFIT = "refit"
_ADVICE = {
    RECORDED_AT_CAPTURE: (
        "call capture() under the state you serve with (inside the same torch.autocast block), or reg.clear() and "
        "capture again under this one"
    ),
    RECORDED_AT_REFIT: (
        "this registry only adapts, so its state was recorded at the run() that queued its first refit, and every "
        "refit captures under it: serve under that state, or reg.clear() and the next refit records the state of "
        "the run() that queues it (or call capture() under the state you serve with)"
    ),
}


def _autocast_now(device_types: tuple[str, ...]) -> tuple[tuple[str, torch.dtype], ...]:
    """The device types autocast is on for in this thread, each with its dtype."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in device_types if torch.is_autocast_enabled(d))


def _matmul_flags() -> tuple[bool, ...]:
    return tuple(bool(read()) for _, read in _MATMUL_FLAGS)


def _describe(autocast: tuple[tuple[str, torch.dtype], ...]) -> str:
    return ", ".join(f"autocast({d}, {dtype})" for d, dtype in autocast) or "no autocast"


@attrs.frozen(slots=True)
class ServingState:
    """One thread's state that changes what a step computes, and the context variables it sees."""

    device_types: tuple[str, ...]
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) for each device type autocast is on for
    autocast_cache: bool
    default_dtype: torch.dtype
    matmul_flags: tuple[bool, ...]  # _MATMUL_FLAGS' values, in order
    default_device: torch.device
    cuda_device: int | None  # the current CUDA device where CUDA is initialized, else None
    context: contextvars.Context = attrs.field(eq=False, repr=False)
    # Where the record was taken (RECORDED_AT_CAPTURE, RECORDED_AT_REFIT): what a refused replay is told to do.
    recorded_at: str = attrs.field(default=RECORDED_AT_CAPTURE, eq=False)

    @classmethod
    def current(cls, device_type: str = "cpu", recorded_at: str = RECORDED_AT_CAPTURE) -> ServingState:
        """The calling thread's state (``device_type``: the registry's device, whose autocast is recorded too), taken
        at ``recorded_at``."""
        types = tuple(dict.fromkeys((*AUTOCAST_DEVICE_TYPES, device_type)))
        return cls(
            device_types=types,
            autocast=_autocast_now(types),
            autocast_cache=torch.is_autocast_cache_enabled(),
            default_dtype=torch.get_default_dtype(),
            matmul_flags=_matmul_flags(),
            default_device=torch.get_default_device(),
            cuda_device=torch.cuda.current_device() if torch.cuda.is_initialized() else None,
            context=contextvars.copy_context(),
            recorded_at=recorded_at,
        )

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` under this state, in a copy of the context variables it was taken with.  The
        process-wide part (default dtype, matmul flags) cannot be set per thread: it is compared with this record before
        and after ``fn`` runs, ``ServingStateError`` naming what differs (a change made and undone meanwhile is not
        seen)."""

        def body() -> Any:
            self.check_process_wide()
            with contextlib.ExitStack() as stack:  # the thread-local part: CUDA device, default device, autocast
                if self.cuda_device is not None:
                    stack.enter_context(torch.cuda.device(self.cuda_device))
                if torch.get_default_device() != self.default_device:
                    stack.enter_context(torch.device(self.default_device))
                for device_type in self.device_types:
                    dtype = dict(self.autocast).get(device_type)
                    if dtype is not None:
                        stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
                    elif torch.is_autocast_enabled(device_type):
                        stack.enter_context(torch.autocast(device_type, enabled=False))
                result = fn(*args, **kwargs)
            self.check_process_wide()
            return result

        return self.context.copy().run(body)

    def _process_wide_differences(self, recorded: str) -> list[str]:
        found = []
        if torch.get_default_dtype() is not self.default_dtype:
            found.append(f"default dtype {torch.get_default_dtype()} now, {self.default_dtype} {recorded}")
        for (name, _), was, now_flag in zip(_MATMUL_FLAGS, self.matmul_flags, _matmul_flags()):
            if was != now_flag:
                found.append(f"{name} {now_flag} now, {was} {recorded}")
        return found

    def check_process_wide(self) -> None:
        """Raise ``ServingStateError`` naming the default dtype or matmul flag that differs from this record now (they
        are process-wide: a capture runs under the values the process has, not under the record's)."""
        found = self._process_wide_differences("recorded")
        if found:
            raise ServingStateError(
                f"capture under another process-wide state than the registry's record: {'; '.join(found)}. The default "
                "dtype and the matmul flags are shared by every thread, so a capture cannot run under the recorded ones "
                "while they are changed, and its graph would compute what a replay under the record does not; the graph "
                "is not kept. Leave them as recorded while captures run (background captures and refits included), or "
                "reg.clear() and capture again under the new ones"
            )

    def differences(self) -> list[str]:
        """How the calling thread's state differs from this one in what a replay computes (empty: it does not):
        autocast and the process-wide flags."""
        found = []
        now = _autocast_now(self.device_types)
        if now != self.autocast:
            found.append(f"{_describe(now)} now, {_describe(self.autocast)} at capture")
        return found + self._process_wide_differences("at capture")

    def check(self, registry: str) -> None:
        """Raise ``ServingStateError`` naming what differs, if the calling thread's state differs from this one; the
        advice depends on where the record was taken (``capture()``, or the refit of a registry that only adapts)."""
        found = self.differences()
        if found:
            raise ServingStateError(
                f"run() on registry {registry!r} under another state than its graphs were captured under: "
                f"{'; '.join(found)}. A graph keeps the precision it was captured with, so it would return what eager "
                f"does not; {_ADVICE.get(self.recorded_at, _ADVICE[RECORDED_AT_CAPTURE])}"
            )


_TRUE: Callable[[], bool] = True.__bool__  # a C callable answering True: a test that always passes


class StateTest:
    """The hot path's test of the calling thread's state against a record: ``guard() and flag() == flag_was``.

    The server reads ``parts``, the triple ``(guard, flag, flag_was)``, where it replays: no Python frame, two C calls
    (dynamo's ``GlobalStateGuard``, and cuDNN's TF32 flag, which it does not cover).  ``take`` and ``passing`` swap the
    tuple whole, so a holder never sees half of two.  False may also mean a difference that changes no result (grad
    mode, the thread count): the caller then asks ``ServingState.differences()``, and ``take``s the state again if there
    is none.
    """

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.passing()

    def __call__(self) -> bool:
        guard, flag, flag_was = self.parts
        return guard() and flag() == flag_was

    def passing(self) -> None:
        """Pass whatever the state (nothing recorded to compare with)."""
        self.parts: tuple[Callable[[], Any], Callable[[], Any], Any] = (_TRUE, _TRUE, True)

    def take(self, device_type: str = "cpu", recorded_at: str = RECORDED_AT_CAPTURE) -> ServingState:
        """Pass while the calling thread's state is what it is now, in every field ``ServingState.differences()``
        compares (``device_type``: the registry's, whose autocast counts too); that state, taken at ``recorded_at``.
        Call it on the thread it will check."""
        now = ServingState.current(device_type, recorded_at)
        if GlobalStateGuard is None:
            self.parts = ((lambda: not now.differences()), _TRUE, True)
            return now
        guard = GlobalStateGuard().check
        rest = [(read, was) for (name, read), was in zip(_MATMUL_FLAGS, now.matmul_flags) if name not in _GUARDED_FLAGS]
        rest += [
            ((lambda d=d: _autocast_now((d,))), _autocast_now((d,)))  # type: ignore[misc]
            for d in now.device_types if d not in _GUARDED_AUTOCAST
        ]
        if len(rest) == 1:  # the usual case: cuDNN's TF32 flag alone
            ((read, was),) = rest
            self.parts = (guard, read, was)
        else:
            self.parts = ((lambda: guard() and all(read() == was for read, was in rest)), _TRUE, True)
        return now
