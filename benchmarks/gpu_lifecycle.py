"""Weight updates and sleep on the GPU: the Hugging Face Llama engine of examples/hf_llama.py.

1. An RL-style weight sync of every parameter while the engine serves, in place (``load_state_dict``)
   and by assign (``load_state_dict(assign=True)`` then ``refresh(background=True)``): steps served
   eagerly, the time until every key is back, p99 step latency meanwhile against eager's (over other
   requests, and over the same steps run eagerly twice), and every logit against Hugging Face's own forward with the new weights.
2. ``sleep()`` / ``wake(background=True)``: bytes released (``torch.cuda.mem_get_info``) against what
   ``capture(plan)`` took, and the time from ``wake()`` to the first graph-served step.
3. The by-assign recapture window again in a loop that gives idle time between bursts: ``capture_budget=0``
   (no piece inside a step) and ``capture_pending(--idle)`` after every ``--burst`` steps; the same figures.
4. ``--loader-syncs N``: N weight syncs streamed, one ``(name, tensor)`` pair at a time, from a trainer's own copy of
   the weights into the engine with ``reg.load_weights`` under ``torch.inference_mode()``, a few requests served after
   each and every logit compared with Hugging Face's forward at the new weights: graphs kept, keys captured again,
   the loader's time per sync, and the p99 of the graph steps after each sync against the graph steps before any.
   ``--loader-only`` skips 1-3.

    PYTHONPATH=. python3 benchmarks/gpu_lifecycle.py [--requests 64] [--config llama-3.2-1b] [--burst 4 --idle 0.05]
        [--loader-syncs 64] [--loader-only]
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
    parser.add_argument("--loader-syncs", type=int, default=0, help="after the rest, this many syncs streamed in place "
                        "with reg.load_weights under inference_mode, every logit checked")
    parser.add_argument("--loader-only", action="store_true", help="only the loader's syncs (--loader-syncs, 64 if unset)")
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

    if args.loader_only:
        loader_syncs(hf, model, shape, args.mode, timed=Timed, counter=counter, syncs=args.loader_syncs or 64, rows=rows)
        print("\nsummary")
        for name, value in rows:
            print(f"  {name:55s} {value}")
        return
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

    def recapture_window(seed: int, idle: tuple[int, float] | None = None) -> tuple[Any, float, float, Any]:
        """A sync by assign captured again in the background while the engine serves (``idle``: the loop's idle gaps,
        (steps, seconds)): refresh()'s result, when every key was back (seconds after it), max |logit - HF|, the
        engine that served."""
        model.load_state_dict(new_weights(seed), assign=True)
        eng = Timed(model, shape, reg, keep_logits=True)
        eng.idle = idle
        start = len(counter.finished)
        t0 = time.perf_counter()
        result = reg.refresh(background=True)
        res = eng.serve(requests(5))
        reg.wait_captured()
        done = counter.finished[start + planned - 1] - t0 if len(counter.finished) >= start + planned else float("nan")
        return result, done, hf.check_against_hf(model, res.finished), eng

    # 1b. by assign, captured again in the background while serving
    result, done, err_assign, eng = recapture_window(11)
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
    reg.capture_budget = 0
    result, done, err_idle, eng = recapture_window(13, (args.burst, args.idle))
    reg.capture_budget = None
    window = [ms for ms, at, _ in eng.steps if at <= done] or [ms for ms, _, _ in eng.steps]
    same_a, same_b = (steps[:len(window)] for steps in same[:2])
    ratio = " and ".join(f"{percentile(window, 0.99) / percentile(steps, 0.99):.2f}" for steps in (same_a, same_b))
    print(f"by assign, idle {args.idle * 1e3:.0f} ms after every {args.burst} steps, capture_budget=0: every key back "
          f"{done:.2f} s after refresh() ({done / foreground_s:.2f}x foreground); {len(window)} steps meanwhile, p99 / the "
          f"same steps eager {ratio}; max |logit - HF(new weights)| {err_idle:.3g}")
    rows.append(("weight sync by assign, idle between bursts: every key back", f"{done:.2f} s ({done / foreground_s:.2f}x foreground)"))
    rows.append(("weight sync by assign, idle between bursts: p99 / the same steps eager", ratio))
    if args.loader_syncs:
        reg.clear()
        del reg, eng, res
        loader_syncs(hf, model, shape, args.mode, timed=Timed, counter=counter, syncs=args.loader_syncs, rows=rows)
    print("\nsummary")
    for name, value in rows:
        print(f"  {name:55s} {value}")
    print(f"  median eager step {statistics.median(eager_ms):.1f} ms")


def loader_syncs(hf: Any, model: Any, shape: Any, mode: str, *, timed: Any, counter: Counter, syncs: int,
                 rows: list[tuple[str, str]]) -> None:
    """``syncs`` weight syncs streamed from a trainer's own copy of the weights with ``reg.load_weights`` under
    ``torch.inference_mode()``, a few requests served after each (every logit against HF's forward at the weights of
    that moment): the loader's time per sync (its copies included: the stream is synchronized), graphs kept, keys
    captured again, and the p99 of the graph-served steps after the syncs against those before any."""
    gc.collect()
    torch.cuda.empty_cache()
    reg = hf.build_registry(model, shape, mode, plugins=cg.Plugins(cg.plugin.make_plugin_manager([counter])))
    planned, captured = len(reg), len(counter.finished)
    trainer = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}  # the trainer's memory
    tied = sum(1 for _ in model.state_dict()) - len({t.data_ptr() for t in model.state_dict().values()})

    def served(seed: int) -> tuple[list[float], float]:
        eng = timed(model, shape, reg, keep_logits=True)
        res = eng.serve(hf.trace_requests(8, shape, model.config.vocab_size, 48, 8, seed=seed))
        return [ms for ms, _, hit in eng.steps if hit], hf.check_against_hf(model, res.finished)

    before: list[float] = []
    for seed in range(4):  # the graph steps before any sync (the first serve warms the engine up)
        steps, _ = served(300 + seed)
        before += steps if seed else []
    after: list[float] = []
    loader_ms: list[float] = []
    worst = 0.0
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(syncs):
        with torch.no_grad():  # the trainer's step: new values in its own tensors
            for tensor in trainer.values():
                if tensor.is_floating_point():
                    tensor.add_(torch.randn(tensor.shape, generator=g, device="cuda", dtype=tensor.dtype), alpha=1e-3)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            loaded = reg.load_weights(iter(trainer.items()), module=model)  # streamed: one (name, tensor) pair at a time
        torch.cuda.synchronize()
        loader_ms.append((time.perf_counter() - t) * 1e3)
        assert len(loaded) == len(trainer)
        steps, err = served(400 + i)
        after += steps
        worst = max(worst, err)
    moved = [name for name, tensor in model.state_dict().items() if tensor.data_ptr() != trainer[name].data_ptr()]
    again = len(counter.finished) - captured
    gigabytes = sum(t.numel() * t.element_size() for t in trainer.values()) / 1e9
    ratio = percentile(after, 0.99) / percentile(before, 0.99)
    print(f"loader: {syncs} syncs of {len(trainer)} tensors ({tied} tied, {gigabytes:.2f} GB) streamed under inference_mode: "
          f"load_weights median {statistics.median(loader_ms):.2f} ms, max {max(loader_ms):.2f} ms per sync; {len(reg)} of "
          f"{planned} graphs kept, {again} keys captured again, {reg.stats().misses} misses; graph steps p99 after the "
          f"syncs {percentile(after, 0.99):.2f} ms over {len(after)} steps, before {percentile(before, 0.99):.2f} ms over "
          f"{len(before)} ({ratio:.3f}x); max |logit - HF(weights of the moment)| {worst:.3g}; parameters sharing the "
          f"trainer's memory: {len(model.state_dict()) - len(moved)}")
    rows.append(("loader: load_weights per sync, median / max", f"{statistics.median(loader_ms):.2f} / {max(loader_ms):.2f} ms"))
    rows.append(("loader: graphs kept / keys captured again", f"{len(reg)} of {planned} / {again}"))
    rows.append(("loader: graph steps p99 after / before the syncs", f"{ratio:.3f}"))
    rows.append(("loader: max |logit - HF(new weights)|", f"{worst:.3g}"))


if __name__ == "__main__":
    main()
