"""Memory reused across weight syncs: where the backend keeps a pool usable once its graphs died, the keys a
``refresh()`` captures again go into the pools the dropped graphs held (the registry's pool, and a background key's
pool of its own), on the pool's own streams, and still account for what those graphs held; ``clear()``, ``sleep()``
and the release of the last graph let the pool go."""

from __future__ import annotations

import contextlib
import gc
import threading
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
    """The cpu emulator with pools kept usable by a keeper object, streams kept per owner, a fence and a device whose
    memory a pool takes at its first capture (later captures into it reuse it), as the cuda backend has them: the
    keepers made, the owner whose streams each capture ran on and the fences waited for are recorded."""

    name = "cpu-kept"

    def __init__(self) -> None:
        super().__init__()
        self.keepers: list[weakref.ref[object]] = []
        self.captured_on: list[object] = []  # the owner of the streams each capture (segment) ran on
        self.owner: object = None
        self.waited = 0
        self.fenced_on: list[int] = []  # the thread each fence was made on
        self.used = 0
        self.grown: set[int] = set()
        self.poisoned: set[int] = set()
        self.refuse_to_keep = False
        self.per_capture = 0  # what every capture takes of the device besides a pool's first (its graph's own)

    def keep_pool(self, pool: object, beside_serving: bool = False) -> object:
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

    def fence(self) -> Callable[[], None]:
        self.fenced_on.append(threading.get_ident())

        def wait() -> None:
            self.waited += 1
        return wait

    def alive(self, collect: bool = True) -> int:
        """Keepers alive (after a full collection, unless ``collect`` is False: those a reference cycle holds count)."""
        if collect:
            gc.collect()
        return sum(ref() is not None for ref in self.keepers)

    @cg.plugin.hookimpl
    def cgregistry_register_backends(self, register):  # type: ignore[no-untyped-def]
        register(self)


class Gate:
    """Holds the capture thread at the start of each capture while closed (the test then serves a step first)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()

    @cg.plugin.hookimpl
    def cgregistry_capture_started(self, registry: Any, key: Any, strategy: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert self.open.wait(10), "the gate was never opened"


def kept_registry(step: Callable[..., torch.Tensor], rows: int = 8, refuse_to_keep: bool = False,
                  gate: Gate | None = None) -> tuple[cg.GraphRegistry, KeptPools]:
    backend = KeptPools()
    backend.refuse_to_keep = refuse_to_keep
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((rows, 16), torch.float32)}, backend="cpu-kept",
                           plugins=make_plugins(backend, *([gate] if gate else [])))
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
    old graphs held), every capture runs on the pool's streams, in the foreground or on the capture thread, and the
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


MIXED = B(12, num_reqs=3, uniform=False)


def mixed_registry(gate: Gate | None = None, fail: list[bool] | None = None) -> tuple[cg.GraphRegistry, KeptPools, torch.nn.Linear, int]:
    """A registry of MIXED_PLAN captured in the foreground, then captured again in the background after one sync (its
    breakable keys then hold pools of their own); how many breakable keys it has."""
    layer = torch.nn.Linear(16, 16)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if fail and fail[0] and not batch.uniform and threading.current_thread() is not threading.main_thread():
            raise ValueError("a breakable key's capture failed")
        return doubled(layer(x)).relu()

    reg, backend = kept_registry(step, rows=16, gate=gate)
    with torch.inference_mode():
        reg.capture(MIXED_PLAN)
        breakable = sum(e.strategy == "breakable" for e in reg.entries())
        assert breakable > 0 and len(backend.keepers) == 1, "foreground keys share the registry's pool"
        new_weights(layer, 1)
        reg.refresh(background=True)
        reg.wait_captured()
    assert len(backend.keepers) == 1 + breakable and backend.alive() == 1 + breakable, "a pool each"
    return reg, backend, layer, breakable


def test_background_keys_with_pools_of_their_own_take_their_dropped_graphs_pools_again_after_the_next_run() -> None:
    """After an assign-style sync, a breakable key's background capture takes the pool its dropped entry held, once
    the serving thread's next run() armed it (the fence made there, on the serving thread, waited for first), and
    the entry accounts for what the dropped one held."""
    gate = Gate()
    reg, backend, layer, breakable = mixed_registry(gate)
    held = sum(e.device_bytes for e in reg.entries())
    used = backend.used
    with torch.inference_mode():
        for seed in (2, 3):
            new_weights(layer, seed)
            gate.open.clear()
            reg.refresh(background=True)
            x = torch.randn(12, 16)
            torch.testing.assert_close(reg.run(MIXED, x=x), (layer(x) * 2).relu())  # served eagerly: arms the pools
            gate.open.set()
            reg.wait_captured()
            torch.testing.assert_close(reg.run(MIXED, x=x), (layer(x) * 2).relu())
            assert len(backend.keepers) == 1 + breakable and backend.used == used, "the dropped pools taken again"
            assert sum(e.device_bytes for e in reg.entries()) == held
    assert backend.waited == 2 * breakable, "each taken after its fence"
    assert backend.fenced_on == [threading.get_ident()] * 2, "fences made by run() on the serving thread"
    assert len(reg) == len(MIXED_PLAN) and backend.alive() == 1 + breakable


def test_pools_no_run_armed_are_not_taken_and_go_once_the_capture_thread_is_idle() -> None:
    """A sync whose keys are captured again before any run() (``wait_captured()`` straight after ``refresh()``)
    takes new pools: the dropped graphs' outputs are still valid; the pools left are let go once the thread is idle."""
    reg, backend, layer, breakable = mixed_registry()
    with torch.inference_mode():
        new_weights(layer, 2)
        reg.refresh(background=True)
        reg.wait_captured()
    assert backend.waited == 0 and len(backend.keepers) == 1 + 2 * breakable
    assert backend.alive() == 1 + breakable, "the old pools went"


