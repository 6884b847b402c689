"""Inspection: entry records, stats per class, explain as data, snapshots, lazy capture and the memory budget."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.inspection import SNAPSHOT_SCHEMA


def make(backend: str = "cpu", **kwargs: Any) -> cg.GraphRegistry:
    plugins = kwargs.pop("plugins", None) or cg.Plugins(cg.plugin.make_plugin_manager(autoload=False))
    return cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((64, 4), torch.float32)}, backend=backend, plugins=plugins, **kwargs)


def run(reg: cg.GraphRegistry, batch: B) -> torch.Tensor:
    x = torch.randn(batch.num_tokens, 4, device=reg.device)
    out = reg.run(batch, x=x)
    torch.testing.assert_close(out, x * 2)
    return out


PLAN = [(B.decode(8), "full"), (B.decode(4), "full"), (B.decode(2, 1), "full"), (B(32, 8), "full"), (B(16, 8, num_active_loras=2), "full")]


def test_entries_filter_and_sort() -> None:
    reg = make()
    reg.capture(PLAN)
    for batch in (B.decode(3), B.decode(3), B(20, 5), B.decode(7)):
        run(reg, batch)
    assert [e.key for e in reg.entries(uniform=True)] == [B.decode(8), B.decode(4), B.decode(2, 1)]
    assert [e.key for e in reg.entries(spec_depth=1)] == [B.decode(2, 1)]
    assert [e.key for e in reg.entries(num_active_loras=2)] == [B(16, 8, num_active_loras=2)]
    assert [e.key for e in reg.entries(used=True, sort="replays")] == [B.decode(4), B(32, 8), B.decode(8)]
    assert [e.key for e in reg.entries(sort="recent")][0] == B.decode(8)
    assert all(e.segments is None and e.breaks is None for e in reg.entries()), "full graphs have no segments"
    with pytest.raises(ValueError, match="unknown sort 'size'; expected one of key, replays"):
        reg.entries(sort="size")


def test_stats_per_strategy_class_and_kind() -> None:
    reg = make()
    reg.capture(PLAN)
    run(reg, B.decode(3))  # -> decode(4): 1 padded
    run(reg, B(20, 5))  # -> (32, 8): 12 padded
    run(reg, B(40, 5))  # miss (mixed)
    run(reg, B.decode(9, 1))  # miss (uniform, depth 1, 18 tokens > 4)
    s = reg.stats()
    assert (s.hits, s.misses, s.eager_fallbacks, s.padded_tokens, s.graph_tokens) == (2, 2, 2, 13, 23)
    assert s.misses_by_form == {"uniform": 1, "mixed": 1}
    assert s.by_class["full/uniform-d0/lora0"] == cg.inspection.ClassStats(entries=2, replays=1, graph_tokens=3, padded_tokens=1)
    assert s.by_class["full/mixed/lora0"] == cg.inspection.ClassStats(entries=1, replays=1, graph_tokens=20, padded_tokens=12)
    assert s.by_class["full/uniform-d1/lora0"].replays == 0
    reg.reset_stats()
    assert reg.stats().hits == 0 and reg.stats().misses_by_form == {"uniform": 0, "mixed": 0}


def test_explain_as_data() -> None:
    reg = make()
    reg.capture(PLAN)
    data = reg.explain(B.decode(3)).to_dict()
    json.dumps(data)
    assert data["match"] == {"key": {"num_tokens": 4, "num_reqs": 4, "num_active_loras": 0, "spec_depth": 0, "uniform": True, "num_ubatches": 1}, "strategy": "full", "padding": [1, 1, 0]}
    chosen = [c for c in data["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["reason"].startswith("chosen")
    assert len(data["candidates"]) == len(PLAN)


def test_snapshot_round_trip_and_offline_explain(tmp_path) -> None:  # noqa: ANN001
    reg = make(name="engine-0")
    reg.capture(PLAN)
    for batch in (B.decode(3), B(20, 5), B(40, 5)):
        run(reg, batch)
    data = reg.snapshot()
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(data))
    snap = cg.load_snapshot(path)
    assert snap.schema == SNAPSHOT_SCHEMA and snap.name == "engine-0" and snap.backend == "cpu"
    assert list(snap.entries) == reg.entries()
    assert snap.stats == reg.stats()
    assert snap.memory_bytes == reg.memory_bytes()
    assert snap.to_dict() == data, "a loaded snapshot writes back the same dict"
    for actual in (B.decode(3), B(20, 5), B(40, 5), B.decode(2, 1)):
        assert snap.explain(actual).to_dict() == reg.explain(actual).to_dict()
    assert [e.key for e in snap.filtered(used=True, sort="padding")] == [B(32, 8), B.decode(4)]
    assert "3 entries" not in snap.table() and "5 entries on cpu" in snap.table()


def test_a_snapshot_written_before_schema_5_reads_its_misses_by_form() -> None:
    """Schemas before 5 named the misses by uniform or mixed ``misses_by_kind``: read as ``misses_by_form``."""
    reg = make()
    reg.capture(PLAN)
    reg.run(B(63, 9), x=torch.ones(63, 4))  # above every key: a mixed miss
    data = reg.snapshot()
    older = {**data, "schema": 4, "stats": {("misses_by_kind" if k == "misses_by_form" else k): v for k, v in data["stats"].items()}}
    assert cg.load_snapshot(older).stats.misses_by_form == reg.stats().misses_by_form
    assert reg.stats().misses_by_form["mixed"] == 1


def test_bad_snapshots_are_named(tmp_path) -> None:  # noqa: ANN001
    data = make().snapshot()
    with pytest.raises(cg.SnapshotError, match=r"snapshot schema 99 is not supported; this cgregistry reads schemas \(1, 2, 3, 4, 5\)"):
        cg.load_snapshot({**data, "schema": 99})
    broken = {**data, "entries": [{"key": {"num_tokens": 0}}]}
    with pytest.raises(cg.SnapshotError, match=r"entries\[0\].key: not a BatchDescriptor: BatchDescriptor.num_tokens must be positive"):
        cg.load_snapshot(broken)
    without = {k: v for k, v in data.items() if k != "stats"}
    with pytest.raises(cg.SnapshotError, match="snapshot lacks field 'stats'"):
        cg.load_snapshot(without)
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    with pytest.raises(cg.SnapshotError, match="a snapshot is a JSON object, got list"):
        cg.load_snapshot(path)


class Events:
    def __init__(self) -> None:
        self.evicted: list[tuple[B, str, int]] = []
        self.started: list[B] = []

    @cg.plugin.hookimpl
    def cgregistry_evicted(self, registry: Any, key: B, strategy: str, memory_bytes: int) -> None:
        self.evicted.append((key, strategy, memory_bytes))

    @cg.plugin.hookimpl
    def cgregistry_capture_started(self, registry: Any, key: B, strategy: str) -> None:
        self.started.append(key)


@pytest.mark.filterwarnings("ignore:.*do not fit static input:RuntimeWarning")  # on purpose
def test_lazy_capture_on_first_need(backend: str) -> None:
    events = Events()
    reg = make(backend, plugins=cg.Plugins(cg.plugin.make_plugin_manager([events], autoload=False)))
    assert reg.capture(PLAN, lazy=True) == []
    assert len(reg) == 0 and len(reg.pending()) == len(PLAN)
    assert reg.match(B.decode(3)).key == B.decode(4), "match reports the key run would capture"
    run(reg, B.decode(3))
    run(reg, B.decode(4))
    assert events.started == [B.decode(4)], "captured once, on first need"
    assert [e.key for e in reg.entries()] == [B.decode(4)]
    s = reg.stats()
    assert (s.lazy_captures, s.hits, s.misses) == (1, 2, 0)
    run(reg, B(100, 3))  # nothing covers it, pending or not
    assert reg.stats().misses == 1 and reg.stats().lazy_captures == 1


def test_failed_lazy_capture_falls_through_to_the_next_key() -> None:
    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch == B.decode(4):
            raise RuntimeError("cannot capture this one")
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((64, 4), torch.float32)}, backend="cpu", plugins=cg.Plugins(cg.plugin.make_plugin_manager(autoload=False)))
    reg.capture(PLAN, lazy=True)
    with pytest.warns(RuntimeWarning, match=r"lazy capturing Batch\(tokens=4, reqs=4, uniform\) with strategy 'full' failed"):
        run(reg, B.decode(3))
    assert (B.decode(4), "full") in reg.failures()
    assert reg.match(B.decode(3)).key == B.decode(8), "the failed key is dropped; the next best is used"
    run(reg, B.decode(3))
    stats = reg.stats()
    assert (stats.lazy_captures, stats.eager_fallbacks, stats.hits) == (1, 0, 2), "the same step went on to the next key"


def test_memory_budget_evicts_least_recently_used() -> None:
    events = Events()
    one = make()
    one.capture([(B(32, 8), "full")])
    per_entry = one.memory_bytes()  # x * 2 on (32, 4) floats: one fresh output
    reg = make(plugins=cg.Plugins(cg.plugin.make_plugin_manager([events], autoload=False)), memory_budget=int(2.5 * per_entry))
    keys = [B(32, 8), B(32, 7), B(32, 6)]  # same size: equal memory
    reg.capture([(keys[0], "full"), (keys[1], "full")])
    run(reg, B(30, 7))  # uses keys[1]
    run(reg, B(30, 8))  # uses keys[0], the most recent
    reg.capture([(keys[2], "full")])
    assert [k for k, _, _ in events.evicted] == [keys[1]], "the least recently replayed goes"
    assert events.evicted[0][2] == per_entry
    assert reg.memory_bytes() <= reg.memory_budget
    assert sorted(e.key.num_reqs for e in reg.entries()) == [6, 8]
    assert reg.pending() == [(keys[1], "full")]
    s = reg.stats()
    assert s.evictions == 1 and s.hits == 2, "an evicted entry's replays still count"
    run(reg, B(30, 7))  # needs keys[1] again: captured lazily, evicting the LRU entry
    assert reg.stats().lazy_captures == 1 and reg.stats().evictions == 2
    assert (keys[1], "full") in [(e.key, e.strategy) for e in reg.entries()]
    with pytest.raises(ValueError, match="memory_budget must be a byte count >= 0 or None, got -1"):
        make(memory_budget=-1)
