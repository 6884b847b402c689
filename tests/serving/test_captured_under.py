"""A graph serves only under what it was captured under: the weights it read where they were, and the serving state.

Whatever path the engine takes (a later capture, refresh(), a step that is a closure over its model), a replay either
computes what eager computes now or is refused with a named error.  Eager is the oracle throughout.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import dataclasses
import enum
import functools
import gc
import logging
import sys
import threading
import types
import weakref
from typing import Any

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from tests.conftest import capture_quietly, device_of

WIDTH, MAX_TOKENS = 8, 16
PLAN = cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[4, 8])
INPUTS = {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}

# A module the step reaches through its globals, as README.md's example does.
GLOBAL_LINEAR = torch.nn.Linear(WIDTH, WIDTH)


def global_step(batch: B, x: torch.Tensor) -> torch.Tensor:
    return GLOBAL_LINEAR(x)


def fresh_state(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g).to(v.device) for k, v in module.state_dict().items()}


def x_of(n: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed)).to(device)


def closure_step(lin: torch.nn.Module):  # type: ignore[no-untyped-def]
    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return lin(x)

    return step


def partial_step(lin: torch.nn.Module):  # type: ignore[no-untyped-def]
    def apply(module: torch.nn.Module, batch: B, x: torch.Tensor) -> torch.Tensor:
        return module(x)

    return functools.partial(apply, lin)


class Model(torch.nn.Module):
    """A module as the step: the registry watches it without being told."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Engine:
    """A plain object (no module) whose step method reads its model."""

    def __init__(self, lin: torch.nn.Module) -> None:
        self.model = lin

    def step(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


STEPS = {
    "closure": closure_step,
    "partial": partial_step,
    "engine method": lambda lin: Engine(lin).step,
}


@pytest.mark.parametrize("how", sorted(STEPS))
def test_an_assigned_weight_of_a_module_the_step_reaches_is_refused_then_refreshed(backend: str, how: str) -> None:
    device = device_of(backend)
    lin = torch.nn.Linear(WIDTH, WIDTH).to(device)
    reg = cg.GraphRegistry(STEPS[how](lin), INPUTS, backend=backend)
    reg.capture(PLAN)
    lin.load_state_dict(fresh_state(lin, 1), assign=True)
    with pytest.raises(cg.WeightsMovedError, match=r"weight moved"):
        reg.run(B.decode(3), x=x_of(3, device))
    result = reg.refresh()
    assert result.kept == () and set(result.recaptured) == {(e.descriptor, e.strategy) for e in PLAN} and result.moved
    x = x_of(3, device, seed=2)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B.decode(3), x=x), lin(x))


def test_a_module_the_step_reads_through_its_globals_is_watched() -> None:
    reg = cg.GraphRegistry(global_step, INPUTS, backend="cpu")
    reg.capture(PLAN)
    saved = GLOBAL_LINEAR.state_dict()
    try:
        GLOBAL_LINEAR.load_state_dict(fresh_state(GLOBAL_LINEAR, 1), assign=True)
        with pytest.raises(cg.WeightsMovedError):
            reg.run(B.decode(3), x=x_of(3, torch.device("cpu")))
        assert reg.refresh().moved
        x = x_of(3, torch.device("cpu"))
        with torch.inference_mode():
            torch.testing.assert_close(reg.run(B.decode(3), x=x), GLOBAL_LINEAR(x))
    finally:
        GLOBAL_LINEAR.load_state_dict(saved, assign=True)


def test_modules_in_a_dict_the_step_reads_are_watched() -> None:
    modules = {"lin": torch.nn.Linear(WIDTH, WIDTH), "name": "a string"}
    reg = cg.GraphRegistry(lambda batch, x: modules["lin"](x), INPUTS, backend="cpu")
    reg.capture(PLAN)
    modules["lin"].load_state_dict(fresh_state(modules["lin"], 1), assign=True)
    with pytest.raises(cg.WeightsMovedError, match=r"modules\['lin'\]\.weight moved"):
        reg.run(B.decode(3), x=x_of(3, torch.device("cpu")))


class Holder:
    """The engine's parts three levels down, and a table too large to look into."""

    def __init__(self) -> None:
        self.parts = {"model": {"lin": torch.nn.Linear(WIDTH, WIDTH)}}
        self.table = {i: torch.nn.Linear(WIDTH, WIDTH) for i in range(300)}


def test_modules_held_a_few_levels_down_in_an_engine_object_are_watched() -> None:
    holder = Holder()
    reg = cg.GraphRegistry(lambda batch, x: holder.parts["model"]["lin"](x), INPUTS, backend="cpu")
    capture_quietly(reg, PLAN)
    assert "holder.parts['model']['lin'].weight" in reg.watched()


def test_a_step_whose_modules_cannot_be_found_is_warned_about_at_capture() -> None:
    holder = Holder()
    reg = cg.GraphRegistry(lambda batch, x: holder.table[7](x), INPUTS, backend="cpu")
    with pytest.warns(RuntimeWarning, match=r"found no module the step reads, and it reads 'holder.table' .*reg\.watch\(model\)"):
        reg.capture(PLAN)
    reg.watch(holder.table[7])  # the engine says what it reads: no more warning
    capture_quietly(reg, cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[2]))


def test_a_step_that_reads_no_state_is_not_warned_about() -> None:
    reg = cg.GraphRegistry(lambda batch, x: torch.tanh(x) + 1, INPUTS, backend="cpu")
    capture_quietly(reg, PLAN)


