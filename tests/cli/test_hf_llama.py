"""A Hugging Face Llama through the registry (examples/hf_llama.py): engine state and outputs, as a server sees them.

The example itself runs every mode and checks every logit against HF's forward (tests/test_examples.py);
these tests pin what an engine relies on besides the numbers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from tests.example_modules import load_example

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

hf = load_example("hf_llama.py")

SHAPE = hf.EngineShape(max_num_seqs=4, max_num_tokens=16, block_size=4, max_blocks_per_req=4)
CPU = torch.device("cpu")


@pytest.mark.parametrize("mode", ["full", "full_and_breakable", "full_and_piecewise"])
def test_capture_writes_only_the_scratch_slot(mode: str) -> None:
    """Warm-up and capture run the model, which writes K/V: only at the scratch slot, also while dynamo traces."""
    model = hf.build_model("tiny", CPU, SHAPE)
    for layer in model.model.layers:
        layer.self_attn.k_cache.fill_(7.0)  # a live server's cache
    reg = hf.build_registry(model, SHAPE, mode, "cpu")
    assert len(reg) > 0
    scratch = SHAPE.scratch_slot
    for layer in model.model.layers:
        cache = layer.self_attn.k_cache
        others = torch.ones(cache.shape[0], dtype=torch.bool)
        others[scratch] = False
        assert cache[others].eq(7.0).all(), "no request's slot was written by capture"
        assert not cache[scratch].eq(7.0).all(), "capture did run the step (it wrote the scratch slot)"


def test_modes_serve_the_trace_like_hugging_face() -> None:
    for mode in ("full_and_piecewise", "none"):
        result, reg = hf.serve("tiny", mode, device=CPU, shape=SHAPE, requests=6, max_prompt=12, max_new=4, backend="cpu")
        assert len(result.finished) == 6 and all(s.generated == s.max_new for s in result.finished)
        assert result.max_abs_error < 1e-4, mode
        if reg is not None:
            stats = reg.stats()
            assert stats.hits == result.steps and stats.misses == 0
            assert {e.strategy for e in reg.entries(used=True)} == {"full", "piecewise"}


def test_debug_mode_catches_logits_kept_past_the_next_run() -> None:
    """The engine's bug to avoid: keeping a view of graph memory (``.float().cpu()`` is no copy on CPU)."""
    model = hf.build_model("tiny", CPU, SHAPE)
    reg = cg.GraphRegistry(hf.make_step(model, hf.decoder(model)), hf.static_inputs(SHAPE), backend="cpu",
                           output_axis=hf.OUTPUT_AXES, debug=True)
    reg.capture([(cg.BatchDescriptor.decode(2), "full")])

    def inputs(position: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.tensor([1, 2]), "positions": torch.tensor([position, position]),
            "slot_mapping": torch.tensor([position, 4 + position]), "query_start_loc": torch.tensor([0, 1, 2]),
            "seq_lens": torch.tensor([position + 1] * 2), "block_table": torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0]]),
            "logits_indices": torch.tensor([0, 1]),
        }

    with torch.inference_mode():
        kept = reg.run(cg.BatchDescriptor.decode(2), **inputs(0))["logits"][0].float().cpu()
        reg.run(cg.BatchDescriptor.decode(2), **inputs(1))
        with pytest.raises(cg.StaleOutputError):
            kept.sum()


