"""A weight sync while a key is being captured, and the Llama example's memory sizing and trace requests: each
reproduced a defect found in review (threads are joined with timeouts)."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
import time
from collections.abc import Iterator

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins
from tests.example_modules import load_example

WIDTH, ROWS = 16, 32


class HeldModel(torch.nn.Module):
    """A step that is the module itself (so the registry watches its weight); its capture of a key of ``hold_tokens``
    tokens on the capture thread reads the weight, then waits on ``release`` (a capture that is slow, mid-way)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))
        self.hold_tokens: int | None = None
        self.calls = 0
        self.holding = threading.Event()
        self.release = threading.Event()

    def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        w = self.weight  # what this capture's graph reads
        if batch.num_tokens == self.hold_tokens and threading.current_thread().name.startswith("cgregistry-capture"):
            self.calls += 1
            if self.calls == 2:  # the capture itself (call 1 is the warm-up)
                self.holding.set()
                self.release.wait(30)
        return torch.tanh(x @ w)


def held_registry() -> tuple[cg.GraphRegistry, HeldModel]:
    model = HeldModel()
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((ROWS, WIDTH), torch.float32)}, backend="cpu")
    return reg, model


@contextlib.contextmanager
def weight_replaced_mid_capture(key: B) -> Iterator[tuple[cg.GraphRegistry, HeldModel]]:
    """A registry whose capture of ``key`` on the capture thread is held after reading the weight; the weight is replaced
    (a weight sync by assignment) and ``refresh(background=True)`` called; the capture goes on as the block ends."""
    reg, model = held_registry()
    model.hold_tokens = key.num_tokens
    reg.capture([(key, "full")], background=True)
    try:
        assert model.holding.wait(30), "the capture thread reached the key's capture"
        model.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))
        assert (key, "full") in reg.refresh(background=True).recaptured
        yield reg, model
    finally:
        model.release.set()


def test_a_capture_in_flight_during_a_weight_sync_is_never_installed() -> None:
    """A weight replaced while its key is being captured, then ``refresh(background=True)``: the capture in flight read the
    old weight and is never installed; the key is captured again and replays what the step computes with the new one."""
    key = B.decode(8)
    with weight_replaced_mid_capture(key) as (reg, model):
        pass
    assert reg.wait_captured(timeout=30)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    got = reg.run(key, x=x).clone()
    with torch.inference_mode():
        want = model(key, x)
    assert len(reg) == 1 and reg.stats().hits == 1
    torch.testing.assert_close(got, want, msg="the graph replayed the weights from before the update")


