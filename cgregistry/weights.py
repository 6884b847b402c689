"""The tensors graphs read: where they were when each graph was captured, and a generation that moves the moment a
watched module replaces one.

A graph reads the addresses it saw at capture.  An in-place update of a weight (``param.copy_``,
``load_state_dict`` without ``assign``, an adapter copied into existing slots) keeps them, so graphs
compute with the new values.  A replacement moves them (``load_state_dict(assign=True)``,
``module.weight = nn.Parameter(...)``, a replaced submodule or buffer): graphs would go on reading the
old, perhaps freed, memory.  So each entry keeps what it read (``seen()``, shared by the captures that
read the same addresses) and the ``generation`` it was captured in; the generation moves when a watched
module registers a new parameter, buffer or submodule (torch's global registration hooks) and when
``rebase()`` finds a move, and a replay whose entry is of an older generation asks ``reads_current``
first.  A replacement that registers nothing (``param.data = t``, ``torch.utils.swap_tensors``, a
global rebound to another module) is only seen by a comparison: at ``refresh()``, and before every
replay in debug mode.

Which modules a step reads is found by ``modules_reached``: the step itself, a bound method's object,
``functools.partial`` arguments, closure cells and the module-level names its code uses (and theirs, for
the plain functions it calls).
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from cgregistry.errors import CgregistryError

__all__ = ["Reached", "WeightWatch", "WeightsMovedError", "reached"]

Seen = Mapping[str, "int | None"]  # a watched tensor's name to its address when a graph was captured


class WeightsMovedError(CgregistryError, RuntimeError):
    """A graph would read a watched weight where it was at capture, after the weight moved (call ``reg.refresh()``)."""


class _ModuleSlot:
    """A parameter or buffer of a module, looked up from the root by its path each time: a replaced parameter, buffer
    or submodule is seen, and so is a root rebound (``root`` is called: a global or a closure cell read anew)."""

    __slots__ = ("root", "path", "table", "name")

    def __init__(self, root: Callable[[], Any], path: str, table: str, name: str) -> None:
        self.root = root
        self.path = path  # of the submodule holding it ("" for the root)
        self.table = table  # "_parameters" or "_buffers"
        self.name = name

    def data_ptr(self) -> int | None:
        module = self.root()
        if not isinstance(module, nn.Module):
            return None
        try:
            module = module.get_submodule(self.path)
        except AttributeError:  # the submodule was removed
            return None
        tensor = getattr(module, self.table).get(self.name)
        return None if tensor is None else tensor.data_ptr()


class _Tensor:
    """A tensor given by ``watch((name, tensor))`` (always that tensor), or read anew (a global or a closure cell)."""

    __slots__ = ("read",)

    def __init__(self, read: Callable[[], Any]) -> None:
        self.read = read

    def data_ptr(self) -> int | None:
        tensor = self.read()
        return tensor.data_ptr() if isinstance(tensor, torch.Tensor) else None


def _module_slots(root: Callable[[], Any], prefix: str) -> list[tuple[str, _ModuleSlot]]:
    module = root()
    if not isinstance(module, nn.Module):
        return []
    slots = []
    for path, sub in module.named_modules():
        for table in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, table).items():
                if tensor is not None:
                    slots.append((f"{prefix}{path + '.' if path else ''}{name}", _ModuleSlot(root, path, table, name)))
    return slots


# Every module of a watched tree, to the watches that want to hear of a registration on it.
_listeners: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[WeightWatch]] = weakref.WeakKeyDictionary()
_hooks_lock = threading.Lock()
_hooks_installed = False


def _registered(module: nn.Module, name: str, value: Any) -> None:
    """torch's registration hook (parameters, buffers, submodules of any module): tell the watches of this module."""
    watches = _listeners.get(module)
    if watches:
        for watch in list(watches):
            watch.changed(f"{type(module).__name__}.{name}")


def _install_hooks() -> None:
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        from torch.nn.modules import module as torch_module

        for register in (
            torch_module.register_module_parameter_registration_hook,
            torch_module.register_module_buffer_registration_hook,
            torch_module.register_module_module_registration_hook,
        ):
            register(_registered)  # returns None: the hooks observe, they never replace what is registered
        _hooks_installed = True


