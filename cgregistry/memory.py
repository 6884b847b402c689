"""The memory ledger: the device memory a plan's capture will take, known before it is captured.

Engines size their KV cache before they capture (graphs bake in its address), so they need the
graphs' bytes first.  ``reg.estimate_memory(plan)`` captures a few of the plan's keys (the
largest and the smallest of each strategy and LoRA count; every key where the backend measures
no device memory, as the cpu emulator) into pools of their own, on static inputs of their own at
their fills (so nothing of the engine's state is touched), measures each, drops it, and gives the
memory back before it returns.  Each probe splits what the device gave it into the pool the graph
needs (its activations and outputs), the warm-up's activations the caching allocator keeps, and
the rest: the driver's graph objects.  What each further key adds to a shared pool (its graph
objects, its outputs kept alive, the pool's rounding: a megabyte or two, lost in one capture's
rounding) is measured first, over ``GRAPH_OBJECT_COPIES`` copies of each group's smallest key captured
into one scratch pool after the largest key (as a plan's capture fills its pool), all groups' copies
alive together (the driver hands what a dropped graph held to the next one, which would then measure
as free).  The other keys are interpolated by token count.

A plan captured in the foreground shares one pool, as large as its largest need, and the warm-up
of its largest key; each key adds its graph objects.  In the background a strategy with eager
breaks gets a pool per key, and every key static inputs of its own.  ``MemoryEstimate`` says it
per key, in capture order, and ``key_bytes`` prices any key for ``CapturePlan.fit(max_bytes=...)``.
"""

from __future__ import annotations

import bisect
import gc
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from cgregistry.background import background_order
from cgregistry.capture import EntryCapture, paused_gc
from cgregistry.descriptor import BatchDescriptor
from cgregistry.entries import Pair
from cgregistry.text import text_table

__all__ = ["GRAPH_OBJECT_COPIES", "KeyMemory", "MemoryEstimate", "Probe", "estimate_memory"]

GRAPH_OBJECT_COPIES = 8  # captures of a group's smallest key into one pool that measure what a key adds to it
Group = tuple[str, int]  # (strategy, LoRA count): keys whose bytes are measured and interpolated together


@attrs.frozen(slots=True)
class Probe:
    """One key captured to be measured: what its capture took, split by where it went."""

    key: BatchDescriptor
    strategy: str
    pool_bytes: int  # the pool it needs (the graph's activations and outputs)
    own_bytes: int  # beside any pool: the driver's graph objects (on cpu: the graph's own count)
    warmup_bytes: int  # the warm-up's activations the caching allocator keeps
    input_bytes: int  # static inputs of its own (a background capture's)
    seconds: float


@attrs.frozen(slots=True)
class KeyMemory:
    """One key of a plan: the device memory its capture will take, in capture order, and how it is made up."""

    key: BatchDescriptor
    strategy: str
    bytes: int  # what capturing it adds, in order: the first key carries the shared pool and the warm-up
    own_bytes: int  # what it alone adds beside the shared pool (graph objects, its own pool and inputs in the background)
    pool_bytes: int  # its need in a pool
    capture_seconds: float
    probed: bool  # measured by a probe (else interpolated from probes of its strategy)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


@attrs.frozen(slots=True)
class MemoryEstimate:
    """What capturing a plan will take: per key, the shared pool, the warm-up's cache and the static inputs."""

    backend: str
    background: bool
    keys: tuple[KeyMemory, ...]
    pool_bytes: int  # the shared pool (its largest need)
    warmup_bytes: int  # the warm-up's activations the caching allocator keeps after capture
    static_input_bytes: int  # the registry's own static inputs (allocated when it was made)
    probes: tuple[Probe, ...]
    shared_strategies: frozenset[str] = frozenset()  # strategies whose background keys share the pool (whole graphs)

    @property
    def capture_bytes(self) -> int:
        """What ``capture(plan)`` will take from the device (the static inputs exist already)."""
        return sum(k.bytes for k in self.keys)

    @property
    def total_bytes(self) -> int:
        """Everything the plan's graphs need, the static inputs included."""
        return self.capture_bytes + self.static_input_bytes

    @property
    def capture_seconds(self) -> float:
        return sum(k.capture_seconds for k in self.keys)

    def key_bytes(self, key: BatchDescriptor, strategy: str) -> int:
        """What a key of ``strategy`` adds beside the shared pool, for any key (interpolated): the price of a key in
        ``CapturePlan.fit(max_bytes=...)``.  In a background estimate that includes the key's own static inputs, and
        its own pool where its strategy does not share one (as ``keys`` counts them)."""
        f = _interpolate(self.probes, key, strategy)
        if not self.background:
            return f.own_bytes
        return f.own_bytes + f.input_bytes + (0 if strategy in self.shared_strategies else f.pool_bytes)

    def fixed_bytes(self) -> int:
        """What a plan with this estimate's largest keys takes whatever else it holds: the pool and the warm-up."""
        return self.pool_bytes + self.warmup_bytes

    def table(self) -> str:
        rows = [("key", "strategy", "bytes", "own", "pool need", "capture ms", "")]
        for k in self.keys:
            rows.append((str(k.key), k.strategy, _size(k.bytes), _size(k.own_bytes), _size(k.pool_bytes),
                         f"{k.capture_seconds * 1e3:.1f}", "probed" if k.probed else ""))
        summary = (f"{len(self.keys)} keys on {self.backend}{' (background)' if self.background else ''}: capture "
                   f"{_size(self.capture_bytes)} (pool {_size(self.pool_bytes)}, warm-up {_size(self.warmup_bytes)}, "
                   f"per key {_size(self.capture_bytes - self.pool_bytes - self.warmup_bytes)}), static inputs "
                   f"{_size(self.static_input_bytes)}; about {self.capture_seconds:.2f} s to capture")
        return "\n".join([*text_table(rows), summary])

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "background": self.background, "capture_bytes": self.capture_bytes,
            "total_bytes": self.total_bytes, "pool_bytes": self.pool_bytes, "warmup_bytes": self.warmup_bytes,
            "static_input_bytes": self.static_input_bytes, "capture_seconds": self.capture_seconds,
            "keys": [{"key": attrs.asdict(k.key), "strategy": k.strategy, "bytes": k.bytes, "own_bytes": k.own_bytes,
                      "pool_bytes": k.pool_bytes, "capture_seconds": k.capture_seconds, "probed": k.probed} for k in self.keys],
        }


