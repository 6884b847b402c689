"""The serving state and reentrancy, as an engine meets them: background captures under another default dtype, the
cuDNN TF32 flag, debug-mode outputs after a refused run, calls back into a registry from a step or a hook, the
message of a registry that only adapts, and a subclass's ``run``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins
from tests.serving_threads import HIDDEN, matmul_registry

ROOT = Path(__file__).parents[2]


def test_a_pending_capture_under_another_default_dtype_is_not_replayed_silently() -> None:
    """A pending key captured while the process-wide default dtype differs from the recorded state is never replayed
    as if it matched: its capture fails (named, kept in failures()) and run() returns what the step computes eagerly."""
    weight = torch.randn(HIDDEN, HIDDEN)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return x @ weight + torch.ones(x.shape[0], 1)  # torch.ones: the default dtype

    reg = matmul_registry(step)
    reg.capture([(B.decode(8), "full")], background=True)
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.warns(RuntimeWarning, match="default dtype torch.float64 now, torch.float32 recorded"):
            assert reg.wait_captured()
    finally:
        torch.set_default_dtype(torch.float32)
    x = torch.randn(8, HIDDEN)
    expected = step(B.decode(8), x)
    out = reg.run(B.decode(8), x=x)
    assert (B.decode(8), "full") in reg.failures() and out.dtype == expected.dtype, (
        f"run() replayed a graph captured under float64 and returned {out.dtype}; the step eagerly returns {expected.dtype}"
    )


def test_a_cudnn_tf32_change_after_capture_is_refused() -> None:
    """A replay after ``torch.backends.cudnn.allow_tf32`` changed since capture raises ServingStateError naming it."""
    weight = torch.randn(HIDDEN, HIDDEN)
    reg = matmul_registry(lambda batch, x: x @ weight)
    reg.capture([(B.decode(8), "full")])
    x = torch.randn(8, HIDDEN)
    reg.run(B.decode(8), x=x)
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = not before
    try:
        assert reg.capture_context is not None and reg.capture_context.state.differences(), "the record sees the change"
        with pytest.raises(cg.ServingStateError, match="cudnn.allow_tf32"):
            reg.run(B.decode(8), x=x)
    finally:
        torch.backends.cudnn.allow_tf32 = before


def test_clear_from_a_hook_inside_a_foreground_capture_is_refused() -> None:
    """clear() from a hook during a foreground capture() is refused, and the registry keeps checking the serving
    state of its graphs."""
    weight = torch.randn(HIDDEN, HIDDEN)
    step = lambda batch, x: x @ weight  # noqa: E731
    outcome: list[object] = []

    class Clearer:
        armed = True

        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            if self.armed:
                self.armed = False
                try:
                    outcome.append(registry.clear())
                except Exception as exc:  # noqa: BLE001
                    outcome.append(exc)

    reg = matmul_registry(step, plugins=make_plugins(Clearer()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg.capture([(B.decode(16), "full"), (B.decode(8), "full")])
    x = torch.randn(8, HIDDEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = step(B.decode(8), x)
        try:
            out = reg.run(B.decode(8), x=x)
        except cg.ServingStateError:
            out = expected
    assert outcome and isinstance(outcome[0], Exception), f"clear() from a hook inside capture() was not refused: it returned {outcome}"
    assert out.dtype == expected.dtype, f"a graph held with capture_context={reg.capture_context} replayed {out.dtype} under autocast"


def test_debug_mode_a_run_refused_for_its_serving_state_leaves_earlier_outputs_readable() -> None:
    """In debug mode a run() refused with ServingStateError overwrites nothing: the previous run's output stays
    readable."""
    weight = torch.randn(HIDDEN, HIDDEN)
    reg = matmul_registry(lambda batch, x: x @ weight, debug=True)
    reg.capture([(B.decode(8), "full")])
    x = torch.randn(8, HIDDEN)
    out = reg.run(B.decode(8), x=x)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(cg.ServingStateError):
        reg.run(B.decode(8), x=x)
    torch.testing.assert_close(out.clone(), x @ weight)


def test_a_subclass_run_override_is_called() -> None:
    """A GraphRegistry subclass's ``run`` override is what ``reg.run`` calls."""
    weight = torch.randn(HIDDEN, HIDDEN)
    calls: list[B] = []

    class Instrumented(cg.GraphRegistry):
        def run(self, actual, /, **kwargs):  # noqa: ANN001, ANN003, ANN201
            calls.append(actual)
            return super().run(actual, **kwargs)

    reg = Instrumented(lambda batch, x: x @ weight, {"x": cg.StaticInput((64, HIDDEN), torch.float32)}, backend="cpu")
    reg.capture([(B.decode(8), "full")])
    reg.run(B.decode(8), x=torch.randn(8, HIDDEN))
    assert calls == [B.decode(8)], f"the subclass's run() was called {len(calls)} times"


