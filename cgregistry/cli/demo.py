"""The main job: the demo decoder on batch shapes from the bundled serving trace, graphs checked against eager.

Builds a plan, captures it, replays trace-derived steps through ``reg.run``, compares every output with an eager
forward, and times both.  Piecewise keys compile the model with ``reg.compile``, its attention kernel an eager break
(the splitting op), so every mode the CLI offers runs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from cgregistry.strategies.breaks import eager_break
from cgregistry.demo_model import (
    DemoConfig,
    DemoDecoder,
    attention_kernel_into,
    demo_inputs,
    random_batch,
)
from cgregistry.plan.build import CapturePlan, mode_preference
from cgregistry.hooks.manager import Plugins
from cgregistry.inspection import CapturePhases
from cgregistry.registry import GraphRegistry
from cgregistry.strategies.piecewise import PiecewiseStrategy
from cgregistry.plan.workload import SchedulerConfig, read_trace, schedule

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
    capture_phases: CapturePhases = CapturePhases()  # where the graphs' capture seconds went

    @property
    def no_speedup_reason(self) -> str | None:
        """Why the eager/registry time ratio is not a speedup (None when it is one)."""
        if self.entries == 0:
            return "the plan has no graphs (mode none), so no speedup is reported"
        if self.backend == "cpu":
            return "the cpu backend emulates graphs (it runs the step eagerly), so no speedup is reported"
        if self.hits == 0:
            return "no step was served by a graph, so no speedup is reported"
        if not self.graph_seconds:
            return "the registry pass took no measurable time, so no speedup is reported"
        return None

    @property
    def speedup(self) -> float | None:
        """Eager time over registry time on the same steps; None where that ratio means nothing (see
        ``no_speedup_reason``): without graphs, on the cpu backend, and when no step was served by a graph."""
        return None if self.no_speedup_reason is not None else self.eager_seconds / self.graph_seconds


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


@functools.cache
def _attention_break() -> Callable[..., None]:
    """The demo's attention kernel marked as an eager break, once per process (marking registers it with the
    compiler's splitting ops): the piecewise compiler splits the model there."""
    return eager_break(attention_kernel_into)


def _preference(mode: str | tuple[str | None, str | None], given: tuple[str, ...] | None, plugins: Plugins) -> tuple[str, ...]:
    """The registry's preference: ``given`` (every name registered), else the mode's (``mode_preference``)."""
    if given is None:
        return mode_preference(mode)
    unknown = [name for name in given if name not in plugins.strategies]
    if unknown or not given:
        problem = f"strategy {unknown[0]!r} is not registered" if unknown else "no strategy named"
        raise ValueError(f"preference {tuple(given)}: {problem}; available: {', '.join(sorted(plugins.strategies))}")
    return tuple(given)


