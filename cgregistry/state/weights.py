"""What a step reads, and where it was: the tensors graphs read, found by following the step's code, with where they
were when each graph was captured and a generation that moves the moment a watched module registers a new one.

A graph reads the addresses it saw at capture.  An in-place update of a weight (``param.copy_``,
``load_state_dict`` without ``assign``, an adapter copied into existing slots) keeps them, so graphs
compute with the new values.  A replacement moves them (``load_state_dict(assign=True)``,
``module.weight = nn.Parameter(...)``, a replaced submodule or buffer, an adapter added): graphs would go
on reading the old, perhaps freed, memory, or miss the new tensor.  So each entry keeps what it read
(``seen()``, one object shared by the captures that read the same addresses) and the ``generation`` it
was captured in; the generation moves when a watched module registers a parameter, buffer or submodule
(torch's global registration hooks) and when ``rebase()`` finds a change, and a replay whose entry is of
an older generation compares that entry's addresses first.  A change that registers nothing
(``param.data = t``, ``torch.utils.swap_tensors``, a deleted submodule or one set to None, a global
rebound to another module) is only seen by a comparison: at ``refresh()``, and before every replay in
debug mode.

Which modules and tensors a step reads, without their being named (``reached(step)``): an engine's step is a module,
a method of an engine object, a closure or ``functools.partial`` over the model, or a function reading module-level
names.  The walk follows the code: the names each function loads (globals, attributes), its closure cells, defaults
and ``partial`` arguments, the plain functions and methods it calls (a few levels deep; through a library's wrapper,
``functools.cache`` say, to what it wraps; static, class and partial methods; ``singledispatch`` implementations),
the ``forward`` of a module class of the engine's own, what a weak reference or a ``ContextVar`` holds, the items of
containers (a set's members by identity, a dict's keys, a view's dict), an engine enum's members, and, into plain
objects and the engine's classes it reaches, the attributes its code loads by name (through a property's getter: an
enum member's value) and the code that calling, iterating or indexing them runs (so an engine's
bookkeeping tensors that the step never reads are not watched).  What it cannot look into (a
container too large, objects nested deeper) is reported as opaque, so that a step whose weights were not found can be
warned about.  Each value is reported with a callable that reads it anew, so a rebound global or cell is seen by a
later comparison.
"""

from __future__ import annotations

import collections
import contextvars
import dis
import enum
import itertools
import functools
import inspect
import io
import re
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from cgregistry.errors import WeightsMovedError
from cgregistry.state.copy_back import Move

__all__ = ["Reached", "Through", "ThroughCheck", "WeightWatch", "WeightsMovedError", "aliases_beside", "reached"]


# Where a tensor's memory is and how a kernel reads it: (address, shape, strides, dtype).  A replacement at the same
# address with another layout (a weight re-registered as its transposed view) moves it too.
Layout = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]
Seen = Mapping[str, "Layout | None"]  # a watched tensor's name to its layout when a graph was captured


class _Seen(dict):  # type: ignore[type-arg]
    """A ``Seen`` that also keeps each parameter's memory alive (``held``: an alias of it, and the parameter object
    weakly, by name) while an entry holds it (``WeightWatch.hold``): a parameter replaced since can have its new values
    copied back there."""

    __slots__ = ("held", "__weakref__")

    def __init__(self, layouts: Mapping[str, Layout | None], held: dict[str, tuple[torch.Tensor, weakref.ref[Any]]]) -> None:
        super().__init__(layouts)
        self.held = held
        _holding[id(self)] = self


_holding: weakref.WeakValueDictionary[int, _Seen] = weakref.WeakValueDictionary()  # every registry's, while held


def aliases_beside(own: Iterable[Seen]) -> list[torch.Tensor]:
    """The parameter aliases other registries' entries hold (``own``: this registry's seens): their graphs read that
    memory too."""
    mine = {id(seen) for seen in own}
    return [alias for key, seen in list(_holding.items()) if key not in mine for alias, _ in seen.held.values()]


def _layout(tensor: torch.Tensor) -> Layout:
    try:
        strides = tensor.stride()
    except RuntimeError:  # a sparse or nested tensor: its address and shape say what there is to say
        strides = ()
    return (tensor.data_ptr(), tuple(tensor.shape), strides, tensor.dtype)


class _ModuleSlot:
    """A parameter or buffer of a module, looked up from the root by its path each time: a replaced parameter, buffer
    or submodule is seen, and so is a root rebound (``root`` is called: a global or a closure cell read anew)."""

    __slots__ = ("root", "path", "table", "name")

    def __init__(self, root: Callable[[], Any], path: str, table: str, name: str) -> None:
        self.root = root
        self.path = path  # of the submodule holding it ("" for the root)
        self.table = table  # "_parameters" or "_buffers"
        self.name = name

    def layout(self, modules: dict[tuple[int, str], tuple[Any, Any]] | None = None) -> Layout | None:
        """Where the tensor is now; ``modules`` holds the submodules one read of every slot found, each looked up once
        from its root (held there with it: a root made anew at each read, freed, would give its id to the next)."""
        tensor = self.tensor(modules)
        return None if tensor is None else _layout(tensor)

    def tensor(self, modules: dict[tuple[int, str], tuple[Any, Any]] | None = None) -> torch.Tensor | None:
        """The tensor the slot holds now (None: removed); ``modules`` as for ``layout``."""
        root = self.root()
        if modules is None:
            module = _submodule(root, self.path)
        else:
            key = (id(root), self.path)
            found = modules.get(key)
            if found is None:
                found = modules[key] = (root, _submodule(root, self.path))
            module = found[1]
        if module is None:
            return None
        return getattr(module, self.table).get(self.name)


