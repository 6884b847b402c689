"""Request traces and a continuous-batching scheduler model that turns them into batch shapes.

``read_trace`` reads the Azure LLM inference format (``TIMESTAMP,ContextTokens,GeneratedTokens``), by default the
bundled 2023 conversation trace (CC BY 4.0, ``cgregistry/plan/data/README.md``).  ``schedule`` replays requests as a
vLLM-style scheduler would (decode first, then chunked prefill under a token budget, at most ``max_num_seqs``
running), yielding each step's actual BatchDescriptor.
"""

from __future__ import annotations

import csv
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from importlib import resources
from pathlib import Path

import attrs

from cgregistry.key.descriptor import BatchDescriptor

__all__ = ["Request", "SchedulerConfig", "bundled_trace_path", "read_trace", "schedule"]


@attrs.frozen(slots=True)
class Request:
    """One request of a trace: arrival time in seconds from the first, prompt and output lengths."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def bundled_trace_path() -> Path:
    """The shipped copy of the Azure 2023 conversation trace."""
    return Path(str(resources.files("cgregistry.plan") / "data" / "azure_llm_conv_2023.csv"))


def _timestamp(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than datetime parses.
    whole, _, frac = text.strip().partition(".")
    seconds = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return seconds + (float("0." + frac) if frac else 0.0)


def read_trace(path: str | Path | None = None, limit: int | None = None) -> list[Request]:
    """Requests of a trace in the Azure format, arrival times relative to the first request."""
    path = bundled_trace_path() if path is None else Path(path)
    requests: list[Request] = []
    start: float | None = None
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        expected = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header] != expected:
            raise ValueError(f"{path}: expected a header {','.join(expected)}, got {header!r}")
        for lineno, row in enumerate(reader, start=2):
            if limit is not None and len(requests) >= limit:
                break
            try:
                ts, prompt, output = _timestamp(row[0]), int(row[1]), int(row[2])
            except (ValueError, IndexError) as exc:
                raise ValueError(f"{path}:{lineno}: cannot read row {row!r}: {exc}") from None
            if prompt < 1 or output < 0:
                raise ValueError(f"{path}:{lineno}: token counts must be positive, got {prompt}, {output}")
            start = ts if start is None else start
            requests.append(Request(ts - start, prompt, output))
    return requests


def _schedule(value: Mapping[int, int] | None) -> tuple[tuple[int, int], ...] | None:
    if value is None:
        return None
    pairs = tuple(sorted(dict(value).items()))
    for bound, depth in pairs:
        if type(bound) is not int or bound < 1 or type(depth) is not int or depth < 0:
            raise ValueError(f"spec_schedule maps request counts >= 1 to depths >= 0, got {bound!r}: {depth!r}")
    return pairs


@attrs.frozen(slots=True)
class SchedulerConfig:
    """Scheduler settings and the step-time model used to advance the clock.  ``spec_schedule`` (dynamic speculative
    decoding) maps a largest number of decoding requests to the depth used up to it, e.g. ``{8: 3, 64: 1, 256: 0}``;
    beyond its last bound, or without one, steps use ``spec_depth``."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    spec_depth: int = 0
    spec_schedule: tuple[tuple[int, int], ...] | None = attrs.field(default=None, converter=_schedule)
    step_base_s: float = 0.010  # fixed cost of one model step
    step_per_token_s: float = 0.00002  # plus this per scheduled token

    def depth_for(self, decoding: int) -> int:
        """The speculative depth for a step with ``decoding`` requests in decode."""
        return next((depth for bound, depth in self.spec_schedule or () if decoding <= bound), self.spec_depth)


class _Running:
    __slots__ = ("prefill_left", "decode_left")

    def __init__(self, req: Request) -> None:
        self.prefill_left = req.prompt_tokens
        self.decode_left = max(req.output_tokens - 1, 0)  # the prefill's last step yields the first token


def schedule(requests: Iterable[Request], config: SchedulerConfig = SchedulerConfig(), max_steps: int | None = None) -> Iterator[BatchDescriptor]:
    """Each model step's actual batch for ``requests`` under ``config``."""
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    waiting: deque[_Running] = deque()
    running: list[_Running] = []
    now = 0.0
    steps = 0
    while pending or waiting or running:
        if max_steps is not None and steps >= max_steps:
            return
        if not waiting and not running and pending[0].arrival_s > now:
            now = pending[0].arrival_s  # idle until the next arrival
        while pending and pending[0].arrival_s <= now:
            waiting.append(_Running(pending.popleft()))
        budget = config.max_num_batched_tokens
        depth = config.depth_for(sum(1 for r in running if r.prefill_left == 0))
        q = 1 + depth
        decode: list[_Running] = []
        chunks: list[tuple[_Running, int]] = []
        for r in running:  # decode first
            if r.prefill_left == 0 and budget >= q:
                decode.append(r)
                budget -= q
        for r in running:  # then unfinished prefills
            if r.prefill_left and budget:
                take = min(r.prefill_left, budget)
                chunks.append((r, take))
                budget -= take
        while waiting and budget and len(running) < config.max_num_seqs:  # then new requests
            r = waiting.popleft()
            running.append(r)
            take = min(r.prefill_left, budget)
            chunks.append((r, take))
            budget -= take
        tokens = len(decode) * q + sum(n for _, n in chunks)
        reqs = len(decode) + len(chunks)
        if reqs == 0:
            now = pending[0].arrival_s if pending else now
            continue
        yield BatchDescriptor(tokens, reqs, spec_depth=depth) if chunks else BatchDescriptor.decode(reqs, depth)
        steps += 1
        for r in decode:
            r.decode_left = max(r.decode_left - q, 0)
        for r, n in chunks:
            r.prefill_left -= n
        running = [r for r in running if r.prefill_left or r.decode_left]
        now += config.step_base_s + config.step_per_token_s * tokens
