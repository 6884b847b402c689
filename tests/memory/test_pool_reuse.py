"""Memory reused across weight syncs: where the backend keeps a pool usable once its graphs died, the keys a
``refresh()`` captures again (now, or between the steps that follow) go into the pool the dropped graphs held, on the
pool's own streams, and still account for what those graphs held; ``clear()``, ``sleep()`` and the release of the last
graph let the pool go."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.backends.cpu import CpuBackend
from cgregistry.testing import make_plugins

PLAN = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=8, mode="full")
MIXED_PLAN = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=16, mode="full_and_breakable", capture_sizes=[4, 8, 16])
POOL_BYTES = 1000  # what the first capture into a pool takes of the emulated device


class PoolSegment:
    """A cpu segment whose graph reports what its capture grew the pool by, as a cuda graph's ``memory_bytes`` does."""

    def __init__(self, segment: Any, grew: int) -> None:
        self._segment, self._grew = segment, grew

    def end(self) -> Any:
        graph = self._segment.end()
        graph.memory_bytes = self._grew
        return graph

    def abort(self) -> None:
        self._segment.abort()


class KeptPools(CpuBackend):
    """The cpu emulator with pools kept usable by a keeper object, streams kept per owner and a device whose memory a
    pool takes at its first capture (later captures into it reuse it), as the cuda backend has them: the keepers made
    and the owner whose streams each capture ran on are recorded."""

    name = "cpu-kept"

    def __init__(self) -> None:
        super().__init__()
        self.keepers: list[weakref.ref[object]] = []
        self.captured_on: list[object] = []  # the owner of the streams each capture (segment) ran on
        self.owner: object = None
        self.used = 0
        self.grown: set[int] = set()
        self.poisoned: set[int] = set()
        self.refuse_to_keep = False
        self.per_capture = 0  # what every capture takes of the device besides a pool's first (its graph's own)

    def keep_pool(self, pool: object) -> object:
        if self.refuse_to_keep:
            raise RuntimeError("no keeper here")
        keeper = type("Keeper", (), {})()
        self.keepers.append(weakref.ref(keeper))
        return keeper

    @contextlib.contextmanager
    def streams_of(self, owner: object) -> Iterator[None]:
        before, self.owner = self.owner, owner
        try:
            yield
        finally:
            self.owner = before

    def begin_capture(self, pool: object) -> Any:
        self.captured_on.append(self.owner)
        grows = id(pool) not in self.grown
        if grows:
            self.grown.add(id(pool))
            self.used += POOL_BYTES
        self.used += self.per_capture
        return PoolSegment(super().begin_capture(pool), (POOL_BYTES if grows else 0) + self.per_capture)

    def device_memory(self) -> tuple[int, int]:
        return self.used, self.used

    def recover_pool(self, pool: object) -> object:
        return object() if id(pool) in self.poisoned else pool

    def alive(self, collect: bool = True) -> int:
        """Keepers alive (after a full collection, unless ``collect`` is False: those a reference cycle holds count)."""
        if collect:
            gc.collect()
        return sum(ref() is not None for ref in self.keepers)

    @cg.plugin.hookimpl
    def cgregistry_register_backends(self, register):  # type: ignore[no-untyped-def]
        register(self)


def kept_registry(step: Callable[..., torch.Tensor], rows: int = 8, refuse_to_keep: bool = False) -> tuple[cg.GraphRegistry, KeptPools]:
    backend = KeptPools()
    backend.refuse_to_keep = refuse_to_keep
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((rows, 16), torch.float32)}, backend="cpu-kept",
                           plugins=make_plugins(backend))
    return reg, backend


