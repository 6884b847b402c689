"""Serving safety: what a registry executes outside run() never touches live engine state, and
outputs, inputs, bad batches and misbehaving plugins cannot change what a later run computes."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from torch import nn

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins

from tests.conftest import device_of

SLOTS = 8
SCRATCH = SLOTS - 1  # the cache cell padded rows (and capture) write to; no request owns it


class CacheStep:
    """A step that writes its own KV cache at slot indices, like an engine's: one cell per slot."""

    def __init__(self, device: torch.device) -> None:
        self.cache = torch.zeros(SLOTS, device=device)

    def __call__(self, batch: B, slot: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
        self.cache.index_put_((slot,), val)
        return val * 2


def cache_registry(backend: str, **options: object) -> tuple[cg.GraphRegistry, CacheStep]:
    step = CacheStep(device_of(backend))
    inputs = {"slot": cg.StaticInput((SLOTS,), torch.long, fill=SCRATCH), "val": cg.StaticInput((SLOTS,), torch.float32)}
    return cg.GraphRegistry(step, inputs, backend=backend, plugins=make_plugins(), **options), step


def decode(reg: cg.GraphRegistry, slots: list[int], vals: list[float]) -> torch.Tensor:
    device = reg.device
    return reg.run(B.decode(len(slots)), slot=torch.tensor(slots, device=device), val=torch.tensor(vals, device=device))


def others_unchanged(cache: torch.Tensor, before: torch.Tensor, own: list[int]) -> None:
    """Every cell but the batch's own slots and the scratch slot holds what it held."""
    keep = [i for i in range(SLOTS) if i not in own and i != SCRATCH]
    assert torch.equal(cache[keep].cpu(), before[keep].cpu()), f"cells {keep} changed: {before.tolist()} -> {cache.tolist()}"


# ---------------------------------------------------------------- 1. capture runs on fills


def test_lazy_capture_mid_traffic_does_not_replay_an_earlier_batch(backend: str) -> None:
    reg, step = cache_registry(backend)
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=8, mode="full_decode_only"), lazy=True)
    decode(reg, [0], [1.0])
    step.cache[0] = 5.0  # slot 0 now belongs to another request
    before = step.cache.clone()
    out = decode(reg, [3, 4], [2.0, 3.0])  # a lazy capture, mid-traffic
    assert reg.stats().lazy_captures == 2
    assert float(step.cache[0]) == 5.0, "capture re-wrote the earlier batch's slot"
    others_unchanged(step.cache, before, [3, 4])
    torch.testing.assert_close(out, torch.tensor([4.0, 6.0], device=reg.device))


@pytest.mark.parametrize("how", ["capture again", "release", "evict"])
def test_every_capture_after_serving_writes_only_the_scratch_slot(backend: str, how: str) -> None:
    reg, step = cache_registry(backend)
    reg.capture([(B.decode(4), "full"), (B.decode(2), "full")])
    decode(reg, [0, 1, 2], [1.0, 2.0, 3.0])  # rows 0..2 of the static buffers now hold a served batch
    step.cache[:SCRATCH] = torch.arange(10.0, 10.0 + SCRATCH, device=reg.device)  # the slots move on to other requests
    before = step.cache.clone()
    if how == "capture again":
        reg.capture([(B.decode(8), "full"), (B.decode(1), "full")])
    elif how == "release":
        reg.release(B.decode(4))
        reg.capture([(B.decode(4), "full")])
    else:
        reg.memory_budget = 0  # every capture evicts every other entry that holds memory
        reg.capture([(B.decode(1), "full")])  # evicts the others: they are pending again
        assert reg.stats().evictions == 2 and len(reg.pending()) == 2
        decode(reg, [5, 6], [7.0, 8.0])  # re-captures decode(2) lazily after its eviction
        assert reg.stats().lazy_captures == 1
        before[5], before[6] = 7.0, 8.0
    others_unchanged(step.cache, before, [])


def test_integer_inputs_must_say_their_fill() -> None:
    with pytest.raises(ValueError, match=r"dtype=torch.int64\) needs an explicit fill.*scratch slot"):
        cg.StaticInput((8,), torch.long)
    with pytest.raises(ValueError, match="integer input needs a fill"):
        cg.StaticInput((8,), torch.int32, fill=None)
    assert cg.StaticInput((8,), torch.float32).fill == 0
    assert cg.StaticInput((8,), torch.bool).fill is False
    assert cg.StaticInput((8,), torch.long, fill=-1).fill == -1


@pytest.mark.parametrize(
    "dtype, fill, expected",
    [
        (torch.int32, 10**20, r"an int in \[-2147483648, 2147483647\]"),
        (torch.long, "a", "an int"),
        (torch.long, math.nan, "an int"),
        (torch.long, 1.5, r"an int \(it would be truncated\)"),
        (torch.bool, 2, "a bool"),
        (torch.uint8, -1, r"an int in \[0, 255\]"),
        (torch.float16, 1e6, r"a number within torch.float16.s range \(it would overflow to inf\)"),
        (torch.float32, "a", "a number"),
        (torch.long, True, "an int"),
        (torch.float32, 2**24 + 1, r"an integer torch.float32 holds exactly"),
        (torch.float16, 1e-8, r"a number torch.float16 can tell from 0 \(it would underflow\)"),
        (torch.float8_e4m3fn, 1000.0, r"a number within torch.float8_e4m3fn.s range and precision \(it would become 448\)"),
    ],
)
def test_a_fill_that_the_dtype_cannot_hold_is_refused(dtype: torch.dtype, fill: object, expected: str) -> None:
    with pytest.raises(ValueError, match=rf"fill={re.escape(repr(fill))} cannot be stored exactly; expected {expected}"):
        cg.StaticInput((8,), dtype, fill=fill)


