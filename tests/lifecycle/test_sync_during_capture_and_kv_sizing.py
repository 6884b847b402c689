"""A weight sync while a key is pending capture, and the Llama example's memory sizing and trace requests."""

from __future__ import annotations

import weakref

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins
from tests.example_modules import load_example

WIDTH, ROWS = 16, 32


class Model(torch.nn.Module):
    """A step that is the module itself (so the registry watches its weight)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))

    def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


def test_a_key_warmed_up_before_a_weight_sync_is_recorded_with_the_new_weight() -> None:
    """A weight replaced between a pending key's warm-up and its recording, then ``refresh(background=True)``: the key
    is captured again under the new weight and replays what the step computes with it."""
    model = Model()
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((ROWS, WIDTH), torch.float32)}, backend="cpu", capture_budget=1e-9)
    key = B.decode(8)
    reg.capture([(key, "full")], background=True)
    reg.run(B.decode(5), x=torch.randn(5, WIDTH))  # the key's warm-up
    assert len(reg) == 0 and reg.capturing() == [(key, "full")]
    model.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))
    assert (key, "full") in reg.refresh(background=True).recaptured
    assert reg.wait_captured()
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    got = reg.run(key, x=x).clone()
    with torch.inference_mode():
        want = model(key, x)
    assert len(reg) == 1 and reg.stats().hits == 1
    torch.testing.assert_close(got, want, msg="the graph replayed the weights from before the update")


class Tracked:
    """The ``full`` strategy under another name, which counts, as each capture begins, how many of the graphs the test
    calls stale are still alive."""

    name = "tracked"
    relaxes_num_reqs = False

    def __init__(self) -> None:
        self.made: list[weakref.ref] = []  # every graph it made
        self.stale: list[weakref.ref] = []  # graphs the test calls stale
        self.stale_alive_at_capture: list[int] = []  # of those, how many were alive as each later capture began

    def capture(self, body, backend, pool):  # type: ignore[no-untyped-def]
        if self.stale:
            self.stale_alive_at_capture.append(sum(ref() is not None for ref in self.stale))
        graph, out = backend.capture(body, pool)

        class Graph:
            memory_bytes = graph.memory_bytes

            def replay(self) -> None:
                graph.replay()

        made = Graph()
        self.made.append(weakref.ref(made))
        return made, out

    @cg.plugin.hookimpl
    def cgregistry_register_strategies(self, register):  # type: ignore[no-untyped-def]
        register(self)


def test_a_refresh_drops_the_stale_graphs_before_any_key_is_captured_again() -> None:
    """After an assign sync, no key is captured while a graph it replaces still holds its memory, also when a step
    moves its own key to the front of the pending captures; every key comes back serving the new weights."""
    tracked = Tracked()
    model = Model()
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((ROWS, WIDTH), torch.float32)}, backend="cpu",
                           plugins=make_plugins(tracked), preference=("tracked",))
    keys = [B.decode(n) for n in (4, 8, 16)]
    reg.capture([(key, "tracked") for key in keys])
    tracked.stale = list(tracked.made)
    model.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))  # a weight sync that replaces the tensor
    result = reg.refresh(background=True)
    assert set(result.recaptured) == {(key, "tracked") for key in keys}
    reg.run(B.decode(7), x=torch.randn(7, WIDTH))  # its key (8 tokens) goes first
    assert reg.wait_captured()
    assert tracked.stale_alive_at_capture == [0, 0, 0], tracked.stale_alive_at_capture
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = model(B.decode(16), x)
    torch.testing.assert_close(reg.run(B.decode(16), x=x), want)
    assert len(reg) == 3 and reg.stats().hits == 1


def _hf():
    pytest.importorskip("transformers")
    return load_example("hf_llama.py")


def test_hf_llama_sizes_the_kv_cache_for_the_capture_that_follows(monkeypatch) -> None:
    """``serve(..., background=True)`` with a memory budget sizes the KV cache with the estimate of the plan it then
    captures between steps (the same pool and inputs as a capture before serving)."""
    hf = _hf()
    shape = hf.EngineShape(max_num_seqs=4, max_num_tokens=16, block_size=4, max_blocks_per_req=4)
    asked: list[int] = []
    original = cg.GraphRegistry.estimate_memory

    def spy(self, plan, *, context=None, sample=False):
        asked.append(len(list(plan)))
        return original(self, plan, context=context, sample=sample)

    monkeypatch.setattr(cg.GraphRegistry, "estimate_memory", spy)
    result, reg = hf.serve("tiny", "full", device=torch.device("cpu"), shape=shape, requests=2, max_prompt=6, max_new=2,
                           backend="cpu", background=True, graph_and_kv_bytes=2**30, check=False)
    assert reg is not None and reg.wait_captured()
    assert len(asked) == 1 and asked[0] == len(reg), f"estimate_memory asked for {asked}, {len(reg)} keys captured"


def test_hf_llama_trace_requests_never_makes_a_request_that_cannot_finish() -> None:
    """Every trace request leaves room in the context for at least one new token, whatever ``max_prompt``."""
    hf = _hf()
    shape = hf.EngineShape(max_num_seqs=4, max_num_tokens=16, block_size=4, max_blocks_per_req=4)
    requests = hf.trace_requests(40, shape, vocab=100, max_prompt=2 * shape.max_context, max_new=4)
    bad = [(len(r.tokens), r.max_new) for r in requests if r.max_new < 1]
    assert not bad, f"(prompt, max_new) of requests that can never finish: {bad[:5]}"
