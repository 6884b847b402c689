"""The main job: the demo decoder on batch shapes from the bundled serving trace, graphs checked against eager.

Builds a plan, captures it, replays trace-derived steps through ``reg.run``,
compares every output with an eager forward, and times eager against the
registry on the same steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from cgregistry.demo_model import DemoConfig, DemoDecoder, demo_inputs, random_batch
from cgregistry.plan import CapturePlan
from cgregistry.plugins import Plugins
from cgregistry.registry import GraphRegistry
from cgregistry.workload import SchedulerConfig, read_trace, schedule

__all__ = ["DemoResult", "run_demo"]


@attrs.frozen
class DemoResult:
    """What the demo measured."""

    backend: str
    steps: int
    mismatches: int
    max_abs_error: float
    eager_seconds: float
    graph_seconds: float
    hits: int
    misses: int
    padding_ratio: float
    entries: int
    capture_seconds: float
    memory_bytes: int
    table: str

    @property
    def speedup(self) -> float:
        return self.eager_seconds / self.graph_seconds if self.graph_seconds else float("nan")


def _tolerance(dtype: torch.dtype) -> float:
    # Padded shapes may pick different GEMM kernels than eager, so allow rounding noise.
    return 1e-3 if dtype == torch.float32 else 5e-2


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_demo(
    backend: str = "auto",
    steps: int = 200,
    mode: str = "full",
    seed: int = 0,
    log: Callable[[str], None] = print,
    progress: bool | None = None,
    all_entries: bool = False,
    snapshot: str | None = None,
) -> DemoResult:
    """Capture the demo model, run ``steps`` trace-derived batches, check and time them."""
    plugins = Plugins()
    device = plugins.backend(backend).device()
    cfg = DemoConfig.for_device(device)
    model = DemoDecoder(cfg, device, seed=seed)
    reg = GraphRegistry(model, demo_inputs(cfg), backend=backend, plugins=plugins)
    plan = CapturePlan.build(max_num_seqs=cfg.max_num_seqs, max_num_tokens=cfg.max_num_tokens, mode=mode)
    log(f"demo model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.dtype} on {device} ({reg.backend.name} backend)")
    log(f"plan: mode {mode!r}, {len(plan)} graphs up to {plan.entries[0].descriptor.num_tokens if len(plan) else 0} tokens")
    started = time.perf_counter()
    reg.capture(plan, progress=progress)
    capture_seconds = time.perf_counter() - started

    sched = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_tokens)
    batches = list(schedule(read_trace(), sched, max_steps=steps))
    gen = torch.Generator().manual_seed(seed)
    live = [random_batch(cfg, b, device, gen) for b in batches]
    log(f"trace: {len(batches)} steps of the bundled Azure 2023 conversation trace (max_num_seqs {cfg.max_num_seqs}, budget {cfg.max_num_tokens})")

    tol = _tolerance(cfg.dtype)
    mismatches = 0
    worst = 0.0
    with torch.inference_mode():
        for batch, inputs in zip(batches, live):
            got = reg.run(batch, **inputs)
            want = model(batch, **inputs)
            err = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item()
            worst = max(worst, err)
            if not err <= tol * max(1.0, scale):
                mismatches += 1
                log(f"MISMATCH {batch}: max abs error {err:.3g}")
        hits, misses = reg.stats().hits, reg.stats().misses
        padding = reg.stats().padding_ratio
        reg.reset_stats()
        eager_s = _timed(lambda: [model(b, **i) for b, i in zip(batches, live)], device)
        graph_s = _timed(lambda: [reg.run(b, **i) for b, i in zip(batches, live)], device)

    result = DemoResult(
        backend=reg.backend.name, steps=len(batches), mismatches=mismatches, max_abs_error=worst,
        eager_seconds=eager_s, graph_seconds=graph_s, hits=hits, misses=misses, padding_ratio=padding,
        entries=len(reg), capture_seconds=capture_seconds, memory_bytes=reg.memory_bytes(),
        table=reg.table(used_only=not all_entries),
    )
    if snapshot:
        import json

        with open(snapshot, "w") as fh:
            json.dump(reg.snapshot(), fh, indent=1)
        log(f"snapshot written to {snapshot} (read it with `cgregistry inspect {snapshot}`)")
    log("" if all_entries else "entries that served the timed pass (every entry: --all):")
    log(result.table)
    log(
        f"checked {result.steps} steps against eager: {result.mismatches} mismatches "
        f"(max abs error {result.max_abs_error:.3g}); {hits} served by graphs, {misses} eager (no covering key); "
        f"padding {padding:.1%} of graph tokens"
    )
    log(f"capture: {result.entries} graphs in {capture_seconds:.2f} s")
    log(
        f"timing over the same {result.steps} steps: eager {eager_s * 1e3:.1f} ms, registry {graph_s * 1e3:.1f} ms "
        f"({result.speedup:.2f}x)"
        + ("  [cpu backend is an emulator: this times its bookkeeping, not a speedup]" if reg.backend.name == "cpu" else "")
    )
    return result
