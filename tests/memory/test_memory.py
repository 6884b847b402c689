"""The memory ledger: estimate_memory() predicts per key what capture(plan) then takes, keeps nothing and
touches no engine state; plans and adaptation fit under a byte budget exactly; snapshots show predicted and actual bytes."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.capture.memory import MemoryEstimate, Probe
from tests.conftest import device_of
from tests.background.test_background import SCRATCH, Engine, make

PLAN = cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=64, mode="full")


def test_the_cpu_estimate_equals_what_capture_then_reports_key_by_key() -> None:
    engine = Engine()
    reg = make(engine)
    before = engine.cache.clone()
    estimate = reg.estimate_memory(PLAN)
    assert len(reg) == 0 and reg.stats().hits == 0 and reg.pending() == [] and reg.capturing() == [], "nothing kept"
    assert torch.equal(engine.cache[:SCRATCH], before[:SCRATCH]), "probes wrote only the scratch slot"
    assert [(k.key, k.strategy) for k in estimate.keys] == [(e.descriptor, e.strategy) for e in PLAN]
    assert all(k.probed for k in estimate.keys) and estimate.pool_bytes == estimate.warmup_bytes == 0
    reg.capture(PLAN)
    actual = {(e.key, e.strategy): e.device_bytes for e in reg.entries()}
    assert {(k.key, k.strategy): k.bytes for k in estimate.keys} == actual
    assert estimate.capture_bytes == sum(actual.values()) == reg.memory_bytes() > 0
    assert estimate.static_input_bytes == 2 * 64 * 8  # two long inputs of 64 rows
    assert estimate.total_bytes == estimate.capture_bytes + estimate.static_input_bytes
    assert all(e.predicted_bytes == actual[(e.key, e.strategy)] for e in reg.entries()), "entries show what was predicted"


@pytest.mark.parametrize("mode", ["full", "full_and_breakable"])
def test_a_sampled_estimate_captures_a_few_whole_graph_keys_and_prices_the_rest_close_to_the_capture(
    mode: str,
) -> None:
    """With ``sample=True`` the estimate captures a few whole-graph keys of each kind (the largest, the smallest, some
    between) and every key with eager work inside (breakable), and prices the rest from the sample: within 5% of
    what capture(plan) then takes, key by key within a tenth of the largest key."""
    plan = cg.CapturePlan.build(max_num_seqs=64, max_num_tokens=64, mode=mode, capture_sizes=[*range(1, 64, 2), 64])
    engine = Engine()
    seen: list[int] = []  # the token count of every step the estimate ran (warm-up, capture)
    step = engine.step
    engine.step = lambda batch, **inputs: (seen.append(batch.num_tokens), step(batch, **inputs))[1]  # type: ignore[method-assign]
    reg = make(engine)
    before = engine.cache.clone()
    estimate = reg.estimate_memory(plan, sample=True)
    assert torch.equal(engine.cache[:SCRATCH], before[:SCRATCH]), "the sampled captures wrote only the scratch slot"
    probed = {(k.key, k.strategy) for k in estimate.keys if k.probed}
    assert [(k.key, k.strategy) for k in estimate.keys] == [(e.descriptor, e.strategy) for e in plan]
    full = [(e.descriptor, e.strategy) for e in plan if e.strategy == "full"]
    assert len(full) > 2 * cg.capture.memory.SAMPLE_PER_FAMILY
    assert len([p for p in full if p in probed]) == cg.capture.memory.SAMPLE_PER_FAMILY, "a sample of the full keys"
    assert all(p in probed for e in plan for p in [(e.descriptor, e.strategy)] if e.strategy != "full"), "the rest each"
    tokens = [k.num_tokens for k, _ in full]
    assert {max(tokens), min(tokens)} <= {k.num_tokens for k, s in probed if s == "full"}
    assert set(seen) == {k.num_tokens for k, _ in probed}, "the estimate ran the probed keys and no other"
    reg.capture(plan)
    actual = {(e.key, e.strategy): e.device_bytes for e in reg.entries()}
    assert abs(estimate.capture_bytes - sum(actual.values())) <= 0.05 * sum(actual.values()), estimate.table()
    largest = max(actual.values())
    for k in estimate.keys:
        assert abs(k.bytes - actual[(k.key, k.strategy)]) <= 0.1 * largest, (k, actual[(k.key, k.strategy)])


def test_the_estimate_keeps_no_graph_alive_once_it_returns() -> None:
    """Every scratch graph is dropped before the estimate measures what it left (a graph kept alive would hold its pool,
    counted as left behind and taken off the prediction), and its steps wrote the KV cache at the scratch slot only."""
    from cgregistry.store.catalog import Entry

    def alive() -> int:
        gc.collect()
        return sum(type(o) is Entry for o in gc.get_objects())

    engine = Engine()
    reg = make(engine)
    cache = engine.cache.clone()
    before = alive()
    assert reg.estimate_memory(PLAN).capture_bytes > 0
    assert alive() == before, "a scratch entry outlived the estimate"
    assert torch.equal(engine.cache[:SCRATCH], cache[:SCRATCH]), "the scratch captures wrote outside the scratch slot"


def test_an_estimate_whose_capture_fails_keeps_nothing_while_its_error_is_held() -> None:
    """A key that fails to capture mid-plan: the error reaches the caller, and the keys captured before it are already
    dropped while the caller still holds the error (whose traceback keeps the estimate's frames)."""
    from cgregistry.store.catalog import Entry

    engine = Engine()
    failing = PLAN.entries[len(PLAN.entries) // 2].descriptor

    def step(batch: B, **inputs: torch.Tensor) -> torch.Tensor:
        if batch == failing:
            raise RuntimeError(f"no graph for {batch}")
        return plain(batch, **inputs)

    engine.step, plain = step, engine.step  # type: ignore[method-assign]
    reg = make(engine)
    gc.collect()
    before = sum(type(o) is Entry for o in gc.get_objects())
    with pytest.raises(cg.CaptureError, match="no graph for") as caught:
        reg.estimate_memory(PLAN)
    gc.collect()
    assert caught.value is not None and sum(type(o) is Entry for o in gc.get_objects()) == before
    assert len(reg) == 0 and reg.stats().hits == 0


def test_an_estimate_of_keys_then_captured_between_steps_and_of_keys_already_held() -> None:
    reg = make(Engine())
    reg.capture(PLAN.entries[:3])
    estimate = reg.estimate_memory(PLAN)
    assert {(k.key, k.strategy) for k in estimate.keys} == {(e.descriptor, e.strategy) for e in PLAN.entries[3:]}, "held keys excluded"
    reg.capture(PLAN, background=True)
    assert reg.wait_captured()
    captured = {(e.key, e.strategy): e.device_bytes for e in reg.entries()}
    assert all(k.bytes == captured[(k.key, k.strategy)] for k in estimate.keys)


def test_the_estimate_is_a_typed_record_with_a_table_and_json() -> None:
    estimate = make(Engine()).estimate_memory(PLAN)
    assert isinstance(estimate, MemoryEstimate)
    text = estimate.table()
    assert text.splitlines()[0].split()[:3] == ["key", "strategy", "bytes"] and f"{len(PLAN)} keys on cpu" in text
    data = json.loads(json.dumps(estimate.to_dict()))
    assert data["capture_bytes"] == estimate.capture_bytes and len(data["keys"]) == len(PLAN)


def test_snapshots_and_inspect_show_predicted_and_actual_bytes_per_key(tmp_path: object) -> None:
    reg = make(Engine())
    estimate = reg.estimate_memory(PLAN)
    reg.capture(PLAN)
    snap = cg.load_snapshot(reg.snapshot())
    assert snap.schema == 5
    predicted = {(k.key, k.strategy): k.bytes for k in estimate.keys}
    assert all(e.predicted_bytes == predicted[(e.key, e.strategy)] and e.device_bytes == e.memory_bytes for e in snap.entries)
    assert "predicted" in reg.table().splitlines()[0]


def test_bad_estimate_calls_are_refused_like_capture() -> None:
    reg = make(Engine())
    with pytest.raises(ValueError, match="needs 65 tokens"):
        reg.estimate_memory([(B.decode(65), "full")])
    with pytest.raises(TypeError, match=r"estimate_memory\(sample=...\) takes a bool"):
        reg.estimate_memory(PLAN, sample=None)  # type: ignore[arg-type]


# ---------------------------------------------------------------- fitting under bytes


class Priced:
    """A price list: every key costs ``per_key`` beside ``fixed`` bytes (what a memory estimate says)."""

    def __init__(self, per_key: int, fixed: int) -> None:
        self.per_key, self.fixed = per_key, fixed

    def key_bytes(self, key: B, strategy: str) -> int:
        return self.per_key

    def fixed_bytes(self) -> int:
        return self.fixed


STEPS = [B.decode(n) for n in (1, 3, 3, 5, 9, 9, 9, 13, 20, 31, 33, 40, 47, 60)] + [B(37, 4), B(22, 3)]
SETTINGS = dict(max_num_seqs=64, max_num_tokens=64, mode="full_and_breakable")


@pytest.mark.parametrize("graphs", [2, 3, 5, 8, 12])
def test_a_byte_budget_fits_exactly_as_the_graph_budget_it_buys(graphs: int) -> None:
    """With every key at one price, max_bytes buys floor((max_bytes - fixed) / price) graphs: the same plan."""
    prices = Priced(per_key=3 << 20, fixed=100 << 20)
    by_bytes = cg.CapturePlan.fit(STEPS, None, max_bytes=prices.fixed + graphs * prices.per_key + (1 << 20), memory=prices, **SETTINGS)
    by_count = cg.CapturePlan.fit(STEPS, graphs, **SETTINGS)
    assert by_bytes == by_count
    assert prices.fixed + len(by_bytes) * prices.per_key <= prices.fixed + graphs * prices.per_key + (1 << 20)


def test_the_byte_budget_buys_fewer_of_the_dearer_keys() -> None:
    class Dear(Priced):
        def key_bytes(self, key: B, strategy: str) -> int:
            return self.per_key * (4 if strategy == "breakable" else 1)  # segments: more graph objects

    prices = Dear(per_key=1 << 20, fixed=0)
    plan = cg.CapturePlan.fit(STEPS, None, max_bytes=12 << 20, memory=prices, **SETTINGS)
    cost = sum(prices.key_bytes(e.descriptor, e.strategy) for e in plan)
    assert cost <= 12 << 20
    full = sum(1 for e in plan if e.strategy == "full")
    assert full > sum(1 for e in plan if e.strategy == "breakable"), "the cheap family gets more sizes"


def test_a_byte_budget_too_small_is_refused_naming_what_it_must_hold() -> None:
    with pytest.raises(ValueError, match=r"max_bytes=\d+ does not hold the pool and warm-up every fitted plan takes \(104857600 bytes\)"):
        cg.CapturePlan.fit(STEPS, None, max_bytes=50 << 20, memory=Priced(1 << 20, 100 << 20), **SETTINGS)
    with pytest.raises(ValueError, match=r"needs memory=reg\.estimate_memory\(plan\) to price each key"):
        cg.CapturePlan.fit(STEPS, None, max_bytes=50 << 20, **SETTINGS)
    with pytest.raises(ValueError, match="needs max_graphs, max_bytes"):
        cg.CapturePlan.fit(STEPS, None, **SETTINGS)


def test_adaptation_under_a_byte_budget_refits_within_it() -> None:
    engine = Engine()
    reg = make(engine)
    estimate = reg.estimate_memory(cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=64, mode="full"))
    budget = estimate.fixed_bytes() + 5 * max(k.own_bytes for k in estimate.keys)
    adapt = cg.Adaptation(max_bytes=budget, memory=estimate, settings=dict(max_num_seqs=16, max_num_tokens=64, mode="full"),
                          every_steps=50, min_steps=50, decay=1.0, min_gain=0.0)
    reg = make(engine, adapt=adapt)
    with pytest.warns(RuntimeWarning, match="with no graph captured or planned"):
        for i in range(200):
            n = 1 + (i * 7) % 16
            reg.run(B.decode(n), input_ids=torch.arange(n) % 100, slot_mapping=torch.arange(n))
    assert reg.wait_captured(timeout=60)
    held = [(e.key, e.strategy) for e in reg.entries()]
    assert held and not adapt.over_budget(held), (len(held), budget)
    with pytest.raises(ValueError, match="max_bytes needs memory="):
        cg.Adaptation(max_bytes=1 << 30, settings=dict(max_num_seqs=16, max_num_tokens=64, mode="full"))


def test_interpolation_between_probes_is_linear_in_tokens() -> None:
    probes = (Probe(B(64), "full", 640, 64, 0, 0, 0.64), Probe(B(16), "full", 160, 16, 0, 0, 0.16))
    estimate = MemoryEstimate("x", (), 640, 0, 0, probes)
    assert estimate.key_bytes(B(40), "full") == 40 and estimate.key_bytes(B(8), "full") == 16 and estimate.key_bytes(B(99), "full") == 64
    with pytest.raises(ValueError, match=r"prices no key of strategy 'breakable' \(it prices \['full'\]\)"):
        estimate.key_bytes(B(8), "breakable")


def test_an_estimate_takes_the_breaks_payload_records_no_context_and_is_refused_asleep() -> None:
    """The recipe estimates before any capture: the breaks' payload is given as capture(context=...) takes it, the
    estimate records no capture context, and a sleeping registry refuses it as it refuses capture()."""
    seen: list[object] = []

    @cg.eager_break
    def scaled(h: torch.Tensor) -> torch.Tensor:
        seen.append(cg.current_batch().payload)
        return h * 2

    reg = cg.GraphRegistry(lambda batch, x: scaled(x + 1) - 1, {"x": cg.StaticInput((16, 4), torch.float32)}, backend="cpu",
                           preference=("breakable",))
    plan = cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=16, mode="breakable", capture_sizes=[8, 16])
    padding = {"metadata": "all padding"}
    reg.estimate_memory(plan, context=padding)
    assert seen and all(p is padding for p in seen) and reg.capture_context is None
    reg.capture(plan, context=padding)
    reg.sleep()
    with pytest.raises(RuntimeError, match=r"estimate_memory\(\) on registry .* while it sleeps: reg.wake\(\) first"):
        reg.estimate_memory(plan)