class WeightWatch:
    """The watched tensors (each with its address when it was first watched or last rebased), and a generation that
    moves whenever one may have moved."""

    def __init__(self) -> None:
        self._watched: dict[str, tuple[_ModuleSlot | _Tensor, int | None]] = {}  # name -> (source, baseline address)
        self._roots: dict[str, tuple[Callable[[], Any], str]] = {}  # what watch() was given, by prefix and identity
        self.generation = 0  # moves when a watched module registers something, or rebase() finds a move
        self.modules_watched = False  # whether any module is watched (a step reading none is warned about)
        self._last_seen: dict[str, int | None] = {}

    def watch(self, named: Iterable[tuple[str, torch.Tensor]] | nn.Module | Callable[[], Any], prefix: str = "") -> None:
        """Watch ``(name, tensor)`` pairs, or every parameter and buffer of a module (by name, so replacing one is seen;
        a callable returning the module is read anew at each comparison).  Each is compared with its address now."""
        if isinstance(named, nn.Module) or callable(named) and not isinstance(named, Iterable):
            root: Callable[[], Any] = (lambda m=named: m) if isinstance(named, nn.Module) else named
            _install_hooks()
            self._roots.setdefault(f"{prefix}@{id(root()) if isinstance(named, nn.Module) else id(named)}", (root, prefix))
            self.modules_watched = True
            for name, slot in _module_slots(root, prefix):
                self._watched.setdefault(name, (slot, slot.data_ptr()))
            self._listen(root())
            return
        for name, tensor in named:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"watch() takes (name, tensor) pairs or an nn.Module, got {name!r}: {type(tensor).__name__}")
            self._watched[f"{prefix}{name}"] = (_Tensor(lambda t=tensor: t), tensor.data_ptr())

    def watch_read(self, name: str, read: Callable[[], Any]) -> None:
        """Watch the tensor ``read()`` returns (a global or a closure cell, read anew at each comparison)."""
        if name not in self._watched:
            source = _Tensor(read)
            self._watched[name] = (source, source.data_ptr())

    def changed(self, what: str) -> None:
        """A watched module registered a parameter, buffer or submodule (called by torch's hooks)."""
        self.generation += 1

    def seen(self) -> Seen:
        """Every watched tensor's address now: what a graph captured now reads (the same object while nothing moved)."""
        now = {name: source.data_ptr() for name, (source, _) in self._watched.items()}
        if now != self._last_seen:
            self._last_seen = now
        return self._last_seen

    def reads_current(self, seen: Seen) -> bool:
        """Whether a graph that read ``seen`` reads every watched tensor where it is now (a tensor watched after that
        graph's capture counts where it was when it was watched)."""
        return not self._moved_for(seen, first_only=True)

    def moved_for(self, seen: Seen) -> list[str]:
        """Each watched tensor a graph that read ``seen`` would read at its old address, with where it went."""
        return self._moved_for(seen, first_only=False)

    def _moved_for(self, seen: Seen, first_only: bool) -> list[str]:
        found = []
        for name, (source, baseline) in self._watched.items():
            was = seen[name] if name in seen else baseline
            now = source.data_ptr()
            if now != was:
                found.append(_move(name, was, now))
                if first_only:
                    break
        for name in seen.keys() - self._watched.keys():  # forgotten since (removed, and rebased away): never current
            found.append(f"{name} was removed")
        return found

    def moved(self) -> list[str]:
        """Each watched tensor whose address is not its baseline (where it was watched or last rebased)."""
        return [_move(name, ptr, now) for name, (source, ptr) in self._watched.items() if (now := source.data_ptr()) != ptr]

    def rebase(self) -> None:
        """Every tensor's baseline becomes its address now; a replaced submodule's tensors are watched from now on, a
        removed one's are forgotten; the generation moves if anything had moved."""
        moved = bool(self.moved())
        watched: dict[str, tuple[_ModuleSlot | _Tensor, int | None]] = {}
        for name, (source, _) in self._watched.items():
            ptr = source.data_ptr()
            if ptr is not None:
                watched[name] = (source, ptr)
        for root, prefix in self._roots.values():
            for name, slot in _module_slots(root, prefix):
                if name not in watched:
                    watched[name] = (slot, slot.data_ptr())
                    moved = True
            self._listen(root())
        moved = moved or watched.keys() != self._watched.keys()
        self._watched = watched
        if moved:
            self.generation += 1

    def names(self) -> list[str]:
        """The watched tensors' names, in watch order."""
        return list(self._watched)

    def __len__(self) -> int:
        return len(self._watched)

    def _listen(self, root: Any) -> None:
        if isinstance(root, nn.Module):
            for module in root.modules():
                _listeners.setdefault(module, weakref.WeakSet()).add(self)


def _move(name: str, was: int | None, now: int | None) -> str:
    if now is None:
        return f"{name} was removed"
    if was is None:
        return f"{name} was added"
    return f"{name} moved from {was:#x} to {now:#x}"


# ---------------------------------------------------------------- what a step reads

_MAX_DEPTH = 3  # plain functions followed from the step (the step, what it calls, what that calls)
# Values a step may reach that hold no tensor a graph reads: not looked into, not reported as opaque.
_INERT = (types.ModuleType, type, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device,
          types.BuiltinFunctionType, types.BuiltinMethodType)


# Packages whose functions are not looked into: they hold no engine weights of their own.
_LIBRARIES = frozenset({"cgregistry", "torch", "functools", "typing"})


@attrs.frozen
class Reached:
    """What a step reads, found by ``reached``: modules and tensors (each as its name and a callable that reads it
    anew, so a rebound global or cell is seen), and the names of values it reads whose contents are not looked into
    (a dict of modules, an engine object reached other than through a method)."""

    modules: list[tuple[str, Callable[[], Any]]]
    tensors: list[tuple[str, Callable[[], Any]]]
    opaque: list[str]


