"""The breakable strategy: eager breaks between graph segments, on the cpu emulator and (marked) on CUDA."""

from __future__ import annotations

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.strategies.breakable import BreakableStrategy
from cgregistry.testing import make_plugins

from tests.conftest import device_of

D, CTX, MAX_TOKENS = 8, 12, 16


class HostLengthAttention:
    """A model whose attention is an eager break reading host-side lengths: impossible in one full graph.

    Each decode token attends to the first L cached positions of its request, with L a Python int
    from the engine's payload (``run(..., context={"lens": [...]})``).
    """

    def __init__(self, device: torch.device, returning: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.w_in = torch.randn(D, D, generator=g).to(device)
        self.w_out = torch.randn(D, D, generator=g).to(device)
        self.k = torch.randn(MAX_TOKENS, CTX, D, generator=g).to(device)
        self.v = torch.randn(MAX_TOKENS, CTX, D, generator=g).to(device)
        self.out = torch.zeros(MAX_TOKENS, D, device=device)
        self.calls = 0
        self.attention = cg.eager_break(self._returning) if returning else cg.eager_break(self._in_place)

    def _rows(self, q: torch.Tensor) -> list[torch.Tensor]:
        self.calls += 1
        batch = cg.current_batch()
        lens = batch.payload["lens"]
        live = batch.actual.num_reqs or q.shape[0]  # at capture the "actual" batch is the relaxed key
        rows = []
        for r in range(q.shape[0]):
            if r < live:
                L = lens[r]  # host int: a full graph would freeze the first batch's value
                scores = (self.k[r, :L] @ q[r]).softmax(0)
                rows.append(scores @ self.v[r, :L])
            else:
                rows.append(torch.zeros(D, device=q.device))
        return rows

    def _in_place(self, q: torch.Tensor, out: torch.Tensor) -> None:
        out[: q.shape[0]].copy_(torch.stack(self._rows(q)))

    def _returning(self, q: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._rows(q))

    def __call__(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        q = torch.tanh(x @ self.w_in)
        if self.attention.__wrapped__ == self._in_place:
            self.attention(q, self.out)
            a = self.out[: q.shape[0]]
        else:
            a = self.attention(q)
        return (a + q) @ self.w_out


def eager_reference(model: HostLengthAttention, batch: B, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    with cg.eager_batch(batch, {"lens": lens}):
        return model(batch, x)


@pytest.mark.parametrize("returning", [False, True], ids=["in-place", "returning"])
def test_breakable_matches_eager_with_host_side_lengths(backend: str, returning: bool) -> None:
    device = device_of(backend)
    model = HostLengthAttention(device, returning)
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend=backend, plugins=make_plugins())
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=MAX_TOKENS, mode="breakable"), context={"lens": [CTX] * MAX_TOKENS})
    g = torch.Generator().manual_seed(1)
    for reqs in (1, 3, 3, 8, 5):
        batch = B.decode(reqs)
        lens = torch.randint(1, CTX + 1, (reqs,), generator=g).tolist()
        x = torch.randn(reqs, D, generator=g).to(device)
        got = reg.run(batch, x=x, context={"lens": lens})
        torch.testing.assert_close(got, eager_reference(model, batch, x, lens), rtol=1e-4, atol=1e-4)
        assert reg.match(batch).strategy == "breakable" and reg.match(batch).key.num_reqs is None
    info = reg.entries()[0]
    assert (info.segments, info.breaks) == (2, 1)
    assert reg.stats().hits == 5


def test_a_full_graph_freezes_the_host_lengths(backend: str) -> None:
    """The same model as one full graph runs the break inline, at capture: later lengths are ignored."""
    device = device_of(backend)
    model = HostLengthAttention(device, returning=False)
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend=backend, plugins=make_plugins())
    reg.capture([(B.decode(4), "full")], context={"lens": [CTX] * MAX_TOKENS})
    calls = model.calls
    x = torch.randn(4, D, device=device)
    got = reg.run(B.decode(4), x=x, context={"lens": [1, 2, 3, 4]})
    assert model.calls == calls, "inside a full graph the break's Python does not run at replay"
    assert not torch.allclose(got, eager_reference(model, B.decode(4), x, [1, 2, 3, 4]), atol=1e-3)


