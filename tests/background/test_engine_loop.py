"""Background capture keeps its promises under an engine's loop: progress with run() called back to back
and nothing between steps, a step that needs a key being captured waits for it (bounded), and the defects a hostile
review found (capture-thread identity, GC during a foreground capture, debug mode after a weight swap, hooks that
read the registry, a BaseException from the step, argument checks)."""

from __future__ import annotations

import gc
import sys
import threading
import time
import warnings

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.capture import background as background_module
from cgregistry.testing import make_plugins
from tests.background.test_background import Engine, batch_inputs, eager, make

WIDTH = 32


class Cheap:
    """Eight 32 x 32 matmuls: a step so cheap that an engine calls run() back to back, host-bound."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5 for _ in range(8)]

    def step(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x


def cheap_registry(model: Cheap, **kwargs: object) -> cg.GraphRegistry:
    return cg.GraphRegistry(model.step, {"x": cg.StaticInput((256, WIDTH), torch.float32)}, backend="cpu", **kwargs)


def test_back_to_back_runs_with_nothing_between_steps_let_every_key_be_captured() -> None:
    """run() back to back with nothing between steps: every key is captured (steps whose key is queued wait for it
    whenever the capture thread, standing aside for each run(), finished nothing for a few steps)."""
    model = Cheap()
    plan = cg.CapturePlan.build(max_num_seqs=256, max_num_tokens=256, mode="full")  # 35 keys
    started = time.perf_counter()
    cheap_registry(model).capture(plan)
    foreground_s = time.perf_counter() - started
    reg = cheap_registry(model)
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 65, (20000,), generator=g).tolist()
    xs = {n: torch.randn(n, WIDTH, generator=g) for n in set(sizes)}
    reg.capture(plan, background=True)
    started = time.perf_counter()
    served_by_graph: list[bool] = []
    steps = 0
    for n in sizes:  # run() back to back: nothing between steps but the loop itself
        hits = reg.stats().hits if steps < 3 else 0
        out = reg.run(B.decode(n), x=xs[n])
        if steps < 3:
            served_by_graph.append(reg.stats().hits > hits)
            torch.testing.assert_close(out, model.step(B.decode(n), xs[n]), rtol=1e-5, atol=1e-5)
        steps += 1
        if len(reg) == len(plan):
            break
    background_s = time.perf_counter() - started
    assert len(reg) == len(plan), f"{len(reg)} of {len(plan)} keys captured in {steps} back-to-back steps ({background_s:.1f} s)"
    assert any(served_by_graph) or steps > 3, "graphs serve once captured"
    print(f"foreground {foreground_s:.2f} s; background under back-to-back runs {background_s:.2f} s, {steps} steps")


def test_steps_run_eagerly_beside_their_keys_capture_then_one_waits_at_most_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture in flight finishes nothing: the first EAGER_STEPS_BEFORE_WAIT steps run eagerly at once, the next
    waits for the key at most the limit and runs eagerly, and no later step waits again for the same capture."""
    monkeypatch.setattr(background_module, "WAIT_LIMIT_S", 0.2)
    monkeypatch.setattr(background_module, "EAGER_STEPS_BEFORE_WAIT", 2)
    engine = Engine()
    engine.hold, engine.hold_tokens = threading.Event(), 16
    reg = make(engine)
    reg.capture([(B.decode(16), "full")], background=True)
    assert engine.holding.wait(10)
    batch, inputs = batch_inputs(3, 0)
    seconds, outs = [], []
    for _ in range(4):
        started = time.perf_counter()
        outs.append(reg.run(batch, **inputs).clone())
        seconds.append(time.perf_counter() - started)
    assert max(seconds[:2]) < 0.15, f"a step waited ({seconds}) before the capture had a chance"
    assert 0.15 <= seconds[2] < 5, f"the third step waited {seconds[2]:.2f} s for the held capture (limit 0.2 s)"
    assert seconds[3] < 0.15, "a later step waited again for the same capture in flight"
    for out in outs:
        assert torch.allclose(out, eager(engine, batch, inputs), atol=1e-5)
    assert reg.stats().misses_by_reason["capturing"] == 4
    engine.hold.set()
    assert reg.wait_captured(timeout=30)
    reg.run(batch, **inputs)
    assert reg.stats().hits == 1


