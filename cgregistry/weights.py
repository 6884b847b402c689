"""The tensors graphs read, where they were at capture, and a notice the moment a watched module replaces one.

A graph reads the addresses it saw at capture.  An in-place update of a weight (``param.copy_``,
``load_state_dict`` without ``assign``, an adapter copied into existing slots) keeps them, so graphs
compute with the new values.  A replacement moves them (``load_state_dict(assign=True)``,
``module.weight = nn.Parameter(...)``, a replaced submodule or buffer): graphs would go on reading the
old, perhaps freed, memory.  ``WeightWatch`` records the address of every watched tensor (a module's
parameters and buffers are looked up by name each time, so a replaced one is seen), compares them on
demand (``moved``, ``fingerprint``), and calls ``on_change`` as soon as a watched module registers a
new parameter, buffer or submodule (torch's global registration hooks), at no cost to a step.
A replacement that registers nothing (``param.data = t``, ``torch.utils.swap_tensors``) is only seen by
a comparison: at ``refresh()``, and before every replay in debug mode.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from cgregistry.errors import CgregistryError

__all__ = ["WeightWatch", "WeightsMovedError"]


class WeightsMovedError(CgregistryError, RuntimeError):
    """A graph would read a watched weight where it was at capture, after the weight moved (call ``reg.refresh()``)."""


class _ModuleSlot:
    """A parameter or buffer of a module, looked up by its path from the root each time: a replaced
    parameter, buffer or submodule is seen."""

    __slots__ = ("root", "path", "table", "name")

    def __init__(self, root: nn.Module, path: str, table: str, name: str) -> None:
        self.root = root
        self.path = path  # of the submodule holding it ("" for the root)
        self.table = table  # "_parameters" or "_buffers"
        self.name = name

    def data_ptr(self) -> int | None:
        try:
            module = self.root.get_submodule(self.path)
        except AttributeError:  # the submodule was removed
            return None
        tensor = getattr(module, self.table).get(self.name)
        return None if tensor is None else tensor.data_ptr()


def _module_slots(module: nn.Module, prefix: str) -> list[tuple[str, _ModuleSlot]]:
    slots = []
    for path, sub in module.named_modules():
        for table in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, table).items():
                if tensor is not None:
                    slots.append((f"{prefix}{path + '.' if path else ''}{name}", _ModuleSlot(module, path, table, name)))
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
    """Addresses of the tensors graphs read, recorded at capture (``rebase``) and compared on demand."""

    def __init__(self) -> None:
        self._watched: dict[str, tuple[torch.Tensor | _ModuleSlot, int | None]] = {}
        self._roots: list[tuple[nn.Module, str]] = []
        self.on_change: Callable[[str], None] | None = None  # called with what was registered, on the registering thread

    def watch(self, named: Iterable[tuple[str, torch.Tensor]] | nn.Module, prefix: str = "") -> None:
        """Watch ``(name, tensor)`` pairs, or every parameter and buffer of a module (by name, so replacing one is seen)."""
        if isinstance(named, nn.Module):
            _install_hooks()
            self._roots.append((named, prefix))
            for name, slot in _module_slots(named, prefix):
                self._watched[name] = (slot, slot.data_ptr())
            self._listen(named)
            return
        for name, tensor in named:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"watch() takes (name, tensor) pairs or an nn.Module, got {name!r}: {type(tensor).__name__}")
            self._watched[f"{prefix}{name}"] = (tensor, tensor.data_ptr())

    def changed(self, what: str) -> None:
        """A watched module registered a parameter, buffer or submodule (called by torch's hooks)."""
        if self.on_change is not None:
            self.on_change(what)

    def rebase(self) -> None:
        """Record the current addresses (no graph reads the old ones); a replaced submodule's tensors are watched from now on."""
        for root, prefix in self._roots:
            for name, slot in _module_slots(root, prefix):
                self._watched.setdefault(name, (slot, None))
            self._listen(root)
        self._watched = {name: (source, source.data_ptr()) for name, (source, _) in self._watched.items()}

    def moved(self) -> list[str]:
        """Each watched tensor whose address is not the recorded one, with where it went."""
        found = []
        for name, (source, ptr) in self._watched.items():
            now = source.data_ptr()
            if now != ptr:
                found.append(f"{name} {'was removed' if now is None else f'moved from {ptr:#x} to {now:#x}'}")
        return found

    def fingerprint(self) -> tuple[int | None, ...]:
        """The current address of every watched tensor, in watch order: what a graph captured now reads."""
        return tuple(source.data_ptr() for source, _ in self._watched.values())

    def recorded(self) -> tuple[int | None, ...]:
        """The addresses recorded at the last ``rebase``, in the same order."""
        return tuple(ptr for _, ptr in self._watched.values())

    def __len__(self) -> int:
        return len(self._watched)

    def _listen(self, root: nn.Module) -> None:
        for module in root.modules():
            _listeners.setdefault(module, weakref.WeakSet()).add(self)