def test_fills_that_fit_are_kept_exactly() -> None:
    assert cg.StaticInput((4,), torch.float32, fill=-math.inf).fill == -math.inf
    assert math.isnan(cg.StaticInput((4,), torch.float32, fill=math.nan).fill)
    assert cg.StaticInput((4,), torch.uint8, fill=255).fill == 255
    assert cg.StaticInput((4,), torch.bool, fill=True).fill is True


@pytest.mark.parametrize("name", ["context", "group"])
def test_run_keyword_names_are_reserved(name: str) -> None:
    with pytest.raises(ValueError, match=f"static input name {name!r} is reserved"):
        cg.GraphRegistry(lambda b, **k: k[name], {name: cg.StaticInput((4,), torch.float32)}, backend="cpu")


# ---------------------------------------------------------------- 2. outputs


def matrix_registry(backend: str, **options: object) -> cg.GraphRegistry:
    reg = cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((8, 3), torch.float32)}, backend=backend,
                           plugins=make_plugins(), **options)
    reg.capture([(B(8), "full")])
    return reg


@pytest.mark.parametrize("poison", ["unsqueeze_", "t_", "squeeze_ (inference mode)", "as_strided_"])
def test_in_place_metadata_changes_to_an_output_stay_with_the_caller(backend: str, poison: str) -> None:
    reg = matrix_registry(backend)
    x = torch.arange(15.0, device=reg.device).reshape(5, 3)
    out = reg.run(B(5), x=x)
    if poison == "unsqueeze_":
        out.unsqueeze_(0)
    elif poison == "t_":
        try:
            out.t_()  # outside inference mode this may raise, and must not stick either way
        except RuntimeError:
            pass
    elif poison == "squeeze_ (inference mode)":
        with torch.inference_mode():
            out.unsqueeze_(1).squeeze_(2)
    else:
        out.as_strided_((1,), (1,))
    again = reg.run(B(5), x=x)
    assert again.shape == (5, 3)
    torch.testing.assert_close(again, x * 2)


def test_structured_outputs_are_fresh_each_run(backend: str) -> None:
    reg = cg.GraphRegistry(lambda b, x: {"a": x + 1, "b": (x * 2, None)}, {"x": cg.StaticInput((8,), torch.float32)},
                           backend=backend, plugins=make_plugins())
    reg.capture([(B(8), "full")])
    x = torch.arange(4.0, device=reg.device)
    first = reg.run(B(4), x=x)
    first["a"].unsqueeze_(0)
    first["b"][0].unsqueeze_(1)
    second = reg.run(B(4), x=x)
    assert second["a"].shape == (4,) and second["b"][0].shape == (4,) and second["b"][1] is None
    torch.testing.assert_close(second["b"][0], x * 2)


# ---------------------------------------------------------------- 3. inputs


def test_an_input_that_requires_grad_leaves_no_autograd_history(backend: str) -> None:
    reg = matrix_registry(backend)
    x = torch.randn(5, 3, device=reg.device, requires_grad=True)
    for _ in range(3):
        out = reg.run(B(5), x=x)  # outside inference mode
    buffer = reg.static_inputs["x"]
    assert buffer.grad_fn is None and not buffer.requires_grad, "the static buffer joined the caller's autograd graph"
    torch.testing.assert_close(out, x.detach() * 2)


@pytest.mark.filterwarnings("ignore:.*do not fit static input:RuntimeWarning")  # on purpose
def test_the_eager_fallback_checks_inputs_like_the_graph_path(backend: str) -> None:
    reg = matrix_registry(backend)
    device = reg.device
    with pytest.raises(cg.InputError, match=re.escape("input 'x' has shape (3, 3), expected (40, 3) (40 tokens in this batch)")):
        reg.run(B(40, 5), x=torch.zeros(3, 3, device=device))  # no key covers 40 tokens, above capacity too
    with pytest.raises(cg.InputError, match="input 'x' has dtype torch.float64"):
        reg.run(B(12, 5), x=torch.zeros(12, 3, dtype=torch.float64, device=device))
    with pytest.raises(cg.InputError, match=r"missing \['x'\]"):
        reg.run(B(12, 5))
    assert reg.stats().misses == 0 and reg.stats().eager_fallbacks == 0, "refused before the step ran"
    torch.testing.assert_close(reg.run(B(40, 5), x=torch.ones(40, 3, device=device)), torch.full((40, 3), 2.0, device=device))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")  # torch's, for the CSR case
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested"])
def test_non_strided_inputs_are_refused_before_any_copy(kind: str) -> None:
    reg = matrix_registry("cpu")
    reg.run(B(5), x=torch.ones(5, 3))
    before = reg.static_inputs["x"].clone()
    dense = torch.arange(15.0).reshape(5, 3)
    if kind == "nested":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad = torch.nested.nested_tensor([dense[:2], dense[2:]])
        label = "nested"
    else:
        bad = dense.to_sparse() if kind == "sparse_coo" else dense.to_sparse_csr()
        label = kind
    with pytest.raises(cg.InputError, match=f"input 'x' is a {label} tensor; expected a dense"):
        reg.run(B(5), x=bad)
    assert torch.equal(reg.static_inputs["x"], before)


# ---------------------------------------------------------------- 4. bad batches, broken entries, plugins


VOCAB = 10


def embed_registry(backend: str, strategy: str) -> tuple[cg.GraphRegistry, torch.Tensor]:
    table = torch.arange(VOCAB * 2, dtype=torch.float32, device=device_of(backend)).reshape(VOCAB, 2)

    @cg.eager_break
    def check_ids(ids: torch.Tensor) -> None:  # an eager break may read the host: it validates the batch
        top = int(ids.max())
        if top >= VOCAB:
            raise ValueError(f"token id {top} out of range for vocab {VOCAB}")

    def step(batch: B, ids: torch.Tensor) -> torch.Tensor:
        if strategy == "breakable":
            check_ids(ids)
        return table[ids] * 1.0

    reg = cg.GraphRegistry(step, {"ids": cg.StaticInput((8,), torch.long, fill=0)}, backend=backend, plugins=make_plugins())
    reg.capture([(B(8), strategy)])
    return reg, table


