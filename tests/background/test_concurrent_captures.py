"""Background capture beside a busy serving thread: a capture is installed only while the registry's capture context
is the one it ran under, released keys stay released, every miss has one reason, a dropped registry stops capturing,
and overlapping captures of two registries leave process-wide state (torch.distributed, torch's dispatch-mode flags,
the switch interval) as it was.

Threads that could hang run on daemon threads joined with a timeout, so a hang fails the test instead of stalling the run.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import warnings
import weakref
from typing import Any

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins
from tests.background.test_background import Engine, batch_inputs, eager, make
from tests.serving_threads import HIDDEN, matmul_registry, on_capture_thread, run_in_thread

def wait_for_no_capture_threads(timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while any(t.name.startswith("cgregistry-capture") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)


def capture_two_registries_at_once() -> None:
    """Two registries capture in the background at once: A's segment opens, B's opens, A's closes, B's closes."""
    a_open, b_open, a_closed = threading.Event(), threading.Event(), threading.Event()
    calls = {"a": 0, "b": 0}

    def step_a(batch: B, x: torch.Tensor) -> torch.Tensor:
        if on_capture_thread():
            calls["a"] += 1
            if calls["a"] == 2:  # the capture itself (the warm-up is the first call)
                a_open.set()
                b_open.wait(10)
        return x * 2

    def step_b(batch: B, x: torch.Tensor) -> torch.Tensor:
        if on_capture_thread():
            calls["b"] += 1
            if calls["b"] == 2:
                b_open.set()
                a_closed.wait(10)
        return x * 3

    class ClosedA:
        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            a_closed.set()

    spec = {"x": cg.StaticInput((16,), torch.float32)}
    reg_a = cg.GraphRegistry(step_a, spec, backend="cpu", plugins=make_plugins(ClosedA()), name="review-a")
    reg_b = cg.GraphRegistry(step_b, spec, backend="cpu", name="review-b")
    reg_a.capture([(B(8), "full")], background=True)
    assert a_open.wait(10)
    reg_b.capture([(B(8), "full")], background=True)
    assert reg_a.wait_captured(timeout=20) and reg_b.wait_captured(timeout=20)
    assert len(reg_a) == 1 and len(reg_b) == 1


def test_two_registries_capturing_at_once_leave_torch_distributed_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlapping background captures of two registries (A opens, B opens, A closes, B closes) leave every
    torch.distributed collective as it was, so a later graph with one all_reduce replays exactly one."""
    import torch.distributed as dist

    replayed: list[int] = []

    def fake_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        replayed.append(tensor.numel())  # stands for the real collective (no process group needed)

    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single"):
        monkeypatch.setattr(dist, name, getattr(dist, name))  # the rest of the session gets these back, whatever happens
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    capture_two_registries_at_once()

    def step_c(batch: B, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y

    reg_c = cg.GraphRegistry(step_c, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", name="review-c")
    reg_c.capture([(B(8), "full")])
    replayed.clear()
    reg_c.run(B(8), x=torch.ones(8))
    assert dist.all_reduce is fake_all_reduce and len(replayed) == 1, (
        f"torch.distributed.all_reduce is {dist.all_reduce!r} after the two captures; a step with one all_reduce "
        f"replays {len(replayed)} collectives"
    )


def test_two_registries_capturing_at_once_leave_torch_dispatch_mode_state_as_it_was() -> None:
    """Overlapping background captures of two registries leave torch's process-wide "a dispatch mode is active" flags
    as they were (left set, torch.compile guards fail inside every later capture: a piecewise model retraces)."""
    from torch.utils import _python_dispatch as dispatch

    def flags() -> tuple[bool, bool]:
        return dispatch.is_in_torch_dispatch_mode(), dispatch.is_in_any_mode_without_ignore_compile_internals()

    before = flags()
    capture_two_registries_at_once()
    assert flags() == before, f"torch's dispatch-mode flags are {flags()} after two overlapping captures, {before} before"


def test_two_registries_capturing_at_once_leave_the_switch_interval_as_it_was() -> None:
    """The capture threads lower the interpreter's switch interval while they run; the last one to end puts back
    the interval from before the first started."""
    wait_for_no_capture_threads()
    before = sys.getswitchinterval()
    capture_two_registries_at_once()
    wait_for_no_capture_threads()
    assert sys.getswitchinterval() == before, f"switch interval {sys.getswitchinterval()} after the captures, {before} before"


def test_a_step_that_waited_for_a_key_gets_it_or_a_counted_miss_under_a_memory_budget() -> None:
    """A step that waited for the key being captured is served by it, or runs eagerly as a miss counted under one
    reason, even when the same install evicts under a ``memory_budget`` (sum of misses_by_reason == misses)."""
    wanted = (B.decode(4), "full")

    wanted_done = threading.Event()

    class HoldInstall:
        once = True

        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            if (key, strategy) == wanted:
                wanted_done.set()

        @cg.plugin.hookimpl
        def cgregistry_evicted(self, registry, key, strategy, memory_bytes):  # noqa: ANN001
            if self.once and key == B.decode(2):
                self.once = False
                # the 4-token key, the last queued, finished on the capture thread: once that thread has ended, its
                # record is waiting to be installed
                assert wanted_done.wait(10)
                deadline = time.monotonic() + 10
                while any(t.name == "cgregistry-capture-review-budget" for t in threading.enumerate()):
                    assert time.monotonic() < deadline
                    time.sleep(0.002)

    engine = Engine()
    engine.hold, engine.hold_tokens = threading.Event(), 32
    reg = make(engine, memory_budget=1, plugins=make_plugins(HoldInstall()), name="review-budget")
    reg.capture([(B.decode(2), "full")])
    first, first_inputs = batch_inputs(2, 0)
    reg.run(first, **first_inputs)  # the 2-token key is replayed once: the least recently used is a fresh one
    try:
        reg.capture([(B.decode(32), "full"), wanted], background=True)
        assert engine.holding.wait(10)
        threading.Timer(0.1, engine.hold.set).start()
        batch, inputs = batch_inputs(20, 1)
        finished, result = run_in_thread(lambda: reg.run(batch, **inputs), timeout=20)
        assert finished and "error" not in result, result
        assert torch.allclose(result["value"], eager(engine, batch, inputs), atol=1e-5)
    finally:
        engine.hold.set()
        reg.wait_captured(timeout=30)
    stats = reg.stats()
    assert sum(stats.misses_by_reason.values()) == stats.misses, (
        f"{stats.misses} misses, by reason {stats.misses_by_reason}: the waiting step's miss has no reason "
        f"(entries {[e.key for e in reg.entries()]}, pending {reg.pending()})"
    )


def test_a_registry_dropped_by_the_engine_stops_capturing() -> None:
    """The capture thread holds its registry weakly: once the engine drops the registry (and it is collected), the
    thread stops taking queued keys and ends."""
    wait_for_no_capture_threads()

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if on_capture_thread():
            time.sleep(0.03)
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((64,), torch.float32)}, backend="cpu", name="review-dropped")
    reg.capture([(B(n), "full") for n in range(1, 41)], background=True)
    time.sleep(0.1)
    thread = next(t for t in threading.enumerate() if t.name == "cgregistry-capture-review-dropped")
    del reg
    gc.collect()
    thread.join(1.0)
    alive = thread.is_alive()
    thread.join(20)  # let it drain so later tests start clean
    assert not alive, "the capture thread of a dropped registry was still capturing its keys 1 s later"