def _submodule(module: Any, path: str) -> nn.Module | None:
    """The submodule at ``path`` under ``module`` where attribute lookup finds it (``forward`` reads it so): the
    instance dict first (a submodule set past ``nn.Module.__setattr__``), then the module table ``named_modules``
    walks (None: ``module`` is no module, or the submodule was removed)."""
    for part in path.split(".") if path else ():
        if not isinstance(module, nn.Module):
            return None
        shadow = vars(module).get(part, _ABSENT)
        module = module._modules.get(part) if shadow is _ABSENT else shadow
    return module if isinstance(module, nn.Module) else None


_ABSENT = object()


class _Tensor:
    """A tensor given by ``watch((name, tensor))`` (always that tensor), or read anew (a global or a closure cell)."""

    __slots__ = ("read",)

    def __init__(self, read: Callable[[], Any]) -> None:
        self.read = read

    def layout(self, modules: dict[tuple[int, str], tuple[Any, Any]] | None = None) -> Layout | None:
        tensor = self.read()
        return _layout(tensor) if isinstance(tensor, torch.Tensor) else None


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
    """torch's registration hook (parameters, buffers, submodules of any module): tell the watches of this module.

    Not while dynamo traces: a model's forward that builds a module (``layers[:n]`` makes a ModuleList) would
    otherwise have the trace guard on which modules are watched, and trace again when another is watched."""
    if torch.compiler.is_compiling():
        return
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


class _Root:
    """A module watched whole: how to read it (anew each time: a global or a closure cell may be rebound) and its
    names' prefix."""

    __slots__ = ("read", "prefix")

    def __init__(self, read: Callable[[], Any], prefix: str) -> None:
        self.read, self.prefix = read, prefix


