"""The ``cpu`` backend: a CUDA-graph emulator for machines with no GPU.

Capture runs the callable under a TorchDispatchMode that records every aten op with the very tensors it touched; replay
re-runs them on those tensors, in order.  So graph semantics carry over: Python control flow and scalars are frozen at
capture, a tensor read at capture is read again at replay (a forgotten copy into a static input gives stale results),
and ops a CUDA capture forbids (host syncs, data-dependent output shapes, copies to the host) raise
``GraphUnsafeOpError`` naming the op and the user's source line.  Only ops that produced fresh storage (or mutated an
argument) are replayed: whether an op was a view (``reshape``, ``contiguous``) is decided by storage at capture.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from cgregistry.contracts import runtime
from cgregistry.errors import GraphUnsafeOpError
from cgregistry.contracts.markers import hookimpl

if TYPE_CHECKING:
    from cgregistry.contracts.registrars import BackendRegistrar

__all__ = ["CpuBackend", "CpuGraph", "CpuSegment", "GraphUnsafeOpError", "find_graph_unsafe_ops"]

aten = torch.ops.aten

# Ops that read device memory on the host, or whose output shape depends on data.
_HOST_SYNC = {
    aten._local_scalar_dense.default: "reads a tensor value on the host (.item(), int(), float())",
    aten.item.default: "reads a tensor value on the host (.item())",
    aten.is_nonzero.default: "reads a tensor value on the host (bool(tensor), if tensor:)",
    aten.equal.default: "compares tensors on the host (torch.equal)",
}
_DATA_DEPENDENT = {
    "nonzero": "output shape depends on data (nonzero / torch.where(cond))",
    "argwhere": "output shape depends on data (argwhere)",
    "masked_select": "output shape depends on data (masked_select)",
    "unique": "output shape depends on data (unique)",
    "_unique": "output shape depends on data (unique)",
    "_unique2": "output shape depends on data (unique)",
    "unique_dim": "output shape depends on data (unique)",
    "unique_consecutive": "output shape depends on data (unique_consecutive)",
}
_BOOL_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
_COPY_OPS = {"to", "_to_copy", "_copy_from", "_copy_from_and_resize"}


# Modules of the package that hold model code (what a user's step is), not machinery.
_MODEL_MODULES = frozenset({"cgregistry.demo_model"})


def _is_machinery(module: str) -> bool:
    """Frames of cgregistry's own modules are machinery, except those that hold a model."""
    return (module == "cgregistry" or module.startswith("cgregistry.")) and module not in _MODEL_MODULES


def _user_frame() -> str:
    """The innermost caller outside torch and cgregistry's machinery, as 'file:line: code'."""
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(torch_dir) and not _is_machinery(frame.f_globals.get("__name__", "")):
            summary = traceback.extract_stack(frame, limit=1)[-1]
            code = (summary.line or "").strip()
            return f"{summary.filename}:{summary.lineno}" + (f": {code}" if code else "")
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _works(obj: Any) -> list[Any]:
    """The c10d work handles in an op's result (collectives return them)."""
    if isinstance(obj, (list, tuple)):
        return [w for item in obj for w in _works(item)]
    return [obj] if isinstance(obj, torch.ScriptObject) and hasattr(obj, "wait") else []


def _unsafe_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    name = func.overloadpacket.__name__
    reason = _HOST_SYNC.get(func) or _DATA_DEPENDENT.get(name)
    if reason is not None:
        return reason
    if name == "repeat_interleave" and kwargs.get("output_size") is None and any(
        isinstance(a, torch.Tensor) for a in args[1:2]
    ):
        return "output shape depends on data (repeat_interleave with tensor repeats and no output_size)"
    if name in _BOOL_INDEX_OPS and len(args) > 1:
        if any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1])):
            return "boolean-mask indexing has a data-dependent output shape"
    # Copies into pinned host memory; other host copies are judged by the Python method called (``_HostTransfers``):
    # at the aten level, on a CPU-only machine, ``.to(x.device)`` and ``.cpu()`` are the same op.
    if name in _COPY_OPS and kwargs.get("pin_memory"):
        return "copies into pinned host memory"
    return None


