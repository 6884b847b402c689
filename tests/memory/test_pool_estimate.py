"""estimate_pool_memory(): the memory of several registries' plans captured into the one pool they share (a drafter
beside its target), predicted per key before anything is captured, with nothing kept and no engine state touched."""

from __future__ import annotations

import gc
import json

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from tests.background.test_background import PLAN, SCRATCH, Engine, make


def pair(**drafter_kwargs: object) -> tuple[Engine, Engine, cg.GraphRegistry, cg.GraphRegistry]:
    target_engine, draft_engine = Engine(), Engine()
    target = make(target_engine, name="target")
    drafter = make(draft_engine, name="drafter", **({"pool": target.pool} | drafter_kwargs))
    return target_engine, draft_engine, target, drafter


DRAFT_PLAN = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=8, mode="full")


def test_the_pair_estimate_equals_what_capturing_both_then_reports_key_by_key() -> None:
    target_engine, draft_engine, target, drafter = pair()
    caches = target_engine.cache.clone(), draft_engine.cache.clone()
    found = cg.estimate_pool_memory([(target, PLAN), (drafter, DRAFT_PLAN)])
    assert len(target) == len(drafter) == 0 and target.pool.live_graphs == 0, "nothing kept"
    assert torch.equal(target_engine.cache[:SCRATCH], caches[0][:SCRATCH]), "the target's probes wrote a live slot"
    assert torch.equal(draft_engine.cache[:SCRATCH], caches[1][:SCRATCH]), "the drafter's probes wrote a live slot"
    assert found.names == ("target", "drafter")
    assert [(k.key, k.strategy) for k in found["target"].keys] == [(e.descriptor, e.strategy) for e in PLAN]
    assert [(k.key, k.strategy) for k in found["drafter"].keys] == [(e.descriptor, e.strategy) for e in DRAFT_PLAN]
    target.capture(PLAN)
    drafter.capture(DRAFT_PLAN)
    for reg in (target, drafter):
        actual = {(e.key, e.strategy): e.device_bytes for e in reg.entries()}
        assert {(k.key, k.strategy): k.bytes for k in found[reg.name].keys} == actual
        assert all(e.predicted_bytes == actual[(e.key, e.strategy)] for e in reg.entries()), "entries show the prediction"
    assert found.capture_bytes == target.memory_bytes() + drafter.memory_bytes() > 0
    assert found.total_bytes == found.capture_bytes + sum(p.static_input_bytes for p in found.parts)


def test_each_registry_keeps_its_own_held_keys_and_its_breaks_see_their_own_payload() -> None:
    seen: list[tuple[str, object]] = []

    def breaking(name: str) -> object:
        @cg.eager_break
        def scaled(h: torch.Tensor) -> torch.Tensor:
            seen.append((name, cg.current_batch().payload))
            return h * 2

        return lambda batch, x: scaled(x + 1) - 1

    spec = {"x": cg.StaticInput((16, 4), torch.float32)}
    target = cg.GraphRegistry(breaking("target"), spec, backend="cpu", name="target", preference=("breakable",))
    drafter = cg.GraphRegistry(breaking("drafter"), spec, backend="cpu", name="drafter", pool=target.pool,
                               preference=("breakable",))
    plan = cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=16, mode="breakable", capture_sizes=[4, 8, 16])
    target.capture(plan.entries[:1], context="held")
    seen.clear()
    found = cg.estimate_pool_memory([(target, plan), (drafter, plan)], contexts={"drafter": "given"})
    assert [(k.key, k.strategy) for k in found["target"].keys] == [(e.descriptor, e.strategy) for e in plan.entries[1:]]
    assert {p for n, p in seen if n == "target"} == {"held"}, "the target's breaks see its recorded context"
    assert {p for n, p in seen if n == "drafter"} == {"given"}, "the drafter's breaks see the context given for it"
    assert drafter.capture_context is None and len(target) == 1 and len(drafter) == 0


def test_the_pair_estimate_reads_as_a_table_and_json() -> None:
    _, _, target, drafter = pair()
    found = cg.estimate_pool_memory([(target, PLAN), (drafter, DRAFT_PLAN)])
    text = found.table()
    assert "registry 'target'" in text and "registry 'drafter'" in text and "2 registries in one pool" in text
    data = json.loads(json.dumps(found.to_dict()))
    assert data["capture_bytes"] == found.capture_bytes
    assert [r["name"] for r in data["registries"]] == ["target", "drafter"] and all(r["keys"] for r in data["registries"])
    with pytest.raises(KeyError, match=r"no registry 'other': it has \['target', 'drafter'\]"):
        found["other"]
    assert list(found) == ["target", "drafter"] and len(found) == 2 and "drafter" in found and "other" not in found
    assert dict(zip(found, found.parts))["drafter"] is found["drafter"]


