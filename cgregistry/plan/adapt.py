"""Adaptation: when and how a registry's plan follows the batch shapes it actually serves.

The registry counts shapes in a ``TrafficHistogram``; when ``Adaptation.due``, ``propose`` fits a plan to the counts
and returns a ``PlanChange`` only when it serves more steps from graphs, brings the plan within budget, or saves at
least ``min_gain`` of the padded tokens.  Pure policy: no registry, no capture, no torch graphs.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.plan.fit import Workload, evaluate, workload_counts
from cgregistry.key.matcher import DEFAULT_PREFERENCE
from cgregistry.plan.build import CapturePlan, PlanSettings
from cgregistry.inspection import PLAN_CHANGE_REASONS as REASONS, PlanChange, PlanScore

__all__ = ["REASONS", "Adaptation", "PlanChange", "PlanScore", "Replay", "TrafficHistogram", "propose", "refit", "replay"]

Pair = tuple[BatchDescriptor, str]


def _count(minimum: int) -> Any:
    def check(instance: Any, attribute: Any, value: object) -> None:
        if type(value) is not int or value < minimum:
            raise ValueError(f"Adaptation.{attribute.name} must be an int >= {minimum}, got {value!r}")

    return check


def _fraction(bounds: str, inside: Callable[[float], bool]) -> Any:
    """A number (never a bool) for which ``inside`` holds, ``bounds`` the interval in words."""

    def check(instance: Any, attribute: Any, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not inside(float(value)):
            raise ValueError(f"Adaptation.{attribute.name} must be a number in {bounds}, got {value!r}")

    return check


def _as_settings(value: object) -> PlanSettings:
    """A ``PlanSettings``, or one built from a mapping of its fields (whose errors name the setting)."""
    if isinstance(value, PlanSettings):
        return value
    if isinstance(value, Mapping):
        return PlanSettings(**value)
    raise ValueError(
        f"Adaptation.settings must be a PlanSettings or a mapping of its fields (max_num_seqs, max_num_tokens, mode, ...), got {value!r}"
    )


@attrs.frozen(slots=True, kw_only=True)
class Adaptation:
    """How a registry adapts its plan: the budget, the settings to fit with, and how eagerly to change.

    ``max_graphs``: graphs the plan may hold.  ``settings``: ``CapturePlan.fit``'s (a ``PlanSettings`` or a mapping).
    ``every_steps``: refit after this many steps since the last; ``min_steps``: none before this many in all.
    ``decay`` in (0, 1]: counts are multiplied by it at each refit (1: old traffic never fades).  ``min_gain`` in
    [0, 1): change for padding only when it saves at least this fraction of the padded tokens (hysteresis).
    ``max_bytes`` (with ``memory``, a ``reg.estimate_memory()`` result pricing each key): the capture may take at most
    that much device memory, as well as or instead of ``max_graphs``.
    """

    max_graphs: int | None = attrs.field(default=None, validator=attrs.validators.optional(_count(1)))
    settings: PlanSettings = attrs.field(default=None, converter=_as_settings)
    every_steps: int = attrs.field(default=10_000, validator=_count(1))
    min_steps: int = attrs.field(default=10_000, validator=_count(0))
    decay: float = attrs.field(default=0.9, validator=_fraction("(0, 1]", lambda v: 0 < v <= 1))
    min_gain: float = attrs.field(default=0.1, validator=_fraction("[0, 1)", lambda v: 0 <= v < 1))
    max_bytes: int | None = attrs.field(default=None, validator=attrs.validators.optional(_count(0)))
    memory: Any = attrs.field(default=None, eq=False, repr=False)  # a MemoryEstimate: prices keys for max_bytes

    def __attrs_post_init__(self) -> None:
        if self.max_graphs is None and self.max_bytes is None:
            raise ValueError("Adaptation needs max_graphs, max_bytes (with memory=reg.estimate_memory(plan)), or both")
        if self.max_bytes is not None and not callable(getattr(self.memory, "key_bytes", None)):
            raise ValueError(f"Adaptation.max_bytes needs memory=reg.estimate_memory(plan) to price each key, got {self.memory!r}")
        if self.settings.mode == "none":
            raise ValueError("Adaptation.settings: mode 'none' captures no graphs, so there is nothing to adapt; use a mode with a strategy")
        try:  # the budget must hold the keys every fitted plan keeps: fail here, not at the first refit
            self.fit({})
        except ValueError as exc:
            raise ValueError(f"Adaptation: {exc}") from None

    def fit(self, steps: Workload) -> CapturePlan:
        """The plan fitted to ``steps`` under this adaptation's budgets."""
        return CapturePlan.fit(steps, self.max_graphs, self.settings, max_bytes=self.max_bytes, memory=self.memory)

    def over_budget(self, pairs: Sequence[Pair]) -> bool:
        """Whether keys exceed the graph budget, or the byte budget by the estimate's prices."""
        if self.max_graphs is not None and len(pairs) > self.max_graphs:
            return True
        if self.max_bytes is None:
            return False
        return self.memory.fixed_bytes() + sum(self.memory.key_bytes(k, s) for k, s in pairs) > self.max_bytes

    def due(self, histogram: TrafficHistogram) -> bool:
        """Whether a refit is due: ``min_steps`` observed in all and ``every_steps`` since the last refit."""
        return histogram.observed >= self.min_steps and histogram.fresh >= self.every_steps


