"""The piecewise compiler: a torch.compile backend that splits the traced model at splitting ops.

Dynamo traces the model once with a dynamic token dimension; this backend cuts the FX graph at every splitting op into
*pieces* (captured per descriptor by the ``piecewise`` strategy) and *splits* (run eagerly between them, as
``@eager_break``s).  Splitting ops: custom ops (or ``"namespace::name"``), Python functions (opaque to dynamo), module
types (traced ops run eagerly, host-side decisions inside frozen by the trace); by default every ``@eager_break``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import sympy
import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._sympy.value_ranges import ValueRanges

from cgregistry.strategies import breaks
from cgregistry.contracts import runtime
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.errors import PiecewiseError

__all__ = ["DEFAULT_MAX_TRACES", "PiecewiseCompiler", "PiecewiseError", "PiecewiseModel", "SplittingOps", "compile_piecewise"]

DEFAULT_MAX_TRACES = 4  # one dynamic trace serves every size; slack for specialize_size_one and retries


_op_name = breaks.custom_op_name  # "namespace::name" of a torch op, else None


def _label(op: object) -> str:
    name = _op_name(op)
    if name is not None:
        return name
    if isinstance(op, nn.Module):
        return type(op).__qualname__  # not repr(): a real model's is thousands of lines
    return getattr(op, "__cgregistry_break__", None) or getattr(op, "__qualname__", None) or repr(op)


@attrs.frozen(slots=True)
class SplittingOps:
    """Where to cut the traced graph: custom op names, opaque functions, module types, marked functions."""

    op_names: frozenset[str] = frozenset()
    functions: tuple[Callable[..., Any], ...] = ()
    module_types: tuple[type[nn.Module], ...] = ()
    marked: bool = True  # every @eager_break function splits

    @classmethod
    def of(cls, ops: Iterable[object] | None, *, marked: bool | None = None) -> SplittingOps:
        """Sort ``ops`` by kind.  ``None`` means the marked functions only; naming ops leaves them out
        unless ``marked=True``."""
        if ops is None:
            return cls(marked=True if marked is None else marked)
        if isinstance(ops, (str, bytes)) or not isinstance(ops, Iterable):
            raise TypeError(f"splitting_ops must be a sequence of ops, functions or module types, got {ops!r}")
        names: set[str] = set()
        functions: list[Callable[..., Any]] = []
        modules: list[type[nn.Module]] = []
        for op in ops:
            if isinstance(op, str):
                if "::" not in op:
                    raise ValueError(f"splitting op {op!r} is not a custom op name; expected 'namespace::name'")
                names.add(op.split(".", 1)[0] if op.count("::") == 1 else op)
            elif _op_name(op) is not None:
                names.add(_op_name(op))  # type: ignore[arg-type]
            elif isinstance(op, type) and issubclass(op, nn.Module):
                modules.append(op)
            elif isinstance(getattr(op, "__cgregistry_op__", None), str):
                names.add(op.__cgregistry_op__)  # a marked custom op: the trace records the op
            elif callable(op) and not isinstance(op, type):
                functions.append(getattr(op, "__cgregistry_opaque__", op))  # a marked function: what the trace records
            else:
                raise TypeError(
                    f"splitting op {op!r} is not a torch custom op, an op name 'namespace::name', "
                    "a function or an nn.Module subclass"
                )
        return cls(frozenset(names), tuple(functions), tuple(modules), bool(marked))

    def keep_opaque(self) -> None:
        """Tell dynamo to record the functions (and marked ones) as single calls instead of tracing into them."""
        for fn in self.functions:
            torch.compiler.allow_in_graph(fn)
        if self.marked:
            for fn in runtime.marked:
                _allow_marked(fn)
            if _allow_marked not in runtime.on_mark:
                runtime.on_mark.append(_allow_marked)

    def region(self, node: fx.Node) -> str | None:
        """The splitting region ``node`` belongs to (a label), or None when it belongs to a piece."""
        if node.op != "call_function":
            return None
        target = node.target
        name = _op_name(target)
        if name is not None and name in self.op_names:
            return f"{name}#{node.name}"
        if name is not None and self.marked and name in runtime.marked_ops:
            return f"{runtime.marked_ops[name][0]}#{node.name}"
        if any(target is fn for fn in self.functions):
            return f"{_label(target)}#{node.name}"
        if self.marked and hasattr(target, "__cgregistry_break__"):
            return f"{target.__cgregistry_break__}#{node.name}"  # type: ignore[union-attr]
        if self.module_types:
            for path, kind in (node.meta.get("nn_module_stack") or {}).values():
                if isinstance(kind, type) and issubclass(kind, self.module_types):
                    return f"{kind.__qualname__}@{path}"  # one region per module instance and call
        return None

    def reached(self, regions: Iterable[str]) -> set[str]:
        """Which named ops (by label) the graph's splitting regions came from."""
        seen = set()
        for label in regions:
            seen.add(label.split("#", 1)[0].split("@", 1)[0])
        return seen

    def named(self) -> set[str]:
        """Labels of the explicitly named ops, each of which the trace must reach."""
        return set(self.op_names) | {_label(f) for f in self.functions} | {t.__qualname__ for t in self.module_types}