@pytest.mark.parametrize("strategy, error", [
    ("full", IndexError),  # the replayed index op raises (cpu emulator; a CUDA kernel would assert instead)
    ("breakable", ValueError),  # the step's own check, in an eager break
])
def test_a_bad_batch_raises_its_own_error_and_keeps_the_entry(backend: str, strategy: str, error: type) -> None:
    if backend == "cuda" and strategy == "full":
        pytest.skip("an out-of-range index inside a CUDA graph is a device assert, not an exception")
    reg, table = embed_registry(backend, strategy)
    good = torch.tensor([1, 2, 3], device=reg.device)
    torch.testing.assert_close(reg.run(B(3), ids=good), table[good])
    with pytest.raises(error):
        reg.run(B(3), ids=torch.tensor([1, 99, 3], device=reg.device))
    assert len(reg) == 1 and not reg.failures(), "one bad batch must not demote the key"
    hits = reg.stats().hits
    torch.testing.assert_close(reg.run(B(3), ids=good), table[good])
    assert reg.stats().hits == hits + 1 and reg.stats().bad_batches == 1


class BrokenReplay:
    """A strategy whose graphs replay once, then raise: broken, whatever the batch."""

    name = "brittle"
    relaxes_num_reqs = False

    def capture(self, body, backend, pool):  # type: ignore[no-untyped-def]
        graph, out = backend.capture(body, pool)
        calls = [0]

        class Graph:
            memory_bytes = graph.memory_bytes

            def replay(self) -> None:
                calls[0] += 1
                if calls[0] > 1:
                    raise RuntimeError("graph is broken")
                graph.replay()

        return Graph(), out

    @cg.plugin.hookimpl
    def cgregistry_register_strategies(self, register):  # type: ignore[no-untyped-def]
        register(self)


def test_a_broken_entry_is_removed_and_the_batch_is_served_eagerly(backend: str) -> None:
    reg = cg.GraphRegistry(lambda b, x: x * 3, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend,
                           plugins=make_plugins(BrokenReplay()), preference=("brittle",))
    reg.capture([(B(8), "brittle")])
    x = torch.arange(4.0, device=reg.device)
    torch.testing.assert_close(reg.run(B(4), x=x), x * 3)
    with pytest.warns(RuntimeWarning, match="the entry was removed"):
        torch.testing.assert_close(reg.run(B(4), x=x), x * 3)
    assert len(reg) == 0 and list(reg.failures()) == [(B(8), "brittle")]
    assert reg.stats().bad_batches == 0


class RaisingObserver:
    """Every observer hook raises."""

    def __init__(self) -> None:
        self.calls = 0

    def _boom(self, **_: object) -> None:
        self.calls += 1
        raise RuntimeError("observer bug")

    @cg.plugin.hookimpl
    def cgregistry_registry_created(self, registry):  # type: ignore[no-untyped-def]
        self._boom()

    @cg.plugin.hookimpl
    def cgregistry_capture_started(self, registry, key, strategy):  # type: ignore[no-untyped-def]
        self._boom()

    @cg.plugin.hookimpl
    def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # type: ignore[no-untyped-def]
        self._boom()

    @cg.plugin.hookimpl
    def cgregistry_miss(self, registry, actual):  # type: ignore[no-untyped-def]
        self._boom()

    @cg.plugin.hookimpl
    def cgregistry_evicted(self, registry, key, strategy, memory_bytes):  # type: ignore[no-untyped-def]
        self._boom()

    @cg.plugin.hookimpl
    def cgregistry_released(self, registry, key, strategy, memory_bytes):  # type: ignore[no-untyped-def]
        self._boom()


class CountingObserver:
    def __init__(self) -> None:
        self.finished: list[B] = []
        self.misses = 0

    @cg.plugin.hookimpl
    def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # type: ignore[no-untyped-def]
        self.finished.append(key)

    @cg.plugin.hookimpl
    def cgregistry_miss(self, registry, actual):  # type: ignore[no-untyped-def]
        self.misses += 1


@pytest.mark.filterwarnings("ignore:.*do not fit static input:RuntimeWarning")  # on purpose
@pytest.mark.filterwarnings("ignore:.*of plugin .*RaisingObserver. raised RuntimeError:RuntimeWarning")  # on purpose
def test_raising_observers_are_contained_and_the_others_still_run() -> None:
    raising, counting = RaisingObserver(), CountingObserver()
    with pytest.warns(RuntimeWarning, match=r"cgregistry_registry_created of plugin .* raised RuntimeError: observer bug"):
        reg = cg.GraphRegistry(lambda b, x: x + 1, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu",
                               plugins=make_plugins(counting, raising))
    with pytest.warns(RuntimeWarning, match="cgregistry_capture_finished"):
        reg.capture([(B(n), "full") for n in (8, 4, 2)])
    assert len(reg) == 3 and counting.finished == [B(8), B(4), B(2)], "the whole plan was captured"
    x = torch.arange(8.0)
    with pytest.warns(RuntimeWarning, match="cgregistry_miss"):
        torch.testing.assert_close(reg.run(B(12), x=torch.zeros(12)), torch.ones(12))
    assert counting.misses == 1
    torch.testing.assert_close(reg.run(B(8), x=x), x + 1)
    with pytest.warns(RuntimeWarning, match="cgregistry_released"):
        reg.release(B(4))
    assert raising.calls >= 9