@pytest.mark.parametrize(("argv", "message"), [
    (["--requests", "-3"], "argument --requests: expected an integer >= 1, got -3"),
    (["--requests", "many"], "argument --requests: expected an integer >= 1, got 'many'"),
    (["--device", "gpu"], "argument --device: expected a torch device such as cpu, cuda or cuda:1, got 'gpu'"),
    (["--device", "cpu", "--gpu-memory-utilization", "1.5"],
     "argument --gpu-memory-utilization: expected a share of the GPU's memory, 0 < F <= 1, got 1.5"),
    (["--device", "cpu", "--gpu-memory-utilization", "0.5"],
     "argument --gpu-memory-utilization: needs a CUDA device (device memory to share), got 'cpu'"),
])
def test_bad_arguments_are_named_before_any_work(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        hf.main(argv)
    assert exit_.value.code == 2
    assert f": error: {message}\n" in capsys.readouterr().err


def test_cuda_without_cuda_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        hf.main(["--device", "cuda"])
    assert exit_.value.code == 2
    assert f"argument --device: 'cuda', but this torch ({torch.__version__}) sees no CUDA device; use --device cpu" in capsys.readouterr().err


def test_long_stages_report_progress_and_quick_ones_stay_quiet(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    progress = hf.Progress("full", after=5.0, every=10.0)
    clock = iter([0.0, 1.0, 2.0, 20.0, 25.0, 40.0])  # begin, then five updates
    monkeypatch.setattr(hf.time, "perf_counter", lambda: next(clock))
    progress.begin("serving 4 requests")
    for step in range(1, 6):
        progress.update(f"step {step}")
    monkeypatch.undo()
    assert capsys.readouterr().err.splitlines() == ["[full] serving 4 requests: step 3 (20 s)", "[full] serving 4 requests: step 5 (40 s)"]


def test_the_kv_cache_gets_what_the_estimated_graphs_leave() -> None:
    """The recipe of --gpu-memory-utilization (docs/integration.md): the model on its smallest cache, the plan
    estimated, the cache given what the budget leaves (never more than every request needs), a clear error where the
    budget leaves too little; nothing is captured before the cache has its final address."""
    small = hf.EngineShape(4, 16, 4, 4, kv_blocks=SHAPE.min_blocks)
    model = hf.build_model("tiny", CPU, small)
    reg, plan = hf.new_registry(model, small, "full", "cpu")
    for layer in model.model.layers:
        layer.self_attn.k_cache.fill_(7.0)  # a live server's cache
    estimate = reg.estimate_memory(plan)
    assert len(reg) == 0 and estimate.capture_bytes > 0
    for layer in model.model.layers:
        cache, others = layer.self_attn.k_cache, torch.ones(layer.self_attn.k_cache.shape[0], dtype=torch.bool)
        others[small.scratch_slot] = False
        assert cache[others].eq(7.0).all() and not cache[small.scratch_slot].eq(7.0).all(), "the probes wrote the scratch slot only"
    per_block = hf.kv_block_bytes(model, small)
    sized = hf.size_kv_cache(model, small, estimate.capture_bytes + 7 * per_block + per_block // 2, estimate)
    assert sized.num_blocks == 7 and model.model.layers[0].self_attn.k_cache.shape[0] == 7 * small.block_size
    assert hf.size_kv_cache(model, small, 10**12, estimate).num_blocks == SHAPE.num_blocks == 17, "capped at what every request needs"
    with pytest.raises(ValueError, match=r"leaves room for 4 blocks of .* the engine needs at least 5 \(raise the memory"):
        hf.size_kv_cache(model, small, estimate.capture_bytes + 4 * per_block, estimate)
    with pytest.raises(ValueError, match=r"kv_blocks=3: the cache needs at least 5 blocks"):
        hf.EngineShape(4, 16, 4, 4, kv_blocks=3)


def test_an_engine_on_a_cache_sized_by_the_estimate_serves_like_hugging_face() -> None:
    """serve() on a budget that leaves room for two requests at a time: graphs captured after the cache was sized,
    the scheduler waits for blocks, every request finishes, every logit equals HF's forward."""
    model = hf.build_model("tiny", CPU, hf.EngineShape(4, 16, 4, 4, kv_blocks=SHAPE.min_blocks))
    reg, plan = hf.new_registry(model, SHAPE, "full_and_breakable", "cpu")
    graphs = reg.estimate_memory(plan).capture_bytes
    budget = graphs + 9 * hf.kv_block_bytes(model, SHAPE)  # the scratch block and two requests of four blocks
    result, reg = hf.serve("tiny", "full_and_breakable", device=CPU, shape=SHAPE, requests=6, max_prompt=12, max_new=4,
                           backend="cpu", graph_and_kv_bytes=budget)
    assert reg is not None and reg.stats().hits > 0
    assert len(result.finished) == 6 and all(s.generated == s.max_new for s in result.finished)
    assert result.max_abs_error < 1e-4
    assert max(b for s in result.finished for b in s.blocks) == 8, "only the nine blocks the budget left were used"


@pytest.mark.parametrize("mode", ["full", "full_and_breakable"])
def test_an_engine_that_captures_first_and_backs_its_cache_after_serves_like_hugging_face(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve(..., capture_first=True): no estimate; every layer's cache reserved with its scratch block backed, the
    plan captured, then the cache backed with what the budget leaves after the graphs (two requests at a time): every
    request finishes at the addresses the graphs baked in, every logit equals HF's forward."""
    import cgregistry.kvcache.reserved as reserved

    monkeypatch.setattr(reserved, "CPU_GRANULARITY", 64)  # the tiny model's blocks are a few KiB
    model = hf.build_model("tiny", CPU, SHAPE)
    per_block = hf.kv_block_bytes(model, SHAPE)
    reg = hf.build_registry(model, SHAPE, mode, "cpu")
    budget = reg.memory_bytes() + 9 * per_block + per_block // 2  # the scratch block and two requests of four blocks
    estimated: list[object] = []
    monkeypatch.setattr(cg.GraphRegistry, "estimate_memory", lambda *a, **k: estimated.append(a))
    result, reg = hf.serve("tiny", mode, device=CPU, shape=SHAPE, requests=6, max_prompt=12, max_new=4, backend="cpu",
                           graph_and_kv_bytes=budget, capture_first=True)
    assert estimated == [] and reg is not None and reg.stats().hits > 0 and reg.failures() == {}
    assert len(result.finished) == 6 and all(s.generated == s.max_new for s in result.finished)
    assert result.max_abs_error < 1e-4
    assert max(b for s in result.finished for b in s.blocks) == 8, "only the nine blocks the budget left were used"
    assert len(result.kv_reserved) == 2 * len(hf.build_model("tiny", CPU, SHAPE).model.layers)
    for memory in result.kv_reserved:
        assert memory.backed_bytes >= 9 * per_block // len(result.kv_reserved)
        memory.check_unbacked()  # nothing written past what was backed (on CUDA, a fault)
    with pytest.raises(ValueError, match=r"capture_first sizes the KV cache after a foreground capture"):
        hf.serve("tiny", mode, device=CPU, shape=SHAPE, requests=1, max_prompt=4, max_new=1, backend="cpu",
                 graph_and_kv_bytes=budget, capture_first=True, background=True)


@pytest.mark.parametrize("mode", ["full", "full_and_breakable", "full_and_piecewise"])
def test_background_capture_while_serving_then_the_hf_check(mode: str) -> None:
    """Capture on the capture thread while the engine serves, piecewise-compiled steps included, every key of the plan
    captured; the HF check (which switches the model's attention to SDPA) waits for the capture, so no key is captured
    through HF's attention (it failed as graph-unsafe before)."""
    result, reg = hf.serve("tiny", mode, device=CPU, shape=SHAPE, requests=6, max_prompt=12, max_new=4, backend="cpu",
                           background=True)
    assert reg is not None and reg.failures() == {} and reg.pending() == [] and reg.capturing() == []
    assert len(result.finished) == 6 and result.max_abs_error < 1e-4
    plan = cg.CapturePlan.build(max_num_seqs=SHAPE.max_num_seqs, max_num_tokens=SHAPE.max_num_tokens,
                                max_capture_size=SHAPE.max_num_tokens, mode=mode)
    assert len(reg) == len(plan) > 0, "every key of the plan captured"


def _as_warm_up_of(key: cg.BatchDescriptor, strategy: object, call: object) -> object:
    """``call()`` as a registry's warm-up of ``key`` with ``strategy`` runs the step (no capture: the cpu emulator
    cannot record Inductor's kernels)."""
    from cgregistry.contracts import runtime

    tokens = (runtime.batch.set(runtime.BreakContext(key, key)),
              runtime.axis_rows.set(frozenset({key.num_tokens, key.num_tokens + 1})), runtime.capture_strategy.set(strategy))
    try:
        with torch.inference_mode():
            return call()  # type: ignore[operator]
    finally:
        for var, token in zip((runtime.capture_strategy, runtime.axis_rows, runtime.batch), reversed(tokens)):
            var.reset(token)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_attention_op_compiles_with_inductor_for_full_piecewise_and_reduce_overhead() -> None:
    """The attention op declares the caches it writes: the decoder compiles once with Inductor in pieces around it,
    full keys run those pieces with the op inline and piecewise keys with it between them, torch.compile's
    reduce-overhead takes the whole step, and each writes the K/V cache where eager writes it, HF's numbers."""
    from cgregistry.strategies.full import FullStrategy
    from cgregistry.strategies.piecewise import PiecewiseStrategy

    model, reference = hf.build_model("tiny", CPU, SHAPE), hf.build_model("tiny", CPU, SHAPE)
    compiled = cg.compile_piecewise(hf.decoder(model), inductor=True)
    plain = hf.build_model("tiny", CPU, SHAPE)
    reduce_overhead = torch.compile(hf.decoder(plain), mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for key, strategy in ((cg.BatchDescriptor.decode(4), FullStrategy()), (cg.BatchDescriptor.decode(3), PiecewiseStrategy()),
                          (cg.BatchDescriptor.decode(1), FullStrategy())):
        n = key.num_tokens
        table = 1 + torch.randperm(SHAPE.num_blocks - 1, generator=g)[: n * SHAPE.max_blocks_per_req].view(n, -1) % (SHAPE.num_blocks - 1)
        pos = torch.randint(0, SHAPE.max_context, (n,), generator=g)
        inputs = dict(input_ids=torch.randint(0, 256, (n,), generator=g), positions=pos,
                      slot_mapping=table.gather(1, (pos // SHAPE.block_size)[:, None])[:, 0] * SHAPE.block_size + pos % SHAPE.block_size,
                      query_start_loc=torch.arange(n + 1), seq_lens=pos + 1, block_table=table)
        got = _as_warm_up_of(key, strategy, lambda: compiled(**inputs))
        with torch.inference_mode():
            want = hf.decoder(reference)(**inputs)
            ro = reduce_overhead(**inputs).clone()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{key} {strategy.name}")
        torch.testing.assert_close(ro, want, rtol=1e-4, atol=1e-4, msg=f"{key} reduce-overhead")
        for ours, theirs, ros in zip(model.model.layers, reference.model.layers, plain.model.layers):
            for name in ("k_cache", "v_cache"):
                torch.testing.assert_close(getattr(ours.self_attn, name), getattr(theirs.self_attn, name), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(getattr(ros.self_attn, name), getattr(theirs.self_attn, name), rtol=1e-5, atol=1e-6)
    assert reference.model.layers[0].self_attn.k_cache.count_nonzero() > 0
    [report] = compiled.compiler.traces
    assert report.splits == ["cgregistry_hf::paged_attention"] * len(model.model.layers)


def test_a_decoder_built_before_the_cache_is_resized_attends_with_the_new_block_size() -> None:
    """The engine may build its step, then size the KV cache (another block size): the attention follows the cache."""
    before = hf.EngineShape(max_num_seqs=2, max_num_tokens=8, block_size=4, max_blocks_per_req=4)
    after = hf.EngineShape(max_num_seqs=2, max_num_tokens=8, block_size=8, max_blocks_per_req=2)
    model = hf.build_model("tiny", CPU, before)
    early = hf.decoder(model)
    hf.resize_kv_cache(model, after)
    positions, table = torch.arange(6), torch.tensor([[1, 2]])
    inputs = (torch.tensor([1, 2, 3, 4, 5, 6]), positions, table[0][positions // 8] * 8 + positions % 8,
              torch.tensor([0, 6]), torch.tensor([6]), table)
    with torch.no_grad():
        want = hf.decoder(model)(*inputs)
        for layer in model.model.layers:
            layer.self_attn.k_cache.zero_()
            layer.self_attn.v_cache.zero_()
        torch.testing.assert_close(early(*inputs), want)


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 7)), min_size=1, max_size=6))
@settings(max_examples=60, deadline=None)
def test_each_live_token_is_read_at_its_own_request_and_position(requests: list[tuple[int, int]]) -> None:
    """``HostBatch.token_rows``, which the varlen attention reads in every layer, against the plain per-request walk:
    a request of ``n`` new tokens after ``cached`` ones holds positions ``cached .. cached + n - 1``."""
    lens = [n for n, _ in requests]
    seq_lens = [n + cached for n, cached in requests]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    req, pos = hf.HostBatch(starts, lens, seq_lens).token_rows()
    expected = [(i, cached + k) for i, (n, cached) in enumerate(requests) for k in range(n)]
    assert list(zip(req.tolist(), pos.tolist())) == expected
    assert req.dtype == pos.dtype == torch.long


def test_the_token_rows_follow_lengths_changed_in_place() -> None:
    """An engine that keeps one ``HostBatch`` and updates its lists each step gets the rows of the lengths it holds."""
    host = hf.HostBatch([0, 2], [2, 1], [2, 5])
    assert [t.tolist() for t in host.token_rows()] == [[0, 0, 1], [0, 1, 4]]
    host.query_lens[1], host.seq_lens[1] = 2, 6
    assert [t.tolist() for t in host.token_rows()] == [[0, 0, 1, 1], [0, 1, 4, 5]]
