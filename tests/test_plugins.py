"""Plugin manager: built-ins registered like third-party plugins, validation, one manager per registry."""

from __future__ import annotations

import sys
import types
from typing import Any

import pluggy
import pytest
import torch

import cgregistry as cg
from cgregistry.plugins import DEFAULT_PLUGINS, DISABLE_AUTOLOAD_ENV, make_plugin_manager


class CountingStrategy:
    """Wraps the backend capture and counts replays: a minimal third-party strategy."""

    name = "counting"
    relaxes_num_reqs = False

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, body: Any, backend: Any, pool: object) -> tuple[Any, Any]:
        graph, out = backend.capture(body, pool)
        outer = self

        class Counted:
            memory_bytes = graph.memory_bytes

            def replay(self) -> None:
                outer.replays += 1
                graph.replay()

        return Counted(), out


def plugin_module(name: str, **hooks: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(mod, hook_name, cg.hookimpl(fn))
    return mod


def test_builtins_are_ordinary_plugins() -> None:
    pm = make_plugin_manager(autoload=False)
    names = {pm.get_name(p) for p in pm.get_plugins()}
    assert set(DEFAULT_PLUGINS) <= names
    plugins = cg.Plugins(pm)
    assert set(plugins.strategies) == {"full"}
    assert set(plugins.backends) == {"cuda", "cpu"}
    assert plugins.strategy_origin["full"] == "cgregistry.strategies.full"


def test_each_registry_gets_its_own_manager() -> None:
    a = cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((4,), torch.float32)}, backend="cpu")
    b = cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((4,), torch.float32)}, backend="cpu")
    assert a.plugins.pm is not b.plugins.pm


def test_third_party_strategy_is_used_by_the_registry() -> None:
    strategy = CountingStrategy()
    plugin = plugin_module("counting_plugin", cgregistry_register_strategies=lambda register: register(strategy))
    plugins = cg.Plugins(make_plugin_manager([plugin], autoload=False))
    assert plugins.strategy_origin["counting"] == "counting_plugin"
    reg = cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", plugins=plugins, preference=("counting", "full"))
    reg.capture([(cg.BatchDescriptor(8), "counting"), (cg.BatchDescriptor(8), "full")])
    out = reg.run(cg.BatchDescriptor(5, 2), x=torch.ones(5))
    assert out.tolist() == [2.0] * 5
    assert strategy.replays == 1
    assert reg.match(cg.BatchDescriptor(5, 2)).strategy == "counting"


def test_duplicate_names_name_both_plugins() -> None:
    class Impostor(CountingStrategy):
        name = "full"

    plugin = plugin_module("impostor", cgregistry_register_strategies=lambda register: register(Impostor()))
    pm = make_plugin_manager(autoload=False)
    pm.register(plugin, name="impostor")
    with pytest.raises(cg.PluginError, match="strategy 'full' is registered by both plugin 'cgregistry.strategies.full' and plugin 'impostor'"):
        cg.Plugins(pm)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (object(), "needs a non-empty str attribute 'name'"),
        (types.SimpleNamespace(name="x", relaxes_num_reqs=False), "needs a method capture"),
        (types.SimpleNamespace(name="x", capture=lambda *a: None), "needs a bool attribute 'relaxes_num_reqs'"),
    ],
)
def test_invalid_strategies_are_refused_with_plugin_name(obj: object, message: str) -> None:
    pm = make_plugin_manager(autoload=False)
    pm.register(plugin_module("bad", cgregistry_register_strategies=lambda register: register(obj)), name="bad")
    with pytest.raises(cg.PluginError, match=f"plugin 'bad' registered an invalid strategy .*{message}"):
        cg.Plugins(pm)


def test_invalid_backend_lists_missing_methods() -> None:
    backend = types.SimpleNamespace(name="npu", is_available=lambda: True)
    pm = make_plugin_manager(autoload=False)
    pm.register(plugin_module("npu", cgregistry_register_backends=lambda register: register(backend)), name="npu")
    with pytest.raises(cg.PluginError, match="lacks device, new_pool, warmup, capture, share_outputs, recover_pool, synchronize"):
        cg.Plugins(pm)


def test_misspelled_hook_is_caught() -> None:
    bad = plugin_module("typo", cgregistry_register_strategy=lambda register: None)
    with pytest.raises(pluggy.PluginValidationError, match="cgregistry_register_strategy"):
        make_plugin_manager([bad], autoload=False)


def test_wrong_hook_signature_is_caught() -> None:
    bad = plugin_module("sig", cgregistry_register_strategies=lambda register, extra: None)
    with pytest.raises(pluggy.PluginValidationError, match="extra"):
        make_plugin_manager([bad], autoload=False)


def test_autoload_env_var_skips_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(pluggy.PluginManager, "load_setuptools_entrypoints", lambda self, group, name=None: calls.append(group) or 0)
    make_plugin_manager()
    assert calls == ["cgregistry"]
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    make_plugin_manager()
    assert calls == ["cgregistry"]


def test_unknown_and_unavailable_backends() -> None:
    with pytest.raises(KeyError, match="backend 'tpu' is not registered; available: cpu, cuda"):
        cg.GraphRegistry(lambda b: None, {}, backend="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="backend 'cuda' is registered but not available"):
            cg.GraphRegistry(lambda b: None, {}, backend="cuda")


def test_every_hook_is_documented_and_tested() -> None:
    from cgregistry import hookspecs

    hooks = [n for n in dir(hookspecs) if n.startswith("cgregistry_")]
    assert hooks
    here = open(__file__).read() + open(__file__.replace("test_plugins", "test_registry")).read()
    for name in hooks:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert ":param register:" in doc and "Since" in doc, f"{name} lacks argument or version docs"
        assert name in here, f"{name} has no test"
    assert "cgregistry_register_backends" in sys.modules["cgregistry.backends.cpu"].__dict__
