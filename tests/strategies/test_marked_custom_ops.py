"""A torch custom op marked as an eager break: one annotation for breakable, piecewise (Inductor pieces or not),
full over Inductor pieces and a plain torch.compile, the op declaring the cache it writes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins

from tests.conftest import device_of

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

D, SLOTS, MAX_TOKENS = 8, 32, 16
SCRATCH = SLOTS - 1  # where padded rows write


@torch.library.custom_op("cgregistry_test::cached_attention", mutates_args=("cache",))
def _cached_attention(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Write this step's rows at ``slots``, then attend over the first ``lens[r]`` slots (host lengths from the
    batch's payload; all of them outside a registry)."""
    cache.index_copy_(0, slots, q)
    batch = cg.current_batch()
    lens = batch.payload if batch is not None and isinstance(batch.payload, list) else [SLOTS] * q.shape[0]
    out = torch.zeros_like(q)
    for r in range(min(len(lens), q.shape[0])):
        scores = (cache[: lens[r]] @ q[r]).softmax(0)
        out[r] = scores @ cache[: lens[r]]
    return out


@_cached_attention.register_fake
def _(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


cached_attention = cg.eager_break(_cached_attention)


class CacheModel(nn.Module):
    """Two layers, each writing its own cache through the marked op between two projections."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.register_buffer("caches", torch.zeros(2, SLOTS, D))
        self.to(device)

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        h = self.proj[0](x)
        for layer in range(2):
            h = self.proj[layer + 1](cached_attention(h, self.caches[layer], slots)).tanh()
        return h


def _registry(backend: str, model: CacheModel, compiled: object = None) -> cg.GraphRegistry:
    step = compiled if compiled is not None else model
    return cg.GraphRegistry(
        lambda batch, x, slots: step(x, slots),
        {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32), "slots": cg.StaticInput((MAX_TOKENS,), torch.long, fill=SCRATCH)},
        backend=backend, plugins=make_plugins(),
    )


@pytest.mark.parametrize("strategy", ["breakable", "piecewise"])
def test_a_marked_custom_op_breaks_and_reads_the_live_lengths(backend: str, strategy: str) -> None:
    device = device_of(backend)
    model, reference = CacheModel(device), CacheModel(device)
    late = _Late()
    reg = _registry(backend, model, late if strategy == "piecewise" else None)
    late.fn = reg.compile(model)  # the marked op splits by default
    with torch.inference_mode():
        reg.capture([(B(n, n, uniform=False), strategy) for n in (16, 8, 4)], context=[1] * 16)
    assert {e.breaks for e in reg.entries()} == {2}
    reference.caches.copy_(model.caches)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for reqs in (3, 8, 13):
            lens = torch.randint(1, SCRATCH + 1, (reqs,), generator=g).tolist()  # never the scratch slot
            x, slots = torch.randn(reqs, D, generator=g).to(device), torch.randperm(SCRATCH, generator=g)[:reqs].to(device)
            got = reg.run(B(reqs, reqs, uniform=False), x=x, slots=slots, context=lens)
            with cg.eager_batch(B(reqs, reqs, uniform=False), lens):
                want = reference(x, slots)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            # Padded rows write the scratch slot (the fill), which no request reads.
            torch.testing.assert_close(model.caches[:, :SCRATCH], reference.caches[:, :SCRATCH], rtol=1e-5, atol=1e-6)


class _Late:
    """A step's compiled model, set once the registry that compiles it exists."""

    fn: object = None

    def __call__(self, *args: object) -> object:
        return self.fn(*args)  # type: ignore[operator]


@pytest.mark.slow  # an Inductor compile on the CPU: about 15 s on two cores
def test_a_plain_torch_compile_takes_the_marked_op_and_its_declared_write() -> None:
    """No registry: torch.compile (Inductor) of a model calling the marked op compiles it as the op it is, and the
    cache is written as eager writes it (the op's schema declares the write, so nothing is dropped)."""
    torch._dynamo.reset()
    model, reference = CacheModel(torch.device("cpu")), CacheModel(torch.device("cpu"))
    compiled = torch.compile(model, fullgraph=True)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for tokens in (4, 6):
            x, slots = torch.randn(tokens, D, generator=g), torch.randperm(SLOTS, generator=g)[:tokens]
            torch.testing.assert_close(compiled(x, slots), reference(x, slots), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(model.caches, reference.caches, rtol=1e-5, atol=1e-6)
    assert model.caches.count_nonzero() > 0


def test_full_and_piecewise_keys_over_inductor_pieces_write_the_cache_through_the_op() -> None:
    """Inductor compiles the pieces around the op once; full keys run them with the op inline, piecewise keys with
    the op between them; the cache gets exactly the rows the op was given (run as a registry's warm-up does: the cpu
    emulator cannot record Inductor's kernels)."""
    from cgregistry.contracts import runtime
    from cgregistry.strategies.full import FullStrategy
    from cgregistry.strategies.piecewise import PiecewiseStrategy

    model, reference = CacheModel(torch.device("cpu")), CacheModel(torch.device("cpu"))
    compiled = cg.compile_piecewise(model, inductor=True)
    g = torch.Generator().manual_seed(3)
    written: set[int] = set()
    for key, strategy in ((B.decode(8), PiecewiseStrategy()), (B.decode(8), FullStrategy()), (B.decode(3), FullStrategy()),
                          (B.decode(5), PiecewiseStrategy())):
        x, slots = torch.randn(key.num_tokens, D, generator=g), torch.randperm(SLOTS, generator=g)[: key.num_tokens]
        written |= set(slots.tolist())
        tokens = (runtime.batch.set(runtime.BreakContext(key, key)), runtime.axis_rows.set(frozenset({key.num_tokens})),
                  runtime.capture_strategy.set(strategy))
        try:
            with torch.inference_mode():
                got = compiled(x, slots)
                want = reference(x, slots)
        finally:
            for var, token in zip((runtime.capture_strategy, runtime.axis_rows, runtime.batch), reversed(tokens)):
                var.reset(token)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{key} {strategy.name}")
        torch.testing.assert_close(model.caches, reference.caches, rtol=1e-5, atol=1e-6, msg=f"{key} {strategy.name}")
        assert set(model.caches.abs().sum((0, 2)).nonzero().flatten().tolist()) == written
    report = compiled.compiler.traces[0]
    assert report.splits == ["cgregistry_test::cached_attention"] * 2
    assert len(compiled.compiler.traces) == 1


@torch.library.custom_op("cgregistry_test::doubled_in_place", mutates_args=("x",))
def _doubled_in_place(x: torch.Tensor) -> None:
    x.mul_(2)


@_doubled_in_place.register_fake
def _(x: torch.Tensor) -> None:
    return None


class _Collective(nn.Module):
    """A step whose in-place op stands for a collective: its capture stub runs instead of it while capturing."""

    def __init__(self, op: object) -> None:
        super().__init__()
        self.op = op
        self.w = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w(x)
        self.op(h)
        return h + 1


@pytest.mark.parametrize("strategy", ["breakable", "piecewise"])
def test_a_marked_custom_ops_capture_stub_runs_while_capturing_and_the_op_at_replay(strategy: str) -> None:
    calls = {"stub": 0}

    def stub(x: torch.Tensor) -> None:
        calls["stub"] += 1

    op = cg.eager_break(_doubled_in_place, capture_stub=stub, name="all_reduce_stand_in")
    model = _Collective(op).eval()
    late = _Late()
    reg = cg.GraphRegistry(lambda batch, x: late(x) if strategy == "piecewise" else model(x),
                           {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu", plugins=make_plugins())
    late.fn = reg.compile(model)
    with torch.inference_mode():
        reg.capture([(B(8), strategy)])
    [entry] = reg.entries()
    assert calls["stub"] == 1 and entry.breaks == 1, calls
    x = torch.randn(5, D)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(5), x=x), (model.w(x) * 2) + 1)
    if strategy == "piecewise":
        assert late.fn.compiler.traces[0].splits == ["all_reduce_stand_in"]


@pytest.mark.parametrize("value", ["cgregistry_test::doubled_in_place", 3])
def test_eager_break_of_something_not_callable_is_refused_naming_it(value: object) -> None:
    with pytest.raises(TypeError, match=f"eager_break marks a function or a torch custom op, got {value!r}"):
        cg.eager_break(value)  # type: ignore[call-overload]