class WeightWatch:
    """The watched tensors (each with its baseline: its address when it was watched or last rebased, or None for one
    added to a watched module since), and a generation that moves whenever one may have moved."""

    def __init__(self) -> None:
        self._watched: dict[str, tuple[_ModuleSlot | _Tensor, Layout | None]] = {}  # name -> (source, baseline address)
        self._roots: list[_Root] = []
        self._stems: dict[str, list[_Root]] = {}  # the roots by prefix stem (``model`` for ``model.``, ``model#2.``)
        self.generation = 0  # moves when a watched module registers something, or rebase() finds a move
        self._walked: tuple[int, tuple[int, ...]] = (-1, ())  # (generation, the roots' objects) at the last walk
        self.modules_watched = False  # whether any module is watched (a step reading none is warned about)
        self.through = ThroughCheck({}, ())  # what the last walk reached through context variables
        self._last_seen: Seen = {}
        self._last_held: Callable[[], _Seen | None] = lambda: None  # with hold: the live one entries share, weakly
        # Whether what graphs read keeps the watched parameters' memory alive (GraphRegistry(in_place_refresh=True)).
        self.hold = False

    def watch(self, named: Iterable[tuple[str, torch.Tensor]] | nn.Module | Callable[[], Any], prefix: str = "",
              added: bool = False) -> None:
        """Watch ``(name, tensor)`` pairs, or every parameter and buffer of a module (by name, so replacing one is seen;
        a callable returning the module is read anew at each comparison).  Each is compared with its address now; a
        module already watched under ``prefix`` is left as it is, and another module under a taken prefix gets
        ``prefix#2.``, ``#3.``, ...  ``added``: the step reads it now but did not when the graphs held were captured
        (an adapter put in a dict the step reads): its tensors have no baseline, so those graphs are stale."""
        if isinstance(named, nn.Module) or callable(named) and not isinstance(named, Iterable):
            read: Callable[[], Any] = (lambda m=named: m) if isinstance(named, nn.Module) else named
            module = read()
            taken = self._stems.setdefault(_stem(prefix), [])
            if any(root.read() is module for root in taken):
                return
            if taken:
                prefix = f"{_stem(prefix)}#{len(taken) + 1}."
            _install_hooks()
            root = _Root(read, prefix)
            self._roots.append(root)
            taken.append(root)
            self.modules_watched = self.modules_watched or isinstance(module, nn.Module)
            for name, slot in _module_slots(read, prefix):
                self._watched.setdefault(name, (slot, None if added else slot.layout()))
            self._listen(module)
            if added:
                self.generation += 1
            return
        items = list(named)
        if items and all(isinstance(item, nn.Module) for item in items):  # a list of modules: each under its index
            for i, module in enumerate(items):
                self.watch(module, f"{prefix}[{i}].", added)
            return
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise TypeError(
                    "watch() takes an nn.Module, a list of modules, or (name, tensor) pairs; got an item "
                    f"{type(item).__name__}{f' {item!r}' if not isinstance(item, (nn.Module, torch.Tensor)) else ''}"
                )
            name, tensor = item
            self._watched[f"{prefix}{name}"] = (_Tensor(lambda t=tensor: t), _layout(tensor))

    def watch_read(self, name: str, read: Callable[[], Any], added: bool = False) -> None:
        """Watch the tensor ``read()`` returns (a global or a closure cell, read anew at each comparison); ``added`` as
        for ``watch``."""
        if name not in self._watched:
            source = _Tensor(read)
            self._watched[name] = (source, None if added else source.layout())
            if added:
                self.generation += 1

    def watch_step(self, step: Callable[..., Any], added: bool = False, rebase: bool = False) -> list[str]:
        """Watch what ``step`` reaches (``reached``): each module under its name, each tensor read anew; ``added`` as for
        ``watch``; with ``rebase``, every baseline taken anew after (no graph holds the old ones).  What the step reads
        without its contents being looked into."""
        found = reached(step)
        self.through = found.through
        for name, read in found.modules:
            self.watch(read, prefix=f"{name}.", added=added)
        for name, read in found.tensors:
            self.watch_read(name, read, added=added)
        if rebase:
            self.rebase()
        return found.opaque

    def forget_through(self) -> None:
        """Drop what the last walk reached through context variables (after ``clear()``: it held the old models)."""
        self.through = ThroughCheck({}, ())

    def changed(self, what: str) -> None:
        """A watched module registered a parameter, buffer or submodule (called by torch's hooks)."""
        self.generation += 1

    def sync(self) -> None:
        """Watch what was added to a watched module (or comes with a module a global now names) since the last walk,
        each with no baseline (no graph captured before read it); walks the modules only when one may have changed."""
        objects = tuple(id(root.read()) for root in self._roots)
        if self._walked == (self.generation, objects):
            return
        for root in self._roots:
            for name, slot in _module_slots(root.read, root.prefix):
                if name not in self._watched:
                    self._watched[name] = (slot, None)
            self._listen(root.read())
        self._walked = (self.generation, objects)

    def now(self) -> dict[str, Layout | None]:
        """Every watched tensor's address now (None: removed), after ``sync``."""
        self.sync()
        modules: dict[tuple[int, str], tuple[Any, Any]] = {}  # each submodule looked up once, with its root
        return {name: source.layout(modules) for name, (source, _) in self._watched.items()}

    def seen(self) -> Seen:
        """What a graph captured now reads (the same object as long as nothing moved, so entries share it)."""
        now = self.now()
        return self._shared(now)

    def _shared(self, layouts: dict[str, Layout | None]) -> Seen:
        """``layouts`` as what graphs read: one object while nothing moves, so entries share it.  With ``hold``, one
        that keeps the parameters' memory alive, referenced here only weakly: once no entry holds it (``clear()``,
        ``sleep()``), a parameter replaced after is freed as it would be without the registry."""
        if layouts != self._last_seen:
            self._last_seen = layouts
        if not self.hold:
            return self._last_seen
        shared = self._last_held()
        if shared is None or shared != layouts:
            shared = self._remember(layouts)
            self._last_held = weakref.ref(shared)
        return shared

    def joined(self, before: Seen) -> Seen:
        """What a graph read whose capture began at ``before``, when a watched module registered tensors meanwhile (a
        cache the step makes at its first call): ``before``'s addresses, and those of the tensors new since.  A tensor
        ``before`` holds that moved meanwhile keeps its old address, so that graph stays stale (the safe side)."""
        now = self.seen()
        layouts = {**{name: ptr for name, ptr in now.items() if name not in before}, **before}
        if not self.hold:
            return layouts
        held = {name: t for name, t in getattr(now, "held", {}).items() if name not in before}
        return _Seen(layouts, {**held, **getattr(before, "held", {})})

    def _remember(self, layouts: dict[str, Layout | None]) -> _Seen:
        """``layouts`` with an alias of each watched parameter found where they say."""
        modules: dict[tuple[int, str], tuple[Any, Any]] = {}
        held: dict[str, tuple[torch.Tensor, weakref.ref[Any]]] = {}
        for name, (source, _) in self._watched.items():
            if isinstance(source, _ModuleSlot) and source.table == "_parameters" and layouts.get(name) is not None:
                tensor = source.tensor(modules)
                if type(tensor) in (nn.Parameter, torch.Tensor) and _layout(tensor) == layouts[name]:
                    held[name] = (tensor.detach(), weakref.ref(tensor))
        return _Seen(layouts, held)

    def moves(self, now: Mapping[str, Layout | None], seens: Iterable[Seen]) -> tuple[list[Move], dict[str, torch.Tensor],
                                                                                list[torch.Tensor], list[str]]:
        """The watched parameters that moved from their baseline while what graphs read (``seens``, entries' ``weights``)
        still holds the memory there; every other watched tensor now (what they may share memory with); every alias
        the seens hold; and why each other moved parameter cannot be copied back."""
        held: dict[str, tuple[torch.Tensor, weakref.ref[Any]]] = {}
        aliases: dict[int, torch.Tensor] = {}
        for seen in {id(seen): seen for seen in seens}.values():
            for name, (alias, was) in getattr(seen, "held", {}).items():
                aliases[id(alias)] = alias
                if name not in held and name in self._watched and _layout(alias) == self._watched[name][1]:
                    held[name] = (alias, was)
        modules: dict[tuple[int, str], tuple[Any, Any]] = {}
        moves, others, unheld = [], {}, []
        for name, (source, base) in self._watched.items():
            tensor = source.tensor(modules) if isinstance(source, _ModuleSlot) else source.read()
            if not isinstance(tensor, torch.Tensor):
                continue
            parameter = isinstance(source, _ModuleSlot) and source.table == "_parameters"
            if now[name] != base and parameter and name in held and now[name] is not None:
                owner = modules[(id(source.root()), source.path)][1]
                alias, was = held[name]
                moves.append(Move(name, alias, tensor, owner, was()))
                continue
            if now[name] != base and parameter and base is not None:
                unheld.append(f"{name}: no graph holds the memory it was captured at, to copy into (it was captured "
                              "before it was watched, or as a tensor subclass, or its layout changed in place)")
            others[name] = tensor
        return moves, others, list(aliases.values()), unheld

    @staticmethod
    def announce(moves: Iterable[Move]) -> None:
        """Tell every watch of the modules holding ``moves`` (another registry's too) that their tensors were pointed
        at other memory (``param.data`` registers nothing): its graphs captured since compare addresses first."""
        for move in moves:
            if isinstance(move.owner, nn.Module):
                _registered(move.owner, move.name.rpartition(".")[2], move.new)

    def reads_current(self, seen: Seen, now: Mapping[str, Layout | None] | None = None) -> bool:
        """Whether a graph that read ``seen`` reads every watched tensor where it is ``now``: a tensor watched after its
        capture counts where it was when it was watched, one added to a watched module since makes it stale."""
        if now is None:
            now = self.now()
        if seen is now:
            return True
        return not self._moved_for(seen, now, first_only=True)

    def moved_for(self, seen: Seen) -> list[str]:
        """Each watched tensor a graph that read ``seen`` would read at its old address (or not at all), and why."""
        return self._moved_for(seen, self.now(), first_only=False)

    def _moved_for(self, seen: Seen, now: Mapping[str, Layout | None], first_only: bool) -> list[str]:
        found = []
        watched = self._watched
        for name, ptr in now.items():
            was = seen[name] if name in seen else watched[name][1]
            if ptr != was:
                found.append(_move(name, was, ptr))
                if first_only:
                    return found
        for name in seen.keys() - now.keys():  # forgotten since (removed, and rebased away): never current
            found.append(f"{name} was removed")
        return found

    def moved(self, now: Mapping[str, Layout | None] | None = None) -> list[str]:
        """Each watched tensor whose address is not its baseline (where it was watched or last rebased)."""
        if now is None:
            now = self.now()
        return [_move(name, base, now[name]) for name, (_, base) in self._watched.items() if now[name] != base]

    def rebase(self, now: Mapping[str, Layout | None] | None = None) -> Seen:
        """Every tensor's baseline becomes its layout ``now`` (read once, by the caller or here); a removed one is
        forgotten; the generation moves if anything had moved, come or gone.  What a graph captured now reads."""
        if now is None:
            now = self.now()
        changed = False
        watched: dict[str, tuple[_ModuleSlot | _Tensor, Layout | None]] = {}
        for name, (source, base) in self._watched.items():
            ptr = now[name]
            changed = changed or ptr != base
            if ptr is not None:
                watched[name] = (source, ptr)
        self._watched = watched
        if changed:
            self.generation += 1
        current = {name: base for name, (_, base) in watched.items()}
        return self._shared(current)

    def names(self) -> list[str]:
        """The watched tensors' names, in watch order."""
        return list(self._watched)

    def __len__(self) -> int:
        return len(self._watched)

    def _listen(self, root: Any) -> None:
        if isinstance(root, nn.Module):
            for module in root.modules():
                _listeners.setdefault(module, weakref.WeakSet()).add(self)


