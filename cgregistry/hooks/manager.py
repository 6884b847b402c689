"""The plugin manager: entry points and built-ins registered the same way, one manager per registry.

Third-party plugins come from the ``cgregistry`` entry-point group (``CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD=1`` skips
them); built-ins (``DEFAULT_PLUGINS``) are registered after them as ordinary plugin modules.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any

import attrs
import pluggy

from cgregistry.hooks import specs as hookspecs
from cgregistry.builtins import DEFAULT_PLUGINS
from cgregistry.contracts.protocols import Backend, Strategy
from cgregistry.contracts.registrars import BackendRegistrar, Registrar, StrategyRegistrar
from cgregistry.version import __version__
from cgregistry.errors import PluginError

__all__ = [
    "BLOCK_ENV", "DEFAULT_PLUGINS", "DISABLE_AUTOLOAD_ENV", "BackendRegistrar", "PluginError", "PluginInfo", "Plugins",
    "Registrar", "StrategyRegistrar", "make_plugin_manager",
]

DISABLE_AUTOLOAD_ENV = "CGREGISTRY_DISABLE_PLUGIN_AUTOLOAD"
BLOCK_ENV = "CGREGISTRY_BLOCK_PLUGINS"  # comma-separated plugin (entry point or module) names never to register


def make_plugin_manager(
    plugins: Iterable[object] = (), *, autoload: bool | None = None, block: Iterable[str] = ()
) -> pluggy.PluginManager:
    """A fresh manager: entry points (unless disabled), then ``plugins``, then the built-ins.  ``block`` (and
    ``CGREGISTRY_BLOCK_PLUGINS``) names plugins never to register: entry points or built-in modules."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked = {*block, *(n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip())}
    for name in blocked:
        pm.set_blocked(name)
    if autoload is None:
        autoload = not os.environ.get(DISABLE_AUTOLOAD_ENV)
    if autoload:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    for plugin in plugins:
        pm.register(plugin, name=_readable_name(plugin, pm))
    for name in DEFAULT_PLUGINS:
        if pm.get_plugin(name) is None and not pm.is_blocked(name):
            pm.register(importlib.import_module(name), name=name)
    pm.check_pending()
    return pm


def _readable_name(plugin: object, pm: pluggy.PluginManager) -> str:
    """A name errors and warnings can show: a module's name, or the object's class (numbered if taken)."""
    base = getattr(plugin, "__name__", None)
    if not isinstance(base, str):
        base = f"{type(plugin).__module__}.{type(plugin).__qualname__}"
    name, n = base, 1
    while pm.has_plugin(name):
        n += 1
        name = f"{base}#{n}"
    return name


@attrs.frozen(slots=True)
class PluginInfo:
    """One registered plugin: where it came from and which hooks it implements."""

    name: str
    distribution: str | None
    version: str | None
    hooks: tuple[str, ...]
    builtin: bool


def _collect(pm: pluggy.PluginManager, hook_name: str, kind: str, protocol: type) -> tuple[dict[str, Any], dict[str, str]]:
    found: dict[str, Any] = {}
    origin: dict[str, str] = {}
    hook = getattr(pm.hook, hook_name)
    # Call each implementation on its own so that every registration is attributed to its plugin.
    for impl in hook.get_hookimpls():  # registration order
        registrar = Registrar(kind, impl.plugin_name, protocol, found, origin)
        try:
            impl.function(register=registrar)
        finally:
            registrar.close()
    return found, origin


class Plugins:
    """Strategies and backends registered through one plugin manager."""

    def __init__(self, pm: pluggy.PluginManager | None = None) -> None:
        self.pm = pm if pm is not None else make_plugin_manager()
        self.strategies, self.strategy_origin = _collect(self.pm, "cgregistry_register_strategies", "strategy", Strategy)
        self.backends, self.backend_origin = _collect(self.pm, "cgregistry_register_backends", "backend", Backend)

    def describe(self) -> list[PluginInfo]:
        """Every registered plugin with its distribution, version and hooks."""
        dists = {id(plugin): dist for plugin, dist in self.pm.list_plugin_distinfo()}
        out = []
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:  # blocked
                continue
            dist, builtin = dists.get(id(plugin)), name in DEFAULT_PLUGINS
            hooks = tuple(sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or ()))
            where = (dist.project_name, dist.version) if dist is not None else (None, None)
            if dist is None and builtin:  # a built-in module is cgregistry's own
                where = ("cgregistry", __version__)
            out.append(PluginInfo(name, *where, hooks=hooks, builtin=builtin))
        return out

    def observed(self, hook_name: str) -> bool:
        """Whether any plugin implements the hook (an unobserved event costs nothing)."""
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def strategy(self, name: str) -> Any:
        try:
            return self.strategies[name]
        except KeyError:
            raise KeyError(f"strategy {name!r} is not registered; available: {', '.join(sorted(self.strategies))}") from None

    def backend(self, name: str) -> Any:
        """The backend called ``name``; "auto" is cuda when available, else cpu."""
        if name == "auto":
            for candidate in ("cuda", "cpu"):
                backend = self.backends.get(candidate)
                if backend is not None and backend.is_available():
                    return backend
            raise KeyError("backend 'auto' found neither an available 'cuda' nor a 'cpu' backend")
        try:
            backend = self.backends[name]
        except KeyError:
            raise KeyError(f"backend {name!r} is not registered; available: {', '.join(sorted(self.backends))}") from None
        if not backend.is_available():
            raise RuntimeError(f"backend {name!r} is registered but not available on this machine")
        return backend
