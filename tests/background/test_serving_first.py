"""The capture thread steps aside while run() is in progress: a step's host work does not share the GIL with a
capture running the model, and a run() that waits for the capture thread is never left waiting on it."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import cgregistry as cg
import cgregistry.capture.background as background
from cgregistry import BatchDescriptor as B

D, MAX_TOKENS = 8, 32


class CountingStep:
    """A step of many small ops; counts, per thread, the loop iterations it ran (a Python-level clock of progress)."""

    def __init__(self) -> None:
        self.weight = torch.randn(D, D, generator=torch.Generator().manual_seed(0))
        self.iterations = {"capture": 0, "serving": 0}
        self.capture_moved_during_a_serving_step: list[int] = []

    def __call__(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        serving = threading.current_thread() is threading.main_thread()
        before = self.iterations["capture"]
        y = x
        for _ in range(150):
            y = torch.tanh(y @ self.weight)
            self.iterations["serving" if serving else "capture"] += 1
        if serving:
            self.capture_moved_during_a_serving_step.append(self.iterations["capture"] - before)
        return y


def registry(step: CountingStep) -> cg.GraphRegistry:
    return cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")


STAND_ASIDE_METHODS = ["profile", "torch_function"]


@pytest.mark.parametrize("method", STAND_ASIDE_METHODS)
def test_the_capture_thread_makes_no_progress_while_an_eager_step_runs(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "PAUSE_LIMIT_S", 60.0)  # however slow this machine is
    # This thread's frame stands still through each matmul (no GIL held) and while the machine deschedules it: on a
    # busy machine that outlasts STILL_S, and the capture thread would go on for a millisecond each time (that escape
    # has its own test). Here: only the stand-aside itself.
    monkeypatch.setattr(background, "STILL_S", 60.0)
    monkeypatch.setattr(background, "STAND_ASIDE_BY", method)
    step = CountingStep()
    reg = registry(step)
    reg.capture([(B(n), "full") for n in range(1, 9)], background=True)
    x = torch.randn(MAX_TOKENS, D)
    steps = 0
    while reg.capturing() and steps < 200:  # batches above every key: eager, beside the capture
        torch.testing.assert_close(reg.run(B(MAX_TOKENS), x=x), step(B(MAX_TOKENS), x))
        steps += 1
    assert steps > 0 and step.iterations["capture"] > 0
    # the eager steps served on this thread, the one compared inside the loop included, saw the capture thread stand
    # still (at most the one iteration it was in when the step began)
    served = sorted(step.capture_moved_during_a_serving_step[0::2])
    assert served and served[len(served) // 2] <= 1, served
    reg.wait_captured()
    assert len(reg) == 8 and not reg.failures()


def test_a_run_that_waits_for_the_capture_thread_is_not_left_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose key is queued waits for its capture, a step beside the capture runs eagerly, wait_captured() waits
    for the rest: the capture thread must not stand aside for a run() that waits for it (it would wait out the limit)."""
    monkeypatch.setattr(background, "PAUSE_LIMIT_S", 60.0)
    monkeypatch.setattr(background, "EAGER_STEPS_BEFORE_WAIT", 0)  # the first step without its graph waits for it
    step = CountingStep()
    reg = registry(step)
    finished = threading.Event()
    waited_for: list[int] = []

    def serve() -> None:
        reg.capture([(B(n), "full") for n in (32, 16, 8, 4)], background=True)
        x = torch.randn(4, D)
        out = reg.run(B(4), x=x)  # its key is queued: moved to the front and waited for
        torch.testing.assert_close(out, step(B(4), x))
        waited_for.append(reg.stats().hits)
        reg.capture([(B(n), "full") for n in (2, 1)], background=True)
        out = reg.run(B(16), x=torch.randn(16, D), exclude=("full",))  # eager; the capture goes on
        reg.wait_captured()
        finished.set()

    worker = threading.Thread(target=serve)  # not the main thread: the step counts it as the capture side; fine here
    worker.start()
    worker.join(30)
    assert finished.is_set(), "run() or wait_captured() waited on a capture thread that stood aside for it"
    assert waited_for == [1], "the step waited for its key and replayed it"
    assert len(reg) == 6


