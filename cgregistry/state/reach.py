"""What a step reads: the modules and tensors its graphs will hold the addresses of, found without being named.

An engine's step is a module, a method of an engine object, a closure or ``functools.partial`` over
the model, or a function reading module-level names.  ``reached(step)`` follows the code: the names
each function loads (globals, attributes), its closure cells, defaults and ``partial`` arguments, the
plain functions and methods it calls (a few levels deep), the ``forward`` of a module class of the
engine's own, and, into containers and plain objects it reaches, the attributes its code loads by
name (so an engine's bookkeeping tensors that the step never reads are not watched).  What it cannot
look into (a container too large, objects nested deeper) is reported as opaque, so that a step whose
weights were not found can be warned about.  Each value is reported with a callable that reads it
anew, so a rebound global or cell is seen by a later comparison.  Imports nothing of the package.
"""

from __future__ import annotations

import dis
import functools
import inspect
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

__all__ = ["Reached", "reached"]

MAX_DEPTH = 7  # functions and objects followed from the step (an engine's model may be five attributes down)
MAX_ITEMS = 256  # a larger container is not looked into (reported as opaque)
MAX_VALUES = 4096  # values looked at in all; past that, what is left is opaque
# Packages whose code and objects hold no engine weights: not followed.
LIBRARIES = frozenset({"cgregistry", "torch", "functools", "typing", "builtins", "transformers", "numpy", "attrs"})
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
# Values that hold no tensor a graph reads.
_INERT = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, type,
          types.BuiltinFunctionType, types.BuiltinMethodType, types.CodeType)


@attrs.frozen
class Reached:
    """What a step reads: modules and tensors, each as (name, a callable that reads it anew), and the names of values
    it reads that were not looked into."""

    modules: list[tuple[str, Callable[[], Any]]]
    tensors: list[tuple[str, Callable[[], Any]]]
    opaque: list[str]


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

    def run(self, step: Callable[..., Any]) -> Reached:
        self.value(step, "step", lambda: step, -1)
        while True:  # objects are looked into by the names the code loads; following them may load more
            before, count = len(self.loads), len(self.taken)
            for obj, label, read, depth in list(self.objects):
                self.look_into(obj, label, read, depth)
            if (len(self.loads), len(self.taken)) == (before, count):
                break
        modules = [(name, read) for (name, _), read in self.modules.items()]
        return Reached(modules, list(self.tensors.items()), list(dict.fromkeys(self.opaque)))

    def value(self, found: Any, label: str, read: Callable[[], Any], depth: int) -> None:
        """Look at one value the code reaches; one that cannot be looked at (a proxy that raises, say) is opaque."""
        try:
            self._value(found, label, read, depth)
        except Exception:  # an engine's object may raise from anything we ask of it: say so, never fail the registry
            self.opaque.append(label)

    def _value(self, found: Any, label: str, read: Callable[[], Any], depth: int) -> None:
        if isinstance(found, _INERT):
            return
        self.values += 1
        if depth > MAX_DEPTH or self.values > MAX_VALUES:
            if not isinstance(found, (types.FunctionType, types.MethodType, types.ModuleType)):
                self.opaque.append(label)  # too deep or too many to look into: the engine can watch() it
            return
        if isinstance(found, nn.Module):
            if (label, id(found)) not in self.modules:  # two closures may each call their own model ``m``
                self.modules[(label, id(found))] = read
                if id(found) not in self.module_ids:
                    self.module_ids.add(id(found))
                    forward = getattr(type(found), "forward", None)
                    if isinstance(forward, types.FunctionType) and _package(forward.__module__) not in LIBRARIES:
                        self.function(forward, depth + 1, label)  # a module class of the engine's own: its code too,
                        self.objects.append((found, label, read, depth))  # and what it holds outside its tables
        elif isinstance(found, torch.Tensor):
            self.tensors.setdefault(label, read)
        elif isinstance(found, functools.partial):
            self.value(found.func, label, lambda: found.func, depth)
            for i, arg in enumerate(found.args):
                self.value(arg, f"{label}.args[{i}]", lambda a=arg: a, depth + 1)
            for key, arg in found.keywords.items():
                self.value(arg, f"{label}.{key}", lambda a=arg: a, depth + 1)
        elif isinstance(found, types.MethodType):
            owner = found.__self__
            self.value(owner, label, lambda: owner, depth)
            self.function(found.__func__, depth + 1, label)
        elif isinstance(found, types.FunctionType):
            self.function(found, depth + 1, label)
        elif isinstance(found, (Mapping, list, tuple)):
            self.objects.append((found, label, read, depth))
        elif isinstance(found, types.ModuleType):
            if _package(found.__name__) not in LIBRARIES | sys.stdlib_module_names:
                self.objects.append((found, label, read, depth))
        elif _package(getattr(type(found), "__module__", None)) not in LIBRARIES:
            call = getattr(type(found), "__call__", None)
            if isinstance(call, types.FunctionType):  # an object with __call__: its code and what it holds
                self.function(call, depth + 1, label)
            self.objects.append((found, label, read, depth))

    def function(self, fn: types.FunctionType, depth: int, label: str) -> None:
        wrapped = getattr(fn, "__wrapped__", None)  # functools.wraps: what a decorator (eager_break) wraps
        if wrapped is not None:
            self.value(wrapped, label, lambda: wrapped, depth - 1)
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
        if isinstance(obj, (Mapping, list, tuple)):
            if (id(obj), "") in self.taken:
                return
            self.taken.add((id(obj), ""))
            if len(obj) > MAX_ITEMS:
                self.opaque.append(label)
                return
            if isinstance(obj, Mapping):
                items = [(f"{label}[{k!r}]", v, lambda r=read, k=k: _item(r(), k)) for k, v in list(obj.items())]
            else:
                items = [(f"{label}[{i}]", v, lambda r=read, i=i: _item(r(), i)) for i, v in enumerate(obj)]
            for name, item, item_read in items:
                self.value(item, name, item_read, depth + 1)
            return
        attributes = getattr(obj, "__dict__", None)
        if not isinstance(attributes, Mapping):
            attributes = {}
        slots = {n for klass in type(obj).__mro__ for n in getattr(klass, "__slots__", ()) if isinstance(n, str)}
        if not attributes and not slots:
            self.opaque.append(label)
            return
        for name in [n for n in self.loads if (id(obj), n) not in self.taken]:
            if name in attributes or name in slots:
                self.taken.add((id(obj), name))
                found = attributes[name] if name in attributes else getattr(obj, name, None)
                self.value(found, f"{label}.{name}", lambda r=read, n=name: getattr(r(), n, None), depth + 1)
            elif not isinstance(obj, types.ModuleType):
                member = inspect.getattr_static(type(obj), name, None)
                if isinstance(member, property) and isinstance(member.fget, types.FunctionType):
                    member = member.fget  # a property the code reads: its getter's code, and what that loads
                if isinstance(member, types.FunctionType):  # a method the code calls: its code too
                    self.taken.add((id(obj), name))
                    self.function(member, depth + 1, label)


def _package(name: object) -> str:
    """The top-level package of a module name (anything else: the empty name)."""
    return name.partition(".")[0] if isinstance(name, str) else ""


def _loads(code: types.CodeType, ops: frozenset[str]) -> set[str]:
    """The names ``code`` and the code nested in it load with ``ops`` (globals, or attributes; stores are bookkeeping,
    not reads)."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ops and isinstance(i.argval, str)}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _loads(const, ops)
    return names


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