def test_a_failed_background_capture_does_not_keep_its_pool() -> None:
    """A key whose background capture fails keeps its error in ``failures()``, not its pool: ``sleep()`` lets every
    pool go."""
    fail = [False]
    gate = Gate()
    reg, backend, layer, breakable = mixed_registry(gate, fail)
    with torch.inference_mode():
        new_weights(layer, 2)
        fail[0] = True
        gate.open.clear()
        reg.refresh(background=True)
        reg.run(MIXED, x=torch.randn(12, 16))
        gate.open.set()
        with pytest.warns(RuntimeWarning, match="a breakable key's capture failed"):
            reg.wait_captured()
        assert len(reg.failures()) >= 1
        reg.sleep()
    assert backend.alive() == 0


def test_a_foreground_refresh_accounts_only_for_memory_its_captures_go_into() -> None:
    """Keys captured in the background into pools of their own, captured again by a foreground ``refresh()``, go into
    the registry's pool and account for that alone (as a foreground capture of the plan does: the first capture into
    it accounts for the pool); a later capture of a released key accounts for what it took."""
    reg, backend, layer, breakable = mixed_registry()
    with torch.inference_mode():
        new_weights(layer, 2)
        reg.refresh(background=False)
        assert sum(e.device_bytes for e in reg.entries()) == POOL_BYTES
        first = reg.entries()[0]
        assert first.device_bytes == POOL_BYTES
        reg.release(first.key, first.strategy)
        reg.capture([(first.key, first.strategy)])
        assert [e.device_bytes for e in reg.entries() if e.key == first.key and e.strategy == first.strategy] == [0]


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
    sync on (the first background one gives breakable keys pools of their own and warms new streams up), the caching
    allocator's reserved bytes stay flat and the entries account for as much as before.  As in an engine's loop, a
    step is served between ``refresh()`` and the recapture (the gate holds the capture thread until it was)."""
    layer = torch.nn.Linear(512, 512, device="cuda")
    gate = Gate()
    reg = cg.GraphRegistry(lambda batch, x: (doubled(layer(x)).relu() * 2).sum(-1),
                           {"x": cg.StaticInput((64, 512), torch.float32)}, backend="cuda", plugins=make_plugins(gate))
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
            gate.open.clear()
            reg.refresh(background=background)
            served(mixed, 24)  # eagerly while the keys are captured again: ends the dropped graphs' outputs
            gate.open.set()
            reg.wait_captured()
            for batch, rows in ((B.decode(5), 5), (mixed, 24)):
                served(batch, rows)
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
            accounted.append(reg.memory_bytes())
    assert len(reg) == len(plan) and reg.stats().hits == (8 if background else 12)
    assert reserved[-1] - reserved[1] < 2**20, [r / 2**20 for r in reserved]
    assert min(accounted[1:]) >= accounted[1] - 2**20, [a / 2**20 for a in accounted]