def test_a_tensor_in_a_closure_moved_by_data_assignment_is_found_by_refresh() -> None:
    w = torch.randn(WIDTH, WIDTH)
    reg = cg.GraphRegistry(lambda batch, x: x @ w, INPUTS, backend="cpu")
    reg.capture(PLAN)
    w.data = torch.randn(WIDTH, WIDTH)  # announces nothing: refresh() compares
    result = reg.refresh()
    assert result.moved and result.moved[0].startswith("w moved from") and result.kept == ()
    x = x_of(3, torch.device("cpu"))
    torch.testing.assert_close(reg.run(B.decode(3), x=x), x @ w)


def test_a_later_capture_does_not_rearm_graphs_that_read_moved_weights(backend: str) -> None:
    device = device_of(backend)
    lin = Model().to(device)
    reg = cg.GraphRegistry(lin, INPUTS, backend=backend)  # a module as the step: watched
    reg.capture(PLAN)
    lin.load_state_dict(fresh_state(lin, 1), assign=True)
    with pytest.raises(cg.WeightsMovedError):
        reg.run(B.decode(3), x=x_of(3, device))
    # One more key, captured after the move: it reads the new weights and serves; the old graphs stay refused.
    reg.capture([(B.decode(2), "full")])
    x = x_of(2, device)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B.decode(2), x=x), lin(B.decode(2), x))
        with pytest.raises(cg.WeightsMovedError):
            reg.run(B.decode(3), x=x_of(3, device))
    result = reg.refresh()
    assert (B.decode(2), "full") in result.kept and set(result.recaptured) == {(e.descriptor, e.strategy) for e in PLAN}
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B.decode(3), x=x_of(3, device)), lin(B.decode(3), x_of(3, device)))


def test_refresh_outside_the_autocast_block_does_not_let_a_replay_outside_it_through(backend: str) -> None:
    device = device_of(backend)
    lin = Model().to(device)
    reg = cg.GraphRegistry(lin, INPUTS, backend=backend)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        reg.capture(PLAN)
        assert reg.run(B.decode(3), x=x_of(3, device)).dtype == torch.bfloat16
    with torch.no_grad():
        lin.linear.weight.mul_(2)  # an in-place sync, outside the block
    assert reg.refresh().recaptured == ()
    with pytest.raises(cg.ServingStateError, match=rf"no autocast now, autocast\({device.type}, torch.bfloat16\) at capture"):
        reg.run(B.decode(3), x=x_of(3, device))
    with torch.autocast(device.type, dtype=torch.bfloat16), torch.inference_mode():
        x = x_of(3, device)
        torch.testing.assert_close(reg.run(B.decode(3), x=x), lin(B.decode(3), x))


def test_watch_after_capture_keeps_every_graph_at_the_next_in_place_refresh() -> None:
    lin, other = Model(), torch.nn.Linear(WIDTH, WIDTH)
    reg = cg.GraphRegistry(lin, INPUTS, backend="cpu")
    reg.capture(PLAN)
    reg.watch(other)
    with torch.no_grad():
        lin.linear.weight.add_(1)
    result = reg.refresh()
    assert result.recaptured == () and result.moved == () and len(result.kept) == len(PLAN)


