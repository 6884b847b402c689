"""The piecewise strategy: one dynamic trace split at splitting ops, each piece graphed per descriptor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.demo_model import (
    DemoConfig,
    DemoDecoder,
    attention_kernel_into,
    demo_inputs,
    random_batch,
)
from cgregistry.testing import make_plugins

from tests.conftest import device_of

# Inductor's first use in a process imports torch modules that still define TorchScript methods.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

CFG = DemoConfig(layers=3, hidden=32, heads=2, ffn=48, vocab=64, max_num_seqs=8, max_num_tokens=32, context=8, dtype=torch.float32)
D, CTX, MAX_TOKENS = 8, 12, 16


def demo_registry(backend: str, **compile_options: object) -> tuple[cg.GraphRegistry, DemoDecoder, DemoDecoder, cg.PiecewiseModel]:
    """A registry over a piecewise-compiled demo decoder (attention an eager break), and the same model inline."""
    device = device_of(backend)
    inline = DemoDecoder(CFG, device, seed=3)
    broken = DemoDecoder(CFG, device, seed=3, attention=cg.eager_break(attention_kernel_into))
    reg = cg.GraphRegistry(lambda batch, **inputs: compiled(**inputs), demo_inputs(CFG), backend=backend, plugins=make_plugins())
    compiled = reg.compile(lambda input_ids, req_idx, seq_lens: broken(None, input_ids, req_idx, seq_lens), **compile_options)
    return reg, inline, broken, compiled


def test_piecewise_matches_eager_across_the_plan_with_full_entries_beside(backend: str) -> None:
    reg, inline, _, compiled = demo_registry(backend)
    plan = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=32, mode="full_and_piecewise")
    reg.capture(plan)
    strategies = {e.strategy for e in reg.entries()}
    assert strategies == {"full", "piecewise"}
    pieces = [e for e in reg.entries() if e.strategy == "piecewise"]
    assert {(e.segments, e.breaks) for e in pieces} == {(CFG.layers + 1, CFG.layers)}
    assert all(e.key.num_reqs is None for e in pieces), "piecewise keys are relaxed"
    # One dynamic trace serves every size, the full entries' too: size 1 is not specialised, and the
    # size checks inside a split (SDPA's, for one query row) add no guards.
    assert len(compiled.compiler.traces) == 1
    assert compiled.compiler.pieces == CFG.layers + 1
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in (B.decode(1), B.decode(5), B(13, 4), B(16, 8), B(3, 3), B(1, 1, uniform=False)):
            inputs = random_batch(CFG, batch, device_of(backend), g)
            got = reg.run(batch, **inputs)
            want_strategy = "full" if batch.uniform else "piecewise"
            assert reg.match(batch).strategy == want_strategy, batch
            torch.testing.assert_close(got, inline(batch, **inputs), rtol=1e-4, atol=1e-4)
    assert reg.stats().misses == 0


@torch.library.custom_op("cgregistry_test::host_len_attention", mutates_args=("out",))
def host_len_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """Attention of row r over the first L[r] cached positions, L a host list from the engine's payload."""
    batch = cg.current_batch()
    lens = batch.payload["lens"] if batch is not None and batch.payload else [CTX] * q.shape[0]
    for r in range(q.shape[0]):
        length = lens[r] if r < len(lens) else CTX
        scores = (k[r, :length] @ q[r]).softmax(0)
        out[r].copy_(scores @ v[r, :length])


@host_len_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    return None


