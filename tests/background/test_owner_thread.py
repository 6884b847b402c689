"""A registry belongs to one thread, the one that serves it: another thread's run() or change to its graphs is refused
with an error naming the owner, or handed over with call_on_owner() to run before the owner's next step, so nothing
that changes graphs ever runs beside a replay; reading it is free from any thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.errors import OwnerThreadError
from tests.background.test_background import PLAN, Engine, batch_inputs, eager, make
from tests.serving_threads import run_in_thread


def on_another_thread(fn: Callable[[], Any], name: str = "trainer") -> dict[str, Any]:
    """``fn()`` on a thread named ``name``: its result or error (``{"value": ...}`` or ``{"error": ...}``)."""
    finished, result = run_in_thread(fn, 30, name=name)
    assert finished
    return result


CHANGES: dict[str, Callable[[cg.GraphRegistry], Any]] = {
    "run()": lambda reg: reg.run(*_batch()[:1], **_batch()[1]),
    "capture()": lambda reg: reg.capture([(B.decode(2), "full")]),
    "capture(background)": lambda reg: reg.capture([(B.decode(2), "full")], background=True),
    "refresh()": lambda reg: reg.refresh(),
    "sleep()": lambda reg: reg.sleep(),
    "wake()": lambda reg: reg.wake(),
    "release()": lambda reg: reg.release(B.decode(4)),
    "clear()": lambda reg: reg.clear(),
    "estimate_memory()": lambda reg: reg.estimate_memory([(B.decode(2), "full")]),
    "capture_pending()": lambda reg: reg.capture_pending(1.0),
    "watch()": lambda reg: reg.watch([("bias", torch.zeros(4))]),
}


def _batch() -> tuple[B, dict[str, torch.Tensor]]:
    return batch_inputs(3, 0)


@pytest.mark.parametrize("call", list(CHANGES))
def test_a_call_that_changes_graphs_or_runs_the_step_from_another_thread_is_refused_naming_the_owner(call: str) -> None:
    engine = Engine()
    reg = make(engine)
    reg.capture([(B.decode(4), "full"), (B.decode(8), "full")])
    reg.capture([(B.decode(16), "full")], background=True)
    before = (sorted(str(e.key) for e in reg.entries()), reg.capturing(), reg.stats().hits, len(engine.calls), reg.watched())
    outcome = on_another_thread(lambda: CHANGES[call](reg))
    error = outcome.get("error")
    assert isinstance(error, OwnerThreadError) and isinstance(error, cg.ConcurrentRunError), outcome
    assert f"{call.split('(')[0]}() on registry" in str(error)
    assert "from thread 'trainer'" in str(error) and "belongs to thread 'MainThread'" in str(error)
    assert "reg.call_on_owner" in str(error)
    after = (sorted(str(e.key) for e in reg.entries()), reg.capturing(), reg.stats().hits, len(engine.calls), reg.watched())
    assert after == before, "a refused call changed nothing and ran no step"


def test_reading_the_registry_from_another_thread_is_free() -> None:
    reg = make(Engine())
    reg.capture(PLAN)
    reg.capture([(B.decode(3), "full")], background=True)
    batch, _ = batch_inputs(3, 0)
    outcome = on_another_thread(lambda: (
        reg.stats(), reg.entries(), reg.explain(batch), reg.match(batch), reg.capturing(), reg.pending(),
        reg.snapshot(), reg.table(), reg.failures(), reg.memory_bytes(), reg.watched(), len(reg), reg.owner))
    assert "value" in outcome, outcome
    assert outcome["value"][-1] == "MainThread"


class Served:
    """A step that writes a KV cache and reads a model (a module the registry watches, as the step's closure cell)."""

    def __init__(self) -> None:
        self.engine = Engine()
        self.model = nn.Linear(16, 16)
        engine, model = self.engine, self.model

        def step(batch: B, input_ids: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
            return model(engine.step(batch, input_ids, slot_mapping))

        self.step = step

    def eager(self, batch: B, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(eager(self.engine, batch, inputs))


@pytest.mark.parametrize("sync", ["load_weights", "assign and refresh"])
def test_a_trainer_thread_hands_its_weight_syncs_to_the_serving_loop_and_every_step_equals_eager(sync: str) -> None:
    """The serving loop calls run() back to back on a step that writes a KV cache; a trainer thread syncs new weights:
    called directly, refresh() and load_weights() are refused; handed over with call_on_owner() the sync runs before
    one of the owner's steps.  Every step equals eager under the weights current at that step, also while keys are
    captured again between steps, and every sync is applied."""
    served = Served()
    reg = cg.GraphRegistry(served.step, {
        "input_ids": cg.StaticInput((64,), torch.long, fill=0),
        "slot_mapping": cg.StaticInput((64,), torch.long, fill=127),
    }, backend="cpu")
    reg.capture(PLAN)
    syncs, refused, stop = [], [], threading.Event()

    def sync_weights(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        new = {"weight": torch.randn(16, 16, generator=g), "bias": torch.randn(16, generator=g)}
        if sync == "load_weights":
            assert reg.load_weights(new) == ("weight", "bias")
        else:
            served.model.load_state_dict(new, assign=True)
            reg.refresh(background=True)

    def trainer() -> None:
        for seed in range(5):
            for direct in (reg.refresh, lambda: reg.load_weights({})):
                try:
                    direct()
                except OwnerThreadError as exc:
                    refused.append(exc)
            syncs.append(reg.call_on_owner(sync_weights, seed))
            syncs[-1].result(timeout=30)  # applied before one of the owner's steps
        stop.set()

    thread = threading.Thread(target=trainer, name="trainer")
    thread.start()
    steps = 0
    with torch.no_grad():
        while not stop.is_set() or steps < 50:
            batch, inputs = batch_inputs(1 + steps % 16, steps)
            out = reg.run(batch, **inputs)
            torch.testing.assert_close(out, served.eager(batch, inputs), atol=1e-5, rtol=1e-5)
            steps += 1
            assert steps < 20_000
    thread.join(30)
    assert len(refused) == 10 and all(s.done() and s.exception() is None for s in syncs)
    assert reg.wait_captured() and len(reg) == len(PLAN)
    if sync == "load_weights":
        assert reg.stats().background_captures == 0, "a sync in place keeps every graph"


def test_calls_handed_over_run_in_order_before_the_next_step_and_report_results_and_errors() -> None:
    order: list[str] = []

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        order.append("step")
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")
    handed = on_another_thread(lambda: [
        reg.call_on_owner(lambda: order.append("first") or 1),
        reg.call_on_owner(lambda: 1 / 0),
        reg.call_on_owner(lambda: order.append("cancelled")),
        reg.call_on_owner(lambda x: order.append(f"last {x}") or x, 7),
    ])
    first, failing, cancelled, last = handed["value"]
    assert cancelled.cancel() and not first.done() and order == []
    reg.run(B(3), x=torch.ones(3))  # no graph: the step runs eagerly, after the handed calls
    assert order == ["first", "last 7", "step"]
    assert first.result() == 1 and last.result() == 7 and isinstance(failing.exception(), ZeroDivisionError)
    now = reg.call_on_owner(lambda: order.append("now") or 2)  # the owner itself, between steps: it runs at once
    assert now.result(timeout=0) == 2 and order[-1] == "now"
    with pytest.raises(TypeError, match="call_on_owner\\(\\) takes a callable"):
        reg.call_on_owner(7)  # type: ignore[arg-type]


def test_adopt_moves_the_registry_to_the_thread_that_serves_it_and_an_ended_owner_leaves_it_to_the_next() -> None:
    engine = Engine()
    reg = make(engine)
    reg.capture(PLAN)
    adopted, go_on, served = threading.Event(), threading.Event(), []

    def serve() -> None:
        reg.adopt()
        adopted.set()
        batch, inputs = batch_inputs(5, 0)
        served.append(reg.run(batch, **inputs))
        assert go_on.wait(30)

    thread = threading.Thread(target=serve, name="serving-loop")
    thread.start()
    assert adopted.wait(30) and reg.owner == "serving-loop"
    with pytest.raises(OwnerThreadError, match="belongs to thread 'serving-loop'"):
        reg.clear()
    go_on.set()
    thread.join(30)
    assert len(served) == 1 and len(reg) == len(PLAN)
    batch, inputs = batch_inputs(5, 1)
    torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
    assert reg.owner == "MainThread", "the owner ended: the next thread that used the registry took it"


def test_wait_captured_on_another_thread_waits_for_the_owners_steps_to_capture_every_key() -> None:
    engine = Engine()
    reg = make(engine, capture_budget=1e-9)
    reg.capture(PLAN, background=True)
    seen: list[list[Any]] = []
    done, result = [False], {}

    def watcher() -> None:
        result["waited"] = reg.wait_captured(timeout=60)
        seen.append(reg.capturing())
        done[0] = True

    thread = threading.Thread(target=watcher)
    thread.start()
    steps = 0
    while not done[0] and steps < 10_000:
        batch, inputs = batch_inputs(1 + steps % 16, steps)
        reg.run(batch, **inputs)
        steps += 1
    thread.join(30)
    assert result == {"waited": True} and seen == [[]] and len(reg) == len(PLAN)
    assert steps >= len(PLAN), "the keys were captured by the owner's steps, one piece a step"
    finished, waited = run_in_thread(lambda: reg.wait_captured(timeout=0), timeout=10)
    assert finished and waited == {"value": True}


def test_a_run_called_back_from_the_step_is_refused_as_a_reentry_not_as_another_thread() -> None:
    holder: list[cg.GraphRegistry] = []

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 5:
            holder[0].run(B(2), x=x[:2])
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")
    holder.append(reg)
    with pytest.raises(cg.ConcurrentRunError, match="from inside a run\\(\\) of the same registry") as info:
        reg.run(B(5), x=torch.ones(5))
    assert not isinstance(info.value, OwnerThreadError)
    for call in ("refresh", "clear", "capture_pending", "sleep"):
        def step_calling(batch: B, x: torch.Tensor, call: str = call) -> torch.Tensor:
            getattr(holder[1], call)(*([0] if call == "capture_pending" else []))
            return x

        holder[1:] = [cg.GraphRegistry(step_calling, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")]
        with pytest.raises(cg.ConcurrentRunError, match=f"{call}\\(\\) on registry .* from inside one of its calls \\(a run\\(\\)"):
            holder[1].run(B(3), x=torch.ones(3))
    torch.testing.assert_close(reg.run(B(3), x=torch.ones(3)), torch.full((3,), 2.0))


def test_an_interrupt_from_the_step_or_a_handed_call_leaves_the_registry_usable_between_steps() -> None:
    interrupt = [False]

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if interrupt[0]:
            interrupt[0] = False
            raise KeyboardInterrupt
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")
    reg.capture([(B(8), "full")])
    x = torch.ones(3)
    interrupt[0] = True
    with pytest.raises(KeyboardInterrupt):
        reg.run(B(3, 3, uniform=False), x=x, exclude=("full",))  # excluded: the step runs eagerly, and is interrupted
    handed = on_another_thread(lambda: reg.call_on_owner(lambda: (_ for _ in ()).throw(KeyboardInterrupt)))["value"]
    with pytest.raises(KeyboardInterrupt):
        reg.run(B(3), x=x)
    assert isinstance(handed.exception(), KeyboardInterrupt)
    assert reg.wait_captured() and reg.refresh().recaptured == ()
    reg.capture([(B(4), "full")], background=True)
    assert reg.capture_pending(None) and len(reg) == 2
    torch.testing.assert_close(reg.run(B(3), x=x), x * 2)
    assert reg.stats().hits == 1


def test_a_thread_given_an_ended_owners_identity_is_the_owner_and_others_are_refused() -> None:
    """The system gives an ended thread's identity to a later thread (glibc reuses a thread's slot), which then passes
    the owner test: that thread is the owner (named so), and no other thread takes the registry over beside it."""
    reg = make(Engine())
    reg.capture(PLAN)
    for _ in range(50):  # until the system hands the ended owner's identity on (most tries, the first)
        ended = threading.Thread(target=reg.adopt, name="old-loop")
        ended.start()
        ended.join(30)
        time.sleep(0.01)  # join() returns before the system thread has quite gone (and its slot is free)
        release, started = threading.Event(), threading.Event()
        later = threading.Thread(target=lambda: (started.set(), release.wait(30)), name="new-loop")
        later.start()
        assert started.wait(30)
        if later.ident == ended.ident:
            break
        release.set()
        later.join(30)
    else:
        pytest.skip("this system gave no new thread an ended thread's identity")
    try:
        assert reg.owner == "new-loop"
        with pytest.raises(OwnerThreadError, match="belongs to thread 'new-loop'"):
            reg.clear()
        assert len(reg) == len(PLAN)
    finally:
        release.set()
        later.join(30)
    assert reg.clear() == len(PLAN) and reg.owner == "MainThread", "once it ended, the next thread took the registry"


def _calling_back_from_the_step(call: Callable[[cg.GraphRegistry], Any]) -> tuple[cg.GraphRegistry, Engine, list[BaseException]]:
    """A registry whose step makes ``call(reg)`` at each of its captures' warm-ups (refused errors kept)."""
    engine = Engine()
    refused: list[BaseException] = []
    step = engine.step

    def calling(batch: B, input_ids: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        if cg.current_batch().key is not None and not refused:
            try:
                call(reg)
            except cg.ConcurrentRunError as exc:
                refused.append(exc)
        return step(batch, input_ids, slot_mapping)

    engine.step = calling  # type: ignore[method-assign]
    reg = make(engine)
    return reg, engine, refused


@pytest.mark.parametrize("call", ["run", "release", "clear", "wait_captured", "adopt from another thread"])
def test_a_call_from_the_step_during_capture_pending_is_refused_and_no_key_is_lost(call: str) -> None:
    calls: dict[str, Callable[[cg.GraphRegistry], Any]] = {
        "run": lambda reg: reg.run(*_batch()[:1], **_batch()[1]),
        "release": lambda reg: reg.release(B.decode(16)),
        "clear": lambda reg: reg.clear(),
        "wait_captured": lambda reg: reg.wait_captured(),
        "adopt from another thread": lambda reg: _raise(on_another_thread(reg.adopt).get("error")),
    }
    reg, engine, refused = _calling_back_from_the_step(calls[call])
    reg.capture([(B.decode(16), "full"), (B.decode(4), "full")], background=True)
    assert reg.capture_pending(None)
    assert len(refused) == 1, "the call was refused"
    assert any(said in str(refused[0]) for said in ("while a run() or a capture is in progress", "from inside")), refused
    assert reg.owner == "MainThread" and len(reg) == 2 and reg.failures() == {} and reg.capturing() == []
    batch, inputs = batch_inputs(3, 1)
    torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def test_capturing_is_read_from_another_thread_while_the_owner_queues_and_captures() -> None:
    reg = make(Engine(), capture_budget=1e-9)
    stop, errors, reads = threading.Event(), [], [0]

    def reader() -> None:
        while not stop.is_set():
            try:
                keys = reg.capturing()
                reg.snapshot()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                return
            assert all(isinstance(pair, tuple) for pair in keys)
            reads[0] += 1

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for round in range(20):
            reg.capture(PLAN, background=True)
            for i in range(6):
                batch, inputs = batch_inputs(1 + (round + i) % 16, i)
                reg.run(batch, **inputs)
            reg.clear()
    finally:
        stop.set()
        thread.join(30)
    assert errors == [] and reads[0] > 0


def test_a_call_handed_to_an_ended_owner_runs_on_the_caller_which_takes_the_registry() -> None:
    reg = make(Engine())
    ended = threading.Thread(target=reg.adopt, name="old-loop")
    ended.start()
    ended.join(30)
    outcome = on_another_thread(lambda: (reg.call_on_owner(lambda: len(reg.capture(PLAN))).result(timeout=5), reg.owner),
                                name="new-loop")
    assert outcome == {"value": (len(PLAN), "new-loop")}


def test_calls_handed_to_a_registry_that_is_gone_are_cancelled() -> None:
    import gc

    reg = make(Engine())
    future = on_another_thread(lambda: reg.call_on_owner(lambda: 1))["value"]
    assert not future.done()
    del reg
    gc.collect()
    assert future.cancelled()


def test_a_handed_call_that_hands_another_leaves_it_to_the_next_step() -> None:
    reg = make(Engine())
    ticks: list[int] = []

    def tick() -> None:
        ticks.append(len(ticks))
        reg.call_on_owner(tick)  # a periodic job: again before the next step

    on_another_thread(lambda: reg.call_on_owner(tick))
    for i in range(3):
        batch, inputs = batch_inputs(3, i)
        reg.run(batch, **inputs)
        assert ticks == list(range(i + 1))


def test_a_capture_handed_over_reads_an_input_that_aliases_a_static_buffer_as_it_was_when_run_was_called() -> None:
    """A handed call runs before the step and may reset the static buffers (a capture): an input that is a view of one
    is served with the values it had when run() was called."""
    engine = Engine()
    reg = make(engine, capture_budget=0)
    reg.capture([(B.decode(8), "full")])
    for i, n in enumerate((2, 16, 32)):
        on_another_thread(lambda n=n: reg.call_on_owner(reg.capture, [(B.decode(n), "full")]))
        batch, inputs = batch_inputs(5, i)
        ids = reg.static_inputs["input_ids"][:5]
        ids.copy_(inputs["input_ids"])
        out = reg.run(batch, input_ids=ids, slot_mapping=inputs["slot_mapping"])
        torch.testing.assert_close(out, eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
    assert len(reg) == 4