class Attention(torch.nn.Module):
    """Reads the per-request lengths of the live batch from the payload, as a varlen kernel launch does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lens = cg.current_batch().payload or []  # the line a frozen read is reported at
        scale = torch.ones(x.shape[0], 1, device=x.device)
        for r, n in enumerate(lens[: x.shape[0]]):
            scale[r] = n
        return x * scale


@cg.eager_break
def marked_attention(x: torch.Tensor) -> torch.Tensor:
    lens = cg.current_batch().payload or []
    scale = torch.ones(x.shape[0], 1)
    for r, n in enumerate(lens[: x.shape[0]]):
        scale[r] = n
    return x * scale


def test_reading_the_payload_outside_an_eager_break_while_recording_is_warned_at_the_line(backend: str) -> None:
    attention = Attention()
    reg = cg.GraphRegistry(lambda batch, x: attention(x) + 1, INPUTS, backend=backend)
    plan = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=MAX_TOKENS)  # full_and_breakable, the default
    with pytest.warns(cg.FrozenReadWarning, match=r"current_batch\(\)\.payload read while capturing .*outside an eager break") as record:
        reg.capture(plan, context=[1, 1, 1, 1])
    frozen = [w for w in record if issubclass(w.category, cg.FrozenReadWarning)]
    assert frozen[0].filename == __file__ and "payload" in open(__file__).readlines()[frozen[0].lineno - 1]


def test_a_mixed_key_captured_with_no_eager_break_while_the_step_reads_the_batch_is_warned_about_once() -> None:
    reg = cg.GraphRegistry(lambda batch, x: x * len(cg.current_batch().payload or ()), INPUTS, backend="cpu")
    plan = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=MAX_TOKENS)
    with pytest.warns(RuntimeWarning, match=r"captured the mixed key .*\[breakable\] with no eager break, and the step") as record:
        reg.capture(plan)
    no_break = [w for w in record if "with no eager break" in str(w.message)]
    assert len(no_break) == 1 and no_break[0].filename == __file__, "once, pointing at the engine's capture() call"
    keyed = cg.GraphRegistry(lambda batch, x: x * cg.current_batch().key.num_tokens, INPUTS, backend="cpu")
    quiet = cg.GraphRegistry(lambda batch, x: torch.tanh(x), INPUTS, backend="cpu")  # no host code: nothing to say
    capture_quietly(keyed, plan)  # the key is what the graph is captured for: reading it is not a frozen read
    capture_quietly(quiet, plan)


def test_reading_the_actual_batch_outside_an_eager_break_while_recording_is_warned() -> None:
    reg = cg.GraphRegistry(lambda batch, x: x * cg.current_batch().actual.num_tokens, INPUTS, backend="cpu")
    with pytest.warns(cg.FrozenReadWarning, match=r"current_batch\(\)\.actual read while capturing Batch\(tokens=8.* \[full\]"):
        reg.capture(PLAN)


def test_a_marked_function_reading_the_payload_is_not_warned_about_and_serves_the_live_lengths() -> None:
    reg = cg.GraphRegistry(lambda batch, x: marked_attention(x) + 1, INPUTS, backend="cpu")
    plan = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=MAX_TOKENS)
    capture_quietly(reg, plan)
    batch = B(7, 4, uniform=False)
    x = torch.randn(7, WIDTH)
    with torch.inference_mode(), cg.eager_batch(batch, [1, 3, 2, 1]):
        want = marked_attention(x) + 1
    torch.testing.assert_close(reg.run(batch, x=x, context=[1, 3, 2, 1]), want)
    assert reg.match(batch).strategy == "breakable"


LOG = logging.getLogger("an-engine")
W = torch.randn(WIDTH, WIDTH)


def test_a_step_that_logs_or_waits_on_an_event_is_not_warned_about() -> None:
    """A logger, a lock or an event the step uses holds no weight: the step reads a tensor (watched) and nothing that
    was not looked into, so no warning."""
    ready = threading.Event()
    ready.set()

    def step(batch: cg.BatchDescriptor, x: torch.Tensor) -> torch.Tensor:
        LOG.debug("step %s", batch)
        if not ready.is_set():
            raise RuntimeError("served before the engine was ready")
        return torch.tanh(x @ W)

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    capture_quietly(reg, PLAN)
    assert "W" in reg.watched()


def test_a_tensor_the_engine_names_does_not_silence_the_warning_about_a_holder_not_looked_into() -> None:
    """``reg.watch((name, tensor))`` pins that tensor object: a module replaced by assignment in a holder the walk
    could not look into would still go unseen, so the warning stays until a module is watched."""
    holder = Holder()
    reg = cg.GraphRegistry(lambda batch, x: holder.table[7](x), INPUTS, backend="cpu")
    reg.watch([(f"table7.{name}", t) for name, t in holder.table[7].named_parameters()])
    with pytest.warns(RuntimeWarning, match=r"found no module the step reads, and it reads 'holder.table'"):
        reg.capture(PLAN)


def each_assign_is_refused_then_captured_again(reg: cg.GraphRegistry, step: Any, models: list[torch.nn.Module]) -> None:
    """For each of ``models`` in turn, new weights by assignment: the next replay is refused, ``refresh()`` captures
    again, and the graphs then equal eager (``step``)."""
    for seed, model in enumerate(models):
        model.load_state_dict(fresh_state(model, seed), assign=True)
        with pytest.raises(cg.WeightsMovedError):
            reg.run(B.decode(4), x=torch.randn(4, WIDTH))
        assert reg.refresh().recaptured
        x = torch.randn(4, WIDTH)
        torch.testing.assert_close(reg.run(B.decode(4), x=x), step(B.decode(4), x))


def test_models_behind_standard_library_objects_are_watched() -> None:
    """A model the step reaches through standard-library objects (a Future's result, an attribute of a Logger, a
    LoggerAdapter's extra) is watched: an assigned weight is refused, then captured again by refresh()."""
    future: concurrent.futures.Future[torch.nn.Module] = concurrent.futures.Future()
    future.set_result(torch.nn.Linear(WIDTH, WIDTH))
    logger = logging.getLogger("an-engine.models")
    logger.model = torch.nn.Linear(WIDTH, WIDTH)  # type: ignore[attr-defined]
    adapter = logging.LoggerAdapter(logger, {"model": torch.nn.Linear(WIDTH, WIDTH)})

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return adapter.extra["model"](logger.model(future.result()(x)))  # type: ignore[attr-defined,index]

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    with torch.no_grad():
        reg.capture(PLAN)
        each_assign_is_refused_then_captured_again(reg, step, [future.result(), logger.model,  # type: ignore[attr-defined]
                                                               adapter.extra["model"]])  # type: ignore[index]


def test_a_step_in_an_engine_module_named_like_the_standard_librarys_is_read(monkeypatch: pytest.MonkeyPatch,
                                                                              tmp_path: Any) -> None:
    """An engine's own module named like one of the standard library's (its ``profile.py``, say) is not the standard
    library's: the model its step reads is watched, so an assigned weight is found."""
    module = types.ModuleType("profile")
    module.__file__ = str(tmp_path / "profile.py")
    monkeypatch.setitem(sys.modules, "profile", module)
    exec("import torch\nMODEL = torch.nn.Linear(8, 8)\ndef step(batch, x):\n    return MODEL(x)\n", module.__dict__)
    reg = cg.GraphRegistry(module.step, INPUTS, backend="cpu")
    with torch.no_grad():
        reg.capture(PLAN)
        assert "MODEL.weight" in reg.watched()
        module.MODEL.load_state_dict({k: torch.randn_like(v) for k, v in module.MODEL.state_dict().items()}, assign=True)
        with pytest.raises(cg.WeightsMovedError):
            reg.run(B.decode(4), x=torch.randn(4, WIDTH))


def test_a_model_held_in_a_thread_local_or_an_engines_thread_object_is_watched() -> None:
    """Objects of threading's own classes hold no weight; an engine's per-thread state (``threading.local``) or its
    own Thread subclass may: the models in them are watched, so an assigned weight is refused."""

    class Worker(threading.Thread):
        def __init__(self) -> None:
            super().__init__(daemon=True)
            self.model = torch.nn.Linear(WIDTH, WIDTH)

    state, worker = threading.local(), Worker()
    state.model = torch.nn.Linear(WIDTH, WIDTH)
    reg = cg.GraphRegistry(lambda batch, x: worker.model(state.model(x)), INPUTS, backend="cpu")
    with torch.no_grad():
        reg.capture(PLAN)
        assert {"state.model.weight", "worker.model.weight"} <= set(reg.watched()), reg.watched()
        each_assign_is_refused_then_captured_again(reg, lambda batch, x: worker.model(state.model(x)),
                                                   [state.model, worker.model])


def test_models_behind_a_cached_getter_or_a_class_attribute_are_watched() -> None:
    """A model the step reaches through a ``functools.cache`` getter (the walk follows what the cache wraps) or as an
    attribute of an engine class (``Engine.model``): an assigned weight is refused, then captured again."""
    cached, held = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    @functools.cache
    def get_model() -> torch.nn.Module:
        return cached

    class Engine:
        model = held

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return Engine.model(get_model()(x))

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    with torch.no_grad():
        reg.capture(PLAN)
        each_assign_is_refused_then_captured_again(reg, step, [cached, held])


class _Models(enum.Enum):
    """An engine's models as enum members (``Models.DRAFT.value``)."""

    MAIN = (torch.nn.Linear(WIDTH, WIDTH),)


def test_models_in_sets_dict_views_user_lists_enum_members_and_weak_references_are_watched() -> None:
    """A model the step reaches through a set, a frozenset, a dict's values or items view, a ``UserList``, an enum
    member's value or a weak reference: an assigned weight is refused, then captured again by refresh()."""
    in_set, in_frozenset, in_values, in_items, in_user_list, referred = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(6))
    models_set, models_frozen = {in_set}, frozenset({in_frozenset})
    values, items = {"m": in_values}.values(), {"m": in_items}.items()  # views: their pairs are made anew at each read
    user_list, ref = collections.UserList([in_user_list]), weakref.ref(referred)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        for model in (*models_set, *models_frozen, *values, *(m for _, m in items), user_list[0], _Models.MAIN.value[0], ref()):
            x = model(x)
        return x

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    capture_quietly(reg, PLAN)  # and no warning that the step reads something not looked into
    with torch.no_grad():
        each_assign_is_refused_then_captured_again(
            reg, step, [in_set, in_frozenset, in_values, in_items, in_user_list, _Models.MAIN.value[0], referred])