def test_the_wait_after_a_weight_sync_waits_for_the_key_captured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait installs the capture that read the old weight, which queues the key again: it returns once that key is
    captured, also when it looks just as the capture thread has taken the key off the queue and not yet marked it in
    flight (held there on purpose)."""
    import cgregistry.capture.background as background

    taken = threading.Event()

    class SlowFreeze(background.FrozenHeap):
        def __enter__(self) -> None:  # the capture thread, between taking a key off the queue and marking it in flight
            taken.set()
            time.sleep(0.3)
            super().__enter__()

    install = background.BackgroundCapture.install

    def install_then_look(self: background.BackgroundCapture) -> None:
        install(self)
        taken.wait(5)  # the wait looks while the capture thread is held after taking the key

    with weight_replaced_mid_capture(B.decode(8)) as (reg, _):
        monkeypatch.setattr(background, "FrozenHeap", SlowFreeze)
        monkeypatch.setattr(background.BackgroundCapture, "install", install_then_look)
    assert reg.wait_captured(timeout=30)
    assert len(reg) == 1 and not reg.capturing(), f"{len(reg)} entries, still capturing {reg.capturing()}"


class Tracked:
    """The ``full`` strategy under another name, whose graphs record the thread they were dropped on."""

    name = "tracked"
    relaxes_num_reqs = False

    def __init__(self) -> None:
        self.dropped_on: list[str] = []
        self.made: list[weakref.ref] = []  # every graph it made
        self.stale: list[weakref.ref] = []  # graphs the test calls stale
        self.stale_alive_at_capture: list[int] = []  # of those, how many were alive as each later capture began

    def capture(self, body, backend, pool):  # type: ignore[no-untyped-def]
        if self.stale:
            self.stale_alive_at_capture.append(sum(ref() is not None for ref in self.stale))
        graph, out = backend.capture(body, pool)
        dropped_on = self.dropped_on

        class Graph:
            memory_bytes = graph.memory_bytes

            def replay(self) -> None:
                graph.replay()

            def __del__(self) -> None:
                dropped_on.append(threading.current_thread().name)

        made = Graph()
        self.made.append(weakref.ref(made))
        return made, out

    @cg.plugin.hookimpl
    def cgregistry_register_strategies(self, register):  # type: ignore[no-untyped-def]
        register(self)


def test_a_background_refresh_drops_the_stale_graphs_on_the_capture_thread_not_the_serving_one() -> None:
    """Dropping a graph frees its driver objects (0.1 s for a 1B model's 62 graphs on an H200, holding the GIL): after
    an assign sync, ``refresh(background=True)`` leaves that to the capture thread, which does it before capturing
    the keys again, and the keys come back serving the new weights."""
    tracked = Tracked()
    model = HeldModel()
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((ROWS, WIDTH), torch.float32)}, backend="cpu",
                           plugins=make_plugins(tracked), preference=("tracked",))
    keys = [B.decode(n) for n in (4, 8, 16)]
    reg.capture([(key, "tracked") for key in keys])
    model.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))  # a weight sync that replaces the tensor
    result = reg.refresh(background=True)
    assert set(result.recaptured) == {(key, "tracked") for key in keys}
    assert reg.wait_captured(timeout=30)
    gc.collect()
    assert tracked.dropped_on[:3] and all(name.startswith("cgregistry-capture-") for name in tracked.dropped_on[:3]), \
        tracked.dropped_on
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = model(B.decode(16), x)
    torch.testing.assert_close(reg.run(B.decode(16), x=x), want)
    assert len(reg) == 3 and reg.stats().hits == 1


def test_a_step_whose_key_is_queued_after_a_background_refresh_does_not_get_it_captured_before_the_drop() -> None:
    """A step whose key is queued moves it to the front of the queue, but not ahead of the stale graphs' drop: no key
    is captured while the graphs it replaces still hold their memory."""
    tracked = Tracked()
    model = HeldModel()
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((ROWS, WIDTH), torch.float32)}, backend="cpu",
                           plugins=make_plugins(tracked), preference=("tracked",))
    reg.capture([(B.decode(n), "tracked") for n in (8, 16)])
    model.hold_tokens = 4
    reg.capture([(B.decode(4), "tracked")], background=True)  # the capture thread busy with it, held
    try:
        assert model.holding.wait(30), "the capture thread reached the key's capture"
        tracked.stale = list(tracked.made)
        model.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))
        reg.refresh(background=True)
        reg.run(B.decode(7), x=torch.randn(7, WIDTH))  # its key (8 tokens) is queued: moved to the front
    finally:
        model.release.set()
    assert reg.wait_captured(timeout=30)
    assert tracked.stale_alive_at_capture and not any(tracked.stale_alive_at_capture), tracked.stale_alive_at_capture
    assert len(reg) == 3 and not reg.capturing()


def _hf():
    pytest.importorskip("transformers")
    return load_example("hf_llama.py")


def test_hf_llama_sizes_the_kv_cache_for_the_capture_that_follows(monkeypatch) -> None:
    """``serve(..., background=True)`` with a memory budget sizes the KV cache with the estimate of a background capture
    (each key's own static inputs, and pool where its strategy does not share one), the capture that follows."""
    hf = _hf()
    shape = hf.EngineShape(max_num_seqs=4, max_num_tokens=16, block_size=4, max_blocks_per_req=4)
    asked: list[bool] = []
    original = cg.GraphRegistry.estimate_memory

    def spy(self, plan, *, background=False, context=None):
        asked.append(background)
        return original(self, plan, background=background, context=context)

    monkeypatch.setattr(cg.GraphRegistry, "estimate_memory", spy)
    result, reg = hf.serve("tiny", "full", device=torch.device("cpu"), shape=shape, requests=2, max_prompt=6, max_new=2,
                           backend="cpu", background=True, graph_and_kv_bytes=2**30, check=False)
    assert reg is not None and reg.wait_captured(timeout=60)
    assert asked == [True], f"estimate_memory called with background={asked} for a background capture"


def test_hf_llama_trace_requests_never_makes_a_request_that_cannot_finish() -> None:
    """Every trace request leaves room in the context for at least one new token, whatever ``max_prompt``."""
    hf = _hf()
    shape = hf.EngineShape(max_num_seqs=4, max_num_tokens=16, block_size=4, max_blocks_per_req=4)
    requests = hf.trace_requests(40, shape, vocab=100, max_prompt=2 * shape.max_context, max_new=4)
    bad = [(len(r.tokens), r.max_new) for r in requests if r.max_new < 1]
    assert not bad, f"(prompt, max_new) of requests that can never finish: {bad[:5]}"
