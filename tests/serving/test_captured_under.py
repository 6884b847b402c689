"""A graph serves only under what it was captured under: the weights it read where they were, and the serving state.

Whatever path the engine takes (a later capture, refresh(), a step that is a closure over its model), a replay either
computes what eager computes now or is refused with a named error.  Eager is the oracle throughout.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import sys
import threading
import types
from typing import Any

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from tests.conftest import capture_quietly, capture_warned_of_attributes, device_of

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


def test_a_module_the_step_reads_through_its_globals_is_warned_about_and_watched_once_named() -> None:
    """A module-level model is not given to the step: the registry says so once at capture, naming the fix; named with
    ``watch=``, an assigned weight there is refused, then captured again by refresh()."""
    reg = cg.GraphRegistry(global_step, INPUTS, backend="cpu")
    with pytest.warns(RuntimeWarning, match=r"the step reads module-level name 'GLOBAL_LINEAR' \(Linear\), which "
                                             r"the registry cannot see.*watch="):
        reg.capture(PLAN)
    reg = cg.GraphRegistry(global_step, INPUTS, backend="cpu", watch=[GLOBAL_LINEAR])
    capture_quietly(reg, PLAN)
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
    capture_warned_of_attributes(reg, PLAN)
    assert "holder.parts['model']['lin'].weight" in reg.watched()


def test_a_step_whose_modules_cannot_be_found_is_warned_about_at_capture() -> None:
    holder = Holder()
    del holder.parts  # no module the registry can see: the table it did not look into is named
    reg = cg.GraphRegistry(lambda batch, x: holder.table[7](x), INPUTS, backend="cpu")
    with pytest.warns(RuntimeWarning, match=r"the step reads holder\.table \(300 items, not looked into\).*watch"):
        reg.capture(PLAN)
    reg = cg.GraphRegistry(lambda batch, x: holder.table[7](x), INPUTS, backend="cpu", watch=[holder.table[7]])
    capture_quietly(reg, PLAN)  # the engine says what it reads: no warning


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


def test_watch_after_capture_keeps_every_graph_at_a_refresh_after_an_update_in_place() -> None:
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
    """A logger, a lock or an event the step uses holds no weight: the step reads a tensor it is given (watched) and
    nothing the registry cannot see, so no warning; a module-level tensor it reads is named."""
    ready, w = threading.Event(), torch.randn(WIDTH, WIDTH)
    ready.set()

    def step(batch: cg.BatchDescriptor, x: torch.Tensor) -> torch.Tensor:
        LOG.debug("step %s", batch)
        if not ready.is_set():
            raise RuntimeError("served before the engine was ready")
        return torch.tanh(x @ w)

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    capture_quietly(reg, PLAN)
    assert "w" in reg.watched()

    def global_weight(batch: cg.BatchDescriptor, x: torch.Tensor) -> torch.Tensor:
        LOG.debug("step %s", batch)
        return torch.tanh(x @ W)

    with pytest.warns(RuntimeWarning, match=r"the step reads module-level name 'W' \(Tensor\), which"):
        cg.GraphRegistry(global_weight, INPUTS, backend="cpu").capture(PLAN)


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
    library's: the module-level model its step reads is named at capture."""
    module = types.ModuleType("profile")
    module.__file__ = str(tmp_path / "profile.py")
    monkeypatch.setitem(sys.modules, "profile", module)
    exec("import torch\nMODEL = torch.nn.Linear(8, 8)\ndef step(batch, x):\n    return MODEL(x)\n", module.__dict__)
    reg = cg.GraphRegistry(module.step, INPUTS, backend="cpu")
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"module-level name 'MODEL' \(Linear\)"):
        reg.capture(PLAN)


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


def test_a_large_set_of_ids_is_no_reason_to_warn() -> None:
    """Stop-token ids, a vocabulary: a container larger than the walk looks into, of values that hold no tensor."""
    weight, stop_ids = torch.randn(WIDTH, WIDTH), set(range(1000))  # no module: the warning's case

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return x @ weight * (0 in stop_ids)

    reg = cg.GraphRegistry(step, INPUTS, backend="cpu")
    capture_quietly(reg, PLAN)



def test_debug_mode_refuses_a_replay_after_a_module_level_model_was_replaced() -> None:
    """The registry cannot see a module-level model (it says so at capture); debug mode watches what the step's code
    names there, so a replay after an assign sync is refused naming the weight instead of serving the old memory."""
    reg = cg.GraphRegistry(global_step, INPUTS, backend="cpu", debug=True)
    with pytest.warns(RuntimeWarning, match="module-level name 'GLOBAL_LINEAR'"):
        reg.capture(PLAN)
    saved = GLOBAL_LINEAR.state_dict()
    try:
        GLOBAL_LINEAR.load_state_dict(fresh_state(GLOBAL_LINEAR, 1), assign=True)
        with pytest.raises(cg.WeightsMovedError, match=r"GLOBAL_LINEAR\.weight moved"):
            reg.run(B.decode(3), x=x_of(3, torch.device("cpu")))
    finally:
        GLOBAL_LINEAR.load_state_dict(saved, assign=True)