def test_stub_runs_only_at_capture_and_barrier_before_each_break(backend: str) -> None:
    seen: list[str] = []

    def stub(x: torch.Tensor, out: torch.Tensor) -> None:
        seen.append("stub")
        out.zero_()

    @cg.eager_break(capture_stub=stub, name="collective")
    def collective(x: torch.Tensor, out: torch.Tensor) -> None:
        seen.append("real")
        out.copy_(x * 10)

    held = {}

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        out = held.setdefault("out", torch.zeros(MAX_TOKENS, device=x.device))[: x.shape[0]]
        collective(x + 1, out)
        cg.graph_break()
        return out + 1

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS,), torch.float32)}, backend=backend, plugins=make_plugins())
    with cg.capture_barrier(lambda: seen.append("barrier")):
        reg.capture([(B(8), "breakable")])
    assert seen == ["real", "barrier", "stub", "barrier"], "warm-up runs the real break; capture runs barrier + stub at each split"
    seen.clear()
    x = torch.arange(5.0, device=device_of(backend))
    assert reg.run(B(5, 2), x=x).tolist() == ((x + 1) * 10 + 1).tolist()
    assert seen == ["real"], "replay runs the real function; graph_break has no eager work"
    info = reg.entries()[0]
    assert (info.segments, info.breaks) == (3, 1)


def test_break_returning_another_shape_at_replay_is_named(backend: str) -> None:
    size = {"n": 4}

    @cg.eager_break
    def shaped(x: torch.Tensor) -> torch.Tensor:
        return torch.ones(size["n"], device=x.device)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return x + shaped(x).sum()

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend, plugins=make_plugins())
    reg.capture([(B(8), "breakable")])
    x = torch.zeros(3, device=device_of(backend))
    assert reg.run(B(3, 1), x=x).tolist() == [4.0, 4.0, 4.0]
    size["n"] = 5
    with pytest.warns(RuntimeWarning, match=r"eager break '.*shaped' returned a tensor of shape \(5,\) .*it returned \(4,\) \(torch.float32\) at capture"):
        out = reg.run(B(3, 1), x=x)
    assert out.tolist() == [5.0, 5.0, 5.0], "the failed entry is dropped and the step runs eagerly"
    assert list(reg.failures()) == [(B(8), "breakable")]


def test_break_returning_a_non_tensor_is_a_capture_error(backend: str) -> None:
    @cg.eager_break
    def count(x: torch.Tensor) -> int:
        return 3

    reg = cg.GraphRegistry(lambda b, x: x * count(x), {"x": cg.StaticInput((8,), torch.float32)}, backend=backend, plugins=make_plugins())
    with pytest.raises(cg.CaptureError, match=r"eager break '.*count' result is a int; an eager break returns tensors"):
        reg.capture([(B(8), "breakable")])
    assert len(reg) == 0


@pytest.mark.filterwarnings("ignore:.*with no graph captured or planned:RuntimeWarning")  # on purpose
def test_nested_breakable_capture_is_refused(backend: str) -> None:
    inner = cg.GraphRegistry(lambda b, x: x + 1, {"x": cg.StaticInput((4,), torch.float32)}, backend=backend, plugins=make_plugins())

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        BreakableStrategy().capture(lambda: x * 2, inner.backend, inner.backend.new_pool())
        return x

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend, plugins=make_plugins())
    with pytest.raises(cg.CaptureError, match="nested breakable capture") as info:
        reg.capture([(B(8), "breakable")])
    assert isinstance(info.value.__cause__, cg.errors.BreakError)
    x = torch.ones(2, device=device_of(backend))
    assert reg.run(B(2, 1), x=x).tolist() == [1.0, 1.0], "nothing captured; the step ran eagerly"


def test_marked_function_outside_capture_is_a_plain_call() -> None:
    @cg.eager_break
    def f(a: int) -> int:
        return a + 1

    assert f(1) == 2 and f.__cgregistry_break__.endswith("f")
    cg.graph_break()  # no-op outside a capture
    assert cg.current_batch() is None


