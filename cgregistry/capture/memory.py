"""The memory ledger: the device memory a plan's capture will take, known before it is captured.

Engines size their KV cache before they capture (graphs bake in its address), so they need the graphs' bytes first.
``reg.estimate_memory(plan)`` captures the plan as ``capture(plan)`` would (same order, pool sharing, warm-up stream)
into a scratch pool on static inputs of its own, measures what each key took of the device, and drops everything.

With ``sample=True`` only a sample of each family's ``full`` keys is captured (the first, which sizes the pool, the
last, ``SAMPLE_PER_FAMILY`` between), the others priced from it (kept tensors linear in token count, driver objects
averaged); keys with eager breaks are captured each (docs/performance.md).  What the estimate leaves on the device
(first CUDA work, the driver's dropped graphs) the capture reuses: it is taken off the first keys' bytes.  ``key_bytes``
prices any key for ``CapturePlan.fit(max_bytes=...)``; ``fixed_bytes`` the pool and warm-up.
"""

from __future__ import annotations

import bisect
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from cgregistry.capture.job import CaptureJob, paused_gc, scratch
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.store.catalog import Pair
from cgregistry.messages import text_table

__all__ = ["SAMPLE_PER_FAMILY", "KeyMemory", "MemoryEstimate", "Part", "PoolEstimate", "Probe", "estimate", "estimate_memory"]


# Whole-graph keys of each family a sampled estimate captures: the first (largest), the last, and evenly spaced between.
SAMPLE_PER_FAMILY = 8


@attrs.frozen(slots=True)
class Probe:
    """One key captured to be measured, and its price: what it adds to a plan beside the pool and warm-up every plan pays."""

    key: BatchDescriptor
    strategy: str
    pool_bytes: int  # what its capture grew its pool by (its own pool's size where it has one)
    own_bytes: int  # its price: the driver's graph objects and the tensors it keeps alive (cpu: the graph's own count)
    warmup_bytes: int  # kept for records made by hand (an estimate prices the warm-up once, in ``MemoryEstimate.warmup_bytes``)
    input_bytes: int  # kept for records made by hand (static inputs are the registry's, priced once)
    seconds: float
    kept_bytes: int = 0  # of own_bytes, the tensors it keeps alive (the rest: the driver's graph objects)


@attrs.frozen(slots=True)
class KeyMemory:
    """One key of a plan: the device memory its capture will take, in capture order, and how it is made up."""

    key: BatchDescriptor
    strategy: str
    bytes: int  # what capturing it adds, in order (the first keys also carry the pool, the warm-up, what the estimate left)
    own_bytes: int  # its price, ``key_bytes``: graph objects, kept tensors
    pool_bytes: int  # what its capture grew its pool by (its own pool's size where it has one)
    capture_seconds: float
    probed: bool  # measured; else priced from the measured keys of its family (``key_bytes``, ``sampled``)


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
    keys: tuple[KeyMemory, ...]
    pool_bytes: int  # the shared pool (the largest growth one key gave it)
    warmup_bytes: int  # the rest of the fixed part: capture_bytes less the pool and every key's price (the warm-up's cache)
    static_input_bytes: int  # the registry's own static inputs (allocated when it was made)
    probes: tuple[Probe, ...]

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
        ``CapturePlan.fit(max_bytes=...)``."""
        return _interpolate(self.probes, key, strategy).own_bytes

    def fixed_bytes(self) -> int:
        """What a plan with this estimate's largest keys takes whatever else it holds: the pool and the warm-up."""
        return self.pool_bytes + self.warmup_bytes

    def table(self) -> str:
        rows = [("key", "strategy", "bytes", "own", "pool need", "capture ms", "")]
        for k in self.keys:
            rows.append((str(k.key), k.strategy, _size(k.bytes), _size(k.own_bytes), _size(k.pool_bytes),
                         f"{k.capture_seconds * 1e3:.1f}", "probed" if k.probed else ""))
        summary = (f"{len(self.keys)} keys on {self.backend}: capture "
                   f"{_size(self.capture_bytes)} (pool {_size(self.pool_bytes)}, warm-up {_size(self.warmup_bytes)}, "
                   f"per key {_size(self.capture_bytes - self.pool_bytes - self.warmup_bytes)}), static inputs "
                   f"{_size(self.static_input_bytes)}; about {self.capture_seconds:.2f} s to capture")
        return "\n".join([*text_table(rows), summary])

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "capture_bytes": self.capture_bytes,
            "total_bytes": self.total_bytes, "pool_bytes": self.pool_bytes, "warmup_bytes": self.warmup_bytes,
            "static_input_bytes": self.static_input_bytes, "capture_seconds": self.capture_seconds,
            "keys": [{"key": attrs.asdict(k.key), "strategy": k.strategy, "bytes": k.bytes, "own_bytes": k.own_bytes,
                      "pool_bytes": k.pool_bytes, "capture_seconds": k.capture_seconds, "probed": k.probed} for k in self.keys],
        }