def _interpolate(probes: Sequence[Probe], key: BatchDescriptor, strategy: str) -> Probe:
    """A key's figures from the probes of its strategy (and LoRA count, where probed), linear in token count."""
    same = [p for p in probes if p.strategy == strategy]
    if not same:
        raise KeyError(f"no probe of strategy {strategy!r}: estimate a plan that holds its keys")
    exact = [p for p in same if p.key == key]
    if exact:
        return exact[0]
    lora = [p for p in same if p.key.num_active_loras == key.num_active_loras] or same
    ordered = sorted(lora, key=lambda p: p.key.num_tokens)
    tokens = [p.key.num_tokens for p in ordered]
    at = bisect.bisect_left(tokens, key.num_tokens)
    low, high = ordered[max(0, min(at - 1, len(ordered) - 1))], ordered[min(at, len(ordered) - 1)]
    if low is high or high.key.num_tokens == low.key.num_tokens:
        share = 0.0
    else:
        share = min(1.0, max(0.0, (key.num_tokens - low.key.num_tokens) / (high.key.num_tokens - low.key.num_tokens)))

    def mix(a: float, b: float) -> float:
        return a + (b - a) * share

    return Probe(key, strategy, int(mix(low.pool_bytes, high.pool_bytes)), int(mix(low.own_bytes, high.own_bytes)),
                 int(mix(low.warmup_bytes, high.warmup_bytes)), int(mix(low.input_bytes, high.input_bytes)),
                 mix(low.seconds, high.seconds))


def _groups(pairs: Sequence[Pair]) -> dict[Group, list[Pair]]:
    """``pairs`` by strategy and LoRA count, in order."""
    groups: dict[Group, list[Pair]] = {}
    for key, strategy in pairs:
        groups.setdefault((strategy, key.num_active_loras), []).append((key, strategy))
    return groups


def _probe_keys(pairs: Sequence[Pair]) -> list[Pair]:
    """The largest and the smallest key of each strategy and LoRA count: what interpolation needs."""
    groups = _groups(pairs)

    def size(pair: Pair) -> tuple[int, int]:
        return (pair[0].num_tokens, pair[0].num_reqs or 0)

    chosen = {p for group in groups.values() for p in (max(group, key=size), min(group, key=size))}
    return sorted(chosen, key=size, reverse=True)