def reached(step: Callable[..., Any]) -> Reached:
    """What ``step`` reads: the step itself or a bound method's object (``step``), a plain object's module and tensor
    attributes (``step.<attr>``), ``functools.partial`` arguments, closure cells and module-level names its code uses
    (by their names), followed into the plain functions it calls.  A module inside another one found is left out (its
    parent's watch covers it)."""
    modules: dict[int, tuple[str, Callable[[], Any]]] = {}
    tensors: dict[str, Callable[[], Any]] = {}
    opaque: list[str] = []
    seen_code: set[int] = set()

    def value(found: Any, name: str, read: Callable[[], Any], depth: int) -> None:
        if isinstance(found, nn.Module):
            modules.setdefault(id(found), (name, read))
        elif isinstance(found, torch.Tensor):
            tensors.setdefault(name, read)
        elif isinstance(found, (types.FunctionType, functools.partial, types.MethodType)):
            visit(found, depth + 1, name)
        elif depth == 0 and not isinstance(found, _INERT) and not callable(found):
            inside(found, name, read, depth)  # read by the step's own code: a container or an object it looks into

    def inside(found: Any, name: str, read: Callable[[], Any], depth: int) -> None:
        """One level into a container or a plain object the step reads: its modules and tensors are watched (read anew
        through it); one holding other objects that are neither is opaque (not looked into further)."""
        if isinstance(found, Mapping):
            items = [(f"{name}[{k!r}]", v, lambda r=read, k=k: _item(r(), k)) for k, v in list(found.items())]
        elif isinstance(found, (list, tuple)):
            items = [(f"{name}[{i}]", v, lambda r=read, i=i: _item(r(), i)) for i, v in enumerate(found)]
        elif isinstance(found, (set, frozenset)):
            items = [(name, v, lambda: None) for v in found]
        else:
            items = [(f"{name}.{a}", v, lambda r=read, a=a: getattr(r(), a, None))
                     for a, v in list(getattr(found, "__dict__", {}).items())]
            if not hasattr(found, "__dict__"):
                opaque.append(name)
        held = [(n, v, r) for n, v, r in items if isinstance(v, (nn.Module, torch.Tensor))]
        for item_name, item, item_read in held:
            value(item, item_name, item_read, depth + 1)
        if not held and any(not isinstance(v, _INERT) and not callable(v) for _, v, _ in items):
            opaque.append(name)

    def attributes(obj: Any, name: str, depth: int) -> None:
        for attr, found in list(getattr(obj, "__dict__", {}).items()):
            if isinstance(found, (nn.Module, torch.Tensor)):
                value(found, f"{name}.{attr}", lambda o=obj, a=attr: getattr(o, a, None), depth)

    def visit(fn: Any, depth: int, label: str) -> None:
        if depth > _MAX_DEPTH:
            return
        if isinstance(fn, nn.Module):
            modules.setdefault(id(fn), (label, lambda m=fn: m))
        elif isinstance(fn, functools.partial):
            visit(fn.func, depth, label)
            for i, arg in enumerate(fn.args):
                value(arg, f"{label}.args[{i}]", lambda a=arg: a, depth)
            for key, arg in fn.keywords.items():
                value(arg, f"{label}.{key}", lambda a=arg: a, depth)
        elif isinstance(fn, types.MethodType):
            owner = fn.__self__
            if isinstance(owner, nn.Module):
                modules.setdefault(id(owner), (label, lambda o=owner: o))
            elif not isinstance(owner, type):
                attributes(owner, label, depth)
            visit(fn.__func__, depth, label)
        elif isinstance(fn, types.FunctionType):
            wrapped = getattr(fn, "__wrapped__", None)  # functools.wraps: what a decorator (eager_break) wraps
            if wrapped is not None:
                visit(wrapped, depth, label)
            code = fn.__code__
            if id(code) in seen_code or fn.__globals__.get("__name__", "").partition(".")[0] in _LIBRARIES:
                return
            seen_code.add(id(code))
            for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
                try:
                    found = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                value(found, name, lambda c=cell: _cell(c), depth)
            scope = fn.__globals__
            for name in _global_names(code):
                if name in scope:
                    value(scope[name], name, lambda s=scope, n=name: s.get(n), depth)
        elif callable(fn):  # an object with __call__: its attributes and its code
            call = getattr(type(fn), "__call__", None)
            attributes(fn, label, depth)
            if isinstance(call, types.FunctionType):
                visit(call, depth, label)

    visit(step, 0, "step")
    roots = list(modules.values())
    inner = {id(sub) for _, read in roots for sub in list(read().modules())[1:]}
    return Reached([(n, r) for n, r in roots if id(r()) not in inner], list(tensors.items()), list(dict.fromkeys(opaque)))


def _item(container: Any, key: Any) -> Any:
    try:
        return container[key]
    except (KeyError, IndexError, TypeError):
        return None


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _global_names(code: types.CodeType) -> list[str]:
    """The names ``code`` and the code nested in it (lambdas, comprehensions, inner functions) look up globally."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return list(dict.fromkeys(names))