def test_choose_match_answering_a_plain_tuple_is_a_plugin_error() -> None:
    class TuplePolicy:
        @cg.plugin.hookimpl
        def cgregistry_choose_match(self, registry, actual, candidates):  # type: ignore[no-untyped-def]
            return tuple(candidates[0])  # the fields of a candidate, not the Match itself

    pm = cg.plugin.make_plugin_manager(autoload=False)
    pm.register(TuplePolicy(), name="tuple-policy")
    reg = cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", plugins=cg.Plugins(pm))
    reg.capture([(B(8), "full")])
    with pytest.raises(cg.PluginError, match="implemented by tuple-policy.*not one of the candidates"):
        reg.run(B(4), x=torch.zeros(4))


class LyingMemory:
    name = "liar"
    relaxes_num_reqs = False

    def __init__(self, memory: object) -> None:
        self.memory = memory

    def capture(self, body, backend, pool):  # type: ignore[no-untyped-def]
        graph, out = backend.capture(body, pool)

        class Graph:
            memory_bytes = self.memory
            replay = graph.replay

        return Graph(), out

    @cg.plugin.hookimpl
    def cgregistry_register_strategies(self, register):  # type: ignore[no-untyped-def]
        register(self)


@pytest.mark.parametrize("memory", [-5, 1.5, None, True])
def test_a_strategy_reporting_a_bad_memory_size_is_refused(memory: object) -> None:
    reg = cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu",
                           plugins=make_plugins(LyingMemory(memory)), memory_budget=1 << 20)
    with pytest.raises(cg.CaptureError, match=rf"strategy 'liar' reported memory_bytes={re.escape(repr(memory))}"):
        reg.capture([(B(8), "liar")])
    assert len(reg) == 0 and reg.memory_bytes() == 0 and reg.memory_budget == 1 << 20


# ---------------------------------------------------------------- 5. debug mode


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def debug_model_registry(backend: str) -> tuple[cg.GraphRegistry, Tiny]:
    model = Tiny().to(device_of(backend))
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((8, 3), torch.float32)}, backend=backend, plugins=make_plugins(), debug=True)
    with torch.inference_mode():
        reg.capture([(B(8), "full")])
    return reg, model


@pytest.mark.parametrize("reload", ["load_state_dict(assign=True)", "module.weight = Parameter", "param.data ="])
def test_debug_mode_catches_weights_replaced_the_way_engines_replace_them(backend: str, reload: str) -> None:
    reg, model = debug_model_registry(backend)
    x = torch.randn(5, 3, device=reg.device)
    with torch.inference_mode():
        reg.run(B(5), x=x)
    new = {k: v * 2 for k, v in model.state_dict().items()}
    if reload == "load_state_dict(assign=True)":
        model.load_state_dict(new, assign=True)
    elif reload == "module.weight = Parameter":
        model.proj.weight = nn.Parameter(new["proj.weight"])
    else:
        model.proj.weight.data = new["proj.weight"]
    with pytest.raises(cg.DebugError, match=r"step\.proj\.weight moved from 0x[0-9a-f]+ to 0x[0-9a-f]+ since capture"):
        with torch.inference_mode():
            reg.run(B(5), x=x)


def test_debug_mode_accepts_an_in_place_reload(backend: str) -> None:
    reg, model = debug_model_registry(backend)
    x = torch.randn(5, 3, device=reg.device)
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})  # copies in place
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(5), x=x).clone(), model(B(5), x))


def test_watching_a_module_of_a_plain_function_step(backend: str) -> None:
    model = Tiny().to(device_of(backend))
    reg = cg.GraphRegistry(lambda b, x: model(b, x), {"x": cg.StaticInput((8, 3), torch.float32)}, backend=backend,
                           plugins=make_plugins(), debug=True)
    reg.watch(model, prefix="model.")
    with torch.inference_mode():
        reg.capture([(B(8), "full")])
        model.proj.bias = nn.Parameter(torch.zeros(3, device=reg.device))
        with pytest.raises(cg.DebugError, match=r"model\.proj\.bias moved"):
            reg.run(B(5), x=torch.randn(5, 3, device=reg.device))


@pytest.mark.parametrize("derive", ["slice", "detach", "view", "in place"])
def test_stale_reads_through_derived_views_are_caught(backend: str, derive: str) -> None:
    reg = matrix_registry(backend, debug=True)
    out = reg.run(B(5), x=torch.ones(5, 3, device=reg.device))
    derive_fn = {"slice": lambda t: t[:2], "detach": lambda t: t.detach(), "view": lambda t: t.view(15),
               "in place": lambda t: t.mul_(1)}
    with torch.inference_mode():  # graph outputs are inference tensors: in-place ops need the mode
        derived = derive_fn[derive](out)
    kept = out.clone()  # not derived: the caller's own copy
    reg.run(B(5), x=torch.zeros(5, 3, device=reg.device))
    with pytest.raises(cg.StaleOutputError, match="output of run 1 was read"):
        derived.sum()
    assert float(kept.sum()) == 30.0


@pytest.mark.filterwarnings("ignore:.*do not fit static input:RuntimeWarning")  # on purpose
def test_debug_mode_raises_no_false_alarms(backend: str) -> None:
    reg = matrix_registry(backend, debug=True)
    device = reg.device
    first = reg.run(B(5), x=torch.ones(5, 3, device=device))
    second = reg.run(B(5), x=first)  # the last output as the next input
    torch.testing.assert_close(second.clone(), torch.full((5, 3), 4.0, device=device))
    with pytest.raises(cg.InputError):
        reg.run(B(5), x=torch.ones(4, 3, device=device))  # refused: nothing was overwritten
    torch.testing.assert_close(second.clone(), torch.full((5, 3), 4.0, device=device))
    eager = reg.run(B(12), x=torch.ones(12, 3, device=device))  # no key covers 12: the caller's own tensor
    reg.run(B(5), x=torch.ones(5, 3, device=device))
    assert float(eager.sum()) == 72.0
    assert second.shape == (5, 3) and second.dtype == torch.float32 and second.device.type == device.type
    assert second.size(0) == 5 and second.dim() == 2 and len(second) == 5 and second.numel() == 15
    with pytest.raises(cg.StaleOutputError):
        second.sum()