class TrafficHistogram(Mapping[BatchDescriptor, float]):
    """Steps per actual shape, older ones decayed: the traffic a refit fits to.  Float counts (decay is exact; below
    one half a shape is dropped; ``steps()`` rounds); ``observed``: every step added, ``fresh``: those since the last
    ``decay``.  Not thread-safe."""

    __slots__ = ("_counts", "fresh", "observed")

    def __init__(self, counts: Workload | None = None) -> None:
        self._counts: dict[BatchDescriptor, float] = {}
        self.observed = 0
        self.fresh = 0
        if counts is not None:
            self.add(counts)

    def add(self, counts: Workload) -> None:
        """Count steps: a ``{shape: steps}`` harvest (ints >= 0) or a stream of shapes."""
        harvest = workload_counts(counts, "TrafficHistogram.add()")
        for shape, n in harvest.items():
            self._counts[shape] = self._counts.get(shape, 0.0) + n
        n = sum(harvest.values())
        self.observed += n
        self.fresh += n

    def decay(self, factor: float) -> None:
        """Multiply every count by ``factor`` in (0, 1] (older traffic weighs less) and start a new refit period."""
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor <= 1:
            raise ValueError(f"decay factor must be a number in (0, 1], got {factor!r}")
        self._counts = {s: c * factor for s, c in self._counts.items() if c * factor >= 0.5}
        self.fresh = 0

    @property
    def total(self) -> float:
        """The decayed step count: the weight of the traffic a refit sees."""
        return sum(self._counts.values())

    def steps(self) -> dict[BatchDescriptor, int]:
        """Counts rounded to whole steps (half up), the workload ``CapturePlan.fit`` takes."""
        return {s: math.floor(c + 0.5) for s, c in self._counts.items()}

    def __getitem__(self, shape: BatchDescriptor) -> float:
        return self._counts[shape]

    def __iter__(self) -> Iterator[BatchDescriptor]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    def __repr__(self) -> str:
        return f"TrafficHistogram({len(self)} shapes, total {self.total:.1f}, observed {self.observed}, fresh {self.fresh})"


def _pairs(current: Sequence[Pair]) -> list[Pair]:
    out: list[Pair] = []
    for i, pair in enumerate(current):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], BatchDescriptor) and isinstance(pair[1], str)):
            raise TypeError(f"propose() takes the current keys as (BatchDescriptor, strategy) pairs; current[{i}] is {pair!r}")
        out.append(pair)
    return list(dict.fromkeys(out))


def propose(
    histogram: TrafficHistogram | Workload,
    current: Sequence[Pair],
    adaptation: Adaptation,
    *,
    preference: Sequence[str] = DEFAULT_PREFERENCE,
    max_padding_tokens: int | None = None,
    max_padding_ratio: float | None = None,
    observed: int | None = None,
) -> PlanChange | None:
    """The change from ``current`` keys to the plan fitted to ``histogram``, or None when it is not worth making.

    Both key sets are scored on the histogram through the matcher (``preference``, the padding cap).  Proposed when the
    current keys exceed the budget ("budget"), the fitted plan serves more steps from graphs ("coverage") or pads at
    least ``min_gain`` fewer tokens ("padding"); never when it serves fewer steps from graphs or the keys are the same.
    ``observed`` (for the record) defaults to the histogram's count."""
    if isinstance(histogram, TrafficHistogram):
        weights, seen = histogram.steps(), histogram.observed
    else:
        weights = dict(workload_counts(histogram, "propose()"))
        seen = sum(weights.values())
    if observed is None:
        observed = seen
    if not weights:
        return None
    pairs = _pairs(current)
    held_plan = CapturePlan.of(pairs)
    fitted = adaptation.fit(weights)
    cap = {"max_padding_tokens": max_padding_tokens, "max_padding_ratio": max_padding_ratio}
    before = PlanScore.of(evaluate(held_plan, weights, preference, **cap))
    after = PlanScore.of(evaluate(fitted, weights, preference, **cap))
    new = [(e.descriptor, e.strategy) for e in fitted]
    held, kept = set(pairs), set(new)
    added = tuple(p for p in new if p not in held)  # largest first, the order to capture them in
    removed = tuple((e.descriptor, e.strategy) for e in held_plan if (e.descriptor, e.strategy) not in kept)
    if (not added and not removed) or after.graph_steps < before.graph_steps:
        return None
    if adaptation.over_budget(pairs):
        reason = "budget"
    elif after.graph_steps > before.graph_steps:
        reason = "coverage"
    elif after.padded_tokens < before.padded_tokens and before.padded_tokens - after.padded_tokens >= adaptation.min_gain * before.padded_tokens:
        reason = "padding"
    else:
        return None
    return PlanChange(added, removed, before, after, observed, reason)


