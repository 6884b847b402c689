"""Weight updates and sleep on the GPU: the Hugging Face Llama engine of examples/hf_llama.py.

1. An RL-style weight sync of every parameter while the engine serves, in place (``load_state_dict``)
   and by assign (``load_state_dict(assign=True)`` then ``refresh(background=True)``): steps served
   eagerly, the time until every key is back, p99 step latency meanwhile against eager's (over other
   requests, and over the same steps run eagerly twice), and every logit against Hugging Face's own forward with the new weights.
2. ``sleep()`` / ``wake(background=True)``: bytes released (``torch.cuda.mem_get_info``) against what
   ``capture(plan)`` took, and the time from ``wake()`` to the first graph-served step.
3. The by-assign recapture window again in a loop that gives idle time between bursts: ``capture_budget=0``
   (no piece inside a step) and ``capture_pending(--idle)`` after every ``--burst`` steps; the same figures.
4. ``--in-place-refresh``: a registry with ``in_place_refresh=True``; syncs by assign copied back by ``refresh()``,
   the next steps' p99 against the same steps eager, and the memory the sync leaves allocated.

    PYTHONPATH=. python3 benchmarks/gpu_lifecycle.py [--requests 64] [--config llama-3.2-1b] [--burst 4 --idle 0.05]
        [--in-place-refresh]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import threading
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import cgregistry as cg
from cgregistry.inspection import CapturePhases


def _load_hf() -> Any:
    spec = importlib.util.spec_from_file_location("hf_llama", Path(__file__).parent.parent / "examples" / "hf_llama.py")
    hf = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["hf_llama"] = hf
    spec.loader.exec_module(hf)  # type: ignore[union-attr]
    return hf


def phases_of(reg: Any) -> str:
    """Where the capture seconds of the registry's entries went, and how many of its keys warmed up."""
    entries = reg.entries()
    warmed = sum(1 for e in entries if e.phases is not None and e.phases.warmup > 0)
    return f"{CapturePhases.of(entries).summary()}; {warmed} of {len(entries)} keys warmed up"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


class Counter:
    """Misses, and when each capture finished (a step with no miss was served by a graph)."""

    def __init__(self) -> None:
        self.misses = 0
        self.finished: list[float] = []

    @cg.plugin.hookimpl
    def cgregistry_miss(self, registry: Any, actual: Any) -> None:
        self.misses += 1

    @cg.plugin.hookimpl
    def cgregistry_capture_finished(self, registry: Any, key: Any, strategy: str, entry: Any, error: Any) -> None:
        self.finished.append(time.perf_counter())