def _allow_marked(fn: Callable[..., Any]) -> None:
    """Dynamo traces the marked wrapper (it swaps module arguments for handles) and records its opaque call
    (a marked custom op: the op itself, which dynamo records as it is)."""
    opaque = getattr(fn, "__cgregistry_opaque__", None)
    if opaque is not None:
        torch.compiler.allow_in_graph(opaque)


class _Split(nn.Module):
    """A splitting region of the split graph: runs eagerly, and as an eager break under a piecewise capture
    (``stub``: the region with a marked op's capture stub in its place, what a capture runs instead)."""

    def __init__(self, region: fx.GraphModule, label: str, stub: fx.GraphModule | None = None) -> None:
        super().__init__()
        self.region = region
        self.label = label
        self.stub = stub

    def forward(self, *args: Any) -> Any:
        return runtime.unrecorded(self._run, args)  # runs eagerly at every replay: what it reads is live

    def _run(self, args: tuple) -> Any:
        site = runtime.site.get()
        if site is None:
            return self.region(*args)
        return site.on_break(self.region.forward, self.stub.forward if self.stub is not None else None, self.label, args, {})


@attrs.define(slots=True)
class SplitReport:
    """What one trace became: how many pieces and splits, the split labels in order, how many Inductor compiles
    its pieces took (pieces alike in graph and input layout share one; 0 without Inductor), and whether it left
    size 1 to a later trace (its Inductor kernels cannot serve size 1: see ``_settle_sizes_unsafe_at_one``)."""

    pieces: int
    splits: list[str]
    compiles: int = 0
    size_one_later: bool = False


def split_graph(gm: fx.GraphModule, ops: SplittingOps) -> tuple[fx.GraphModule, SplitReport, list[str]]:
    """Cut ``gm`` at its splitting regions; return the split module, a report and the piece submodule names."""
    partition_of: dict[fx.Node, int] = {}
    region_labels: dict[int, str] = {}
    part = 0
    current: str | None = None  # the region of the previous compute node (None: a piece)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        region = ops.region(node)
        if region != current:
            part += 1
            current = region
        partition_of[node] = part
        if region is not None:
            region_labels[part] = region.split("#", 1)[0]
    if not region_labels:
        raise PiecewiseError(
            "no splitting op was reached in the traced graph: the pieces would be one full graph. "
            + _which_ops(ops)
        )
    missing = ops.named() - ops.reached(region_labels.values())
    if missing:
        raise PiecewiseError(
            f"splitting op(s) {sorted(missing)} never reached in the traced graph; check the names "
            "(custom ops as 'namespace::name', functions as the very objects the model calls)"
        )
    split = fx.passes.split_module.split_module(gm, None, lambda node: partition_of[node], keep_original_order=True)
    pieces: list[str] = []
    labels: list[str] = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        index = int(str(node.target).rsplit("_", 1)[1])
        label = region_labels.get(index)
        if label is None:
            pieces.append(str(node.target))
            continue
        labels.append(label)
        region = getattr(split, str(node.target))
        # A region holding just a marked function already breaks by itself (with its capture stub).
        calls = [n for n in region.graph.nodes if n.op == "call_function"]
        if not (len(calls) == 1 and hasattr(calls[0].target, "__cgregistry_break__")):
            setattr(split, str(node.target), _Split(region, label, _with_capture_stubs(region)))
    return split, SplitReport(len(pieces), labels), pieces


