"""Plans against workloads: how a plan serves a stream of steps, and the plan that serves it best.

A workload is a stream of actual batch shapes or a histogram ``{descriptor: steps}`` (never expanded).  ``evaluate``
replays one through a plan's matcher (hit rate, eager fallbacks, padded tokens); ``fit_families`` chooses the sizes
that minimise padded tokens under a graph budget, exactly (a dynamic programme per key family, then an exact split of
the budget), which ``CapturePlan.fit`` turns into a plan.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol

import attrs
import torch

from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.key.matcher import DEFAULT_PREFERENCE, Matcher

__all__ = ["KeyPricing", "PlanReport", "Workload", "evaluate", "fit_families", "fit_sizes", "workload_counts"]

# Actual batch shapes, one per step, or a histogram {shape: steps} (the same workload, not expanded).
Workload = Iterable[BatchDescriptor] | Mapping[BatchDescriptor, int]

# Columns of the dynamic programme's cost matrix computed at once (bounds memory for large sizes).
_BLOCK = 512


class PlannedKey(Protocol):
    """One entry of a plan as ``evaluate`` reads it (a ``PlanEntry``; plans build on this module, not the reverse)."""

    @property
    def descriptor(self) -> BatchDescriptor: ...

    @property
    def strategy(self) -> str: ...


class FitSettings(Protocol):
    """What ``fit_families`` reads of a ``PlanSettings``: its strategies, depths, widths and sizes."""

    @property
    def used_lora_counts(self) -> Sequence[int]: ...

    @property
    def used_max_capture_size(self) -> int: ...

    @property
    def size_multiple(self) -> int: ...

    @property
    def decode_strategy(self) -> str | None: ...

    @property
    def mixed_strategy(self) -> str | None: ...

    @property
    def widest(self) -> Mapping[int, int]: ...

    @property
    def uniform_depths(self) -> Collection[int]: ...

    @property
    def folded(self) -> bool: ...


@attrs.frozen(slots=True)
class PlanReport:
    """How one plan served one stream of steps."""

    graphs: int
    largest_key_tokens: int  # the shared pool is about the size of this graph (see docs/performance.md)
    steps: int
    graph_steps: int
    eager_steps: int
    real_tokens: int  # tokens of graph-served steps
    padded_tokens: int
    eager_tokens: int
    by_tokens: Mapping[int, tuple[int, int]]  # actual token count -> (graph-served steps, padded tokens)
    memory_bytes: int | None = None  # measured, when the report comes from a captured registry

    @property
    def hit_rate(self) -> float:
        return self.graph_steps / self.steps if self.steps else 0.0

    @property
    def padding_ratio(self) -> float:
        """Padded tokens over all tokens computed by graphs."""
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0


def workload_counts(steps: Workload, caller: str = "fit()") -> Counter[BatchDescriptor]:
    """``steps`` as ``{shape: steps}``: a mapping's counts (ints >= 0, checked; zeros dropped), or each item of a stream
    counted once.  Errors name ``caller`` and the bad item."""
    counts: Counter[BatchDescriptor] = Counter()
    if isinstance(steps, Mapping):
        for step, n in steps.items():
            if not isinstance(step, BatchDescriptor):
                raise TypeError(f"{caller} takes BatchDescriptors; the workload has a key {step!r} ({type(step).__name__})")
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
                raise ValueError(f"{caller}: a workload mapping holds step counts (ints >= 0); {step} has {n!r}")
            if n:
                counts[step] += int(n)
        return counts
    for i, step in enumerate(steps):
        if not isinstance(step, BatchDescriptor):
            raise TypeError(f"{caller} takes BatchDescriptors; steps[{i}] is {step!r} ({type(step).__name__})")
        counts[step] += 1
    return counts


def evaluate(
    plan: Collection[PlannedKey],
    steps: Workload,
    preference: Sequence[str] = DEFAULT_PREFERENCE,
    memory_bytes: int | None = None,
    *,
    max_padding_tokens: int | None = None,
    max_padding_ratio: float | None = None,
) -> PlanReport:
    """Replay ``steps`` (a stream or a ``{shape: steps}`` histogram) through ``plan``'s matcher and count what graphs would serve.

    ``max_padding_tokens`` and ``max_padding_ratio`` are a registry's padding cap (a capped batch runs eagerly).
    """
    matcher = Matcher(
        ((e.descriptor, e.strategy) for e in plan), preference,
        max_padding_tokens=max_padding_tokens, max_padding_ratio=max_padding_ratio,
    )
    shapes = workload_counts(steps, "evaluate()")
    graph_steps = eager_steps = real = padded = eager_tokens = 0
    by_tokens: dict[int, list[int]] = {}
    for actual, n in shapes.items():
        match = matcher.match(actual)
        if match is None:
            eager_steps += n
            eager_tokens += n * actual.num_tokens
            continue
        graph_steps += n
        real += n * actual.num_tokens
        padded += n * match.padding.tokens
        slot = by_tokens.setdefault(actual.num_tokens, [0, 0])
        slot[0] += n
        slot[1] += n * match.padding.tokens
    return PlanReport(
        graphs=len(plan),
        largest_key_tokens=max((e.descriptor.num_tokens for e in plan), default=0),
        steps=graph_steps + eager_steps,
        graph_steps=graph_steps,
        eager_steps=eager_steps,
        real_tokens=real,
        padded_tokens=padded,
        eager_tokens=eager_tokens,
        by_tokens={t: (v[0], v[1]) for t, v in sorted(by_tokens.items())},
        memory_bytes=memory_bytes,
    )


def fit_sizes(weights: Mapping[int, int], top: int, unit: int = 1, max_sizes: int | None = None) -> dict[int, tuple[int, list[int]]]:
    """Optimal size sets for one family: for k = 1 .. max_sizes, the least total padding with k sizes including ``top``
    and one set achieving it.  ``weights``: observed size (at most ``top``) -> steps; size s serving v pads
    ``(s - v) * unit`` tokens.  A dynamic programme over the observed sizes (with ``top``, all an optimal set uses)."""
    bad = [v for v in weights if v < 1 or v > top]
    if bad:
        raise ValueError(f"sizes {sorted(bad)[:5]} lie outside 1..{top}")
    inf = torch.iinfo(torch.int64).max // 4
    if sum(weights.values()) * top * unit >= inf:  # any padding total must stay below the programme's infinity
        raise ValueError(f"{sum(weights.values())} steps are too many to fit exactly (at most {inf // (top * unit) - 1} here); scale the counts down")
    candidates = sorted(set(weights) | {top})
    m = len(candidates)
    limit = m if max_sizes is None else min(max_sizes, m)
    values = torch.tensor(candidates, dtype=torch.int64)
    w = torch.tensor([weights.get(c, 0) for c in candidates], dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    cum_w = torch.cat([zero, w.cumsum(0)])
    cum_wv = torch.cat([zero, (w * values).cumsum(0)])
    rows = torch.arange(m + 1)[:, None]  # row r: the previous size is candidate r - 1 (r = 0: none)

    def segments(cols: torch.Tensor) -> torch.Tensor:
        """Padding when the candidates after the previous size, up to ``cols``, are served by ``cols``."""
        count = cum_w[cols + 1][None, :] - cum_w[rows]
        weighted = cum_wv[cols + 1][None, :] - cum_wv[rows]
        pad = (values[cols][None, :] * count - weighted) * unit
        return torch.where(rows <= cols[None, :], pad, torch.full_like(pad, inf))

    blocks = [torch.arange(start, min(start + _BLOCK, m)) for start in range(0, m, _BLOCK)]
    # best[k][j]: least padding covering candidates 0..j with k + 1 sizes, the largest being j
    best = [torch.cat([segments(cols)[0] for cols in blocks])]
    choice: list[torch.Tensor] = [torch.full((m,), -1, dtype=torch.int64)]
    for _ in range(1, limit):
        prev = torch.cat([torch.full((1,), inf, dtype=torch.int64), best[-1]])[:, None]
        values_k, args_k = [], []
        for cols in blocks:
            cand = torch.clamp(prev + segments(cols), max=inf)
            v, a = cand.min(dim=0)
            values_k.append(v)
            args_k.append(a - 1)
        best.append(torch.cat(values_k))
        choice.append(torch.cat(args_k))
    out: dict[int, tuple[int, list[int]]] = {}
    for k in range(1, limit + 1):
        cost = int(best[k - 1][m - 1])
        if cost >= inf:
            continue
        sizes, col = [], m - 1
        for level in range(k - 1, -1, -1):
            sizes.append(candidates[col])
            col = int(choice[level][col])
        out[k] = (cost, sorted(sizes))
    return out


class KeyPricing(Protocol):
    """What ``fit_families`` reads of a memory estimate (``cgregistry.capture.memory.MemoryEstimate``) to fit under bytes."""

    def key_bytes(self, key: BatchDescriptor, strategy: str) -> int: ...

    def fixed_bytes(self) -> int: ...


# A byte budget is split in this many steps at most: each family's price is rounded up to whole steps, so a fitted
# plan never exceeds the budget (it may leave up to one step per family unused).
_BYTE_STEPS = 4096


def fit_families(
    steps: Workload, max_graphs: int | None, settings: FitSettings, *, max_bytes: int | None = None, pricing: KeyPricing | None = None,
) -> tuple[dict[int, list[int]], list[int]]:
    """The sizes ``CapturePlan.fit`` captures: request counts per spec depth, and mixed token counts.

    Each key family gets an exact padding curve (``fit_sizes``) over the steps it serves (sizes rounded up to a
    ``size_multiple``), and the budget is split between families exactly (``_split_budget``).  Folded plans fit uniform
    batches up to the max capture size in the mixed family; a depth outside ``uniform_depths`` has no family, a class
    without a strategy none (eager).  Under ``max_bytes`` (``pricing``: a memory estimate), beside
    ``pricing.fixed_bytes()``, a size costs its widest key's ``pricing.key_bytes`` per LoRA count.
    """
    if max_graphs is not None and (type(max_graphs) is not int or max_graphs < 1):
        raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
    if max_bytes is not None and type(max_bytes) is not int:
        raise TypeError(f"max_bytes must be an int byte count >= 0, got {max_bytes!r} ({type(max_bytes).__name__})")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be a byte count >= 0, got {max_bytes!r}")
    if max_bytes is not None and pricing is None:
        raise ValueError(f"max_bytes={max_bytes} needs memory=reg.estimate_memory(plan) to price each key, got none")
    if max_graphs is None and max_bytes is None:
        raise ValueError("fit needs max_graphs, max_bytes (with a memory estimate to price keys), or both")
    per_size = len(settings.used_lora_counts)
    top = settings.used_max_capture_size
    m = settings.size_multiple
    decode_hist: dict[int, Counter[int]] = {}
    if settings.decode_strategy is not None:
        # Folded plans serve uniform batches up to the max capture size from mixed keys: a depth keeps a
        # family of its own only for the uniform batches wider than that.
        decode_hist = {
            d: Counter() for d, w in settings.widest.items()
            if d in settings.uniform_depths and (not settings.folded or w * (1 + d) > top)
        }
    steps_of: dict[int, int] = {d: m // math.gcd(m, 1 + d) for d in decode_hist}  # request counts a key may have
    mixed_hist: Counter[int] = Counter()
    for step, n in workload_counts(steps).items():
        depth = step.spec_depth
        if (
            step.uniform and depth in decode_hist and step.num_reqs <= settings.widest[depth]  # type: ignore[operator]
            and not (settings.folded and step.num_tokens <= top)
        ):
            decode_hist[depth][round_up(step.num_reqs, steps_of[depth])] += n  # type: ignore[arg-type]
        elif settings.mixed_strategy is not None and step.num_tokens <= top:
            mixed_hist[round_up(step.num_tokens, m)] += n
    classes: list[tuple[str, int, str, BatchDescriptor]] = [
        ("decode", d, settings.decode_strategy, BatchDescriptor.decode(settings.widest[d], d)) for d in decode_hist  # type: ignore[misc]
    ]
    if settings.mixed_strategy is not None:
        classes.append(("mixed", 0, settings.mixed_strategy, BatchDescriptor(top)))
    budget = max_graphs // per_size if max_graphs is not None else None
    prices: list[int] | None = None
    units: int | None = None
    if max_bytes is not None:
        prices, units = _prices(classes, settings, max_bytes, pricing)  # type: ignore[arg-type]
    families: list[tuple[str, int, dict[int, tuple[int, list[int]]]]] = []
    for i, (key_class, depth, _, _) in enumerate(classes):
        most = [n for n in (budget, None if prices is None else units // prices[i]) if n is not None]  # type: ignore[operator]
        hist, top_size, unit = (decode_hist[depth], settings.widest[depth], 1 + depth) if key_class == "decode" else (mixed_hist, top, 1)
        families.append((key_class, depth, fit_sizes(hist, top_size, unit=unit, max_sizes=max(1, min(most)))))
    if budget is not None and len(families) > budget:
        raise ValueError(
            f"max_graphs={max_graphs} cannot hold one graph per key family ({len(families)} families "
            f"x {per_size} LoRA counts = {len(families) * per_size})"
        )
    if prices is not None and sum(prices) > units:  # type: ignore[operator]
        raise ValueError(
            f"max_bytes={max_bytes} cannot hold one key of each key family beside the pool and warm-up every fitted plan "
            f"takes ({pricing.fixed_bytes()} bytes)"  # type: ignore[union-attr]
        )
    chosen = _split_budget([f[2] for f in families], budget, prices, units)
    sizes = [(key_class, depth, curve[k][1]) for (key_class, depth, curve), k in zip(families, chosen)]
    return {depth: s for c, depth, s in sizes if c == "decode"}, next((s for c, _, s in sizes if c == "mixed"), [])


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def _prices(
    classes: list[tuple[str, int, str, BatchDescriptor]], settings: FitSettings, max_bytes: int, pricing: KeyPricing,
) -> tuple[list[int], int]:
    """Each family's price per size in byte steps (its widest key, once per LoRA count), and the steps ``max_bytes``
    leaves beside the fixed bytes."""
    room = max_bytes - pricing.fixed_bytes()
    if room <= 0:
        raise ValueError(
            f"max_bytes={max_bytes} does not hold the pool and warm-up every fitted plan takes ({pricing.fixed_bytes()} bytes)"
        )
    step = max(1, -(-room // _BYTE_STEPS))
    prices = []
    for _, _, strategy, widest in classes:
        price = sum(
            pricing.key_bytes(BatchDescriptor(widest.num_tokens, widest.num_reqs, lora, widest.spec_depth, widest.uniform), strategy)
            for lora in settings.used_lora_counts
        )
        prices.append(max(1, -(-price // step)))
    return prices, room // step


def _split_budget(
    curves: list[dict[int, tuple[int, list[int]]]], budget: int | None, prices: list[int] | None = None, units: int | None = None,
) -> list[int]:
    """Sizes per family minimising total padding with at most ``budget`` sizes in all and, with ``prices``, at most
    ``units`` byte steps (each size of a family costing its price): exact."""
    inf = float("inf")
    costs = prices or [0] * len(curves)
    # best[(sizes, steps)] = (padding, choices) using the families seen so far
    best: dict[tuple[int, int], tuple[float, list[int]]] = {(0, 0): (0, [])}
    for curve, price in zip(curves, costs):
        nxt: dict[tuple[int, int], tuple[float, list[int]]] = {}
        for (used, spent), (cost, picks) in best.items():
            for k, (pad, _) in curve.items():
                state = (used + k if budget is not None else 0, spent + k * price)
                if (budget is not None and state[0] > budget) or (units is not None and state[1] > units):
                    continue
                total = cost + pad
                if total < nxt.get(state, (inf, []))[0]:
                    nxt[state] = (total, [*picks, k])
        best = nxt
    _, picks = min(best.values(), key=lambda item: (item[0], sum(item[1])))  # ties: fewer graphs
    return picks