# Tensor methods that move device memory to the host by what they do, whatever the tensor's device.
_HOST_METHODS = {
    torch.Tensor.cpu: "copies device memory to the host (.cpu())",
    torch.Tensor.numpy: "reads device memory on the host (.numpy())",
    torch.Tensor.tolist: "reads device memory on the host (.tolist())",
}
_MOVE_METHODS = (torch.Tensor.to, torch.Tensor.pin_memory)


def _host_transfer_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why a Python-level tensor call is a host transfer, or None.

    ``.cpu()``, ``.numpy()`` and ``.tolist()`` are by definition; ``.to(...)`` is when it names the host
    ("cpu" as a string).  A ``torch.device`` object is never judged: on a CPU-only machine the tensor's own
    ``x.device`` is ``device('cpu')`` too, and a same-device move is legal (the emulator cannot see intent there).
    """
    reason = _HOST_METHODS.get(func)
    if reason is not None:
        return reason
    if func is torch.Tensor.pin_memory:
        return "copies into pinned host memory (.pin_memory())"
    if func is torch.Tensor.to:
        if kwargs.get("pin_memory"):
            return "copies into pinned host memory"
        targets = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, str)]
        if any(torch.device(t).type == "cpu" for t in targets):
            return "copies device memory to the host (.to('cpu'))"
    return None


class _HostTransfers(TorchFunctionMode):
    """Refuses Python-level host transfers (``_host_transfer_reason``) while a capture records,
    or lists them in ``found`` and goes on."""

    def __init__(self, found: list[GraphUnsafeOpError] | None = None) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_METHODS or func in _MOVE_METHODS:
            reason = _host_transfer_reason(func, args, kwargs)
            if reason is not None:
                error = GraphUnsafeOpError(f"Tensor.{func.__name__}", reason, _user_frame())
                if self.found is None:
                    raise error
                self.found.append(error)
        return func(*args, **kwargs)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Op:
    """One recorded call: the op, its exact arguments, and the fresh outputs to refresh."""

    __slots__ = ("func", "args", "kwargs", "targets", "waits")

    def __init__(self, func: Any, args: tuple, kwargs: dict, targets: list[tuple[int, torch.Tensor]], waits: bool = False) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.targets = targets  # (position in the flattened result, tensor captured there)
        self.waits = waits  # a collective: its result holds work to wait for, as the eager call did


class _Recorder(TorchDispatchMode):
    # Under a piecewise capture, the split graph runs as compiled (its aten ops reach the recorder); elsewhere
    # torch.compile'd code falls back to eager under the recorder, since Inductor kernels bypass the dispatcher and
    # would be recorded as nothing.  Torch asks at every mode entry: the context variable's own getter answers.
    ignore_compile_internals = staticmethod(runtime.see_compiled.get)

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.collectives = 0  # torch.distributed collectives recorded (c10d ops)
        self.fresh_bytes = 0
        self._fresh_storages: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        reason = _unsafe_reason(func, args, kwargs)
        if reason is not None:
            raise GraphUnsafeOpError(str(func), reason, _user_frame())
        result = func(*args, **kwargs)
        inputs = {_storage_key(t) for t in _tensors(args) + _tensors(list(kwargs.values()))}
        outs = _tensors(result if isinstance(result, (list, tuple)) else [result])
        targets = []
        for i, t in enumerate(outs):
            key = _storage_key(t)
            if t.untyped_storage().nbytes() == 0 or key in inputs:
                continue  # a view or the mutated argument itself: it follows its storage
            targets.append((i, t))
            if key not in self._fresh_storages:
                self._fresh_storages.add(key)
                self.fresh_bytes += t.untyped_storage().nbytes()
        collective = func.namespace == "c10d"  # in place through the process group: no schema says it writes
        if targets or collective or func._schema.is_mutable:
            self.ops.append(_Op(func, args, kwargs, targets, waits=bool(_works(result))))
            self.collectives += collective
        return result


class CpuGraph:
    """Recorded ops replayed on the tensors they were captured with."""

    __slots__ = ("ops", "memory_bytes")

    def __init__(self, ops: list[_Op], memory_bytes: int) -> None:
        self.ops = ops
        self.memory_bytes = memory_bytes

    def replay(self) -> None:
        with torch.inference_mode():
            for op in self.ops:
                result = op.func(*op.args, **op.kwargs)
                if op.waits:  # a c10d collective replays synchronously, as it ran at capture
                    for work in _works(result):
                        work.wait()
                if op.targets:
                    fresh = _tensors(result if isinstance(result, (list, tuple)) else [result])
                    for i, target in op.targets:
                        target.copy_(fresh[i])


def find_graph_unsafe_ops(fn: Callable[[], Any]) -> list[GraphUnsafeOpError]:
    """Run ``fn`` eagerly and list every graph-unsafe op it calls (does not stop at the first)."""
    found: list[GraphUnsafeOpError] = []

    class _Finder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            reason = _unsafe_reason(func, args, kwargs)
            if reason is not None:
                found.append(GraphUnsafeOpError(str(func), reason, _user_frame()))
            return func(*args, **kwargs)

    with torch.inference_mode(), _Finder(), _HostTransfers(found):
        fn()
    return found


def _default_group_sequence() -> int | None:
    """How many collectives the default process group has run (None without torch.distributed)."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except (RuntimeError, AttributeError):  # a process group without sequence numbers
        return None