@pytest.mark.parametrize("method", STAND_ASIDE_METHODS)
def test_a_loop_with_no_gap_between_steps_still_lets_every_key_be_captured(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """run() back to back with no gap the capture thread sees, and no stand ever running out (the limit is a minute):
    each step's start hands the capture thread the share it is owed, so every key ends captured, also those no step
    needs (a larger key serves every size here, so no step waits for one)."""
    monkeypatch.setattr(background, "PAUSE_LIMIT_S", 60.0)
    monkeypatch.setattr(background, "STAND_ASIDE_BY", method)
    step = CountingStep()
    reg = registry(step)
    sizes = list(range(1, 9))
    reg.capture([(B(n), "full") for n in sizes], background=True)
    xs = [torch.randn(n, D) for n in sizes]
    outs = []
    deadline = time.monotonic() + 120
    i = 0
    while len(reg) < len(sizes) and time.monotonic() < deadline:  # nothing between steps but the loop and the output
        out = reg.run(B(sizes[i % len(sizes)]), x=xs[i % len(sizes)])
        if i < 64:
            outs.append(out.clone())
        i += 1
    assert len(reg) == len(sizes), f"{len(reg)} of {len(sizes)} keys captured in {i} back-to-back steps"
    assert reg.stats().hits >= 1
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, step(B(sizes[i % len(sizes)]), xs[i % len(sizes)]))
    # the capture thread moved between steps, never inside one
    served = sorted(step.capture_moved_during_a_serving_step[: len(outs)])
    assert served[len(served) // 2] <= 1, served


def test_the_share_a_step_hands_the_capture_thread_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host-bound steps of 5 ms called back to back (the serving thread never stands still, nothing runs between
    steps), and a stand that never runs out (the limit is a minute): the capture still ends beside them, through the
    share each step's start hands the capture thread, and no step waits for it more than SHARE_MAX_S."""
    monkeypatch.setattr(background, "PAUSE_LIMIT_S", 60.0)
    eager_s = 0.005

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name.startswith("cgregistry-capture-"):
            y = x
            for _ in range(200):  # host work between torch ops: the capture thread stands aside at each
                y = y + 1
            return y
        end = time.perf_counter() + eager_s
        while time.perf_counter() < end:  # Python all along: a frame that moves
            pass
        return x + 200

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
    reg.capture([(B(16), "full")])  # the process's first capture (lazy imports and such) on this thread
    reg.clear()
    reg.capture([(B(n), "full") for n in (1, 2, 4, 8)], background=True)
    x = torch.randn(MAX_TOKENS, D)
    clock, run, capturing = time.perf_counter, reg.run, reg.capturing
    deadline, seconds = clock() + 30, []
    while capturing() and clock() < deadline:  # batches above every key: eager, back to back
        started = clock()
        run(B(MAX_TOKENS), x=x)
        seconds.append(clock() - started)
    assert not capturing(), f"the capture did not end beside {len(seconds)} back-to-back steps"
    assert reg.wait_captured(timeout=60) and len(reg) == 4
    torch.testing.assert_close(reg.run(B(MAX_TOKENS), x=x), x + 200)
    assert max(seconds) - eager_s < background.SHARE_MAX_S + 0.25, f"a step waited {max(seconds) - eager_s:.3f} s before it ran"


@pytest.mark.parametrize("method", STAND_ASIDE_METHODS)
def test_steps_back_to_back_under_autocast_and_inference_mode_equal_eager_while_the_share_runs(
    method: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run() back to back under torch.autocast and inference mode, nothing between steps, while the capture thread
    takes its shares (the stand never runs out): every step, eager or replayed, equals the eager step under the
    same state, in bfloat16."""
    monkeypatch.setattr(background, "PAUSE_LIMIT_S", 60.0)
    monkeypatch.setattr(background, "STAND_ASIDE_BY", method)
    step = CountingStep()
    reg = registry(step)
    sizes = [3, 5, 8, MAX_TOKENS]  # MAX_TOKENS: above every key, eager
    g = torch.Generator().manual_seed(2)
    xs = {n: torch.randn(n, D, generator=g) for n in sizes}
    outs: list[tuple[int, torch.Tensor]] = []
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        reg.capture([(B(2), "full")])  # the process's first capture (lazy imports and such) on this thread
        reg.clear()
        reg.capture([(B(n), "full") for n in (4, 8, 16)], background=True)
        i = 0
        while reg.capturing() and i < 20_000:
            n = sizes[i % len(sizes)]
            outs.append((n, reg.run(B(n), x=xs[n]).clone()))
            i += 1
        assert reg.wait_captured(timeout=60) and len(reg) == 3
        assert i >= len(sizes), f"only {i} steps ran beside the capture"
        hits = reg.stats().hits
        for n in sizes:
            outs.append((n, reg.run(B(n), x=xs[n]).clone()))
        assert reg.stats().hits == hits + 3, "graphs serve once captured"
        for n, out in outs:
            expected = step(B(n), xs[n])
            assert out.dtype == expected.dtype == torch.bfloat16
            torch.testing.assert_close(out, expected)


def test_an_unknown_stand_aside_setting_is_named_in_a_warning_and_the_capture_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The setting is read on the capture thread as it starts: an unknown one is named in a warning and taken as
    "profile", and the capture thread neither dies of it nor leaves the registry waiting on it."""
    monkeypatch.setattr(background, "STAND_ASIDE_BY", "sometimes")
    step = CountingStep()
    reg = registry(step)
    with pytest.warns(RuntimeWarning, match="STAND_ASIDE_BY='sometimes'.*'profile' or 'torch_function'"):
        reg.capture([(B(n), "full") for n in (1, 2)], background=True)
        assert reg.wait_captured(timeout=30)
    assert len(reg) == 2 and not reg.failures()
    x = torch.randn(2, D)
    torch.testing.assert_close(reg.run(B(2), x=x), step(B(2), x))


def test_the_torch_function_mode_is_the_capture_threads_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Standing aside by torch function mode: the step's code on the capture thread runs under it (its warm-up calls
    too, where the cpu backend's own recording mode is not on), and on the serving thread never."""
    monkeypatch.setattr(background, "STAND_ASIDE_BY", "torch_function")
    modes: dict[str, set[int]] = {"capture": set(), "serving": set()}

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        capture = threading.current_thread().name.startswith("cgregistry-capture-")
        modes["capture" if capture else "serving"].add(torch._C._len_torch_function_stack())
        return torch.tanh(x)

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
    reg.capture([(B(n), "full") for n in (1, 2, 4, 8)], background=True)
    x = torch.randn(MAX_TOKENS, D)
    while reg.capturing():
        torch.testing.assert_close(reg.run(B(MAX_TOKENS), x=x), torch.tanh(x))
    assert reg.wait_captured(timeout=30)
    assert modes["serving"] == {0}, modes
    assert modes["capture"] and min(modes["capture"]) >= 1, modes


class SleepyStep:
    """A step whose capture (on the capture thread) and whose eager run (on this one) take the given seconds."""

    def __init__(self, capture_s: float, eager_s: float) -> None:
        self.capture_s, self.eager_s = capture_s, eager_s

    def __call__(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        on_capture_thread = threading.current_thread().name.startswith("cgregistry-capture-")
        time.sleep(self.capture_s / 2 if on_capture_thread else self.eager_s)  # warm-up and capture: two calls
        return x * 2


@pytest.mark.parametrize("capture_s, eager_s, waits", [(0.4, 0.01, False), (0.04, 0.3, True)])
def test_a_step_waits_for_its_key_in_flight_only_when_that_is_sooner_than_running_eagerly(
    capture_s: float, eager_s: float, waits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(background, "WAIT_LIMIT_S", 5.0)  # long enough to wait out any of these captures
    step = SleepyStep(capture_s, eager_s)
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
    reg.capture([(B(2), "full")], background=True)  # the capture thread's time for a key, measured
    reg.wait_captured()
    reg.capture([(B(n), "full") for n in (32, 8, 4)], background=True)  # 32, which serves every batch below, first
    x = torch.randn(3, D)
    hits = []
    for _ in range(3):
        torch.testing.assert_close(reg.run(B(3), x=x), x * 2)
        hits.append(reg.stats().hits)
    reg.wait_captured()
    if waits:  # the first step ran eagerly (its cost unknown); by the second the key was captured or waited for
        assert hits[0] == 0 and hits[1] == 1, hits
    else:  # a capture of 0.4 s against 10 ms eagerly: no step waited for it
        assert hits == [0, 0, 0], hits


class KeyedSleepyStep(SleepyStep):
    """A SleepyStep whose capture of a key of ``slow_tokens`` tokens takes ``slow_s`` instead."""

    def __init__(self, capture_s: float, eager_s: float, slow_tokens: int, slow_s: float) -> None:
        super().__init__(capture_s, eager_s)
        self.quick_s, self.slow_tokens, self.slow_s = capture_s, slow_tokens, slow_s
        self.slow_began = threading.Event()  # set when the capture thread starts on the slow key

    def __call__(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        slow = batch.num_tokens == self.slow_tokens
        if slow and threading.current_thread().name.startswith("cgregistry-capture-"):
            self.slow_began.set()
        self.capture_s = self.slow_s if slow else self.quick_s
        return super().__call__(batch, x)


def hits_beside_the_slow_key(reg: cg.GraphRegistry, step: KeyedSleepyStep) -> list[int]:
    """Capture 32, 8 and 4 tokens in the background, 32 (the slow key, which serves every batch below) first, and run
    three steps of 3 tokens once it is in flight: the registry's hits after each (each output checked)."""
    step.slow_began.clear()
    reg.capture([(B(n), "full") for n in (32, 8, 4)], background=True)
    assert step.slow_began.wait(30), "the capture thread did not start on the slow key"
    x = torch.randn(3, D)
    hits = []
    for _ in range(3):
        torch.testing.assert_close(reg.run(B(3), x=x), x * 2)
        hits.append(reg.stats().hits)
    assert reg.wait_captured(timeout=30)
    return hits


def test_a_step_does_not_wait_for_a_slow_key_in_flight_because_other_keys_were_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys' capture times differ tenfold (a 512-token mixed key against a decode key): whether waiting for the key in
    flight beats running eagerly is judged by that key's own last capture time, not by the quick keys' median."""
    monkeypatch.setattr(background, "WAIT_LIMIT_S", 5.0)  # long enough to wait out the slow key
    step = KeyedSleepyStep(0.01, 0.05, slow_tokens=32, slow_s=0.3)
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
    reg.capture([(B(n), "full") for n in (32, 1, 2, 4, 8)], background=True)  # every key's own time, measured
    assert reg.wait_captured(timeout=30) and len(reg) == 5
    reg.clear()  # as refresh() after weights moved: the same keys, captured again beside the engine
    hits = hits_beside_the_slow_key(reg, step)
    assert hits == [0, 0, 0], f"a step waited for the 0.3 s key in flight instead of running eagerly in 50 ms: {hits}"


def test_a_step_waits_at_most_half_an_eager_step_for_a_key_the_estimate_said_was_sooner(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key whose capture takes far longer than its last one (the estimate is wrong): the step that waits for it
    gives up after half an eager step (WAIT_SHARE) and runs eagerly, instead of waiting up to WAIT_LIMIT_S for it."""
    monkeypatch.setattr(background, "WAIT_LIMIT_S", 5.0)  # long enough to wait out the slow capture
    step = KeyedSleepyStep(0.01, 0.05, slow_tokens=32, slow_s=0.01)
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
    reg.capture([(B(16), "full")])  # the process's first capture, whose one-time costs are not the key's
    reg.capture([(B(n), "full") for n in (32, 1, 2)], background=True)  # 32 took about 10 ms
    assert reg.wait_captured(timeout=30) and len(reg) == 4
    reg.clear()
    step.slow_s = 0.4  # this time it takes 0.4 s
    hits = hits_beside_the_slow_key(reg, step)
    assert hits == [0, 0, 0], f"a step waited out the 0.4 s capture its estimate put at 10 ms: {hits}"


def test_the_capture_thread_never_stands_aside_holding_the_lock_run_takes() -> None:
    """The capture thread takes the background's lock to pop its next key and to hand in a result, and run() takes it
    to install results: standing aside while holding it would stall that run() for the whole limit."""
    capture = background.BackgroundCapture(None, None, None, "standing-aside")  # type: ignore[arg-type]
    turn: list[None] = []  # a run() in progress, on a thread not watched here
    hook = capture.step_aside_hook(turn, limit=30.0)
    started = time.monotonic()
    capture.holding.append(None)
    hook(None, "call", None)  # holding the lock: goes on at once
    capture.holding.pop()
    assert time.monotonic() - started < 10
    threading.Timer(0.2, turn.append, (None,)).start()  # the run() ends
    started = time.monotonic()
    hook(None, "call", None)  # not holding it: stands aside until the run() ends
    assert time.monotonic() - started >= 0.15


@pytest.mark.parametrize("method", STAND_ASIDE_METHODS)
def test_a_step_that_takes_a_lock_the_capture_thread_holds_is_not_stalled(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step takes a lock of its own around its ops (a cache's, a logging handler's): the capture thread running it
    may stand aside inside that lock, and the serving thread's eager step then blocks on it.  Seeing the serving
    thread stand still, the capture thread goes on and lets the lock go, instead of stalling run() for the limit."""
    monkeypatch.setattr(background, "PAUSE_LIMIT_S", 60.0)
    monkeypatch.setattr(background, "STAND_ASIDE_BY", method)
    lock = threading.Lock()
    weight = torch.randn(D, D, generator=torch.Generator().manual_seed(1))

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(20):
            with lock:
                y = torch.tanh(y @ weight)
        return y

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
    finished = threading.Event()

    def serve() -> None:
        x = torch.randn(MAX_TOKENS, D)
        for _ in range(2):
            reg.clear()
            reg.capture([(B(n), "full") for n in range(1, 17)], background=True)
            while reg.capturing():
                torch.testing.assert_close(reg.run(B(MAX_TOKENS), x=x), step(B(MAX_TOKENS), x))  # eager beside it
        finished.set()

    worker = threading.Thread(target=serve, name="serving")
    worker.start()
    worker.join(45)
    assert finished.is_set(), "a step stalled on a lock held by the capture thread standing aside"


@pytest.mark.parametrize("engine_froze", ["never", "before", "after_the_wait"])
def test_the_heap_is_frozen_while_the_capture_thread_works_and_as_it_was_after(engine_froze: str) -> None:
    """A capture makes many objects; a full collection they set off would hold the GIL for the whole heap (0.2 s with
    a 1B model loaded) on whichever thread, the serving one included: while the capture thread works, collections see
    only objects made since it began.  The heap is as it was once wait_captured() returns, and a heap the engine froze
    (before, or at the end of its start-up once the capture is waited for) stays frozen."""
    seen: list[int] = []

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name.startswith("cgregistry-capture-"):
            seen.append(gc.get_freeze_count())
        return x * 2

    if engine_froze == "before":
        gc.freeze()
    else:
        gc.unfreeze()  # a heap nobody froze (some interpreters start with a few hundred objects frozen)
    try:
        reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
        reg.capture([(B(n), "full") for n in (4, 8)], background=True)
        assert reg.wait_captured(timeout=30) and len(reg) == 2
        assert seen and all(n > 0 for n in seen), seen
        assert (gc.get_freeze_count() > 0) == (engine_froze == "before"), "the heap is not as it was once the wait returned"
        if engine_froze == "after_the_wait":
            gc.freeze()
        deadline = time.monotonic() + 30
        thread = f"cgregistry-capture-{reg.name}"
        while any(t.name == thread for t in threading.enumerate()):  # let the thread end: it must not unfreeze then
            assert time.monotonic() < deadline, "the capture thread did not end"
            time.sleep(0.01)
        assert (gc.get_freeze_count() > 0) == (engine_froze != "never"), "the engine's own frozen heap was unfrozen"
    finally:
        gc.unfreeze()


def test_no_full_collection_runs_while_the_capture_thread_works_beside_a_heap_frozen_before_it() -> None:
    """A heap frozen before the capture (by the engine, or by the interpreter's start-up: some builds start with a few
    hundred objects frozen) is not the capture thread's to thaw, so it cannot freeze the rest of the heap: the full
    collection waits instead, on every thread, until the capture thread runs out of work, and is back as it was once
    the wait returns (what the engine set meanwhile kept)."""
    thresholds = gc.get_threshold()
    ran: list[str] = []
    full: list[str] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(threading.current_thread().name)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name.startswith("cgregistry-capture-"):
            if not ran:
                gc.set_threshold(150)  # the engine tunes the young collections meanwhile
            ran.append("capture thread")
            for _ in range(3000):  # a capture's worth of objects in cycles: automatic collections, the full one due
                a: list = []
                a.append(a)
        return x * 2

    gc.freeze()  # a few objects frozen before anything ran, as by the interpreter's start-up
    gc.set_threshold(100, 1, 1)  # a full collection due after two young ones
    gc.callbacks.append(watch)
    try:
        reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
        reg.capture([(B(n), "full") for n in (4, 8)], background=True)
        assert reg.wait_captured(timeout=30) and len(reg) == 2
        assert ran, "the step never ran on the capture thread"
        assert not [name for name in full if name.startswith("cgregistry-capture-")], full
        assert gc.get_threshold() == (150, 1, 1), "the full collection is not back as it was once the wait returned"
        assert gc.get_freeze_count() > 0, "the heap frozen before the capture was thawed"
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*thresholds)
        gc.unfreeze()
