"""CapturePlan: which (descriptor, strategy) pairs to capture, largest first.

``CapturePlan.build`` turns engine settings into keys the way engines size their
graphs today (a ladder of token counts), but as one list of descriptors instead
of parallel dicts of sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal

import attrs

from cgregistry.descriptor import BatchDescriptor
from cgregistry.matcher import Matcher

__all__ = ["MODES", "CapturePlan", "PlanEntry", "PlanSettings", "UncoveredRange", "default_ladder", "lora_ladder"]

Mode = Literal[
    "none", "full", "piecewise", "breakable", "full_decode_only", "full_and_piecewise", "full_and_breakable"
]

# mode -> (strategy for uniform decode keys, strategy for mixed-batch keys)
MODES: dict[str, tuple[str | None, str | None]] = {
    "none": (None, None),
    "full": ("full", "full"),
    "piecewise": (None, "piecewise"),
    "breakable": (None, "breakable"),
    "full_decode_only": ("full", None),
    "full_and_piecewise": ("full", "piecewise"),
    "full_and_breakable": ("full", "breakable"),
}

# Strategies that build attention metadata eagerly, so their keys need no request count.
RELAXED_STRATEGIES = frozenset({"piecewise", "breakable"})

# Spec depths for every batch size, or a schedule {largest request count: depths allowed up to it}.
SpecDepths = Sequence[int] | Mapping[int, Sequence[int]]


def lora_ladder(max_loras: int) -> tuple[int, ...]:
    """LoRA counts captured when LoRA is on: 0 (no adapter), powers of two below ``max_loras``, and ``max_loras``."""
    if type(max_loras) is not int or max_loras < 1:
        raise ValueError(f"max_loras must be a positive int, got {max_loras!r}")
    counts = {0, max_loras}
    p = 1
    while p < max_loras:
        counts.add(p)
        p *= 2
    return tuple(sorted(counts))


def default_ladder(max_size: int) -> list[int]:
    """Token counts engines capture today: 1, 2, 4, every 8 to 256, then every 16; ends at ``max_size``."""
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, max_size + 1, 16)]
    sizes = [s for s in ladder if s <= max_size]
    if not sizes or sizes[-1] != max_size:
        sizes.append(max_size)  # the largest key must cover the maximum exactly
    return sizes


@attrs.frozen(slots=True)
class PlanEntry:
    """One key to capture and the strategy that captures it."""

    descriptor: BatchDescriptor
    strategy: str


@attrs.frozen(slots=True)
class UncoveredRange:
    """A run of actual batch shapes that no key in a plan covers (they run eagerly).

    ``kind`` is "decode" (uniform batches of ``spec_depth``) or "mixed" (any
    batch, checked at its worst-case request count ``min(tokens, max_num_seqs)``).
    """

    kind: str
    num_active_loras: int
    spec_depth: int | None
    min_tokens: int
    max_tokens: int


def _entry_order(entry: PlanEntry) -> tuple[int, int, int, int, int, str]:
    d = entry.descriptor
    return (
        -d.num_tokens,
        -(d.num_reqs if d.num_reqs is not None else d.num_tokens + 1),
        -d.num_active_loras,
        -d.spec_depth,
        -int(d.uniform),
        entry.strategy,
    )


def _positive_ints(name: str, values: Iterable[int], minimum: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a sequence of ints, got {values!r}")
    out = []
    for v in values:
        if type(v) is not int or v < minimum:
            raise ValueError(f"{name} must hold ints >= {minimum}, got {v!r}")
        out.append(v)
    if not out:
        raise ValueError(f"{name} must not be empty")
    return tuple(sorted(set(out)))


@attrs.frozen(slots=True)
class PlanSettings:
    """Engine settings normalised: what ``build`` and ``fit`` turn into keys."""

    max_num_seqs: int
    max_num_tokens: int
    mode: str
    max_capture_size: int
    capture_sizes: tuple[int, ...]  # mixed-batch token counts (the ladder unless given)
    widest: Mapping[int, int]  # spec depth -> largest request count of a uniform batch of that depth
    lora_counts: tuple[int, ...]

    @property
    def decode_strategy(self) -> str | None:
        return MODES[self.mode][0]

    @property
    def mixed_strategy(self) -> str | None:
        return MODES[self.mode][1]

    @classmethod
    def from_engine(
        cls,
        max_num_seqs: int,
        max_num_tokens: int,
        mode: str = "full_and_piecewise",
        capture_sizes: Sequence[int] | None = None,
        max_capture_size: int | None = None,
        spec_depths: SpecDepths = (0,),
        lora_counts: Sequence[int] | None = None,
        max_loras: int | None = None,
    ) -> PlanSettings:
        """Validate settings; errors name the offending value and what was expected."""
        if type(max_num_seqs) is not int or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
        if type(max_num_tokens) is not int or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be a positive int, got {max_num_tokens!r}")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        widest = _depth_widest(spec_depths, max_num_seqs, max_num_tokens)
        if lora_counts is None:
            loras = (0,) if max_loras is None else lora_ladder(max_loras)
        else:
            loras = _positive_ints("lora_counts", lora_counts, 0)
            if max_loras is not None and max(loras) < max_loras:
                raise ValueError(
                    f"lora_counts {list(loras)} do not reach max_loras={max_loras}: "
                    f"a batch with {max_loras} active adapters would have no graph"
                )
        query_len = 1 + max(widest)
        if capture_sizes is not None:
            capture_sizes = _positive_ints("capture_sizes", capture_sizes, 1)

        if max_capture_size is None:
            if capture_sizes:
                max_capture_size = max(capture_sizes)
            else:
                max_capture_size = min(2 * max_num_seqs * query_len, 512, max_num_tokens)
        elif type(max_capture_size) is not int or max_capture_size < 1:
            raise ValueError(f"max_capture_size must be a positive int, got {max_capture_size!r}")
        if max_capture_size > max_num_tokens:
            raise ValueError(
                f"max_capture_size={max_capture_size} exceeds max_num_tokens={max_num_tokens}: "
                "no batch can be that large"
            )
        if capture_sizes is None:
            sizes = tuple(default_ladder(max_capture_size))
        else:
            sizes = _positive_ints("capture_sizes", capture_sizes, 1)
            too_big = [s for s in sizes if s > max_capture_size]
            if too_big:
                raise ValueError(
                    f"capture_sizes {too_big} exceed max_capture_size={max_capture_size}; "
                    "raise max_capture_size or drop those sizes"
                )
        return cls(max_num_seqs, max_num_tokens, mode, max_capture_size, sizes, widest, loras)

    def plan(self, decode_reqs: Mapping[int, Sequence[int]], mixed_tokens: Sequence[int]) -> CapturePlan:
        """Keys from chosen sizes: request counts per spec depth, token counts for mixed batches."""
        keys: list[tuple[BatchDescriptor, str]] = []
        for n_loras in self.lora_counts:
            if self.decode_strategy is not None:
                for depth, counts in decode_reqs.items():
                    for num_reqs in counts:
                        keys.append((BatchDescriptor.decode(num_reqs, depth, n_loras), self.decode_strategy))
            if self.mixed_strategy is not None:
                for tokens in mixed_tokens:
                    reqs = None if self.mixed_strategy in RELAXED_STRATEGIES else min(tokens, self.max_num_seqs)
                    keys.append((BatchDescriptor(tokens, reqs, n_loras), self.mixed_strategy))
        return CapturePlan(
            tuple(PlanEntry(d, st) for d, st in dict.fromkeys(keys)),
            max_num_seqs=self.max_num_seqs,
            max_num_tokens=self.max_num_tokens,
            decode_widest=self.widest,
        )


@attrs.frozen(slots=True)
class CapturePlan:
    """An ordered, duplicate-free list of entries to capture, largest first.

    ``max_num_seqs`` and ``max_num_tokens`` are kept (when the plan was built
    from settings) so the plan can say which batches it leaves uncovered.
    """

    entries: tuple[PlanEntry, ...] = attrs.field(converter=tuple)
    max_num_seqs: int | None = None
    max_num_tokens: int | None = None
    decode_widest: Mapping[int, int] | None = None  # spec depth -> widest uniform batch the engine will send

    def __attrs_post_init__(self) -> None:
        seen: set[PlanEntry] = set()
        for entry in self.entries:
            if not isinstance(entry, PlanEntry):
                raise TypeError(f"CapturePlan entries must be PlanEntry, got {entry!r}")
            if entry in seen:
                raise ValueError(f"CapturePlan lists {entry.descriptor} with strategy {entry.strategy!r} twice")
            seen.add(entry)
        object.__setattr__(self, "entries", tuple(sorted(self.entries, key=_entry_order)))

    @classmethod
    def of(cls, pairs: Iterable[tuple[BatchDescriptor, str]], **settings: int | None) -> CapturePlan:
        """A plan from explicit (descriptor, strategy) pairs."""
        return cls(tuple(PlanEntry(d, s) for d, s in pairs), **settings)

    @classmethod
    def build(
        cls,
        max_num_seqs: int,
        max_num_tokens: int,
        mode: Mode | str = "full_and_piecewise",
        capture_sizes: Sequence[int] | None = None,
        max_capture_size: int | None = None,
        spec_depths: SpecDepths = (0,),
        lora_counts: Sequence[int] | None = None,
        max_loras: int | None = None,
    ) -> CapturePlan:
        """Keys for an engine's settings.

        Uniform-decode keys (``full``) carry an exact request count: for each
        spec depth ``d`` their token counts are multiples of ``1 + d`` up to
        ``max_num_seqs * (1 + d)``, so one token count may have a key per depth.
        ``spec_depths`` may be a schedule ``{largest request count: depths}``
        (deep speculation for small batches only).  Mixed-batch keys cover any
        batch up to ``max_capture_size`` tokens; for ``piecewise``/``breakable``
        they relax ``num_reqs`` to None, for ``full`` they carry
        ``min(tokens, max_num_seqs)`` requests.  Every key is repeated for each
        LoRA count (default with ``max_loras``: ``lora_ladder(max_loras)``).
        """
        settings = PlanSettings.from_engine(
            max_num_seqs, max_num_tokens, mode, capture_sizes, max_capture_size, spec_depths, lora_counts, max_loras
        )
        sizes = settings.capture_sizes
        decode = {d: _decode_request_counts(sizes, d, w) for d, w in settings.widest.items()}
        return settings.plan(decode, sizes)

    @classmethod
    def fit(cls, steps: Iterable[BatchDescriptor], max_graphs: int, **settings: object) -> CapturePlan:
        """The plan that minimises padded tokens over ``steps`` with at most ``max_graphs`` graphs.

        Takes the keyword settings of ``build`` (``max_num_seqs``, ``max_num_tokens``,
        ``mode``, ...); keeps its covering guarantees.  See ``cgregistry.fitting.fit``.
        """
        from cgregistry.fitting import fit  # fitting builds on this module

        return fit(steps, max_graphs, **settings)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[PlanEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def descriptors(self) -> list[BatchDescriptor]:
        """The keys in capture order."""
        return [e.descriptor for e in self.entries]

    def uncovered(self) -> list[UncoveredRange]:
        """Actual batch shapes up to the plan's maxima that no key covers.

        Checks every uniform decode batch (each spec depth and LoRA count seen in
        the plan) and every mixed batch at its worst-case request count.
        """
        if self.max_num_seqs is None or self.max_num_tokens is None:
            raise ValueError("uncovered() needs a plan built with max_num_seqs and max_num_tokens")
        matcher = Matcher((e.descriptor, e.strategy) for e in self.entries)
        widest = self.decode_widest
        if widest is None:
            depths = {e.descriptor.spec_depth for e in self.entries} | {0}
            widest = {d: min(self.max_num_seqs, self.max_num_tokens // (1 + d)) for d in depths}
        max_loras = max((e.descriptor.num_active_loras for e in self.entries), default=0)
        gaps: list[UncoveredRange] = []
        for n_loras in range(max_loras + 1):
            for depth, reqs_max in sorted(widest.items()):
                q = 1 + depth
                shapes = [(r * q, BatchDescriptor.decode(r, depth, n_loras)) for r in range(1, reqs_max + 1)]
                gaps += _runs("decode", n_loras, depth, shapes, matcher)
            shapes = [
                (t, BatchDescriptor(t, min(t, self.max_num_seqs), n_loras))
                for t in range(1, self.max_num_tokens + 1)
            ]
            gaps += _runs("mixed", n_loras, None, shapes, matcher)
        return gaps


def _decode_request_counts(sizes: Sequence[int], depth: int, widest: int) -> list[int]:
    """Request counts of uniform keys: each size rounded up to whole requests, plus the widest batch."""
    q = 1 + depth
    counts = {-(-s // q) for s in sizes}
    return sorted({c for c in counts if c <= widest} | {widest})


def _depth_widest(spec_depths: SpecDepths, max_num_seqs: int, max_num_tokens: int) -> dict[int, int]:
    """For each spec depth, the largest request count of a uniform batch of that depth."""
    widest: dict[int, int] = {}
    if isinstance(spec_depths, Mapping):
        if not spec_depths:
            raise ValueError("spec_depths schedule must not be empty")
        for bound in spec_depths:
            if type(bound) is not int or bound < 1:
                raise ValueError(f"spec_depths schedule keys are request counts >= 1, got {bound!r}")
        if max(spec_depths) < max_num_seqs:
            raise ValueError(
                f"spec_depths schedule ends at {max(spec_depths)} requests; it must reach max_num_seqs={max_num_seqs}"
            )
        for bound in sorted(spec_depths):
            for depth in _positive_ints(f"spec_depths[{bound}]", spec_depths[bound], 0):
                widest[depth] = max(widest.get(depth, 0), min(bound, max_num_seqs))
    else:
        for depth in _positive_ints("spec_depths", spec_depths, 0):
            widest[depth] = max_num_seqs
    for depth in widest:
        q = 1 + depth
        if max_num_tokens // q < 1:
            raise ValueError(f"spec depth {depth} needs {q} tokens per request but max_num_tokens={max_num_tokens}")
        widest[depth] = min(widest[depth], max_num_tokens // q)
    return dict(sorted(widest.items()))


def _runs(
    kind: str, n_loras: int, depth: int | None, shapes: list[tuple[int, BatchDescriptor]], matcher: Matcher
) -> list[UncoveredRange]:
    out: list[UncoveredRange] = []
    start: int | None = None
    last = 0
    for tokens, actual in shapes:
        missing = matcher.match(actual) is None
        if missing and start is None:
            start = tokens
        if not missing and start is not None:
            out.append(UncoveredRange(kind, n_loras, depth, start, last))
            start = None
        last = tokens
    if start is not None:
        out.append(UncoveredRange(kind, n_loras, depth, start, last))
    return out