def test_bad_pairs_are_refused_before_anything_is_captured() -> None:
    target_engine, draft_engine, target, drafter = pair()
    calls = []
    step = target_engine.step
    target_engine.step = lambda batch, **kw: calls.append(batch) or step(batch, **kw)  # type: ignore[method-assign]
    target = make(target_engine, name="target", pool=drafter.pool)
    apart = make(Engine(), name="apart")
    with pytest.raises(ValueError, match=r"registry 'apart' captures into another pool than registry 'target'"):
        cg.estimate_pool_memory([(target, PLAN), (apart, PLAN)])
    with pytest.raises(ValueError, match=r"registry 'target' is given twice"):
        cg.estimate_pool_memory([(target, PLAN), (target, DRAFT_PLAN)])
    with pytest.raises(ValueError, match=r"contexts names registries \['verify'\] not given: the registries are \['target', 'drafter'\]"):
        cg.estimate_pool_memory([(target, PLAN), (drafter, DRAFT_PLAN)], contexts={"verify": 1})
    with pytest.raises(ValueError, match="registry 'drafter': .*needs 65 tokens"):
        cg.estimate_pool_memory([(target, PLAN), (drafter, [(B.decode(65), "full")])])
    twin = make(Engine(), name="target", pool=target.pool)
    with pytest.raises(ValueError, match=r"two registries are named 'target'"):
        cg.estimate_pool_memory([(target, PLAN), (twin, DRAFT_PLAN)])
    for contexts in ({target: 1}, ["target"], "target"):
        with pytest.raises(TypeError, match=r"contexts as a mapping from registry name to payload"):
            cg.estimate_pool_memory([(target, PLAN), (drafter, DRAFT_PLAN)], contexts=contexts)  # type: ignore[arg-type]
    for bad in ([], [target], [(target,)], [(PLAN, target)], "target"):
        with pytest.raises(TypeError, match=r"a non-empty list of \(registry, plan\) pairs"):
            cg.estimate_pool_memory(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"estimate_pool_memory\(sample=...\) takes a bool"):
        cg.estimate_pool_memory([(target, PLAN)], sample=1)  # type: ignore[arg-type]
    assert calls == [] and len(target) == len(drafter) == 0


def test_a_pair_estimate_whose_second_registry_fails_keeps_nothing_of_either() -> None:
    from cgregistry.store.catalog import Entry

    _, draft_engine, target, drafter = pair()
    step = draft_engine.step

    def failing(batch: B, **inputs: torch.Tensor) -> torch.Tensor:
        if batch == DRAFT_PLAN.entries[-1].descriptor:
            raise RuntimeError(f"no graph for {batch}")
        return step(batch, **inputs)

    draft_engine.step = failing  # type: ignore[method-assign]
    drafter = make(draft_engine, name="drafter", pool=target.pool)
    gc.collect()
    before = sum(type(o) is Entry for o in gc.get_objects())
    with pytest.raises(cg.CaptureError, match="no graph for"):
        cg.estimate_pool_memory([(target, PLAN), (drafter, DRAFT_PLAN)])
    gc.collect()
    assert sum(type(o) is Entry for o in gc.get_objects()) == before, "a scratch entry outlived the failed estimate"
    assert len(target) == len(drafter) == 0 and target.pool.live_graphs == 0


class WideMLP(torch.nn.Module):
    """An MLP whose hidden activations (tokens x 16384 floats) dominate its graphs' pool, as a decoder's do."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(1024, 16384, device="cuda"), torch.nn.Linear(16384, 1024, device="cuda")

    def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.cuda
def test_the_cuda_pair_estimate_prices_the_drafter_at_what_it_adds_to_the_targets_pool() -> None:
    plan = cg.CapturePlan.build(max_num_seqs=512, max_num_tokens=512, max_capture_size=512, mode="full")
    spec = {"x": cg.StaticInput((512, 1024), torch.float32)}
    models = WideMLP(), WideMLP()
    target = cg.GraphRegistry(models[0], spec, backend="cuda", name="target")
    drafter = cg.GraphRegistry(models[1], spec, backend="cuda", name="drafter", pool=target.pool)
    with torch.inference_mode():
        cg.estimate_pool_memory([(target, plan), (drafter, plan)])  # the process's first CUDA work, whoever runs first
        alone = drafter.estimate_memory(plan)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        found = cg.estimate_pool_memory([(target, plan), (drafter, plan)])
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] >= free0 - (2 << 20), "the estimate left memory behind"
        target.capture(plan)
        drafter.capture(plan)
        torch.cuda.synchronize()
        taken = free0 - torch.cuda.mem_get_info()[0]
    assert abs(found.capture_bytes - taken) <= 0.05 * taken, (found.capture_bytes, taken)
    assert found["drafter"].capture_bytes < 0.25 * alone.capture_bytes, (found["drafter"].capture_bytes, alone.capture_bytes)


def test_a_refused_pair_leaves_every_registry_as_it_was() -> None:
    """A drafter asleep is refused before anything of either registry changes: the target's pending keys stay pending."""
    _, _, target, drafter = pair()
    drafter.capture(DRAFT_PLAN)
    drafter.sleep()
    target.capture(PLAN, background=True)
    with pytest.raises(RuntimeError, match=r"estimate_pool_memory\(\) on registry 'drafter' while it sleeps"):
        cg.estimate_pool_memory([(target, PLAN), (drafter, DRAFT_PLAN)])
    assert len(target) == 0 and len(target.capturing()) == len(PLAN)
    drafter.wake()
    assert target.wait_captured() and len(target) == len(PLAN)


def test_a_pair_whose_first_registry_holds_its_graphs_says_the_rest_is_an_upper_bound() -> None:
    _, _, target, drafter = pair()
    target.capture(PLAN)
    with pytest.warns(RuntimeWarning, match=r"registry 'target' already holds graphs in the pool; .* estimate before capturing"):
        found = cg.estimate_pool_memory([(target, PLAN), (drafter, DRAFT_PLAN)])
    assert found["target"].keys == () and len(found["drafter"].keys) == len(DRAFT_PLAN)