@pytest.mark.cuda
def test_the_cuda_estimate_is_close_and_leaves_no_memory_behind() -> None:
    engine = Engine("cuda")
    reg = make(engine)
    reg.estimate_memory(PLAN)  # the process's first CUDA work: kernels load and cuBLAS makes handles, whoever runs first
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    estimate = reg.estimate_memory(PLAN)
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] >= free0 - (2 << 20), "the estimate left memory behind"
    reg.capture(PLAN)
    torch.cuda.synchronize()
    taken = free0 - torch.cuda.mem_get_info()[0]
    assert abs(estimate.capture_bytes - taken) <= max(0.05 * taken, 32 << 20), (estimate.capture_bytes, taken)
    assert device_of("cuda").type == "cuda"


def measure_a_sampled_wide_estimate() -> str:
    """In this process: a sampled estimate of a wide MLP's plan, then its capture; ``predicted taken left probed keys``."""
    from tests.memory.test_pool_estimate import WideMLP

    plan = cg.CapturePlan.build(max_num_seqs=512, max_num_tokens=512, max_capture_size=512, mode="full")
    reg = cg.GraphRegistry(WideMLP(), {"x": cg.StaticInput((512, 1024), torch.float32)}, backend="cuda")
    with torch.inference_mode():
        reg.estimate_memory(plan, sample=True)  # the process's first CUDA work, whoever runs first
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        estimate = reg.estimate_memory(plan, sample=True)
        torch.cuda.synchronize()
        left = free0 - torch.cuda.mem_get_info()[0]
        reg.capture(plan)
        torch.cuda.synchronize()
        taken = free0 - torch.cuda.mem_get_info()[0]
    return f"{estimate.capture_bytes} {taken} {left} {sum(k.probed for k in estimate.keys)} {len(plan)}"


