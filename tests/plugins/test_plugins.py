"""Plugin manager: built-ins registered like third-party plugins, validation, one manager per registry."""

from __future__ import annotations

import types
from typing import Any

import pluggy
import pytest
import torch

import cgregistry as cg
from cgregistry.hooks.manager import (
    DEFAULT_PLUGINS,
    DISABLE_AUTOLOAD_ENV,
    make_plugin_manager,
)


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
        setattr(mod, hook_name, cg.plugin.hookimpl(fn))
    return mod


def test_builtins_are_ordinary_plugins() -> None:
    pm = make_plugin_manager(autoload=False)
    names = {pm.get_name(p) for p in pm.get_plugins()}
    assert set(DEFAULT_PLUGINS) <= names
    plugins = cg.Plugins(pm)
    assert set(plugins.strategies) == {"full", "breakable", "piecewise"}
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
    with pytest.raises(pluggy.PluginValidationError, match=r"(?s)Plugin .sig..*extra"):
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


class Recorder:
    """An observer plugin that records every event it sees."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    @cg.plugin.hookimpl
    def cgregistry_registry_created(self, registry: cg.GraphRegistry) -> None:
        self.events.append(("created", registry.name))

    @cg.plugin.hookimpl
    def cgregistry_capture_started(self, registry: cg.GraphRegistry, key: cg.BatchDescriptor, strategy: str) -> None:
        self.events.append(("started", key, strategy))

    @cg.plugin.hookimpl
    def cgregistry_capture_finished(self, registry: cg.GraphRegistry, key: cg.BatchDescriptor, strategy: str, entry: Any, error: Any) -> None:
        self.events.append(("finished", key, None if entry is None else entry.key, type(error).__name__ if error else None))

    @cg.plugin.hookimpl
    def cgregistry_miss(self, registry: cg.GraphRegistry, actual: cg.BatchDescriptor) -> None:
        self.events.append(("miss", actual))

    @cg.plugin.hookimpl
    def cgregistry_entry_failed(self, registry: cg.GraphRegistry, key: cg.BatchDescriptor, strategy: str, error: BaseException) -> None:
        self.events.append(("failed", key, strategy, str(error)))


def test_observer_hooks_see_capture_and_misses() -> None:
    rec = Recorder()
    plugins = cg.Plugins(make_plugin_manager([rec], autoload=False))

    def step(batch: cg.BatchDescriptor, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 2:
            raise ValueError("no")
        return x + 1

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", plugins=plugins, name="observed")
    with pytest.raises(cg.CaptureError):
        reg.capture([(cg.BatchDescriptor(4), "full"), (cg.BatchDescriptor(2), "full")])
    reg.run(cg.BatchDescriptor(3, 1), x=torch.ones(3))
    reg.run(cg.BatchDescriptor(6, 1), x=torch.ones(6))
    B = cg.BatchDescriptor
    assert rec.events == [
        ("created", "observed"),
        ("started", B(4), "full"),
        ("finished", B(4), B(4), None),
        ("started", B(2), "full"),
        ("finished", B(2), None, "CaptureError"),
        ("miss", B(6, 1)),
    ]


class FlakyStrategy(CountingStrategy):
    """Replays fine until told to fail: a vendor strategy with a bug."""

    name = "flaky"
    fail = False

    def capture(self, body: Any, backend: Any, pool: object) -> tuple[Any, Any]:
        graph, out = backend.capture(body, pool)
        strategy = self

        class Flaky:
            memory_bytes = graph.memory_bytes

            def replay(self) -> None:
                if strategy.fail:
                    raise RuntimeError("vendor replay bug")
                graph.replay()

        return Flaky(), out


def test_failing_replay_is_contained_to_its_entry() -> None:
    flaky = FlakyStrategy()
    rec = Recorder()
    plugin = plugin_module("flaky_plugin", cgregistry_register_strategies=lambda register: register(flaky))
    plugins = cg.Plugins(make_plugin_manager([plugin, rec], autoload=False))
    reg = cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", plugins=plugins, preference=("flaky", "full"))
    B = cg.BatchDescriptor
    reg.capture([(B(8), "flaky"), (B(16), "full")])
    x = torch.arange(5.0)
    assert reg.run(B(5, 1), x=x).tolist() == (x * 2).tolist()
    flaky.fail = True
    with pytest.warns(RuntimeWarning, match=r"replay of Batch\(tokens=8, reqs=any\) \[flaky\] raised RuntimeError: vendor replay bug"):
        out = reg.run(B(5, 1), x=x + 1)
    assert out.tolist() == ((x + 1) * 2).tolist(), "the step ran eagerly instead: still right"
    assert [e.key for e in reg.entries()] == [B(16)], "only the failed entry is gone"
    assert list(reg.failures()) == [(B(8), "flaky")]
    assert reg.stats().entry_failures == 1 and reg.stats().eager_fallbacks == 1
    assert ("failed", B(8), "flaky", "vendor replay bug") in rec.events
    assert reg.run(B(5, 1), x=x).tolist() == (x * 2).tolist()
    assert reg.match(B(5, 1)).key == B(16), "later batches use the remaining entries"


class PreferBigKeys:
    @cg.plugin.hookimpl
    def cgregistry_choose_match(self, registry: Any, actual: cg.BatchDescriptor, candidates: list) -> Any:
        return max(candidates, key=lambda m: m.key.num_tokens)


class Abstains:
    def __init__(self) -> None:
        self.asked = 0

    @cg.plugin.hookimpl
    def cgregistry_choose_match(self, registry: Any, actual: cg.BatchDescriptor, candidates: list) -> Any:
        self.asked += 1
        return None


def test_choose_match_policy_reranks_candidates() -> None:
    B = cg.BatchDescriptor
    abstains = Abstains()
    for plugins, expected in ((cg.Plugins(make_plugin_manager([abstains], autoload=False)), B(8)), (cg.Plugins(make_plugin_manager([PreferBigKeys()], autoload=False)), B(32))):
        reg = cg.GraphRegistry(lambda b, x: x + 1, {"x": cg.StaticInput((32,), torch.float32)}, backend="cpu", plugins=plugins)
        reg.capture([(B(8), "full"), (B(16), "full"), (B(32), "full")])
        assert reg.match(B(5, 1)).key == expected
        assert reg.run(B(5, 1), x=torch.zeros(5)).tolist() == [1.0] * 5
        reg.run(B(5, 1), x=torch.zeros(5))
    assert abstains.asked == 1, "asked once per shape, not per step"


def test_choose_match_must_return_a_candidate() -> None:
    class Bad:
        @cg.plugin.hookimpl
        def cgregistry_choose_match(self, registry: Any, actual: Any, candidates: list) -> Any:
            return cg.inspection.Match(cg.BatchDescriptor(99), "full", cg.key.Padding(0, 0, 0))

    pm = make_plugin_manager(autoload=False)
    pm.register(Bad(), name="bad-policy")
    reg = cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", plugins=cg.Plugins(pm))
    reg.capture([(cg.BatchDescriptor(8), "full")])
    with pytest.raises(cg.PluginError, match="implemented by bad-policy.*not one of the candidates"):
        reg.run(cg.BatchDescriptor(4, 1), x=torch.zeros(4))


def test_plugins_can_be_blocked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "cuda" not in cg.Plugins(make_plugin_manager(autoload=False, block=["cgregistry.backends.cuda"])).backends
    monkeypatch.setenv("CGREGISTRY_BLOCK_PLUGINS", "cgregistry.strategies.full, other")
    plugins = cg.Plugins(make_plugin_manager(autoload=False))
    assert "full" not in plugins.strategies
    assert "cgregistry.strategies.full" not in {p.name for p in plugins.describe()}


def test_installed_plugin_distributions_are_discovered() -> None:
    """The plugins/ packages, when installed, arrive through the entry-point group like any third party."""
    import importlib.metadata

    installed = {ep.name for ep in importlib.metadata.entry_points(group="cgregistry")}
    if not {"eager", "prometheus"} <= installed:
        pytest.skip("plugins/ packages are not installed here (CI installs them)")
    plugins = cg.Plugins()
    infos = {p.name: p for p in plugins.describe()}
    assert infos["eager"].distribution == "cgregistry-eager" and not infos["eager"].builtin
    assert infos["prometheus"].hooks == ("cgregistry_registry_created",)
    assert plugins.strategy_origin["eager"] == "eager"
    blocked = cg.Plugins(make_plugin_manager(block=["eager"]))
    assert "eager" not in blocked.strategies


def test_every_hook_is_documented_and_tested() -> None:
    from pathlib import Path

    from cgregistry.hooks import specs as hookspecs

    hooks = [n for n in dir(hookspecs) if n.startswith("cgregistry_")]
    assert len(hooks) == 14
    root = Path(__file__).parents[2]
    tests = "".join(p.read_text() for p in (root / "tests").rglob("test_*.py"))
    reference = (root / "docs" / "hooks.md").read_text()
    for name in hooks:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert ":param" in doc and ":return" in doc and "Since 0." in doc, f"{name} lacks argument, return or version docs"
        assert name in tests, f"{name} has no test"
        assert f"## `{name}" in reference, f"{name} is not in docs/hooks.md"