class CustomOpModel(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_in = nn.Parameter(torch.randn(D, D, generator=g))
        self.w_out = nn.Parameter(torch.randn(D, D, generator=g))
        self.register_buffer("k", torch.randn(MAX_TOKENS, CTX, D, generator=g))
        self.register_buffer("v", torch.randn(MAX_TOKENS, CTX, D, generator=g))
        self.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.tanh(x @ self.w_in)
        out = torch.empty_like(q)
        torch.ops.cgregistry_test.host_len_attention(q, self.k[: q.shape[0]], self.v[: q.shape[0]], out)
        return (out + q) @ self.w_out


@pytest.mark.parametrize("name", [False, True], ids=["op", "op-name"])
def test_custom_op_split_reads_the_live_host_lengths(backend: str, name: bool) -> None:
    device = device_of(backend)
    model = CustomOpModel(device)
    op = "cgregistry_test::host_len_attention" if name else torch.ops.cgregistry_test.host_len_attention
    reg = cg.GraphRegistry(lambda b, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend=backend, plugins=make_plugins())
    compiled = reg.compile(model, splitting_ops=[op])
    reg.capture([(B(n), "piecewise") for n in (16, 8, 4, 2)])
    assert {(e.segments, e.breaks) for e in reg.entries()} == {(2, 1)}
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for reqs in (1, 3, 7, 16):
            lens = torch.randint(1, CTX + 1, (reqs,), generator=g).tolist()
            x = torch.randn(reqs, D, generator=g).to(device)
            got = reg.run(B(reqs, reqs, uniform=False), x=x, context={"lens": lens})
            with cg.eager_batch(B(reqs), {"lens": lens}):
                want = model(x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def plain_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) * x


class TwoSplits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = plain_scale(x + 1)
        return self.gate(y * 2) - 1


@pytest.mark.parametrize("ops", [[plain_scale], [Gate], [plain_scale, Gate]], ids=["function", "module-type", "both"])
def test_functions_and_module_types_split(backend: str, ops: list[object]) -> None:
    device = device_of(backend)
    model = TwoSplits()
    reg = cg.GraphRegistry(lambda b, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend=backend, plugins=make_plugins())
    compiled = reg.compile(model, splitting_ops=ops)
    reg.capture([(B(n), "piecewise") for n in (16, 4)])
    assert {e.breaks for e in reg.entries()} == {len(ops)}
    x = torch.randn(3, D, device=device)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(3, 2), x=x), model(x))


def test_specialising_size_one_traces_again_and_stays_correct(backend: str) -> None:
    reg, inline, _, compiled = demo_registry(backend, specialize_size_one=True)
    reg.capture([(B(n), "piecewise") for n in (8, 4, 1)])
    assert len(compiled.compiler.traces) == 2, "dynamo's default: sizes 0 and 1 get a trace of their own"
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for batch in (B.decode(1), B(7, 3)):
            inputs = random_batch(CFG, batch, device_of(backend), g)
            torch.testing.assert_close(reg.run(batch, **inputs), inline(batch, **inputs), rtol=1e-4, atol=1e-4)


def test_a_named_op_never_reached_is_an_error(backend: str) -> None:
    reg = cg.GraphRegistry(lambda b, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend=backend, plugins=make_plugins())
    compiled = reg.compile(TwoSplits(), splitting_ops=[plain_scale, "cgregistry_test::host_len_attention"])
    with pytest.raises(cg.CaptureError, match=r"host_len_attention'\] never reached"):
        reg.capture([(B(8), "piecewise")])
    assert reg.entries() == []


def test_no_splitting_op_at_all_is_an_error(backend: str) -> None:
    reg = cg.GraphRegistry(lambda b, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend=backend, plugins=make_plugins())
    compiled = reg.compile(lambda x: x * 2 + 1)
    with pytest.raises(cg.CaptureError, match="no splitting op was reached.*eager_break"):
        reg.capture([(B(8), "piecewise")])


def test_an_untraceable_model_names_the_place_and_suggests_breakable(backend: str) -> None:
    def untraceable(x: torch.Tensor) -> torch.Tensor:
        rows = x.sum(-1).tolist()  # host values drive Python: dynamo cannot keep one graph
        return x * (1.0 if rows[0] > 0 else 2.0)

    reg = cg.GraphRegistry(lambda b, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend=backend, plugins=make_plugins())
    compiled = reg.compile(untraceable)
    with pytest.raises(cg.CaptureError) as info:
        reg.capture([(B(8), "piecewise")])
    text = str(info.value)
    assert "dynamo cannot trace" in text and "'breakable'" in text and "test_piecewise.py" in text