def _stem(prefix: str) -> str:
    """A prefix without its trailing dot and its ``#n`` (``model#2.`` -> ``model``)."""
    return prefix.removesuffix(".").partition("#")[0]


def _move(name: str, was: Layout | None, now: Layout | None) -> str:
    if now is None:
        return f"{name} was removed"
    if was is None:
        return f"{name} was added"
    if was[0] != now[0]:
        return f"{name} moved from {was[0]:#x} to {now[0]:#x}"
    return (f"{name} changed layout at {now[0]:#x}: shape {list(was[1])} strides {list(was[2])} {was[3]} to shape "
            f"{list(now[1])} strides {list(now[2])} {now[3]}")


MAX_DEPTH = 7  # functions and objects followed from the step (an engine's model may be five attributes down)
MAX_ITEMS = 256  # a larger container is not looked into (reported as opaque)
MAX_VALUES = 4096  # values looked at in all; past that, what is left is opaque
# Packages whose code and objects hold no engine weights: not followed.
LIBRARIES = frozenset({"cgregistry", "torch", "functools", "typing", "builtins", "transformers", "numpy", "attrs"})
# Objects of these exact types hold no tensor (no attributes and no items of an engine's): locks, compiled patterns and
# the io module's own streams, which a step's logger reaches: neither looked into nor reported as opaque.
_HOLD_NOTHING = (type(threading.Lock()), type(threading.RLock()), re.Pattern, io.TextIOWrapper, io.BufferedWriter,
                 io.BufferedReader, io.FileIO, io.StringIO, io.BytesIO)
_CONTAINERS = (Mapping, list, tuple, collections.deque, collections.UserList)  # looked into item by item
_VIEWS = (collections.abc.KeysView, collections.abc.ValuesView, collections.abc.ItemsView)  # a dict's: looked into as it
_SETS = (collections.abc.Set,)  # looked into member by member (a member read anew while it is still one)
# The methods of an engine's object that the step runs without loading them by name: calling it, iterating it,
# indexing it; their code is followed as the step's own.
_IMPLICIT = ("__call__", "__iter__", "__next__", "__getitem__")
_ENUM_OWN = frozenset({"_value_", "_name_", "__objclass__", "_sort_order_"})  # what every enum member has
MAX_INERT_ITEMS = 4096  # a container larger than MAX_ITEMS is looked over this far for anything but inert values
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
# Values that hold no tensor a graph reads.
_INERT = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device,
          types.BuiltinFunctionType, types.BuiltinMethodType, types.CodeType)


@attrs.frozen
class Reached:
    """What a step reads: modules and tensors, each as (name, a callable that reads it anew), and the names of values
    it reads that were not looked into."""

    modules: list[tuple[str, Callable[[], Any]]]
    tensors: list[tuple[str, Callable[[], Any]]]
    opaque: list[str]
    # What it reached through a context variable: a replay in a context where one of these reads otherwise would
    # compute with what capture() saw (``ServingState.differences``).
    through: ThroughCheck = attrs.field(factory=lambda: ThroughCheck({}, ()))


@attrs.frozen(eq=False)
class Through:
    """A module or tensor the step reaches through a context variable: its name, how to read it anew in the calling
    context, and what it was where the walk ran (the module itself; a tensor's layout, so a new view of the same
    memory is the same)."""

    name: str
    var: contextvars.ContextVar[Any]
    read: Callable[[], Any]
    seen: Any

    def now(self) -> Any:
        """What the calling context reaches there (None where it reaches nothing)."""
        try:
            found = self.read()
        except Exception:  # an engine's object raising on the way: it reaches nothing we can compare
            return None
        return _layout(found) if isinstance(found, torch.Tensor) else found

    def differs(self) -> bool:
        try:
            return not _same(self.now(), self.seen)
        except Exception:  # an engine's object raising on the way: not what capture() saw
            return True


