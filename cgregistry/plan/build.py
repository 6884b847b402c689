"""CapturePlan: which (descriptor, strategy) pairs to capture, largest first.  ``CapturePlan.build`` turns engine
settings into keys as engines size their graphs today (a ladder of token counts), as one list of descriptors."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from cgregistry.hooks.manager import Plugins
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.plan.fit import Workload, fit_families, round_up
from cgregistry.key.classes import KEY_CLASSES, declared_unsupported, key_classes
from cgregistry.builtins import BUILTIN_RELAXES, DEFAULT_PREFERENCE, MODES
from cgregistry.key.matcher import Matcher, PaddingCap

__all__ = [
    "BUILTIN_RELAXES", "KEY_CLASSES", "MODES", "CapturePlan", "Downgrade", "PlanEntry", "PlanSettings", "UncoveredRange",
    "default_ladder", "lora_ladder", "mode_preference", "request_ladder", "rounded_sizes",
    "whole_requests",
]

_DECLARERS = ("engine", "strategy", "both")

def mode_preference(mode: str | tuple[str | None, str | None], base: Sequence[str] = DEFAULT_PREFERENCE) -> tuple[str, ...]:
    """The matcher preference that serves a plan of ``mode`` as the mode says: its decode strategy, its mixed one, then ``base``.

    A plugin decode strategy would otherwise rank last, its uniform keys losing every decode batch to the relaxed mixed
    keys (``("timed", "breakable")``).  The fitter assumes this order too."""
    decode, mixed = MODES[mode] if isinstance(mode, str) else mode
    return tuple(dict.fromkeys(s for s in (decode, mixed, *base) if s is not None))


@attrs.frozen(slots=True)
class Downgrade:
    """A key class moved off a strategy that cannot serve it, and who said so.

    ``to``: the strategy serving the class instead (the mode's other one, when it can), or None: eager.  ``declared_by``:
    "engine" (``PlanSettings.unsupported``), "strategy" (its own ``unsupported_classes``) or "both"."""

    key_class: str  # a KEY_CLASSES name
    strategy: str
    to: str | None
    declared_by: str = "engine"

    def __attrs_post_init__(self) -> None:
        if self.declared_by not in _DECLARERS:
            raise ValueError(f"Downgrade.declared_by must be one of {', '.join(_DECLARERS)}, got {self.declared_by!r}")

    def __str__(self) -> str:
        to = "no graph (eager)" if self.to is None else f"{self.to} keys"
        who = {
            "engine": "the engine (unsupported)",
            "strategy": f"strategy {self.strategy!r} itself (unsupported_classes)",
            "both": f"the engine (unsupported) and strategy {self.strategy!r} itself (unsupported_classes)",
        }[self.declared_by]
        return (f"{self.key_class} batches: {self.strategy} -> {to}, because {self.strategy} cannot serve "
                f"{KEY_CLASSES[self.key_class]}; declared by {who}")


def _unsupported(value: object) -> dict[str, frozenset[str]]:
    """``unsupported`` as {strategy: key classes}, checked: known class names, nested as KEY_CLASSES says."""
    if not isinstance(value, Mapping):
        raise ValueError(
            f"unsupported must map strategy names to key classes, e.g. {{'full': ('mixed',)}}, got {value!r}"
        )
    out: dict[str, frozenset[str]] = {}
    for strategy, classes in value.items():
        if not isinstance(strategy, str):
            raise ValueError(f"unsupported: keys are strategy names, got {strategy!r}")
        out[strategy] = key_classes(classes, f"unsupported[{strategy!r}]")
    return out


def _declarer(key_class: str, engine: frozenset[str] | None, strategy: frozenset[str] | None) -> str:
    """Who declared that a strategy cannot serve ``key_class``: "engine", "strategy" or "both"."""
    by_engine, by_strategy = key_class in (engine or ()), key_class in (strategy or ())
    return "both" if by_engine and by_strategy else "strategy" if by_strategy else "engine"


# Spec depths for every batch size, or a schedule {largest request count: depths allowed up to it}.
SpecDepths = Sequence[int] | Mapping[int, Sequence[int]]


def lora_ladder(max_loras: int) -> tuple[int, ...]:
    """LoRA counts captured when LoRA is on: 0 (no adapter), powers of two below ``max_loras``, and ``max_loras``."""
    if type(max_loras) is not int or max_loras < 1:
        raise ValueError(f"max_loras must be a positive int, got {max_loras!r}")
    return tuple(sorted({0, max_loras, *(1 << i for i in range(max_loras.bit_length()) if 1 << i < max_loras)}))


def request_ladder(top: int, query_len: int) -> list[int]:
    """Request counts of the ladder (1, 2, 4, 8, 16, 24, ...) whose uniform width ``r * query_len`` fits ``top`` tokens."""
    return [r for r in default_ladder(top) if r * query_len <= top]


def whole_requests(sizes: Iterable[int], query_len: int, top: int) -> list[int]:
    """Each token count rounded up to whole requests of ``query_len`` tokens, where the rounded width fits ``top``; [1]
    if none does.  vLLM sizes its uniform decode graphs so (``adjust_cudagraph_sizes_for_spec_decode``)."""
    return [-(-s // query_len) for s in sizes if round_up(s, query_len) <= max(top, query_len)] or [1]


def rounded_sizes(sizes: Iterable[int], multiple: int, top: int) -> set[int]:
    """Token counts rounded up to multiples of ``multiple`` that stay within ``top``; ``multiple`` itself if none does
    (vLLM's model runner V1 rounds so when its decode graphs are full, ``multiple`` the decode query length)."""
    out = {round_up(s, multiple) for s in sizes if round_up(s, multiple) <= top}
    return out or ({multiple} if multiple <= top else set())


def _fitting_requests(counts: Iterable[int], step: int, widest: int, query_len: int, top: int) -> set[int]:
    """Request counts made multiples of ``step`` (whole multiples of the size multiple in tokens) that fit both the
    widest uniform batch and the max capture size."""
    return {r for r in {round_up(c, step) for c in counts} if r <= widest and r * query_len <= max(top, query_len)}


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
    """A run of actual batch shapes that no key in a plan serves (they run eagerly).

    ``key_class``: "decode" (uniform batches of ``spec_depth``) or "mixed" (checked at ``min(tokens, max_num_seqs)``
    requests).  ``reason``: "no_key", or "padding_cap" (every covering key pads more than the cap given)."""

    key_class: str
    num_active_loras: int
    spec_depth: int | None
    min_tokens: int
    max_tokens: int
    reason: str = "no_key"


def _entry_order(entry: PlanEntry) -> tuple[int, int, int, int, int, int, str]:
    d = entry.descriptor
    return (
        -d.num_tokens,
        -(d.num_reqs if d.num_reqs is not None else d.num_tokens + 1),
        -d.num_active_loras,
        -d.spec_depth,
        -int(d.uniform),
        -d.num_ubatches,
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


def _positive(instance: Any, attribute: Any, value: object) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


def _flag(instance: Any, attribute: Any, value: object) -> None:
    if type(value) is not bool:
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _optional_positive(minimum: int = 1) -> Callable[[Any, Any, Any], None]:
    def optional(instance: Any, attribute: Any, value: object) -> None:
        if value is not None:
            _positive(instance, attribute, value)
            if value < minimum:  # type: ignore[operator]
                raise ValueError(f"{attribute.name} must be at least {minimum}, got {value}")

    return optional


def _spec_depths(value: SpecDepths) -> SpecDepths:
    """A schedule stays a mapping; any other iterable becomes a tuple (a generator is read once, here)."""
    if isinstance(value, Mapping) or isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return value
    return tuple(value)


@attrs.frozen(slots=True, kw_only=True)
class PlanSettings:
    """Engine settings, checked on construction (errors name the setting), and what follows from them (the fields
    without ``init``); the one place the settings are declared: ``CapturePlan.build`` and ``fit`` take these fields by
    keyword or in this order.

    ``mode``: a ``MODES`` name or a pair ``(decode_strategy, mixed_strategy)`` of registered strategies (either may be
    None); a strategy's own ``relaxes_num_reqs`` decides whether its mixed keys carry a request count (non-built-ins
    are looked up in ``plugins``, default the installed).  ``separate_decode``: the step branches on uniformity, so
    uniform batches need graphs of their own; without it a mode whose one strategy serves both classes (``full``)
    captures one graph per token count, uniform widths ``q * r`` (``q = 1 + spec depth``) up to the max capture size
    being mixed keys (``folded``).  ``size_multiple``: every key's token count is a multiple of it (the TP size under
    sequence parallelism).  ``unsupported``: ``{strategy: KEY_CLASSES it cannot serve}`` (``{"full": ["mixed"]}``);
    such a class moves to the mode's other strategy if that can serve it, else runs eagerly, each move a ``Downgrade``.
    The strategies' own ``unsupported_classes`` (``strategy_unsupported``) count the same; ``decode_strategy``,
    ``mixed_strategy`` and ``uniform_depths`` are after the moves.  ``ubatch_threshold``: from this token count the
    engine splits a step into two micro-batches (vLLM's DBO), and each key that large gets a ``num_ubatches=2`` twin.
    """

    max_num_seqs: int = attrs.field(validator=_positive)
    max_num_tokens: int = attrs.field(validator=_positive)
    # The default serves any step: breakable keys are piecewise's (the same key set as vLLM's FULL_AND_PIECEWISE)
    # without a trace; with a model compiled by reg.compile, "full_and_piecewise" fuses across the pieces too.
    mode: str | tuple[str | None, str | None] = "full_and_breakable"
    capture_sizes: Sequence[int] | None = None  # mixed-batch token counts (the ladder unless given)
    max_capture_size: int | None = attrs.field(default=None, validator=_optional_positive())
    spec_depths: SpecDepths = attrs.field(default=(0,), converter=_spec_depths)
    lora_counts: Sequence[int] | None = None
    max_loras: int | None = attrs.field(default=None, validator=_optional_positive())
    plugins: Any = attrs.field(default=None, eq=False, repr=False)  # where non-built-in strategies are looked up
    separate_decode: bool = attrs.field(default=False, validator=_flag)
    size_multiple: int = attrs.field(default=1, validator=_positive)
    unsupported: Mapping[str, Any] = attrs.field(factory=dict, converter=_unsupported)  # strategy -> KEY_CLASSES it cannot serve
    ubatch_threshold: int | None = attrs.field(default=None, validator=_optional_positive(minimum=2))
    decode_strategy: str | None = attrs.field(init=False)
    mixed_strategy: str | None = attrs.field(init=False)
    mixed_relaxed: bool = attrs.field(init=False)  # mixed keys carry no request count
    folded: bool = attrs.field(init=False)  # uniform widths up to the max capture size are mixed keys
    widest: Mapping[int, int] = attrs.field(init=False)  # spec depth -> largest request count of a uniform batch
    used_capture_sizes: tuple[int, ...] = attrs.field(init=False)
    used_max_capture_size: int = attrs.field(init=False)
    used_lora_counts: tuple[int, ...] = attrs.field(init=False)
    decode_reqs: Mapping[int, tuple[int, ...]] = attrs.field(init=False)  # spec depth -> request counts of uniform widths
    mixed_sizes: tuple[int, ...] = attrs.field(init=False)  # token counts of the mixed keys ``build`` captures
    uniform_depths: frozenset[int] = attrs.field(init=False)  # spec depths whose uniform batches get uniform keys
    strategy_unsupported: Mapping[str, frozenset[str]] = attrs.field(init=False)  # the mode's strategies' own declarations
    downgrades: tuple[Downgrade, ...] = attrs.field(init=False)  # classes moved off a strategy by ``unsupported``
    _installed: Any = attrs.field(init=False, default=None, eq=False, repr=False)  # Plugins(), made once when needed

    def __attrs_post_init__(self) -> None:
        fix = functools.partial(object.__setattr__, self)
        decode, mixed = self._strategies()
        widest = _depth_widest(self.spec_depths, self.max_num_seqs, self.max_num_tokens)
        declared = {name: self._declared(name) for name in dict.fromkeys((decode, mixed)) if name is not None}
        fix("strategy_unsupported", {name: classes for name, classes in declared.items() if classes})
        decode, mixed, spec_to_mixed, downgrades = self._downgraded(decode, mixed, widest)
        fix("downgrades", downgrades)
        fix("uniform_depths", frozenset() if decode is None else frozenset(d for d in widest if d == 0 or not spec_to_mixed))
        fix("decode_strategy", decode)
        fix("mixed_strategy", mixed)
        fix("mixed_relaxed", mixed is not None and self._relaxes(mixed))
        fix("folded", decode is not None and decode == mixed and not self.separate_decode)
        fix("widest", widest)
        max_loras = self.max_loras
        if self.lora_counts is None:
            loras = (0,) if max_loras is None else lora_ladder(max_loras)
        else:
            loras = _positive_ints("lora_counts", self.lora_counts, 0)
            if max_loras is not None and max(loras) < max_loras:
                raise ValueError(
                    f"lora_counts {list(loras)} do not reach max_loras={max_loras}: "
                    f"a batch with {max_loras} active adapters would have no graph"
                )
            if max_loras is not None and max(loras) > max_loras:
                raise ValueError(
                    f"lora_counts {list(loras)} go beyond max_loras={max_loras}: no batch has more active adapters, "
                    "so those graphs would never replay"
                )
        fix("used_lora_counts", loras)
        m = self.size_multiple
        sizes = None if self.capture_sizes is None else _positive_ints("capture_sizes", self.capture_sizes, 1)
        if sizes is not None and m > 1:
            off = [size for size in sizes if size % m]
            if off:
                raise ValueError(f"capture_sizes {off} are not multiples of size_multiple={m}")
        top = self.max_capture_size
        if top is not None and top % m:
            raise ValueError(f"max_capture_size={top} is not a multiple of size_multiple={m}")
        if top is None:
            query_len = 1 + max(widest)
            top = max(sizes) if sizes else min(2 * self.max_num_seqs * query_len, 512, self.max_num_tokens) // m * m
            if top < 1:
                raise ValueError(f"size_multiple={m} exceeds max_num_tokens={self.max_num_tokens}: no key can hold a batch")
        if top > self.max_num_tokens:
            given = f"max_capture_size={top}" if self.max_capture_size is not None else (
                f"capture_sizes {[s for s in sizes if s > self.max_num_tokens]}" if sizes else f"the largest size {top}")
            raise ValueError(f"{given} exceed{'' if sizes and self.max_capture_size is None else 's'} max_num_tokens="
                             f"{self.max_num_tokens}: no batch can be that large")
        default_sizes = sizes is None
        if sizes is None:
            sizes = tuple(sorted({round_up(s, m) for s in default_ladder(top)}))
        else:
            too_big = [size for size in sizes if size > top]
            if too_big:
                raise ValueError(
                    f"capture_sizes {too_big} exceed max_capture_size={top}; raise max_capture_size or drop those sizes"
                )
        fix("used_max_capture_size", top)
        fix("used_capture_sizes", sizes)
        # Request counts of uniform widths per spec depth, then the token counts of mixed keys.
        ladder_reqs: dict[int, tuple[int, ...]] = {}
        reqs: dict[int, tuple[int, ...]] = {}
        for depth, w in widest.items():
            q = 1 + depth
            step = self._request_step(depth, w)
            # The request ladder and, for spec decode, the widest batch, with the default sizes (given sizes are taken as
            # given: vLLM's default sizes hold these widths); for uniform keys, and with given sizes, the sizes rounded
            # up to whole requests too, as vLLM sizes its uniform graphs; and the widest batch.
            ladder = _fitting_requests(request_ladder(top, q), step, w, q, top) | ({w} if q > 1 else set()) if default_sizes else set()
            rounded = whole_requests(sizes, q, top) if depth in self.uniform_depths or not default_sizes else []
            reqs[depth] = tuple(sorted(ladder | _fitting_requests(rounded, step, w, q, top) | {w}))
            ladder_reqs[depth] = tuple(sorted(ladder))
        fix("decode_reqs", reqs)
        fix("mixed_sizes", self._mixed_sizes(sizes, top, ladder_reqs, default_sizes))

    def _request_step(self, depth: int, widest: int) -> int:
        """The step of request counts whose token counts are multiples of ``size_multiple``; the widest batch must be one."""
        m, q = self.size_multiple, 1 + depth
        step = m // math.gcd(m, q)
        if widest % step:
            raise ValueError(
                f"size_multiple={m}: uniform keys of spec depth {depth} ({q} token{'s' if q > 1 else ''} a request) need request counts "
                f"that are multiples of {step}, but the widest uniform batch, {widest} requests "
                f"(min(max_num_seqs={self.max_num_seqs}, max_num_tokens // {q})), is not; make it a multiple of {step}"
            )
        return step

    def _mixed_sizes(
        self, sizes: tuple[int, ...], top: int, ladder_reqs: Mapping[int, tuple[int, ...]], default_sizes: bool
    ) -> tuple[int, ...]:
        """Token counts of mixed keys: the capture sizes, uniform widths ``q * r`` that fit (all when ``folded``; with
        the default sizes, those of depths without uniform keys and the request ladder's of the others), and, when
        uniform batches have graphs of their own, the sizes rounded up to whole requests of the deepest spec depth
        (vLLM V1's rounding; V2 keeps the sizes: having both keeps every mixed batch within the padding of either)."""
        out = set(sizes)
        if self.mixed_strategy is None:
            return tuple(sorted(out))
        for depth, counts in self.decode_reqs.items():
            q = 1 + depth
            served = self.folded or (depth not in self.uniform_depths and default_sizes)
            out |= {q * r for r in (counts if served else ladder_reqs[depth]) if q * r <= top}
        if self.decode_strategy is not None and self.uniform_depths:
            q = 1 + max(self.uniform_depths)
            out |= rounded_sizes(sizes, q * self.size_multiple // math.gcd(q, self.size_multiple), top)
        return tuple(sorted(out))

    def _strategies(self) -> tuple[str | None, str | None]:
        mode = self.mode
        if isinstance(mode, str):
            if mode not in MODES:
                raise ValueError(
                    f"unknown mode {mode!r}; expected one of {', '.join(MODES)}, or a pair (decode_strategy, mixed_strategy)"
                )
            return MODES[mode]
        if not isinstance(mode, tuple) or len(mode) != 2 or not all(m is None or isinstance(m, str) for m in mode):
            raise ValueError(f"mode must be a name from MODES or a pair (decode_strategy, mixed_strategy), got {mode!r}")
        for name in mode:
            if name is not None:
                self._relaxes(name)
        return mode

    def _downgraded(
        self, decode: str | None, mixed: str | None, widest: Mapping[int, int]
    ) -> tuple[str | None, str | None, bool, tuple[Downgrade, ...]]:
        """The mode's strategies after ``unsupported`` and ``strategy_unsupported``: (decode, mixed, spec decode served
        by mixed keys, downgrades).  A class moves to the mode's other strategy when that one can serve it, else gets no
        graph; mixed first, so a ``full`` mode whose graphs cannot take mixed batches keeps full decode keys."""
        engine = self.unsupported
        for name in engine:
            if name not in BUILTIN_RELAXES or self.plugins is not None:
                try:
                    self._registered(name)
                except KeyError:
                    raise ValueError(f"unsupported names strategy {name!r}, which is not registered (a typo?)") from None
        declared = self.strategy_unsupported
        cannot = {name: engine.get(name, frozenset()) | declared.get(name, frozenset()) for name in {*engine, *declared}}
        found: list[Downgrade] = []

        def other(strategy: str, key_class: str, candidate: str | None) -> str | None:
            to = candidate if candidate != strategy and candidate is not None and key_class not in cannot.get(candidate, ()) else None
            found.append(Downgrade(key_class, strategy, to, _declarer(key_class, engine.get(strategy), declared.get(strategy))))
            return to

        if mixed is not None and "mixed" in cannot.get(mixed, ()):
            mixed = other(mixed, "mixed", decode if decode is not None and "mixed" not in cannot.get(decode, ()) else None)
        if decode is not None and "decode" in cannot.get(decode, ()):
            was = decode
            decode = other(decode, "decode", mixed)
            if any(d > 0 for d in widest):  # spec decode moves with plain decode (the classes nest)
                found.append(Downgrade("spec_decode", was, decode, _declarer("spec_decode", engine.get(was), declared.get(was))))
        spec_to_mixed = False
        if decode is not None and "spec_decode" in cannot.get(decode, ()) and any(d > 0 for d in widest):
            to = other(decode, "spec_decode", mixed)
            spec_to_mixed = True  # uniform keys of depth > 0 are dropped; mixed keys (if any) serve those batches
            assert to is None or to == mixed
        return decode, mixed, spec_to_mixed, tuple(found)

    def _registered(self, strategy: str) -> Any:
        """The registered strategy object, from ``plugins`` else the installed plugins (made once); KeyError naming the
        registered strategies if none has that name."""
        plugins = self.plugins
        if plugins is None:
            plugins = self._installed
            if plugins is None:
                plugins = Plugins()
                object.__setattr__(self, "_installed", plugins)
        return plugins.strategy(strategy)

    def _relaxes(self, strategy: str) -> bool:
        """The strategy's own ``relaxes_num_reqs``."""
        if self.plugins is None and strategy in BUILTIN_RELAXES:
            return BUILTIN_RELAXES[strategy]
        try:
            return bool(self._registered(strategy).relaxes_num_reqs)
        except KeyError as exc:
            raise ValueError(f"mode {self.mode!r}: {exc.args[0]}") from None

    def _declared(self, strategy: str) -> frozenset[str]:
        """The key classes the strategy declares it cannot serve (``unsupported_classes``; the built-ins none, so plans
        of built-in modes need no plugin manager)."""
        if self.plugins is None and strategy in BUILTIN_RELAXES:
            return frozenset()
        return declared_unsupported(self._registered(strategy))

    def plan(self, decode_reqs: Mapping[int, Sequence[int]], mixed_tokens: Sequence[int]) -> CapturePlan:
        """Keys from chosen sizes: request counts per spec depth, token counts for mixed batches.  When ``folded``, a
        uniform width up to the max capture size is a mixed key; wider uniform batches keep uniform keys."""
        keys: list[tuple[BatchDescriptor, str]] = []
        decode_reqs = {d: list(counts) for d, counts in decode_reqs.items()}
        mixed_tokens = list(mixed_tokens)
        if self.folded:
            top = self.used_max_capture_size
            for depth, counts in decode_reqs.items():
                q = 1 + depth
                mixed_tokens += [q * r for r in counts if q * r <= top]
                decode_reqs[depth] = [r for r in counts if q * r > top]
            mixed_tokens = sorted(set(mixed_tokens))
        for n_loras in self.used_lora_counts:
            if self.decode_strategy is not None:
                for depth, counts in decode_reqs.items():
                    if depth not in self.uniform_depths:
                        continue  # downgraded: mixed keys serve these batches, or they run eagerly
                    for num_reqs in counts:
                        keys.append((BatchDescriptor.decode(num_reqs, depth, n_loras), self.decode_strategy))
            if self.mixed_strategy is not None:
                for tokens in mixed_tokens:
                    reqs = None if self.mixed_relaxed else min(tokens, self.max_num_seqs)
                    keys.append((BatchDescriptor(tokens, reqs, n_loras), self.mixed_strategy))
        if self.ubatch_threshold is not None:
            keys += [(attrs.evolve(key, num_ubatches=2), strategy) for key, strategy in keys if key.num_tokens >= self.ubatch_threshold]
        return CapturePlan(
            tuple(PlanEntry(d, st) for d, st in dict.fromkeys(keys)),
            max_num_seqs=self.max_num_seqs,
            max_num_tokens=self.max_num_tokens,
            decode_widest=self.widest,
            downgrades=self.downgrades,
        )


@attrs.frozen(slots=True)
class CapturePlan:
    """An ordered, duplicate-free list of entries to capture, largest first; ``max_num_seqs`` and ``max_num_tokens``
    (kept when built from settings) let it say which batches it leaves uncovered."""

    entries: tuple[PlanEntry, ...] = attrs.field(converter=tuple)
    max_num_seqs: int | None = None
    max_num_tokens: int | None = None
    decode_widest: Mapping[int, int] | None = None  # spec depth -> widest uniform batch the engine will send
    downgrades: tuple[Downgrade, ...] = ()  # key classes the settings' ``unsupported`` moved off a strategy

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
    def build(cls, *settings: Any, **fields: Any) -> CapturePlan:
        """Keys for an engine's settings: a ``PlanSettings``, or its fields by keyword or in declaration order.

        Uniform-decode keys carry an exact request count: per spec depth ``d``, the capture sizes rounded up to whole
        requests of ``1 + d`` tokens (as vLLM sizes them), the request ladder (1, 2, 4, 8, 16, 24, ...) while it fits
        the max capture size (default sizes only), and the widest uniform batch.  ``spec_depths`` may be a schedule
        ``{largest request count: depths}``.  Mixed keys cover any batch up to ``max_capture_size`` tokens, without a
        request count for a strategy that relaxes ``num_reqs``, else with ``min(tokens, max_num_seqs)``.  Where mixed
        keys serve uniform batches too, the uniform widths that fit are mixed token counts (one graph per token count
        when ``folded``); where uniform batches have keys of their own, mixed keys also get the sizes rounded up to
        whole requests of the deepest depth (docs/plans-and-workloads.md, "Compared with vLLM").  Every key is repeated
        per LoRA count (default with ``max_loras``: ``lora_ladder(max_loras)``).
        """
        plan_settings = _settings(settings, fields)
        return plan_settings.plan(plan_settings.decode_reqs, plan_settings.mixed_sizes)

    @classmethod
    def fit(
        cls, steps: Workload, max_graphs: int | None, *settings: Any, max_bytes: int | None = None, memory: Any = None, **fields: Any,
    ) -> CapturePlan:
        """The plan with at most ``max_graphs`` graphs (and/or, with ``memory``, a ``reg.estimate_memory()`` result, at
        most ``max_bytes`` of device memory for its capture) that pads ``steps`` least (exactly).

        ``steps``: the actual shapes, one per step, or a histogram ``{shape: steps}``.  Takes ``build``'s settings and
        keeps its covering guarantees (the widest uniform batch of each depth and the max capture size stay keys).
        Families: one per spec depth for uniform batches (request counts), one for mixed batches (token counts), served
        as the matcher serves them (with ``separate_decode`` the fitted padding is an upper bound); sizes are shared by
        all LoRA counts.  Under ``max_bytes`` a key costs ``memory.key_bytes``, after ``memory.fixed_bytes()`` (the pool
        and warm-up of the largest keys, which every fitted plan keeps).
        """
        plan_settings = _settings(settings, fields)
        if plan_settings.ubatch_threshold is not None:
            raise ValueError(
                f"ubatch_threshold={plan_settings.ubatch_threshold}: CapturePlan.fit does not count the two-micro-batch keys "
                "it adds against max_graphs or max_bytes; fit without it, or build the plan with CapturePlan.build")
        decode, mixed = fit_families(steps, max_graphs, plan_settings, max_bytes=max_bytes, pricing=memory)
        return plan_settings.plan(decode, mixed)

    def __iter__(self) -> Iterator[PlanEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def descriptors(self) -> list[BatchDescriptor]:
        """The keys in capture order."""
        return [e.descriptor for e in self.entries]

    def uncovered(self, *, max_padding_tokens: int | None = None, max_padding_ratio: float | None = None) -> list[UncoveredRange]:
        """Actual batch shapes up to the plan's maxima that no key serves, each run with its reason: every uniform batch
        (each spec depth and LoRA count of the plan) and every mixed batch at its worst-case request count.  With a
        padding cap (``GraphRegistry``'s), shapes whose every covering key pads more are uncovered too ("padding_cap")."""
        if self.max_num_seqs is None or self.max_num_tokens is None:
            raise ValueError("uncovered() needs a plan built with max_num_seqs and max_num_tokens")
        pairs = [(e.descriptor, e.strategy) for e in self.entries]
        matcher = Matcher(pairs, max_padding_tokens=max_padding_tokens, max_padding_ratio=max_padding_ratio)
        uncapped = Matcher(pairs) if matcher.cap else matcher
        widest = self.decode_widest
        if widest is None:
            depths = {e.descriptor.spec_depth for e in self.entries} | {0}
            widest = {d: min(self.max_num_seqs, self.max_num_tokens // (1 + d)) for d in depths}
        max_loras = max((e.descriptor.num_active_loras for e in self.entries), default=0)
        keys = [e.descriptor for e in self.entries]
        seqs = self.max_num_seqs
        gaps: list[UncoveredRange] = []
        for n_loras in range(max_loras + 1):
            for depth, reqs_max in sorted(widest.items()):
                q = 1 + depth
                points = _change_points(keys, q, reqs_max, matcher.cap)

                def decode(r: int, q: int = q, depth: int = depth) -> tuple[int, BatchDescriptor]:
                    return r * q, BatchDescriptor.decode(r, depth, n_loras)

                gaps += _runs("decode", n_loras, depth, points, reqs_max, decode, matcher, uncapped)

            def mixed(t: int) -> tuple[int, BatchDescriptor]:
                return t, BatchDescriptor(t, min(t, seqs), n_loras)

            points = _change_points(keys, 1, self.max_num_tokens, matcher.cap, seqs)
            gaps += _runs("mixed", n_loras, None, points, self.max_num_tokens, mixed, matcher, uncapped)
        return gaps


def _settings(positional: tuple[Any, ...], fields: dict[str, Any]) -> PlanSettings:
    """A ``PlanSettings`` given as one, or built from its fields (positional ones in declaration order)."""
    if len(positional) == 1 and isinstance(positional[0], PlanSettings):
        if fields:
            raise TypeError(f"give a PlanSettings or its fields, not both; got a PlanSettings and {sorted(fields)}")
        return positional[0]
    names = [f.name for f in attrs.fields(PlanSettings) if f.init]
    if len(positional) > len(names):
        raise TypeError(f"plans take at most {len(names)} settings ({', '.join(names)}), got {len(positional)} positional values")
    for name, value in zip(names, positional):
        if name in fields:
            raise TypeError(f"setting {name!r} given twice, by position and by keyword")
        fields[name] = value
    return PlanSettings(**fields)


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


def _change_points(keys: Sequence[BatchDescriptor], q: int, last: int, cap: PaddingCap, seqs: int | None = None) -> list[int]:
    """Sizes in 1..``last`` where whether a batch is served may change; between two of them it cannot.

    Size ``n``: ``n * q`` tokens and ``n`` requests (uniform, depth ``q - 1``), or with ``seqs`` ``n`` tokens and
    ``min(n, seqs)`` requests (mixed).  A key stops covering past its token and request counts, and a padding cap
    allows it from ``tokens - max_padding_tokens`` and ``tokens / (1 + max_padding_ratio)`` on: each threshold, with
    neighbours against rounding, is a point, so ``uncovered`` asks the matcher a few times per key."""
    thresholds: list[float] = [0, last]
    if seqs is not None:
        thresholds.append(seqs)
    for key in keys:
        thresholds.append(key.num_tokens / q)
        if key.num_reqs is not None:
            thresholds.append(key.num_reqs)
        if cap.max_tokens is not None:
            thresholds.append((key.num_tokens - cap.max_tokens) / q)
        if cap.max_ratio is not None:
            thresholds.append(key.num_tokens / (q * (1 + cap.max_ratio)))
    points = {1}
    for x in thresholds:
        base = math.floor(x)
        points.update(n for n in range(base - 1, base + 3) if 1 <= n <= last)
    return sorted(points)


def _runs(
    key_class: str, n_loras: int, depth: int | None, points: list[int], last: int,
    shape: Callable[[int], tuple[int, BatchDescriptor]], matcher: Matcher, uncapped: Matcher,
) -> list[UncoveredRange]:
    """Runs of sizes 1..``last`` that ``matcher`` serves no key for, split where the reason changes; only ``points``
    (``_change_points``) are matched.  ``shape(n)``: the batch of size ``n`` and its tokens."""
    out: list[UncoveredRange] = []
    start: int | None = None
    reason: str | None = None
    for n in points:
        tokens, actual = shape(n)
        now = None if matcher.match(actual) is not None else "no_key" if uncapped.match(actual) is None else "padding_cap"
        if now != reason:
            if reason is not None:
                out.append(UncoveredRange(key_class, n_loras, depth, start, shape(n - 1)[0], reason))  # type: ignore[arg-type]
            start, reason = tokens, now
    if reason is not None:
        out.append(UncoveredRange(key_class, n_loras, depth, start, shape(last)[0], reason))  # type: ignore[arg-type]
    return out