@pytest.mark.parametrize("eager_first", [0, 4])
def test_a_step_moves_its_key_to_the_front_of_the_queue(eager_first: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for it (no eager steps first) or not: the key that would serve the step is the one captured next."""
    monkeypatch.setattr(background_module, "EAGER_STEPS_BEFORE_WAIT", eager_first)
    engine = Engine()
    engine.hold, engine.hold_tokens = threading.Event(), 64
    plan = cg.CapturePlan.of([(B.decode(n), "full") for n in (2, 4, 8, 16, 32, 64)])
    reg = make(engine)
    reg.capture(plan, background=True)  # order: 64 first (covers all; held here until the step came), then 2, 4, 8, ...
    assert engine.holding.wait(10)
    batch, inputs = batch_inputs(3, 0)
    threading.Timer(0.3, engine.hold.set).start()
    out = reg.run(batch, **inputs)
    assert torch.allclose(out, eager(engine, batch, inputs), atol=1e-5)
    if eager_first:  # ran eagerly at once; the key in flight serves it, so nothing needed moving
        assert reg.stats().hits == 0 and reg.capturing()[0][0] == B.decode(64)
    else:
        assert reg.stats().hits == 1  # waited for the capture in flight (64), which serves it
    assert reg.wait_captured(timeout=60) and len(reg) == len(plan)


# ---------------------------------------------------------------- the hostile review's defects (item 4)


def no_capture_threads(timeout: float = 30) -> bool:
    """Wait until no capture thread of any registry runs (earlier tests' threads end once idle)."""
    deadline = time.monotonic() + timeout
    while any(t.name.startswith("cgregistry-capture-") for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_capture_thread_ending_after_a_new_one_started_does_not_unmark_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old thread's exit runs after a new capture thread has started: clear() from the new thread's hook must
    still be refused (it would wait for itself, and interpreter exit would stall)."""
    assert no_capture_threads()
    first: list[threading.Thread] = []
    old_leaving, old_may_leave = threading.Event(), threading.Event()
    real_get = sys.getswitchinterval

    def held_get() -> float:  # called as the last capture thread restores the switch interval on its way out
        if first and threading.current_thread() is first[0] and not old_may_leave.is_set():
            old_leaving.set()
            old_may_leave.wait(10)
        return real_get()

    refused: list[BaseException] = []

    class Hooks:
        @cg.plugin.hookimpl
        def cgregistry_capture_started(self, registry, key, strategy):  # noqa: ANN001
            if key == B.decode(8):
                first.append(threading.current_thread())

        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            if key == B.decode(4):
                try:
                    registry.clear()
                except RuntimeError as exc:
                    refused.append(exc)

    interval = real_get()
    sys.setswitchinterval(0.005)  # the capture thread lowers it, and the last one out restores it (calling held_get)
    monkeypatch.setattr(sys, "getswitchinterval", held_get)
    try:
        reg = make(Engine(), plugins=make_plugins(Hooks()))
        reg.capture([(B.decode(8), "full")], background=True)
        assert old_leaving.wait(10), "the first capture thread never reached its exit"
        reg.capture([(B.decode(4), "full")], background=True)  # a new capture thread starts while the old one exits
        time.sleep(0.2)
        old_may_leave.set()  # the old thread finishes its exit after the new one marked itself
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert reg.wait_captured(timeout=20), "the capture thread hung in clear() from its own hook"
    finally:
        old_may_leave.set()
        sys.setswitchinterval(interval)
    assert refused and "from its own capture thread" in str(refused[0])


def test_a_foreground_capture_beside_a_background_one_runs_with_gc_off() -> None:
    engine = Engine()
    engine.hold, engine.hold_tokens = threading.Event(), 16
    gc_during: list[bool] = []
    step = engine.step

    def watching(batch: B, **inputs: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 2:
            gc_during.append(gc.isenabled())
        return step(batch, **inputs)

    engine.step = watching  # type: ignore[method-assign]
    reg = make(engine)
    reg.capture([(B.decode(16), "full")], background=True)
    assert engine.holding.wait(10)
    threading.Timer(0.2, engine.hold.set).start()  # the background capture ends while the foreground one waits for it
    reg.capture([(B.decode(2), "full")])
    assert gc_during and not any(gc_during), f"the foreground capture ran with GC on: {gc_during}"
    assert gc.isenabled() and reg.wait_captured(timeout=30)


def test_debug_mode_after_a_weight_swap_before_any_capture_has_no_false_alarm() -> None:
    model = torch.nn.Linear(8, 8)
    model.weight = torch.nn.Parameter(torch.randn(8, 8))  # replaced before any capture: nothing reads the old one

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16, 8), torch.float32)}, backend="cpu", debug=True)
    reg.watch(model, prefix="model.")
    model.weight = torch.nn.Parameter(torch.randn(8, 8))
    reg.capture([(B.decode(16), "full")], background=True)
    assert reg.wait_captured(timeout=30)
    x = torch.randn(5, 8)
    torch.testing.assert_close(reg.run(B.decode(5), x=x), model(x))
    model.weight = torch.nn.Parameter(torch.randn(8, 8))  # after capture: the graph reads the old tensor
    with pytest.raises(cg.DebugError, match="model.weight moved"):
        reg.run(B.decode(5), x=x)


def test_hooks_on_the_capture_thread_read_the_registry_while_it_serves() -> None:
    problems: list[str] = []

    class Reader:
        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            for _ in range(20):
                registry.stats()
                registry.entries()
                registry.snapshot()

    plan = cg.CapturePlan.build(max_num_seqs=64, max_num_tokens=64, mode="full")
    engine = Engine()
    for _ in range(3):
        reg = make(engine, plugins=make_plugins(Reader()), memory_budget=None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reg.capture(plan, background=True)
            for i in range(400):
                batch, inputs = batch_inputs(1 + i % 64, i)
                reg.run(batch, **inputs)
            reg.wait_captured(timeout=60)
        problems += [str(w.message) for w in caught if "Reader" in str(w.message)]
    assert problems == []


def test_a_base_exception_from_the_step_on_the_capture_thread_is_a_named_capture_error() -> None:
    seen: list[object] = []

    class Observer:
        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            seen.append(error)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 8 and threading.current_thread() is not threading.main_thread():
            raise SystemExit(3)
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", plugins=make_plugins(Observer()))
    reg.capture([(B(8), "full"), (B(16), "full")], background=True)
    with pytest.warns(RuntimeWarning, match=r"background capturing Batch\(tokens=8, reqs=any\) with strategy 'full' failed: SystemExit: 3"):
        assert reg.wait_captured(timeout=30)
    error = reg.failures()[(B(8), "full")]
    assert isinstance(error, cg.CaptureError) and error.descriptor == B(8) and error.strategy == "full"
    assert any(isinstance(e, cg.CaptureError) for e in seen), "capture_finished reported the failure"
    assert len(reg) == 1


def test_wait_and_capture_arguments_are_checked() -> None:
    reg = make(Engine())
    reg.capture([(B.decode(4), "full")], background=True)
    assert reg.wait_captured(timeout=float("inf")) is True
    with pytest.raises(TypeError, match=r"wait_captured\(timeout=...\) takes seconds >= 0 .* got '5'"):
        reg.wait_captured(timeout="5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got -1"):
        reg.wait_captured(timeout=-1)
    with pytest.raises(TypeError, match=r"capture\(background=...\) takes a bool, got 'yes'"):
        reg.capture([(B.decode(2), "full")], background="yes")  # type: ignore[arg-type]
    assert reg.capturing() == [] and len(reg) == 1
