"""Background capture and adaptation against a hostile tester's cases: re-requested keys, a step that compiles,
clear() during a refit, a capture that ends before submit() returns, calls from capture hooks, keys captured in
the foreground meanwhile, and evictions while a capture is in flight."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins
from tests.background.test_background import HIDDEN, MAX_TOKENS, Engine, make
from tests.serving_threads import run_in_thread


def held_engine() -> Engine:
    """test_background's engine with an event to hold the capture of ``hold_tokens`` on."""
    engine = Engine()
    engine.hold = threading.Event()
    return engine


def inputs_for(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(n) % 100, "slot_mapping": torch.arange(n)}


def test_recapturing_a_released_in_flight_key_captures_it() -> None:
    """A key released while in flight and requested again is captured (the capture in flight is kept)."""
    engine = held_engine()
    engine.hold_tokens = 8
    reg = make(engine)
    key = B.decode(8)
    reg.capture([(key, "full")], background=True)
    assert engine.holding.wait(10)
    assert reg.release(key) == 1
    reg.capture([(key, "full")], background=True)  # the engine wants it after all
    capturing = reg.capturing()  # [] already: the re-request is not even reported
    engine.hold.set()
    assert reg.wait_captured(timeout=30)
    assert len(reg) == 1 and capturing == [(key, "full")] and reg.match(key) is not None, f"the re-requested key was silently never captured (capturing() right after the request: {capturing})"


def test_a_step_using_torch_compile_does_not_deadlock_beside_a_background_capture() -> None:
    """A step that compiles does not wait forever for a capture thread paused inside dynamo's compile lock
    (the pause gives up after PAUSE_LIMIT_S)."""
    weight = torch.randn(HIDDEN, HIDDEN)

    @torch.compile(backend="eager", dynamic=True)
    def layer(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, HIDDEN), torch.float32)}, backend="cpu")
    reg.capture([(B.decode(16), "full")], background=True)
    import time

    time.sleep(0.05)  # the capture thread's warm-up is compiling now

    def serve() -> list[torch.Tensor]:
        return [reg.run(B.decode(n), x=torch.randn(n, HIDDEN)) for n in (3, 5)]

    done, result = run_in_thread(serve, timeout=30)
    assert done, "run() deadlocked: the paused capture thread holds dynamo's compile lock"
    assert "error" not in result, result


def test_clear_during_a_refit_does_not_stop_adaptation_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    """clear() while a refit is queued or running drops it, and adaptation refits again afterwards."""
    from cgregistry.capture import refit as registry_module
    from cgregistry.plan.adapt import Adaptation

    settings = dict(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", max_capture_size=MAX_TOKENS)
    adapt = Adaptation(max_graphs=4, settings=settings, every_steps=10, min_steps=10, decay=1.0, min_gain=0.0)
    reg = make(Engine(), adapt=adapt)
    started, go = threading.Event(), threading.Event()
    propose = registry_module.propose

    def held_propose(*args, **kwargs):  # a refit that takes a moment (the real fitter on a large histogram does)
        started.set()
        go.wait(30)
        return propose(*args, **kwargs)

    monkeypatch.setattr(registry_module, "propose", held_propose)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(10):
            reg.run(B.decode(3), **inputs_for(3))
        assert started.wait(10)
        go.set()
        reg.clear()  # the engine starts over (a new model version, say)
        monkeypatch.setattr(registry_module, "propose", propose)
        for _ in range(200):
            reg.run(B.decode(3), **inputs_for(3))
    assert reg.wait_captured(timeout=30)
    assert reg.stats().plan_changes >= 1 and len(reg) > 0, "adaptation never refits again after clear()"


def test_a_capture_finished_before_submit_returns_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that finishes before capture(background=True) returns is still installed."""
    from cgregistry.capture.background import BackgroundCapture

    submit = BackgroundCapture.submit

    def submit_then_preempted(self, pairs, payload):  # the OS deschedules the serving thread here
        submit(self, pairs, payload)
        self.wait(30)

    monkeypatch.setattr(BackgroundCapture, "submit", submit_then_preempted)
    reg = make(Engine())
    reg.capture([(B.decode(8), "full")], background=True)
    monkeypatch.setattr(BackgroundCapture, "submit", submit)
    assert reg.wait_captured(timeout=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg.run(B.decode(8), **inputs_for(8))
    assert len(reg) == 1, f"the finished entry was lost; capturing()={reg.capturing()}"


def test_clear_from_a_capture_hook_is_refused_not_a_hung_capture_thread() -> None:
    """clear() from a hook on the capture thread is refused; the capture thread goes on."""
    errors: list[BaseException] = []

    class ClearOnCapture:
        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            try:
                registry.clear()
            except RuntimeError as exc:
                errors.append(exc)

    reg = make(Engine(), plugins=make_plugins(ClearOnCapture()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg.capture([(B.decode(8), "full")], background=True)
        assert reg.wait_captured(timeout=10), "the capture thread hung in clear() called from its own hook"
    assert errors, "clear() from the capture thread was neither refused nor completed"


def test_capturing_does_not_list_a_key_already_live() -> None:
    """A key captured in the foreground while queued leaves the queue: capturing() lists only keys not live."""
    engine = held_engine()
    engine.hold_tokens = 16
    reg = make(engine)
    reg.capture([(B.decode(16), "full"), (B.decode(4), "full")], background=True)
    assert engine.holding.wait(10)
    threading.Timer(0.3, engine.hold.set).start()  # let the held capture end (the foreground one waits for it)
    reg.capture([(B.decode(4), "full")])
    assert (B.decode(4), "full") in {(i.key, i.strategy) for i in reg.entries()}
    assert (B.decode(4), "full") not in reg.capturing(), reg.capturing()
    assert reg.wait_captured(timeout=30)


def test_a_step_does_not_wait_on_a_background_capture_after_an_eviction() -> None:
    """An evicted (pending) key met by a step while a capture is in flight goes to the capture thread's
    queue; the step waits for it at most WAIT_LIMIT_S (0.5 s), then runs eagerly, never for the whole capture."""
    engine = held_engine()
    engine.hold_tokens = 8
    reg = make(engine, memory_budget=1)  # room for one entry: each install evicts the others
    reg.capture([(B.decode(16), "full"), (B.decode(4), "full"), (B.decode(8), "full")], background=True)
    assert engine.holding.wait(10)  # order: 16, 4, then 8 (held mid-capture)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg.run(B.decode(1), **inputs_for(1))  # installs 16 and 4; the budget evicts 16 back to pending
        assert (B.decode(16), "full") in reg.pending()
        done, result = run_in_thread(lambda: reg.run(B.decode(12), **inputs_for(12)), timeout=3)
        engine.hold.set()
        assert done, "run() waited on the background capture in flight (a lazy re-capture of an evicted key)"
        assert reg.wait_captured(timeout=30)
