"""Background capture and adaptation on the GPU, one process: start-up, step latency while capturing, padding.

1. The demo decoder (12 x 1024 bf16), ``CapturePlan.build(max_num_seqs=64, max_num_tokens=256,
   mode="full")`` (19 keys), decode batches of 1..64 requests with ``run()`` called back to back in
   two loops: a sync of the serving stream after each step (a sampler reading tokens), and no host
   sync at all (async scheduling).  Reported against the foreground capture time and eager's p99
   in the same loop: the first graph-served step (its index and time), every key captured, p99 step
   latency while capturing; every graph then checked against eager.
2. The engine of examples/hf_llama.py (Llama-3.2-1B shape, random weights, bf16) serves trace
   requests eagerly, then with ``full_and_breakable`` captured in the background; the same figures,
   and every logit checked against Hugging Face's own forward.
3. Adaptation (``--adapt``): the demo decoder adapting from vLLM's default ladder; see ``adaptation``.
   ``--hf-adapt``: the same for the HF Llama engine; see ``hf_adaptation``.

    PYTHONPATH=. python3 benchmarks/gpu_adaptive.py [--steps 4000] [--hf] [--adapt [--adapt-steps 8000]] [--hf-adapt] [--no-demo]
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
from cgregistry.capture.queue import capture_order
from cgregistry.demo_model import DemoConfig, DemoDecoder, demo_inputs, random_batch
from cgregistry.plan.workload import SchedulerConfig, read_trace, schedule


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


# ----------------------------------------------------------------------------- 1. demo decoder, two engine loops


class MissCounter:
    """Counts misses (a cgregistry_miss hook): a step with no miss was served by a graph; and notes when each
    capture finished."""

    def __init__(self) -> None:
        self.n = 0
        self.finished: list[float] = []

    @cg.plugin.hookimpl
    def cgregistry_miss(self, registry: Any, actual: Any) -> None:
        self.n += 1

    @cg.plugin.hookimpl
    def cgregistry_capture_finished(self, registry: Any, key: Any, strategy: str, entry: Any, error: Any) -> None:
        self.finished.append(time.perf_counter())


def loop_latencies(run: Callable[[Any, dict], Any], steps: list[tuple[Any, dict]], synced: bool) -> list[float]:
    """Per-step ms of ``run`` called back to back: with a sync of the serving stream after each (a sampler reading
    tokens), or host time alone (async scheduling: nothing between steps)."""
    out = []
    for batch, inputs in steps:
        t = time.perf_counter()
        run(batch, inputs)
        if synced:
            sync()
        out.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return out


def demo(n_steps: int, rows: list[tuple[str, str]]) -> None:
    """The demo decoder, a 19-key 'full' plan, decode batches run back to back in two loops."""
    device = torch.device("cuda")
    cfg = DemoConfig.for_device(device)
    model = DemoDecoder(cfg, device, seed=0)
    plan = cg.CapturePlan.build(max_num_seqs=64, max_num_tokens=256, mode="full")
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 65, (n_steps,), generator=gen).tolist()
    pool = {n: random_batch(cfg, cg.BatchDescriptor.decode(n), device, gen) for n in set(sizes)}
    steps = [(cg.BatchDescriptor.decode(n), pool[n]) for n in sizes]
    print(f"demo: {cfg.layers} x {cfg.hidden} {cfg.dtype}, plan 'full' {len(plan)} keys, decode batches of 1..64")

    with torch.inference_mode():
        loop_latencies(lambda b, i: model(b, **i), steps[:200], True)  # warm kernels and the allocator
        fg = cg.GraphRegistry(model, demo_inputs(cfg), name="fg")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fg.capture(plan)
        torch.cuda.synchronize()
        foreground_s = time.perf_counter() - t0
        per_key = statistics.median(e.capture_seconds for e in fg.entries())
        first_key = capture_order((e.descriptor, e.strategy) for e in plan)[0]
        first_key_s = next(e.capture_seconds for e in fg.entries() if (e.key, e.strategy) == first_key)
        fg.clear()
        print(f"  foreground capture {foreground_s * 1e3:.0f} ms ({len(plan)} keys, median {per_key * 1e3:.1f} ms a key)")
        rows.append(("demo: foreground capture", f"{foreground_s * 1e3:.0f} ms ({per_key * 1e3:.1f} ms a key)"))
        for synced in (True, False):
            label = "sync after each step" if synced else "no host sync between steps"
            eager = loop_latencies(lambda b, i: model(b, **i), steps, synced)
            eager_step = statistics.median(eager)
            misses = MissCounter()
            reg = cg.GraphRegistry(model, demo_inputs(cfg), name="bg", plugins=cg.Plugins(cg.plugin.make_plugin_manager([misses])))
            lat: list[float] = []
            first_graph = all_keys = first_index = None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            reg.capture(plan, background=True)
            k = 0
            deadline = t0 + 20.0
            while time.perf_counter() < deadline:
                batch, inputs = steps[k % len(steps)]
                before = misses.n
                t = time.perf_counter()
                reg.run(batch, **inputs)
                if synced:
                    sync()
                now = time.perf_counter()
                if all_keys is None:
                    lat.append((now - t) * 1e3)
                if first_graph is None and misses.n == before:
                    first_graph, first_index = now - t0, k + 1
                if all_keys is None and len(reg) == len(plan):
                    all_keys = now - t0
                k += 1
                if all_keys is not None and k >= 200:
                    break
            torch.cuda.synchronize()
            worst = 0.0
            for batch, inputs in steps[:64]:  # every graph against eager after the capture
                worst = max(worst, (reg.run(batch, **inputs).float() - model(batch, **inputs).float()).abs().max().item())
            p99, p99_eager = percentile(lat, 0.99), percentile(eager, 0.99)
            first_ms = f"step {first_index}, {first_graph * 1e3:.0f} ms" if first_graph is not None else "never"
            bg_seconds = sorted(e.capture_seconds for e in reg.entries())
            all_ms = f"{all_keys * 1e3:.0f} ms ({all_keys / foreground_s:.2f}x foreground)" if all_keys is not None else f"{len(reg)} of {len(plan)} in 20 s"
            print(f"  {label}: eager step median {eager_step:.2f} ms, p99 {p99_eager:.2f} ms")
            print(f"    capture seconds between the loop's steps: median {statistics.median(bg_seconds) * 1e3:.1f} ms, max {bg_seconds[-1] * 1e3:.1f} ms a key")
            print(f"    first graph-served step {first_ms} (target <= the first key, {first_key[0]}, + one step = "
                  f"{(first_key_s + eager_step / 1e3) * 1e3:.0f} ms); "
                  f"all keys {all_ms}; steps while capturing {summary(lat)}; p99 / eager p99 {p99 / p99_eager:.2f}; "
                  f"max |graph - eager| {worst:.3g}")
            rows.append((f"demo, {label}: first graph-served step", first_ms))
            rows.append((f"demo, {label}: all keys captured", all_ms))
            rows.append((f"demo, {label}: p99 while capturing / eager p99", f"{p99 / p99_eager:.2f} ({p99:.2f} / {p99_eager:.2f} ms)"))
            reg.clear()


# ----------------------------------------------------------------------------- 3. adaptation


def adaptation(n_steps: int, every: int, rows: list[tuple[str, str]]) -> None:
    """The demo decoder serves ``n_steps`` trace steps from vLLM's default ladder ('full', 51 graphs) with
    ``adapt=Adaptation(max_graphs=51, ...)``: refits and the new keys captured between steps.

    Reported: the refits (changes, keys added, seconds each), step latency while the
    registry refits or captures against the same steps served by a registry that keeps the
    default plan (its graphs), every 10th output against eager, and padding over all the steps of the default
    plan, the adapted keys, and a plan fitted offline to the same steps at the same budget.
    """
    from cgregistry.capture import refit as registry_module
    from cgregistry.plan.fit import evaluate

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
                busy = bool(reg.capturing())  # keys pending capture (a refit runs as a piece among them)
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
          f"refit seconds: median {statistics.median(refit_s) if refit_s else 0:.2f}, "
          f"max {max(refit_s, default=0):.2f}; graphs held at the end {len(reg)}; failures {len(reg.failures())}")
    print(f"  steps while refitting or capturing      {summary(window)}")
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
    rows.append(("adapt: refit (max)", f"{max(refit_s, default=0):.2f} s"))
    rows.append(("adapt: p99 while working / default plan", f"{ratio:.2f} ({summary(window)})"))
    rows.append(("adapt: every 10th step vs eager", f"{mismatches} mismatches, max abs error {worst:.3g}"))
    rows.append(("adapt: padding default / adapted / offline", f"{p_default:.2f}% / {p_adapted:.2f}% / {p_offline:.2f}% "
                 f"(adapted/offline {p_adapted / p_offline:.2f}, target <= 1.5)"))
    reg.clear()


def hf_adaptation(requests: int, every: int, budget: int, rows: list[tuple[str, str]]) -> None:
    """The Hugging Face Llama engine serves trace requests with ``adapt``: mode 'full' from its default plan,
    ``budget`` graphs (fewer than the plan's: the first refit brings it under), a refit due every ``every`` steps.  Padding of the default, adapted and offline-fitted keys over the steps
    it served, and every logit checked against Hugging Face's own forward."""
    from cgregistry.plan.fit import evaluate

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
        def run_step(self, batch: Any) -> torch.Tensor:
            served.append(cg.BatchDescriptor(sum(n for _, n in batch), len(batch), uniform=all(n == 1 for _, n in batch)))
            return super().run_step(batch)

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
    """On the engine of examples/hf_llama.py (Llama-3.2-1B shape, random weights, bf16,
    'full_and_breakable'): foreground capture time, then serving from creation with the plan captured in the
    background; every logit against Hugging Face's own forward."""
    hf = _load_hf()
    shape = hf.EngineShape(max_num_seqs=64, max_num_tokens=512, block_size=16, max_blocks_per_req=64)
    device = torch.device("cuda")
    model = hf.build_model("llama-3.2-1b", device, shape)
    mode = "full_and_breakable"

    class Timed(hf.Engine):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.lat: list[tuple[float, float, bool, bool]] = []  # (ms, seconds since t0, capturing, served by a graph)
            self.t0 = time.perf_counter()

        def run_step(self, batch: Any) -> torch.Tensor:
            reg = self.reg
            capturing = reg is not None and len(reg) < planned
            misses = counter.n
            t = time.perf_counter()
            out = super().run_step(batch)
            torch.cuda.current_stream().synchronize()
            now = time.perf_counter()
            self.lat.append(((now - t) * 1e3, now - self.t0, capturing, reg is not None and counter.n == misses))
            return out

    def reqs() -> list:
        return hf.trace_requests(requests, shape, model.config.vocab_size, 96, 48)

    counter = MissCounter()
    planned = 0
    eng = Timed(model, shape, None, keep_logits=False)
    eng.serve(hf.trace_requests(16, shape, model.config.vocab_size, 96, 48, seed=1))  # warm-up: every kernel, the allocator
    eng = Timed(model, shape, None, keep_logits=True)
    res = eng.serve(reqs())
    eager = [ms for ms, *_ in eng.lat]
    err_eager = hf.check_against_hf(model, res.finished)
    print(f"hf llama eager: {res.steps} steps, {res.tokens / res.seconds:.1f} tokens/s  {summary(eager)}  max|logit - HF| {err_eager:.3g}")
    rows.append(("hf eager step", summary(eager)))

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fg = hf.build_registry(model, shape, mode)
    torch.cuda.synchronize()
    foreground_s = time.perf_counter() - t0
    planned = len(fg)
    per_key = statistics.median(e.capture_seconds for e in fg.entries())
    fg.clear()
    print(f"hf llama foreground capture: {foreground_s:.2f} s ({planned} keys, median {per_key * 1e3:.0f} ms a key)")
    rows.append(("hf: foreground capture", f"{foreground_s:.2f} s ({per_key * 1e3:.0f} ms a key)"))

    torch.cuda.synchronize()
    eng = Timed(model, shape, None, keep_logits=True)
    eng.reg = reg = hf.build_registry(model, shape, mode, background=True, plugins=cg.Plugins(cg.plugin.make_plugin_manager([counter])))
    res = eng.serve(reqs())
    reg.wait_captured()
    err = hf.check_against_hf(model, res.finished)
    window = [ms for ms, _, capturing, _ in eng.lat if capturing]
    first = next((at for _, at, _, hit in eng.lat if hit), None)
    done = max(counter.finished) - eng.t0 if len(counter.finished) >= planned else None  # the last capture's end
    p99, p99_eager = percentile(window, 0.99) if window else float("nan"), percentile(eager, 0.99)
    eager_step = statistics.median(eager)
    print(f"hf llama background: {res.steps} steps, {res.tokens / res.seconds:.1f} tokens/s; {len(reg)} graphs; failures {len(reg.failures())}")
    print(f"  first graph-served step {first * 1e3 if first else float('nan'):.0f} ms after creation (target <= one key + one step "
          f"= {(per_key + eager_step / 1e3) * 1e3:.0f} ms); all keys at {done if done else float('nan'):.2f} s "
          f"({(done or float('nan')) / foreground_s:.2f}x foreground)")
    print(f"  steps while capturing {summary(window)}; p99 / eager p99 {p99 / p99_eager:.2f}; max|logit - HF| {err:.3g}")
    rows.append(("hf background: first graph-served step", f"{first * 1e3 if first else float('nan'):.0f} ms"))
    rows.append(("hf background: all keys captured", f"{done if done else float('nan'):.2f} s ({(done or float('nan')) / foreground_s:.2f}x foreground)"))
    rows.append(("hf background: p99 while capturing / eager p99", f"{p99 / p99_eager:.2f}"))
    rows.append(("hf background: max |logit - HF|", f"{err:.3g} (eager {err_eager:.3g})"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--hf", action="store_true")
    parser.add_argument("--requests", type=int, default=256)
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
        demo(args.steps, rows)
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
