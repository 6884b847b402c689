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
3. Adaptation (``--adapt``): the demo decoder adapting from vLLM's default ladder; see ``adaptation``.
   ``--hf-adapt``: the same for the HF Llama engine; see ``hf_adaptation``.

    PYTHONPATH=. python3 benchmarks/gpu_adaptive.py [--steps 600] [--ablate] [--hf] [--adapt [--adapt-steps 8000]] [--hf-adapt] [--no-demo]
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


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def timed_steps(run: Callable[[Any, dict], Any], steps: list[tuple[Any, dict]]) -> list[float]:
    out = []
    for batch, inputs in steps:
        t = time.perf_counter()
        run(batch, inputs)
        sync()  # what an engine reading its samples waits for
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


# ----------------------------------------------------------------------------- 3. adaptation


def adaptation(n_steps: int, every: int, rows: list[tuple[str, str]]) -> None:
    """The demo decoder serves ``n_steps`` trace steps from vLLM's default ladder ('full', 51 graphs) with
    ``adapt=Adaptation(max_graphs=51, ...)``: refits on the capture thread, new keys captured in the background.

    Reported: the refits (changes, keys added, seconds each on the capture thread), step latency while the
    capture thread works (a refit or its captures) against the same steps served by a registry that keeps the
    default plan (its graphs), every 10th output against eager, and padding over all the steps of the default
    plan, the adapted keys, and a plan fitted offline to the same steps at the same budget.
    """
    from cgregistry import registry as registry_module
    from cgregistry.fitting import evaluate

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run of the logic
    cfg = DemoConfig.for_device(device)
    model = DemoDecoder(cfg, device, seed=0)
    settings = dict(max_num_seqs=cfg.max_num_seqs, max_num_tokens=cfg.max_num_tokens, mode="full")
    start = cg.CapturePlan.build(**settings)
    budget = len(start)
    sched = SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_tokens)
    batches = list(schedule(read_trace(), sched, max_steps=n_steps))
    gen = torch.Generator().manual_seed(1)
    # Inputs are drawn for a pool of batches and reused by shape: the trace's steps, the memory of a few hundred.
    pool: dict[Any, dict] = {}
    steps = [(b, pool.setdefault(b, random_batch(cfg, b, device, gen))) for b in batches]
    print(f"adaptation: demo decoder, {len(steps)} trace steps, start: default 'full' plan ({budget} graphs), budget {budget}, "
          f"a refit due every {every} steps")

    refit_s: list[float] = []
    real_propose = registry_module.propose

    def timed_propose(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_propose(*a, **k)
        finally:
            refit_s.append(time.perf_counter() - t)

    registry_module.propose = timed_propose
    try:
        with torch.inference_mode():
            static = cg.GraphRegistry(model, demo_inputs(cfg), name="static")
            static.capture(start)
            timed_steps(lambda b, i: static.run(b, **i), steps[:50])
            base = timed_steps(lambda b, i: static.run(b, **i), steps)
            static.clear()

            adapt = cg.Adaptation(max_graphs=budget, settings=settings, every_steps=every, min_steps=every)
            reg = cg.GraphRegistry(model, demo_inputs(cfg), adapt=adapt, name="adapting")
            reg.capture(start)
            lat: list[float] = []
            working: list[bool] = []
            worst, mismatches = 0.0, 0
            for k, (batch, inputs) in enumerate(steps):
                busy = bool(reg.capturing()) or reg._refit_running  # the capture thread has work
                t = time.perf_counter()
                out = reg.run(batch, **inputs)
                sync()
                lat.append((time.perf_counter() - t) * 1e3)
                working.append(busy)
                if k % 10 == 0:
                    want = model(batch, **inputs).float()
                    err = (out.float() - want).abs().max().item()
                    worst = max(worst, err)
                    mismatches += err > 5e-2 * max(1.0, want.abs().max().item())
            reg.wait_captured()
    finally:
        registry_module.propose = real_propose

    held = cg.CapturePlan.of((e.key, e.strategy) for e in reg.entries())
    offline = cg.CapturePlan.fit(batches, budget, **settings)

    def padding(plan: cg.CapturePlan) -> float:
        r = evaluate(plan, batches)
        return r.padded_tokens / max(1, r.padded_tokens + r.real_tokens) * 100

    changes = reg.plan_changes
    added = sum(len(c.added) for c in changes)
    removed = sum(len(c.removed) for c in changes)
    window = [ms for ms, busy in zip(lat, working) if busy]
    same = [ms for ms, busy in zip(base, working) if busy]
    ratio = percentile(window, 0.99) / percentile(same, 0.99) if window else float("nan")
    p_default, p_adapted, p_offline = padding(start), padding(held), padding(offline)
    print(f"  refits run {len(refit_s)}, changes {len(changes)} ({added} keys added, {removed} released), "
          f"refit seconds on the capture thread: median {statistics.median(refit_s) if refit_s else 0:.2f}, "
          f"max {max(refit_s, default=0):.2f}; graphs held at the end {len(reg)}; failures {len(reg.failures())}")
    print(f"  steps while the capture thread worked   {summary(window)}")
    print(f"  default plan's graphs on those steps    {summary(same)}   p99 ratio {ratio:.2f}")
    print(f"  all steps: adapting {summary(lat)}")
    print(f"  all steps: default  {summary(base)}")
    print(f"  every 10th step vs eager: {mismatches} mismatches, max abs error {worst:.3g}")
    print(f"  padding over all {len(batches)} steps (padded / graph tokens): default {p_default:.2f}%, adapted {p_adapted:.2f}%, "
          f"fitted offline {p_offline:.2f}%; adapted / offline {p_adapted / p_offline:.2f}")
    stats = reg.stats()
    print(f"  served: {stats.hits} graph steps, {stats.misses} eager ({dict(stats.misses_by_reason)}), "
          f"{stats.background_captures} background captures, {stats.plan_changes} plan changes")
    rows.append(("adapt: refits / changes / keys added", f"{len(refit_s)} / {len(changes)} / {added}"))
    rows.append(("adapt: refit on the capture thread (max)", f"{max(refit_s, default=0):.2f} s"))
    rows.append(("adapt: p99 while working / default plan", f"{ratio:.2f} ({summary(window)})"))
    rows.append(("adapt: every 10th step vs eager", f"{mismatches} mismatches, max abs error {worst:.3g}"))
    rows.append(("adapt: padding default / adapted / offline", f"{p_default:.2f}% / {p_adapted:.2f}% / {p_offline:.2f}% "
                 f"(adapted/offline {p_adapted / p_offline:.2f}, target <= 1.5)"))
    reg.clear()


def hf_adaptation(requests: int, every: int, budget: int, rows: list[tuple[str, str]]) -> None:
    """The Hugging Face Llama engine serves trace requests with ``adapt``: mode 'full' from its default plan,
    ``budget`` graphs (fewer than the plan's: the first refit brings it under), a refit due every ``every`` steps.  Padding of the default, adapted and offline-fitted keys over the steps
    it served, and every logit checked against Hugging Face's own forward."""
    from cgregistry.fitting import evaluate

    hf = _load_hf()
    shape = hf.EngineShape(max_num_seqs=64, max_num_tokens=512, block_size=16, max_blocks_per_req=64)
    gpu = torch.cuda.is_available()  # cpu: a smoke run of the logic on the tiny config
    device = torch.device("cuda" if gpu else "cpu")
    model = hf.build_model("llama-3.2-1b" if gpu else "tiny", device, shape)
    settings = dict(max_num_seqs=shape.max_num_seqs, max_num_tokens=shape.max_num_tokens,
                    max_capture_size=shape.max_num_tokens, mode="full")
    start = cg.CapturePlan.build(**settings)
    served: list[cg.BatchDescriptor] = []

    class Recorded(hf.Engine):
        def _run(self, batch: Any) -> torch.Tensor:
            served.append(cg.BatchDescriptor(sum(n for _, n in batch), len(batch), uniform=all(n == 1 for _, n in batch)))
            return super()._run(batch)

    adapt = cg.Adaptation(max_graphs=budget, settings=settings, every_steps=every, min_steps=every)
    reg = hf.build_registry(model, shape, "full", adapt=adapt)
    eng = Recorded(model, shape, reg, keep_logits=True)
    res = eng.serve(hf.trace_requests(requests, shape, model.config.vocab_size, 96, 48))
    reg.wait_captured()
    err = hf.check_against_hf(model, res.finished)
    held = cg.CapturePlan.of((e.key, e.strategy) for e in reg.entries())
    offline = cg.CapturePlan.fit(served, budget, **settings)

    def padding(plan: cg.CapturePlan) -> float:
        r = evaluate(plan, served)
        return r.padded_tokens / max(1, r.padded_tokens + r.real_tokens) * 100

    p_default, p_adapted, p_offline = padding(start), padding(held), padding(offline)
    changes = reg.plan_changes
    print(f"hf llama adaptation: {res.steps} steps, {len(changes)} plan changes ({sum(len(c.added) for c in changes)} keys added), "
          f"{len(reg)} graphs held (budget {budget}), failures {len(reg.failures())}; max|logit - HF| {err:.3g}")
    print(f"  padding over the {len(served)} steps served: default {p_default:.2f}%, adapted {p_adapted:.2f}%, "
          f"fitted offline {p_offline:.2f}%; adapted / offline "
          + (f"{p_adapted / p_offline:.2f}" if p_offline else "n/a (the offline plan pads nothing)"))
    rows.append(("hf adapt: steps / changes / max |logit - HF|", f"{res.steps} / {len(changes)} / {err:.3g}"))
    rows.append(("hf adapt: padding default / adapted / offline", f"{p_default:.2f}% / {p_adapted:.2f}% / {p_offline:.2f}%"))


# ----------------------------------------------------------------------------- 2. HF Llama engine


def _load_hf() -> Any:
    """examples/hf_llama.py as a module."""
    if "hf_llama" in sys.modules:
        return sys.modules["hf_llama"]
    spec = importlib.util.spec_from_file_location("hf_llama", Path(__file__).parent.parent / "examples" / "hf_llama.py")
    hf = importlib.util.module_from_spec(spec)
    sys.modules["hf_llama"] = hf
    spec.loader.exec_module(hf)  # type: ignore[union-attr]
    return hf


def hf_llama(requests: int, rows: list[tuple[str, str]]) -> None:
    hf = _load_hf()
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
    parser.add_argument("--adapt", action="store_true")
    parser.add_argument("--adapt-steps", type=int, default=8000)
    parser.add_argument("--adapt-every", type=int, default=1000)
    parser.add_argument("--hf-adapt", action="store_true")
    parser.add_argument("--hf-adapt-requests", type=int, default=1024)
    parser.add_argument("--hf-adapt-graphs", type=int, default=12)
    parser.add_argument("--hf-adapt-every", type=int, default=100)
    parser.add_argument("--no-demo", action="store_true", help="skip part 1")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    rows: list[tuple[str, str]] = []
    if not args.no_demo:
        demo(args.steps, args.ablate, rows)
    if args.adapt:
        adaptation(args.adapt_steps, args.adapt_every, rows)
    if args.hf:
        hf_llama(args.requests, rows)
    if args.hf_adapt:
        hf_adaptation(args.hf_adapt_requests, args.hf_adapt_every, args.hf_adapt_graphs, rows)
    print("\nsummary")
    for name, value in rows:
        print(f"  {name:55s} {value}")


if __name__ == "__main__":
    main()
