"""The registry finds the modules a step is given by its structure (the step, a bound method's object, closure cells,
partial arguments, defaults, and what they hold), never by its code: after an assign-style sync of any of them a
replay is refused (or, for a change torch does not announce, refresh() captures again), and every served output
equals eager.  What it cannot see (a module-level model, a Python module's attribute) it says once at capture, naming
the fix; watch= names it."""

from __future__ import annotations

import functools
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
from tests.conftest import capture_quietly, capture_warned_of_attributes

WIDTH = 8
INPUTS = {"x": cg.StaticInput((8, WIDTH), torch.float32)}
KEY = [(B(8), "full")]
X = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0))
MODEL = nn.Linear(WIDTH, WIDTH)  # a module-level model, read by StepModule.forward and global_step


def assign_new(module: nn.Module) -> None:
    module.load_state_dict({k: torch.randn_like(v) for k, v in module.state_dict().items()}, assign=True)


class Runner:
    def __init__(self) -> None:
        self.model = nn.Linear(WIDTH, WIDTH)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class Engine:
    """The model one object down, and bookkeeping the step writes."""

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


def global_step(batch: B, x: torch.Tensor) -> torch.Tensor:
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


def partial_argument() -> tuple[Callable[..., Any], nn.Module]:
    model = nn.Linear(WIDTH, WIDTH)

    def forward(model: nn.Module, batch: B, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    return functools.partial(forward, model), model


def layers_in_a_list_and_adapters_in_a_dict() -> tuple[Callable[..., Any], nn.Module]:
    layers, adapters = [nn.Linear(WIDTH, WIDTH) for _ in range(2)], {"a0": nn.Linear(WIDTH, WIDTH)}

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return adapters["a0"](layers[1](layers[0](x)))

    return step, adapters["a0"]


def a_module_held_by_the_step() -> tuple[Callable[..., Any], nn.Module]:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH))
    return (lambda batch, x: model(x)), model[0]


def two_closures_over_two_models() -> tuple[Callable[..., Any], nn.Module]:
    def over(m: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: m(x)  # both closures name their model ``m``

    target, draft = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    first, second = over(target), over(draft)
    return (lambda batch, x: first(x) + second(x)), draft


def a_wrapped_model() -> tuple[Callable[..., Any], nn.Module]:
    model = nn.Linear(WIDTH, WIDTH)

    def wrapped(x: torch.Tensor) -> torch.Tensor:  # a decorator's wrapper, as functools.cache or reg.compile make
        return x

    wrapped.__wrapped__ = model  # type: ignore[attr-defined]
    return (lambda batch, x: wrapped.__wrapped__(x)), model  # type: ignore[attr-defined]


LAYOUTS = {f.__name__: f for f in (engine_method, callable_object, default_argument, partial_argument,
                                   layers_in_a_list_and_adapters_in_a_dict, a_module_held_by_the_step,
                                   two_closures_over_two_models, a_wrapped_model)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_assigned_model_is_refused_then_refreshed_however_the_engine_hands_it_to_the_step(layout: str) -> None:
    step, model = LAYOUTS[layout]()
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    if layout in ("engine_method", "callable_object"):  # the model is an attribute of an engine object: said once
        capture_warned_of_attributes(reg, KEY)
    else:
        capture_quietly(reg, KEY)
    assign_new(model)
    with pytest.raises(cg.WeightsMovedError):
        reg.run(B(8), x=X)
    assert reg.refresh().recaptured == tuple(KEY)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(8), x=X), step(B(8), X))


def _python_module_step() -> Callable[..., Any]:
    state = types.ModuleType("engine_state")
    state.model = MODEL  # type: ignore[attr-defined]
    sys.modules["engine_state"] = state
    return lambda batch, x: state.model(x)  # type: ignore[attr-defined]


UNSEEN = {
    "a function reading a module-level model": (lambda: global_step, "module-level name 'MODEL' \\(Linear\\)"),
    "a module whose forward reads one": (StepModule, None),
    "a Python module's attribute": (_python_module_step, "Python module 'state'"),
}


@pytest.mark.parametrize("case", sorted(UNSEEN))
def test_what_the_registry_cannot_see_is_said_once_at_capture_and_watch_names_it(case: str) -> None:
    make, said = UNSEEN[case]
    saved = {k: v.clone() for k, v in MODEL.state_dict().items()}
    try:
        step = make()
        reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
        if said is None:  # a module's forward reads what its code reads: its own module is watched, nothing named
            reg.capture(KEY)
        else:
            with pytest.warns(RuntimeWarning, match=rf"reads {said}, which the registry cannot see.*watch=") as warned:
                reg.capture(KEY)
                reg.capture([(B(4), "full")])  # said once per registry
            assert len([w for w in warned if "cannot see" in str(w.message)]) == 1
        watching = cg.GraphRegistry(step, INPUTS, backend="cpu", watch=[MODEL])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            watching.capture(KEY)
        assign_new(MODEL)
        with pytest.raises(cg.WeightsMovedError, match=r"\[0\]\.weight"):
            watching.run(B(8), x=X)
        assert watching.refresh().recaptured == tuple(KEY)
        with torch.inference_mode():
            torch.testing.assert_close(watching.run(B(8), x=X), MODEL(X))
    finally:
        MODEL.load_state_dict(saved, assign=True)


