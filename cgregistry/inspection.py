"""Inspection records: entries, stats, snapshots, and the tables that print them.

Plain data.  A registry hands out ``EntryInfo`` and ``Stats``; a ``Snapshot`` freezes them to versioned JSON,
loadable without a registry (or torch devices) for offline inspection, ``explain`` against its keys included.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.errors import SnapshotError
from cgregistry.key.matcher import DEFAULT_PREFERENCE, Candidate, Explanation, Match, Matcher
from cgregistry.messages import text_table

__all__ = [
    "PLAN_CHANGE_REASONS", "SNAPSHOT_SCHEMA", "Candidate", "CapturePhases", "ClassStats", "EntryInfo", "Explanation", "Match", "PlanChange", "PlanScore", "Refreshed", "Slept", "Snapshot", "SnapshotError",
    "Stats", "entries_table",
    "key_class", "load_snapshot",
]

# Why adaptation proposes a plan change, in the order ``cgregistry.plan.adapt.propose`` checks them.
PLAN_CHANGE_REASONS: dict[str, str] = {
    "budget": "the current keys exceed max_graphs or max_bytes",
    "coverage": "the fitted plan serves more observed steps from graphs",
    "padding": "the fitted plan saves at least min_gain of the padded tokens",
}

# 2: stats.bad_batches; 3: entries' device_bytes and predicted_bytes; 4: entries' phases; 5: stats.misses_by_form
SNAPSHOT_SCHEMA = 5
_READABLE_SCHEMAS = (1, 2, 3, 4, 5)  # older schemas lack only fields that have defaults (misses_by_form: read as such)


def key_class(key: BatchDescriptor, strategy: str) -> str:
    """The class a key belongs to for statistics: strategy, form (``BatchDescriptor.form_label``), LoRA count."""
    return f"{strategy}/{key.form_label}/lora{key.num_active_loras}"


@attrs.frozen(slots=True)
class CapturePhases:
    """Where capture seconds went: compiling (dynamo and Inductor), the warm-up run (less compiling), ending the graphs
    (the driver instantiates them then), and the rest (recording the step, checking its outputs).  They add up to the
    capture's seconds; ``CapturePhases.of(reg.capture(plan))`` sums a plan's."""

    compile: float = 0.0
    warmup: float = 0.0
    record: float = 0.0
    instantiate: float = 0.0

    @property
    def total(self) -> float:
        return sum(attrs.astuple(self))

    def __add__(self, other: CapturePhases) -> CapturePhases:
        if not isinstance(other, CapturePhases):
            return NotImplemented
        return CapturePhases(*(a + b for a, b in zip(attrs.astuple(self), attrs.astuple(other))))

    @classmethod
    def of(cls, entries: Iterable[EntryInfo]) -> CapturePhases:
        """The phases of ``entries`` (``capture()``'s result, ``entries()``) summed; entries without phases add none."""
        return sum((e.phases for e in entries if e.phases is not None), cls())

    def summary(self) -> str:
        """One line: the total and each phase's seconds and share."""
        total = self.total
        parts = [f"{name} {getattr(self, name):.2f} s ({getattr(self, name) / total:.0%})" if total else f"{name} 0.00 s"
                 for name in ("compile", "warmup", "record", "instantiate")]
        return f"{total:.2f} s: " + ", ".join(parts)


@attrs.frozen(slots=True)
class EntryInfo:
    """A read-only view of one captured entry."""

    key: BatchDescriptor
    strategy: str
    backend: str
    capture_seconds: float
    memory_bytes: int
    replays: int
    padded_tokens: int
    last_step: int  # the registry's step counter at this entry's last replay (0: never replayed)
    segments: int | None = None  # graph segments, where the strategy has them
    breaks: int | None = None  # eager breaks between segments, where the strategy has them
    device_bytes: int | None = None  # device memory its capture took (pool, warm-up, driver objects; cpu: memory_bytes)
    predicted_bytes: int | None = None  # what the last reg.estimate_memory() predicted for it
    phases: CapturePhases | None = None  # where its capture seconds went

    @property
    def key_class(self) -> str:
        return key_class(self.key, self.strategy)


@attrs.frozen(slots=True)
class Refreshed:
    """What ``refresh()`` did: keys kept (their graphs read the weights where they are), keys captured again (now, or
    pending capture between the steps that follow with ``background``), and the watched tensors that had moved."""

    kept: tuple[tuple[BatchDescriptor, str], ...]
    recaptured: tuple[tuple[BatchDescriptor, str], ...]
    moved: tuple[str, ...]
    background: bool


@attrs.frozen(slots=True)
class Slept:
    """What ``sleep()`` released: the graphs (and their keys, kept for ``wake()``) and the bytes it measured."""

    keys: tuple[tuple[BatchDescriptor, str], ...]  # the plan wake() captures again, hottest first
    memory_bytes: int  # the released graphs' measured memory
    input_bytes: int  # the registry's own static inputs
    lazy: tuple[tuple[BatchDescriptor, str], ...] = ()  # keys lazy at sleep (never used, or evicted): lazy again at wake


@attrs.frozen(slots=True)
class ClassStats:
    """Counters of one key class (see ``key_class``)."""

    entries: int
    replays: int
    graph_tokens: int
    padded_tokens: int


# Why a batch ran eagerly, as counted in ``Stats.misses_by_reason``.
MISS_REASONS = {
    "no_graphs": "run() before any capture: nothing captured or planned",
    "no_key_for_class": "no key of the batch's form (uniform or mixed, spec depth) and LoRA count at any size",
    "above_largest_key": "keys of its form and LoRA count exist, all smaller than the batch",
    "no_request_count": "every key of its form bakes in a request count, and the batch gives none (num_reqs=None)",
    "above_capacity": "more tokens or requests than a static input holds",
    "failed": "the key that would serve it failed (at capture or replay) and was removed",
    "excluded": "every key covering it belongs to a strategy the call excluded (run(..., exclude=...))",
    "padding_cap": "keys cover it, but each allowed strategy's best key pads more than the registry's padding cap",
    "capturing": "a key that covers it is pending capture between steps (capture(..., background=True), refresh, wake)",
    "asleep": "the registry is asleep (reg.sleep()): every batch runs eagerly until reg.wake()",
}


@attrs.frozen(slots=True)
class Stats:
    """Counters since construction or the last reset."""

    hits: int
    misses: int
    eager_fallbacks: int
    graph_tokens: int  # real tokens served by graphs
    padded_tokens: int  # padding tokens computed by graphs
    eager_tokens: int
    by_strategy: Mapping[str, int]  # replays per strategy
    entry_failures: int = 0  # keys in failures(): captures that failed, entries removed because their replay raised
    by_class: Mapping[str, ClassStats] = attrs.field(factory=dict)
    misses_by_form: Mapping[str, int] = attrs.field(factory=dict)  # "uniform" / "mixed"
    bad_batches: int = 0  # runs whose step raised on the batch itself when run eagerly (no entry was removed)
    lazy_captures: int = 0  # entries captured on a first miss
    evictions: int = 0  # entries dropped to stay under the memory budget
    misses_by_reason: Mapping[str, int] = attrs.field(factory=dict)  # MISS_REASONS: why each miss ran eagerly
    background_captures: int = 0  # pending keys captured between steps
    plan_changes: int = 0  # plan changes made by adaptation (GraphRegistry(adapt=...))
    # pending keys warmed up again because capture() recorded another capture context before their recording
    stale_captures: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def padding_ratio(self) -> float:
        """Padded tokens over all tokens computed by graphs."""
        total = self.graph_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


SORT_KEYS = {
    "key": lambda e: (-e.key.num_tokens, -(e.key.num_reqs or 0), -e.key.num_active_loras, -e.key.spec_depth, e.strategy),
    "replays": lambda e: (-e.replays, -e.key.num_tokens),
    "padding": lambda e: (-e.padded_tokens, -e.key.num_tokens),
    "memory": lambda e: (-e.memory_bytes, -e.key.num_tokens),
    "capture": lambda e: (-e.capture_seconds, -e.key.num_tokens),
    "recent": lambda e: (-e.last_step, -e.key.num_tokens),
}


def filter_entries(
    entries: Iterable[EntryInfo],
    *,
    strategy: str | None = None,
    uniform: bool | None = None,
    spec_depth: int | None = None,
    num_active_loras: int | None = None,
    used: bool | None = None,
    sort: str = "key",
) -> list[EntryInfo]:
    """Entries that match every given filter, sorted (``SORT_KEYS``: key, replays, padding, memory, capture, recent)."""
    if sort not in SORT_KEYS:
        raise ValueError(f"unknown sort {sort!r}; expected one of {', '.join(SORT_KEYS)}")
    out = [
        e
        for e in entries
        if (strategy is None or e.strategy == strategy)
        and (uniform is None or e.key.uniform == uniform)
        and (spec_depth is None or e.key.spec_depth == spec_depth)
        and (num_active_loras is None or e.key.num_active_loras == num_active_loras)
        and (used is None or (e.replays > 0) == used)
    ]
    out.sort(key=SORT_KEYS[sort])
    return out


def entries_table(entries: Iterable[EntryInfo]) -> list[str]:
    """Entries as aligned text rows: key, strategy, replays, padding, capture time, memory (the graph's own count, the
    device's, and what a memory estimate predicted), segments."""
    rows = [("key", "strategy", "replays", "padded tok", "capture ms", "memory", "device", "predicted", "segments")]
    for e in entries:
        segments = "-" if e.segments is None else f"{e.segments} ({e.breaks or 0} breaks)"
        device = "-" if e.device_bytes is None else _size(e.device_bytes)
        predicted = "-" if e.predicted_bytes is None else _size(e.predicted_bytes)
        rows.append((str(e.key), e.strategy, str(e.replays), str(e.padded_tokens), f"{e.capture_seconds * 1e3:.1f}",
                     _size(e.memory_bytes), device, predicted, segments))
    return text_table(rows)


def stats_line(stats: Stats, entries: int, backend: str, memory_bytes: int) -> str:
    """One summary line under an entries table."""
    line = (
        f"{entries} entries on {backend}, {_size(memory_bytes)}; hits {stats.hits}, misses {stats.misses}, "
        f"padding {stats.padding_ratio:.1%} of graph tokens"
    )
    why = ", ".join(f"{reason} {n}" for reason, n in stats.misses_by_reason.items() if n)
    if why:
        line += f" ({why})"
    extras = [f"{name} {value}" for name, value in (("lazy captures", stats.lazy_captures), ("evictions", stats.evictions), ("failed entries", stats.entry_failures)) if value]
    return line + ("; " + ", ".join(extras) if extras else "")


# ---------------------------------------------------------------- snapshots


def _descriptor_from(data: object, where: str) -> BatchDescriptor:
    if not isinstance(data, Mapping):
        raise SnapshotError(f"snapshot field {where}: expected an object, got {data!r}")
    try:
        return BatchDescriptor(**data)
    except (TypeError, ValueError) as exc:
        raise SnapshotError(f"snapshot field {where}: not a BatchDescriptor: {exc}") from None


def _entry_to_dict(e: EntryInfo) -> dict[str, Any]:
    data = attrs.asdict(e, recurse=False)
    data["key"] = attrs.asdict(e.key)
    data["phases"] = None if e.phases is None else attrs.asdict(e.phases)
    return data


def _stats_to_dict(s: Stats) -> dict[str, Any]:
    data = attrs.asdict(s, recurse=False)
    data.update(by_class={k: attrs.asdict(v) for k, v in s.by_class.items()}, by_strategy=dict(s.by_strategy),
                misses_by_form=dict(s.misses_by_form), misses_by_reason=dict(s.misses_by_reason))
    return data


def _bad(where: str, expected: str, value: object) -> SnapshotError:
    return SnapshotError(f"snapshot field {where}: expected {expected}, got {value!r}")


def _count(value: object, where: str) -> int:
    if type(value) is not int or value < 0:
        raise _bad(where, "an int >= 0", value)
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, "a string", value)
    return value