def _interpolate(probes: Sequence[Probe], key: BatchDescriptor, strategy: str) -> Probe:
    """A key's figures from the probes of its strategy (and form and LoRA count, where probed), linear in token count."""
    same = [p for p in probes if p.strategy == strategy]
    if not same:
        priced = sorted({p.strategy for p in probes})
        raise ValueError(
            f"this memory estimate prices no key of strategy {strategy!r} (it prices {priced}): estimate a plan that "
            "holds keys of every strategy to be priced, e.g. reg.estimate_memory(plan) of the plan the engine captures"
        )
    exact = [p for p in same if p.key == key]
    if exact:
        return exact[0]
    lora = ([p for p in same if (p.key.form, p.key.num_active_loras) == (key.form, key.num_active_loras)]
            or [p for p in same if p.key.num_active_loras == key.num_active_loras] or same)
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


@attrs.frozen(slots=True)
class Part:
    """One registry's share of an estimate: its capture job, the keys it will capture (plan order), and the payload
    its eager breaks see (None: the recorded one)."""

    job: CaptureJob
    pairs: Sequence[Pair]
    payload: Any = None


@attrs.frozen(slots=True)
class PoolEstimate:
    """What capturing several registries' plans into their one pool will take, in that order: each registry's
    ``MemoryEstimate`` says what its keys add after the registries before it (a drafter's graphs reuse what the
    target's left free in the pool, so its keys add only their own graph objects and kept tensors)."""

    names: tuple[str, ...]
    parts: tuple[MemoryEstimate, ...]

    def __getitem__(self, name: str) -> MemoryEstimate:
        """The part of registry ``name``."""
        for have, part in zip(self.names, self.parts):
            if have == name:
                return part
        raise KeyError(f"this estimate has no registry {name!r}: it has {list(self.names)}")

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        """The registries' names, in capture order (as a mapping's keys)."""
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def capture_bytes(self) -> int:
        """What capturing every plan, in order, will take from the device."""
        return sum(p.capture_bytes for p in self.parts)

    @property
    def total_bytes(self) -> int:
        """Everything the plans' graphs need, every registry's static inputs included."""
        return sum(p.total_bytes for p in self.parts)

    @property
    def capture_seconds(self) -> float:
        return sum(p.capture_seconds for p in self.parts)

    def table(self) -> str:
        blocks = [f"registry {name!r}\n{part.table()}" for name, part in zip(self.names, self.parts)]
        summary = (f"{len(self.parts)} registries in one pool: capture {_size(self.capture_bytes)}, with static inputs "
                   f"{_size(self.total_bytes)}; about {self.capture_seconds:.2f} s to capture")
        return "\n\n".join([*blocks, summary])

    def to_dict(self) -> dict[str, Any]:
        return {"capture_bytes": self.capture_bytes, "total_bytes": self.total_bytes,
                "capture_seconds": self.capture_seconds,
                "registries": [{"name": name, **part.to_dict()} for name, part in zip(self.names, self.parts)]}


def estimate(parts: Sequence[Part], sample: bool = False) -> list[MemoryEstimate]:
    """Measure and predict the capture of each part's keys by its job, in order into their one pool, one at a time,
    under the context a capture from this thread would run under (not recorded); the per-key predictions are kept for
    inspection.  ``sample``: only a sample of the whole-graph keys captured (``sampled``)."""
    pool = parts[0].job.pool
    for part in parts:
        pool.refuse_if_held("estimate_memory()", part.job.name)
    contexts = [part.job.context_for(part.payload) for part in parts]
    with pool.lock:
        found = estimate_memory(parts, [c.state.run for c in contexts], [c.payload for c in contexts], sample=sample)
    for part, one in zip(parts, found):
        part.job.predicted(one.keys)
    return found