def test_a_model_rebound_on_the_engine_object_is_said_once_at_capture_found_by_refresh_and_by_debug() -> None:
    engine = Engine()
    reg = cg.GraphRegistry(engine.step, INPUTS, backend="cpu")
    with pytest.warns(RuntimeWarning) as warned:
        reg.capture(KEY)
        reg.capture([(B(4), "full")])
    said = [str(w.message) for w in warned if "through attributes of plain objects" in str(w.message)]
    assert len(said) == 1 and "step.runner.model through attributes of plain objects" in said[0]
    assert "a weight replaced inside is caught" in said[0] and "found by reg.refresh() only" in said[0]
    assert "reg.refresh()" in said[0] and "reg.load_weights" in said[0], said
    engine.runner.model = nn.Linear(WIDTH, WIDTH)  # registers nothing anywhere: run() cannot see it
    assert reg.refresh().recaptured == (*KEY, (B(4), "full")), "refresh() reads the attribute anew"
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(8), x=X), engine.step(B(8), X))
    debug = cg.GraphRegistry(engine.step, INPUTS, backend="cpu", debug=True, watch=[engine.runner.model])
    capture_quietly(debug, KEY)  # the engine named its model: no warning
    engine.runner.model = nn.Linear(WIDTH, WIDTH)
    with pytest.raises(cg.DebugError, match=r"step\.runner\.model\.weight moved"):
        debug.run(B(8), x=X)


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


def test_bookkeeping_tensors_on_the_engine_object_are_not_watched() -> None:
    step, model = engine_method()
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu", debug=True)
    capture_warned_of_attributes(reg, KEY)
    for _ in range(3):  # each step rebinds engine.last_logits: no DebugError, no recapture
        reg.run(B(8), x=X).clone()
    with torch.no_grad():
        model.weight.mul_(2)
    assert reg.refresh().recaptured == () and not any("last_logits" in n for n in reg.watched())


def test_capturing_again_watches_nothing_twice() -> None:
    step, _ = engine_method()
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    capture_warned_of_attributes(reg, KEY)
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


def test_debug_mode_refuses_moved_weights_with_an_error_the_plain_mode_handler_catches() -> None:
    step, model = engine_method()
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu", debug=True)
    capture_warned_of_attributes(reg, KEY)
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
    with pytest.raises(TypeError, match=r"watch\(\) takes an nn.Module, a list of modules, or \(name, tensor\) pairs; got 'weight'"):
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
    capture_warned_of_attributes(reg, KEY)
    assert "step._executor.worker.runner.wrapper.model.weight" in reg.watched()  # named by where it is held
    assert "step.adapter_b" not in reg.watched(), "a tensor on the engine object is the engine's bookkeeping"
    engine.executor.worker.runner.wrapper.model = nn.Linear(WIDTH, WIDTH)  # rebound: refresh() finds it
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


def test_an_engine_object_that_raises_when_looked_at_is_not_fatal() -> None:
    class Hostile:
        __slots__ = ("model",)

        def __init__(self) -> None:
            self.model = nn.Linear(WIDTH, WIDTH)

        def __getattribute__(self, name: str) -> Any:
            if name == "model":
                raise RuntimeError(f"proxy: {name}")
            return object.__getattribute__(self, name)

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x

    hostile = Hostile()
    reg = cg.GraphRegistry(lambda batch, x: hostile(x) * 2, INPUTS, backend="cpu")
    reg.capture(KEY)
    torch.testing.assert_close(reg.run(B(8), x=X), X * 2)


def test_a_buffer_the_model_makes_at_its_first_forward_is_read_by_every_graph_and_debug_mode_serves() -> None:
    """A cache a module registers at its first forward (a rotary table) is made by the first capture's warm-up: every
    graph reads it, so it is there from the start, not 'added': debug mode serves, refresh() keeps every graph and
    names nothing moved."""

    for debug, background in ((True, False), (True, True), (False, False)):
        model = LazyCache()
        reg = cg.GraphRegistry(lambda batch, x: model(x), INPUTS, backend="cpu", debug=debug)
        with torch.inference_mode():
            reg.capture(KEY, background=background)
            assert reg.wait_captured()
        with torch.inference_mode():
            torch.testing.assert_close(reg.run(B(8), x=X), model(X))
        result = reg.refresh()
        assert result.recaptured == () and result.moved == (), (debug, background, result)


def test_a_module_that_is_not_hashable_builds_anywhere_in_a_process_with_a_registry() -> None:
    """The watch hears of registrations through torch's global hooks: they must not ask anything of other modules
    (an nn.Module with dataclass equality is not hashable)."""
    import dataclasses

    lin = nn.Linear(WIDTH, WIDTH)
    reg = cg.GraphRegistry(lambda batch, x: lin(x), INPUTS, backend="cpu")
    capture_quietly(reg, KEY)

    @dataclasses.dataclass(eq=True)
    class Head(nn.Module):
        width: int

        def __post_init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(self.width, self.width)

    head = Head(WIDTH)
    head.proj.weight = nn.Parameter(torch.zeros(WIDTH, WIDTH))
    assert torch.equal(head.proj.weight, torch.zeros(WIDTH, WIDTH))