@pytest.mark.cuda
def test_a_sampled_cuda_estimate_of_a_wide_model_is_close_and_leaves_no_memory_behind() -> None:
    """In a fresh process, as an engine's start-up is: the driver keeps memory of graphs a process captured and
    dropped, and a sampled estimate made after that errs low (docs/integration.md), so the suite's earlier CUDA
    tests would change what this one measures."""
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = "from tests.memory.test_memory import measure_a_sampled_wide_estimate as m; print(m())"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    predicted, taken, left, probed, keys = map(int, done.stdout.split()[-5:])
    assert left <= 2 << 20, "the estimate left memory behind"
    assert probed < keys / 2
    assert abs(predicted - taken) <= 0.05 * taken, (predicted, taken)


def test_the_demo_fits_its_plan_to_memory_only_where_there_is_device_memory(capsys: pytest.CaptureFixture[str]) -> None:
    from cgregistry.cli import main

    assert main(["demo", "--backend", "cpu", "--steps", "2", "--gpu-memory-utilization", "0.5"]) == 2
    assert "gpu_memory_utilization needs the cuda backend (device memory to share), got 'cpu'" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["estimate_memory", "estimate_pool_memory"])
def test_a_call_from_the_step_during_an_estimate_is_refused(how: str) -> None:
    """An estimate runs the step: the registries it prices are busy meanwhile, so a clear() or a weight load from the
    step (or a hook) is refused as from inside any capture."""
    engine = Engine()
    refused: list[BaseException] = []

    def step(batch: B, **inputs: torch.Tensor) -> torch.Tensor:
        if not refused:
            try:
                reg.clear()
            except cg.ConcurrentRunError as exc:
                refused.append(exc)
        return plain(batch, **inputs)

    engine.step, plain = step, engine.step  # type: ignore[method-assign]
    reg = make(engine)
    if how == "estimate_memory":
        reg.estimate_memory(PLAN.entries[:2])
    else:
        cg.estimate_pool_memory([(reg, PLAN.entries[:2])])
    assert len(refused) == 1 and "from inside one of its calls" in str(refused[0]), refused
