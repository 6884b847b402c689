"""GraphRegistry with the full strategy, on the cpu emulator and (marked cuda) on a GPU."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.demo_model import DemoConfig, DemoDecoder, demo_inputs, random_batch

from tests.conftest import device_of

TINY = DemoConfig(layers=2, hidden=64, heads=4, ffn=96, vocab=128, max_num_seqs=16, max_num_tokens=64, context=16, dtype=torch.float32)


class RowStep:
    """y[t] = (x[t] @ w) * scale[req_idx[t]]: each output row depends on its own inputs only."""

    def __init__(self, device: torch.device) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(8, 8, generator=g).to(device)
        self.calls: list[B] = []

    def __call__(self, batch: B, x: torch.Tensor, req_idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self.calls.append(batch)
        return (x @ self.w) * scale[req_idx][:, None]


def row_inputs() -> dict[str, cg.StaticInput]:
    return {
        "x": cg.StaticInput((64, 8), torch.float32),
        "req_idx": cg.StaticInput((64,), torch.long, fill=0),
        "scale": cg.StaticInput((16,), torch.float32, axis="reqs", fill=1.0),
    }


def live(batch: B, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    reqs = batch.num_reqs
    req_idx = torch.cat([torch.arange(reqs), torch.randint(0, reqs, (batch.num_tokens - reqs,), generator=g)]).sort().values
    return {
        "x": torch.randn(batch.num_tokens, 8, generator=g).to(device),
        "req_idx": req_idx.to(device),
        "scale": torch.rand(reqs, generator=g).to(device) + 0.5,
    }


def make(backend: str, plan: cg.CapturePlan | None = None) -> tuple[cg.GraphRegistry, RowStep]:
    step = RowStep(device_of(backend))
    reg = cg.GraphRegistry(step, row_inputs(), backend=backend)
    # uniform keys beside the mixed ones (a step that branches on uniformity), so both kinds are exercised
    reg.capture(plan or cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=64, mode="full", separate_decode=True))
    return reg, step


def test_auto_backend_picks_cuda_when_available() -> None:
    reg = cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((4,), torch.float32)})
    assert reg.backend.name == ("cuda" if torch.cuda.is_available() else "cpu")


def test_run_matches_eager_across_the_plan(backend: str) -> None:
    reg, step = make(backend)
    device = device_of(backend)
    shapes = [B.decode(r) for r in (1, 3, 5, 16)] + [B(t, r) for t, r in ((3, 2), (9, 4), (17, 16), (32, 5))]
    for i, batch in enumerate(shapes):
        inputs = live(batch, device, seed=i)
        out = reg.run(batch, **inputs)
        assert reg.match(batch) is not None
        assert out.shape == (batch.num_tokens, 8)
        torch.testing.assert_close(out, step(batch, **inputs))
    assert reg.stats().hits == len(shapes) and reg.stats().misses == 0


def test_padding_and_stats(backend: str) -> None:
    reg, _ = make(backend)
    device = device_of(backend)
    reg.run(B.decode(5), **live(B.decode(5), device))  # pads to 8
    reg.run(B.decode(8), **live(B.decode(8), device))
    s = reg.stats()
    assert (s.hits, s.padded_tokens, s.graph_tokens) == (2, 3, 13)
    assert s.by_strategy == {"full": 2}
    used = [e for e in reg.entries() if e.replays]
    assert [(e.key, e.replays, e.padded_tokens) for e in used] == [(B.decode(8), 2, 3)]
    assert used[0].last_step == 2
    reg.reset_stats()
    assert reg.stats().hits == 0 and all(e.replays == 0 for e in reg.entries())


def test_miss_runs_eagerly_and_is_counted(backend: str) -> None:
    reg, step = make(backend)
    device = device_of(backend)
    batch = B(40, 10)  # mixed keys stop at 2 * 16 = 32 tokens
    inputs = live(batch, device)
    step.calls.clear()
    out = reg.run(batch, **inputs)
    assert step.calls == [batch], "the eager fallback calls step with the actual batch"
    torch.testing.assert_close(out, step(batch, **inputs))
    s = reg.stats()
    assert (s.hits, s.misses, s.eager_fallbacks, s.eager_tokens) == (0, 1, 1, 40)
    assert reg.match(batch) is None
    assert "no covering key" in str(reg.explain(batch))


def test_padded_rows_are_refilled_after_a_larger_batch(backend: str) -> None:
    def step(batch: B, scale: torch.Tensor) -> torch.Tensor:
        return scale * 1

    reg = cg.GraphRegistry(step, {"scale": cg.StaticInput((8,), torch.float32, axis="reqs", fill=-1.0)}, backend=backend)
    reg.capture([(B(8, 8), "full")])
    dev = device_of(backend)
    reg.run(B(8, 8), scale=torch.arange(8.0, device=dev))
    out = reg.run(B(3, 3), scale=torch.ones(3, device=dev))
    assert out.tolist() == [1.0, 1.0, 1.0]
    full = reg.static_inputs["scale"]  # the padded tail the graph read
    assert full.tolist() == [1, 1, 1, -1, -1, -1, -1, -1]


def test_pytree_outputs(backend: str) -> None:
    def step(batch: B, x: torch.Tensor) -> dict:
        return {"h": x * 2, "pair": (x + 1, None), "rows": [x.sum(-1)]}

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16, 4), torch.float32)}, backend=backend)
    reg.capture([(B(16), "full")])
    x = torch.randn(5, 4, device=device_of(backend))
    out = reg.run(B(5, 2), x=x)
    torch.testing.assert_close(out["h"], x * 2)
    torch.testing.assert_close(out["pair"][0], x + 1)
    assert out["pair"][1] is None
    torch.testing.assert_close(out["rows"][0], x.sum(-1))
    out["h"] = None  # a caller may mutate the container it got
    assert reg.run(B(5, 2), x=x)["h"] is not None


def test_output_axis_reqs(backend: str) -> None:
    def step(batch: B, lens: torch.Tensor) -> torch.Tensor:
        return lens * 10

    reg = cg.GraphRegistry(step, {"lens": cg.StaticInput((8,), torch.long, axis="reqs", fill=0)}, backend=backend, output_axis="reqs")
    reg.capture([(B.decode(8), "full")])
    lens = torch.arange(1, 4, device=device_of(backend))
    assert reg.run(B.decode(3), lens=lens).tolist() == [10, 20, 30]


def test_capture_failure_leaves_registry_unchanged(backend: str) -> None:
    fail_on = {B(4, 4)}

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch in fail_on:
            raise RuntimeError("boom")
        return x + 1

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16,), torch.float32)}, backend=backend)
    plan = cg.CapturePlan.of([(B(16, 16), "full"), (B(8, 8), "full"), (B(4, 4), "full"), (B(2, 2), "full")])
    with pytest.raises(cg.CaptureError, match=r"capturing Batch\(tokens=4, reqs=4\) with strategy 'full' failed: RuntimeError: boom") as info:
        reg.capture(plan)
    assert info.value.descriptor == B(4, 4) and info.value.strategy == "full"
    assert [e.key for e in reg.entries()] == [B(16, 16), B(8, 8)], "earlier entries stay, the failed one is absent"
    x = torch.ones(3, device=device_of(backend))
    assert reg.run(B(3, 3), x=x).tolist() == [2.0, 2.0, 2.0]
    assert reg.match(B(3, 3)).key == B(8, 8)
    fail_on.clear()
    reg.capture(plan)  # a retry captures what is missing
    assert reg.match(B(3, 3)).key == B(4, 4)
    assert reg.run(B(3, 3), x=x * 5).tolist() == [6.0, 6.0, 6.0]


@pytest.mark.filterwarnings("ignore:.*with no graph captured or planned:RuntimeWarning")  # on purpose
def test_new_captures_update_routes(backend: str) -> None:
    reg = cg.GraphRegistry(lambda b, x: x * 3, {"x": cg.StaticInput((16,), torch.float32)}, backend=backend)
    x = torch.ones(3, device=device_of(backend))
    reg.run(B(3, 1), x=x)
    assert reg.stats().misses == 1
    reg.capture([(B(4), "full")])
    assert reg.run(B(3, 1), x=x).tolist() == [3.0] * 3
    assert reg.stats().hits == 1


def test_unknown_strategy_and_capacity_errors_before_capturing(backend: str) -> None:
    plugins = cg.Plugins(cg.plugin.make_plugin_manager(autoload=False))  # the message lists what is installed
    reg = cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend, plugins=plugins)
    with pytest.raises(KeyError, match="strategy 'warp' is not registered; available: breakable, full"):
        reg.capture([(B(4), "full"), (B(2), "warp")])
    with pytest.raises(ValueError, match=r"key Batch\(tokens=16, reqs=any\) needs 16 tokens in static input 'x', which holds 8"):
        reg.capture([(B(4), "full"), (B(16), "full")])
    assert len(reg) == 0


def test_bad_live_inputs_are_named(backend: str) -> None:
    reg, _ = make(backend)
    dev = device_of(backend)
    batch = B.decode(4)
    good = live(batch, dev)
    with pytest.raises(cg.InputError, match=r"missing \['scale'\]"):
        reg.run(batch, x=good["x"], req_idx=good["req_idx"])
    with pytest.raises(cg.InputError, match=r"unexpected \['y'\]"):
        reg.run(batch, **good, y=good["x"])
    with pytest.raises(cg.InputError, match=r"input 'x' has shape \(5, 8\), expected \(4, 8\) \(4 tokens in this batch\)"):
        reg.run(batch, **{**good, "x": torch.zeros(5, 8, device=dev)})
    with pytest.raises(cg.InputError, match="input 'x' has dtype torch.float64, expected torch.float32"):
        reg.run(batch, **{**good, "x": good["x"].double()})
    with pytest.raises(cg.InputError, match="input 'scale' must be a torch.Tensor, got list"):
        reg.run(batch, **{**good, "scale": [1.0] * 4})
    with pytest.raises(TypeError, match=r"a batch must be a cgregistry.BatchDescriptor, got \(4, 4\) \(tuple\)"):
        reg.run((4, 4), **good)  # type: ignore[arg-type]


def test_step_output_errors_name_the_leaf(backend: str) -> None:
    reg = cg.GraphRegistry(lambda b, x: (x, x[:1]), {"x": cg.StaticInput((8,), torch.float32)}, backend=backend)
    with pytest.raises(cg.CaptureError, match=r"output\[1\] \(output leaf 1\) has shape \(1,\); expected a leading dimension of 4"):
        reg.capture([(B(4), "full")])
    reg = cg.GraphRegistry(lambda b, x: {"a": 3}, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend)
    with pytest.raises(cg.CaptureError, match=r"output\['a'\] is a int"):
        reg.capture([(B(4), "full")])
    assert len(reg) == 0


def test_demo_model_graphs_match_eager(backend: str) -> None:
    device = device_of(backend)
    model = DemoDecoder(TINY, device)
    reg = cg.GraphRegistry(model, demo_inputs(TINY), backend=backend)
    reg.capture(cg.CapturePlan.build(max_num_seqs=TINY.max_num_seqs, max_num_tokens=TINY.max_num_tokens, mode="full"))
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for batch in [B.decode(1), B.decode(7), B(13, 5), B(32, 16), B(30, 2)]:
            inputs = random_batch(TINY, batch, device, g)
            torch.testing.assert_close(reg.run(batch, **inputs), model(batch, **inputs), rtol=1e-4, atol=1e-4)
    assert reg.stats().hits == 5


def test_entries_report_measured_capture(backend: str) -> None:
    reg, _ = make(backend)
    infos = reg.entries()
    assert infos and all(e.backend == backend and e.capture_seconds > 0 for e in infos)
    assert reg.entries(uniform=True) and all(e.key.uniform for e in reg.entries(uniform=True))
    assert reg.entries(strategy="piecewise") == []
    assert reg.memory_bytes() == sum(e.memory_bytes for e in infos)
    assert "entries on " + backend in reg.table()


@pytest.mark.parametrize("engine_gc", ["enabled", "disabled"])
def test_the_collector_is_paused_during_capture_and_left_as_the_engine_had_it(backend: str, engine_gc: str) -> None:
    """No collection runs while the step is captured; the heap is never frozen and the collector's thresholds never
    change; afterwards the collector is on or off as the engine had it."""
    seen: list[tuple[bool, int, tuple[int, ...]]] = []

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        seen.append((gc.isenabled(), gc.get_freeze_count(), gc.get_threshold()))
        return x + 1

    before = (gc.get_freeze_count(), gc.get_threshold())
    gc.disable() if engine_gc == "disabled" else gc.enable()
    try:
        reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend)
        reg.capture([(B(8), "full"), (B(4), "full")])
        assert seen and all(not enabled for enabled, _, _ in seen), "no collection runs during capture"
        assert all((frozen, threshold) == before for _, frozen, threshold in seen), "the heap frozen or the thresholds changed"
        assert gc.isenabled() is (engine_gc == "enabled") and (gc.get_freeze_count(), gc.get_threshold()) == before
    finally:
        gc.enable()


@pytest.mark.cuda
def test_cuda_pool_memory_tracks_the_largest_graph() -> None:
    cfg = DemoConfig(layers=2, hidden=256, heads=4, ffn=512, vocab=1024, max_num_seqs=64, max_num_tokens=256, context=64, dtype=torch.float16)
    model = DemoDecoder(cfg, "cuda")
    plan = cg.CapturePlan.build(max_num_seqs=64, max_num_tokens=256, mode="full", separate_decode=True)  # 30 graphs
    largest = cg.CapturePlan(plan.entries[:1])
    one = cg.GraphRegistry(model, demo_inputs(cfg), backend="cuda")
    one.capture(largest)
    single = one.memory_bytes()
    del one
    gc.collect()
    torch.cuda.empty_cache()
    reg = cg.GraphRegistry(model, demo_inputs(cfg), backend="cuda")
    reg.capture(plan)
    assert len(plan) > 20
    assert reg.memory_bytes() <= 1.15 * single, (reg.memory_bytes(), single)


@pytest.mark.cuda
def test_cuda_outputs_of_all_entries_stay_correct_after_many_captures() -> None:
    """Outputs live in the shared pool without owning it: each replay must still write correct rows."""
    reg, step = make("cuda")
    dev = torch.device("cuda")
    for i, batch in enumerate([B.decode(16), B.decode(1), B(32, 7), B.decode(2), B.decode(16)]):
        inputs = live(batch, dev, seed=10 + i)
        torch.testing.assert_close(reg.run(batch, **inputs), step(batch, **inputs))


def test_failure_inside_capture_leaves_registry_usable(backend: str) -> None:
    """The step survives warm-up but raises while being captured (second call for that key)."""
    calls: dict[B, int] = {}

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        calls[batch] = calls.get(batch, 0) + 1
        if batch == B(4) and calls[batch] == 2:
            raise RuntimeError("failed mid-capture")
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend)
    with pytest.raises(cg.CaptureError, match="failed mid-capture"):
        reg.capture([(B(8), "full"), (B(4), "full")])
    x = torch.arange(3.0, device=device_of(backend))
    assert [e.key for e in reg.entries()] == [B(8)]
    assert reg.run(B(3, 1), x=x).tolist() == [0.0, 2.0, 4.0]
    reg.capture([(B(4), "full")])  # the retry's capture is the third call: it succeeds
    assert reg.match(B(3, 1)).key == B(4)
    assert reg.run(B(3, 1), x=x + 1).tolist() == [2.0, 4.0, 6.0]


def test_host_sync_in_step_is_a_capture_error_and_registry_recovers(backend: str) -> None:
    """A host sync invalidates a CUDA capture; entries captured before it and after it still work."""
    broken = {"on": True}

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch == B(8) and broken["on"]:
            return x * x.sum().item()
        return x + 1

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16,), torch.float32)}, backend=backend)
    with pytest.raises(cg.CaptureError, match=r"capturing Batch\(tokens=8, reqs=any\) with strategy 'full' failed"):
        reg.capture([(B(16), "full"), (B(8), "full")])
    assert [e.key for e in reg.entries()] == [B(16)]
    broken["on"] = False
    reg.capture([(B(8), "full"), (B(4), "full")])
    dev = device_of(backend)
    for n in (3, 7, 12):
        x = torch.arange(float(n), device=dev)
        torch.testing.assert_close(reg.run(B(n, 1), x=x), x + 1)
    assert [e.replays for e in reg.entries()] == [1, 1, 1]


def test_a_plan_capture_collects_garbage_first_only_where_it_may_hold_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full collection before the heap is frozen frees device memory that garbage holds (the default, and cuda's); the
    cpu emulator collects only the young generations (a large heap takes 0.1-0.4 s to collect in full), so garbage made
    just before its capture is still freed by the next young collection, not frozen and thawed into the oldest."""
    from cgregistry.backends.cpu import CpuBackend

    full: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    def registry() -> cg.GraphRegistry:
        return cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")

    def capture() -> tuple[int, bool]:
        """Full collections during a capture, and whether a registry dropped in a reference cycle just before it is
        gone after the next young collection."""
        class Engine:
            pass

        reg = registry()
        gc.collect()
        gc.disable()  # the garbage below stays in the youngest generation until the capture
        try:
            old = Engine()
            old.me, old.reg = old, registry()
            dropped = weakref.ref(old.reg)
            del old
        finally:
            gc.enable()
        full.clear()
        gc.callbacks.append(count)
        try:
            reg.capture([(B(8), "full"), (B(4), "full")])
        finally:
            gc.callbacks.remove(count)
        assert len(reg) == 2
        gc.collect(1)
        return len(full), dropped() is None

    frozen = gc.get_freeze_count()
    gc.unfreeze()  # a heap frozen before (some interpreters start with one) is left alone, uncollected
    try:
        assert capture() == (0, True)
        monkeypatch.delattr(CpuBackend, "collects_before_capture")  # a backend that does not say: collected in full
        assert capture() == (1, True)
    finally:
        if frozen:
            gc.freeze()
