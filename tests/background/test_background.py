"""Capture while serving: capture(background=True) returns at once, each run() takes pieces of the pending keys
before its step (a warm-up, then a recording), every batch is served and equals eager, engine state is untouched,
failures are kept, and the registry ends as a foreground capture leaves it."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import _disable_current_modes

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins
from tests.conftest import device_of

HIDDEN, MAX_TOKENS, MAX_SEQS, SLOTS = 16, 64, 16, 128
SCRATCH = SLOTS - 1


class Engine:
    """A step that writes a KV cache at its slot mapping (like a real engine); it logs each call by the key it runs
    for (None: an eager step), and can fail the capture of a key of ``fail_tokens`` tokens."""

    def __init__(self, backend: str = "cpu") -> None:
        g = torch.Generator().manual_seed(0)
        self.backend = backend
        self.device = device_of(backend)
        self.weight = torch.randn(HIDDEN, HIDDEN, generator=g).to(self.device)
        self.embed = torch.randn(100, HIDDEN, generator=g).to(self.device)
        self.cache = torch.zeros(SLOTS, HIDDEN, device=self.device)
        self.fail_tokens: int | None = None
        self.calls: list[B | None] = []  # the key each call ran for: a warm-up or a recording; None: eager

    def step(self, batch: B, input_ids: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        key = cg.current_batch().key
        self.calls.append(key)
        if key is not None and batch.num_tokens == self.fail_tokens:
            raise RuntimeError(f"no graph for {batch.num_tokens} tokens")
        h = self.embed[input_ids] @ self.weight
        self.cache.index_copy_(0, slot_mapping, h)
        return torch.tanh(h)


def make(engine: Engine, **kwargs: object) -> cg.GraphRegistry:
    inputs = {
        "input_ids": cg.StaticInput((MAX_TOKENS,), torch.long, fill=0),
        "slot_mapping": cg.StaticInput((MAX_TOKENS,), torch.long, fill=SCRATCH),
    }
    return cg.GraphRegistry(engine.step, inputs, backend=engine.backend, **kwargs)


def batch_inputs(n: int, seed: int, device: torch.device = torch.device("cpu")) -> tuple[B, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(SCRATCH, generator=g)[:n]
    return B.decode(n), {"input_ids": torch.randint(0, 100, (n,), generator=g).to(device), "slot_mapping": slots.to(device)}


def eager(engine: Engine, batch: B, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    h = engine.embed[inputs["input_ids"]] @ engine.weight
    return torch.tanh(h)


PLAN = cg.CapturePlan.build(max_num_seqs=MAX_SEQS, max_num_tokens=MAX_TOKENS, mode="full")


def test_capture_returns_at_once_and_the_steps_that_follow_capture_every_key(backend: str) -> None:
    engine = Engine(backend)
    reg = make(engine, capture_budget=1e-9)  # one piece a step: the order of events is the test's
    assert reg.capture(PLAN, background=True) == []
    assert engine.calls == [] and len(reg) == 0 and len(reg.capturing()) == len(PLAN.entries)
    steps = 0
    while reg.capturing():
        batch, inputs = batch_inputs(1 + steps % MAX_SEQS, steps, engine.device)
        torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
        steps += 1
    assert steps <= 2 * len(PLAN.entries), "each step takes at least one piece: a key takes two"
    assert len(reg) == len(PLAN.entries) and reg.stats().background_captures == len(PLAN.entries)
    assert reg.wait_captured(timeout=0) is True


def test_a_key_is_warmed_up_in_one_step_and_recorded_in_the_next_that_it_then_serves() -> None:
    engine = Engine()
    reg = make(engine, capture_budget=1e-9)
    reg.capture([(B.decode(16), "full"), (B.decode(4), "full"), (B.decode(2), "full")], background=True)
    batch, inputs = batch_inputs(3, 1)
    reg.run(batch, **inputs)  # the next key (16, the largest) serves it: its warm-up, then the step eagerly
    assert engine.calls == [B.decode(16), None] and len(reg) == 0
    engine.calls.clear()
    out = reg.run(batch, **inputs)  # its recording, then the replay
    assert engine.calls == [B.decode(16)] and reg.match(batch).key == B.decode(16) and reg.stats().hits == 1
    torch.testing.assert_close(out, eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
    assert reg.capturing() == [(B.decode(2), "full"), (B.decode(4), "full")]  # then from the smallest up


def test_capture_while_serving_never_writes_a_live_cache_slot(backend: str) -> None:
    engine = Engine(backend)
    reg = make(engine)
    live = torch.arange(0, 40, device=engine.device)  # slots a running request owns
    engine.cache[live] = 7.0
    reg.capture(PLAN, background=True)
    for i in range(30):  # these write their own slots, not the live ones
        batch, inputs = batch_inputs(1 + i % 16, i, engine.device)
        inputs["slot_mapping"] = torch.arange(40, 40 + batch.num_tokens, device=engine.device)
        reg.run(batch, **inputs)
    reg.wait_captured()
    assert torch.equal(engine.cache[live], torch.full((40, HIDDEN), 7.0, device=engine.device)), "capture wrote a live request's slot"


def test_capture_between_steps_runs_the_step_on_fill_values_and_writes_only_the_scratch_slot(backend: str) -> None:
    engine = Engine(backend)
    engine.cache.copy_(torch.arange(SLOTS * HIDDEN, dtype=torch.float32, device=engine.device).view(SLOTS, HIDDEN))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    step = engine.step

    def recording(batch: B, input_ids: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        if backend == "cpu" and cg.current_batch().key is not None:  # the cpu emulator runs every call for real
            with _disable_current_modes():  # copies of their own, not ops of the graph that replays refresh
                seen.append((input_ids.clone(), slot_mapping.clone()))
        return step(batch, input_ids, slot_mapping)

    engine.step = recording  # type: ignore[method-assign]
    reg = make(engine)
    reg.capture(PLAN, background=True)
    before = engine.cache.clone()
    served = torch.arange(SCRATCH - 16, SCRATCH, device=engine.device)
    for i in range(3):
        batch, inputs = batch_inputs(16, i, engine.device)
        inputs["slot_mapping"] = served
        reg.run(batch, **inputs)
    assert reg.wait_captured() and len(reg) == len(PLAN.entries)
    changed = (engine.cache != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [*served.tolist(), SCRATCH], f"capture wrote cache rows {changed}; only the scratch slot may change"
    if backend == "cpu":
        assert len(seen) >= 2 * len(PLAN.entries)  # warm-up and capture of every key
        assert all(bool((ids == 0).all()) and bool((slots == SCRATCH).all()) for ids, slots in seen), "a capture saw non-fill inputs"


def test_an_input_that_aliases_a_static_buffer_is_read_as_it_was_when_run_was_called() -> None:
    """A piece before the step resets the static buffers: an input that is a view of one (an engine writing its batch
    into ``reg.static_inputs`` directly) is served with the values it had when run() was called."""
    engine = Engine()
    reg = make(engine)
    reg.capture(PLAN, background=True)
    for i in range(6):
        batch, inputs = batch_inputs(5, i)
        ids = reg.static_inputs["input_ids"][:5]
        ids.copy_(inputs["input_ids"])
        out = reg.run(batch, input_ids=ids, slot_mapping=inputs["slot_mapping"])
        torch.testing.assert_close(out, eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, MAX_SEQS), min_size=1, max_size=25), seed=st.integers(0, 10_000),
       budget=st.sampled_from([None, 0.0, 1e-9, 1.0]))
def test_serving_while_capturing_always_matches_eager(sizes: list[int], seed: int, budget: float | None) -> None:
    engine = Engine()
    reg = make(engine, capture_budget=budget)
    reg.capture(PLAN, background=True)
    for i, n in enumerate(sizes):
        batch, inputs = batch_inputs(n, seed + i)
        torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
    stats = reg.stats()
    assert stats.hits + stats.misses == len(sizes)
    assert stats.misses == stats.misses_by_reason["capturing"], "every eager batch was waiting for its key"
    if budget == 0.0 or len(sizes) >= 2:  # a key takes two steps (a piece each) at least
        assert (len(reg) == 0) == (budget == 0.0), "a budget of 0 captures nothing while serving, any other something"
    assert reg.wait_captured() and len(reg) == len(PLAN.entries)


def test_a_failed_pending_capture_is_kept_and_the_rest_serve() -> None:
    engine = Engine()
    engine.fail_tokens = 8
    seen: list[tuple[B, object]] = []

    class Observer:
        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            seen.append((key, error))

    reg = make(engine, plugins=make_plugins(Observer()))
    reg.capture(PLAN, background=True)
    with pytest.warns(RuntimeWarning, match=r"pending capturing Batch\(tokens=8.*no graph for 8 tokens"):
        assert reg.wait_captured()
    key8 = next(d for d in PLAN.descriptors() if d.num_tokens == 8)
    assert (key8, "full") in reg.failures() and (key8, "full") not in {(e.key, e.strategy) for e in reg.entries()}
    assert len(reg) == len(PLAN.entries) - 1
    assert [err for key, err in seen if key == key8 and isinstance(err, cg.CaptureError)]
    batch, inputs = batch_inputs(7, 3)
    torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
    assert reg.match(batch).key.num_tokens > 8


@pytest.mark.filterwarnings("ignore:.*with no graph captured or planned:RuntimeWarning")  # on purpose
def test_clear_drops_pending_keys_the_one_warmed_up_included() -> None:
    engine = Engine()
    reg = make(engine, capture_budget=1e-9)
    reg.capture(PLAN, background=True)
    batch, inputs = batch_inputs(3, 0)
    reg.run(batch, **inputs)  # one key warmed up, none recorded
    assert len(reg) == 0 and engine.calls.count(None) == 1 and len(engine.calls) == 2
    assert reg.clear() == len(PLAN.entries)
    assert len(reg) == 0 and reg.capturing() == [] and reg.wait_captured()
    engine.calls.clear()
    reg.run(batch, **inputs)
    assert engine.calls == [None] and reg.stats().misses_by_reason["no_graphs"] == 1


def test_release_of_a_pending_key_takes_it_off_the_queue() -> None:
    engine = Engine()
    reg = make(engine)
    reg.capture(PLAN, background=True)
    victim = PLAN.descriptors()[0]
    assert reg.release(victim) == 1
    assert (victim, "full") not in reg.capturing()
    reg.wait_captured()
    assert len(reg) == len(PLAN.entries) - 1 and victim not in {e.key for e in reg.entries()}


def test_a_foreground_capture_of_a_pending_key_takes_it_off_the_queue() -> None:
    engine = Engine()
    reg = make(engine, capture_budget=1e-9)
    reg.capture([(B.decode(16), "full"), (B.decode(2), "full")], background=True)
    batch, inputs = batch_inputs(2, 0)
    reg.run(batch, **inputs)  # 2 tokens warmed up
    infos = reg.capture([(B.decode(2), "full")])
    assert [i.key for i in infos] == [B.decode(2)] and reg.capturing() == [(B.decode(16), "full")]
    reg.wait_captured()
    assert {e.key for e in reg.entries()} == {B.decode(16), B.decode(2)} and reg.stats().background_captures == 1


def test_lazy_and_background_cannot_be_combined_and_bad_plans_are_refused_before_queueing() -> None:
    reg = make(Engine())
    with pytest.raises(ValueError, match="lazy=True, background=True"):
        reg.capture(PLAN, lazy=True, background=True)
    with pytest.raises(ValueError, match="needs 65 tokens"):
        reg.capture([(B.decode(65), "full")], background=True)
    assert reg.capturing() == [] and len(reg) == 0


def test_run_from_a_hook_during_a_piece_is_refused_and_reported() -> None:
    engine = Engine()
    holder: list[cg.GraphRegistry] = []

    class Reentrant:
        @cg.plugin.hookimpl
        def cgregistry_capture_started(self, registry, key, strategy):  # noqa: ANN001
            batch, inputs = batch_inputs(1, 0)
            holder[0].run(batch, **inputs)

    reg = make(engine, plugins=make_plugins(Reentrant()))
    holder.append(reg)
    reg.capture([(B.decode(4), "full")], background=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            batch, inputs = batch_inputs(2, i)
            torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
    # hooks are contained: the observer's error is reported, the capture itself goes on
    assert any("from inside a run() of the same registry" in str(w.message) for w in caught)
    assert len(reg) == 1


def test_snapshot_lists_pending_keys() -> None:
    reg = make(Engine())
    reg.capture(PLAN, background=True)
    snap = cg.load_snapshot(reg.snapshot())
    assert sorted(k.num_tokens for k, _ in snap.capturing) == sorted(d.num_tokens for d in PLAN.descriptors())
    reg.wait_captured()
    assert cg.load_snapshot(reg.snapshot()).capturing == ()
    assert cg.load_snapshot(reg.snapshot()).stats.background_captures == len(PLAN.entries)


def test_the_explanation_of_a_batch_names_the_pending_key_that_will_serve_it() -> None:
    reg = make(Engine(), capture_budget=0)
    reg.capture(PLAN, background=True)
    batch, inputs = batch_inputs(3, 0)
    reg.run(batch, **inputs)
    assert reg.stats().misses_by_reason["capturing"] == 1
    assert reg.match(batch) is None
    explanation = reg.explain(batch)
    assert explanation.match is None and explanation.capturing is not None
    waits = explanation.capturing
    assert (waits.key, waits.strategy) == (B(4, 4), "full") and tuple(waits.padding) == (1, 1, 0)  # the smallest that covers
    text = str(explanation)
    assert "no covering key" not in text
    assert f"runs eagerly until a key pending capture is captured: {B(4, 4)} [full] will serve it" in text
    assert "miss reason 'capturing'" in text
    # every key pending capture is in the table, marked as pending, none chosen
    listed = {(c.key, c.strategy) for c in explanation.candidates}
    assert listed == set(reg.capturing()) and all(c.capturing and not c.chosen for c in explanation.candidates)
    reasons = {c.key: c.reason for c in explanation.candidates}
    assert reasons[B(4, 4)].startswith("pending capture between steps: serves it once captured")
    assert reasons[B(2, 2)] == "pending capture between steps; too few tokens: 2 < 3"
    data = explanation.to_dict()
    assert data["capturing"]["key"]["num_tokens"] == 4 and all(c["capturing"] for c in data["candidates"])
    assert cg.load_snapshot(reg.snapshot()).explain(batch).to_dict() == data  # offline, from the snapshot's pending keys
    reg.wait_captured()
    explanation = reg.explain(batch)  # captured now: matched, nothing pending
    assert explanation.match.key == B(4, 4) and explanation.capturing is None
    assert not any(c.capturing for c in explanation.candidates)


# --------------------------------------------------------------------------- adaptation


def trace_steps(max_seqs: int, max_tokens: int, n: int, start: int = 0) -> list[B]:
    from cgregistry.plan.workload import SchedulerConfig, read_trace, schedule

    sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens)
    return list(schedule(read_trace(), sched, max_steps=start + n))[start:]


def test_adaptation_refits_to_the_traffic_between_steps_and_reports_each_change() -> None:
    from cgregistry.plan.adapt import Adaptation
    from cgregistry.plan.fit import evaluate

    engine = Engine()
    changes: list[object] = []

    class Watcher:
        @cg.plugin.hookimpl
        def cgregistry_plan_changed(self, registry, change):  # noqa: ANN001
            changes.append(change)

    settings = dict(max_num_seqs=MAX_SEQS, max_num_tokens=MAX_TOKENS, mode="full", max_capture_size=MAX_TOKENS)
    budget = 6
    adapt = Adaptation(max_graphs=budget, settings=settings, every_steps=100, min_steps=100, decay=1.0, min_gain=0.0)
    reg = make(engine, adapt=adapt, plugins=make_plugins(Watcher()))
    start = cg.CapturePlan.build(**settings, capture_sizes=[MAX_TOKENS])  # one graph: everything pads to 64
    reg.capture(start)
    steps = trace_steps(MAX_SEQS, MAX_TOKENS, 400)
    for batch in steps:  # back to back: the refits and their keys are pieces taken before the steps
        n = batch.num_tokens
        inputs = {"input_ids": torch.randint(0, 100, (n,)), "slot_mapping": torch.randint(0, SCRATCH, (n,))}
        torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
    assert reg.wait_captured()
    assert changes and reg.stats().plan_changes == len(changes) == len(reg.plan_changes)
    assert len(reg) <= budget
    offline = cg.CapturePlan.fit(steps, budget, **settings)
    adapted = evaluate(cg.CapturePlan.of((e.key, e.strategy) for e in reg.entries()), steps)
    fitted = evaluate(offline, steps)
    assert adapted.padded_tokens <= 1.5 * fitted.padded_tokens, (adapted, fitted)
    snap = cg.load_snapshot(reg.snapshot())
    assert snap.stats.plan_changes == len(changes) and len(snap.plan_changes) == len(changes)