def test_a_model_taken_out_of_a_set_is_refused() -> None:
    """A set's member replaced by another model: the old graphs are refused, and refresh() watches the new member."""
    old, new = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    models = {old}

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return next(iter(models))(x)

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    reg.capture(PLAN)
    models.clear()
    models.add(new)
    assert reg.refresh().recaptured
    with torch.no_grad():
        x = torch.randn(4, WIDTH)
        torch.testing.assert_close(reg.run(B.decode(4), x=x), new(x))
        each_assign_is_refused_then_captured_again(reg, step, [new])


def _reached_through(way: str) -> tuple[Any, torch.nn.Module]:
    """A step that reads its model ``way``, and the model."""
    model = torch.nn.Linear(WIDTH, WIDTH)
    if way == "an engine Set whose iteration makes handles":
        class Handle:
            def __init__(self, held: torch.nn.Module) -> None:
                self.model = held

        class Models(collections.abc.Set):  # type: ignore[type-arg]
            def __init__(self, *held: torch.nn.Module) -> None:
                self._models = list(held)

            def __iter__(self):  # type: ignore[no-untyped-def]
                return (Handle(m) for m in self._models)

            def __len__(self) -> int:
                return len(self._models)

            def __contains__(self, item: object) -> bool:
                return any(item is m for m in self._models)

        models = Models(model)
        return (lambda batch, x: next(iter(models)).model(x)), model
    if way == "an engine's subclass of set":
        class ModelSet(set):  # type: ignore[type-arg]
            def __iter__(self):  # type: ignore[no-untyped-def]  # code of its own, which the walk does not run
                yield from super().__iter__()

        held = ModelSet([model])
        return (lambda batch, x: next(iter(held))(x)), model
    if way == "an attribute of a set subclass":
        class Named(set):  # type: ignore[type-arg]
            def __iter__(self):  # type: ignore[no-untyped-def]
                return iter(self.models)

        named = Named({"main"})
        named.models = [model]  # type: ignore[attr-defined]
        return (lambda batch, x: next(iter(named))(x)), model
    if way == "a tuple class of its own hashing, in a set":
        class Slot(tuple):  # type: ignore[type-arg]
            def __hash__(self) -> int:
                return hash(self[0])

            def __eq__(self, other: object) -> bool:
                return isinstance(other, Slot) and self[0] == other[0]

        slots = {Slot(("main", model))}
        return (lambda batch, x: next(iter(slots))[1](x)), model
    if way == "an attribute of an enum member whose value is a code":
        class Layer(enum.Enum):
            FIRST = 1

        Layer.FIRST.model = model  # type: ignore[attr-defined]
        return (lambda batch, x: [layer.model for layer in Layer][0](x)), model
    if way == "a member of a big enum's neighbour":
        Op = enum.Enum("Op", {f"OP{i}": object() for i in range(5000)})  # noqa: N806  # more members than the walk reads

        class Holder:
            model = None

        holder = Holder()
        holder.model = model
        return (lambda batch, x: holder.model(x) if Op.OP0 else x), model
    if way in ("an enum iterated", "an enum member by name"):
        Models = enum.Enum("Models", {"MAIN": (model,)})  # noqa: N806
        if way == "an enum iterated":
            return (lambda batch, x: [m.value[0] for m in Models][0](x)), model
        return (lambda batch, x: Models["MAIN"].value[0](x)), model
    if way == "a dict's key":
        counts = collections.Counter([model])
        return (lambda batch, x: next(iter(counts))(x)), model
    if way == "a WeakSet":
        weak = weakref.WeakSet([model])
        return (lambda batch, x: next(iter(weak))(x)), model
    if way == "a WeakMethod":
        method = weakref.WeakMethod(model.forward)
        return (lambda batch, x: method()(x)), model  # type: ignore[misc]
    if way == "a ContextVar":
        var: contextvars.ContextVar[torch.nn.Module] = contextvars.ContextVar("model")
        var.set(model)
        return (lambda batch, x: var.get()(x)), model
    if way == "functools.singledispatch":
        held = {"m": model}

        @functools.singledispatch
        def apply(x: object) -> torch.Tensor:
            raise NotImplementedError

        @apply.register(torch.Tensor)
        def _(x: torch.Tensor) -> torch.Tensor:
            return held["m"](x)

        return (lambda batch, x: apply(x)), model

    class Engine:  # an object with no attributes of its own: its class holds the model and the helpers
        main = model

        @staticmethod
        def by_static(x: torch.Tensor) -> torch.Tensor:
            return Engine.main(x)

        @classmethod
        def by_class(cls, x: torch.Tensor) -> torch.Tensor:
            return cls.main(x)

        def _run(self, which: str, x: torch.Tensor) -> torch.Tensor:
            return self.main(x)

        run_main = functools.partialmethod(_run, "main")

    engine = Engine()
    return {"a staticmethod": lambda batch, x: engine.by_static(x), "a classmethod": lambda batch, x: engine.by_class(x),
            "a partialmethod": lambda batch, x: engine.run_main(x),
            "a class attribute read through an object": lambda batch, x: engine.main(x)}[way], model


