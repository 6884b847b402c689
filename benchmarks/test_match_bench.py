"""match() cost at 10 and 10,000 keys, against a plain dict lookup (what hand-written engines do).

Run: python -m pytest benchmarks/test_match_bench.py --benchmark-only
pytest-benchmark prints each row's ratio to the fastest row of its group.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B


def uniform_keys(n: int) -> list[tuple[B, str]]:
    """n uniform full keys spread over spec depths and LoRA counts (several graphs per token count)."""
    depths, loras = (0, 1, 2, 3), (0, 1, 2, 4, 8)
    per_class = max(1, n // (len(depths) * len(loras)))
    keys = [(B.decode(r, d, l), "full") for d in depths for l in loras for r in range(1, per_class + 1)]
    return keys[:n]


def actual_batches(keys: list[tuple[B, str]], count: int = 512) -> list[B]:
    rng = random.Random(0)
    max_reqs = max(k.num_reqs for k, _ in keys)
    out = []
    for _ in range(count):
        d = rng.choice((0, 1, 2, 3)) if len(keys) > 10 else 0
        l = rng.choice((0, 1, 3, 5)) if len(keys) > 10 else 0
        out.append(B.decode(rng.randint(1, max_reqs), d, l))
    return out


def cycle_call(fn, items):  # noqa: ANN001, ANN201
    it = itertools.cycle(items)
    return lambda: fn(next(it))


@pytest.mark.parametrize("n_keys", [10, 10_000])
@pytest.mark.benchmark(group="match")
def test_matcher_match(benchmark, n_keys: int) -> None:  # noqa: ANN001
    keys = uniform_keys(n_keys) if n_keys > 10 else [(B.decode(r), "full") for r in (1, 2, 4, 8, 16, 24, 32, 40, 48, 64)]
    assert len(keys) == n_keys
    matcher = cg.Matcher(keys)
    batches = actual_batches(keys)
    assert all(matcher.match(b) is not None for b in batches)
    benchmark(cycle_call(matcher.match, batches))


@pytest.mark.parametrize("n_keys", [10, 10_000])
@pytest.mark.benchmark(group="match")
def test_matcher_match_first_sight(benchmark, n_keys: int) -> None:  # noqa: ANN001
    """A shape never seen before: table index per key class, no memo."""
    keys = uniform_keys(n_keys) if n_keys > 10 else [(B.decode(r), "full") for r in (1, 2, 4, 8, 16, 24, 32, 40, 48, 64)]
    matcher = cg.Matcher(keys)
    batches = actual_batches(keys)
    benchmark(cycle_call(matcher.match_uncached, batches))


@pytest.mark.parametrize("n_keys", [10, 10_000])
@pytest.mark.benchmark(group="match")
def test_registry_match_cached_route(benchmark, n_keys: int) -> None:  # noqa: ANN001
    """reg.match(): what run() pays per step once a shape has been seen."""
    keys = uniform_keys(n_keys) if n_keys > 10 else [(B.decode(r), "full") for r in (1, 2, 4, 8, 16, 24, 32, 40, 48, 64)]
    reg = cg.GraphRegistry(lambda b: None, {}, backend="cpu")
    reg.capture(keys, lazy=True)  # matching only: pending keys route like captured ones, no graphs needed
    batches = actual_batches(keys)
    benchmark(cycle_call(reg.match, batches))


@pytest.mark.benchmark(group="match")
def test_baseline_plain_dict_lookup(benchmark) -> None:  # noqa: ANN001
    """The hand-written baseline: graphs[padded_size] with the padded size already known."""
    table = {b: torch.Size([1]) for b in (B.decode(r) for r in range(1, 65))}
    batches = [B.decode(r) for r in random.Random(0).choices(range(1, 65), k=512)]
    benchmark(cycle_call(table.__getitem__, batches))
