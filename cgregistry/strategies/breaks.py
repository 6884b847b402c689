"""Eager breaks: functions that end a graph segment, run eagerly, and let capture resume.

Mark a function with ``@eager_break`` (or call ``graph_break()`` for an empty split point).  Outside a ``breakable``
capture it costs one context-variable read (inside a ``full`` one it is captured like any code); inside, the segment
ends, the function (or its ``capture_stub``) runs eagerly, and a new segment begins; at replay it runs again between
the segments with the same arguments, seeing fresh data in them.  It may write into tensors it is given, or return
tensors: kept from capture, each replay copies the fresh result in, so later code reads a stable address.
``current_batch()`` gives the live batch inside it: actual descriptor, padded key, ``run(..., context=...)`` payload.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

import torch
from torch import nn

from cgregistry.contracts import runtime
from cgregistry.contracts.runtime import BreakContext, current_batch

__all__ = ["BreakContext", "capture_barrier", "current_batch", "eager_break", "graph_break"]

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def capture_barrier(fn: Callable[[], None]) -> Iterator[None]:
    """Run ``fn`` (e.g. ``torch.distributed.barrier``) before each eager break while capturing inside this block: it
    keeps ranks in step between the end of a segment and rank-coupled eager work."""
    token = runtime.barrier.set(fn)
    try:
        yield
    finally:
        runtime.barrier.reset(token)


def fake_mode_of(args: tuple, kwargs: dict) -> Any:
    """The FakeTensorMode of the first fake tensor argument (dynamo is tracing the call), else None."""
    from torch._subclasses.fake_tensor import FakeTensor

    return next((value.fake_mode for value in (*args, *kwargs.values()) if isinstance(value, FakeTensor)), None)


def run_for_trace(fn: Callable[..., Any] | None, fake_mode: Any, args: tuple, kwargs: dict) -> Any:
    """Run a break on dynamo's fake tensors, for its output shapes only, adding no guards: it runs on real tensors
    later, so its size checks (a kernel's path for one query row) must not make dynamo trace again."""
    if fn is None:
        return None
    shape_env = getattr(fake_mode, "shape_env", None)
    token = runtime.site.set(None)
    # The break may touch real tensors it reaches itself (a module's KV cache buffer): under the fake
    # mode they become fakes for this call, so nothing real is read or written.
    allowed, fake_mode.allow_non_fake_inputs = fake_mode.allow_non_fake_inputs, True
    try:
        if shape_env is None:
            return fn(*args, **kwargs)
        with shape_env.suppress_guards():
            return fn(*args, **kwargs)
    finally:
        fake_mode.allow_non_fake_inputs = allowed
        runtime.site.reset(token)


class TracingSite:
    """The site while a piecewise model may be traced outside a capture: fake calls add no guards."""

    def on_break(self, fn: Callable[..., Any] | None, stub: Callable[..., Any] | None, name: str, args: tuple, kwargs: dict) -> Any:
        fake_mode = fake_mode_of(args, kwargs)
        if fake_mode is not None:
            return run_for_trace(fn, fake_mode, args, kwargs)
        return fn(*args, **kwargs) if fn is not None else None  # a plain call: marked code inside ends up here too


TRACING_SITE = TracingSite()


# Modules a traced graph may pass to marked functions, by handle (weakly: a trace must not keep a model alive).
_modules_by_handle: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_handles = itertools.count(1)
HANDLE = "_cgregistry_handle"  # the attribute a registered module carries: dynamo reads it as a constant


def register_modules(root: nn.Module) -> None:
    """Give ``root`` and its submodules handles, so a traced call of a marked function can pass them."""
    for module in root.modules():
        held = module.__dict__.get(HANDLE)
        if held is None or _modules_by_handle.get(held) is not module:  # new, or a copy carrying the original's handle
            handle = next(_handles)
            module.__dict__[HANDLE] = handle
            _modules_by_handle[handle] = module


def _handle_of(module: nn.Module, label: str) -> int:
    handle = getattr(module, HANDLE, None)  # (read by dynamo as a constant: kept to a plain attribute read)
    if handle is None:
        raise TypeError(
            f"eager break {label!r} was called with a {type(module).__name__} the piecewise compiler was not told of: "
            "compile the model itself, or a function whose closure holds it (reg.compile(model) or a lambda over it)"
        )
    return handle


def _module_of(handle: int, label: str) -> nn.Module:
    module = _modules_by_handle.get(handle)
    if module is None:
        raise RuntimeError(f"eager break {label!r}: the module passed to it when the model was traced no longer exists")
    return module


@overload
def eager_break(fn: F) -> F: ...


@overload
def eager_break(*, capture_stub: Callable[..., Any] | None = None, name: str | None = None) -> Callable[[F], F]: ...


def eager_break(fn: Any = None, *, capture_stub: Callable[..., Any] | None = None, name: str | None = None) -> Any:
    """Mark ``fn`` as an eager break; usable bare or as ``@eager_break(capture_stub=..., name=...)``.

    ``capture_stub`` runs instead of ``fn`` while segments are captured (to skip a collective, say); replay runs
    ``fn``.  Arguments may include ``nn.Module`` objects, also under ``piecewise``'s trace.  ``fn`` may be a torch
    custom op (with a fake implementation): a trace records the op with the tensors it writes, and the piecewise
    compiler splits at every call of it (call it through the marked function so ``breakable`` breaks there too).
    """

    def wrap(func: F) -> F:
        if not callable(func):
            raise TypeError(f"eager_break marks a function or a torch custom op, got {func!r}")
        op = custom_op_name(func)
        label = name or op or getattr(func, "__qualname__", repr(func))

        def call(args: tuple, kwargs: dict) -> Any:
            return runtime.unrecorded(dispatch, args, kwargs)  # marked host code: what it reads is not frozen unseen

        def dispatch(args: tuple, kwargs: dict) -> Any:
            site = runtime.site.get()
            if site is None:
                return func(*args, **kwargs)
            return site.on_break(func, capture_stub, label, args, kwargs)

        def opaque(module_slots: tuple[int, ...], module_keys: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
            # What a traced graph calls: dynamo cannot pass modules, so their handles stand in for them.
            args = tuple(_module_of(a, label) if i in module_slots else a for i, a in enumerate(args))
            for key in module_keys:
                kwargs[key] = _module_of(kwargs[key], label)
            return call(args, kwargs)

        @functools.wraps(func, updated=() if op is not None else functools.WRAPPER_UPDATES)  # not a custom op's internals
        def marked(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                if op is not None:  # dynamo records the op itself, with what its schema says it mutates
                    return func(*args, **kwargs)
                # Record one opaque call.
                slots = tuple(i for i, a in enumerate(args) if isinstance(a, nn.Module))
                keys = tuple(k for k, v in kwargs.items() if isinstance(v, nn.Module))
                args = tuple(_handle_of(a, label) if i in slots else a for i, a in enumerate(args))
                kwargs = {k: _handle_of(v, label) if k in keys else v for k, v in kwargs.items()}
                return opaque(slots, keys, *args, **kwargs)
            return call(args, kwargs)

        marked.__cgregistry_break__ = label  # type: ignore[attr-defined]
        if op is None:
            opaque.__cgregistry_break__ = label  # type: ignore[attr-defined]
            opaque.__qualname__ = f"{label}.<traced>"
            marked.__cgregistry_opaque__ = opaque  # type: ignore[attr-defined]
        else:
            marked.__cgregistry_op__ = op  # type: ignore[attr-defined]
            runtime.marked_ops[op] = (label, capture_stub)
        runtime.marked.add(marked)
        for callback in runtime.on_mark:
            callback(marked)
        return marked  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap


def custom_op_name(func: object) -> str | None:
    """``"namespace::name"`` of a torch custom op (``torch.library.custom_op``'s result, or an op of ``torch.ops``), else None."""
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name
    if isinstance(func, torch._library.custom_ops.CustomOpDef):
        return func._qualname
    return None


def graph_break() -> None:
    """An empty split point: ends the current segment and starts the next (no-op elsewhere)."""
    site = runtime.site.get()
    if site is not None:
        site.on_break(None, None, "graph_break", (), {})
