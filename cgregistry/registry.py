"""GraphRegistry: owns static buffers, the pool, entries, the matcher and the counters.

Hot path (``run``): one dict lookup of the actual descriptor gives a *route*
(entry, rows to copy per input, sliced outputs) built the first time that
shape was seen; then one copy per input, the replay, two counter bumps.
A batch no key covers runs ``step`` eagerly on the live inputs and is counted.
"""

from __future__ import annotations

import gc
import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from cgregistry.buffers import InputError, StaticBuffer, StaticInput
from cgregistry.descriptor import BatchDescriptor
from cgregistry.matcher import DEFAULT_PREFERENCE, Explanation, Match, Matcher
from cgregistry.outputs import OutputError, OutputSlicer, flatten
from cgregistry.plan import CapturePlan, PlanEntry
from cgregistry.plugins import PluginError, Plugins
from cgregistry.text import text_table

_CG_INTERNAL = True

__all__ = ["CaptureError", "EntryInfo", "GraphRegistry", "Stats"]

# Distinct actual shapes remembered by the route cache before it starts over.
_ROUTE_CACHE_LIMIT = 1 << 16
_names = itertools.count(1)  # default registry names: registry-1, registry-2, ...


class CaptureError(RuntimeError):
    """Capturing one entry failed; the registry is as it was before that entry."""

    def __init__(self, descriptor: BatchDescriptor, strategy: str, cause: BaseException) -> None:
        super().__init__(f"capturing {descriptor} with strategy {strategy!r} failed: {type(cause).__name__}: {cause}")
        self.descriptor = descriptor
        self.strategy = strategy


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
    last_step: int  # value of the registry's step counter at the last replay (0: never)


@attrs.frozen(slots=True)
class Stats:
    """Counters since the last reset."""

    hits: int
    misses: int
    eager_fallbacks: int
    graph_tokens: int  # real tokens served by graphs
    padded_tokens: int  # padding tokens computed by graphs
    eager_tokens: int
    by_strategy: Mapping[str, int]  # replays per strategy
    entry_failures: int = 0  # entries removed because their replay raised (see failures())

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def padding_ratio(self) -> float:
        """Padded tokens over all tokens computed by graphs."""
        total = self.graph_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0


class _Entry:
    __slots__ = (
        "key", "strategy", "graph", "replay", "slicer", "capture_seconds", "memory_bytes",
        "replays", "padded_tokens", "graph_tokens", "last_step",
    )

    def __init__(self, key: BatchDescriptor, strategy: str, graph: Any, slicer: OutputSlicer, seconds: float) -> None:
        self.key = key
        self.strategy = strategy
        self.graph = graph
        self.replay = graph.replay
        self.slicer = slicer
        self.capture_seconds = seconds
        self.memory_bytes = int(graph.memory_bytes)
        self.replays = 0
        self.padded_tokens = 0
        self.graph_tokens = 0
        self.last_step = 0


class _Route:
    """Everything ``run`` needs for one actual shape, computed once."""

    __slots__ = ("entry", "match", "copies", "out_rows", "single_output", "real_tokens", "pad_tokens")

    def __init__(self, entry: _Entry | None, match: Match | None, copies: tuple[tuple[StaticBuffer, int], ...], out_rows: int, real_tokens: int) -> None:
        self.entry = entry
        self.match = match
        self.copies = copies
        self.out_rows = out_rows
        self.real_tokens = real_tokens
        self.pad_tokens = match.padding.tokens if match is not None else 0
        self.single_output = entry.slicer.sliced(out_rows) if entry is not None and entry.slicer.spec is None else None


def _rows(axis: str, descriptor: BatchDescriptor) -> int | None:
    if axis == "tokens":
        return descriptor.num_tokens
    return descriptor.num_reqs


