"""Every capture path runs the step under the serving thread's state (autocast, default device, context variables)
and the one capture context (the ``context=`` payload); a replay under another state than the capture's is refused."""

from __future__ import annotations

import contextlib
import contextvars
import threading

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.plan.adapt import Adaptation
from cgregistry.capture.serving_state import ServingState, ServingStateError
from tests.conftest import device_of

WIDTH, MAX_TOKENS = 64, 32
PLAN = cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[8, 32])
PATHS = ["foreground", "background", "lazy", "refit"]


class Model:
    """Two matmuls: under autocast they run in bfloat16 and return it; without, float32."""

    def __init__(self, backend: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.device = device_of(backend)
        self.w1 = torch.randn(WIDTH, WIDTH, generator=g).to(self.device)
        self.w2 = torch.randn(WIDTH, WIDTH, generator=g).to(self.device)

    def step(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1) @ self.w2


def registry(model: Model, backend: str, **kwargs: object) -> cg.GraphRegistry:
    return cg.GraphRegistry(model.step, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend=backend, **kwargs)


def autocast(backend: str) -> contextlib.AbstractContextManager[None]:
    return torch.autocast(device_of(backend).type, dtype=torch.bfloat16)


def traffic(model: Model, n: int, seed: int) -> tuple[B, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return B.decode(n), torch.randn(n, WIDTH, generator=g).to(model.device)


def capture_by(path: str, reg: cg.GraphRegistry, model: Model) -> None:
    """Get graphs for the decode keys of PLAN into ``reg`` by one capture path, on the calling (serving) thread."""
    if path == "foreground":
        reg.capture(PLAN)
    elif path == "background":
        reg.capture(PLAN, background=True)
        assert reg.wait_captured(timeout=60)
    elif path == "lazy":
        reg.capture(PLAN, lazy=True)
        for n in (3, 20):
            reg.run(*[traffic(model, n, n)[0]], x=traffic(model, n, n)[1])
    else:  # the refit of an adapting registry that was never asked to capture anything
        with pytest.warns(RuntimeWarning, match="with no graph captured or planned"):
            for i in range(60):
                batch, x = traffic(model, 3 + i % 2, i)
                reg.run(batch, x=x)
        assert reg.wait_captured(timeout=60)
    assert len(reg) >= 1


@pytest.mark.parametrize("path", PATHS)
def test_every_capture_path_runs_the_step_under_the_serving_threads_autocast(backend: str, path: str) -> None:
    model = Model(backend)
    adapt = Adaptation(max_graphs=2, settings=dict(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full"),
                       every_steps=50, min_steps=50) if path == "refit" else None
    reg = registry(model, backend, adapt=adapt)
    with torch.inference_mode(), autocast(backend):
        capture_by(path, reg, model)
        for seed, n in enumerate((1, 3, 4, 7)):
            batch, x = traffic(model, n, 100 + seed)
            out = reg.run(batch, x=x)
            expected = model.step(batch, x)
            assert reg.match(batch) is not None, "served by a graph"
            assert out.dtype == expected.dtype == torch.bfloat16, f"{path}: the graph ran without the serving thread's autocast"
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert reg.stats().hits >= 4


@pytest.mark.parametrize("captured_under_autocast", [False, True])
def test_a_replay_under_another_autocast_than_the_capture_is_refused_and_eager_is_not(backend: str, captured_under_autocast: bool) -> None:
    model = Model(backend)
    reg = registry(model, backend)
    batch, x = traffic(model, 3, 0)
    with autocast(backend) if captured_under_autocast else contextlib.nullcontext():
        reg.capture(PLAN)
        reg.run(batch, x=x)
    with contextlib.nullcontext() if captured_under_autocast else autocast(backend):
        with pytest.raises(ServingStateError, match=r"autocast\(\w+, torch.bfloat16\)") as info:
            reg.run(batch, x=x)
        assert "call capture() under the state you serve with" in str(info.value)
    with autocast(backend) if captured_under_autocast else contextlib.nullcontext():
        out = reg.run(batch, x=x)  # back under the capture's state: served
    assert reg.stats().hits == 2
    assert out.dtype == (torch.bfloat16 if captured_under_autocast else torch.float32)


def test_capture_under_another_state_than_the_graphs_held_is_refused_until_clear() -> None:
    model = Model("cpu")
    reg = registry(model, "cpu")
    reg.capture([(B.decode(8), "full")])
    with autocast("cpu"):
        with pytest.raises(ServingStateError, match=r"autocast\(cpu, torch.bfloat16\) now, no autocast at capture; .* reg.clear\(\) first"):
            reg.capture([(B.decode(32), "full")])
        assert len(reg) == 1, "a refused capture changes nothing"
        reg.clear()
        reg.capture([(B.decode(32), "full")])
        batch, x = traffic(model, 5, 1)
        assert reg.run(batch, x=x).dtype == torch.bfloat16


def test_a_change_of_the_default_dtype_after_capture_is_refused() -> None:
    model = Model("cpu")
    reg = registry(model, "cpu")
    reg.capture(PLAN)
    batch, x = traffic(model, 3, 0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(ServingStateError, match="default dtype torch.float64 now, torch.float32 at capture"):
            reg.run(batch, x=x)
    finally:
        torch.set_default_dtype(old)
    reg.run(batch, x=x)


REQUEST = contextvars.ContextVar("request", default="unset")


def test_pending_keys_are_captured_under_the_context_variables_recorded_at_capture() -> None:
    """A key captured in a piece between steps sees the context variables capture(background=True) was called under,
    whatever the run() or capture_pending() that takes the piece binds."""
    seen: list[tuple[object, str]] = []

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        seen.append((cg.current_batch().key, REQUEST.get("unbound")))
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8, 4), torch.float32)}, backend="cpu")
    token = REQUEST.set("engine-config")
    try:
        reg.capture([(B.decode(8), "full")], background=True)
    finally:
        REQUEST.reset(token)
    reg.run(B.decode(8), x=torch.ones(8, 4))  # the warm-up piece, then the step, which binds nothing
    assert reg.capture_pending(None)  # the recording piece
    captured = [value for key, value in seen if key is not None]
    assert len(captured) == 2 and set(captured) == {"engine-config"}, seen
    assert ("unbound" in [value for key, value in seen if key is None]), seen