def new_weights(layer: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    layer.load_state_dict({k: torch.randn_like(v) for k, v in layer.state_dict().items()}, assign=True)


@cg.eager_break
def doubled(h: torch.Tensor) -> torch.Tensor:
    return h * 2


@pytest.mark.parametrize("background", [False, True])
def test_keys_captured_again_after_a_weight_update_go_into_the_kept_pool_on_its_streams(background: bool) -> None:
    """A weight update that makes every graph stale keeps the registry's pool (the keys captured again reuse what the
    old graphs held), every capture runs on the pool's streams, at once or between steps, and the
    entries captured again account for what the dropped ones held; ``clear()`` renews the pool and lets it go."""
    layer = torch.nn.Linear(16, 16)
    reg, backend = kept_registry(lambda batch, x: layer(x) * 2)
    with torch.inference_mode():
        reg.capture(PLAN)
        handle, held = reg.pool.handle, sum(e.device_bytes for e in reg.entries())
        assert held == POOL_BYTES + 0 and backend.used == POOL_BYTES
        for seed in range(3):
            new_weights(layer, seed)
            assert len(reg.refresh(background=background).recaptured) == len(PLAN)
            reg.wait_captured()
            assert reg.pool.handle is handle and backend.used == POOL_BYTES, "the old graphs' memory is reused"
            assert sum(e.device_bytes for e in reg.entries()) == held, "the keys still account for the pool"
            assert reg.memory_bytes() == POOL_BYTES
            x = torch.randn(5, 16)
            torch.testing.assert_close(reg.run(B.decode(5), x=x), layer(x) * 2)
        assert len(backend.captured_on) == 4 * len(PLAN) and all(owner is reg.pool for owner in backend.captured_on)
        assert backend.alive() == 1
        reg.clear()
    assert reg.pool.handle is not handle and backend.alive() == 0, "clear() lets the pool go"


def test_a_pool_nothing_keeps_is_renewed_once_its_graphs_are_stale() -> None:
    """On a backend that keeps no pool (a pool whose graphs all died takes no capture), the keys captured again after
    every graph went stale go into a fresh pool."""
    layer = torch.nn.Linear(16, 16)
    reg = cg.GraphRegistry(lambda batch, x: layer(x) * 2, {"x": cg.StaticInput((8, 16), torch.float32)}, backend="cpu")
    with torch.inference_mode():
        reg.capture(PLAN)
        handle = reg.pool.handle
        new_weights(layer, 0)
        reg.refresh()
        assert reg.pool.handle is not handle
        x = torch.randn(5, 16)
        torch.testing.assert_close(reg.run(B.decode(5), x=x), layer(x) * 2)


def test_keys_of_a_strategy_with_eager_breaks_captured_again_between_steps_share_the_kept_pool() -> None:
    """A breakable key runs eager code while it is captured; between steps nothing replays meanwhile, so its keys
    captured again after a sync go into the registry's kept pool like every other key: no pool of their own."""
    layer = torch.nn.Linear(16, 16)
    plan = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=16, mode="full_and_breakable", capture_sizes=[4, 8, 16])
    mixed = B(12, num_reqs=3, uniform=False)
    reg, backend = kept_registry(lambda batch, x: doubled(layer(x)).relu(), rows=16)
    with torch.inference_mode():
        reg.capture(plan)
        held, used = sum(e.device_bytes for e in reg.entries()), backend.used
        for seed in (1, 2):
            new_weights(layer, seed)
            reg.refresh(background=True)
            x = torch.randn(12, 16)
            torch.testing.assert_close(reg.run(mixed, x=x), (layer(x) * 2).relu())
            reg.wait_captured()
            torch.testing.assert_close(reg.run(mixed, x=x), (layer(x) * 2).relu())
    assert len(backend.keepers) == 1 and backend.alive() == 1 and backend.used == used, "one pool, reused"
    assert sum(e.device_bytes for e in reg.entries()) == held and len(reg) == len(plan)


def test_sleep_and_the_release_of_the_last_graph_let_the_pool_go_and_make_no_keeper() -> None:
    """``sleep()`` lets the kept pool go even while another capture holds the pool's lock, and makes no keeper of its
    own; the first capture after ``wake()`` keeps the new pool; releasing every key lets it go again."""
    layer = torch.nn.Linear(16, 16)
    reg, backend = kept_registry(lambda batch, x: layer(x) * 2)
    with torch.inference_mode():
        reg.capture(PLAN)
        assert backend.alive() == 1
        with reg.pool.lock:  # a capture of another registry sharing the pool, say
            reg.sleep()
        assert backend.alive() == 0 and len(backend.keepers) == 1, "let go, and no keeper made while asleep"
        reg.wake(background=False)
        assert backend.alive() == 1 and len(reg) == len(PLAN)
        for entry in reg.entries():
            reg.release(entry.key, entry.strategy)
        assert len(reg) == 0 and backend.alive() == 0


def test_a_registry_whose_captures_all_failed_lets_its_kept_pool_go_at_sleep() -> None:
    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the step is broken")

    reg, backend = kept_registry(step)
    with pytest.raises(cg.CaptureError, match="the step is broken"):
        reg.capture(PLAN)
    assert len(reg) == 0 and backend.alive() == 1, "kept from the registry's start"
    reg.sleep()
    assert backend.alive() == 0