def _with_capture_stubs(region: fx.GraphModule) -> fx.GraphModule | None:
    """``region`` with each marked custom op that has a capture stub calling the stub instead (same arguments);
    None where it has none."""
    stubs: dict[fx.Node, Callable[..., Any]] = {}
    for node in region.graph.nodes:
        name = _op_name(node.target) if node.op == "call_function" else None
        stub = runtime.marked_ops[name][1] if name in runtime.marked_ops else None
        if stub is not None:
            stubs[node] = stub
    if not stubs:
        return None
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for node in region.graph.nodes:
        copies[node] = graph.node_copy(node, copies.__getitem__)
        if node in stubs:
            copies[node].target = stubs[node]
    return fx.GraphModule(region, graph)


def _which_ops(ops: SplittingOps) -> str:
    if ops.named():
        return f"Named splitting ops: {sorted(ops.named())}."
    return "No op was named: mark the attention (or any uncapturable) function with @cgregistry.eager_break, or name ops."


def _fakes_of(gm: fx.GraphModule) -> tuple[list[Any], Any]:
    """The trace's own example inputs (fake tensors with symbolic sizes, SymInts) and their fake mode."""
    fake_args = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next((a.fake_mode for a in fake_args if isinstance(a, torch._subclasses.FakeTensor)), None)
    return fake_args, fake_mode


def _compile_pieces_with_inductor(split: fx.GraphModule, pieces: Sequence[str], gm: fx.GraphModule) -> tuple[int, bool]:
    """Replace each piece by its Inductor compilation, for the symbolic shapes of the trace; return how many
    compiles that took, and whether size 1 is left to a trace of its own.  Pieces alike (a decoder's layers:
    the same ops on inputs of the same layout, the weights among the inputs) share one compilation.  A trace
    that Inductor's general kernels cannot serve, made at size 1, keeps its pieces uncompiled."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.compile_fx import compile_fx

    from cgregistry.strategies.inductor_passes import pieces_config

    fake_args, fake_mode = _fakes_of(gm)
    names = set(pieces)
    compiled_by_form: dict[tuple, _Compiled] = {}

    class _Propagate(fx.Interpreter):
        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            module = self.fetch_attr(target)
            out = module(*args, **kwargs)
            if target in names:
                form = _piece_form(module, args)
                compiled = compiled_by_form.get(form) if form is not None else None
                if compiled is None:
                    compiled = _Compiled(compile_fx(module, list(args)))
                    compiled_by_form[form if form is not None else ("own", target)] = compiled
                setattr(split, target, compiled)
            return out

    shape_env = getattr(fake_mode, "shape_env", None)
    safe = _sizes_safe_at_one(gm)
    own_trace_at_one, for_size_one = _settle_sizes_unsafe_at_one(fake_args, _sizes_general_at_one(gm, shape_env) - safe)
    if for_size_one:
        return 0, own_trace_at_one  # the pieces run as traced: torch's own ops, right at size 1
    ctx = fake_mode if fake_mode is not None else torch.no_grad()
    # The python dispatcher, as dynamo traced with: composite ops (a matmul under autocast on CUDA) then keep their
    # sizes symbolic instead of reading them as ints, which would fix the batch size for good.
    with ctx, enable_python_dispatcher(), _sizes_kept_general(shape_env, safe), pieces_config(), runtime.timed_phase("compile"):
        _Propagate(split).run(*fake_args)
    return len(compiled_by_form), own_trace_at_one


class _Ref:
    """A node of a piece, by its position: what ``_piece_form`` writes in place of a node's name."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"%{self.index}"