def test_full_and_breakable_entries_coexist(backend: str) -> None:
    device = device_of(backend)
    model = HostLengthAttention(device, returning=True)
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend=backend, plugins=make_plugins())
    plan = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=MAX_TOKENS, mode="full_and_breakable")
    reg.capture(plan, context={"lens": [CTX] * MAX_TOKENS})
    assert {e.strategy for e in reg.entries()} == {"full", "breakable"}
    assert reg.match(B.decode(3)).strategy == "full"
    mixed = B(6, 2)
    x = torch.randn(6, D, device=device)
    got = reg.run(mixed, x=x, context={"lens": [5, 7]})
    assert reg.match(mixed).strategy == "breakable"
    torch.testing.assert_close(got, eager_reference(model, mixed, x, [5, 7]), rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_an_unjoined_side_stream_is_a_capture_error_that_says_how_to_join_it() -> None:
    side = torch.cuda.Stream()

    @cg.eager_break
    def brk(x: torch.Tensor) -> None:
        return None

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        side.wait_stream(torch.cuda.current_stream())  # fork
        with torch.cuda.stream(side):
            z = y + 1
        brk(z)  # not joined back first
        return z

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cuda", plugins=make_plugins())
    with pytest.raises(cg.CaptureError) as info:
        reg.capture([(B(8), "breakable")])
    text = str(info.value)
    assert "before eager break" in text and "not joined back" in text and "wait_stream(side)" in text, text
    ok = cg.GraphRegistry(lambda b, x: x + 1, {"x": cg.StaticInput((8,), torch.float32)}, backend="cuda", plugins=make_plugins())
    ok.capture([(B(8), "breakable")])
    assert ok.run(B(3, 1), x=torch.zeros(3, device="cuda")).tolist() == [1.0] * 3


def test_demo_model_with_a_break_per_layer(backend: str) -> None:
    from cgregistry.demo_model import (
        DemoConfig,
        DemoDecoder,
        attention_kernel_into,
        demo_inputs,
        random_batch,
    )

    cfg = DemoConfig(layers=3, hidden=32, heads=2, ffn=48, vocab=64, max_num_seqs=8, max_num_tokens=32, context=8, dtype=torch.float32)
    device = device_of(backend)
    inline = DemoDecoder(cfg, device, seed=3)
    broken = DemoDecoder(cfg, device, seed=3, attention=cg.eager_break(attention_kernel_into))
    reg = cg.GraphRegistry(broken, demo_inputs(cfg), backend=backend, plugins=make_plugins())
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=32, mode="breakable"))
    assert {(e.segments, e.breaks) for e in reg.entries()} == {(cfg.layers + 1, cfg.layers)}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in (B.decode(1), B.decode(5), B(13, 4), B(32, 8)):
            inputs = random_batch(cfg, batch, device, g)
            torch.testing.assert_close(reg.run(batch, **inputs), inline(batch, **inputs), rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:.*do not fit static input:RuntimeWarning")  # on purpose
def test_current_batch_inside_a_break_follows_the_live_batch(backend: str) -> None:
    seen: list[tuple] = []

    @cg.eager_break
    def probe(x: torch.Tensor) -> None:
        b = cg.current_batch()
        seen.append((b.actual, b.key, b.payload))

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        probe(x)
        return x + 1

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend, plugins=make_plugins())
    reg.capture([(B(8), "breakable")], context="at-capture")
    assert seen[-1] == (B(8), B(8), "at-capture")
    dev = device_of(backend)
    reg.run(B(3, 2), x=torch.zeros(3, device=dev))
    reg.run(B(5, 1), x=torch.zeros(5, device=dev), context={"lens": [5]})
    reg.run(B(20, 2), x=torch.zeros(20, device=dev), context="eager")  # a miss: the step runs eagerly
    assert seen[-3:] == [(B(3, 2), B(8), None), (B(5, 1), B(8), {"lens": [5]}), (B(20, 2), None, "eager")]
    assert cg.current_batch() is None