class GcClock:
    """The serving thread's time in garbage collections: a step's CPU time may hold one."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.ms = 0.0
        self._began: float | None = None
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != self.thread:
            return
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.ms += (time.perf_counter() - self._began) * 1e3
            self._began = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--config", default="llama-3.2-1b")
    parser.add_argument("--mode", default="full_and_breakable")
    parser.add_argument("--burst", type=int, default=4, help="steps between the idle gaps of the idle-time window")
    parser.add_argument("--idle", type=float, default=0.05, help="seconds of each idle gap the loop offers capture_pending()")
    parser.add_argument("--eager-runs", type=int, default=2, help="eager runs of the window's requests, the reference "
                        "each window's p99 is held against (and, pooled, the pooled windows')")
    parser.add_argument("--steps", action="store_true", help="print every step of the background recapture window on stderr")
    parser.add_argument("--in-place-refresh", action="store_true", help="after the rest, a registry with "
                        "in_place_refresh=True: three syncs by assign, each copied back by refresh(background=True)")
    args = parser.parse_args()
    hf = _load_hf()
    device = torch.device("cuda")
    shape = hf.EngineShape(max_num_seqs=64, max_num_tokens=512, block_size=16, max_blocks_per_req=64)
    model = hf.build_model(args.config, device, shape)
    counter = Counter()
    gc_clock = GcClock()
    rows: list[tuple[str, str]] = []

    class Timed(hf.Engine):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.steps: list[tuple[float, float, bool]] = []  # (ms, seconds since start, served by a graph)
            self.sizes: list[tuple[int, int]] = []  # (tokens, requests) of each step
            self.cpu_ms: list[float] = []  # the serving thread's CPU time in each step
            self.gc_ms: list[float] = []  # the serving thread's time in garbage collections in each step
            self.t0 = time.perf_counter()
            self.idle: tuple[int, float] | None = None  # (burst, seconds): capture_pending() between bursts

        def run_step(self, batch: Any) -> torch.Tensor:
            if self.idle is not None and self.reg is not None and self.steps and len(self.steps) % self.idle[0] == 0:
                self.reg.capture_pending(self.idle[1])  # the loop's idle time, outside any step's time
            misses = counter.misses
            t, cpu, collecting = time.perf_counter(), time.thread_time(), gc_clock.ms
            out = super().run_step(batch)
            torch.cuda.current_stream().synchronize()
            now = time.perf_counter()
            self.cpu_ms.append((time.thread_time() - cpu) * 1e3)
            self.gc_ms.append(gc_clock.ms - collecting)
            self.steps.append(((now - t) * 1e3, now - self.t0, self.reg is not None and counter.misses == misses))
            self.sizes.append((sum(n for _, n in batch), len(batch)))
            return out

    def requests(seed: int) -> list:
        return hf.trace_requests(args.requests, shape, model.config.vocab_size, 96, 48, seed=seed)

    def new_weights(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(seed)
        return {k: (v.float() + 0.02 * torch.randn(v.shape, generator=g, device="cuda")).to(v.dtype) for k, v in model.state_dict().items()}

    eager = Timed(model, shape, None, keep_logits=False)
    eager.serve(requests(1))  # warm-up: every kernel, the allocator
    eager = Timed(model, shape, None, keep_logits=False)
    eager.serve(requests(2))
    eager_ms = [ms for ms, _, _ in eager.steps]
    # The requests the background recapture serves, eagerly, twice: the same steps (scheduling depends on the
    # requests alone), so the window is held against its own steps, and the two runs show eager's own spread.
    same = []
    for _ in range(max(2, args.eager_runs)):
        eager = Timed(model, shape, None, keep_logits=False)
        eager.serve(requests(5))
        same.append([ms for ms, _, _ in eager.steps])

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    started = time.perf_counter()
    reg = hf.build_registry(model, shape, args.mode, plugins=cg.Plugins(cg.plugin.make_plugin_manager([counter])))
    foreground_s = time.perf_counter() - started  # the plan captured in the foreground (graphs and warm-up)
    torch.cuda.synchronize()
    captured_bytes = free0 - torch.cuda.mem_get_info()[0]
    planned = len(reg)
    eng = Timed(model, shape, reg, keep_logits=True)
    res = eng.serve(requests(3))
    graph_ms = [ms for ms, _, hit in eng.steps if hit]
    err = hf.check_against_hf(model, res.finished)
    print(f"{args.config} {args.mode}: {planned} graphs ({captured_bytes / 2**20:.0f} MiB); eager p99 {percentile(eager_ms, 0.99):.1f} ms, "
          f"graphs p99 {percentile(graph_ms, 0.99):.1f} ms; max |logit - HF| {err:.3g}")
    print(f"  the first capture, {foreground_s:.2f} s: {phases_of(reg)}")

    # 1a. an RL weight sync in place
    with torch.no_grad():
        model.load_state_dict(new_weights(10))
    t = time.perf_counter()
    result = reg.refresh()
    refresh_s = time.perf_counter() - t
    again_ms = []  # the same in-place refresh repeated: one sample on a shared host is noisy
    for _ in range(5):
        t = time.perf_counter()
        assert len(reg.refresh().kept) == len(result.kept)
        again_ms.append((time.perf_counter() - t) * 1e3)
    eng = Timed(model, shape, reg, keep_logits=True)
    res = eng.serve(requests(4))
    err_in_place = hf.check_against_hf(model, res.finished)
    eager_steps = sum(1 for _, _, hit in eng.steps if not hit)
    print(f"in place: refresh {refresh_s * 1e3:.1f} ms (5 more: median {statistics.median(again_ms):.1f} ms), kept {len(result.kept)}, captured again {len(result.recaptured)}; "
          f"{eager_steps} of {len(eng.steps)} steps eager; max |logit - HF(new weights)| {err_in_place:.3g}")
    rows.append(("weight sync in place: refresh / kept / captured again", f"{refresh_s * 1e3:.1f} ms (then median {statistics.median(again_ms):.1f}) / {len(result.kept)} / {len(result.recaptured)}"))
    rows.append(("weight sync in place: eager steps, max |logit - HF|", f"{eager_steps} of {len(eng.steps)}, {err_in_place:.3g}"))

    # 1b. by assign, captured again in the background while serving
    model.load_state_dict(new_weights(11), assign=True)
    eng = Timed(model, shape, reg, keep_logits=True)
    start = len(counter.finished)
    t0 = time.perf_counter()
    result = reg.refresh(background=True)
    res = eng.serve(requests(5))
    reg.wait_captured()
    done = counter.finished[start + planned - 1] - t0 if len(counter.finished) >= start + planned else float("nan")
    err_assign = hf.check_against_hf(model, res.finished)
    eager_steps = sum(1 for _, _, hit in eng.steps if not hit)
    window = [ms for ms, at, _ in eng.steps if at <= done]
    same_a, same_b = (steps[:len(window)] for steps in same[:2])
    print(f"by assign: {len(result.moved)} tensors moved, {len(result.recaptured)} keys captured again in the background, "
          f"every key back {done:.2f} s after refresh(); {eager_steps} of {len(eng.steps)} steps eager; steps meanwhile p99 "
          f"{percentile(window, 0.99):.1f} ms (eager p99 {percentile(eager_ms, 0.99):.1f}; the same {len(window)} steps eager, two runs: "
          f"p99 {percentile(same_a, 0.99):.1f} and {percentile(same_b, 0.99):.1f}); max |logit - HF(new weights)| {err_assign:.3g}")
    print(f"  the keys captured again: {phases_of(reg)}")
    if args.steps:
        for (ms, at, hit), (tokens, reqs), alone in zip(eng.steps, eng.sizes, same[0]):
            print(f"  step at {at:6.3f} s: {ms:7.1f} ms (eager alone {alone:5.1f}), {tokens:3d} tokens {reqs:2d} requests, "
                  f"{'graph' if hit else 'eager'}", file=sys.stderr)
    rows.append(("weight sync by assign: every key back", f"{done:.2f} s ({len(result.recaptured)} keys, background; "
                 f"{done / foreground_s:.2f}x the foreground capture, {foreground_s:.2f} s)"))
    rows.append(("weight sync by assign: eager steps meanwhile", f"{eager_steps} of {len(eng.steps)}"))
    rows.append(("weight sync by assign: p99 meanwhile / eager p99", f"{percentile(window, 0.99) / percentile(eager_ms, 0.99):.2f}"))
    rows.append(("weight sync by assign: p99 meanwhile / the same steps eager", " and ".join(
        f"{percentile(window, 0.99) / percentile(steps, 0.99):.2f}" for steps in (same_a, same_b)) + " (against each eager run)"))
    rows.append(("weight sync by assign: max |logit - HF(new weights)|", f"{err_assign:.3g}"))

    # 1c. by assign, captured again in the foreground: what capturing every key again costs with nothing beside it
    model.load_state_dict(new_weights(12), assign=True)
    t = time.perf_counter()
    result = reg.refresh()
    again_s = time.perf_counter() - t
    print(f"by assign, refresh() in the foreground: {len(result.recaptured)} keys captured again in {again_s:.2f} s "
          f"({again_s / foreground_s:.2f}x the first capture); {phases_of(reg)}")
    rows.append(("weight sync by assign: refresh() in the foreground", f"{again_s:.2f} s ({again_s / foreground_s:.2f}x the first capture)"))

    # 2. sleep and wake
    torch.cuda.synchronize()
    before_sleep = torch.cuda.mem_get_info()[0]
    slept = reg.sleep()
    released = torch.cuda.mem_get_info()[0] - before_sleep
    print(f"sleep: released {released / 2**20:.0f} MiB of the {captured_bytes / 2**20:.0f} MiB capture took "
          f"({released / captured_bytes:.2f}); {len(slept.keys)} keys kept for wake()")
    eng = Timed(model, shape, reg, keep_logits=False)
    eng.serve(requests(6), max_steps=5)  # asleep: eagerly
    eng = Timed(model, shape, reg, keep_logits=True)
    t0 = time.perf_counter()
    reg.wake(background=True)
    res = eng.serve(requests(7))
    first = next((at for _, at, hit in eng.steps if hit), float("nan")) - (t0 - eng.t0)
    reg.wait_captured()
    err_wake = hf.check_against_hf(model, res.finished)
    print(f"wake: first graph-served step {first * 1e3:.0f} ms after wake(); {len(reg)} graphs back; max |logit - HF| {err_wake:.3g}")
    print(f"  the keys captured again: {phases_of(reg)}")
    rows.append(("sleep: released / capture took", f"{released / 2**20:.0f} / {captured_bytes / 2**20:.0f} MiB ({released / captured_bytes:.2f})"))
    rows.append(("wake: first graph-served step after wake()", f"{first * 1e3:.0f} ms"))
    rows.append(("wake: max |logit - HF|", f"{err_wake:.3g}"))
    # 3. by assign again, in a loop that gives idle time between bursts: no piece inside a step
    model.load_state_dict(new_weights(13), assign=True)
    reg.capture_budget = 0
    eng = Timed(model, shape, reg, keep_logits=True)
    eng.idle = (args.burst, args.idle)
    start = len(counter.finished)
    t0 = time.perf_counter()
    result = reg.refresh(background=True)
    res = eng.serve(requests(5))
    reg.wait_captured()
    done = counter.finished[start + planned - 1] - t0 if len(counter.finished) >= start + planned else float("nan")
    err_idle = hf.check_against_hf(model, res.finished)
    reg.capture_budget = None
    window = [ms for ms, at, _ in eng.steps if at <= done] or [ms for ms, _, _ in eng.steps]
    same_a, same_b = (steps[:len(window)] for steps in same[:2])
    ratio = " and ".join(f"{percentile(window, 0.99) / percentile(steps, 0.99):.2f}" for steps in (same_a, same_b))
    print(f"by assign, idle {args.idle * 1e3:.0f} ms after every {args.burst} steps, capture_budget=0: every key back "
          f"{done:.2f} s after refresh() ({done / foreground_s:.2f}x foreground); {len(window)} steps meanwhile, p99 / the "
          f"same steps eager {ratio}; max |logit - HF(new weights)| {err_idle:.3g}")
    rows.append(("weight sync by assign, idle between bursts: every key back", f"{done:.2f} s ({done / foreground_s:.2f}x foreground)"))
    rows.append(("weight sync by assign, idle between bursts: p99 / the same steps eager", ratio))
    if args.in_place_refresh:
        reg.clear()
        del reg, eng, res
        in_place(hf, model, shape, args.mode, timed=Timed, requests=requests, new_weights=new_weights, same=same, rows=rows)
    print("\nsummary")
    for name, value in rows:
        print(f"  {name:55s} {value}")
    print(f"  median eager step {statistics.median(eager_ms):.1f} ms")


def in_place(hf: Any, model: Any, shape: Any, mode: str, *, timed: Any, requests: Any, new_weights: Any,
             same: list[list[float]], rows: list[tuple[str, str]]) -> None:
    """Syncs by assign under ``in_place_refresh``: refresh()'s time, what it copied and captured again, the next steps'
    p99 against the same steps eager, every logit against HF with the new weights, and the device memory the sync
    leaves allocated once the handed-over tensors are dropped."""
    gc.collect()
    torch.cuda.empty_cache()
    reg = hf.build_registry(model, shape, mode, in_place_refresh=True)
    planned = len(reg)
    eager_p99 = [percentile(steps, 0.99) for steps in same[:2]]
    for i in range(3):
        eng = res = None
        gc.collect()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        model.load_state_dict(sharing_kept(model, new_weights(200 + i)), assign=True)  # the dict is dropped at once
        t = time.perf_counter()
        result = reg.refresh(background=True)
        refresh_ms = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        grown = (torch.cuda.memory_allocated() - allocated) / 2**20  # the new weights' memory, freed once copied back
        eng = timed(model, shape, reg, keep_logits=True)
        res = eng.serve(requests(5))
        reg.wait_captured()
        err = hf.check_against_hf(model, res.finished)
        alone = timed(model, shape, None, keep_logits=True)  # the same requests eagerly: HF's difference at these weights
        err_eager = hf.check_against_hf(model, alone.serve(requests(5)).finished)
        steps = [ms for ms, _, _ in eng.steps]
        eager_steps = sum(1 for _, _, hit in eng.steps if not hit)
        ratio = " and ".join(f"{percentile(steps, 0.99) / p:.2f}" for p in eager_p99)
        print(f"by assign, in place: refresh(background=True) {refresh_ms:.1f} ms; {len(result.moved)} moved, "
              f"{len(result.copied)} copied back, {len(result.kept)} of {planned} keys kept, {len(result.recaptured)} "
              f"captured again{f' ({result.not_copied[0]})' if result.not_copied else ''}; the next {len(steps)} steps: "
              f"{eager_steps} eager, p99 {percentile(steps, 0.99):.1f} ms, p99 / the same steps eager {ratio}; "
              f"allocated {grown:+.0f} MiB; max |logit - HF(new weights)| {err:.3g} (served eagerly: {err_eager:.3g})")
        rows.append((f"sync by assign, in place {i + 1}: refresh / kept / again", f"{refresh_ms:.1f} ms / {len(result.kept)} / {len(result.recaptured)}"))
        rows.append((f"sync by assign, in place {i + 1}: next steps p99 / eager", ratio))
        rows.append((f"sync by assign, in place {i + 1}: max |logit - HF| (eager's), allocated", f"{err:.3g} ({err_eager:.3g}), {grown:+.0f} MiB"))


def sharing_kept(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with one tensor for the names whose tensors share memory in ``model`` now (tied embeddings), as a
    trainer's sync of a tied model sends one."""
    first: dict[tuple[int, int], str] = {}
    for name, tensor in model.state_dict().items():
        state[name] = state[first.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), name)]
    return state


if __name__ == "__main__":
    main()