class GraphRegistry:
    """Captured graphs for one step function, keyed by BatchDescriptor.

    ``step(batch, **inputs)`` is the engine's forward: it gets the padded key and
    views of the static buffers sized for it, and returns a tensor or a pytree of
    tensors whose leading dimension is the padded token (or request) count.

    Outputs returned by ``run`` are views of graph memory: valid until the next
    ``run`` on this registry, and only while the registry lives (on CUDA they do
    not own the pool).  Not thread-safe: call ``run`` from one thread.
    """

    def __init__(
        self,
        step: Callable[..., Any],
        inputs: Mapping[str, StaticInput],
        *,
        backend: str = "auto",
        output_axis: str = "tokens",
        preference: Sequence[str] = DEFAULT_PREFERENCE,
        warmup_runs: int = 1,
        plugins: Plugins | None = None,
        name: str | None = None,
    ) -> None:
        if not callable(step):
            raise TypeError(f"step must be callable, got {step!r}")
        if output_axis not in ("tokens", "reqs"):
            raise ValueError(f"output_axis must be 'tokens' or 'reqs', got {output_axis!r}")
        if type(warmup_runs) is not int or warmup_runs < 1:
            raise ValueError(f"warmup_runs must be an int >= 1, got {warmup_runs!r}")
        for input_name, spec in inputs.items():
            if not isinstance(spec, StaticInput):
                raise TypeError(f"inputs[{input_name!r}] must be a cgregistry.StaticInput, got {spec!r}")
        self._step = step
        self.name = name if name is not None else f"registry-{next(_names)}"
        self.plugins = plugins if plugins is not None else Plugins()
        self.backend = self.plugins.backend(backend)
        self.device = self.backend.device()
        self.output_axis = output_axis
        self.preference = tuple(preference)
        self.warmup_runs = warmup_runs
        self._buffers = {key: StaticBuffer(key, spec, self.device) for key, spec in inputs.items()}
        self._input_names = frozenset(self._buffers)
        self._pool = self.backend.new_pool()
        self._entries: dict[tuple[BatchDescriptor, str], _Entry] = {}
        self._matcher = Matcher((), self.preference)
        self._routes: dict[BatchDescriptor, _Route] = {}
        self._clock = 0
        self._misses = 0
        self._eager_fallbacks = 0
        self._eager_tokens = 0
        self._failures: dict[tuple[BatchDescriptor, str], BaseException] = {}
        hook = self.plugins.pm.hook
        self._hook = hook
        # Hooks with no implementation cost nothing: the hot path checks a None.
        self._miss_hook = hook.cgregistry_miss if hook.cgregistry_miss.get_hookimpls() else None
        self._choose_hook = hook.cgregistry_choose_match if hook.cgregistry_choose_match.get_hookimpls() else None
        hook.cgregistry_registry_created(registry=self)

    # ------------------------------------------------------------------ capture

    def capture(self, plan: CapturePlan | Iterable[PlanEntry | tuple[BatchDescriptor, str]], *, progress: bool | None = None) -> list[EntryInfo]:
        """Capture every entry of ``plan`` not yet captured, in plan order (largest first).

        All entries are checked before any is captured.  If one fails, the
        entries captured before it stay, it is absent, and ``CaptureError``
        names its descriptor and strategy.
        """
        todo = [self._plan_entry(e) for e in plan]
        for entry in todo:
            self.plugins.strategy(entry.strategy)
            self._check_fits(entry.descriptor)
        todo = [e for e in dict.fromkeys(todo) if (e.descriptor, e.strategy) not in self._entries]
        if progress is None:
            progress = len(todo) > 1 and _stderr_is_terminal()
        bar = _progress(todo, progress)
        # Freeze the heap so no collection (and no tensor finaliser) runs between captures.
        freeze = gc.get_freeze_count() == 0  # leave a caller's own frozen heap alone
        if freeze:
            gc.collect()
            gc.freeze()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        captured: list[EntryInfo] = []
        try:
            for entry in bar:
                captured.append(self._capture_observed(entry.descriptor, entry.strategy))
        finally:
            if freeze:
                gc.unfreeze()
            if gc_was_enabled:
                gc.enable()
            self._rebuild()
            if hasattr(bar, "close"):
                bar.close()
        return captured

    def _capture_observed(self, key: BatchDescriptor, strategy: str) -> EntryInfo:
        """Capture one entry between the capture_started and capture_finished hooks."""
        try:
            self._hook.cgregistry_capture_started(registry=self, key=key, strategy=strategy)
            info = self._info(self._capture_one(key, strategy))
        except Exception as exc:
            error = exc if isinstance(exc, CaptureError) else CaptureError(key, strategy, exc)
            self._hook.cgregistry_capture_finished(registry=self, key=key, strategy=strategy, entry=None, error=error)
            if error is exc:
                raise
            raise error from exc
        self._hook.cgregistry_capture_finished(registry=self, key=key, strategy=strategy, entry=info, error=None)
        return info

    @staticmethod
    def _plan_entry(e: object) -> PlanEntry:
        if isinstance(e, PlanEntry):
            return e
        if isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], BatchDescriptor) and isinstance(e[1], str):
            return PlanEntry(e[0], e[1])
        raise TypeError(f"a plan holds PlanEntry or (BatchDescriptor, strategy name) pairs, got {e!r}")

    def _check_fits(self, key: BatchDescriptor) -> None:
        for buf in self._buffers.values():
            rows = self._key_rows(buf, key)
            if rows > buf.capacity:
                raise ValueError(
                    f"key {key} needs {rows} {buf.spec.axis} in static input {buf.name!r}, "
                    f"which holds {buf.capacity}; enlarge its StaticInput shape"
                )

    @staticmethod
    def _key_rows(buf: StaticBuffer, key: BatchDescriptor) -> int:
        rows = _rows(buf.spec.axis, key)
        return buf.capacity if rows is None else rows  # relaxed keys see every request slot

    def _capture_one(self, key: BatchDescriptor, strategy_name: str) -> _Entry:
        strategy = self.plugins.strategy(strategy_name)
        views = {name: buf.view(self._key_rows(buf, key)) for name, buf in self._buffers.items()}
        step = self._step

        def body() -> Any:
            return step(key, **views)

        started = time.perf_counter()
        try:
            with torch.inference_mode():
                warm_leaves, spec = flatten(self.backend.warmup(body, self.warmup_runs))
                self._check_outputs(warm_leaves, key)
                del warm_leaves
                graph, out = strategy.capture(body, self.backend, self._pool)
                leaves, captured_spec = flatten(out)
                del out
                if captured_spec != spec:
                    raise OutputError("the step returned a different output structure at capture than at warm-up")
                self._check_outputs(leaves, key)
            self.backend.synchronize()
        except Exception as exc:
            self._pool = self.backend.recover_pool(self._pool)
            raise CaptureError(key, strategy_name, exc) from exc
        seconds = time.perf_counter() - started
        entry = _Entry(key, strategy_name, graph, OutputSlicer(self.backend.share_outputs(leaves), spec), seconds)
        self._entries[(key, strategy_name)] = entry
        return entry

    def _check_outputs(self, leaves: list[torch.Tensor], key: BatchDescriptor) -> None:
        if not leaves:
            raise OutputError("the step returned no tensor")
        rows = key.num_tokens if self.output_axis == "tokens" else key.num_reqs
        for i, leaf in enumerate(leaves):
            if leaf.dim() == 0 or (rows is not None and leaf.shape[0] != rows):
                raise OutputError(
                    f"output leaf {i} has shape {tuple(leaf.shape)}; expected a leading dimension of "
                    f"{rows} ({self.output_axis} of {key})"
                )
            if leaf.device != self.device:
                raise OutputError(f"output leaf {i} is on {leaf.device}, expected {self.device}")
        if rows is None:
            raise OutputError(f"output_axis='reqs' needs keys with a request count; {key} has none")

    def _rebuild(self) -> None:
        self._matcher = Matcher(self._entries, self.preference)
        self._routes.clear()

    # ------------------------------------------------------------------ run

    def run(self, actual: BatchDescriptor, /, **inputs: torch.Tensor) -> Any:
        """Match, copy in, pad, replay, and return outputs sliced to ``actual``.

        With no covering key, ``step(actual, **inputs)`` runs eagerly (counted).
        """
        route = self._routes.get(actual)
        if route is None:
            route = self._route(actual)
        entry = route.entry
        if entry is None:
            if inputs.keys() != self._input_names:
                raise self._bad_names(inputs)
            self._misses += 1
            if self._miss_hook is not None:
                self._miss_hook(registry=self, actual=actual)
            return self._eager(actual, inputs)
        if len(inputs) != len(route.copies):
            raise self._bad_names(inputs)
        try:
            for buf, rows in route.copies:
                buf.write(inputs[buf.name], rows)
        except KeyError:
            raise self._bad_names(inputs) from None
        try:
            entry.replay()
        except Exception as exc:  # a strategy's replay failed: contain it to its entry
            self._remove_failed(entry, exc)
            return self._eager(actual, inputs)
        entry.replays += 1
        entry.padded_tokens += route.pad_tokens
        entry.graph_tokens += route.real_tokens
        self._clock += 1
        entry.last_step = self._clock
        out = route.single_output
        if out is not None:
            return out
        return entry.slicer.sliced(route.out_rows)

    def _eager(self, actual: BatchDescriptor, inputs: Mapping[str, torch.Tensor]) -> Any:
        self._eager_fallbacks += 1
        self._eager_tokens += actual.num_tokens
        return self._step(actual, **inputs)

    def _remove_failed(self, entry: _Entry, error: BaseException) -> None:
        """Drop an entry whose replay raised, keep the error for failures(), tell observers."""
        pair = (entry.key, entry.strategy)
        self._entries.pop(pair, None)
        self._failures[pair] = error
        self._rebuild()
        warnings.warn(
            f"cgregistry: replay of {entry.key} [{entry.strategy}] raised {type(error).__name__}: {error}; "
            "the entry was removed and the step ran eagerly",
            RuntimeWarning,
            stacklevel=3,
        )
        self._hook.cgregistry_entry_failed(registry=self, key=entry.key, strategy=entry.strategy, error=error)

    def failures(self) -> dict[tuple[BatchDescriptor, str], BaseException]:
        """Entries removed because their replay raised, with the error (a new capture may replace them)."""
        return dict(self._failures)

    def _bad_names(self, inputs: Mapping[str, Any]) -> InputError:
        missing = sorted(self._input_names - inputs.keys())
        extra = sorted(inputs.keys() - self._input_names)
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"unexpected {extra}")
        return InputError(f"run() inputs do not match the static inputs: {'; '.join(parts)}; expected {sorted(self._input_names)}")

    def _route(self, actual: BatchDescriptor) -> _Route:
        if not isinstance(actual, BatchDescriptor):
            raise TypeError(f"run() needs a BatchDescriptor, got {actual!r}")
        match = self._matcher.match(actual)
        if match is not None and self._choose_hook is not None:
            match = self._chosen(actual, match)
        entry = self._entries[(match.key, match.strategy)] if match is not None else None
        copies = []
        for buf in self._buffers.values():
            rows = _rows(buf.spec.axis, actual)
            if rows is None:
                raise InputError(f"static input {buf.name!r} is indexed by requests, but {actual} gives num_reqs=None")
            copies.append((buf, rows))
        out_rows = actual.num_tokens if self.output_axis == "tokens" else actual.num_reqs
        if out_rows is None:
            raise InputError(f"output_axis='reqs' needs the batch's request count; {actual} gives none")
        route = _Route(entry, match, tuple(copies), out_rows, actual.num_tokens)
        if len(self._routes) >= _ROUTE_CACHE_LIMIT:
            self._routes.clear()
        self._routes[actual] = route
        return route

    def _chosen(self, actual: BatchDescriptor, default: Match) -> Match:
        candidates = self._matcher.candidates(actual)
        choice = self._choose_hook(registry=self, actual=actual, candidates=candidates)  # type: ignore[misc]
        if choice is None:
            return default
        if choice not in candidates:
            impls = ", ".join(i.plugin_name for i in self._hook.cgregistry_choose_match.get_hookimpls())
            raise PluginError(
                f"cgregistry_choose_match (implemented by {impls}) returned {choice!r} for {actual}, "
                "which is not one of the candidates it was given"
            )
        return choice

    # ------------------------------------------------------------------ inspection

    def match(self, actual: BatchDescriptor) -> Match | None:
        """The key, strategy and padding ``run`` would use for ``actual`` (None: eager)."""
        route = self._routes.get(actual)
        if route is None:
            route = self._route(actual)
        return route.match

    def explain(self, actual: BatchDescriptor) -> Explanation:
        """Every captured key and why it won or lost for ``actual``; ``str()`` gives a table."""
        return self._matcher.explain(actual)

    def entries(self, *, strategy: str | None = None, uniform: bool | None = None) -> list[EntryInfo]:
        """Captured entries, largest first, optionally filtered."""
        out = []
        for entry in self._entries.values():
            if strategy is not None and entry.strategy != strategy:
                continue
            if uniform is not None and entry.key.uniform != uniform:
                continue
            out.append(self._info(entry))
        out.sort(key=lambda e: (-e.key.num_tokens, -(e.key.num_reqs or 0), -e.key.num_active_loras, e.strategy))
        return out

    def _info(self, entry: _Entry) -> EntryInfo:
        return EntryInfo(
            entry.key, entry.strategy, self.backend.name, entry.capture_seconds, entry.memory_bytes,
            entry.replays, entry.padded_tokens, entry.last_step,
        )

    def __len__(self) -> int:
        return len(self._entries)

    def memory_bytes(self) -> int:
        """Measured memory of all captures (pool growth on cuda, held tensors on cpu)."""
        return sum(e.memory_bytes for e in self._entries.values())

    def stats(self) -> Stats:
        """Counters since construction or the last ``reset_stats``."""
        by_strategy: dict[str, int] = {}
        for entry in self._entries.values():
            by_strategy[entry.strategy] = by_strategy.get(entry.strategy, 0) + entry.replays
        entries = self._entries.values()
        return Stats(
            hits=sum(e.replays for e in entries),
            misses=self._misses,
            eager_fallbacks=self._eager_fallbacks,
            graph_tokens=sum(e.graph_tokens for e in entries),
            padded_tokens=sum(e.padded_tokens for e in entries),
            eager_tokens=self._eager_tokens,
            by_strategy=by_strategy,
            entry_failures=len(self._failures),
        )

    def reset_stats(self) -> None:
        """Zero every counter (entries stay captured)."""
        for entry in self._entries.values():
            entry.replays = entry.padded_tokens = entry.graph_tokens = entry.last_step = 0
        self._misses = self._eager_fallbacks = self._eager_tokens = self._clock = 0

    def table(self, *, used_only: bool = False) -> str:
        """Entries as a text table: key, strategy, replays, padding, capture time, memory."""
        rows = [("key", "strategy", "replays", "padded tok", "capture ms", "memory")]
        for e in self.entries():
            if used_only and not e.replays:
                continue
            rows.append((str(e.key), e.strategy, str(e.replays), str(e.padded_tokens), f"{e.capture_seconds * 1e3:.1f}", _bytes(e.memory_bytes)))
        s = self.stats()
        lines = text_table(rows)
        lines.append(
            f"{len(self._entries)} entries on {self.backend.name}, {_bytes(self.memory_bytes())}; "
            f"hits {s.hits}, misses {s.misses}, padding {s.padding_ratio:.1%} of graph tokens"
        )
        return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _stderr_is_terminal() -> bool:
    import sys

    return sys.stderr.isatty()


def _progress(items: list[PlanEntry], enabled: bool) -> Iterable[PlanEntry]:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc="capturing graphs", unit="graph", leave=False)
