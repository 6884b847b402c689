"""Pending keys as the registry keeps them: each listed in exactly one place (pending capture, lazy, live, failed),
released or captured again as asked, warmed up again when capture() recorded another context meanwhile, refits queued
among them surviving clear(), and nothing of theirs keeping a dropped registry or its engine alive."""

from __future__ import annotations

import gc
import warnings
import weakref

import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from tests.background.test_background import Engine, batch_inputs, make


def test_a_lazy_key_made_pending_is_listed_once_and_released_once() -> None:
    reg = make(Engine())
    key = (B.decode(8), "full")
    reg.capture([key], lazy=True)
    assert reg.pending() == [key] and reg.capturing() == []
    reg.capture([key], background=True)
    assert reg.pending() == [] and reg.capturing() == [key], "pending capture now, no longer lazy"
    assert reg.release(B.decode(8)) == 1
    assert reg.pending() == [] and reg.capturing() == [] and len(reg) == 0


def test_a_released_warmed_up_key_asked_for_again_is_captured() -> None:
    engine = Engine()
    reg = make(engine, capture_budget=1e-9)
    key = (B.decode(8), "full")
    reg.capture([key], background=True)
    batch, inputs = batch_inputs(5, 0)
    reg.run(batch, **inputs)  # its warm-up
    reg.release(B.decode(8))
    assert reg.capturing() == []
    reg.capture([key], background=True)  # the engine wants it after all
    assert reg.capturing() == [key]
    assert reg.wait_captured() and len(reg) == 1 and reg.match(batch) is not None


def test_capturing_never_lists_a_key_already_live() -> None:
    reg = make(Engine())
    reg.capture([(B.decode(8), "full")])
    reg.capture([(B.decode(8), "full"), (B.decode(4), "full")], background=True)
    assert reg.capturing() == [(B.decode(4), "full")]


def test_a_key_warmed_up_before_capture_records_another_context_is_warmed_up_again_under_the_new_one() -> None:
    """A pending key's warm-up ran under one capture context; capture(context=...) then recorded another: its
    recording is not made under the old one, it is warmed up again (``stats().stale_captures``) and recorded under the
    new payload."""
    seen: list[object] = []
    engine = Engine()
    step = engine.step

    def noting(batch: B, **inputs: torch.Tensor) -> torch.Tensor:
        if cg.current_batch().key is not None:
            seen.append((cg.current_batch().key.num_tokens, cg.current_batch().payload))
        return step(batch, **inputs)

    engine.step = noting  # type: ignore[method-assign]
    reg = make(engine, capture_budget=1e-9)
    old, new = object(), object()
    reg.capture([(B.decode(8), "full")], background=True, context=old)
    batch, inputs = batch_inputs(5, 0)
    reg.run(batch, **inputs)  # 8's warm-up under the old payload
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading the payload while recording: FrozenReadWarning, on purpose here
        reg.capture([(B.decode(4), "full")], background=True, context=new)
        assert reg.wait_captured()
    assert reg.stats().stale_captures == 1 and len(reg) == 2
    assert seen[0] == (8, old) and all(payload is new for _, payload in seen[1:]), seen


def test_clear_with_a_refit_pending_does_not_stop_adaptation_for_good() -> None:
    """clear() drops a refit queued among the pending keys, and adaptation refits again afterwards."""
    settings = dict(max_num_seqs=64, max_num_tokens=64, mode="full", max_capture_size=64)
    adapt = cg.Adaptation(max_graphs=4, settings=settings, every_steps=10, min_steps=10, decay=1.0, min_gain=0.0)
    reg = make(Engine(), adapt=adapt, capture_budget=0)  # nothing while serving: the refit stays queued
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(10):
            batch, inputs = batch_inputs(3, i)
            reg.run(batch, **inputs)
        assert reg.capture_pending(0) is False, "a refit is queued"
        reg.clear()  # the engine starts over (a new model version, say)
        reg.capture_budget = None
        for i in range(200):
            batch, inputs = batch_inputs(3, i)
            reg.run(batch, **inputs)
    assert reg.wait_captured()
    assert reg.stats().plan_changes >= 1 and len(reg) > 0, "adaptation never refits again after clear()"


def test_a_registry_the_engine_drops_with_keys_pending_is_collected_and_with_it_its_engine() -> None:
    """An engine that holds its registry and hands it its own bound method as the step (a cycle: engine, registry,
    step, engine) is collected once dropped, keys pending or not: nothing the registry leaves behind holds either."""

    class Server:
        def __init__(self) -> None:
            self.reg = cg.GraphRegistry(self.step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")

        def step(self, batch: B, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    for captured in (True, False):
        server = Server()
        server.reg.capture([(B(8), "full"), (B(4), "full")], background=True)
        if captured:
            assert server.reg.wait_captured() and len(server.reg) == 2
        refs = weakref.ref(server), weakref.ref(server.reg)
        del server
        gc.collect()
        assert [ref() is None for ref in refs] == [True, True], f"captured={captured}: the engine outlived its last reference"
