"""What the graphs read, and where it was: the modules and tensors a step is given, where they were when each graph
was captured, and a generation that moves the moment a watched module registers a new one.

A graph reads the addresses it saw at capture: an update in place (``param.copy_``, ``reg.load_weights``) keeps them, a
replacement (``load_state_dict(assign=True)``, a new parameter, submodule or buffer) moves them.  So each entry keeps
what it read (``seen()``, shared by captures reading the same addresses) and its ``generation``, which moves when a
watched module registers something (torch's registration hooks, which only observe) or ``rebase()`` finds a change;
replaying an entry of an older generation compares addresses first.  A change registering nothing (``param.data = t``,
a rebound attribute) is found by comparison: at ``refresh()``, and before every replay in debug mode.

What a step is given is found by structure, never code: the step, a bound method's object, closure cells, defaults, a
``functools.partial``'s arguments, then plain objects' attributes and container items, a few levels deep.  What it
reads otherwise (a module-level name, a context variable) ``unseen`` names, for the registry to say once; ``watch()``
names it instead.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from cgregistry.errors import WeightsMovedError

__all__ = ["Reached", "WeightWatch", "WeightsMovedError", "reached"]

# Where a tensor's memory is and how a kernel reads it: (address, shape, strides, dtype); another layout moves it too.
Layout = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]
Seen = Mapping[str, "Layout | None"]  # a watched tensor's name to its layout when a graph was captured

MAX_DEPTH = 4  # objects and containers followed from the step (an engine's model may be two attributes down)
MAX_ITEMS = 256  # a larger container is not looked into


def _layout(tensor: torch.Tensor) -> Layout:  # a sparse or nested tensor has no strides: address and shape say it
    return (tensor.data_ptr(), tuple(tensor.shape), _get(lambda: tensor.stride()) or (), tensor.dtype)


class _ModuleSlot:
    """A module's parameter or buffer, looked up from the root (read anew) by its path each time: one replaced is seen."""

    __slots__ = ("root", "path", "table", "name")

    def __init__(self, root: Callable[[], Any], path: str, table: str, name: str) -> None:
        self.root, self.path, self.table, self.name = root, path, table, name

    def layout(self, modules: dict[tuple[int, str], tuple[Any, Any]]) -> Layout | None:
        """Where the tensor is now; ``modules``: the submodules found in this read, with their roots (held: a root made
        anew at each read and freed would give its id to the next)."""
        root = self.root()
        key = (id(root), self.path)
        found = modules.get(key)
        if found is None:
            found = modules[key] = (root, _submodule(root, self.path))
        tensor = getattr(found[1], self.table).get(self.name) if found[1] is not None else None
        return None if tensor is None else _layout(tensor)


def _submodule(module: Any, path: str) -> nn.Module | None:  # where attribute lookup finds it, as forward does
    for part in path.split(".") if path else ():
        if not isinstance(module, nn.Module):
            return None
        module = vars(module).get(part, module._modules.get(part))
    return module if isinstance(module, nn.Module) else None


class _Tensor:  # a tensor given by watch((name, tensor)) (always that one), or read anew (a cell, an argument)

    __slots__ = ("read",)

    def __init__(self, read: Callable[[], Any]) -> None:
        self.read = read

    def layout(self, modules: dict[tuple[int, str], tuple[Any, Any]]) -> Layout | None:
        tensor = self.read()
        return _layout(tensor) if isinstance(tensor, torch.Tensor) else None


def _module_slots(root: Callable[[], Any], prefix: str) -> list[tuple[str, _ModuleSlot]]:
    module = root()
    if not isinstance(module, nn.Module):
        return []
    return [(f"{prefix}{path + '.' if path else ''}{name}", _ModuleSlot(root, path, table, name))
            for path, sub in module.named_modules() for table in ("_parameters", "_buffers")
            for name, tensor in getattr(sub, table).items() if tensor is not None]


# Every module of a watched tree, by id (a module need not be hashable), to a weak reference to it and the watches
# that want to hear of a registration on it.
_listeners: dict[int, tuple[weakref.ref[nn.Module], weakref.WeakSet[WeightWatch]]] = {}