def _what(value: object) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, tuple):  # a tensor's layout
        return f"a tensor at {value[0]:#x}, shape {tuple(value[1])}"
    return f"{type(value).__name__} at {id(value):#x}"


class ThroughCheck:
    """The replay's test of what the step reaches through context variables: per variable, what it held where the
    walk ran (the context capture() recorded) and what was reached through it.  A variable holding that same object
    passes at the cost of one read; one holding another is compared item by item (a forward context made anew each
    step over the same model passes); one that held nothing then and holds something now, or the reverse, fails
    (a number or a string, a request id say, excepted: no model comes through it)."""

    def __init__(self, origins: Mapping[contextvars.ContextVar[Any], Any], items: Iterable[Through]) -> None:
        groups: dict[int, tuple[contextvars.ContextVar[Any], Any, list[Through]]] = {
            id(var): (var, origin, []) for var, origin in origins.items()}
        for item in items:
            groups[id(item.var)][2].append(item)
        self.groups = tuple((var, origin, tuple(found)) for var, origin, found in groups.values())

    def __bool__(self) -> bool:
        return bool(self.groups)

    def passes(self) -> bool:
        for var, origin, items in self.groups:
            now = _context_value(var)
            if now is origin:
                continue
            if origin is None or now is None:
                if not isinstance(now if origin is None else origin, _INERT):
                    return False
            elif any(item.differs() for item in items):
                return False
        return True

    def differences(self, bound_only: bool = False) -> list[str]:
        """What the calling context reaches otherwise, named (``bound_only``: not counting a variable it leaves
        unset, as a thread that binds none of them)."""
        found = []
        for var, origin, items in self.groups:
            now = _context_value(var)
            if now is origin or (bound_only and now is None):
                continue
            if origin is None or now is None:
                if not isinstance(now if origin is None else origin, _INERT):  # (a request id: nothing a graph reads)
                    found.append(f"ContextVar {var.name!r} holds {_what(now)} now, {_what(origin)} at capture")
                continue
            for item in items:
                if item.differs():
                    found.append(f"{item.name} (read through ContextVar {var.name!r}) is {_what(item.now())} now, "
                                 f"{_what(item.seen)} at capture")
        return found


def _same(now: Any, seen: Any, depth: int = 0) -> bool:
    """Whether what a context now reaches is what capture() reached, for what a graph reads: the same object; a
    tensor's layout; a bound method of the same object and function; a partial or a closure of the same function
    over the same values (one made anew each step over the same model is the same)."""
    if now is seen:
        return True
    if isinstance(now, torch.Tensor) and isinstance(seen, torch.Tensor):  # held by a closure or a partial
        return _layout(now) == _layout(seen)
    if depth > 3 or type(now) is not type(seen):
        return False
    if isinstance(now, _INERT):  # a number or a string made anew
        return bool(now == seen)
    if isinstance(now, tuple):  # a tensor's layout
        return now == seen
    if isinstance(now, types.MethodType):
        return now.__self__ is seen.__self__ and now.__func__ is seen.__func__
    if isinstance(now, functools.partial):
        return (_same(now.func, seen.func, depth + 1) and len(now.args) == len(seen.args)
                and all(_same(a, b, depth + 1) for a, b in zip(now.args, seen.args))
                and now.keywords.keys() == seen.keywords.keys()
                and all(_same(now.keywords[k], seen.keywords[k], depth + 1) for k in now.keywords))
    if isinstance(now, types.FunctionType):
        cells, were = now.__closure__ or (), seen.__closure__ or ()
        defaults, had = now.__defaults__ or (), seen.__defaults__ or ()
        keywords, kept = now.__kwdefaults__ or {}, seen.__kwdefaults__ or {}
        return (now.__code__ is seen.__code__ and len(defaults) == len(had) and len(cells) == len(were)
                and all(_same(a, b, depth + 1) for a, b in zip(defaults, had))
                and keywords.keys() == kept.keys() and all(_same(keywords[k], kept[k], depth + 1) for k in keywords)
                and all(_same(_cell(a), _cell(b), depth + 1) for a, b in zip(cells, were)))
    return False


def reached(step: Callable[..., Any]) -> Reached:
    """The modules and tensors ``step`` reads (see the module's docstring); the step itself, or a bound method's
    object, is named ``step``, anything else by the name the code reads it under."""
    return _Walk().run(step)