def _piece_form(piece: fx.GraphModule, args: Sequence[Any]) -> tuple | None:
    """What a piece computes, independent of its nodes' names: each node's op, target and arguments (nodes by
    position), with its inputs' dtypes, devices, symbolic sizes and strides.  Two pieces of one form compile
    to the same kernels.  None where the piece holds state of its own (a constant, a submodule)."""
    position: dict[fx.Node, _Ref] = {}
    nodes: list[tuple] = []
    for i, node in enumerate(piece.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        position[node] = _Ref(i)
        if node.op == "placeholder":
            target = None  # its name: the piece's own
        else:
            target = node.target if node.op == "call_function" else str(node.target)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), position.__getitem__)
        nodes.append((node.op, target, repr(args), repr(kwargs)))
    storages: dict[Any, int] = {}  # which inputs share memory: compiled code may rely on how they alias
    return (tuple(nodes), tuple(_input_form(a, i, storages) for i, a in enumerate(args)))


def _input_form(value: Any, index: int, storages: dict[Any, int]) -> tuple:
    if isinstance(value, torch.Tensor):
        shares = storages.setdefault(StorageWeakRef(value.untyped_storage()), index)
        return ("tensor", value.dtype, value.device, tuple(map(str, value.shape)), tuple(map(str, value.stride())),
                str(value.storage_offset()), value.requires_grad, shares)
    return ("value", type(value), str(value))


@contextlib.contextmanager
def _sizes_kept_general(shape_env: Any, allowed: frozenset[Any]) -> Iterator[None]:
    """Undo what Inductor's code generation assumes of a symbolic size only to rule out 0 and 1.

    Inductor's "is this size 1?" guards turn a general size into ``2 <= size``, so the key of size 1 would trace and
    compile again; the kernels for a general size serve size 1 too, so the lower bound goes back to the trace's and
    guards implied by ``size >= 2`` alone are dropped (other refinements stay).  Only sizes in ``allowed`` (where the
    trace's shapes agree at size 1, ``_sizes_safe_at_one``).  Torch internals: where not as expected, nothing is undone.
    """
    ranges = getattr(shape_env, "var_to_range", None)
    guards = getattr(shape_env, "guards", None)
    evaluate = getattr(shape_env, "_maybe_evaluate_static", None)
    changed = getattr(shape_env, "_update_version_counter", None)
    if not (isinstance(ranges, dict) and isinstance(guards, list) and callable(evaluate) and callable(changed)):
        yield
        return
    before, first_new = dict(ranges), len(guards)
    yield
    now = {
        symbol: ranges[symbol]
        for symbol in allowed
        if symbol in ranges and symbol in before and before[symbol].lower <= 1 and ranges[symbol].lower <= 2 <= ranges[symbol].upper
    }
    if not now:
        return
    try:
        # Which new guards hold for every size from 2 up to the upper bound: those only rule out 0 and 1.
        for symbol, current in now.items():
            ranges[symbol] = ValueRanges(2, current.upper)
        changed()
        implied = {
            id(g)
            for g in guards[first_new:]
            if g.expr.free_symbols and g.expr.free_symbols <= now.keys() and bool(evaluate(g.expr, axioms=()))
        }
    except Exception:  # an internal changed shape: keep whatever Inductor recorded (one more trace for size 1)
        ranges.update(now)
        changed()
        return
    for symbol, current in now.items():
        ranges[symbol] = ValueRanges(before[symbol].lower, current.upper)  # an upper bound (32-bit indexing) stays
    guards[:] = [g for g in guards if id(g) not in implied]
    changed()