def test_release_of_a_key_planned_lazily_and_queued_counts_it_once() -> None:
    """A lazy key queued for background capture moves to the queue (listed by ``capturing()`` alone), and
    ``release()`` of it counts the one (key, strategy) pair once."""
    engine = Engine()
    engine.hold, engine.hold_tokens = threading.Event(), 64
    reg = make(engine)
    key = (B.decode(8), "full")
    try:
        reg.capture([key], lazy=True)
        reg.capture([(B.decode(64), "full"), key], background=True)
        assert engine.holding.wait(10)
        both = key in reg.pending() and key in reg.capturing()
        released = reg.release(key[0])
    finally:
        engine.hold.set()
        reg.wait_captured(timeout=30)
    assert released == 1 and not both, f"release() returned {released} for one pair (pending and capturing: {both})"


def test_a_released_key_is_not_brought_back_by_a_capture_hook_that_calls_match() -> None:
    """A hook's ``match()`` on the capture thread, racing a ``release()`` on the serving thread, never caches a route
    to the released key: it stays released."""
    weight = torch.randn(HIDDEN, HIDDEN)
    hold = threading.Event()

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if on_capture_thread() and batch.num_tokens == 16:
            hold.wait(10)
        return x @ weight

    in_policy, go, matched = threading.Event(), threading.Event(), threading.Event()

    class SlowPolicy:
        armed = True

        @cg.plugin.hookimpl
        def cgregistry_choose_match(self, registry, actual, candidates):  # noqa: ANN001
            if on_capture_thread() and self.armed:
                self.armed = False
                in_policy.set()
                go.wait(10)
            return None

    class Telemetry:
        @cg.plugin.hookimpl
        def cgregistry_capture_started(self, registry, key, strategy):  # noqa: ANN001
            if on_capture_thread():
                registry.match(B.decode(4))
                matched.set()

    reg = matmul_registry(step, plugins=make_plugins(SlowPolicy(), Telemetry()))
    reg.capture([(B.decode(8), "full")])
    try:
        reg.capture([(B.decode(16), "full")], background=True)
        assert in_policy.wait(10)
        assert reg.release(B.decode(8)) == 1
        go.set()
        assert matched.wait(10)  # the hook's match() has returned; the 16-token capture is still held
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            finished, result = run_in_thread(lambda: reg.run(B.decode(4), x=torch.randn(4, HIDDEN)), timeout=10)
        assert finished and "error" not in result, result
    finally:
        go.set()
        hold.set()
        reg.wait_captured(timeout=30)
    live = [e.key for e in reg.entries()]
    assert B.decode(8) not in live, f"the released key is live again: {live}"