class _Walk:
    def __init__(self) -> None:
        self.modules: dict[tuple[str, int], Callable[[], Any]] = {}  # (name, module) -> how to read it anew
        self.module_ids: set[int] = set()
        self.tensors: dict[str, Callable[[], Any]] = {}
        self.opaque: list[str] = []
        self.loads: set[str] = set()  # the attribute names the code followed loads
        self.objects: list[tuple[Any, str, Callable[[], Any], int]] = []  # looked into once the code is followed
        self.code: set[int] = set()  # functions followed
        self.taken: set[tuple[int, str]] = set()  # (object, attribute) pairs already followed
        self.values = 0  # values looked at so far (MAX_VALUES)
        self.via: list[contextvars.ContextVar[Any]] = []  # the context variables the value looked at now came through
        self.through: dict[tuple[str, int, int], Through] = {}
        self.origins: dict[contextvars.ContextVar[Any], Any] = {}  # each variable followed, and what it held

    def run(self, step: Callable[..., Any]) -> Reached:
        self.value(step, "step", lambda: step, -1)
        while True:  # objects are looked into by the names the code loads; following them may load more
            before, count = len(self.loads), len(self.taken)
            for obj, label, read, depth, via in list(self.objects):
                self.via = list(via)
                self.look_into(obj, label, read, depth)
            self.via = []
            if (len(self.loads), len(self.taken)) == (before, count):
                break
        modules = [(name, read) for (name, _), read in self.modules.items()]
        return Reached(modules, list(self.tensors.items()), list(dict.fromkeys(self.opaque)),
                       ThroughCheck(self.origins, self.through.values()))

    def reached_through(self, found: Any, label: str, read: Callable[[], Any]) -> None:
        """A module or tensor found while following a context variable's value: kept to compare at each replay."""
        if not self.via:
            return
        key = (label, id(self.via[-1]), id(found))  # two closures may each read their own ``var``
        if key not in self.through:
            self.through[key] = Through(label, self.via[-1], read, _layout(found) if isinstance(found, torch.Tensor) else found)

    def _path(self, name: str) -> str:
        """``name`` as a key of ``taken``: an object reached outside a context variable and through one is looked into
        on each path (what it holds is then compared at replay on the second)."""
        return f"{name}@{','.join(str(id(var)) for var in self.via)}" if self.via else name

    def add_object(self, found: Any, label: str, read: Callable[[], Any], depth: int) -> None:
        self.objects.append((found, label, read, depth, tuple(self.via)))

    def value(self, found: Any, label: str, read: Callable[[], Any], depth: int) -> None:
        """Look at one value the code reaches; one that cannot be looked at (a proxy that raises, say) is opaque."""
        try:
            self._value(found, label, read, depth)
        except Exception:  # an engine's object may raise from anything we ask of it: say so, never fail the registry
            self.opaque.append(label)

    def _value(self, found: Any, label: str, read: Callable[[], Any], depth: int) -> None:
        if isinstance(found, _INERT) or type(found) in _HOLD_NOTHING:
            return
        self.values += 1
        if depth > MAX_DEPTH or self.values > MAX_VALUES:
            if not isinstance(found, (types.FunctionType, types.MethodType, types.ModuleType)):
                self.opaque.append(label)  # too deep or too many to look into: the engine can watch() it
            return
        if isinstance(found, nn.Module):
            self.reached_through(found, label, read)
            if (label, id(found)) not in self.modules:  # two closures may each call their own model ``m``
                self.modules[(label, id(found))] = read
                if id(found) not in self.module_ids:
                    self.module_ids.add(id(found))
                    forward = getattr(type(found), "forward", None)
                    if isinstance(forward, types.FunctionType) and _package(forward.__module__) not in LIBRARIES:
                        self.function(forward, depth + 1, label)  # a module class of the engine's own: its code too,
                        self.add_object(found, label, read, depth)  # and what it holds outside its tables
        elif isinstance(found, torch.Tensor):
            self.reached_through(found, label, read)
            self.tensors.setdefault(label, read)
        elif isinstance(found, functools.partial):
            self.reached_through(found, label, read)  # (a partial of another model is another partial)
            self.value(found.func, label, lambda: found.func, depth)
            for i, arg in enumerate(found.args):
                self.value(arg, f"{label}.args[{i}]", lambda a=arg: a, depth + 1)
            for key, arg in found.keywords.items():
                self.value(arg, f"{label}.{key}", lambda a=arg: a, depth + 1)
        elif isinstance(found, types.MethodType):
            self.reached_through(found, label, read)
            owner = found.__self__
            self.value(owner, label, lambda: owner, depth)
            self.function(found.__func__, depth + 1, label)
        elif isinstance(found, types.FunctionType):
            self.reached_through(found, label, read)
            self.function(found, depth + 1, label)
        elif isinstance(found, _VIEWS) and _standard(found) and isinstance(_mapping_of(found), Mapping):
            self.value(_mapping_of(found), f"{label}.mapping", lambda: _mapping_of(read()), depth)  # its dict, by key
        elif isinstance(found, _CONTAINERS) or _iterated_set(found):
            if not _standard(found):  # an engine's subclass: the code it runs when iterated or indexed too
                self.implicit(found, label, depth)
            self.add_object(found, label, read, depth)
        elif isinstance(found, weakref.ref) and _standard(found):  # what it refers to (a WeakMethod: the bound method)
            self.value(found(), label, lambda: _referent(read()), depth)
        elif isinstance(found, contextvars.ContextVar):  # its value in this context (the thread that walks: capture's)
            held = _context_value(found)
            self.origins.setdefault(found, held)
            self.via.append(found)
            try:
                self.value(held, f"{label}.get()", lambda: _context_value(read()), depth)
            finally:
                self.via.pop()
        elif isinstance(found, (types.GeneratorType, collections.abc.Iterator)) and _standard(found):
            self.opaque.append(label)  # what it yields is not looked into (that would consume it)
        elif isinstance(found, (types.ModuleType, type)):  # a module, or a class: the engine's own hold what it set
            if _package(getattr(found, "__module__" if isinstance(found, type) else "__name__", None)) not in (
                    LIBRARIES | sys.stdlib_module_names):
                self.add_object(found, label, read, depth)
        elif _package(getattr(type(found), "__module__", None)) in LIBRARIES:
            wrapped = getattr(found, "__wrapped__", None)  # a library's wrapper (functools.cache): what it wraps
            if wrapped is not None:
                self.value(wrapped, label, lambda: wrapped, depth)
        else:
            self.implicit(found, label, depth)
            self.add_object(found, label, read, depth)

    def implicit(self, found: Any, label: str, depth: int) -> None:
        """Follow the code calling, iterating or indexing an engine's object runs (``_IMPLICIT``)."""
        for method in _IMPLICIT:
            code = getattr(type(found), method, None)
            if isinstance(code, types.FunctionType):
                self.function(code, depth + 1, label)

    def function(self, fn: types.FunctionType, depth: int, label: str) -> None:
        wrapped = getattr(fn, "__wrapped__", None)  # functools.wraps: what a decorator (eager_break) wraps
        if wrapped is not None:
            self.value(wrapped, label, lambda: wrapped, depth - 1)
        registry = getattr(fn, "registry", None)  # functools.singledispatch: every function registered for a type
        if isinstance(registry, Mapping) and hasattr(fn, "dispatch"):
            for impl in list(registry.values()):
                if isinstance(impl, types.FunctionType) and impl is not wrapped:
                    self.function(impl, depth, label)
        code = fn.__code__
        if depth > MAX_DEPTH or id(fn) in self.code or _package(fn.__globals__.get("__name__")) in LIBRARIES:
            return
        self.code.add(id(fn))  # by function, not code: closures of one code object hold different cells
        names, attributes = _loads(code, _GLOBAL_LOADS), _loads(code, _ATTRIBUTE_LOADS)
        self.loads |= attributes
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                found = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.value(found, name, lambda c=cell: _cell(c), depth)
        for i, default in enumerate(fn.__defaults__ or ()):
            self.value(default, f"{code.co_varnames[code.co_argcount - len(fn.__defaults__) + i]}", lambda d=default: d, depth)
        for key, default in (fn.__kwdefaults__ or {}).items():
            self.value(default, key, lambda d=default: d, depth)
        scope = fn.__globals__
        for name in names:
            if name in scope:
                self.value(scope[name], name, lambda s=scope, n=name: s.get(n), depth)

    def look_into(self, obj: Any, label: str, read: Callable[[], Any], depth: int) -> None:
        """A container's items, or the attributes of an object that the code loads; one that raises is opaque."""
        try:
            self._look_into(obj, label, read, depth)
        except Exception:
            self.opaque.append(label)

    def _look_into(self, obj: Any, label: str, read: Callable[[], Any], depth: int) -> None:
        members = _iterated_set(obj)
        if isinstance(obj, _CONTAINERS) or members:
            if (id(obj), self._path("")) in self.taken:
                return
            self.taken.add((id(obj), self._path("")))
            base = _set_type(obj)
            size = len(obj) if base is None else base.__len__(obj)
            if size > MAX_ITEMS:
                if size > MAX_INERT_ITEMS or not all(isinstance(v, _INERT) for v in _values_and_keys(obj)):
                    self.opaque.append(label)  # (ids, names, a vocabulary's strings: nothing a graph reads)
                return
            if isinstance(obj, Mapping):
                items = []
                for k, v in list(obj.items()):
                    name, item_read = _keyed_read(read, k)
                    items.append((f"{label}[{name}]", v, item_read))
                    if not isinstance(k, _INERT):  # a model as a key
                        items.append((f"{label}.keys{{{name}}}", k, _member_read(read, k)))
            elif members:  # each under its identity: a set's order is no name
                items = [(f"{label}{{{_tag(v)}}}", v, _member_read(read, v)) for v in _members(obj)]
            else:
                items = [(f"{label}[{i}]", v, lambda r=read, i=i: _item(r(), i)) for i, v in enumerate(obj)]
            for name, item, item_read in items:
                self.value(item, name, item_read, depth + 1)
            if _standard(obj):
                return
            # an engine's subclass of a container: what it holds besides its items, below
        if isinstance(obj, enum.EnumMeta) and (id(obj), "members") not in self.taken:  # an engine's enum: its members
            self.taken.add((id(obj), "members"))
            members = dict(obj.__members__)
            if len(members) <= MAX_ITEMS:
                for name, member in members.items():
                    self.value(member, f"{label}.{name}", lambda r=read, n=name: _enum_member(r(), n), depth + 1)
            elif not all(isinstance(getattr(m, "_value_", None), _INERT) and not set(vars(m)) - _ENUM_OWN
                         for m in members.values()):  # (a large enum of codes and flags holds nothing)
                self.opaque.append(label)
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, Mapping):
            attributes = {}
        slots = {n for klass in type(obj).__mro__ for n in getattr(klass, "__slots__", ()) if isinstance(n, str)}
        followed = False
        for name in [n for n in self.loads if (id(obj), self._path(n)) not in self.taken]:
            if name in attributes or name in slots:
                self.taken.add((id(obj), self._path(name)))
                found = attributes[name] if name in attributes else getattr(obj, name, None)
                self.value(found, f"{label}.{name}", lambda r=read, n=name: getattr(r(), n, None), depth + 1)
                followed = True
            elif not isinstance(obj, types.ModuleType):
                member = inspect.getattr_static(type(obj), name, None)
                if isinstance(member, (property, types.DynamicClassAttribute)) and isinstance(member.fget, types.FunctionType):
                    member = member.fget  # a property the code reads (an enum member's value): its getter's code, and what that loads
                elif isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, functools.partialmethod):  # its function, and the arguments it was given
                    for i, arg in enumerate(member.args):
                        self.value(arg, f"{label}.{name}.args[{i}]", lambda a=arg: a, depth + 1)
                    member = member.func
                if isinstance(member, types.FunctionType):  # a method the code calls: its code too
                    self.taken.add((id(obj), self._path(name)))
                    self.function(member, depth + 1, label)
                    followed = True
                elif member is not None and not hasattr(type(member), "__get__"):  # its class's attribute, read through it
                    self.taken.add((id(obj), self._path(name)))
                    self.value(member, f"{label}.{name}", lambda r=read, n=name: getattr(r(), n, None), depth + 1)
                    followed = True
        if not attributes and not slots and not followed:
            self.opaque.append(label)