# ---------------------------------------------------------------- 6. piecewise eager fallback


@pytest.mark.filterwarnings("ignore:.*do not fit static input:RuntimeWarning")  # on purpose
def test_piecewise_eager_fallback_never_retraces() -> None:
    @cg.eager_break
    def mix(h: torch.Tensor) -> torch.Tensor:
        return h.softmax(-1)

    w = torch.randn(4, 4)

    def model(x: torch.Tensor) -> torch.Tensor:
        return mix(x @ w) @ w

    reg = cg.GraphRegistry(lambda b, x: compiled(x), {"x": cg.StaticInput((16, 4), torch.float32)}, backend="cpu",
                           plugins=make_plugins())
    compiled = reg.compile(model, max_traces=2)
    reg.capture([(B(8), "piecewise"), (B(4), "piecewise")])
    traces = len(compiled.compiler.traces)
    for i, tokens in enumerate((9, 12, 16, 20, 33, 11)):  # no key covers these: eager, in new layouts each time
        x = torch.randn(4, tokens).t() if i % 2 else torch.randn(tokens, 8)[:, ::2]
        torch.testing.assert_close(reg.run(B(tokens), x=x), model(x))
    assert len(compiled.compiler.traces) == traces
    assert reg.stats().misses == 6


# ---------------------------------------------------------------- 7. errors name the value


@pytest.mark.parametrize("make, name", [
    (lambda: B.decode(3, -1), "spec_depth"),
    (lambda: B.decode(0), "num_reqs"),
    (lambda: B.decode(2.5), "num_reqs"),
    (lambda: B.decode(2, 0, -1), "num_active_loras"),
])
def test_decode_names_the_bad_argument(make: object, name: str) -> None:
    with pytest.raises((TypeError, ValueError), match=f"BatchDescriptor.{name} must be"):
        make()  # type: ignore[operator]


@pytest.mark.parametrize("sizes", [[8, "16"], [8, None], "16", 16])
def test_bad_capture_sizes_are_named(sizes: object) -> None:
    with pytest.raises(ValueError, match=rf"capture_sizes must .*got {re.escape(repr(sizes if isinstance(sizes, (str, int)) else sizes[1]))}"):
        cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, mode="full", capture_sizes=sizes)  # type: ignore[arg-type]


def test_fit_names_the_bad_step() -> None:
    with pytest.raises(TypeError, match=r"steps\[1\] is 7 \(int\)"):
        cg.CapturePlan.fit([B(4, 2), 7, "x"], 4, max_num_seqs=8, max_num_tokens=64)  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [4, [4], {"num_tokens": 4}, (4, 2)])
def test_every_entry_point_refuses_a_non_descriptor_alike(bad: object) -> None:
    reg = matrix_registry("cpu")
    message = f"a batch must be a cgregistry.BatchDescriptor, got {re.escape(repr(bad))}"
    for call in (lambda: reg.run(bad, x=torch.zeros(4, 3)), lambda: reg.match(bad), lambda: reg.explain(bad)):
        with pytest.raises(TypeError, match=message):
            call()  # type: ignore[arg-type]


def good_snapshot() -> dict:
    reg = matrix_registry("cpu")
    reg.run(B(5), x=torch.ones(5, 3))
    return reg.snapshot()


@pytest.mark.parametrize("corrupt, field", [
    (lambda d: d.update(entries=5), "entries"),
    (lambda d: d.update(failures=[1, 2]), "failures"),
    (lambda d: d.update(memory_bytes="lots"), "memory_bytes"),
    (lambda d: d["stats"].update(hits="many"), "stats.hits"),
    (lambda d: d["entries"][0].update(replays=-5), r"entries\[0\].replays"),
    (lambda d: d["entries"][0].update(capture_seconds="fast"), r"entries\[0\].capture_seconds"),
    (lambda d: d["entries"][0]["key"].update(num_tokens="8"), r"entries\[0\].key"),
    (lambda d: d.update(preference="full"), "preference"),
    (lambda d: d["stats"]["by_class"]["full/mixed/lora0"].update(replays=None), r"stats.by_class\['full/mixed/lora0'\].replays"),
    (lambda d: d.update(pending=[{"key": {"num_tokens": 4}}]), r"pending\[0\]"),
])
def test_load_snapshot_names_the_bad_field(corrupt: object, field: str) -> None:
    data = good_snapshot()
    assert cg.load_snapshot(data).stats.hits == 1
    corrupt(data)  # type: ignore[operator]
    with pytest.raises(cg.SnapshotError, match=f"snapshot field {field}"):
        cg.load_snapshot(data)


def test_load_snapshot_refuses_a_boolean_schema_and_a_binary_file(tmp_path: object) -> None:
    data = good_snapshot()
    data["schema"] = True
    with pytest.raises(cg.SnapshotError, match="snapshot schema True is not supported"):
        cg.load_snapshot(data)
    path = tmp_path / "snap.bin"  # type: ignore[operator]
    path.write_bytes(bytes(range(256)))
    with pytest.raises(cg.SnapshotError, match="not UTF-8 text"):
        cg.load_snapshot(path)
    path.write_text(json.dumps(good_snapshot()))
    assert cg.load_snapshot(path).entries[0].key == B(8)


# ---------------------------------------------------------------- 8. an engine's life, stateful