def _fit_to_memory(
    reg: GraphRegistry, plan: CapturePlan, steps: list, utilization: float, settings: dict, log: Callable[[str], None],
) -> CapturePlan:
    """The plan, or one fitted to ``steps`` under what ``utilization`` of the device leaves for graphs."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    if reg.backend.name != "cuda":
        raise ValueError(f"gpu_memory_utilization needs the cuda backend (device memory to share), got {reg.backend.name!r}")
    estimate = reg.estimate_memory(plan)
    free, total = torch.cuda.mem_get_info()
    budget = int(utilization * total) - (total - free)
    mib = 2**20
    log(f"memory: the plan's capture would take {estimate.capture_bytes / mib:.0f} MiB (estimated); "
        f"{utilization:.0%} of the device leaves {budget / mib:.0f} MiB for graphs")
    if estimate.capture_bytes <= budget:
        return plan
    fitted = CapturePlan.fit(steps, None, max_bytes=max(0, budget), memory=estimate, **settings)
    log(f"memory: plan fitted to the trace under {budget / mib:.0f} MiB: {len(fitted)} of {len(plan)} graphs")
    return fitted


def run_demo(
    backend: str = "auto",
    steps: int = 200,
    mode: str | tuple[str | None, str | None] = "full",
    seed: int = 0,
    log: Callable[[str], None] = print,
    progress: bool | None = None,
    all_entries: bool = False,
    snapshot: str | None = None,
    preference: tuple[str, ...] | None = None,
    gpu_memory_utilization: float | None = None,
) -> DemoResult:
    """Capture the demo model, run ``steps`` trace-derived batches, check and time them.

    ``mode``: a ``MODES`` name or a (decode, mixed) strategy pair; piecewise keys compile the model (``reg.compile``).
    ``preference`` defaults to ``mode_preference``, so a plugin's decode keys do not lose to relaxed mixed keys.
    ``gpu_memory_utilization``: the device's share the process may use; a plan whose estimated capture takes more than
    is left is fitted to the trace under those bytes (``CapturePlan.fit(max_bytes=...)``, docs/integration.md).
    """
    plugins = Plugins()
    device = plugins.backend(backend).device()
    cfg = DemoConfig.for_device(device)
    plan = CapturePlan.build(max_num_seqs=cfg.max_num_seqs, max_num_tokens=cfg.max_num_tokens, mode=mode, plugins=plugins)
    order = _preference(mode, preference, plugins)
    compile_model = any(isinstance(plugins.strategy(s), PiecewiseStrategy) for s in {e.strategy for e in plan})
    model = DemoDecoder(cfg, device, seed=seed, attention=_attention_break() if compile_model else None)
    if compile_model:
        # Piecewise keys capture the pieces of a compiled model, split at the attention kernel (an eager break).
        reg = GraphRegistry(lambda batch, **inputs: compiled(**inputs), demo_inputs(cfg), backend=backend, plugins=plugins, preference=order)
        compiled = reg.compile(lambda input_ids, req_idx, seq_lens: model(None, input_ids, req_idx, seq_lens))
    else:
        reg = GraphRegistry(model, demo_inputs(cfg), backend=backend, plugins=plugins, preference=order)
    log(f"demo model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.dtype} on {device} ({reg.backend.name} backend)")
    log(f"plan: mode {mode!r}, {len(plan)} graphs up to {plan.entries[0].descriptor.num_tokens if len(plan) else 0} tokens")
    why = "given" if preference is not None else "the mode's decode strategy, then its mixed one"
    log(f"preference: {', '.join(order)} ({why})")
    if compile_model:
        log("model compiled with reg.compile for the piecewise keys: split at its attention kernel, which runs eagerly")
    sched = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_tokens)
    batches = list(schedule(read_trace(), sched, max_steps=steps))
    if gpu_memory_utilization is not None:
        plan = _fit_to_memory(reg, plan, batches, gpu_memory_utilization, dict(
            max_num_seqs=cfg.max_num_seqs, max_num_tokens=cfg.max_num_tokens, mode=mode, plugins=plugins), log)
    started = time.perf_counter()
    captured = reg.capture(plan, progress=progress)
    capture_seconds = time.perf_counter() - started

    gen = torch.Generator().manual_seed(seed)
    live = [random_batch(cfg, b, device, gen) for b in batches]
    log(f"trace: {len(batches)} steps of the bundled Azure 2023 conversation trace (max_num_seqs {cfg.max_num_seqs}, budget {cfg.max_num_tokens})")

    tol = 1e-3 if cfg.dtype == torch.float32 else 5e-2  # padded shapes may pick other GEMM kernels than eager
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
        table=reg.table(used_only=not all_entries), capture_phases=CapturePhases.of(captured),
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
    log(f"capture: {result.entries} graphs in {capture_seconds:.2f} s; the graphs' own {result.capture_phases.summary()}")
    timing = f"timing over the same {result.steps} steps: eager {eager_s * 1e3:.1f} ms, registry {graph_s * 1e3:.1f} ms"
    if result.speedup is None:
        log(timing)
        log(f"timings: {result.no_speedup_reason}")
    else:
        log(f"{timing} ({result.speedup:.2f}x)")
    return result