def test_retracing_beyond_the_bound_is_an_error(backend: str) -> None:
    shift = {"mode": "a"}

    @cg.eager_break
    def ident(x: torch.Tensor) -> torch.Tensor:
        return x + 0

    def model(x: torch.Tensor) -> torch.Tensor:
        return ident(x) + len(shift["mode"])  # a Python string dynamo guards on

    reg = cg.GraphRegistry(lambda b, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend=backend, plugins=make_plugins())
    compiled = reg.compile(model, max_traces=2)
    reg.capture([(B(8), "piecewise")])
    shift["mode"] = "bb"
    reg.capture([(B(4), "piecewise")])
    shift["mode"] = "ccc"
    with pytest.raises(cg.CaptureError, match=r"traced 3 times, over the bound of max_traces=2"):
        reg.capture([(B(2), "piecewise")])
    assert len(reg.entries()) == 2


def test_piecewise_without_a_compiled_model_is_an_error(backend: str) -> None:
    @cg.eager_break
    def brk(x: torch.Tensor) -> None:
        return None

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        brk(x)
        return x + 1

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend, plugins=make_plugins())
    with pytest.raises(cg.CaptureError, match="compile_piecewise"):
        reg.capture([(B(8), "piecewise")])
    reg.capture([(B(8), "breakable")])  # the same step is fine without a trace
    assert reg.entries()[0].strategy == "breakable"


@pytest.mark.parametrize(
    "ops, error",
    [("attention", "not a custom op name"), ([42], "is not a torch custom op"), ("x::y", "must be a sequence")],
)
def test_bad_splitting_ops_are_named(ops: object, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        cg.strategies.compiler.PiecewiseCompiler([ops] if ops == "attention" else ops)


def test_inductor_pieces_refuse_the_cpu_emulator() -> None:
    reg = cg.GraphRegistry(lambda b, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu", plugins=make_plugins())
    compiled = reg.compile(TwoSplits(), splitting_ops=[plain_scale], inductor=True)
    with pytest.raises(cg.CaptureError, match="cannot record Inductor kernels"):
        reg.capture([(B(8), "piecewise")])
    assert reg.entries() == []


@pytest.mark.cuda
def test_inductor_pieces_on_cuda_match_eager() -> None:
    reg, inline, _, compiled = demo_registry("cuda", inductor=True)
    reg.capture([(B(n), "piecewise") for n in (32, 16, 8, 1)])
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in (B(13, 4), B.decode(1), B(32, 8)):
            inputs = random_batch(CFG, batch, "cuda", g)
            torch.testing.assert_close(reg.run(batch, **inputs), inline(batch, **inputs), rtol=1e-3, atol=1e-3)
    # Inductor's code generation assumes sizes are not 1 (32-bit indexing, strides); those assumptions are
    # not guards, so size 1 runs the same kernels: one trace.
    assert len(compiled.compiler.traces) == 1


class _RotaryLike(nn.Module):
    """What Hugging Face models do: a module argument to the attention function, a same-device
    ``.to(dtype=..., device=x.device)`` of a buffer, and a 4-D mask with size-1 axes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.scale = 0.5
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, D, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freq = self.inv_freq[None, :].to(dtype=torch.float32, device=x.device)  # dynamo spells device(type='cpu')
        h = self.proj(x[None]) * freq.cos()  # (1, T, D): a batch of one sequence
        mask = torch.ones(1, 1, h.shape[1], h.shape[1], dtype=torch.bool, device=x.device).tril()
        return _module_attention(self, h, mask)[0]


@cg.eager_break
def _module_attention(module: nn.Module, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An eager break that takes the calling module, as transformers' attention interface does."""
    scores = (h @ h.transpose(1, 2) * module.scale).masked_fill(~mask[0], float("-inf"))
    return scores.softmax(-1) @ h


def test_hugging_face_shaped_model_captures_piecewise_on_cpu() -> None:
    model = _RotaryLike()
    reg = cg.GraphRegistry(lambda batch, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
    compiled = reg.compile(model)
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=MAX_TOKENS, mode="piecewise"))
    assert len(compiled.compiler.traces) == 1, "one trace: only the token axis is symbolic, the size-1 axes stay static"
    assert compiled.compiler.pieces == 2
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for tokens in (1, 5, 16):
            batch = B(tokens, 1)
            x = torch.randn(tokens, D, generator=g)
            got = reg.run(batch, x=x)
            with cg.eager_batch(batch):
                want = model(x)
            torch.testing.assert_close(got, want)
    assert reg.stats().hits == 3 and len(compiled.compiler.traces) == 1


def test_full_keys_run_the_model_unsplit() -> None:
    """A full key has no reason to be split: without Inductor its graph is the model's own ops, and no trace is made."""
    reg, inline, _, compiled = demo_registry("cpu")
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=32, mode="full"))
    assert compiled.compiler.traces == [], "full keys alone never trace the model"
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for batch in (B.decode(3), B(13, 4)):
            inputs = random_batch(CFG, batch, torch.device("cpu"), g)
            torch.testing.assert_close(reg.run(batch, **inputs), inline(batch, **inputs), rtol=1e-4, atol=1e-4)
    assert reg.stats().hits == 2