def _symbol_of(size: Any) -> Any:
    """The sympy symbol behind a SymInt that is a plain symbol (a batch axis of the trace), else None."""
    expr = getattr(getattr(size, "node", None), "expr", None) if isinstance(size, torch.SymInt) else None
    return expr if isinstance(expr, sympy.Symbol) else None


def _placeholder_symbols(gm: fx.GraphModule) -> list[list[tuple[int, Any]] | Any]:
    """Per placeholder: the (dimension, symbol) pairs of a tensor's symbolic sizes, or a SymInt's symbol."""
    found: list[list[tuple[int, Any]] | Any] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            found.append([(d, sym) for d, size in enumerate(value.shape) if (sym := _symbol_of(size)) is not None])
        else:
            found.append(_symbol_of(value))
    return found


def _sizes_safe_at_one(gm: fx.GraphModule) -> frozenset[Any]:
    """The trace's batch-axis symbols at which every node's shape, rerun with that size (and all of them) at 1,
    is the symbolic shape at 1: no op in the trace behaves differently at size 1 (a squeeze of that axis, a
    broadcast against it), so kernels generated for a general size serve size 1.  Empty where unsure."""
    fake_args, fake_mode = _fakes_of(gm)
    shape_env = getattr(fake_mode, "shape_env", None)
    hints = getattr(shape_env, "backed_var_to_val" if hasattr(shape_env, "backed_var_to_val") else "var_to_val", None)
    if not isinstance(hints, dict):
        return frozenset()
    candidates = _sizes_general_at_one(gm, shape_env)
    safe = frozenset(sym for sym in candidates if _shapes_agree(gm, fake_args, hints, {sym}))
    if len(safe) > 1 and not _shapes_agree(gm, fake_args, hints, safe):
        return frozenset()
    return safe


def _sizes_general_at_one(gm: fx.GraphModule, shape_env: Any) -> set[Any]:
    """The trace's batch-axis symbols whose range takes 1: sizes the trace (size-oblivious) assumed are not 1."""
    ranges = getattr(shape_env, "var_to_range", None) or {}
    return {sym for where in _placeholder_symbols(gm) for sym in ([s for _, s in where] if isinstance(where, list) else [where])
            if sym is not None and ranges.get(sym) is not None and ranges[sym].lower <= 1}


def _settle_sizes_unsafe_at_one(fake_args: Sequence[Any], unsafe: set[Any]) -> tuple[bool, bool]:
    """Keep Inductor's kernels for a general size away from size 1 on the ``unsafe`` batch axes (those a trace's
    shapes differ at, at size 1: the kernels would run the trace's size-oblivious choices there, a squeeze that
    squeezes nothing).  Called before the pieces compile.  A trace made at size 2 or more gets a ``size >= 2`` guard,
    so dynamo traces size 1 again; one made at size 1 gets ``size < 2``, and its pieces must stay uncompiled (their
    torch ops then decide at run time).  Returns (a guard left size 1 to a later trace, this trace is for size 1)."""
    later = at_one = False
    for value in fake_args:
        sizes = value.shape if isinstance(value, torch.Tensor) else [value] if isinstance(value, torch.SymInt) else []
        for size in sizes:
            symbol = _symbol_of(size)
            if symbol in unsafe:
                unsafe.discard(symbol)
                if bool(size >= 2):  # a guard, installed with the trace's own
                    later = True
                else:
                    at_one = True
    return later, at_one


