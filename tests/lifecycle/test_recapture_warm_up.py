"""By default every capture warms up, so state the step makes lazily on a first run is made again after the engine
freed it.  With ``warm_up_again=False`` a key captured again (after a weight update, a wake) on a thread that has
warmed up before skips its warm-up: the step runs once per such key instead of twice, and still equals eager under
the new weights.  A capture that
fails without its warm-up (lazy state the step cannot make while recorded) is warmed up and captured again; keys
whose capture runs compiled code, the memory estimate, and every key after ``clear()`` always warm up."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import pytest
import torch
from torch import nn

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.backends.cpu import CpuBackend
from cgregistry.contracts.runtime import RecordingBatch
from cgregistry.testing import make_plugins

WIDTH, MAX_TOKENS = 8, 32
SIZES = (8, 16, 32)
PLAN = [(B.decode(n), "full") for n in SIZES]


class CountingModel(nn.Module):
    """Counts its runs per token count; ``lazy``: state made on a thread's first run of a size, which cannot be made
    while the step is recorded (as a cuBLAS handle cannot be created inside a CUDA capture)."""

    def __init__(self, lazy: bool = False, delay_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.runs: Counter[int] = Counter()
        self.lazy = lazy
        self.delay_s = delay_s
        self.made = threading.local()

    def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        self.runs[n] += 1
        time.sleep(self.delay_s)
        if self.lazy:
            made = self.made.__dict__.setdefault("sizes", set())
            if n not in made:
                if isinstance(cg.current_batch(), RecordingBatch):
                    raise RuntimeError(f"lazy state for {n} rows made while recorded")
                made.add(n)
        return self.second(torch.tanh(self.first(x)))


class Measured(CpuBackend):
    """The cpu emulator with a device whose memory reads as unused: memory estimates capture on it."""

    name = "cpu-measured"

    def device_memory(self) -> tuple[int, int]:
        return 0, 0

    @cg.plugin.hookimpl
    def cgregistry_register_backends(self, register):  # type: ignore[no-untyped-def]
        register(self)


def registry(model: nn.Module, measured: bool = False, warm_up_again: bool = False) -> cg.GraphRegistry:
    return cg.GraphRegistry(model, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)},
                            backend="cpu-measured" if measured else "cpu", plugins=make_plugins(Measured()),
                            warm_up_again=warm_up_again)


def new_weights(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model.load_state_dict({k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}, assign=True)


def each_size_equals_eager(reg: cg.GraphRegistry, model: nn.Module) -> None:
    hits = reg.stats().hits
    for n in SIZES:
        x = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            want = model(B.decode(n), x)
        torch.testing.assert_close(reg.run(B.decode(n), x=x), want, rtol=1e-5, atol=1e-5)
    assert reg.stats().hits == hits + len(SIZES)


def test_a_key_captured_again_after_an_assign_runs_the_step_once_and_equals_eager() -> None:
    model = CountingModel()
    reg = registry(model)
    reg.capture(PLAN)
    assert model.runs == {n: 2 for n in SIZES}, "a first capture warms up, then records"
    new_weights(model, 1)
    model.runs.clear()
    assert len(reg.refresh().recaptured) == len(PLAN)
    assert model.runs == {n: 1 for n in SIZES}, "captured again on the thread that warmed them up: recorded only"
    assert all(e.phases.warmup == 0 for e in reg.entries())
    each_size_equals_eager(reg, model)


def test_keys_captured_again_between_steps_are_recorded_only_and_equal_eager() -> None:
    model = CountingModel()
    reg = registry(model)
    reg.capture(PLAN)
    for seed in (1, 2):
        new_weights(model, seed)
        model.runs.clear()
        reg.refresh(background=True)
        assert reg.wait_captured() and len(reg) == len(PLAN)
        assert model.runs == {n: 1 for n in SIZES}, "the owner thread warmed them up before: recorded only"
        each_size_equals_eager(reg, model)


class LazyCache(nn.Module):
    """A step that makes its cache on its first run (as a lazily initialised KV cache is), writes this step's values
    at their slots and reads every live slot."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(1, 1)
        self.cache: torch.Tensor | None = None

    def forward(self, batch: B, slots: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.zeros(9)
        self.cache.index_put_((slots,), k)
        return self.proj(k.unsqueeze(-1)).squeeze(-1) * 0 + self.cache[:8].sum()


def test_by_default_every_capture_warms_up_so_a_cache_freed_while_asleep_is_made_again_eagerly() -> None:
    engine = LazyCache()
    reg = cg.GraphRegistry(engine, {"slots": cg.StaticInput((4,), torch.long, fill=8),
                                    "k": cg.StaticInput((4,), torch.float32)}, backend="cpu")
    reg.capture([(B.decode(n), "full") for n in (1, 2, 4)])

    def serve() -> list[list[float]]:
        with torch.inference_mode():  # made under capture's inference mode
            engine.cache.zero_()  # type: ignore[union-attr]
        steps = (([0], [1.0]), ([1, 2], [2.0, 3.0]), ([3, 4, 5], [4.0, 5.0, 6.0]))
        return [reg.run(B.decode(len(s)), slots=torch.tensor(s), k=torch.tensor(k)).tolist() for s, k in steps]

    assert serve() == [[1.0], [6.0, 6.0], [21.0, 21.0, 21.0]]
    reg.sleep()
    engine.cache = None  # freed while asleep: the next first run makes it
    reg.wake(background=False)
    assert serve() == [[1.0], [6.0, 6.0], [21.0, 21.0, 21.0]], "no graph made the cache: it is the engine's"


def test_warm_up_again_is_a_flag() -> None:
    with pytest.raises(TypeError, match=r"warm_up_again=\.\.\.\) takes a bool, got 0"):
        cg.GraphRegistry(CountingModel(), {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend="cpu",
                         warm_up_again=0)  # type: ignore[arg-type]


def test_a_capture_that_fails_without_its_warm_up_is_warmed_up_and_captured_again(caplog) -> None:  # noqa: ANN001
    model = CountingModel(lazy=True, delay_s=0.02)
    reg = registry(model)
    reg.capture(PLAN)
    new_weights(model, 3)
    model.made = threading.local()  # the engine freed the state its first runs made (a sleep, say)
    model.runs.clear()
    with caplog.at_level(logging.INFO, logger="cgregistry"):
        reg.refresh(background=True)
        assert reg.wait_captured()
    assert len(reg) == len(PLAN) and reg.failures() == {}
    retried = [r.getMessage() for r in caplog.records if "without a warm-up failed" in r.getMessage()]
    assert len(retried) == 3 and all("made while recorded" in m for m in retried), retried
    assert model.runs == {n: 3 for n in SIZES}, "each failed once, then warmed up and was recorded"
    assert all(e.capture_seconds >= 3 * 0.02 and e.phases.record >= 0.02 for e in reg.entries()), \
        "the failed recording counts in the key's capture seconds"
    each_size_equals_eager(reg, model)
    model.runs.clear()
    reg.refresh(background=True)  # nothing moved: nothing captured
    assert reg.wait_captured() and sum(model.runs.values()) == 0


def test_the_memory_estimate_and_every_key_after_clear_warm_up() -> None:
    model = CountingModel()
    reg = registry(model, measured=True)
    reg.estimate_memory(PLAN)
    reg.capture(PLAN)
    assert model.runs == {n: 4 for n in SIZES}, "the estimate priced each capture with its warm-up: the capture has one"
    reg.clear()
    reg.capture(PLAN)
    reg.release(B.decode(8))
    model.runs.clear()
    reg.estimate_memory(PLAN)
    assert model.runs == {8: 2}, "an estimate measures what a first capture takes, its warm-up included"
    reg.capture(PLAN)
    assert model.runs == {8: 3}, "a released key captured again skips its warm-up"
    reg.clear()
    model.runs.clear()
    reg.capture(PLAN)
    assert model.runs == {n: 2 for n in SIZES}, "after clear() every key warms up again"


@cg.eager_break
def _doubled(h: torch.Tensor) -> torch.Tensor:
    _doubled.calls += 1  # type: ignore[attr-defined]
    return h * 2


_doubled.calls = 0  # type: ignore[attr-defined]


def test_keys_whose_capture_runs_compiled_code_always_warm_up() -> None:
    """A guard that fails after a weight update compiles again: that must happen in a warm-up, not while recorded."""
    lin = nn.Linear(WIDTH, WIDTH)
    reg = cg.GraphRegistry(lambda batch, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)},
                           backend="cpu", warm_up_again=False)
    compiled = reg.compile(lambda x: lin(_doubled(lin(x))))
    reg.capture([(B(16), "piecewise"), (B(8), "piecewise")])  # the second size compiles nothing: one dynamic trace
    assert compiled.compiler.traces and len(compiled.compiler.traces) == 1
    new_weights(lin, 4)
    _doubled.calls = 0
    assert len(reg.refresh().recaptured) == 2
    assert _doubled.calls == 4, "each split ran in a warm-up and again while the pieces were recorded"
    for n in (16, 8):
        x = torch.randn(n, WIDTH)
        with torch.inference_mode():
            torch.testing.assert_close(reg.run(B(n), x=x), lin(lin(x) * 2), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("background", [False, True])
def test_cuda_keys_captured_again_after_each_assign_skip_their_warm_up_and_equal_eager(background: bool) -> None:
    """On CUDA every key captured again on the owner thread, at once or between steps, is recorded only (the thread's
    cuBLAS state was made by the first capture); every key comes back and computes with the new weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda().half()
    reg = cg.GraphRegistry(lambda batch, x: model(x), {"x": cg.StaticInput((64, 256), torch.float16)}, backend="cuda",
                           warm_up_again=False)
    sizes = (1, 8, 24, 64)
    reg.capture([(B.decode(n), "full") for n in sizes])
    for seed in (1, 2):
        torch.manual_seed(seed)
        model.load_state_dict({k: torch.randn_like(v) * 0.05 for k, v in model.state_dict().items()}, assign=True)
        reg.refresh(background=background)
        assert reg.wait_captured(timeout=120) and len(reg) == len(sizes) and reg.failures() == {}
        warmed = [e for e in reg.entries() if e.phases.warmup > 0]
        assert warmed == [], [(e.descriptor, e.phases) for e in reg.entries()]
        for n in sizes:
            x = torch.randn(n, 256, device="cuda", dtype=torch.float16)
            with torch.inference_mode():
                want = model(x)
            torch.testing.assert_close(reg.run(B.decode(n), x=x), want, rtol=2e-2, atol=2e-2)


class CacheWriter(nn.Module):
    """A step that writes its rows into a persistent cache at ``slots`` (the scratch row is the fill) and reads them
    back, as a paged attention writes its KV cache."""

    ROWS = 40  # rows 0..38 belong to requests; row 39 is the scratch slot the fill points at

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("cache", torch.zeros(self.ROWS, WIDTH))

    def forward(self, batch: B, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, slots, x.to(self.cache.dtype))
        return self.lin(x) + self.cache[slots].to(x.dtype)


def test_keys_captured_again_without_a_warm_up_write_only_the_scratch_slot_and_serve_back_to_back_as_eager() -> None:
    """warm_up_again=False, a weight sync by assign captured again in the background while run() is called back to
    back under autocast and inference mode: every output equals eager, the recaptures write no request's cache row,
    and a replay outside the autocast the graphs were captured under is refused by name, after a later capture() and
    refresh() as well."""
    engine = CacheWriter()
    scratch = CacheWriter.ROWS - 1
    reg = cg.GraphRegistry(engine, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32),
                                    "slots": cg.StaticInput((MAX_TOKENS,), torch.long, fill=scratch)},
                           backend="cpu", warm_up_again=False)
    expected = torch.zeros(CacheWriter.ROWS - 1, WIDTH)  # what the served steps wrote, row by row
    g = torch.Generator().manual_seed(1)

    def serve(n: int, step: int) -> None:
        x = torch.randn(n, WIDTH, generator=g)
        slots = torch.arange(n) + (step * n) % (scratch - n)
        out = reg.run(B.decode(n), x=x, slots=slots)
        want = engine.lin(x) + x  # what eager computes, under the same autocast
        assert out.dtype == want.dtype
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
        expected[slots] = x

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        reg.capture([(B.decode(n), "full") for n in SIZES])
        for step in range(6):
            serve(SIZES[step % 3], step)
        new_weights(engine.lin, 5)
        reg.refresh(background=True)
        step = 6
        while (reg.capturing() or step < 9) and step < 400:  # nothing between steps
            serve(SIZES[step % 3], step)
            step += 1
        assert reg.wait_captured(timeout=60) and len(reg) == len(SIZES) and reg.failures() == {}
        assert all(e.phases.warmup == 0 for e in reg.entries()), "the owner thread warmed them up before: recorded only"
        torch.testing.assert_close(engine.cache[:scratch].float(), expected, rtol=0, atol=0)
        for n in SIZES:
            serve(n, step)
            step += 1
        reg.capture([(B.decode(4), "full")])
        assert reg.refresh().recaptured == ()
        serve(4, step)
    with torch.inference_mode(), pytest.raises(cg.ServingStateError, match="autocast"):
        reg.run(B.decode(8), x=torch.randn(8, WIDTH), slots=torch.arange(8))