class _Scaled(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("factor", torch.tensor(factor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_scale_by(self, x))


@cg.eager_break
def _scale_by(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * layer.factor


def _scaled_registry(forward: object) -> cg.GraphRegistry:
    reg = cg.GraphRegistry(lambda batch, x: compiled(x), {"x": cg.StaticInput((8, 4), torch.float32)}, backend="cpu")
    compiled = reg.compile(forward)
    reg.capture([(B(8), "piecewise")])
    return reg


def test_a_copied_model_breaks_with_its_own_module() -> None:
    import copy

    original = _Scaled(1.0).eval()
    _scaled_registry(original)
    replica = copy.deepcopy(original)  # carries the original's handle attribute
    replica.factor.fill_(100.0)
    reg = _scaled_registry(replica)
    x = torch.ones(3, 4)
    with torch.inference_mode():
        got = reg.run(B(3), x=x)
        with cg.eager_batch(B(3)):
            torch.testing.assert_close(got, replica(x))


def test_modules_reached_through_an_engine_object() -> None:
    class Engine:
        def __init__(self) -> None:
            self.model = _Scaled(2.0)

    engine = Engine()
    reg = _scaled_registry(lambda x: engine.model(x))  # the closure holds the engine, not the module
    x = torch.ones(2, 4)
    with torch.inference_mode():
        got = reg.run(B(2), x=x)
        with cg.eager_batch(B(2)):
            torch.testing.assert_close(got, engine.model(x))


def test_unreachable_module_is_a_clear_error() -> None:
    hidden = {"m": _Scaled(3.0)}
    def lookup() -> nn.Module:
        return hidden["m"]
    reg = cg.GraphRegistry(lambda batch, x: compiled(x), {"x": cg.StaticInput((8, 4), torch.float32)}, backend="cpu")
    compiled = reg.compile(lambda x: lookup()(x))
    with pytest.raises(cg.CaptureError, match="nn.Module the piecewise compiler cannot reach.*register_modules"):
        reg.capture([(B(8), "piecewise")])


def _warm_up_as(compiled: cg.PiecewiseModel, strategy: object, key: B, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Call ``compiled`` as the registry's warm-up of ``key`` with ``strategy`` does (no capture: Inductor's kernels
    can run on the cpu, which the emulator cannot record)."""
    from cgregistry.contracts import runtime

    tokens = (
        runtime.batch.set(runtime.BreakContext(key, key)),
        runtime.axis_rows.set(frozenset(v.shape[0] for v in inputs.values()) | {key.num_tokens}),
        runtime.capture_strategy.set(strategy),
    )
    try:
        with torch.inference_mode():
            return compiled(**{name: value.clone() for name, value in inputs.items()})  # like static buffers: one kind of tensor
    finally:
        for var, token in zip((runtime.capture_strategy, runtime.axis_rows, runtime.batch), reversed(tokens)):
            var.reset(token)


def test_one_inductor_compile_serves_full_and_piecewise_keys_of_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Full keys run the piecewise trace's compiled pieces, splits inline; size 1 runs the general kernels: one trace,
    one Inductor pass over the pieces, nothing compiled again for a full key or another size."""
    from torch._inductor import compile_fx as inductor

    from cgregistry.strategies.full import FullStrategy
    from cgregistry.strategies.piecewise import PiecewiseStrategy

    compiled_graphs: list[torch.fx.GraphModule] = []
    real = inductor.compile_fx

    def counting(gm: torch.fx.GraphModule, *args: object, **kwargs: object) -> object:
        compiled_graphs.append(gm)
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", counting)
    _, inline, _, compiled = demo_registry("cpu", inductor=True)
    full, piecewise = FullStrategy(), PiecewiseStrategy()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    traces_after = []
    g = torch.Generator().manual_seed(4)
    for batch, strategy in ((B.decode(8), piecewise), (B.decode(8), full), (B.decode(1), full), (B(1, 1, uniform=False), piecewise),
                            (B(13, 4), piecewise), (B.decode(5), full)):
        inputs = random_batch(CFG, batch, "cpu", g)
        got = _warm_up_as(compiled, strategy, batch, inputs)
        with torch.inference_mode():
            torch.testing.assert_close(got, inline(batch, **inputs), rtol=1e-4, atol=1e-4)
        traces_after.append(len(compiled.compiler.traces))
    assert traces_after == [1] * 6, f"traces after each call: {traces_after}"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1, "full keys traced the model again"
    report = compiled.compiler.traces[0]
    # Three layers, attention split out: the first piece (embedding, layer 0 up to attention), two alike middle pieces
    # (a layer's rest and the next layer's start) and the last (the head): three forms, three compiles.
    assert (report.pieces, report.compiles, len(compiled_graphs)) == (4, 3, 3)


@cg.eager_break
def _written_cache_attention(q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    cache.index_copy_(0, slots, q)
    out.copy_(q + cache.sum(0))


class _CacheWriting(nn.Module):
    """Two layers, each writing its own cache in an eager break between two Inductor pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.register_buffer("caches", torch.zeros(2, 32, D))

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        h = self.w[0](x)
        for layer in range(2):
            out = torch.empty_like(h)
            _written_cache_attention(h, self.caches[layer], slots, out)
            h = self.w[layer + 1](out).relu()
        return h


def test_a_full_key_over_inductor_pieces_writes_the_cache_its_break_writes() -> None:
    """A break that writes a KV cache in place stays out of Inductor for full keys too: the full key runs the
    compiled pieces with the break inline, the cache is written where the break writes it, nothing else moves."""
    from cgregistry.strategies.full import FullStrategy
    from cgregistry.strategies.piecewise import PiecewiseStrategy

    torch.manual_seed(0)
    model, reference = _CacheWriting().eval(), _CacheWriting().eval()
    reference.load_state_dict(model.state_dict())
    compiled = cg.compile_piecewise(model, inductor=True)
    written: set[int] = set()
    for key, strategy in ((B.decode(8), PiecewiseStrategy()), (B.decode(4), FullStrategy()), (B.decode(1), FullStrategy())):
        x, slots = torch.randn(key.num_tokens, D), torch.randperm(32)[: key.num_tokens]
        written |= set(slots.tolist())
        got = _warm_up_as(compiled, strategy, key, {"x": x, "slots": slots})
        with torch.inference_mode():
            want = reference(x, slots)
            torch.testing.assert_close(got, want, msg=f"{key} {strategy.name}")
        torch.testing.assert_close(model.caches, reference.caches, msg=f"{key} {strategy.name}")
        rows = set(model.caches.abs().sum((0, 2)).nonzero().flatten().tolist())
        assert rows == written, f"{key} {strategy.name}: cache rows written {sorted(rows)}, slots given {sorted(written)}"


@cg.eager_break
def _branching_attention(q: torch.Tensor, req_idx: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor) -> None:
    """A backend's host-side dispatch: decode (one token per request) and varlen paths, chosen by sizes."""
    if q.shape[0] == seq_lens.shape[0]:
        out.copy_(q * seq_lens[:, None])
    else:
        out.copy_(q * seq_lens[req_idx][:, None])


@cg.eager_break
def _doubling(q: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q * 2)


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, req_idx: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        out = torch.empty_like(h)
        _branching_attention(h, req_idx, seq_lens, out)
        return self.w2(out)


class _Squeezing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(h := self.w(x))
        _doubling(h, out)
        return out.squeeze(0).softmax(0).reshape(-1)  # one token: softmax over features; more: over tokens


def test_full_keys_over_inductor_pieces_take_each_sizes_own_host_side_branch() -> None:
    """Full keys run an eager break's host-side code at their own sizes (spec decode after decode takes the other
    branch), and a model that behaves differently at size 1 (a squeeze of the token axis) does not run general
    kernels at size 1, for full and piecewise keys alike."""
    from cgregistry.strategies.full import FullStrategy
    from cgregistry.strategies.piecewise import PiecewiseStrategy

    torch.manual_seed(0)
    branching = _Branching().eval()
    compiled = cg.compile_piecewise(branching, inductor=True)
    for key, strategy in ((B.decode(8), PiecewiseStrategy()), (B.decode(8), FullStrategy()),
                          (B.decode(4, spec_depth=1), PiecewiseStrategy()), (B.decode(4, spec_depth=1), FullStrategy())):
        t, r = key.num_tokens, key.num_reqs
        inputs = {"x": torch.randn(t, D), "req_idx": torch.arange(r).repeat_interleave(t // r), "seq_lens": torch.arange(1.0, r + 1)}
        got = _warm_up_as(compiled, strategy, key, inputs)
        with torch.inference_mode():
            torch.testing.assert_close(got, branching(**inputs), msg=f"{key} {strategy.name}")
    squeezing = _Squeezing().eval()
    compiled = cg.compile_piecewise(squeezing, inductor=True)
    for key, strategy in ((B.decode(8), PiecewiseStrategy()), (B.decode(8), FullStrategy()), (B.decode(1), FullStrategy()),
                          (B.decode(1), PiecewiseStrategy())):
        x = torch.randn(key.num_tokens, D)
        got = _warm_up_as(compiled, strategy, key, {"x": x})
        with torch.inference_mode():
            torch.testing.assert_close(got, squeezing(x), msg=f"{key} {strategy.name}")




class _Slicing(nn.Module):
    """A forward that builds a module while it runs (``layers[:n]`` makes a ModuleList), as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:2]:
            x = torch.tanh(layer(plain_scale(x)))
        return x


def test_watching_another_module_does_not_make_the_model_trace_again() -> None:
    """The weight watch's registration hook runs inside the trace when the forward builds a module: it must not
    leave a guard on which modules are watched (a drafter's registry, an adapter loaded later)."""
    model = _Slicing().eval()
    reg = cg.GraphRegistry(lambda batch, x: compiled(x), {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
    compiled = reg.compile(model, splitting_ops=[plain_scale])
    reg.watch(model)
    reg.capture([(B(8), "piecewise")])
    other = cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((MAX_TOKENS, D), torch.float32)}, backend="cpu")
    other.watch(nn.Linear(D, D))
    reg.capture([(B(4), "piecewise")])
    assert len(compiled.compiler.traces) == 1, "the trace guarded on the watched modules"
    x = torch.randn(5, D)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B(5), x=x), model(x))


def test_a_model_that_differs_at_size_one_called_directly_matches_eager_at_every_size() -> None:
    """Outside a registry dynamo may first trace size 1 dynamically: that trace serves size 1 only, and its pieces
    run torch's own ops there, not general kernels that squeeze nothing."""
    torch.manual_seed(0)
    squeezing = _Squeezing().eval()
    compiled = cg.compile_piecewise(squeezing, inductor=True)
    with torch.inference_mode():
        for tokens in (8, 1, 4, 1):
            x = torch.randn(tokens, D)
            torch.testing.assert_close(compiled(x), squeezing(x), msg=f"{tokens} tokens")