def test_a_run_from_inside_run_on_the_same_thread_is_named_as_such() -> None:
    """run() called from inside run() on the same thread (from the step or a hook) is refused with a message that
    says so, not with the advice for two threads."""
    weight = torch.randn(HIDDEN, HIDDEN)
    errors: list[str] = []

    class Rerun:
        @cg.plugin.hookimpl
        def cgregistry_miss(self, registry, actual):  # noqa: ANN001
            try:
                registry.run(actual, x=torch.randn(actual.num_tokens, HIDDEN))
            except Exception as exc:  # noqa: BLE001
                errors.append(str(exc))

    reg = matmul_registry(lambda batch, x: x @ weight, plugins=make_plugins(Rerun()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg.run(B.decode(8), x=torch.randn(8, HIDDEN))
    assert errors and "own registry" not in errors[0] and "inside" in errors[0], errors


def test_capture_from_a_capture_started_hook_on_the_serving_thread_does_not_hang() -> None:
    """capture() from a capture_started hook on the serving thread returns (refused), never deadlocks on the capture
    lock its own thread holds (run in a subprocess: a hang would leave the collector disabled)."""
    script = textwrap.dedent(
        """
        import threading, warnings, torch, cgregistry as cg
        from cgregistry import BatchDescriptor as B
        from cgregistry.testing import make_plugins
        weight = torch.randn(16, 16)

        class Companion:
            armed = True

            @cg.plugin.hookimpl
            def cgregistry_capture_started(self, registry, key, strategy):
                if self.armed:
                    self.armed = False
                    registry.capture([(B.decode(2), "full")])

        def serve():
            reg = cg.GraphRegistry(lambda batch, x: x @ weight, {"x": cg.StaticInput((64, 16), torch.float32)},
                                   backend="cpu", plugins=make_plugins(Companion()))
            reg.capture([(B.decode(8), "full")])

        warnings.simplefilter("ignore")
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        thread.join(5)
        print("HUNG" if thread.is_alive() else "RETURNED", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "RETURNED" in done.stdout, (
        f"capture() hung: a capture_started hook's capture() waits for the capture lock its own thread holds "
        f"({done.stdout.strip()!r}, {done.stderr.strip()[-300:]!r})"
    )


def test_the_serving_state_error_of_an_adapting_registry_says_where_its_state_was_recorded() -> None:
    """The ServingStateError of a registry that only adapts says that its state was recorded at the step that started
    adaptation (not at a capture() it never made)."""
    from cgregistry.plan.adapt import Adaptation

    weight = torch.randn(HIDDEN, HIDDEN)
    settings = dict(max_num_seqs=16, max_num_tokens=64, mode="full", max_capture_size=64)
    adapt = Adaptation(max_graphs=3, settings=settings, every_steps=10, min_steps=10, decay=1.0, min_gain=0.0)
    reg = matmul_registry(lambda batch, x: x @ weight, adapt=adapt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(10):
                reg.run(B.decode(3), x=torch.randn(3, HIDDEN))
            assert reg.wait_captured(timeout=20) and len(reg) > 0
        with pytest.raises(cg.ServingStateError) as info:
            reg.run(B.decode(3), x=torch.randn(3, HIDDEN))
    message = str(info.value)
    assert "adapt" in message or "refit" in message, message