class CpuSegment:
    """One recording in progress: ops run between construction and ``end()`` are captured."""

    def __init__(self) -> None:
        if runtime.cpu_capturing.get():
            raise RuntimeError("nested capture: a cpu graph capture is already in progress on this thread")
        self._token = runtime.cpu_capturing.set(True)
        self._recorder = _Recorder()
        self._sequence = _default_group_sequence()
        self._recorder.__enter__()
        # Python-level host transfers are checked in Python code; a piecewise segment records compiled
        # code (generated, and dynamo would trace again under a new function mode), so none there.
        self._host = contextlib.nullcontext() if runtime.see_compiled.get() else _HostTransfers()
        self._host.__enter__()

    def _close(self) -> None:
        self._host.__exit__(None, None, None)
        self._recorder.__exit__(None, None, None)
        runtime.cpu_capturing.reset(self._token)

    def end(self) -> CpuGraph:
        self._close()
        if self._sequence is not None:
            ran = (_default_group_sequence() or 0) - self._sequence
            if ran > self._recorder.collectives:
                raise GraphUnsafeOpError(
                    "a torch.distributed collective",
                    f"{ran} collective(s) ran on the default process group during capture but the emulator recorded "
                    f"{self._recorder.collectives}: call them as torch.distributed.<name>(...) (all_reduce, "
                    "all_gather_into_tensor, reduce_scatter_tensor, broadcast, all_to_all_single), not as functional "
                    "collectives; replay would skip the rest",
                    "the end of a captured segment",
                )
        clock, began = runtime.phase_clock.get(), time.perf_counter()
        graph = CpuGraph(self._recorder.ops, self._recorder.fresh_bytes)
        if clock is not None:  # inline: a capture walks no more modules for it
            clock["instantiate"] += time.perf_counter() - began
        return graph

    def abort(self) -> None:
        self._close()


class CpuBackend:
    """The emulator: runs anywhere, records and replays aten ops."""

    name = "cpu"
    # A plan's capture runs a full collection first where garbage may hold device memory that a graph would otherwise
    # be captured beside (cuda); the emulator's graphs take host memory from the allocator like everything else, and a
    # full collection of a large heap costs 0.1-0.4 s a capture() call: the young generations are collected instead.
    collects_before_capture = False

    def is_available(self) -> bool:
        return True

    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_pool(self) -> object:
        return object()  # recorded tensors are held per graph; there is no pool to share

    def warmup(self, fn: Callable[[], Any], runs: int) -> Any:
        out = None
        for _ in range(max(runs, 1)):
            out = fn()
        return out

    def capture_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def begin_capture(self, pool: object) -> CpuSegment:
        """Start recording aten ops; ``end()`` gives the graph."""
        return CpuSegment()

    def capture(self, fn: Callable[[], Any], pool: object) -> tuple[CpuGraph, Any]:
        segment = self.begin_capture(pool)
        try:
            out = fn()
        except BaseException:
            segment.abort()
            raise
        return segment.end(), out

    def share_outputs(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return leaves

    def hold_intermediates(self, tensors: list[torch.Tensor], pool: object) -> list[torch.Tensor]:
        return tensors  # recorded tensors are held per graph: there is no shared pool to leave them in

    def recover_pool(self, pool: object) -> object:
        return pool

    def synchronize(self) -> None:
        return None


@hookimpl
def cgregistry_register_backends(register: BackendRegistrar) -> None:
    register(CpuBackend())
