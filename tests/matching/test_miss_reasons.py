"""Misses told apart by reason, and the one-time warnings for misses that mean a setup mistake."""

from __future__ import annotations

import warnings

import pytest
import torch

import cgregistry as cg
from cgregistry.inspection import MISS_REASONS

B = cg.BatchDescriptor


def step(batch: B, x: torch.Tensor) -> torch.Tensor:
    return x * 2


def registry() -> cg.GraphRegistry:
    return cg.GraphRegistry(step, {"x": cg.StaticInput((64,), torch.float32)}, backend="cpu")


def reasons(reg: cg.GraphRegistry) -> dict[str, int]:
    return {k: v for k, v in reg.stats().misses_by_reason.items() if v}


def test_run_before_capture_warns_once_and_counts() -> None:
    reg = registry()
    with pytest.warns(RuntimeWarning, match=r"run\(Batch\(tokens=3, reqs=3\)\) with no graph captured or planned.*reg.capture\(plan\)"):
        assert reg.run(B(3, 3), x=torch.ones(3)).tolist() == [2, 2, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time is silent
        reg.run(B(4, 4), x=torch.ones(4))
    assert reasons(reg) == {"no_graphs": 2} and reg.stats().misses == 2


def test_reasons_tell_misses_apart() -> None:
    reg = registry()
    plan = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, mode="full_decode_only", capture_sizes=[1, 2, 4, 8])
    reg.capture(plan)
    assert {e.key.uniform for e in reg.entries()} == {True}, "full_decode_only: decode keys only"
    reg.run(B(5, 2), x=torch.ones(5))  # a prefill batch: no mixed key at any size
    reg.run(B.decode(16), x=torch.ones(16))  # decode, larger than the largest decode key
    reg.run(B.decode(3, spec_depth=1), x=torch.ones(6))  # spec decode: no key with that depth
    with pytest.warns(RuntimeWarning, match=r"65 tokens do not fit static input 'x', which holds 64; enlarge"):
        reg.run(B(65, 1), x=torch.ones(65))
    assert reasons(reg) == {"no_key_for_class": 2, "above_largest_key": 1, "above_capacity": 1}
    assert reg.stats().misses == 4 and reg.stats().hits == 0
    reg.run(B.decode(3), x=torch.ones(3))
    assert reg.stats().hits == 1 and sum(reg.stats().misses_by_reason.values()) == 4
    assert set(reg.stats().misses_by_reason) == set(MISS_REASONS)
    assert "no_key_for_class 2" in reg.table()


def test_failed_key_is_its_own_reason() -> None:
    broken = {"on": False}

    def flaky(batch: B, x: torch.Tensor) -> torch.Tensor:
        if broken["on"] and batch.num_tokens == 8:
            raise RuntimeError("capture broke")
        return x + 1

    reg = cg.GraphRegistry(flaky, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")
    reg.capture([(B(8, 8), "full")], lazy=True)
    broken["on"] = True
    with pytest.warns(RuntimeWarning, match="lazy capturing"):
        reg.run(B(5, 5), x=torch.ones(5))  # the lazy capture fails: eager, key dropped
    broken["on"] = False
    reg.run(B(6, 6), x=torch.ones(6))
    assert reasons(reg) == {"failed": 2}


def test_snapshot_round_trips_reasons() -> None:
    reg = registry()
    with pytest.warns(RuntimeWarning):
        reg.run(B(2, 2), x=torch.ones(2))
    snap = cg.load_snapshot(reg.snapshot())
    assert snap.stats.misses_by_reason["no_graphs"] == 1


def test_failed_lazy_capture_falls_to_the_next_pending_key() -> None:
    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 8:
            raise RuntimeError("cannot capture")
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu")
    reg.capture([(B(16), "full"), (B(8), "full")], lazy=True)
    with pytest.warns(RuntimeWarning, match="lazy capturing"):
        assert reg.run(B(5), x=torch.ones(5)).tolist() == [2.0] * 5
    s = reg.stats()
    assert (s.hits, s.misses, s.lazy_captures) == (1, 0, 1), "the 16-token key serves it after the 8-token one failed"


def test_a_broken_entry_counts_its_eager_step_as_a_failed_miss() -> None:
    calls = {"n": 0}

    class BrokenGraph:
        memory_bytes = 0

        def replay(self) -> None:
            calls["n"] += 1
            raise RuntimeError("replay broke")

    class Breaks:
        """A strategy whose graphs capture fine and then break at every replay."""

        name, relaxes_num_reqs = "breaks", False

        def capture(self, body: object, backend: object, pool: object) -> tuple[BrokenGraph, object]:
            return BrokenGraph(), body()  # type: ignore[operator]

    class Plugin:
        @cg.plugin.hookimpl
        def cgregistry_register_strategies(self, register: object) -> None:
            register(Breaks())  # type: ignore[operator]

    plugins = cg.Plugins(cg.plugin.make_plugin_manager([Plugin()]))
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((64,), torch.float32)}, backend="cpu", plugins=plugins, preference=("breaks",))
    reg.capture([(B(8, 8), "breaks")])
    with pytest.warns(RuntimeWarning, match="entry was removed"):
        reg.run(B(4, 4), x=torch.ones(4))
    s = reg.stats()
    assert calls["n"] == 1 and s.misses == 1 and s.misses_by_reason["failed"] == 1 and s.hits == 0


def test_a_decode_batch_not_marked_uniform_gets_a_hint_in_explain_and_one_warning() -> None:
    """BatchDescriptor(4, 4) may be a prefill chunk, so it is not a decode batch; but when uniform keys would serve it,
    explain() says how to describe it, and a registry that sees many such misses says so once."""
    reg = registry()
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, mode="full_decode_only", spec_depths=(0, 1)))
    explained = reg.explain(B(4, 4))
    assert explained.match is None and explained.hint is not None
    assert "describe it as BatchDescriptor.decode(4) (uniform=True) and Batch(tokens=4, reqs=4, uniform) [full] serves it" in str(explained)
    assert "BatchDescriptor.decode(3, spec_depth=1)" in str(reg.explain(B(6, 3)))
    assert reg.explain(B(5, 2)).hint is None, "5 tokens for 2 requests is no uniform batch"
    assert reg.explain(B.decode(4)).hint is None, "served: nothing to hint"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(40):
            assert reg.run(B(4, 4), x=torch.ones(4)).tolist() == [2.0] * 4
    hinted = [w for w in caught if "uniform keys would serve them" in str(w.message)]
    assert len(hinted) == 1 and "16 batches ran eagerly as mixed batches" in str(hinted[0].message)
    assert reasons(reg) == {"no_key_for_class": 40}


def test_a_batch_without_a_request_count_beside_keys_that_count_requests_is_its_own_reason() -> None:
    """Keys that bake in a request count cannot serve a batch that gives none, however large they are: the miss says
    so (and warns once, naming the field), rather than sending the engine to raise max_capture_size."""
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((256,), torch.float32)}, backend="cpu")
    reg.capture(cg.CapturePlan.build(max_num_seqs=64, max_num_tokens=256, mode="full"))
    with pytest.warns(RuntimeWarning, match=r"Batch\(tokens=97, reqs=any\) runs eagerly: every key of its form needs a "
                                            r"request count.*num_reqs"):
        reg.run(B(97), x=torch.ones(97))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        for _ in range(20):
            reg.run(B(97), x=torch.ones(97))
    assert reasons(reg) == {"no_request_count": 21}
    reg.run(B(97, 3), x=torch.ones(97))
    assert reg.stats().hits == 1
