"""The registry is a guest in the engine's process: no call of it (capture at once or between steps, refresh, sleep,
wake, run, refits) leaves the interpreter's or torch's global state other than it found it, or shows the step another
(the collector paused while a capture runs the step is the one exception, put back before the call returns); it starts
no thread; a profiler, a pool partner's steps and an interrupt in refresh() or wake() change nothing it promised."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import types
from typing import Any

import pytest
import torch
from torch import nn

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from tests.background.test_background import PLAN, Engine, batch_inputs, eager, make

ROOT = __import__("pathlib").Path(__file__).parent.parent.parent


def _torch_objects() -> dict[str, object]:
    import torch.distributed

    return {"torch": torch, "torch.cuda": torch.cuda, "torch.cuda.Stream": torch.cuda.Stream,
            "torch.cuda.CUDAGraph": torch.cuda.CUDAGraph, "torch.distributed": torch.distributed,
            "torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module, "torch.nn.functional": torch.nn.functional}


def process_state() -> dict[str, Any]:
    """What of the interpreter and torch is everyone's: profile and trace functions (this thread's and the ones new
    threads get), the switch interval, the collector (on, frozen, thresholds), the threads, and the attributes of
    torch's modules and classes an engine calls (each attribute's object; a submodule torch imports is new, not changed)."""
    return {
        "profile": (sys.getprofile(), threading.getprofile()),
        "trace": (sys.gettrace(), threading.gettrace()),
        "switch interval": sys.getswitchinterval(),
        "collector on": gc.isenabled(),
        "frozen": gc.get_freeze_count(),
        "thresholds": gc.get_threshold(),
        "threads": sorted(t.ident or 0 for t in threading.enumerate()),
        "torch": {name: {k: id(v) for k, v in vars(obj).items() if not isinstance(v, types.ModuleType)}
                  for name, obj in _torch_objects().items()},
    }


def differences(before: dict[str, Any], now: dict[str, Any], capturing: bool = False) -> list[str]:
    """What differs between two ``process_state()`` readings; ``capturing``: read inside the step while a capture runs
    it, where the collector is paused."""
    found = []
    for name, was in before.items():
        if name == "collector on" and capturing:
            if now[name]:
                found.append("the collector runs while a capture runs the step")
            continue
        if name == "torch":
            for obj, attrs in was.items():
                changed = sorted(k for k, v in attrs.items() if now[name][obj].get(k) != v)
                if changed:
                    found.append(f"{obj}: {changed} replaced or removed")
        elif now[name] != was:
            found.append(f"{name}: {was!r} -> {now[name]!r}")
    return found


class Probe:
    """A step that reads the process state every time it runs (a warm-up, a recording, an eager step) and writes a
    KV cache; its weights are a module the registry watches."""

    def __init__(self, baseline: dict[str, Any]) -> None:
        self.engine = Engine()
        self.model = nn.Linear(16, 16)
        self.baseline = baseline
        self.problems: list[str] = []

    def step(self, batch: B, input_ids: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        capturing = cg.current_batch().key is not None
        self.problems += [f"inside the step ({'capture' if capturing else 'eager'}): {d}"
                          for d in differences(self.baseline, process_state(), capturing)]
        return self.model(self.engine.step(batch, input_ids, slot_mapping))


@pytest.mark.parametrize("engine_collector", ["on", "off"])
def test_no_call_changes_the_interpreters_or_torchs_global_state_before_during_or_after(engine_collector: str) -> None:
    import torch._dynamo  # noqa: F401  (its first import wraps torch.manual_seed: torch's own doing, taken first)

    gc.disable() if engine_collector == "off" else gc.enable()
    try:
        baseline = process_state()
        probe = Probe(baseline)
        reg = cg.GraphRegistry(probe.step, {
            "input_ids": cg.StaticInput((64,), torch.long, fill=0),
            "slot_mapping": cg.StaticInput((64,), torch.long, fill=127),
        }, backend="cpu", adapt=cg.Adaptation(max_graphs=4, settings=dict(max_num_seqs=16, max_num_tokens=64, mode="full"),
                                              every_steps=20, min_steps=20, decay=1.0, min_gain=0.0))
        after: dict[str, list[str]] = {}

        def serve(n: int) -> None:
            for i in range(n):
                batch, inputs = batch_inputs(1 + i % 16, i)
                reg.run(batch, **inputs)

        def sync() -> None:
            probe.model.weight = nn.Parameter(torch.randn(16, 16))

        calls = {
            "capture()": lambda: reg.capture(PLAN.entries[:3]),
            "capture(background) and run()": lambda: (reg.capture(PLAN, background=True), serve(5)),
            "capture_pending()": lambda: reg.capture_pending(0.01),
            "wait_captured()": lambda: reg.wait_captured(),
            "run() with refits": lambda: serve(60),
            "refresh()": lambda: (sync(), reg.refresh()),
            "refresh(background) and run()": lambda: (sync(), reg.refresh(background=True), serve(5), reg.wait_captured()),
            "sleep()": lambda: (reg.sleep(), serve(2)),
            "wake()": lambda: (reg.wake(background=False), serve(2)),
            "sleep() and wake(background)": lambda: (reg.sleep(), reg.wake(), serve(5), reg.wait_captured()),
            "call_on_owner()": lambda: (reg.call_on_owner(reg.release, B.decode(1)), serve(1)),
            "clear()": lambda: reg.clear(),
        }
        for name, call in calls.items():
            call()
            after[name] = differences(baseline, process_state())
        assert {name: found for name, found in after.items() if found} == {}
        assert probe.problems == [], probe.problems[:5]
        assert reg.stats().hits > 0 and reg.stats().plan_changes > 0, "graphs served and refits ran"
    finally:
        gc.enable()


def test_a_torch_profiler_with_stacks_during_capture_between_steps_changes_nothing() -> None:
    """A profiler session recording Python stacks (as vLLM's profiler runs) while keys are captured between steps: the
    keys are captured, every step equals eager, and no profile function is left behind."""
    engine = Engine()
    reg = make(engine)
    reg.capture(PLAN, background=True)
    before = (sys.getprofile(), threading.getprofile())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True):
        for i in range(2 * len(PLAN)):
            batch, inputs = batch_inputs(1 + i % 16, i)
            torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
    assert reg.capturing() == [] and len(reg) == len(PLAN)
    assert (sys.getprofile(), threading.getprofile()) == before


def test_a_drafters_pending_captures_never_run_inside_its_pool_partners_step() -> None:
    """A target and its drafter share a pool and a serving loop (draft, verify, draft, ...): every piece of the
    drafter's pending captures runs before one of the drafter's own steps, none while the target's step runs."""
    events: list[str] = []

    def step_of(name: str) -> Any:
        def step(batch: B, x: torch.Tensor) -> torch.Tensor:
            events.append(f"{name} {'capture' if cg.current_batch().key is not None else 'step'}")
            return x * (2 if name == "target" else 3)
        return step

    spec = {"x": cg.StaticInput((16, 4), torch.float32)}
    target = cg.GraphRegistry(step_of("target"), spec, backend="cpu", name="target")
    drafter = cg.GraphRegistry(step_of("drafter"), spec, backend="cpu", name="drafter", pool=target.pool)
    plan = [(B.decode(n), "full") for n in (1, 2, 4, 8, 16)]
    target.capture(plan)
    drafter.capture(plan, background=True)
    marks: list[tuple[int, int]] = []
    for i in range(3 * len(plan)):
        x = torch.randn(1 + i % 8, 4)
        torch.testing.assert_close(drafter.run(B.decode(x.shape[0]), x=x), x * 3)
        begin = len(events)
        torch.testing.assert_close(target.run(B.decode(x.shape[0]), x=x), x * 2)
        marks.append((begin, len(events)))
    assert all("drafter capture" not in events[a:b] for a, b in marks), "a drafter piece ran inside the target's run()"
    assert len(drafter) == len(plan) and drafter.capturing() == []


def test_capture_between_steps_starts_no_thread_and_the_first_import_of_dynamo_happens_on_the_calling_thread() -> None:
    """Run in a fresh process: no call starts a thread, so whatever the capture imports first (torch's dispatch mode
    imports torch._dynamo) is imported on the engine's own thread, never beside one of the engine's imports."""
    script = """
import sys, threading, builtins, torch
import cgregistry as cg
from cgregistry import BatchDescriptor as B
where = []
original = builtins.__import__
def noting(name, *args, **kwargs):
    if name.startswith("torch._dynamo") and "torch._dynamo" not in sys.modules:
        where.append(threading.current_thread().name)
    return original(name, *args, **kwargs)
builtins.__import__ = noting
threads = threading.active_count()
reg = cg.GraphRegistry(lambda batch, x: torch.nn.functional.embedding(x, torch.ones(10, 4)),
                       {"x": cg.StaticInput((8,), torch.long, fill=0)}, backend="cpu")
reg.capture([(B(n), "full") for n in (2, 4, 8)], background=True)
for n in (1, 3, 5, 7, 2, 6):
    reg.run(B(n), x=torch.zeros(n, dtype=torch.long))
    assert threading.active_count() == threads, threading.enumerate()
assert reg.wait_captured() and len(reg) == 3
print(where)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] in ("[]", "['MainThread']"), done.stdout


class Interrupting(Engine):
    """An engine whose step raises KeyboardInterrupt (a Ctrl-C) at its ``at``-th capture call."""

    def __init__(self) -> None:
        super().__init__()
        self.at: int | None = None

    def step(self, batch: B, input_ids: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        if cg.current_batch().key is not None and self.at is not None:
            self.at -= 1
            if self.at == 0:
                self.at = None
                raise KeyboardInterrupt
        return super().step(batch, input_ids, slot_mapping)


@pytest.mark.parametrize("where", ["refresh", "wake"])
@pytest.mark.parametrize("at", [1, 4])
def test_ctrl_c_inside_refresh_or_wake_loses_no_key(where: str, at: int) -> None:
    """An interrupt while refresh() or wake() captures keys again: the keys not captured yet stay owed and planned
    lazily (pending() lists them), none is lost, and the next refresh() or wake() captures every one."""
    engine = Interrupting()
    model = nn.Linear(16, 16)
    reg = make(engine)
    reg.watch(model, "model.")
    reg.capture(PLAN)
    if where == "refresh":
        model.weight = nn.Parameter(torch.randn(16, 16))
    else:
        reg.sleep()
    engine.at = at
    with pytest.raises(KeyboardInterrupt):
        reg.refresh() if where == "refresh" else reg.wake(background=False)
    listed = {pair for pair in reg.pending()} | {(e.key, e.strategy) for e in reg.entries()}
    assert listed == {(e.descriptor, e.strategy) for e in PLAN}, "every key is live or pending"
    again = reg.refresh() if where == "refresh" else reg.wake(background=False)
    assert again, "the next call captures what the interrupt left"
    assert len(reg) == len(PLAN) and reg.pending() == [] and reg.failures() == {}
    for i in (1, 5, 16):
        batch, inputs = batch_inputs(i, i)
        torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
