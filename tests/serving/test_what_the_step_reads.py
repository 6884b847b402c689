"""The registry finds the weights a step reads however the engine holds its model, and nothing the step does not read:
after an assign-style sync of any of them a replay is refused (or, for a change torch does not announce, refresh()
captures again), and every served output equals eager."""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from tests.conftest import capture_quietly

WIDTH = 8
INPUTS = {"x": cg.StaticInput((8, WIDTH), torch.float32)}
KEY = [(B(8), "full")]
X = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0))
MODEL = nn.Linear(WIDTH, WIDTH)  # a module-level model, read by StepModule.forward


def assign_new(module: nn.Module) -> None:
    module.load_state_dict({k: torch.randn_like(v) for k, v in module.state_dict().items()}, assign=True)


class Runner:
    def __init__(self) -> None:
        self.model = nn.Linear(WIDTH, WIDTH)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class Engine:
    """The model one object down, and bookkeeping the step writes but never reads."""

    def __init__(self) -> None:
        self.runner = Runner()
        self.last_logits = torch.zeros(1)

    def step(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        out = self.runner.model(x)
        self.last_logits = out
        return out


class StepModule(nn.Module):
    def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        return MODEL(x)


def engine_method() -> tuple[Callable[..., Any], nn.Module]:
    engine = Engine()
    return engine.step, engine.runner.model


def callable_object() -> tuple[Callable[..., Any], nn.Module]:
    runner = Runner()
    return (lambda batch, x: runner(x)), runner.model


def default_argument() -> tuple[Callable[..., Any], nn.Module]:
    model = nn.Linear(WIDTH, WIDTH)

    def step(batch: B, x: torch.Tensor, model: nn.Module = model) -> torch.Tensor:
        return model(x)

    return step, model


def python_module_attribute() -> tuple[Callable[..., Any], nn.Module]:
    state = types.ModuleType("engine_state")
    state.model = nn.Linear(WIDTH, WIDTH)  # type: ignore[attr-defined]
    sys.modules["engine_state"] = state
    return (lambda batch, x: state.model(x)), state.model  # type: ignore[attr-defined]


def module_reading_a_global() -> tuple[Callable[..., Any], nn.Module]:
    return StepModule(), MODEL


def two_closures_over_two_models() -> tuple[Callable[..., Any], nn.Module]:
    def over(m: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: m(x)  # both closures name their model ``m``

    target, draft = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    first, second = over(target), over(draft)
    return (lambda batch, x: first(x) + second(x)), draft


LAYOUTS = {f.__name__: f for f in (engine_method, callable_object, default_argument, python_module_attribute,
                                   module_reading_a_global, two_closures_over_two_models)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_assigned_model_is_refused_then_refreshed_however_the_engine_holds_it(layout: str) -> None:
    step, model = LAYOUTS[layout]()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    capture_quietly(reg, KEY)
    try:
        assign_new(model)
        with pytest.raises(cg.WeightsMovedError):
            reg.run(B(8), x=X)
        assert reg.refresh().recaptured == tuple(KEY)
        with torch.inference_mode():
            torch.testing.assert_close(reg.run(B(8), x=X), step(B(8), X))
    finally:
        model.load_state_dict(saved, assign=True)


def test_an_adapter_registered_on_a_watched_module_is_refused_at_the_next_run() -> None:
    class WithAdapters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base, self.adapters = nn.Linear(WIDTH, WIDTH), nn.ModuleDict()

        def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + sum((a(x) for a in self.adapters.values()), torch.zeros_like(x))

    model = WithAdapters()
    reg = cg.GraphRegistry(model, INPUTS, backend="cpu")
    reg.capture(KEY)
    model.adapters["lora0"] = nn.Linear(WIDTH, WIDTH)
    with pytest.raises(cg.WeightsMovedError, match=r"step\.adapters\.lora0\.weight was added"):
        reg.run(B(8), x=X)
    assert reg.refresh().recaptured == tuple(KEY)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(8), x=X), model(B(8), X))


def test_an_adapter_put_in_a_plain_dict_the_step_reads_is_found_by_refresh() -> None:
    base, adapters = nn.Linear(WIDTH, WIDTH), {"a0": nn.Linear(WIDTH, WIDTH)}

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return base(x) + sum((a(x) for a in adapters.values()), torch.zeros_like(x))

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    reg.capture(KEY)
    adapters["a1"] = nn.Linear(WIDTH, WIDTH)  # announces nothing: refresh() looks again
    assert reg.refresh().recaptured == tuple(KEY)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(8), x=X), step(B(8), X))