@pytest.mark.parametrize("way", [
    "an engine Set whose iteration makes handles", "an engine's subclass of set", "a member of a big enum's neighbour",
    "an attribute of a set subclass", "a tuple class of its own hashing, in a set",
    "an attribute of an enum member whose value is a code",
    "an enum iterated",
    "an enum member by name", "a dict's key", "a WeakSet", "a WeakMethod", "a ContextVar", "functools.singledispatch",
    "a staticmethod", "a classmethod", "a partialmethod", "a class attribute read through an object",
])
def test_a_model_reached_this_way_is_watched(way: str) -> None:
    step, model = _reached_through(way)
    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    capture_quietly(reg, PLAN)
    with torch.no_grad():
        each_assign_is_refused_then_captured_again(reg, step, [model])


def test_a_set_reordered_or_a_dict_moved_to_end_refuses_nothing_and_frees_what_leaves() -> None:
    """Members are named by what they are, not where iteration met them: a set grown and shrunk back, or an LRU's
    move_to_end, changes no watched name; a model taken out of a set is not kept alive by the watch."""
    kept, other, lru = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH), collections.OrderedDict()
    models = {kept, other}
    lru["a"], lru["b"] = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    adapters = lru.values()

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return sum(m(x) for m in (*models, *adapters))  # in any order (a graph keeps the order it was captured in)

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    with torch.no_grad():
        reg.capture(PLAN)
        for _ in range(20):
            models.add(torch.nn.Linear(WIDTH, WIDTH))
        models.intersection_update({kept, other})
        lru.move_to_end("a")
        assert reg.refresh().recaptured == ()
        x = torch.randn(4, WIDTH)
        torch.testing.assert_close(reg.run(B.decode(4), x=x), step(B.decode(4), x))
        gone = weakref.ref(other)
        models.discard(other)
        del other
        reg.refresh()
        gc.collect()
        assert gone() is None, "the watch holds no model the engine let go of"


def test_a_large_set_of_ids_is_no_reason_to_warn() -> None:
    """Stop-token ids, a vocabulary: a container larger than the walk looks into, of values that hold no tensor."""
    weight, stop_ids = torch.randn(WIDTH, WIDTH), set(range(1000))  # no module: the warning's case

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return x @ weight * (0 in stop_ids)

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    capture_quietly(reg, PLAN)


def test_a_model_in_a_context_variable_is_watched_from_the_capture_thread() -> None:
    """The capture thread reads the engine's context variables as the step saw them (its own context has none): a
    background capture of a step reading a ContextVar's model is installed, replays, and refuses an assign."""
    model = torch.nn.Linear(WIDTH, WIDTH)
    var: contextvars.ContextVar[torch.nn.Module] = contextvars.ContextVar("engine-model")
    var.set(model)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return var.get()(x)

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    with torch.no_grad():
        reg.capture(PLAN, background=True)
        assert reg.wait_captured(timeout=30) and len(reg) == len(PLAN), reg.stats()
        assert reg.refresh().recaptured == ()
        x = torch.randn(4, WIDTH)
        torch.testing.assert_close(reg.run(B.decode(4), x=x), model(x))
        assert reg.stats().hits == 1
        each_assign_is_refused_then_captured_again(reg, step, [model])


