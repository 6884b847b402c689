"""Background capture and adaptation on the GPU, one process: start-up, step latency while capturing, padding.

1. The demo decoder (12 x 1024 bf16) serves bundled-trace steps from the moment the registry is
   created.  Foreground: ``capture(plan)``, then serve.  Background: ``capture(plan, background=True)``
   and serve at once.  Reported: time from registry creation to the first graph-served step, the
   capture window, and step latency (run + a sync of the serving stream) inside it (p50 / p99 / worst) against
   eager's on the same steps.  ``--ablate`` adds a background run without the pause during
   ``run()`` and with the interpreter's default switch interval, to show what they are worth.
   Every output of the background run is checked against eager, during the window and after.
2. The engine of examples/hf_llama.py (Llama-3.2-1B shape, random weights, bf16) serves trace
   requests eagerly, then with ``full_and_breakable`` captured in the background; per-step
   latency the same way, and every logit checked against Hugging Face's own forward.
3. Adaptation (``--adapt``): see the section's docstring.

    PYTHONPATH=. python3 benchmarks/gpu_adaptive.py [--steps 600] [--ablate] [--hf] [--adapt]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cgregistry as cg
from cgregistry import background
from cgregistry.demo_model import DemoConfig, DemoDecoder, demo_inputs, random_batch
from cgregistry.workload import SchedulerConfig, read_trace, schedule


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(lat_ms: list[float]) -> str:
    if not lat_ms:
        return "no steps"
    return f"n={len(lat_ms):4d}  p50 {statistics.median(lat_ms):7.3f}  p99 {percentile(lat_ms, 0.99):7.3f}  worst {max(lat_ms):7.3f} ms"


def timed_steps(run: Callable[[Any, dict], Any], steps: list[tuple[Any, dict]]) -> list[float]:
    out = []
    for batch, inputs in steps:
        t = time.perf_counter()
        run(batch, inputs)
        torch.cuda.current_stream().synchronize()  # what an engine reading its samples waits for
        out.append((time.perf_counter() - t) * 1e3)
    return out


# ----------------------------------------------------------------------------- 1. demo decoder


def demo(n_steps: int, ablate: bool, rows: list[tuple[str, str]]) -> None:
    device = torch.device("cuda")
    cfg = DemoConfig.for_device(device)
    model = DemoDecoder(cfg, device, seed=0)
    plan = cg.CapturePlan.build(max_num_seqs=cfg.max_num_seqs, max_num_tokens=cfg.max_num_tokens, mode="full")
    sched = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_tokens)
    batches = list(schedule(read_trace(), sched, max_steps=n_steps))
    gen = torch.Generator().manual_seed(0)
    steps = [(b, random_batch(cfg, b, device, gen)) for b in batches]
    print(f"demo: {cfg.layers} x {cfg.hidden} {cfg.dtype}, plan 'full' {len(plan)} graphs, {len(steps)} trace steps")

    with torch.inference_mode():
        timed_steps(lambda b, i: model(b, **i), steps[:50])  # warm the allocator and kernels
        eager = timed_steps(lambda b, i: model(b, **i), steps)
        print(f"  eager                          {summary(eager)}")
        rows.append(("demo eager step", summary(eager)))

        # Foreground: capture everything, then serve.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reg = cg.GraphRegistry(model, demo_inputs(cfg), name="fg")
        reg.capture(plan)
        b, i = steps[0]
        reg.run(b, **i)
        torch.cuda.synchronize()
        fg_first = time.perf_counter() - t0
        served = timed_steps(lambda b, i: reg.run(b, **i), steps)
        print(f"  foreground: first graph step {fg_first * 1e3:8.1f} ms after creation; then {summary(served)}")
        rows.append(("demo foreground: creation -> first graph step", f"{fg_first * 1e3:.1f} ms"))
        rows.append(("demo graphs, all captured", summary(served)))
        reg.clear()

        variants = [("background", True)] + ([("background, no pause, 5 ms switch", False)] if ablate else [])
        for label, yielding in variants:
            saved = (background.SWITCH_INTERVAL_S, background.CaptureWorker._pause)
            if not yielding:
                background.SWITCH_INTERVAL_S = None
                background.CaptureWorker._pause = lambda self, frame, event, arg: None  # type: ignore[method-assign]
            try:
                first, window_s, in_window, _, _ = background_run(model, cfg, plan, steps, check=False)
            finally:
                background.SWITCH_INTERVAL_S, background.CaptureWorker._pause = saved  # type: ignore[method-assign]
            same = eager[: len(in_window)]  # eager on the same steps (the window is a prefix of the trace)
            ratio = percentile(in_window, 0.99) / percentile(same, 0.99) if in_window else float("nan")
            ratio_all = percentile(in_window, 0.99) / percentile(eager, 0.99) if in_window else float("nan")
            print(f"  {label}: first graph step {first * 1e3:8.1f} ms after creation; capture window {window_s * 1e3:.0f} ms")
            print(f"    steps in the window          {summary(in_window)}")
            print(f"    eager on those steps         {summary(same)}   p99 ratio {ratio:.2f} (vs eager p99 over all: {ratio_all:.2f})")
            rows.append((f"demo {label}: creation -> first graph step", f"{first * 1e3:.1f} ms (window {window_s * 1e3:.0f} ms)"))
            rows.append((f"demo {label}: steps while capturing", f"{summary(in_window)}"))
            rows.append((f"demo {label}: p99 / eager p99 same steps (all)", f"{ratio:.2f} ({ratio_all:.2f})"))
        # Correctness while capturing: every output against the eager forward (a separate, untimed run).
        _, _, _, worst_err, mismatches = background_run(model, cfg, plan, steps, check=True)
        print(f"  background, checked against eager at every step: {mismatches} mismatches, max abs error {worst_err:.3g}")
        rows.append(("demo background: every step vs eager", f"{mismatches} mismatches, max abs error {worst_err:.3g}"))


def background_run(model: Any, cfg: DemoConfig, plan: cg.CapturePlan, steps: list, check: bool) -> tuple:
    """Serve from creation while the plan is captured in the background; step latency inside the window."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reg = cg.GraphRegistry(model, demo_inputs(cfg), name="bg")
    reg.capture(plan, background=True)
    first = None
    in_window: list[float] = []
    worst, mismatches = 0.0, 0
    k = 0
    hits = 0
    window_end = t0
    while reg.capturing() or k < len(steps):
        batch, inputs = steps[k % len(steps)]
        capturing = bool(reg.capturing())
        t = time.perf_counter()
        out = reg.run(batch, **inputs)
        torch.cuda.current_stream().synchronize()
        now = time.perf_counter()
        if capturing:
            in_window.append((now - t) * 1e3)
            window_end = now
        new_hits = reg.stats().hits
        if first is None and new_hits > hits:
            first = now - t0
        hits = new_hits
        if check:  # the serving thread's own eager reference (untimed)
            want = model(batch, **inputs)
            err = (out.float() - want.float()).abs().max().item()
            worst = max(worst, err)
            mismatches += err > 5e-2 * max(1.0, want.float().abs().max().item())
        if not capturing and k >= len(steps):
            break
        k += 1
    window = window_end - t0
    reg.wait_captured()
    reg.clear()
    return first if first is not None else float("nan"), window, in_window, worst, mismatches