def _registered(module: nn.Module, name: str, value: Any) -> None:
    """torch's registration hook (parameters, buffers, submodules of any module): tell the watches of this module.
    Not while dynamo traces (a forward that builds a ModuleList would have the trace guard on what is watched)."""
    entry = _listeners.get(id(module))
    if entry is not None and entry[0]() is module and not torch.compiler.is_compiling():
        for watch in list(entry[1]):
            watch.generation += 1


def _forget(key: int) -> None:
    if key in _listeners and _listeners[key][0]() is None:
        del _listeners[key]


@functools.cache  # once per process (two threads racing here register twice: a generation moves by two, no harm)
def _install_hooks() -> None:
    from torch.nn.modules import module as torch_module

    torch_module.register_module_parameter_registration_hook(_registered)  # they observe, never replace
    torch_module.register_module_buffer_registration_hook(_registered)
    torch_module.register_module_module_registration_hook(_registered)


@attrs.frozen
class Reached:
    """What a step is given (modules, tensors: each as its name and a callable that reads it anew), what run() cannot
    check (``unseen``; the modules read through plain objects' attributes, whose rebinding only ``refresh()`` finds)."""

    modules: list[tuple[str, Callable[[], Any]]]
    tensors: list[tuple[str, Callable[[], Any]]]
    unseen: list[str]
    attributes: list[str] = attrs.field(factory=list)
    module_level: list[tuple[str, Callable[[], Any]]] = attrs.field(factory=list)  # of ``unseen``: debug mode watches


def reached(step: Callable[..., Any]) -> Reached:
    """What ``step`` is given, by structure (the step itself, or a bound method's object, named ``step``; the rest by
    cell, argument, attribute or item name).  Modules anywhere on the way; tensors only where the step is given them,
    not in an object's attributes, where an engine keeps its bookkeeping."""
    modules: dict[int, tuple[str, Callable[[], Any]]] = {}
    tensors: dict[str, Callable[[], Any]] = {}
    unseen: list[str] = []
    attributes: list[str] = []
    module_level: dict[str, Callable[[], Any]] = {}
    large: list[str] = []
    looked: set[int] = set()

    def visit(value: Any, label: str, read: Callable[[], Any], depth: int, held: bool = False) -> None:
        """``held``: reached through an attribute of a plain object (rebound without the registry's knowing)."""
        if isinstance(value, nn.Module):
            if id(value) not in modules:
                modules[id(value)] = (label, read)
                attributes.extend([label] if held else [])
        elif isinstance(value, torch.Tensor):
            tensors.update({} if held or label in tensors else {label: read})
        elif depth > MAX_DEPTH or id(value) in looked:
            return
        elif _wrapped(value) is not None:  # a wrapper (functools.wraps, a cache, reg.compile's model): what it wraps too
            looked.add(id(value))
            visit(_wrapped(value), label, lambda: _wrapped(read()), depth, held)
            if isinstance(value, types.FunctionType):
                visit_function(value, depth, held)
        elif isinstance(value, functools.partial):
            looked.add(id(value))
            visit(value.func, label, lambda: value.func, depth, held)
            for key, arg in [*((f"args[{i}]", a) for i, a in enumerate(value.args)), *value.keywords.items()]:
                visit(arg, f"{label}.{key}", lambda a=arg: a, depth + 1, held)
        elif isinstance(value, types.MethodType):
            visit(value.__self__, label, lambda: value.__self__, depth, held)
            visit(value.__func__, label, lambda: value.__func__, depth, held)
        elif isinstance(value, types.FunctionType):
            visit_function(value, depth, held)
        elif isinstance(value, (list, tuple, dict)) and len(value) > MAX_ITEMS:
            if _holds_weights(value):  # said only where no module was found (an engine object holds many tables)
                large.append(f"{label} ({len(value)} items, not looked into)")
        elif isinstance(value, (list, tuple, dict)):
            looked.add(id(value))
            for key, item in list(value.items() if isinstance(value, dict) else enumerate(value)):
                visit(item, f"{label}[{key!r}]", lambda r=read, k=key: _get(lambda: r()[k]), depth + 1, held)
        elif isinstance(value, types.ModuleType):
            unseen.extend([f"Python module {label!r}"] if _holds_weights(value) else [])
        elif _plain_object(value):
            looked.add(id(value))
            for name, item in _attributes(value):
                visit(item, f"{label}.{name}", lambda r=read, n=name: getattr(r(), n, None), depth + 1, True)

    def visit_function(fn: types.FunctionType, depth: int, held: bool) -> None:
        looked.add(id(fn))
        code = fn.__code__
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            visit(_get(lambda c=cell: c.cell_contents), name, lambda c=cell: _get(lambda: c.cell_contents), depth + 1, held)
        defaults = fn.__defaults__ or ()
        named = zip(code.co_varnames[code.co_argcount - len(defaults):code.co_argcount], defaults)
        for name, default in [*named, *(fn.__kwdefaults__ or {}).items()]:
            visit(default, name, lambda d=default: d, depth + 1, held)
        scope = fn.__globals__
        for name in code.co_names:  # the names its code looks up outside itself: module-level ones are not given to it
            value = scope.get(name)
            if name in scope and _holds_weights(value):
                unseen.append(f"module-level name {name!r} ({type(value).__name__})")
                if isinstance(value, (nn.Module, torch.Tensor)):
                    module_level.setdefault(name, lambda s=scope, n=name: s.get(n))

    visit(step, "step", lambda: step, 0)
    if not modules:
        unseen.extend(large)
    return Reached(list(modules.values()), list(tensors.items()), list(dict.fromkeys(unseen)), attributes,
                   list(module_level.items()))