def test_a_context_variable_rebound_to_another_model_after_capture_is_refused_not_served_stale() -> None:
    """The engine binds its model in a ContextVar, captures, then binds another model (a sync that builds a new one)
    or serves from a thread where nothing is bound: a replay would compute with the model capture() saw, so run()
    refuses, naming the variable, before and after refresh(); back on the binding of capture() it serves again, and
    clear() and capture() under the new binding serve the new model as eager does."""
    old, new = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    var: contextvars.ContextVar[torch.nn.Module] = contextvars.ContextVar("engine-model")

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return var.get()(x)

    def serve() -> None:
        reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
        x = torch.randn(4, WIDTH)
        with torch.no_grad():
            token = var.set(old)
            capture_quietly(reg, PLAN)
            torch.testing.assert_close(reg.run(B.decode(4), x=x), old(x))
            var.set(new)
            captured = [(e.key, e.capture_seconds) for e in reg.entries()]
            for call in (lambda: reg.run(B.decode(4), x=x), reg.refresh, lambda: reg.run(B.decode(4), x=x)):
                with pytest.raises(cg.ServingStateError, match=r"var.get\(\) \(read through ContextVar 'engine-model'\) "
                                   r"is Linear at 0x[0-9a-f]+ now, Linear at 0x[0-9a-f]+ at capture.*clear\(\) and "
                                   r"capture\(\) again under the new binding"):
                    call()
            assert [(e.key, e.capture_seconds) for e in reg.entries()] == captured, "refresh() captured nothing again"
            elsewhere: list[BaseException] = []
            thread = threading.Thread(target=lambda: _refused_on(reg, x, elsewhere))
            thread.start()
            thread.join(30)
            assert elsewhere and isinstance(elsewhere[0], cg.errors.OwnerThreadError), elsewhere  # another thread: refused
            synced: list[object] = []
            thread = threading.Thread(target=lambda: synced.append(reg.call_on_owner(reg.refresh)))  # a weight-sync
            thread.start()  # thread binds nothing, and hands the refresh over to the serving thread
            thread.join(30)
            reg.capture_pending(0)  # the refresh runs here, under the serving thread's binding: refused as above
            assert len(synced) == 1 and "ContextVar 'engine-model'" in str(synced[0].exception(timeout=0))
            with torch.autocast("cpu", dtype=torch.bfloat16):  # another autocast and the rebound variable: both named
                with pytest.raises(cg.ServingStateError, match=r"autocast\(cpu, torch.bfloat16\) now, no autocast at "
                                   r"capture; var.get\(\) \(read through ContextVar 'engine-model'\)"):
                    reg.run(B.decode(4), x=x)
            var.reset(token)
            var.set(old)
            with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(cg.ServingStateError, match="autocast"):
                reg.run(B.decode(4), x=x)
            old.weight.mul_(2)  # an in-place sync: refresh() keeps every graph, the replay reads the new values
            assert reg.refresh().recaptured == ()
            torch.testing.assert_close(reg.run(B.decode(4), x=x), old(x))
            var.set(new)
            reg.clear()
            capture_quietly(reg, PLAN)
            torch.testing.assert_close(reg.run(B.decode(4), x=x), new(x))
            assert reg.stats().hits == 3

    contextvars.copy_context().run(serve)


class _Holder:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


_GLOBAL_MODELS = {"first": torch.nn.Linear(WIDTH, WIDTH), "second": torch.nn.Linear(WIDTH, WIDTH)}


def _first(x: torch.Tensor) -> torch.Tensor:
    return _GLOBAL_MODELS["first"](x)


def _second(x: torch.Tensor) -> torch.Tensor:
    return _GLOBAL_MODELS["second"](x)


def _closure_over(model: torch.nn.Module) -> Any:
    return lambda x: model(x)


# How an engine may put its model behind a context variable: what to bind for a model, and how the step calls it.
_BEHIND_A_VAR = {
    "the model": (lambda m: m, lambda v, x: v(x)),
    "a set of one model": (lambda m: {m}, lambda v, x: next(iter(v))(x)),
    "an object's attribute": (_Holder, lambda v, x: v.model(x)),
    "a partial": (lambda m: functools.partial(m), lambda v, x: v(x)),
    "a closure": (_closure_over, lambda v, x: v(x)),
    "a bound method": (lambda m: _Holder(m).forward, lambda v, x: v(x)),
}


@pytest.mark.parametrize("way", [*_BEHIND_A_VAR, "a function reading a global model", "a variable whose default is it",
                                 "two closures each reading a variable named var"])
