"""Scrape the plugin's HTTP endpoint on loopback and check the numbers against registry.stats()."""

from __future__ import annotations

import re
import urllib.request

import cgregistry_prometheus
import pytest
import torch

import cgregistry as cg


@pytest.fixture
def endpoint():  # noqa: ANN201
    server, port = cgregistry_prometheus.serve(port=0, addr="127.0.0.1")
    yield port
    cgregistry_prometheus.shutdown()


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        m = re.match(r"^(cgregistry_\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


@pytest.mark.filterwarnings("ignore:.*do not fit static input:RuntimeWarning")  # on purpose
def test_registry_counters_are_scraped(endpoint: int) -> None:
    reg = cg.GraphRegistry(lambda b, x: x + 1, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", name="scraped")
    assert reg in cgregistry_prometheus.tracked(), "attached through the installed entry point"
    reg.capture([(cg.BatchDescriptor(8), "full"), (cg.BatchDescriptor(16), "full")])
    for n in (3, 8, 5):
        reg.run(cg.BatchDescriptor(n, 1), x=torch.ones(n))
    reg.run(cg.BatchDescriptor(16, 2), x=torch.ones(16))
    reg.run(cg.BatchDescriptor(20, 1), x=torch.ones(20))  # larger than any key: a miss
    s = scrape(endpoint)
    stats = reg.stats()
    assert s['cgregistry_replays_total{registry="scraped",strategy="full"}'] == stats.hits == 4
    assert s['cgregistry_misses_total{registry="scraped"}'] == stats.misses == 1
    assert s['cgregistry_eager_fallbacks_total{registry="scraped"}'] == 1
    assert s['cgregistry_padded_tokens_total{registry="scraped"}'] == stats.padded_tokens == 5 + 0 + 3
    assert s['cgregistry_graph_tokens_total{registry="scraped"}'] == 3 + 8 + 5 + 16
    assert s['cgregistry_entries{registry="scraped",strategy="full"}'] == 2
    assert s['cgregistry_memory_bytes{registry="scraped"}'] == reg.memory_bytes()
    reg.run(cg.BatchDescriptor(2, 1), x=torch.ones(2))
    assert scrape(endpoint)['cgregistry_replays_total{registry="scraped",strategy="full"}'] == 5, "read live at scrape time"


def test_registries_are_held_weakly(endpoint: int) -> None:
    reg = cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((4,), torch.float32)}, backend="cpu", name="short-lived")
    assert any('registry="short-lived"' in k for k in scrape(endpoint))
    del reg
    import gc

    gc.collect()
    assert not any('registry="short-lived"' in k for k in scrape(endpoint))