def test_a_rebound_global_that_was_a_submodule_is_found_by_refresh() -> None:
    scope: dict[str, Any] = {}
    exec(  # a module of the engine's own: globals the step reads, one of them an alias of a submodule
        "import torch\n"
        "model = torch.nn.ModuleDict({'body': torch.nn.Linear(8, 8), 'head': torch.nn.Linear(8, 8)})\n"
        "head = model['head']\n"
        "def step(batch, x):\n"
        "    return head(model['body'](x))\n",
        scope,
    )
    reg = cg.GraphRegistry(scope["step"], INPUTS, backend="cpu")
    reg.capture(KEY)
    scope["head"] = nn.Linear(WIDTH, WIDTH)
    assert reg.refresh().recaptured == tuple(KEY)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(8), x=X), scope["step"](B(8), X))


def test_bookkeeping_the_step_writes_but_never_reads_is_not_watched() -> None:
    step, model = engine_method()
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu", debug=True)
    reg.capture(KEY)
    for _ in range(3):  # each step rebinds engine.last_logits: no DebugError, no recapture
        reg.run(B(8), x=X).clone()
    with torch.no_grad():
        model.weight.mul_(2)
    assert reg.refresh().recaptured == () and not any("last_logits" in n for n in reg.watched())


def test_capturing_again_watches_nothing_twice() -> None:
    step, _ = engine_method()
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    reg.capture(KEY)
    watched = reg.watched()
    for _ in range(2):
        reg.capture(KEY)
    assert reg.watched() == watched


def test_the_batch_seen_while_recording_is_a_break_context() -> None:
    seen: list[object] = []

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        seen.append(cg.current_batch())
        return x * 2

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg.capture(KEY)
        print(seen[-1])  # its repr reads nothing frozen
    assert len(seen) == 2 and all(isinstance(b, cg.plugin.BreakContext) and b.key == B(8) for b in seen)


