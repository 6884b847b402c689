"""Prometheus metrics for cgregistry: counters read from live registries at scrape time."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cgregistry.plugin import hookimpl

__all__ = ["PORT_ENV", "RegistryCollector", "serve", "tracked"]
__version__ = "0.1.0"

PORT_ENV = "CGREGISTRY_PROMETHEUS_PORT"

_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_server: tuple[Any, int] | None = None


def tracked() -> list[Any]:
    """The live registries this plugin reports on."""
    return list(_tracked)


class RegistryCollector(Collector):
    """Turns every tracked registry's stats into metric families."""

    def collect(self) -> Iterator[Metric]:
        replays = CounterMetricFamily("cgregistry_replays", "Graph replays (hits)", labels=["registry", "strategy"])
        misses = CounterMetricFamily("cgregistry_misses", "Batches no captured key covered", labels=["registry"])
        eager = CounterMetricFamily("cgregistry_eager_fallbacks", "Steps run eagerly", labels=["registry"])
        graph_tokens = CounterMetricFamily("cgregistry_graph_tokens", "Real tokens served by graphs", labels=["registry"])
        padded = CounterMetricFamily("cgregistry_padded_tokens", "Padding tokens computed by graphs", labels=["registry"])
        failures = GaugeMetricFamily("cgregistry_entry_failures", "Entries removed because their replay raised", labels=["registry"])
        entries = GaugeMetricFamily("cgregistry_entries", "Captured entries", labels=["registry", "strategy"])
        memory = GaugeMetricFamily("cgregistry_memory_bytes", "Measured memory of all captures", labels=["registry"])
        capture = GaugeMetricFamily("cgregistry_capture_seconds", "Total capture time", labels=["registry"])
        for reg in tracked():
            name = reg.name
            stats = reg.stats()
            for strategy, count in sorted(stats.by_strategy.items()):
                replays.add_metric([name, strategy], count)
            misses.add_metric([name], stats.misses)
            eager.add_metric([name], stats.eager_fallbacks)
            graph_tokens.add_metric([name], stats.graph_tokens)
            padded.add_metric([name], stats.padded_tokens)
            failures.add_metric([name], stats.entry_failures)
            infos = reg.entries()
            per_strategy: dict[str, int] = {}
            for info in infos:
                per_strategy[info.strategy] = per_strategy.get(info.strategy, 0) + 1
            for strategy, count in sorted(per_strategy.items()):
                entries.add_metric([name, strategy], count)
            memory.add_metric([name], reg.memory_bytes())
            capture.add_metric([name], sum(i.capture_seconds for i in infos))
        yield from (replays, misses, eager, graph_tokens, padded, failures, entries, memory, capture)


def serve(port: int = 0, addr: str = "127.0.0.1") -> tuple[Any, int]:
    """Start (once) an HTTP endpoint with the metrics; returns the server and its port."""
    global _server
    with _lock:
        if _server is None:
            registry = CollectorRegistry(auto_describe=True)
            registry.register(RegistryCollector())
            server, _thread = start_http_server(port, addr=addr, registry=registry)
            _server = (server, server.server_port)
        return _server


def shutdown() -> None:
    """Stop the endpoint started by ``serve`` (tests and clean exits)."""
    global _server
    with _lock:
        if _server is not None:
            _server[0].shutdown()
            _server[0].server_close()
            _server = None


@hookimpl
def cgregistry_registry_created(registry: Any) -> None:
    _tracked.add(registry)
    port = os.environ.get(PORT_ENV)
    if port:
        serve(int(port), addr=os.environ.get(PORT_ENV + "_ADDR", "127.0.0.1"))