def _package(name: object) -> str:
    """The top-level package of a module name (anything else: the empty name)."""
    return name.partition(".")[0] if isinstance(name, str) else ""


def _loads(code: types.CodeType, ops: frozenset[str]) -> frozenset[str]:
    """The names ``code`` and the code nested in it load with ``ops`` (globals, or attributes; stores are bookkeeping,
    not reads); a code object's instructions never change, so each is read once (a code object that cannot be
    hashed, holding a list constant, say, is read each time)."""
    try:
        return _cached_loads(code, ops)
    except TypeError:
        return _read_loads(code, ops)


def _read_loads(code: types.CodeType, ops: frozenset[str]) -> frozenset[str]:
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ops and isinstance(i.argval, str)}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _loads(const, ops)
    return frozenset(names)


_cached_loads = functools.lru_cache(maxsize=4096)(_read_loads)


def _item(container: Any, key: Any) -> Any:
    """``container[key]``, or None where it holds none; a dict's own lookup for a dict (a ``defaultdict`` is never
    made to insert the key), and nothing an engine's container raises escapes."""
    try:
        return dict.get(container, key) if isinstance(container, dict) else container[key]
    except Exception:
        return None


def _keyed_read(read: Callable[[], Any], key: Any) -> tuple[str, Callable[[], Any]]:
    """A mapping key's name in labels, and what reads its item anew from the mapping ``read()`` returns: a key equal
    only to itself (a module) by its identity, held weakly (None once it died); any other (a string, a tuple, a frozen
    dataclass) by its value, its repr, held, so that an equal key made anew names and finds the same item."""
    if type(key).__eq__ is object.__eq__ and type(key).__hash__ is object.__hash__:
        try:
            ref = weakref.ref(key)
        except TypeError:
            pass
        else:
            return _tag(key), lambda: None if (alive := ref()) is None else _item(read(), alive)
    return repr(key), lambda: _item(read(), key)