def test_serving_state_carries_the_default_device_to_another_thread() -> None:
    with torch.device("meta"):
        state = ServingState.current()
    assert state.default_device == torch.device("meta")
    got: list[torch.device] = []
    t = threading.Thread(target=lambda: got.append(state.run(lambda: torch.empty(1).device)))
    t.start()
    t.join(10)
    assert got == [torch.device("meta")]


# ---------------------------------------------------------------- one capture context (the payload)


def payload_step() -> tuple[object, list[object]]:
    """A step with an eager break that needs the engine's payload at capture (as attention metadata builders do)."""
    payloads: list[object] = []

    @cg.eager_break
    def attention(x: torch.Tensor) -> torch.Tensor:
        ctx = cg.current_batch()
        assert ctx is not None
        if ctx.key is not None and ctx.payload is None:
            raise RuntimeError("capture without the engine's payload")
        payloads.append(ctx.payload)
        return x + 1

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return attention(x * 2)

    return step, payloads


def payload_registry(**kwargs: object) -> tuple[cg.GraphRegistry, list[object]]:
    step, payloads = payload_step()
    return cg.GraphRegistry(step, {"x": cg.StaticInput((32, 4), torch.float32)}, backend="cpu", **kwargs), payloads


def test_a_refit_captures_with_the_context_of_a_foreground_start_up() -> None:
    adapt = Adaptation(max_graphs=3, settings=dict(max_num_seqs=32, max_num_tokens=32, mode="breakable"),
                       every_steps=40, min_steps=40, decay=1.0, min_gain=0.0)
    reg, payloads = payload_registry(adapt=adapt)
    reg.capture([(B(32), "breakable")], context="metadata")  # a foreground start-up
    for i in range(80):
        n = 2 + i % 3
        out = reg.run(B(n), x=torch.ones(n, 4), context="live")
        assert torch.equal(out, torch.full((n, 4), 3.0))
    assert reg.wait_captured(timeout=60)
    assert reg.stats().plan_changes >= 1 and reg.failures() == {}, reg.failures()
    added: set[tuple[B, str]] = set()
    for change in reg.plan_changes:  # a later refit may release what an earlier one added
        added = (added | set(change.added)) - set(change.removed)
    assert added and added <= {(e.key, e.strategy) for e in reg.entries()}
    assert set(payloads) == {"metadata", "live"}


def test_lazy_recaptures_use_the_context_of_a_background_start_up() -> None:
    reg, payloads = payload_registry()
    reg.capture(cg.CapturePlan.of([(B(32), "breakable"), (B(8), "breakable")]), background=True, context="metadata")
    assert reg.wait_captured(timeout=60)
    reg.capture([(B(16), "breakable")], lazy=True)
    out = reg.run(B(12), x=torch.ones(12, 4), context="live")
    assert torch.equal(out, torch.full((12, 4), 3.0))
    assert reg.match(B(12)).key == B(16) and reg.stats().lazy_captures == 1
    assert reg.failures() == {}