def _shapes_agree(gm: fx.GraphModule, fake_args: list[Any], hints: dict[Any, Any], at_one: set[Any] | frozenset[Any]) -> bool:
    """Rerun ``gm`` on static fake tensors with the ``at_one`` symbols at 1 (the others at their hints) and compare
    every tensor's shape with its symbolic shape at those values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    values = {sym: sympy.Integer(int(v)) for sym, v in hints.items()}
    values.update({sym: sympy.Integer(1) for sym in at_one})

    def concrete(size: Any) -> int:
        if isinstance(size, torch.SymInt):
            return int(size.node.expr.xreplace(values))
        return int(size)

    static = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        inputs: list[Any] = []
        with static:
            for a in fake_args:
                if isinstance(a, torch.Tensor):
                    shape = [concrete(d) for d in a.shape]
                    inputs.append(torch.empty(shape, dtype=a.dtype, device=a.device))
                elif isinstance(a, torch.SymInt):
                    inputs.append(concrete(a))
                else:
                    inputs.append(a)

        mismatch: list[bool] = []

        class _Compare(fx.Interpreter):
            def run_node(self, node: fx.Node) -> Any:
                out = super().run_node(node)
                want = node.meta.get("example_value")
                if isinstance(want, torch.Tensor) and isinstance(out, torch.Tensor):
                    if [concrete(d) for d in want.shape] != list(out.shape):
                        mismatch.append(True)
                return out

        token = runtime.site.set(breaks.TRACING_SITE)
        try:
            with static, torch.no_grad():
                _Compare(gm).run(*inputs)
        finally:
            runtime.site.reset(token)
        return not mismatch
    except Exception:  # anything unexpected: size 1 keeps its own trace
        return False


class _Compiled(nn.Module):
    """An Inductor-compiled piece."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        if runtime.cpu_capturing.get():
            raise PiecewiseError(
                "an Inductor-compiled piece ran under the cpu emulator's capture, which cannot record Inductor "
                "kernels (they bypass the dispatcher); capture on the cuda backend, or compile with inductor=False"
            )
        return self.fn(*args)


class PiecewiseCompiler:
    """The torch.compile backend: ``torch.compile(model, backend=PiecewiseCompiler(...), dynamic=True)``.

    ``splitting_ops``: custom ops, op names, functions, module types (default: ``@eager_break`` functions).
    ``inductor``: compile each piece with Inductor (off by default).  ``max_traces``: traces before it is an error.
    """

    def __init__(
        self,
        splitting_ops: Iterable[object] | None = None,
        *,
        inductor: bool = False,
        max_traces: int = DEFAULT_MAX_TRACES,
        include_marked: bool | None = None,
    ) -> None:
        if type(max_traces) is not int or max_traces < 1:
            raise ValueError(f"max_traces must be an int >= 1, got {max_traces!r}")
        self.ops = SplittingOps.of(splitting_ops, marked=include_marked)
        self.ops.keep_opaque()
        self.inductor = bool(inductor)
        self.max_traces = max_traces
        self.traces: list[SplitReport] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if len(self.traces) >= self.max_traces:
            raise PiecewiseError(
                f"the model was traced {len(self.traces) + 1} times, over the bound of max_traces={self.max_traces}: "
                "a guard fails for each new batch. Make the token dimension dynamic (torch.compile(..., dynamic=True) "
                "or torch._dynamo.mark_dynamic), keep Python values that change per batch out of the model, and see "
                "TORCH_LOGS=recompiles for the failing guard"
            )
        split, report, pieces = split_graph(gm, self.ops)
        if self.inductor:
            report.compiles, report.size_one_later = _compile_pieces_with_inductor(split, pieces, gm)
        self.traces.append(report)
        return _Runner(split)

    @property
    def size_one_specialized(self) -> bool:
        """Whether later traces specialise size 1: an earlier trace's Inductor kernels cannot serve it."""
        return any(report.size_one_later for report in self.traces)

    @property
    def pieces(self) -> int:
        """Pieces of the latest trace (0 before the first)."""
        return self.traces[-1].pieces if self.traces else 0


class _Runner:
    """What dynamo calls for a trace: the split graph.  A piecewise capture records its pieces and runs its
    splits between them; any other capture (a full key's) records the whole of it, splits inline, in one graph."""

    __slots__ = ("split",)

    def __init__(self, split: fx.GraphModule) -> None:
        self.split = split

    def __call__(self, *args: Any) -> Any:
        site = runtime.site.get()
        if site is not None and hasattr(site, "compiled_runs"):  # a piecewise capture is watching
            site.compiled_runs += 1  # type: ignore[attr-defined]
        return self.split(*args)