KV_SLOTS = 16
KV_SCRATCH = KV_SLOTS - 1
DECODE_KEYS = [B.decode(n) for n in (1, 2, 4, 8, 16)]
RELAXED_KEYS = [B(n) for n in (4, 8, 16)]


@cg.eager_break
def refuse_bad_request(slot: torch.Tensor) -> None:
    """The engine's own check of a request, run eagerly (at replay of breakable entries, and when eager)."""
    batch = cg.current_batch()
    if batch is not None and batch.payload == "bad":
        raise ValueError("request refused: malformed")


class KVStep:
    """Writes its KV cache at the slots it is given and reads them back, like attention over a paged cache."""

    def __init__(self, device: torch.device) -> None:
        self.cache = torch.zeros(KV_SLOTS, device=device)
        self.fail_for: set[B] = set()  # keys whose capture raises (injected faults)

    def __call__(self, batch: B, slot: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
        running = cg.current_batch()
        if batch in self.fail_for and running is not None and running.key is not None:
            raise RuntimeError(f"injected fault capturing {batch}")
        refuse_bad_request(slot)
        self.cache.index_put_((slot,), val)
        return self.cache[slot] * 2 + val


class EngineLife(RuleBasedStateMachine):
    """Lazy and eager capture, eviction under a budget, release, clear, bad batches and capture faults,
    interleaved with runs.  After every step every cache cell but the scratch slot holds exactly what an
    eager engine would have written, and every output equals eager."""

    backend = "cpu"

    @initialize()
    def make(self) -> None:
        self.device = device_of(self.backend)
        self.model = KVStep(self.device)
        inputs = {"slot": cg.StaticInput((KV_SLOTS,), torch.long, fill=KV_SCRATCH), "val": cg.StaticInput((KV_SLOTS,), torch.float32)}
        self.reg = cg.GraphRegistry(self.model, inputs, backend=self.backend, plugins=make_plugins())
        self.expected = torch.zeros(KV_SLOTS)  # what eager serving would leave in the cache
        self.gen = torch.Generator().manual_seed(0)

    def _plan(self, keys: list[B], strategy: str) -> list[tuple[B, str]]:
        return [(k, strategy) for k in keys if (k.num_reqs is None) == (strategy == "breakable")]

    @rule(keys=st.lists(st.sampled_from(DECODE_KEYS + RELAXED_KEYS), min_size=1, max_size=3, unique=True),
          strategy=st.sampled_from(["full", "breakable"]), lazy=st.booleans(), fail=st.booleans())
    def capture(self, keys: list[B], strategy: str, lazy: bool, fail: bool) -> None:
        plan = self._plan(keys, strategy)
        if not plan:
            return
        if fail and not lazy:
            self.model.fail_for.add(plan[-1][0])
        try:
            self.reg.capture(plan, lazy=lazy)
        except cg.CaptureError as exc:
            assert fail and "injected fault" in str(exc)
        finally:
            self.model.fail_for.clear()

    @rule(tokens=st.integers(1, KV_SLOTS - 1), data=st.data())
    def run(self, tokens: int, data: st.DataObject) -> None:
        batch = self._batch(tokens, data)
        slots = torch.randperm(KV_SCRATCH, generator=self.gen)[:tokens]
        vals = torch.rand(tokens, generator=self.gen) + 1
        out = self.reg.run(batch, slot=slots.to(self.device), val=vals.to(self.device))
        self.expected[slots] = vals
        torch.testing.assert_close(out.cpu(), vals * 3)

    @rule(tokens=st.integers(1, KV_SLOTS - 1), data=st.data(), kind=st.sampled_from(["refused", "out of range"]))
    def bad_batch(self, tokens: int, data: st.DataObject, kind: str) -> None:
        batch = self._batch(tokens, data)
        match = self.reg.match(batch)
        slots = torch.randperm(KV_SCRATCH, generator=self.gen)[:tokens]
        vals = torch.rand(tokens, generator=self.gen) + 1
        entries = {(e.key, e.strategy) for e in self.reg.entries()}
        failures = set(self.reg.failures())
        if kind == "out of range":
            if self.backend == "cuda":
                return  # an out-of-range index in a CUDA kernel is a device assert, not an exception
            slots[-1] = KV_SLOTS + 3
            with pytest.raises(IndexError):
                self.reg.run(batch, slot=slots.to(self.device), val=vals.to(self.device))
            assert self.reg.stats().bad_batches >= 1
            own, now = slots[:-1], self.model.cache.cpu()[slots[:-1]]
            assert bool(((now == self.expected[own]) | (now == vals[:-1])).all()), "the batch's own slots: old or new values"
            self.expected[own] = now  # a refused batch may have written its own slots, nothing else
        elif match is not None and match.strategy == "full":
            return  # a full graph (captured now or lazily) runs no eager code: it cannot refuse a request
        else:
            with pytest.raises(ValueError, match="request refused"):
                self.reg.run(batch, slot=slots.to(self.device), val=vals.to(self.device), context="bad")
        now = {(e.key, e.strategy) for e in self.reg.entries()}
        lost = entries - now
        assert lost <= set(self.reg.pending()), f"a bad batch demoted {lost} (only eviction may, back to pending)"
        assert set(self.reg.failures()) <= failures, "a bad batch was taken for a broken entry"
        assert failures - set(self.reg.failures()) <= now, "a failure forgotten though its key was not captured"

    @rule(data=st.data())
    def lazy_capture_fault(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(DECODE_KEYS))
        if (key, "full") in {(e.key, e.strategy) for e in self.reg.entries()}:
            return
        self.reg.capture([(key, "full")], lazy=True)
        self.model.fail_for.add(key)
        batch = B.decode(key.num_reqs)
        slots = torch.randperm(KV_SCRATCH, generator=self.gen)[: min(key.num_reqs, KV_SCRATCH)]
        if len(slots) != key.num_reqs:
            self.model.fail_for.clear()
            return
        vals = torch.rand(len(slots), generator=self.gen) + 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                out = self.reg.run(batch, slot=slots.to(self.device), val=vals.to(self.device))
        finally:
            self.model.fail_for.clear()
        self.expected[slots] = vals
        torch.testing.assert_close(out.cpu(), vals * 3)

    @rule(data=st.data())
    def set_budget(self, data: st.DataObject) -> None:
        sizes = sorted({e.memory_bytes for e in self.reg.entries()})
        self.reg.memory_budget = data.draw(st.sampled_from([None, *sizes]))

    @precondition(lambda self: len(self.reg) > 0)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.reg.entries()))
        self.reg.release(entry.key, entry.strategy)

    @rule()
    def clear(self) -> None:
        self.reg.clear()

    def _batch(self, tokens: int, data: st.DataObject) -> B:
        if data.draw(st.booleans(), label="decode"):
            return B.decode(tokens)
        return B(tokens, data.draw(st.integers(1, tokens), label="reqs"))

    @invariant()
    def only_the_scratch_slot_differs_from_eager(self) -> None:
        keep = torch.arange(KV_SCRATCH)
        assert torch.equal(self.model.cache.cpu()[keep], self.expected[keep]), (
            f"cache {self.model.cache.cpu().tolist()} != eager {self.expected.tolist()}"
        )