def _iterated_set(obj: Any) -> bool:
    """Whether ``obj`` is a set looked into member by member: a set or frozenset (an engine's subclass too, read from
    the set itself, never through its own methods), or another set of Python's own; an engine's own Set class is
    followed through its code instead (``_IMPLICIT``)."""
    return isinstance(obj, (set, frozenset)) or (isinstance(obj, _SETS) and _standard(obj))


def _set_type(obj: Any) -> type | None:
    """``set`` or ``frozenset`` for one of them (a subclass too), whose own methods read it without an engine's code."""
    return set if isinstance(obj, set) else frozenset if isinstance(obj, frozenset) else None


def _members(obj: Any) -> list[Any]:
    """A set's members, without running an engine's code: a set's (or frozenset's) own iteration for its subclasses."""
    base = _set_type(obj)
    return list(obj) if base is None else list(base.__iter__(obj))


def _contains(collection: Any, item: Any) -> bool:
    """``item in collection``, by a set's own test for its subclasses (an engine's ``__contains__`` is not run)."""
    base = _set_type(collection)
    if base is not None:
        return base.__contains__(collection, item)
    if isinstance(collection, dict):
        return dict.__contains__(collection, item)
    return item in collection if isinstance(collection, Mapping) or (isinstance(collection, _SETS) and _standard(collection)) else False


def _standard(obj: Any) -> bool:
    """Whether ``obj``'s type is Python's own or a library's (looked into by what it is, never by running its code)."""
    return _package(getattr(type(obj), "__module__", None)) in LIBRARIES | sys.stdlib_module_names


def _mapping_of(view: Any) -> Any:
    """The mapping a dict's view (or a ``collections.abc`` view over a mapping) shows, else None."""
    found = getattr(view, "mapping", None)
    return found if found is not None else getattr(view, "_mapping", None)


def _values_and_keys(container: Any) -> Iterable[Any]:
    """A container's items (a mapping's values and keys; a set's members read as ``_members`` reads them)."""
    if isinstance(container, Mapping):
        return itertools.chain(container.values(), container.keys())
    return _members(container) if _iterated_set(container) else container


def _tag(value: Any) -> str:
    """A member's name in a set (or a mapping's keys): its type and identity, the same wherever it is iterated."""
    return f"{type(value).__name__}@{id(value):#x}"


def _weak(item: Any) -> Callable[[], Any]:
    """What reads ``item`` without keeping it alive where it can be weakly referenced (an int, a string: held)."""
    try:
        return weakref.ref(item)
    except TypeError:
        return lambda: item


def _member_read(read: Callable[[], Any], value: Any) -> Callable[[], Any]:
    """What reads ``value`` anew while it is still a member of the set (or a key of the mapping) ``read()`` returns,
    else None; held weakly, so a member the engine drops is freed (a tuple, a named one too: its items weakly, and
    asked for as a plain tuple, which hashes and compares as it does; a tuple class of its own hashing is held)."""
    if isinstance(value, tuple) and type(value).__hash__ is tuple.__hash__ and type(value).__eq__ is tuple.__eq__:
        parts = [_weak(item) for item in value]

        def target() -> Any:
            items = tuple(part() for part in parts)
            return None if any(i is None for i in items) else items
    else:
        target = _weak(value)

    def member() -> Any:
        found, collection = target(), read()
        try:
            return found if found is not None and _contains(collection, found) else None  # by hash
        except Exception:  # not there in a form we can ask: nothing to read
            return None
    return member


def _context_value(var: Any) -> Any:
    """What ``var`` holds in the calling context, its default included (None: unset, or no context variable)."""
    if not isinstance(var, contextvars.ContextVar):
        return None
    try:
        return var.get()
    except LookupError:
        return None


def _enum_member(cls: Any, name: str) -> Any:
    members = getattr(cls, "__members__", None)
    return members.get(name) if isinstance(members, Mapping) else None


def _referent(ref: Any) -> Any:
    """What a weak reference refers to (None once it died, or for what is no weak reference now)."""
    return ref() if isinstance(ref, weakref.ref) else None


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return None