def refit(
    histogram: TrafficHistogram,
    current: Sequence[Pair],
    adaptation: Adaptation,
    *,
    preference: Sequence[str] = DEFAULT_PREFERENCE,
    max_padding_tokens: int | None = None,
    max_padding_ratio: float | None = None,
) -> PlanChange | None:
    """One step of the adaptation loop, after each harvest: when due, ``propose``, then decay the histogram (None when
    not due or nothing is proposed)."""
    if not isinstance(histogram, TrafficHistogram):
        raise TypeError(f"refit() takes a TrafficHistogram (it decays it), got {type(histogram).__name__}; propose() takes a plain workload")
    if not adaptation.due(histogram):
        return None
    change = propose(histogram, current, adaptation, preference=preference, max_padding_tokens=max_padding_tokens,
                     max_padding_ratio=max_padding_ratio)
    histogram.decay(adaptation.decay)
    return change


@attrs.frozen(slots=True)
class Replay:
    """The adaptation loop driven over recorded steps (``replay``): ``windows[i]`` scores steps
    ``[i * window, (i + 1) * window)`` with the keys held when each was served; ``changes``: the plan changes in order;
    ``keys``: those held at the end."""

    window: int
    windows: tuple[PlanScore, ...]
    changes: tuple[PlanChange, ...]
    keys: tuple[Pair, ...]

    def padding_per_real_token(self) -> list[float]:
        """Each window's padded tokens per real token of its graph-served steps (0 where graphs served none)."""
        return [w.padded_tokens / w.real_tokens if w.real_tokens else 0.0 for w in self.windows]


def _positive(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"replay() {name} must be an int >= 1 (steps), got {value!r}")
    return value


def replay(
    steps: Sequence[BatchDescriptor],
    adaptation: Adaptation,
    current: Sequence[Pair] = (),
    *,
    harvest: int = 100,
    window: int = 1000,
    preference: Sequence[str] = DEFAULT_PREFERENCE,
    max_padding_tokens: int | None = None,
    max_padding_ratio: float | None = None,
) -> Replay:
    """Serve ``steps`` (in order) from the ``current`` keys, adapting as a registry with ``adaptation`` would: every
    ``harvest`` steps are served with the keys held, then counted; a due refit's change holds from the next harvest on.
    What to tune ``every_steps``, ``min_steps`` and ``decay`` on (docs/adaptive.md)."""
    harvest, window = _positive("harvest", harvest), _positive("window", window)
    workload_counts(steps, "replay()")  # every step a BatchDescriptor, an error naming the first that is not
    cap = {"max_padding_tokens": max_padding_tokens, "max_padding_ratio": max_padding_ratio}
    held = _pairs(current)
    histogram = TrafficHistogram()
    changes: list[PlanChange] = []
    windows: list[PlanScore] = []
    served: Counter[BatchDescriptor] = Counter()  # steps of this window served by the keys held, not scored yet
    totals = [0, 0, 0, 0]  # steps, graph steps, real tokens, padded tokens of this window's scored steps

    def score() -> None:  # the steps served so far by the keys held (scored once per window or change)
        if served:
            report = evaluate(CapturePlan.of(held), served, preference, **cap)
            for i, n in enumerate((report.steps, report.graph_steps, report.real_tokens, report.padded_tokens)):
                totals[i] += n
            served.clear()

    for start in range(0, len(steps), harvest):
        end = min(start + harvest, len(steps))
        lo = start
        while lo < end:  # a harvest may straddle windows
            hi = min(end, (lo // window + 1) * window)
            served.update(steps[lo:hi])
            if hi % window == 0 or hi == len(steps):
                score()
                windows.append(PlanScore(len(held), *totals))
                totals = [0, 0, 0, 0]
            lo = hi
        histogram.add(workload_counts(steps[start:end], "replay()"))
        change = refit(histogram, held, adaptation, preference=preference, **cap)
        if change is not None:
            score()
            gone = set(change.removed)
            held = [p for p in held if p not in gone] + list(change.added)
            changes.append(change)
    return Replay(window, tuple(windows), tuple(changes), tuple(held))