def test_a_key_requested_again_under_a_new_state_is_not_served_from_a_capture_under_the_old_one() -> None:
    """A capture in flight under an old capture context (autocast) is never installed once the registry records a new
    one: the key asked for again is captured under the new context and computes what the step does eagerly."""
    weight = torch.randn(HIDDEN, HIDDEN)
    holding, go = threading.Event(), threading.Event()

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if on_capture_thread():
            holding.set()
            go.wait(10)
        return x @ weight

    reg = matmul_registry(step)
    key = (B.decode(8), "full")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reg.capture([key], background=True)
        assert holding.wait(10)
        assert reg.release(key[0]) == 1
        reg.capture([key], background=True)  # no autocast now; nothing is held, so the new state is recorded
    finally:
        go.set()
    assert reg.wait_captured(timeout=20)
    x = torch.randn(8, HIDDEN)
    expected = step(B.decode(8), x)
    try:
        out = reg.run(B.decode(8), x=x)
    except cg.ServingStateError:
        out = expected
    assert out.dtype == expected.dtype, (
        f"run() without autocast returned {out.dtype} from a graph captured under autocast; eager returns "
        f"{expected.dtype} (entries {reg.entries()})"
    )
    assert reg.stats().stale_captures == 1, "the capture under the old context is counted as discarded once"


class _Finished:
    """Counts captures finished, and runs ``then(registry, key)`` on the thread that finished each."""

    def __init__(self, then: Any = None) -> None:
        self.count = 0
        self.then = then

    @cg.plugin.hookimpl
    def cgregistry_capture_finished(self, registry: Any, key: B, strategy: str, entry: Any, error: Any) -> None:
        self.count += 1
        if self.then is not None:
            self.then(registry, key)


def _doubling(batch: B, x: torch.Tensor) -> torch.Tensor:
    if batch.num_tokens == 8:
        raise RuntimeError("a capture that fails")
    return x * 2


def test_a_refused_capture_leaves_finished_background_work_uninstalled() -> None:
    """capture() refused at its checks changes nothing, also while the capture thread has finished work waiting for the
    serving thread (an entry and a failure): those go live at the next step or call that installs, not here."""
    finished = _Finished()
    reg = cg.GraphRegistry(_doubling, {"x": cg.StaticInput((32, 8), torch.float32)}, backend="cpu", plugins=make_plugins(finished))
    reg.capture([(B(16), "full"), (B(8), "full")], background=True)
    deadline = time.monotonic() + 20
    while finished.count < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    before = (len(reg), reg.capturing(), dict(reg.failures()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even the failed key's warning: nothing is installed
        with pytest.raises(ValueError, match="needs 64 tokens"):
            reg.capture([(B(64), "full")])  # too large for the static input
    assert (len(reg), reg.capturing(), dict(reg.failures())) == before == (0, [(B(16), "full"), (B(8), "full")], {})
    with pytest.warns(RuntimeWarning, match="a capture that fails"):
        reg.wait_captured()
    assert len(reg) == 1 and list(reg.failures()) == [(B(8), "full")]


def test_a_capture_asked_for_on_the_capture_thread_is_refused_before_it_installs_anything() -> None:
    """A hook on the capture thread that calls capture() is refused, and nothing goes live on that thread: entries are
    installed by the serving thread only."""
    seen: list[tuple[int, int]] = []

    def call_back(registry: Any, key: B) -> None:
        if threading.current_thread() is not threading.main_thread() and key.num_tokens == 8:
            time.sleep(0.05)  # the 32-token key finished before: waiting, not installed
            before = len(registry)
            with pytest.raises(RuntimeError, match="from its own capture thread"):
                registry.capture([(B(4), "full")])
            seen.append((before, len(registry)))

    reg = cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((32, 8), torch.float32)}, backend="cpu",
                           plugins=make_plugins(_Finished(call_back)))
    reg.capture([(B(32), "full"), (B(16), "full"), (B(8), "full")], background=True)  # 32 first, then 8 and 16
    reg.wait_captured()
    assert seen == [(0, 0)] and len(reg) == 3


def test_an_engine_whose_step_is_its_own_method_is_collected_with_its_registry() -> None:
    """An engine that holds its registry and hands it its own bound method as the step (a cycle: engine, registry,
    step, engine) is collected once dropped, after a background capture as after a foreground one: nothing the
    registry leaves behind (its finalizer included) holds either."""

    class Server:
        def __init__(self, name: str) -> None:
            self.reg = cg.GraphRegistry(self.step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", name=name)

        def step(self, batch: B, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    wait_for_no_capture_threads()
    for background in (False, True):
        server = Server(f"cycle-{background}")
        server.reg.capture([(B(8), "full"), (B(4), "full")], background=background)
        server.reg.wait_captured(timeout=30)
        assert len(server.reg) == 2
        refs = weakref.ref(server), weakref.ref(server.reg)
        del server
        gc.collect()
        if any(ref() is not None for ref in refs):  # a capture thread may still be on its way out (a loaded machine)
            wait_for_no_capture_threads(timeout=10)
            gc.collect()
        assert [ref() is None for ref in refs] == [True, True], f"background={background}: the engine outlived its last reference"