class PiecewiseModel:
    """``model`` compiled with the piecewise backend; tracing errors say where and suggest ``breakable``."""

    def __init__(self, model: Callable[..., Any], compiler: PiecewiseCompiler, *, specialize_size_one: bool = False) -> None:
        self.model = model
        self.compiler = compiler
        # Sizes that merely coincide (tokens == request slots) must not become equal in the trace,
        # and, unless asked, size 1 is not specialised either: one trace then serves every size.
        # The pieces run real torch ops, so only Python control flow on "size == 1" is assumed false.
        self._shape_config = {"use_duck_shape": False, "backed_size_oblivious": not specialize_size_one}
        # Only the batch's axes become symbolic (marked per call from the key being captured); every other
        # dimension, such as a mask's size-1 axes or the hidden size, stays static.
        self._compiled = torch.compile(model, backend=compiler, dynamic=None, fullgraph=True)
        self._register_modules()
        # (argument, dimension) pairs sized like the key of the first traced call: marked on every call
        # alike, since a marking that appears later would make dynamo trace again.
        self._batch_axes: list[tuple[int | str, int]] | None = None
        functools.update_wrapper(self, model, updated=())  # type: ignore[arg-type]

    def _register_modules(self) -> None:
        """Handles for the modules the model reaches (itself, a bound method's owner, a closure's modules),
        so marked functions may take them as arguments in the trace."""
        for module in _reachable_modules(self.model):
            breaks.register_modules(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = runtime.batch.get()
        if batch is not None and batch.key is None:
            # A registry runs this batch eagerly (no key covers it): the model itself, never a new
            # trace for whatever layout the live inputs have.
            return self.model(*args, **kwargs)
        whole = getattr(runtime.capture_strategy.get(), "whole_graph", False)
        if whole and (not self.compiler.inductor or runtime.cpu_capturing.get()):
            # A full key has no reason to be split: without Inductor its graph is the model's own ops
            # (no trace needed); on the cpu emulator, whose recording mode dynamo will not run compiled
            # code under, likewise.
            return self.model(*args, **kwargs)
        if runtime.cpu_capturing.get() and not runtime.see_compiled.get():
            # Another whole-step capture on the cpu emulator: the model itself, splits inline.
            return self.model(*args, **kwargs)
        args = tuple(_unviewed(a) for a in args)
        kwargs = {k: _unviewed(v) for k, v in kwargs.items()}
        if batch is not None and batch.key is not None:  # a warm-up or capture, where a trace may happen
            runtime.ran_compiled()
            self._register_modules()
            if self._batch_axes is None:
                self._batch_axes = _batch_axes(batch.key, runtime.axis_rows.get(), args, kwargs)
            _mark_dynamic(self._batch_axes, args, kwargs)
        # Outside a capture, breaks run plainly, except on dynamo's fake tensors (no guards from them).
        token = runtime.site.set(breaks.TRACING_SITE) if runtime.site.get() is None else None
        try:
            # Python floats of the model (eps, say) stay constants instead of becoming 0-d tensor
            # inputs read with .item(): one trace still serves every size.
            shapes = {**self._shape_config, "backed_size_oblivious": False} if self.compiler.size_one_specialized else self._shape_config
            with torch._dynamo.config.patch(specialize_float=True), fx.experimental._config.patch(**shapes):
                return self._compiled(*args, **kwargs)
        except PiecewiseError:
            raise
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, PiecewiseError):
                raise PiecewiseError(str(inner)) from None
            raise
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
            if "_handle_of" in str(exc):
                raise PiecewiseError(
                    f"an eager break in {_label(self.model)} was given an nn.Module the piecewise compiler cannot reach "
                    "from the compiled callable: compile the model itself, or a function whose closure (or its objects' "
                    "attributes) holds it; or give it a handle first with cgregistry.strategies.breaks.register_modules(module)"
                ) from exc
            raise PiecewiseError(
                f"dynamo cannot trace {_label(self.model)}: {_first_line(exc)}{_where(exc)}. Mark that code with "
                "@cgregistry.eager_break (it becomes a splitting op), or use the 'breakable' strategy, which "
                "captures without tracing"
            ) from exc
        finally:
            if token is not None:
                runtime.site.reset(token)