def sampled(order: Sequence[Pair], every: Callable[[Pair], bool] = lambda pair: False,
            per_family: int = SAMPLE_PER_FAMILY) -> list[Pair]:
    """The keys of ``order`` an estimate captures, in that order: every key ``every`` names, and of each other family
    (strategy, uniformity, LoRA count) the first, the last and evenly spaced ones between, ``per_family`` in all."""
    families: dict[tuple[Any, ...], list[Pair]] = {}
    chosen: set[Pair] = set()
    for pair in order:
        if every(pair):
            chosen.add(pair)
        else:
            families.setdefault((pair[1], pair[0].form, pair[0].num_active_loras), []).append(pair)
    for pairs in families.values():
        if len(pairs) <= per_family:
            chosen.update(pairs)
            continue
        last = len(pairs) - 1
        chosen.update(pairs[round(i * last / (per_family - 1))] for i in range(per_family))
    return [pair for pair in order if pair in chosen]


def estimate_memory(
    parts: Sequence[Part], runs: Sequence[Callable[..., Any]], payloads: Sequence[Any], *, sample: bool = False,
) -> list[MemoryEstimate]:
    """Capture each part's keys, in order, as each registry's ``capture`` would, into one scratch pool, measure each
    and let everything go (with ``sample``, a sample of each ``full`` family, the rest priced from it).  ``runs[i]``
    runs a capture under part i's capture context, whose eager breaks see ``payloads[i]``."""
    backend = parts[0].job.backend
    device_memory = getattr(backend, "device_memory", None)
    release = getattr(backend, "release_cached", None) or (lambda: None)
    orders = [list(p.pairs) for p in parts]
    if not sample:
        captured = orders
    else:  # keys with eager work between their graphs keep tensors and reuse caches by what came before: each measured
        captured = [sampled(order, lambda pair: not getattr(part.job.strategy(pair[1]), "whole_graph", False))
                    for part, order in zip(parts, orders)]
    gc.collect()
    release()
    try:
        measured, held = _capture_all(parts, captured, runs, payloads, device_memory)
    finally:  # on an error too: nothing captured for the estimate outlives it (the error's frames are cleared)
        gc.collect()
        release()
    taken = [t for _, t in measured]
    if device_memory is not None and taken:
        # What dropping the scratch graphs gave back is what the capture will take: what the estimate leaves (kernels
        # loaded, cuBLAS handles, what the driver keeps of dead graphs) the capture reuses.  The difference from the
        # keys' own measurements (that, and what ran between them) is taken from, or given to, the first keys.
        change = (held - device_memory()[0]) - sum(taken)
        if change >= 0:
            taken[0] += change
        else:
            for i, t in enumerate(taken):
                cut = min(-change, t)
                taken[i], change = t - cut, change + cut
    found, at = [], 0
    for part, order, done in zip(parts, orders, captured):
        probes = [p for p, _ in measured[at:at + len(done)]]
        found.append(_part_estimate(part, order, probes, taken[at:at + len(done)], device_memory is not None))
        at += len(done)
    return found


def _part_estimate(part: Part, order: Sequence[Pair], probes: list[Probe], taken: list[int], measures: bool) -> MemoryEstimate:
    """One part's estimate of the keys of ``order`` from the probes of those captured and what each took in the joint
    order; a key not captured adds its price (``key_bytes``) and takes its family's interpolated seconds."""
    job = part.job
    if measures:
        probes = _priced_first(probes)
    pool_bytes = max((p.pool_bytes for p in probes), default=0) if measures else 0
    inputs = sum(buf.tensor.untyped_storage().nbytes() for buf in job.buffers.values())
    estimate = MemoryEstimate(job.backend.name, (), pool_bytes, 0, inputs, tuple(probes))
    measured = {(p.key, p.strategy): KeyMemory(p.key, p.strategy, t, estimate.key_bytes(p.key, p.strategy),
                                                p.pool_bytes, p.seconds, True) for p, t in zip(probes, taken)}
    warmup = max(0, sum(taken) - pool_bytes - sum(k.own_bytes for k in measured.values())) if measures else 0
    keys = []
    for key, strategy in order:
        known = measured.get((key, strategy))
        if known is None:
            like = _interpolate(probes, key, strategy)
            price = estimate.key_bytes(key, strategy)
            adds = _adds_like(probes, key, strategy) if measures else None
            known = KeyMemory(key, strategy, price if adds is None else adds, price, like.pool_bytes, like.seconds, False)
        keys.append(known)
    return attrs.evolve(estimate, keys=tuple(keys), warmup_bytes=warmup)