def _items(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(where, "a list", value)
    return value


def _table(value: object, where: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _bad(where, "an object", value)
    return value


def _finite(value: object, where: str, expected: str = "a finite number >= 0") -> float:
    """A real number in [0, inf): a JSON number, or what a registry's own dict may hold (``np.float64``), never a bool."""
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 <= value < float("inf")):
        raise _bad(where, expected, value)
    return float(value)


def _pending_from(value: object, where: str) -> tuple[BatchDescriptor, str]:
    item = _table(value, where)
    if item.keys() != {"key", "strategy"}:
        raise _bad(where, "an object with fields key and strategy", value)
    return _descriptor_from(item["key"], f"{where}.key"), _text(item["strategy"], f"{where}.strategy")


# How each field type of the snapshot records is read back: (value, where) -> value.
_READERS: dict[str, Any] = {
    "int": _count,
    "int | None": lambda v, w: None if v is None else _count(v, w),
    "float": lambda v, w: _finite(v, w, "a number of seconds >= 0"),
    "float | None": lambda v, w: None if v is None else _finite(v, w),
    "str": _text,
    "BatchDescriptor": _descriptor_from,
    "tuple[str, ...]": lambda v, w: tuple(_text(x, f"{w}[{i}]") for i, x in enumerate(_items(v, w))),
    "Mapping[str, int]": lambda v, w: {k: _count(x, f"{w}[{k!r}]") for k, x in _table(v, w).items()},
    "Mapping[str, str]": lambda v, w: {k: _text(x, f"{w}[{k!r}]") for k, x in _table(v, w).items()},
    "Mapping[str, ClassStats]": lambda v, w: {k: _record(ClassStats, x, f"{w}[{k!r}]") for k, x in _table(v, w).items()},
    "Stats": lambda v, w: _record(Stats, v, w),
    "CapturePhases | None": lambda v, w: None if v is None else _record(CapturePhases, v, w),
    "tuple[EntryInfo, ...]": lambda v, w: tuple(_record(EntryInfo, x, f"{w}[{i}]") for i, x in enumerate(_items(v, w))),
    "tuple[tuple[BatchDescriptor, str], ...]": lambda v, w: tuple(_pending_from(x, f"{w}[{i}]") for i, x in enumerate(_items(v, w))),
}


def _record(cls: type, data: object, where: str) -> Any:
    """An attrs record from its JSON form: every field checked against its declared type, named on error."""
    fields = attrs.fields(cls)
    table = _table(data, where or "snapshot")
    values = {}  # fields this version does not know are ignored: a later writer may add some
    for f in fields:
        path = f"{where}.{f.name}" if where else f.name
        if f.name not in table:
            if f.default is attrs.NOTHING:
                raise SnapshotError(f"snapshot lacks field {path!r}")
            continue
        values[f.name] = _READERS[f.type](table[f.name], path)
    return cls(**values)


@attrs.frozen(slots=True)
class Snapshot:
    """A registry's entries and counters at one moment; JSON round-trips through ``to_dict``/``load_snapshot``."""

    name: str
    backend: str
    device: str
    created: str  # ISO 8601, UTC
    preference: tuple[str, ...]
    entries: tuple[EntryInfo, ...]
    stats: Stats
    memory_bytes: int
    pending: tuple[tuple[BatchDescriptor, str], ...] = ()  # lazy keys not captured yet
    failures: Mapping[str, str] = attrs.field(factory=dict)  # "key [strategy]" -> error
    schema: int = SNAPSHOT_SCHEMA
    max_padding_tokens: int | None = None  # the registry's padding cap, so explain() refuses what it refused
    max_padding_ratio: float | None = None
    capturing: tuple[tuple[BatchDescriptor, str], ...] = ()  # keys pending capture between steps
    plan_changes: tuple[str, ...] = ()  # the last plan changes adaptation made, one line each

    def to_dict(self) -> dict[str, Any]:
        data = {"schema": self.schema, **attrs.asdict(self, recurse=False)}
        data.update(preference=list(self.preference), entries=[_entry_to_dict(e) for e in self.entries],
                    stats=_stats_to_dict(self.stats), pending=[_pair_dict(p) for p in self.pending],
                    failures=dict(self.failures), capturing=[_pair_dict(p) for p in self.capturing],
                    plan_changes=list(self.plan_changes))
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Snapshot:
        """A snapshot from its JSON form; a missing or mistyped field is a ``SnapshotError`` naming it."""
        schema = data.get("schema") if isinstance(data, Mapping) else None
        if type(schema) is not int or schema not in _READABLE_SCHEMAS:
            raise SnapshotError(f"snapshot schema {schema!r} is not supported; this cgregistry reads schemas {_READABLE_SCHEMAS}")
        stats = data.get("stats")
        if schema < 5 and isinstance(stats, Mapping) and "misses_by_kind" in stats:  # the field's name before schema 5
            stats = {("misses_by_form" if k == "misses_by_kind" else k): v for k, v in stats.items()}
            data = {**data, "stats": stats}
        return _record(cls, data, "")

    def filtered(self, **filters: Any) -> list[EntryInfo]:
        """Entries after ``filter_entries`` (strategy, uniform, spec_depth, num_active_loras, used, sort)."""
        return filter_entries(self.entries, **filters)

    def explain(self, actual: BatchDescriptor) -> Explanation:
        """How the snapshot's keys would serve ``actual`` under its padding cap (lazy keys not included; keys pending
        capture between steps listed as such, as ``GraphRegistry.explain`` lists them)."""
        return Matcher(
            ((e.key, e.strategy) for e in self.entries), self.preference or DEFAULT_PREFERENCE,
            max_padding_tokens=self.max_padding_tokens, max_padding_ratio=self.max_padding_ratio,
        ).explain(actual, capturing=self.capturing)

    def table(self, **filters: Any) -> str:
        lines = entries_table(self.filtered(**filters))
        lines.append(stats_line(self.stats, len(self.entries), self.backend, self.memory_bytes))
        return "\n".join(lines)


def load_snapshot(source: str | Path | Mapping[str, Any]) -> Snapshot:
    """A snapshot from a JSON file or an already-parsed dict."""
    if isinstance(source, Mapping):
        return Snapshot.from_dict(source)
    path = Path(source)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise SnapshotError(f"{path}: not a snapshot: the file is not UTF-8 text (a binary file?)") from None
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"{path}: not JSON: {exc}") from None
    except RecursionError:
        raise SnapshotError(f"{path}: not a snapshot: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise SnapshotError(f"{path}: a snapshot is a JSON object, got {type(data).__name__}")
    return Snapshot.from_dict(data)


Pair = tuple[BatchDescriptor, str]  # (key, strategy name)


@attrs.frozen(slots=True)
class PlanScore:
    """How a set of keys serves the observed traffic: the numbers a change is judged on."""

    graphs: int
    steps: int
    graph_steps: int
    real_tokens: int  # tokens of graph-served steps
    padded_tokens: int

    @classmethod
    def of(cls, report: Any) -> PlanScore:
        """The score of a ``cgregistry.plan.fit.PlanReport``."""
        return cls(report.graphs, report.steps, report.graph_steps, report.real_tokens, report.padded_tokens)

    @property
    def padding_ratio(self) -> float:
        """Padded tokens over all tokens computed by graphs (``PlanReport.padding_ratio``)."""
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0


def _pair_dict(pair: Pair) -> dict[str, Any]:
    return {"key": attrs.asdict(pair[0]), "strategy": pair[1]}


def _pair_of(data: Mapping[str, Any]) -> Pair:
    return BatchDescriptor(**data["key"]), data["strategy"]


@attrs.frozen(slots=True)
class PlanChange:
    """One refit's outcome: keys to capture (largest first), keys to release, and why.  ``before`` and ``after`` score
    the current and the new keys on the traffic the refit saw; ``observed``: the registry's step count when proposed;
    ``reason``: a ``PLAN_CHANGE_REASONS`` name."""

    added: tuple[Pair, ...]
    removed: tuple[Pair, ...]
    before: PlanScore
    after: PlanScore
    observed: int
    reason: str

    @property
    def gain(self) -> float:
        """The fraction of padded tokens saved (negative when a budget cut costs padding; 0 with none before)."""
        b = self.before.padded_tokens
        return (b - self.after.padded_tokens) / b if b else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The change as JSON-serialisable data (``from_dict`` reads it back)."""
        return {"reason": self.reason, "observed": self.observed, "added": [_pair_dict(p) for p in self.added],
                "removed": [_pair_dict(p) for p in self.removed], "before": attrs.asdict(self.before),
                "after": attrs.asdict(self.after), "gain": self.gain}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanChange:
        """A change from ``to_dict``'s form (``gain`` is derived, so it is not read)."""
        if data.get("reason") not in PLAN_CHANGE_REASONS:
            raise ValueError(f"PlanChange reason must be one of {', '.join(PLAN_CHANGE_REASONS)}, got {data.get('reason')!r}")
        if type(data.get("observed")) is not int or data["observed"] < 0:
            raise ValueError(f"PlanChange observed must be an int >= 0 (steps), got {data.get('observed')!r}")
        return cls(added=tuple(_pair_of(p) for p in data["added"]), removed=tuple(_pair_of(p) for p in data["removed"]),
                   before=PlanScore(**data["before"]), after=PlanScore(**data["after"]), observed=data["observed"],
                   reason=data["reason"])

    def __str__(self) -> str:
        b, a = self.before, self.after
        return (
            f"plan change ({self.reason}: {PLAN_CHANGE_REASONS[self.reason]}) after {self.observed} steps: +{len(self.added)} -{len(self.removed)} keys, "
            f"{b.graphs} -> {a.graphs} graphs, graph-served steps {b.graph_steps} -> {a.graph_steps} of {a.steps}, "
            f"padding {b.padding_ratio:.2%} -> {a.padding_ratio:.2%}"
        )