def _reachable_modules(fn: Any) -> list[nn.Module]:
    """The modules ``fn`` can reach: itself, a bound method's owner, a partial's arguments, the values in its
    closure and the globals its code names, and one level inside those (an engine object's ``.model``, a list
    or dict of modules)."""
    roots: list[Any] = [fn, getattr(fn, "__self__", None), getattr(fn, "func", None)]
    if callable(getattr(fn, "func", None)):
        roots += [*(getattr(fn, "args", None) or ()), *(getattr(fn, "keywords", None) or {}).values()]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            roots.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is not None and isinstance(scope, dict):
        roots += [scope[name] for name in code.co_names if name in scope]
    found: dict[int, nn.Module] = {}
    for root in roots:
        for value in (root, *_members(root)):
            if isinstance(value, nn.Module):
                found.setdefault(id(value), value)
    return list(found.values())


def _members(value: Any) -> list[Any]:
    """One level inside ``value``: a sequence's or mapping's items, a plain object's attributes (not a module's)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (nn.Module, type, types.ModuleType)) or callable(value):
        return []  # a module's own submodules are registered through it; a Python module's namespace is not the model
    return list(getattr(value, "__dict__", {}).values())


def _batch_axes(key: BatchDescriptor, rows: frozenset[int], args: tuple, kwargs: dict) -> list[tuple[int | str, int]]:
    """The (argument, dimension) pairs of tensor arguments sized like one of ``key``'s axes (or ``rows``, the static
    inputs' under a capture): the dimensions dynamo treats as symbolic.  One that only coincides (a weight's) is
    specialised again by the trace; size 1 is never taken for a batch axis."""
    sizes = {key.num_tokens, *rows}
    if key.num_reqs is not None:
        sizes |= {key.num_reqs, key.num_reqs + 1}
    sizes.discard(1)
    named: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    return [(where, dim) for where, value in named if isinstance(value, torch.Tensor)
            for dim, size in enumerate(value.shape) if size in sizes]


def _mark_dynamic(axes: list[tuple[int | str, int]], args: tuple, kwargs: dict) -> None:
    for where, dim in axes:
        value = args[where] if isinstance(where, int) else kwargs.get(where)
        if isinstance(value, torch.Tensor) and dim < value.dim():
            torch._dynamo.maybe_mark_dynamic(value, dim)


def _unviewed(value: Any) -> Any:
    """A view (of a static buffer, say) as a plain tensor over the same memory: dynamo guards on how a view relates to
    its base, which would retrace for every row count."""
    if not isinstance(value, torch.Tensor) or value._base is None:
        return value
    alias = torch.empty(0, dtype=value.dtype, device=value.device)
    return alias.set_(value.untyped_storage(), value.storage_offset(), value.shape, value.stride())


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _where(exc: BaseException) -> str:
    """The innermost user-code location dynamo reports, as ' (File "...", line N)' (empty where it names none)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip().startswith('File "')]
    return f" ({lines[-1]})" if lines else ""


def compile_piecewise(
    model: Callable[..., Any],
    splitting_ops: Iterable[object] | None = None,
    *,
    inductor: bool = False,
    max_traces: int = DEFAULT_MAX_TRACES,
    include_marked: bool | None = None,
    specialize_size_one: bool = False,
) -> PiecewiseModel:
    """Compile ``model`` for the ``piecewise`` strategy (dynamic shapes, full graph, split at splitting ops);
    ``specialize_size_one=True`` keeps a separate trace for size 1 (for a model branching on a size being 1)."""
    compiler = PiecewiseCompiler(splitting_ops, inductor=inductor, max_traces=max_traces, include_marked=include_marked)
    return PiecewiseModel(model, compiler, specialize_size_one=specialize_size_one)