def test_every_way_a_rebound_context_variable_reaches_another_model_is_refused(way: str) -> None:
    """Whatever the variable holds on the way to the model, a replay in a context where it leads to another model
    is refused; where it leads to the one capture() saw, it serves as eager."""
    old, new = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    if way == "a function reading a global model":
        bind, call, old_value, new_value = None, lambda v, x: v(x), _first, _second
    elif way == "a variable whose default is it":
        bind, call, old_value, new_value = None, lambda v, x: v(x), old, new
    elif way == "two closures each reading a variable named var":
        bind, call, old_value, new_value = None, None, old, new
    else:
        bind, call = _BEHIND_A_VAR[way]
        old_value, new_value = bind(old), bind(new)
    var: contextvars.ContextVar[Any] = (contextvars.ContextVar("engine-model", default=old)
                                        if way == "a variable whose default is it" else contextvars.ContextVar("engine-model"))
    if way == "two closures each reading a variable named var":
        other: contextvars.ContextVar[Any] = contextvars.ContextVar("draft-model")
        first_call, second_call = (lambda var: lambda x: var.get()(x))(other), (lambda var: lambda x: var.get()(x))(var)

        def step(batch: B, x: torch.Tensor) -> torch.Tensor:
            return first_call(x) + second_call(x)
    else:
        def step(batch: B, x: torch.Tensor) -> torch.Tensor:
            return call(var.get(), x)

    def serve() -> None:
        if way == "two closures each reading a variable named var":
            other.set(torch.nn.Linear(WIDTH, WIDTH))
        if way != "a variable whose default is it":
            var.set(old_value)
        reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
        x = torch.randn(4, WIDTH)
        with torch.no_grad():
            capture_quietly(reg, PLAN)
            torch.testing.assert_close(reg.run(B.decode(4), x=x), step(B.decode(4), x))
            token = var.set(new_value)
            with pytest.raises(cg.ServingStateError, match=r"read through ContextVar 'engine-model'"):
                reg.run(B.decode(4), x=x)
            var.reset(token)
            if way in _BEHIND_A_VAR and way not in ("the model", "a bound method"):  # (a method of a new object: refused)
                var.set(bind(old))  # made anew, leading to the same model: the same to a graph
            torch.testing.assert_close(reg.run(B.decode(4), x=x), step(B.decode(4), x))

    contextvars.copy_context().run(serve)


def test_a_per_step_context_leading_to_the_same_model_serves_and_a_background_capture_under_a_rebound_one_ends() -> None:
    """An engine that binds a fresh forward context each step (the same model and cache in it) replays every step;
    a background capture whose variable is rebound meanwhile finishes (it captures under the recorded context, and is
    installed as such) and run() is refused instead of capturing again forever; wake() under it is refused."""

    class ForwardContext:
        def __init__(self, model: torch.nn.Module, cache: torch.Tensor, step: int) -> None:
            self.model, self.cache, self.step = model, cache, step

    model, cache = torch.nn.Linear(WIDTH, WIDTH), torch.zeros(MAX_TOKENS, WIDTH)
    var: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar("forward-context")

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        ctx = var.get()
        return ctx.model(x) + ctx.cache[: x.shape[0]]

    def serve() -> None:
        var.set(ForwardContext(model, cache, 0))
        reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
        with torch.no_grad():
            capture_quietly(reg, PLAN)
            for i in range(1, 4):
                var.set(ForwardContext(model, cache[:], i))  # a new object, and a new view of the same cache
                x = torch.randn(4, WIDTH)
                torch.testing.assert_close(reg.run(B.decode(4), x=x), step(B.decode(4), x))
            assert reg.stats().hits == 3
            reg.clear()
            reg.capture(PLAN, background=True)
            var.set(ForwardContext(torch.nn.Linear(WIDTH, WIDTH), cache, 9))
            assert reg.wait_captured(timeout=30) and len(reg) == len(PLAN)
            with pytest.raises(cg.ServingStateError, match=r"var.get\(\).model \(read through ContextVar 'forward-context'\)"):
                reg.run(B.decode(4), x=torch.randn(4, WIDTH))
            assert reg.stats().stale_captures == 0
            reg.sleep()
            with pytest.raises(cg.ServingStateError, match=r"wake\(\) on registry"):
                reg.wake()

    contextvars.copy_context().run(serve)