class LazyCache(nn.Module):
    """Registers a buffer at its first call, as a rotary embedding's cache does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "cache"):
            self.register_buffer("cache", torch.linspace(0, 1, WIDTH), persistent=False)
        return self.linear(x) * self.cache


def test_a_buffer_the_step_registers_at_its_first_call_refuses_no_graph() -> None:
    model = LazyCache()
    reg = cg.GraphRegistry(lambda batch, x: model(x), {"x": cg.StaticInput((16, WIDTH), torch.float32)}, backend="cpu")
    reg.capture(cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=16, mode="full"))
    with torch.inference_mode():
        for n in (3, 9, 16):  # every key, the first captured (the largest) included
            x = torch.randn(n, WIDTH)
            torch.testing.assert_close(reg.run(B.decode(n), x=x), model(x))
    assert reg.refresh().recaptured == ()


def test_an_attribute_name_is_not_taken_for_a_global_of_the_same_name() -> None:
    scope: dict[str, Any] = {}
    exec("import torch\nweight = torch.randn(8, 8)\nmodel = torch.nn.Linear(8, 8)\n"
         "def step(batch, x):\n    return x @ model.weight.T\n", scope)
    reg = cg.GraphRegistry(scope["step"], INPUTS, backend="cpu")
    reg.capture(KEY)
    assert "weight" not in reg.watched() and "model.weight" in reg.watched()
    scope["weight"] = torch.randn(WIDTH, WIDTH)  # an unrelated global rebound: nothing to capture again
    assert reg.refresh().recaptured == ()


def test_debug_mode_refuses_moved_weights_with_an_error_the_plain_mode_handler_catches() -> None:
    step, model = engine_method()
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu", debug=True)
    reg.capture(KEY)
    assign_new(model)
    with pytest.raises(cg.WeightsMovedError):
        reg.run(B(8), x=X)
    with pytest.raises(cg.DebugError):
        reg.run(B(8), x=X)


def test_watch_takes_a_list_of_modules_and_names_a_bad_item() -> None:
    models = [nn.Linear(WIDTH, WIDTH) for _ in range(300)]  # too many to look into
    reg = cg.GraphRegistry(lambda batch, x: models[299](x), INPUTS, backend="cpu")
    reg.watch(models, prefix="models")
    assert "models[299].weight" in reg.watched()
    reg.capture(KEY)
    assign_new(models[299])
    with pytest.raises(cg.WeightsMovedError, match=r"models\[299\]\.weight"):
        reg.run(B(8), x=X)
    with pytest.raises(TypeError, match=r"watch\(\) takes an nn.Module, a list of modules, or \(name, tensor\) pairs; got an item str"):
        reg.watch(["weight"])


class Deep:
    """An engine whose model is five objects down, behind a property, beside a slotted holder and a plain tensor."""

    __slots__ = ("_executor", "adapter_b")

    def __init__(self) -> None:
        self._executor = types.SimpleNamespace(worker=types.SimpleNamespace(
            runner=types.SimpleNamespace(wrapper=types.SimpleNamespace(model=nn.Linear(WIDTH, WIDTH)))))
        self.adapter_b = torch.zeros(WIDTH)

    @property
    def executor(self) -> Any:
        return self._executor

    def step(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        return self.executor.worker.runner.wrapper.model(x) + self.adapter_b


def test_a_model_deep_in_an_engine_behind_a_property_and_slots_is_watched() -> None:
    engine = Deep()
    reg = cg.GraphRegistry(engine.step, INPUTS, backend="cpu")
    reg.capture(KEY)
    assert "step.executor.worker.runner.wrapper.model.weight" not in reg.watched()  # named by where the code reads it
    assert any(n.endswith("wrapper.model.weight") for n in reg.watched()) and "step.adapter_b" in reg.watched()
    engine.adapter_b = torch.ones(WIDTH)  # a plain tensor rebound: refresh() finds it
    assert reg.refresh().recaptured == tuple(KEY)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(8), x=X), engine.step(B(8), X))


def test_a_weight_re_registered_as_a_view_at_the_same_address_is_refused() -> None:
    lin = nn.Linear(WIDTH, WIDTH)
    reg = cg.GraphRegistry(lambda batch, x: lin(x), INPUTS, backend="cpu")
    reg.capture(KEY)
    lin.weight = nn.Parameter(lin.weight.detach().t(), requires_grad=False)  # same memory, another layout
    with pytest.raises(cg.WeightsMovedError, match=r"lin\.weight changed layout at 0x[0-9a-f]+: shape \[8, 8\] strides \[8, 1\]"):
        reg.run(B(8), x=X)
    assert reg.refresh().recaptured == tuple(KEY)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(8), x=X), lin(X))


@pytest.mark.parametrize("name", [None, 7])
def test_a_step_made_by_exec_with_an_odd_module_name_is_read(name: object) -> None:
    scope: dict[str, Any] = {"__name__": name, "lin": nn.Linear(WIDTH, WIDTH)}
    exec("def step(batch, x):\n    return lin(x)\n", scope)
    reg = cg.GraphRegistry(scope["step"], INPUTS, backend="cpu")
    assert "lin.weight" in reg.watched()


def test_an_engine_object_that_raises_when_looked_at_is_opaque_not_fatal() -> None:
    class Hostile:
        def __getattribute__(self, name: str) -> Any:
            raise RuntimeError(f"proxy: {name}")

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x

    hostile = Hostile()
    reg = cg.GraphRegistry(lambda batch, x: hostile(x) * 2, INPUTS, backend="cpu")  # builds; capture warns what it missed
    with pytest.warns(RuntimeWarning, match="found no module the step reads, and it reads 'hostile'"):
        reg.capture(KEY)


def test_watched_roots_read_as_new_modules_each_time_are_each_their_own() -> None:
    """Two watched callables that build a new module at each read (a view of the adapters in use): a module freed
    within one read of every address may give its id to the next, and each root's submodules must still be its own:
    a replaced adapter behind the second is found."""
    # more adapters than the walk looks into (MAX_ITEMS): the engine watches the ones in use itself
    first, second = ([nn.Linear(WIDTH, WIDTH) for _ in range(300)] for _ in range(2))

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return second[0](first[0](x))

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    reg.watch(lambda: nn.ModuleList(first[:1]), prefix="a.")
    reg.watch(lambda: nn.ModuleList(second[:1]), prefix="b.")
    with torch.no_grad():
        reg.capture(KEY)
        second[0] = nn.Linear(WIDTH, WIDTH)
        refreshed = reg.refresh()
        assert not refreshed.kept and any(m.startswith("b.0.weight") for m in refreshed.moved), refreshed.moved
        x = torch.randn(4, WIDTH)
        torch.testing.assert_close(reg.run(B.decode(4), x=x), step(B.decode(4), x))


def test_a_step_whose_code_holds_an_unhashable_constant_is_still_read() -> None:
    """Code rewritten by a bytecode tool may hold an unhashable constant (a list): the model it reads is still found."""
    model = nn.Linear(WIDTH, WIDTH)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    step.__code__ = step.__code__.replace(co_consts=(*step.__code__.co_consts, []))
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    capture_quietly(reg, KEY)
    assert "model.weight" in reg.watched()


def test_a_submodule_shadowed_in_the_instance_dict_is_read_where_forward_reads_it() -> None:
    """A submodule set past nn.Module.__setattr__ (into the instance dict) is what ``forward`` calls: its replacement
    is found, as attribute lookup finds it."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x)

    model = Head()
    reg = cg.GraphRegistry(lambda batch, x: model(x), INPUTS, backend="cpu")
    with torch.no_grad():
        reg.capture(KEY)
        object.__setattr__(model, "head", nn.Linear(WIDTH, WIDTH))
        refreshed = reg.refresh()
        assert not refreshed.kept
        x = torch.randn(4, WIDTH)
        torch.testing.assert_close(reg.run(B.decode(4), x=x), model(x))