# ----------------------------------------------------------------------------- 2. HF Llama engine


def hf_llama(requests: int, rows: list[tuple[str, str]]) -> None:
    spec = importlib.util.spec_from_file_location("hf_llama", Path(__file__).parent.parent / "examples" / "hf_llama.py")
    hf = importlib.util.module_from_spec(spec)
    sys.modules["hf_llama"] = hf
    spec.loader.exec_module(hf)
    shape = hf.EngineShape(max_num_seqs=64, max_num_tokens=512, block_size=16, max_blocks_per_req=64)
    device = torch.device("cuda")
    model = hf.build_model("llama-3.2-1b", device, shape)

    class Timed(hf.Engine):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.lat: list[tuple[float, bool, bool]] = []  # (ms, capturing, served by a graph)

        def _run(self, batch: Any) -> torch.Tensor:
            reg = self.reg
            capturing = bool(reg.capturing()) if reg is not None else False
            hits = reg.stats().hits if reg is not None else 0
            t = time.perf_counter()
            out = super()._run(batch)
            torch.cuda.current_stream().synchronize()
            ms = (time.perf_counter() - t) * 1e3
            self.lat.append((ms, capturing, reg is not None and reg.stats().hits > hits))
            return out

    def reqs() -> list:
        return hf.trace_requests(requests, shape, model.config.vocab_size, 96, 48)

    eng = Timed(model, shape, None, keep_logits=False)
    eng.serve(hf.trace_requests(16, shape, model.config.vocab_size, 96, 48, seed=1))  # warm-up: every kernel, the allocator
    eng = Timed(model, shape, None, keep_logits=True)
    res = eng.serve(reqs())
    eager = [ms for ms, _, _ in eng.lat]
    err_eager = hf.check_against_hf(model, res.finished)
    print(f"hf llama eager: {res.steps} steps, {res.tokens / res.seconds:.1f} tokens/s  {summary(eager)}  max|logit - HF| {err_eager:.3g}")
    rows.append(("hf eager step", summary(eager)))

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reg = hf.build_registry(model, shape, "full_and_breakable", background=True)
    eng = Timed(model, shape, reg, keep_logits=True)
    res = eng.serve(reqs())
    reg.wait_captured()
    err = hf.check_against_hf(model, res.finished)
    window = [ms for ms, capturing, _ in eng.lat if capturing]
    same = eager[: len(window)]
    first = next((i for i, (_, _, hit) in enumerate(eng.lat) if hit), None)
    first_s = (sum(ms for ms, _, _ in eng.lat[: first + 1]) / 1e3) if first is not None else float("nan")
    ratio = percentile(window, 0.99) / percentile(same, 0.99) if window else float("nan")
    print(f"hf llama background: {res.steps} steps, {res.tokens / res.seconds:.1f} tokens/s; {len(reg)} graphs; "
          f"first graph-served step at step {first} (~{first_s * 1e3:.0f} ms of steps); failures {len(reg.failures())}")
    print(f"  steps while capturing  {summary(window)}")
    print(f"  eager on those steps   {summary(same)}  p99 ratio {ratio:.2f}; max|logit - HF| {err:.3g}")
    rows.append(("hf background: steps while capturing", f"{summary(window)}"))
    rows.append(("hf background: p99 / eager p99, same steps", f"{ratio:.2f}"))
    rows.append(("hf background: max |logit - HF|", f"{err:.3g} (eager {err_eager:.3g})"))
    t0 = time.perf_counter() - t0
    rows.append(("hf background: total serve time", f"{t0:.1f} s, {res.tokens / res.seconds:.1f} tokens/s"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--ablate", action="store_true")
    parser.add_argument("--hf", action="store_true")
    parser.add_argument("--requests", type=int, default=96)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    rows: list[tuple[str, str]] = []
    demo(args.steps, args.ablate, rows)
    if args.hf:
        hf_llama(args.requests, rows)
    print("\nsummary")
    for name, value in rows:
        print(f"  {name:55s} {value}")


if __name__ == "__main__":
    main()