class EngineLifeCuda(EngineLife):
    backend = "cuda"


_life = settings(max_examples=30, stateful_step_count=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EngineLife.TestCase.settings = _life
EngineLifeCuda.TestCase.settings = _life
# 30 examples: minutes on two cores, so in the slow set (tests/serving/test_stateful.py runs 4 in the default one).
_no_graph_yet = pytest.mark.filterwarnings("ignore:.*with no graph captured or planned:RuntimeWarning")  # on purpose
test_engine_life_cpu = pytest.mark.slow(_no_graph_yet(EngineLife.TestCase))
test_engine_life_cuda = pytest.mark.slow(pytest.mark.cuda(_no_graph_yet(EngineLifeCuda.TestCase)))


# ---------------------------------------------------------------- found by attacking the above


def test_a_refused_batch_that_lazily_captures_a_key_that_failed_before_serves_it_after(backend: str) -> None:
    """A breakable key whose capture failed, asked for lazily again: a refused batch captures it on its way (the
    capture runs on the fills, not the bad request), the failure record goes with the new entry, and the next good
    batch replays it with the cache as eager leaves it."""
    device = device_of(backend)
    model = KVStep(device)
    inputs = {"slot": cg.StaticInput((KV_SLOTS,), torch.long, fill=KV_SCRATCH), "val": cg.StaticInput((KV_SLOTS,), torch.float32)}
    reg = cg.GraphRegistry(model, inputs, backend=backend, plugins=make_plugins())
    model.fail_for.add(B(16))
    with pytest.raises(cg.CaptureError, match="injected fault"):
        reg.capture([(B(16), "breakable")])
    model.fail_for.clear()
    reg.capture([(B(16), "breakable")], lazy=True)
    assert list(reg.failures()) == [(B(16), "breakable")] and reg.pending() == [(B(16), "breakable")]
    with pytest.raises(ValueError, match="request refused"):
        reg.run(B.decode(1), slot=torch.tensor([3], device=device), val=torch.tensor([1.5], device=device), context="bad")
    assert reg.failures() == {} and [(e.key, e.strategy) for e in reg.entries()] == [(B(16), "breakable")]
    out = reg.run(B.decode(2), slot=torch.tensor([4, 5], device=device), val=torch.tensor([1.0, 2.0], device=device))
    torch.testing.assert_close(out.cpu(), torch.tensor([3.0, 6.0]))
    assert reg.stats().hits == 1 and model.cache[4:6].tolist() == [1.0, 2.0]



def test_a_live_input_aliasing_a_static_buffer_survives_a_lazy_capture(backend: str) -> None:
    reg = cg.GraphRegistry(lambda b, h: (h * 2, h), {"h": cg.StaticInput((8,), torch.float32)}, backend=backend,
                           plugins=make_plugins())
    reg.capture([(B(8), "full"), (B.decode(4), "full")], lazy=True)
    out = reg.run(B(4, 2), h=torch.tensor([1.0, 2.0, 3.0, 4.0], device=reg.device))
    again = reg.run(B.decode(4), h=out[1])  # a view of the static buffer, as the next input; captures lazily first
    torch.testing.assert_close(again[0], torch.tensor([2.0, 4.0, 6.0, 8.0], device=reg.device))


def test_a_refused_group_run_does_not_leave_the_agreed_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import cgregistry.server as registry_module

    monkeypatch.setattr(registry_module, "agree", lambda actual, group: B(12, 6) if actual.num_tokens <= 12 else actual)
    reg = cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", plugins=make_plugins())
    reg.capture([(B(16), "full"), (B(8), "full")], lazy=True)
    with pytest.raises(cg.InputError):
        reg.run(B(4, 2), x=torch.ones(5), group=object())
    torch.testing.assert_close(reg.run(B(4, 2), x=torch.ones(4), group=object()), torch.full((4,), 2.0))
    assert reg.stats().misses == 0 and [e.key for e in reg.entries(used=True)] == [B(16)], "every rank replays the agreed key"


@pytest.mark.filterwarnings("ignore:.*do not fit static input:RuntimeWarning")  # on purpose
def test_more_requests_than_a_static_input_holds_run_eagerly() -> None:
    reg = cg.GraphRegistry(lambda b, ids, seq_lens: ids.float() * 2,
                           {"ids": cg.StaticInput((32,), torch.long, fill=0), "seq_lens": cg.StaticInput((8,), torch.int32, axis="reqs", fill=1)},
                           backend="cpu", plugins=make_plugins())
    reg.capture([(B(32), "breakable")])
    batch = B(20, 12)  # the relaxed key covers any request count, but seq_lens holds 8
    assert reg.match(batch) is None
    torch.testing.assert_close(reg.run(batch, ids=torch.arange(20), seq_lens=torch.ones(12, dtype=torch.int32)), torch.arange(20.0) * 2)
    assert reg.stats().misses == 1


@pytest.mark.filterwarnings("ignore:.*with no graph captured or planned:RuntimeWarning")  # on purpose
def test_debug_mode_no_alarm_while_no_graph_reads_the_weights() -> None:
    model = Tiny()
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((8, 3), torch.float32)}, backend="cpu", plugins=make_plugins(), debug=True)
    reg.capture([(B(8), "full")], lazy=True)
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()}, assign=True)  # before any graph exists
    x = torch.randn(5, 3)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(5), x=x).clone(), model(B(5), x))  # captured lazily, on the new weights
        reg.clear()
        model.proj.weight = nn.Parameter(torch.zeros(3, 3))
        torch.testing.assert_close(reg.run(B(5), x=x), model(B(5), x))  # eager: nothing to warn about