def _adds_like(probes: Sequence[Probe], key: BatchDescriptor, strategy: str) -> int | None:
    """What a whole-graph key not captured adds: the tensors it keeps (interpolated by token count between its family's
    captured keys) and the driver's graph objects, averaged over those keys after the first (the driver hands out graph
    memory in chunks, lumpy per key); None with no key of its family after the first."""
    family = (strategy, key.form, key.num_active_loras)
    of_family = [p for p in probes if (p.strategy, p.key.form, p.key.num_active_loras) == family]
    later = of_family[1:]
    if not later:
        return None
    graphs = sum(p.own_bytes - p.kept_bytes for p in later) / len(later)
    kept = _interpolate([attrs.evolve(p, own_bytes=p.kept_bytes) for p in of_family], key, strategy).own_bytes
    return int(graphs + kept)


def _capture_all(
    parts: Sequence[Part], orders: Sequence[Sequence[Pair]], runs: Sequence[Callable[..., Any]], payloads: Sequence[Any],
    device_memory: Callable[[], tuple[int, int]] | None,
) -> tuple[list[tuple[Probe, int]], int]:
    """Each part's keys captured into one scratch pool, in order, all alive until the last is measured (as while the
    plans are captured), then dropped: each key's probe and what it took of the device (cpu: the emulator's count), and
    the device memory in use with all alive (0 where the backend measures none).  A key's price (``Probe.own_bytes``) is
    what stays whatever else is captured (driver objects, tensors kept between eager breaks); every plan pays the pool's
    growth and the warm-up's cache once (``fixed_bytes``)."""
    backend = parts[0].job.backend
    pool = backend.new_pool()
    live = getattr(backend, "live_bytes", None) or (lambda: 0)
    before_inputs = device_memory()[0] if device_memory is not None else 0
    inputs = [{name: buf.sized(buf.capacity) for name, buf in part.job.buffers.items()} for part in parts]
    scratch_inputs = device_memory()[0] - before_inputs if device_memory is not None else 0  # a capture has its own
    entries: list[Any] = []
    measured = []
    try:
        with paused_gc():
            for part, order, run, payload, part_inputs in zip(parts, orders, runs, payloads, inputs):
                for key, name in order:
                    strategy = part.job.strategy(name)
                    before, live_before = (device_memory(), live()) if device_memory is not None else ((0, 0), 0)
                    with part.job.pool_streams():  # as the capture will run: its warm-up's cache is per stream
                        entry = run(part.job.capture_entry, key, name, strategy, payload, scratch(pool, part_inputs))
                    entries.append(entry)
                    if device_memory is None:  # the emulator counts a graph's bytes, and nothing else
                        measured.append((Probe(key, name, 0, entry.memory_bytes, 0, 0, entry.capture_seconds), entry.memory_bytes))
                        continue
                    used, reserved = device_memory()
                    outside = max(0, (used - before[0]) - (reserved - before[1]))
                    kept = max(0, live() - live_before)  # tensors it keeps alive (results kept between eager breaks)
                    price = outside + kept
                    measured.append((Probe(key, name, entry.memory_bytes, price, 0, 0, entry.capture_seconds, kept),
                                     entry.device_bytes))
        if device_memory is None:
            return measured, 0
        backend.synchronize()
        return measured, device_memory()[0] - scratch_inputs
    finally:  # the entries die here, also when a capture raised (its traceback keeps this frame)
        entries.clear()
        entry = inputs = part_inputs = None  # noqa: F841


def _priced_first(probes: list[Probe]) -> list[Probe]:
    """The first key's price: what it took outside the allocator also holds the process's first CUDA work (kernels,
    cuBLAS handles), and its seconds that work's time, so it is priced (bytes and seconds) as the next key of its
    strategy and LoRA count, else of its strategy, else as the median key (a plan of one key keeps its own)."""
    if len(probes) < 2:
        return probes
    first, rest = probes[0], probes[1:]
    like = ([p for p in rest if (p.strategy, p.key.num_active_loras) == (first.strategy, first.key.num_active_loras)]
            or [p for p in rest if p.strategy == first.strategy])
    model = like[0] if like else sorted(rest, key=lambda p: p.own_bytes)[len(rest) // 2]
    return [attrs.evolve(first, own_bytes=model.own_bytes, seconds=model.seconds), *rest]
