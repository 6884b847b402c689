"""What registration hooks receive: a ``Registrar`` that checks each object against its protocol, refuses a name another
plugin took, and names the plugin in every error.

Its own module so that the hook specifications can name it without importing the plugin manager (which imports them).
"""

from __future__ import annotations

import typing
from typing import Any, Generic, TypeVar

from cgregistry.contracts.protocols import Backend, Strategy, protocol_members
from cgregistry.errors import PluginError
from cgregistry.key.classes import declared_unsupported

__all__ = ["BackendRegistrar", "PluginError", "Registrar", "StrategyRegistrar"]


T = TypeVar("T")


class Registrar(Generic[T]):
    """What a registration hook receives, one per plugin and hook: call it with each object to register
    (``register(obj)``).  It checks the object against its protocol, refuses a name another plugin took, and names the
    plugin in every error."""

    def __init__(self, kind: str, plugin: str, protocol: type, found: dict[str, T], origin: dict[str, str]) -> None:
        self.kind = kind  # "strategy" or "backend"
        self.plugin = plugin  # the registering plugin's name
        self.protocol = protocol
        self._found = found
        self._origin = origin
        self._closed = False

    def close(self) -> None:
        """Registration is over: later calls are refused (a kept registrar must not change a live plugin set)."""
        self._closed = True

    def __call__(self, obj: T) -> None:
        if self._closed:
            raise PluginError(f"plugin {self.plugin!r} registered {obj!r} after its registration hook returned")
        if isinstance(obj, type):
            raise PluginError(f"plugin {self.plugin!r} registered the class {obj.__qualname__}; register an instance of it")
        problem = _problem(obj, self.protocol)
        if problem:
            raise PluginError(f"plugin {self.plugin!r} registered an invalid {self.kind} {obj!r}: {problem}")
        name = obj.name  # type: ignore[attr-defined]
        if name in self._found:
            raise PluginError(f"{self.kind} {name!r} is registered by both plugin {self._origin[name]!r} and plugin {self.plugin!r}")
        self._found[name] = obj
        self._origin[name] = self.plugin

    register = __call__


StrategyRegistrar = Registrar[Strategy]
BackendRegistrar = Registrar[Backend]


def _problem(obj: Any, protocol: type) -> str | None:
    """What ``obj`` lacks of ``protocol`` (its required members, derived from the protocol), or None."""
    if not isinstance(getattr(obj, "name", None), str) or not obj.name:
        return "it needs a non-empty str attribute 'name'"
    hints = typing.get_type_hints(protocol)
    missing = []
    for member in protocol_members(protocol):
        if member in hints:
            if hints[member] is bool and not isinstance(getattr(obj, member, None), bool):
                return f"it needs a bool attribute {member!r}"
        elif not callable(getattr(obj, member, None)):
            missing.append(member)
    if len(missing) == 1 and protocol is Strategy:
        return f"it needs a method {missing[0]}(body, backend, pool)"
    if missing:
        return f"it lacks {', '.join(missing)}"
    if protocol is Strategy:
        try:
            declared_unsupported(obj)  # optional; checked here so that a bad one is the registering plugin's error
        except ValueError as exc:
            return str(exc)
    return None