def test_what_a_context_variable_held_at_capture_decides_and_clear_lets_it_go() -> None:
    """An adapter variable unset at capture and bound later is refused (the graph has no adapter in it); a model
    reached both through a closure's default and through the variable is still tied to the variable; a keyword
    default and a partial made anew each step over equal values are the same."""
    base, adapter = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    adapters: contextvars.ContextVar[Any] = contextvars.ContextVar("adapter")

    def with_adapter(batch: B, x: torch.Tensor) -> torch.Tensor:
        a = adapters.get(None)
        return base(x) + a(x) if a is not None else base(x)

    old, new = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    forward: contextvars.ContextVar[Any] = contextvars.ContextVar("forward")
    fallback = types.SimpleNamespace(model=old)

    def both_ways(batch: B, x: torch.Tensor, default: Any = fallback) -> torch.Tensor:
        return (forward.get(None) or default).model(x) + default.model(x) * 0

    def keyword(x: torch.Tensor, *, model: torch.nn.Module = old, scale: float = 1.0) -> torch.Tensor:
        return model(x) * scale

    def by_keyword(batch: B, x: torch.Tensor) -> torch.Tensor:
        return forward.get()(x)

    def serve() -> None:
        x = torch.randn(4, WIDTH)
        with torch.no_grad():
            reg = cg.GraphRegistry(with_adapter, INPUTS, backend="cpu")
            capture_quietly(reg, PLAN)
            adapters.set(adapter)
            with pytest.raises(cg.ServingStateError, match=r"ContextVar 'adapter' holds Linear at 0x[0-9a-f]+ now, nothing at capture"):
                reg.run(B.decode(4), x=x)
            adapters.set(None)
            torch.testing.assert_close(reg.run(B.decode(4), x=x), base(x))
            request = contextvars.ContextVar("request-id")

            def logged(batch: B, x: torch.Tensor) -> torch.Tensor:
                request.get(None)  # read for the engine's logs: nothing a graph reads comes through it
                return base(x)

            reg = cg.GraphRegistry(logged, INPUTS, backend="cpu")
            capture_quietly(reg, PLAN)
            request.set("req-17")  # unset at capture, a string now: served
            torch.testing.assert_close(reg.run(B.decode(4), x=x), base(x))

            forward.set(fallback)
            reg = cg.GraphRegistry(both_ways, INPUTS, backend="cpu")
            capture_quietly(reg, PLAN)
            forward.set(types.SimpleNamespace(model=new))
            with pytest.raises(cg.ServingStateError, match=r"forward.get\(\).model \(read through ContextVar 'forward'\)"):
                reg.run(B.decode(4), x=x)
            forward.set(types.SimpleNamespace(model=old))  # made anew over the same model: served
            torch.testing.assert_close(reg.run(B.decode(4), x=x), both_ways(B.decode(4), x))

            forward.set(functools.partial(keyword, scale=float("0.5")))
            reg = cg.GraphRegistry(by_keyword, INPUTS, backend="cpu")
            capture_quietly(reg, PLAN)
            forward.set(functools.partial(keyword, scale=float("0.5")))  # equal values made anew
            torch.testing.assert_close(reg.run(B.decode(4), x=x), old(x) * 0.5)

            def keyword_new(x: torch.Tensor, *, model: torch.nn.Module = new, scale: float = 1.0) -> torch.Tensor:
                return model(x) * scale

            keyword_new.__code__ = keyword.__code__  # the same code, another model as its default
            forward.set(functools.partial(keyword_new, scale=float("0.5")))
            with pytest.raises(cg.ServingStateError, match=r"read through ContextVar 'forward'"):
                reg.run(B.decode(4), x=x)

    contextvars.copy_context().run(serve)


def test_clear_lets_go_of_a_model_a_context_variable_held_at_capture() -> None:
    var: contextvars.ContextVar[Any] = contextvars.ContextVar("model")

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return var.get()(x)

    def serve() -> None:
        model = torch.nn.Linear(WIDTH, WIDTH)
        var.set(model)
        reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
        with torch.no_grad():
            capture_quietly(reg, PLAN)
            reg.run(B.decode(4), x=torch.randn(4, WIDTH))
        gone = weakref.ref(model)
        var.set(torch.nn.Linear(WIDTH, WIDTH))
        del model
        reg.clear()
        gc.collect()
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())] if gone() is not None else ""

    contextvars.copy_context().run(serve)


def _refused_on(reg: cg.GraphRegistry, x: torch.Tensor, errors: list[BaseException]) -> None:
    try:
        reg.run(B.decode(4), x=x)
    except cg.ConcurrentRunError as e:
        errors.append(e)


def test_the_watch_keeps_no_model_alive_that_a_named_tuple_or_a_weak_dictionary_held() -> None:
    """A set of named tuples over models, and a WeakKeyDictionary from a model to its adapter: once the engine lets
    the model go (and refresh() has looked again), nothing of the registry's holds it."""
    Pair = collections.namedtuple("Pair", "name model")  # noqa: PYI024
    pairs, adapters = {Pair("main", torch.nn.Linear(WIDTH, WIDTH))}, weakref.WeakKeyDictionary()
    base = torch.nn.Linear(WIDTH, WIDTH)
    adapters[base] = torch.nn.Linear(WIDTH, WIDTH)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return sum(p.model(x) for p in pairs) + sum(a(x) for a in adapters.values())

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    with torch.no_grad():
        reg.capture(PLAN)
        gone = [weakref.ref(next(iter(pairs)).model), weakref.ref(base)]
        pairs.clear()
        pairs.add(Pair("main", torch.nn.Linear(WIDTH, WIDTH)))
        del base
        reg.refresh()
        gc.collect()
        assert [ref() for ref in gone] == [None, None]
        x = torch.randn(4, WIDTH)
        torch.testing.assert_close(reg.run(B.decode(4), x=x), step(B.decode(4), x))


def test_keys_made_anew_equal_refuse_nothing_and_a_removed_key_is_not_put_back() -> None:
    """An engine that rebuilds its table under equal new keys (frozen dataclasses) changes no watched name; one that
    deletes a layer's entry from a defaultdict does not get it put back (nor a None key) by refresh()."""
    @dataclasses.dataclass(frozen=True)
    class Key:
        name: str

    first, second = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    table: dict[Key, torch.nn.Module] = {Key("first"): first}
    extra: collections.defaultdict[torch.nn.Module, list[torch.nn.Module]] = collections.defaultdict(list)
    extra[first].append(second)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return table[Key("first")](x) + sum((m(x) for ms in extra.values() for m in ms), torch.zeros_like(x))

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu", debug=True)
    with torch.no_grad():
        reg.capture(PLAN)
        table.clear()
        table[Key("first")] = first
        x = torch.randn(4, WIDTH)
        torch.testing.assert_close(reg.run(B.decode(4), x=x), step(B.decode(4), x))
        assert reg.refresh().recaptured == ()
        del extra[first]
        reg.refresh()
        assert list(extra) == [], "refresh() wrote into the engine's defaultdict"
        torch.testing.assert_close(reg.run(B.decode(4), x=x), step(B.decode(4), x))