def test_what_dropped_entries_left_in_the_pool_goes_with_the_pool_when_it_is_let_go() -> None:
    """Entries dropped by a weight sync leave what they accounted for in the kept pool, for its next capture; when
    the sync's capture failed before any went into the pool and ``clear()`` lets the pool go, the registry's next
    capture goes into a new pool and accounts only for what it takes there."""
    layer = torch.nn.Linear(16, 16)
    fail = [False]

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            raise ValueError("the step is broken")
        return layer(x) * 2

    reg, backend = kept_registry(step)
    backend.per_capture = 10
    with torch.inference_mode():
        reg.capture(PLAN)
        fresh = sorted(e.device_bytes for e in reg.entries())
        assert fresh == sorted([POOL_BYTES + 10] + [10] * (len(PLAN) - 1))
        new_weights(layer, 0)
        fail[0] = True
        with pytest.raises(cg.CaptureError, match="the step is broken"):
            reg.refresh()
        assert len(reg) == 0 and len(reg.failures()) == 1
        reg.clear()
        assert backend.alive() == 0
        fail[0] = False
        reg.capture(PLAN)
    assert sorted(e.device_bytes for e in reg.entries()) == fresh
    assert reg.memory_bytes() == sum(fresh)


def test_a_capture_that_poisons_the_kept_pool_moves_the_registry_to_a_new_one_kept_at_its_next_capture() -> None:
    layer = torch.nn.Linear(16, 16)
    fail = [False]

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if fail[0] and batch.num_tokens == 4:
            raise ValueError("a capture broken half-way")
        return layer(x) * 2

    reg, backend = kept_registry(step)
    with torch.inference_mode():
        reg.capture(PLAN.entries[:2])
        old = reg.pool.handle
        backend.poisoned.add(id(old))
        fail[0] = True
        with pytest.raises(cg.CaptureError, match="half-way"):
            reg.capture([(B.decode(4), "full")])
        assert reg.pool.handle is not old and backend.alive() == 0, "the old keeper went; the old graphs hold the pool"
        fail[0] = False
        reg.capture([(B.decode(4), "full")])
        assert backend.alive() == 1 and len(backend.keepers) == 2 and len(reg) == 3, "the new pool kept"
        x = torch.randn(4, 16)
        torch.testing.assert_close(reg.run(B.decode(4), x=x), layer(x) * 2)


def test_a_backend_that_cannot_keep_a_pool_warns_once_and_captures_as_one_that_keeps_none() -> None:
    layer = torch.nn.Linear(16, 16)
    with pytest.warns(RuntimeWarning, match="could not keep a graph pool usable") as warned:
        reg, backend = kept_registry(lambda batch, x: layer(x) * 2, refuse_to_keep=True)
    with torch.inference_mode():
        reg.capture(PLAN)
        handle = reg.pool.handle
        new_weights(layer, 0)
        reg.refresh()
    assert reg.pool.handle is not handle and len(reg) == len(PLAN), "renewed, as a pool nothing keeps"
    assert len([w for w in warned if "could not keep" in str(w.message)]) == 1
    x = torch.randn(5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B.decode(5), x=x), layer(x) * 2)


def test_the_memory_estimate_captures_on_the_pool_streams_the_capture_will_use() -> None:
    layer = torch.nn.Linear(16, 16)
    reg, backend = kept_registry(lambda batch, x: layer(x) * 2)
    with torch.inference_mode():
        reg.estimate_memory(PLAN)
        assert len(backend.captured_on) == len(PLAN) and all(owner is reg.pool for owner in backend.captured_on)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["full", "full_and_breakable"])
@pytest.mark.parametrize("background", [False, True])
def test_cuda_weight_updates_captured_again_take_no_new_memory(mode: str, background: bool) -> None:
    """After an assign-style weight update the graphs captured again reuse the dropped graphs' memory: from the second
    sync on, the caching allocator's reserved bytes stay flat and the entries account for as much as before.  As in an
    engine's loop, a step is served between ``refresh()`` and the rest of the recapture."""
    layer = torch.nn.Linear(512, 512, device="cuda")
    reg = cg.GraphRegistry(lambda batch, x: (doubled(layer(x)).relu() * 2).sum(-1),
                           {"x": cg.StaticInput((64, 512), torch.float32)}, backend="cuda")
    plan = cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=64, mode=mode)
    mixed = B(24, num_reqs=5, uniform=False)
    reserved, accounted = [], []

    def served(batch: B, rows: int) -> None:
        x = torch.randn(rows, 512, device="cuda")
        torch.testing.assert_close(reg.run(batch, x=x), (layer(x).relu() * 4).sum(-1))

    with torch.inference_mode():
        reg.capture(plan)
        for seed in range(4):
            new_weights(layer, seed)
            reg.refresh(background=background)
            served(mixed, 24)  # a piece of the recapture first (background), then the step
            reg.wait_captured()
            for batch, rows in ((B.decode(5), 5), (mixed, 24)):
                served(batch, rows)
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
            accounted.append(reg.memory_bytes())
    assert len(reg) == len(plan)
    assert reserved[-1] - reserved[1] < 2**20, [r / 2**20 for r in reserved]
    assert min(accounted[1:]) >= accounted[1] - 2**20, [a / 2**20 for a in accounted]