def estimate_memory(
    one: EntryCapture, pairs: Sequence[Pair], strategies: Callable[[str], Any], run: Callable[..., Any], payload: Any,
    *, background: bool, whole_graph: Callable[[str], bool],
) -> MemoryEstimate:
    """Probe ``pairs`` (plan order) and predict their capture; nothing stays behind (see the module's docstring).

    ``strategies(name)`` gives a strategy object; ``run(fn, *args, **kwargs)`` runs a capture under the registry's
    capture context; ``whole_graph(name)``: the strategy shares the pool in the background too.
    """
    backend = one.backend
    device_memory = getattr(backend, "device_memory", None)
    release = getattr(backend, "release_cached", None) or (lambda: None)
    measured = device_memory is not None
    todo = _probe_keys(pairs) if measured else list(pairs)
    probes: list[Probe] = []
    with paused_gc():
        own: dict[Group, int] = {}
        if measured and todo:
            _probe(one, todo[0], strategies, run, payload, device_memory, release)  # first use: kernels load, handles are made
            own = _graph_object_bytes(todo, one, strategies, run, payload, device_memory, release)
        for pair in todo:
            probes.append(_probe(one, pair, strategies, run, payload, device_memory, release))
        if own:
            probes = [attrs.evolve(p, own_bytes=own[(p.strategy, p.key.num_active_loras)]) for p in probes]
    gc.collect()
    release()
    figures = {pair: _interpolate(probes, *pair) for pair in pairs}
    order = background_order(pairs) if background else list(pairs)
    shared = [p for p in order if not background or whole_graph(p[1])]
    pool = max((figures[p].pool_bytes for p in shared), default=0)
    warmup = max((p.warmup_bytes for p in probes), default=0)
    keys = []
    for i, pair in enumerate(order):
        f = figures[pair]
        own = f.own_bytes + (f.input_bytes + (0 if whole_graph(pair[1]) else f.pool_bytes) if background else 0)
        first = (pool if shared and pair == shared[0] else 0) + (warmup if i == 0 else 0)
        keys.append(KeyMemory(pair[0], pair[1], own + first, own, f.pool_bytes, f.seconds, any(p.key == pair[0] and p.strategy == pair[1] for p in probes)))
    static = sum(buf.tensor.untyped_storage().nbytes() for buf in one.buffers.values())
    shared_strategies = frozenset(name for name in {p[1] for p in pairs} if whole_graph(name))
    return MemoryEstimate(backend.name, background, tuple(keys), pool, warmup, static, tuple(probes), shared_strategies)


def _graph_object_bytes(
    pairs: Sequence[Pair], one: EntryCapture, strategies: Callable[[str], Any], run: Callable[..., Any], payload: Any,
    device_memory: Callable[[], tuple[int, int]], release: Callable[[], None],
) -> dict[Group, int]:
    """What a key of each group (strategy, LoRA count) adds to a shared pool, measured over ``GRAPH_OBJECT_COPIES`` copies.

    ``pairs`` largest first.  A plan's capture takes its largest key first: one pool as large as that key's need,
    and the warm-up's activations left in the caching allocator; each further key adds its graph objects and
    whatever of its own does not fit in those (outputs kept alive, static buffers between eager breaks).  So the
    largest key is captured first into one scratch pool, unmeasured, then each group's smallest key
    ``GRAPH_OBJECT_COPIES`` times into the same pool; what the device gave the copies, less their own scratch
    inputs, is shared out.  The driver keeps what dead graphs held and gives it to later ones, so every group's
    copies stay alive until all are measured (a group measured in what an earlier one gave back would see none of
    its own), and this runs before the probes capture and drop theirs.  A second estimate in the same process
    still measures less than the first (docs/performance.md).
    """
    own = {}
    release()
    pool = one.backend.new_pool()

    def capture(key: BatchDescriptor, name: str) -> Any:
        return run(one.capture, key, name, strategies(name), payload, scratch=True, scratch_pool=pool)

    alive: list[Any] = [capture(*pairs[0])]  # the plan's pool and cached warm-up, as capture has them: not measured
    for group, members in _groups(pairs).items():
        key, name = min(members, key=lambda pair: pair[0].num_tokens)  # the group's smallest (the first, on a tie)
        used, reserved = device_memory()
        copies = [capture(key, name) for _ in range(GRAPH_OBJECT_COPIES)]
        used_after, reserved_after = device_memory()
        # Outside the caching allocator: graph objects.  Inside: the copies' scratch inputs (which may also have come
        # out of the cached warm-up), then what each copy keeps in the pool.
        inputs = sum(buf.tensor.untyped_storage().nbytes() for entry in copies for buf in entry.buffers or ())
        held = reserved_after - reserved
        outside = max(0, used_after - used - held)
        own[group] = (outside + max(0, held - inputs)) // GRAPH_OBJECT_COPIES
        alive += copies
    del alive, copies
    gc.collect()
    release()
    return own


def _probe(
    one: EntryCapture, pair: Pair, strategies: Callable[[str], Any], run: Callable[..., Any], payload: Any,
    device_memory: Callable[[], tuple[int, int]] | None, release: Callable[[], None],
) -> Probe:
    """Capture ``pair`` into a scratch pool on scratch inputs, measure, and let everything go."""
    key, name = pair
    if device_memory is None:
        entry = run(one.capture, key, name, strategies(name), payload, scratch=True)
        return Probe(key, name, 0, entry.memory_bytes, 0, 0, entry.capture_seconds)
    release()
    used, reserved = device_memory()
    entry = run(one.capture, key, name, strategies(name), payload, scratch=True)
    used_after, reserved_after = device_memory()
    device, held = used_after - used, reserved_after - reserved
    inputs = sum(buf.tensor.untyped_storage().nbytes() for buf in entry.buffers or ())
    pool = entry.memory_bytes
    probe = Probe(key, name, pool, max(0, device - held), max(0, held - pool - inputs), inputs, entry.capture_seconds)
    del entry
    gc.collect()
    release()
    return probe