def _attributes(value: Any) -> list[tuple[str, Any]]:
    """An object's attributes, its instance dict's and its slots' (an unset slot, or one that raises: None)."""
    found = _get(lambda: list(vars(value).items())) or []
    slots = [name for klass in type(value).__mro__ for name in getattr(klass, "__slots__", ())
             if isinstance(name, str) and name not in ("__dict__", "__weakref__")]
    return found + [(name, _get(lambda n=name: getattr(value, n))) for name in slots]


def _plain_object(value: Any) -> bool:
    """An engine's own object, whose attributes are looked into (a class, a library's object: not)."""
    module = getattr(type(value), "__module__", "") or ""
    return (not isinstance(value, type) and (hasattr(value, "__dict__") or hasattr(type(value), "__slots__"))
            and module.partition(".")[0] not in ("builtins", "torch", "cgregistry", "functools", "typing"))


def _get(read: Callable[[], Any]) -> Any:
    """``read()``, or None where it raises (an unset slot, an empty cell, a key gone, an engine's object raising)."""
    try:
        return read()
    except Exception:
        return None


def _wrapped(value: Any) -> Any:  # what a wrapper wraps (functools.wraps, update_wrapper), else None
    return _get(lambda: getattr(value, "__wrapped__", None))


def _holds_weights(value: Any) -> bool:
    """Whether a value the registry does not follow may hold what a graph reads: a module, a tensor, a context
    variable, a container of modules or tensors, an engine's Python module holding one."""
    if isinstance(value, types.ModuleType):
        if value.__name__.partition(".")[0] in ("torch", "cgregistry") or value.__name__ in sys.stdlib_module_names:
            return False
        return any(isinstance(v, (nn.Module, torch.Tensor)) for v in list(vars(value).values())[:4 * MAX_ITEMS])
    return isinstance(value, (nn.Module, torch.Tensor, contextvars.ContextVar)) or (
        isinstance(value, (list, tuple, dict)) and any(isinstance(v, (nn.Module, torch.Tensor))
                                                       for v in list(value.values() if isinstance(value, dict) else value)[:MAX_ITEMS]))


