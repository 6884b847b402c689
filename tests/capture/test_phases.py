"""Where a capture's seconds went: every entry splits its capture time into compile, warm-up, record and
instantiate, adding up to it, and each phase holds the time of the work that belongs to it."""

from __future__ import annotations

import time

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.inspection import CapturePhases
from cgregistry.contracts import runtime

from tests.strategies.test_piecewise import demo_registry

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


class TimedStep:
    """A step whose warm-up run and recorded run sleep for the given seconds (the calls for one key alternate)."""

    def __init__(self, warmup_s: float, record_s: float) -> None:
        self.warmup_s, self.record_s, self.calls = warmup_s, record_s, 0
        self.weight = torch.randn(4, 4)

    def __call__(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.warmup_s if self.calls % 2 == 0 else self.record_s)
        self.calls += 1
        return x @ self.weight


def test_the_phases_add_up_to_the_capture_seconds_and_put_the_warm_up_and_the_recording_where_they_ran() -> None:
    step = TimedStep(warmup_s=0.05, record_s=0.02)
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8, 4), torch.float32)}, backend="cpu")
    reg.watch(torch.nn.Module())
    captured = reg.capture([(B(8), "full"), (B(4), "full")])
    for entry in captured:
        phases = entry.phases
        assert phases is not None and phases.total == pytest.approx(entry.capture_seconds)
        assert phases.compile == 0.0, "nothing compiled"
        assert phases.warmup >= 0.05 and phases.record >= 0.02, phases
        assert phases.warmup < entry.capture_seconds - 0.02, "the recorded run's sleep is not the warm-up's"
        assert phases.instantiate >= 0.0
    total = CapturePhases.of(captured)
    assert total.total == pytest.approx(sum(e.capture_seconds for e in captured))
    assert total == captured[0].phases + captured[1].phases
    assert [e.phases for e in reg.entries()] == [e.phases for e in captured], "entries() shows them too"
    assert "warmup" in total.summary() and total.summary().startswith(f"{total.total:.2f} s")


@pytest.mark.parametrize("reset", [False, True], ids=["as-is", "after-dynamo-reset"])
def test_the_first_piecewise_key_carries_the_compile_and_the_later_keys_none(reset: bool) -> None:
    """Also after ``torch._dynamo.reset()``, which drops dynamo's compile callbacks: the next capture sets them again."""
    if reset:
        demo_registry("cpu")[0].capture([(B(8), "piecewise")])  # dynamo loaded and the callbacks set
        torch._dynamo.reset()
    reg, _, _, compiled = demo_registry("cpu")
    plan = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=32, mode="full_and_piecewise")
    captured = reg.capture(plan)
    assert len(compiled.compiler.traces) == 1, "one trace for the plan"
    compiles = [e.phases.compile for e in captured if e.phases is not None]
    assert len(compiles) == len(captured) and compiles[0] > 0, "the first capture traced the model"
    assert all(c == 0.0 for c in compiles[1:]), f"only the first key compiled: {compiles}"
    first = captured[0].phases
    assert first is not None and first.total == pytest.approx(captured[0].capture_seconds)
    assert first.compile <= captured[0].capture_seconds


def test_a_background_capture_and_a_failed_one_leave_no_clock_set() -> None:
    step = TimedStep(warmup_s=0.0, record_s=0.0)
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8, 4), torch.float32)}, backend="cpu")
    reg.watch(torch.nn.Module())
    reg.capture([(B(8), "full"), (B(2), "full")], background=True)
    assert reg.wait_captured(timeout=30)
    assert all(e.phases is not None and e.phases.total == pytest.approx(e.capture_seconds) for e in reg.entries())

    def failing(batch: B, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no graph today")

    bad = cg.GraphRegistry(failing, {"x": cg.StaticInput((8, 4), torch.float32)}, backend="cpu")
    with pytest.raises(cg.CaptureError):
        bad.capture([(B(4), "full")])
    assert runtime.phase_clock.get() is None, "the failed capture left its clock set on this thread"
    again = reg.capture([(B(1), "full")])
    assert again[0].phases is not None and again[0].phases.total == pytest.approx(again[0].capture_seconds)
    assert runtime.phase_clock.get() is None


def test_a_snapshot_keeps_each_entrys_phases_and_an_older_one_loads_without_them() -> None:
    step = TimedStep(warmup_s=0.0, record_s=0.0)
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8, 4), torch.float32)}, backend="cpu")
    reg.watch(torch.nn.Module())
    reg.capture([(B(8), "full"), (B(2), "full")])
    data = reg.snapshot()
    snap = cg.load_snapshot(data)
    assert [e.phases for e in snap.entries] == [e.phases for e in reg.entries()] != [None, None]
    for entry in data["entries"]:
        del entry["phases"]  # what schema 3 wrote
    assert all(e.phases is None for e in cg.load_snapshot({**data, "schema": 3}).entries)