def test_debug_mode_sees_a_replaced_submodule() -> None:
    reg, model = debug_model_registry("cpu")
    model.proj = nn.Linear(3, 3)
    with pytest.raises(cg.DebugError, match=r"step\.proj\.weight moved"):
        with torch.inference_mode():
            reg.run(B(5), x=torch.randn(5, 3))


def test_debug_outputs_behave_like_plain_ones() -> None:
    reg = matrix_registry("cpu", debug=True)
    out = reg.run(B(5), x=torch.ones(5, 3))
    out.unsqueeze_(0)  # allowed on the plain view run() hands out, so allowed here
    assert out.shape == (1, 5, 3)
    with pytest.raises(TypeError):
        reg.run(None, x=torch.ones(5, 3))  # type: ignore[arg-type]
    assert float(out.sum()) == 30.0, "a refused batch overwrote nothing"
    reg.run(B(5), x=torch.zeros(5, 3))
    assert out.nbytes == 60 and out.itemsize == 4 and out.is_leaf and out.grad is None and not out.is_nested


def test_structseq_outputs_round_trip_and_odd_containers_are_refused() -> None:
    reg = cg.GraphRegistry(lambda b, x: torch.topk(x, 2, dim=-1), {"x": cg.StaticInput((16, 4), torch.float32)}, backend="cpu",
                           plugins=make_plugins())
    reg.capture([(B(8), "full")])
    x = torch.randn(5, 4)
    got, want = reg.run(B(5), x=x), torch.topk(x, 2, dim=-1)
    assert type(got) is type(want)
    torch.testing.assert_close(got.values, want.values)
    import collections

    reg = cg.GraphRegistry(lambda b, x: collections.defaultdict(list, a=x), {"x": cg.StaticInput((16,), torch.float32)},
                           backend="cpu", plugins=make_plugins())
    with pytest.raises(cg.CaptureError, match="output is a defaultdict; return a dict"):
        reg.capture([(B(8), "full")])


@pytest.mark.filterwarnings("ignore:.*with no graph captured or planned:RuntimeWarning")  # on purpose
def test_observers_are_contained_beside_a_wrapper() -> None:
    seen: list[str] = []

    class Good:
        @cg.plugin.hookimpl
        def cgregistry_miss(self, registry, actual):  # type: ignore[no-untyped-def]
            seen.append("good")

    class Bad:
        @cg.plugin.hookimpl
        def cgregistry_miss(self, registry, actual):  # type: ignore[no-untyped-def]
            raise RuntimeError("bad observer")

    class Wrapping:
        @cg.plugin.hookimpl(wrapper=True)
        def cgregistry_miss(self, registry, actual):  # type: ignore[no-untyped-def]
            seen.append("wrapper")
            return (yield)

    pm = cg.plugin.make_plugin_manager(autoload=False)
    for plugin, name in ((Good(), "good"), (Bad(), "bad"), (Wrapping(), "wrapping")):
        pm.register(plugin, name=name)
    reg = cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((4,), torch.float32)}, backend="cpu", plugins=cg.Plugins(pm))
    with pytest.warns(RuntimeWarning, match="cgregistry_miss of plugin 'bad' raised RuntimeError: bad observer"):
        reg.run(B(2), x=torch.ones(2))
    assert sorted(seen) == ["good", "wrapper"]


def test_a_deeply_nested_snapshot_file_is_a_snapshot_error(tmp_path: object) -> None:
    path = tmp_path / "deep.json"  # type: ignore[operator]
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(cg.SnapshotError, match="nested too deeply"):
        cg.load_snapshot(path)


def test_a_schema_1_snapshot_still_loads_and_unknown_fields_are_ignored() -> None:
    data = good_snapshot()
    assert data["schema"] == 5
    del data["stats"]["bad_batches"]  # what 0.1 wrote
    data["schema"] = 1
    data["note"] = "written by a later version"
    snapshot = cg.load_snapshot(data)
    assert snapshot.schema == 1 and snapshot.stats.bad_batches == 0 and snapshot.stats.hits == 1


def test_debug_mode_no_alarm_after_the_eager_step_refused_a_batch() -> None:
    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 7:
            raise IndexError("token id out of range")
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", plugins=make_plugins(), debug=True)
    reg.capture([(B(4), "full")])
    out = reg.run(B(3), x=torch.ones(3))
    with pytest.raises(IndexError):
        reg.run(B(7), x=torch.ones(7))  # a miss the step refuses: no graph memory touched
    assert float((out + 0).sum()) == 6.0