class WeightWatch:
    """The watched tensors, each with its baseline (its layout when watched or rebased; None: added since), and a
    generation that moves whenever one may have moved."""

    def __init__(self) -> None:
        self._watched: dict[str, tuple[_ModuleSlot | _Tensor, Layout | None]] = {}  # name -> (source, baseline)
        self._roots: list[tuple[Callable[[], Any], str]] = []  # (read the module anew, its names' prefix)
        self.generation = 0  # moves when a watched module registers something, or rebase() finds a move
        self._walked: tuple[int, tuple[int, ...]] = (-1, ())  # (generation, the roots' objects) at the last walk
        self._last_seen: Seen = {}
        self.named = False  # the engine named what its step reads (GraphRegistry(watch=...), reg.watch())
        self.module_level = False  # watch the module-level models and tensors the step's code names (debug mode)

    def watch(self, named: Iterable[tuple[str, torch.Tensor]] | nn.Module | Callable[[], Any], prefix: str = "",
              added: bool = False) -> None:
        """Watch ``(name, tensor)`` pairs, or a module's parameters and buffers by name (a callable returning it is read
        anew each time), against their addresses now; a watched module is kept, another under a taken prefix gets
        ``prefix#2.``, ...  ``added``: the step did not read it when the graphs held were captured (they are stale)."""
        if isinstance(named, nn.Module) or callable(named) and not isinstance(named, Iterable):
            read: Callable[[], Any] = (lambda m=named: m) if isinstance(named, nn.Module) else named
            module = read()
            if any(root() is module for root, _ in self._roots):
                return
            taken = sum(p.removesuffix(".").partition("#")[0] == prefix.removesuffix(".") for _, p in self._roots)
            if taken:
                prefix = f"{prefix.removesuffix('.')}#{taken + 1}."
            _install_hooks()
            self._roots.append((read, prefix))
            for name, slot in _module_slots(read, prefix):
                self._watched.setdefault(name, (slot, None if added else slot.layout({})))
            self._listen(module)
            self.generation += added
            return
        items = list(named)
        if items and all(isinstance(item, nn.Module) for item in items):  # a list of modules: each under its index
            for i, module in enumerate(items):
                self.watch(module, f"{prefix}[{i}].", added)
            return
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"watch() takes an nn.Module, a list of modules, or (name, tensor) pairs; got {item!r:.80}")
            name, tensor = item
            self._watched[f"{prefix}{name}"] = (_Tensor(lambda t=tensor: t), _layout(tensor))

    def watch_step(self, step: Callable[..., Any], added: bool = False, rebase: bool = False) -> Reached:
        """Watch what ``step`` is given (``reached``): each module under its name, each tensor read anew; ``added`` as
        for ``watch``; with ``rebase``, every baseline taken anew after (no graph holds the old ones).  What was found."""
        found = reached(step)
        module_level = found.module_level if self.module_level else []
        for name, read in [*found.modules, *((n, r) for n, r in module_level if isinstance(r(), nn.Module))]:
            self.watch(read, prefix=f"{name}.", added=added)
        for name, read in [*found.tensors, *((n, r) for n, r in module_level if isinstance(r(), torch.Tensor))]:
            if name not in self._watched:
                self._watched[name] = (_Tensor(read), None if added else _Tensor(read).layout({}))
                self.generation += added
        if rebase:
            self.rebase()
        return found

    def the_module(self, module: nn.Module | None = None) -> nn.Module:
        """``module`` where the step reads it (in a watched module), else the one module holding weights that the step
        reads (``load_weights``' target); ValueError naming those it reads otherwise."""
        found = [(prefix.removesuffix("."), m) for read, prefix in self._roots if isinstance(m := read(), nn.Module) and m.state_dict()]
        if module is not None and any(module is sub for _, m in found for sub in m.modules()):
            return module
        inner = {id(sub) for _, m in found for sub in list(m.modules())[1:]}  # a submodule: loaded through its parent
        names = [name for name, m in found if id(m) not in inner]
        if module is not None or len(names) != 1:
            why = "module=... is not a module the step reads" if module is not None else "name the one to load into, module=..."
            raise ValueError(f"{why}: the step reads {len(names)} modules {names}")
        return next(m for name, m in found if id(m) not in inner)

    def sync(self) -> None:
        """Watch, with no baseline, what was added to a watched module (or an attribute's new module) since the last
        walk; walks only when one may have changed."""
        objects = tuple(id(read()) for read, _ in self._roots)
        if self._walked == (self.generation, objects):
            return
        for read, prefix in self._roots:
            for name, slot in _module_slots(read, prefix):
                self._watched.setdefault(name, (slot, None))
            self._listen(read())
        self._walked = (self.generation, objects)

    def now(self) -> dict[str, Layout | None]:
        """Every watched tensor's layout now (None: removed), after ``sync``."""
        self.sync()
        modules: dict[tuple[int, str], tuple[Any, Any]] = {}
        return {name: source.layout(modules) for name, (source, _) in self._watched.items()}

    def seen(self) -> Seen:
        """What a graph captured now reads (the same object as long as nothing moved, so entries share it)."""
        now = self.now()
        self._last_seen = self._last_seen if now == self._last_seen else now
        return self._last_seen

    def joined(self, before: Seen) -> Seen:
        """What a graph read whose capture began at ``before``, when a watched module registered tensors meanwhile (a
        cache the step makes at its first call): ``before``'s layouts, and those of the tensors new since."""
        return {**{name: ptr for name, ptr in self.seen().items() if name not in before}, **before}

    def settle(self, seen: Seen) -> None:
        """The first graph read ``seen``: a tensor added since it was watched (a cache its warm-up made) is there
        from the start, its baseline where that graph read it."""
        self._watched.update({name: (self._watched[name][0], ptr) for name, ptr in seen.items()
                              if name in self._watched and self._watched[name][1] is None})

    def reads_current(self, seen: Seen, now: Mapping[str, Layout | None] | None = None) -> bool:
        """Whether a graph that read ``seen`` reads every watched tensor where it is ``now``."""
        return seen is now or not self.moved_for(seen, now, first_only=True)

    def moved_for(self, seen: Seen, now: Mapping[str, Layout | None] | None = None, first_only: bool = False) -> list[str]:
        """Each watched tensor a graph that read ``seen`` would read at its old address (or not at all), and why."""
        now = self.now() if now is None else now
        found = []
        for name, ptr in now.items():
            was = seen[name] if name in seen else self._watched[name][1]
            if ptr != was:
                found.append(_move(name, was, ptr))
                if first_only:
                    return found
        return found + [f"{name} was removed" for name in seen.keys() - now.keys()]

    def moved(self, now: Mapping[str, Layout | None] | None = None) -> list[str]:
        """Each watched tensor whose layout is not its baseline (where it was watched or last rebased)."""
        now = self.now() if now is None else now
        return [_move(name, base, now[name]) for name, (_, base) in self._watched.items() if now[name] != base]

    def rebase(self, now: Mapping[str, Layout | None] | None = None) -> Seen:
        """Every tensor's baseline becomes its layout ``now``; a removed one is forgotten; the generation moves if
        anything had moved, come or gone.  What a graph captured now reads."""
        now = self.now() if now is None else now
        changed = any(now[name] != base for name, (_, base) in self._watched.items())
        self._watched = {name: (source, now[name]) for name, (source, _) in self._watched.items() if now[name] is not None}
        self.generation += changed
        self._last_seen = {name: base for name, (_, base) in self._watched.items()}
        return self._last_seen

    def names(self) -> list[str]:
        """The watched tensors' names, in watch order."""
        return list(self._watched)

    def _listen(self, root: Any) -> None:
        for module in root.modules() if isinstance(root, nn.Module) else ():
            entry = _listeners.get(id(module))
            if entry is None or entry[0]() is not module:
                entry = _listeners[id(module)] = (weakref.ref(module, lambda _, key=id(module): _forget(key)), weakref.WeakSet())
            entry[1].add(self)


def _move(name: str, was: Layout | None, now: Layout | None) -> str:
    if now is None or was is None:
        return f"{name} was {'removed' if now is None else 'added'}"
    if was[0] != now[0]:
        return f"{name} moved from {was[0]:#x} to {now[0]:#x}"
    return (f"{name} changed layout at {now[0]:#x}: shape {list(was[1])} strides {list(was[2])} {was[3]} to shape "
            f"{list(now[1])} strides {list(now[2])} {now[3]}")
