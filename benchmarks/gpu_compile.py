"""torch.compile users: the registry over an Inductor-compiled model against mode="reduce-overhead", one process.

Demo decoder (12 x 1024, bf16) with its attention kernel as ``@eager_break``; ``reg.compile(...,
inductor=True)`` and a ``full_and_piecewise`` plan.  Per step (median µs): ``full`` keys at decode
batch 1, 8 and 64 (the pieces compiled once by Inductor, attention inline, in one graph), ``piecewise`` keys at
64 tokens (a mixed batch: the same pieces, attention eager between them), and
``torch.compile(mode="reduce-overhead", dynamic=True)`` of the same model.  Start-up: the whole
plan's trace, compile and capture against reduce-overhead's compile and warm-up over the same
token sizes.  Reduce-overhead runs after the registry has captured (its warm-up clears cuBLAS's
workspaces; the registry's graphs must keep working, and are checked again afterwards).

    PYTHONPATH=. python3 benchmarks/gpu_compile.py
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.inspection import CapturePhases
from cgregistry.demo_model import (
    DemoConfig,
    DemoDecoder,
    attention_kernel_into,
    demo_inputs,
    random_batch,
)

sys.path.insert(0, str(Path(__file__).parent))
from timing import per_call_us, reduce_overhead_warmed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--ro-first", action="store_true",
                        help="only check: reduce-overhead warms up and records first, then the registry captures and replays")
    parser.add_argument("--unprotected", action="store_true",
                        help="with --ro-first: leave cuBLAS's workspaces alone around captures (the backend's old behaviour)")
    parser.add_argument("--profile", action="store_true", help="cProfile the registry's start-up (top 45 by cumulative time)")
    parser.add_argument("--skip-ro", action="store_true", help="the registry's start-up and steps only")
    args = parser.parse_args()
    if args.unprotected:
        from cgregistry.backends import cuda as cuda_backend

        cuda_backend.clear_cublas_workspaces = lambda: None
    cfg = DemoConfig.for_device("cuda")
    model = DemoDecoder(cfg, "cuda", seed=0, attention=cg.eager_break(attention_kernel_into))
    fn = lambda input_ids, req_idx, seq_lens: model(None, input_ids, req_idx, seq_lens)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    warm = torch.compile(lambda x: x * 2, backend="eager", dynamic=True)  # load dynamo outside both start-ups
    warm(torch.ones(3, device="cuda"))
    warm(torch.ones(5, device="cuda"))

    plan = cg.CapturePlan.build(max_num_seqs=args.max_num_seqs, max_num_tokens=cfg.max_num_tokens, mode="full_and_piecewise")
    sizes = sorted({e.descriptor.num_tokens for e in plan}, reverse=True)
    if args.ro_first:
        ro_first_check(args, cfg, model, fn, plan, sizes, gen)
        return
    reg = cg.GraphRegistry(lambda batch, **inputs: compiled(**inputs), demo_inputs(cfg), backend="cuda")
    compiled = reg.compile(fn, inductor=True)
    torch.cuda.synchronize()
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    with torch.inference_mode():
        if profiler is not None:
            profiler.enable()
        reg.capture(plan, progress=False)
        if profiler is not None:
            profiler.disable()
    torch.cuda.synchronize()
    reg_startup = time.perf_counter() - start
    startup_breakdown(reg, reg_startup)
    reports = compiled.compiler.traces
    print(f"  {len(reports)} trace(s): " + "; ".join(f"{r.pieces} pieces, {r.compiles} Inductor compiles" for r in reports)
          + f"; phases {CapturePhases.of(reg.entries()).summary()}")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)

    def per_step(run: object, batch: B, inputs: dict) -> tuple[float, float]:
        with torch.inference_mode():
            want = model(batch, **inputs).float()
            err = (run().float() - want).abs().max().item()  # type: ignore[operator]
            return per_call_us(run, args.iters), err  # type: ignore[arg-type]

    batches = {f"decode {n}": B.decode(n) for n in (1, 8, 64)}
    batches["mixed 64 tokens"] = B(64, 16)
    batches["decode 64, no full"] = B.decode(64)  # the same batch as decode 64, served by its piecewise key
    inputs = {k: random_batch(cfg, b, "cuda", gen) for k, b in batches.items()}
    inputs["decode 64, no full"] = inputs["decode 64"]
    excluded = {"decode 64, no full": ("full",)}
    reg_rows = {}
    for label, batch in batches.items():
        exclude = excluded.get(label)
        strategy = reg.match(batch, exclude=exclude).strategy
        us, err = per_step(lambda b=batch, i=inputs[label], x=exclude: reg.run(b, exclude=x, **i), batch, inputs[label])
        reg_rows[label] = (strategy, us, err)
    if args.skip_ro:
        for label, (strategy, us, err) in reg_rows.items():
            print(f"{label:16} {strategy:10} {us:9.1f} us  err {err:.2g}")
        return

    ro, ro_startup = reduce_overhead_warmed(fn, cfg, sizes, gen)
    ro_rows = {label: per_step(lambda i=inputs[label]: ro(**i), batch, inputs[label]) for label, batch in batches.items()}
    # The registry's graphs after reduce-overhead's warm-up and recordings (which clear cuBLAS's workspaces).
    after = {label: per_step(lambda b=batch, i=inputs[label], x=excluded.get(label): reg.run(b, exclude=x, **i),
                             batch, inputs[label])[1]
             for label, batch in batches.items()}

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; demo decoder {cfg.layers} x {cfg.hidden}, "
          f"{cfg.dtype}; plan: {len(plan)} keys over {len(sizes)} token sizes")
    print(f"{'batch':16} {'strategy':10} {'registry us':>12} {'reduce-overhead us':>19} {'reg/ro':>7} {'reg err':>8} {'ro err':>8} {'reg err after ro':>16}")
    for label in batches:
        strategy, us, err = reg_rows[label]
        ro_us, ro_err = ro_rows[label]
        print(f"{label:16} {strategy:10} {us:12.1f} {ro_us:19.1f} {us / ro_us:7.3f} {err:8.2g} {ro_err:8.2g} {after[label]:16.2g}")
    full64 = reg_rows["decode 64"][1]
    print(f"piecewise (mixed 64 tokens) / full (decode 64): {reg_rows['mixed 64 tokens'][1] / full64:.3f}; "
          f"piecewise / full on the same decode-64 batch: {reg_rows['decode 64, no full'][1] / full64:.3f}")
    print(f"start-up over {len(sizes)} token sizes: registry {reg_startup:.1f} s ({len(plan)} graphs), "
          f"reduce-overhead {ro_startup:.1f} s, ratio {ro_startup / reg_startup:.2f}x")


def startup_breakdown(reg: cg.GraphRegistry, total: float) -> None:
    """Where the registry's start-up went: each entry's capture seconds (the first of a kind pays its compile)."""
    entries = sorted(reg.entries(), key=lambda e: -e.capture_seconds)
    by_strategy: dict[str, list[float]] = {}
    for e in entries:
        by_strategy.setdefault(e.strategy, []).append(e.capture_seconds)
    print(f"registry start-up {total:.2f} s: " + "; ".join(
        f"{name} {len(secs)} keys {sum(secs):.2f} s" for name, secs in by_strategy.items()))
    print("  slowest entries: " + ", ".join(f"{e.strategy} {e.key.num_tokens}t {e.capture_seconds:.2f} s" for e in entries[:6]))
    rest = sorted(e.capture_seconds for e in entries[6:])
    if rest:
        print(f"  the other {len(rest)}: median {rest[len(rest) // 2] * 1e3:.0f} ms, max {rest[-1] * 1e3:.0f} ms")


def ro_first_check(args: argparse.Namespace, cfg: DemoConfig, model: DemoDecoder, fn: object, plan: cg.CapturePlan,
                   sizes: list[int], gen: torch.Generator) -> None:
    """Reduce-overhead's warm-up and recordings first, then the registry: every replay checked against eager."""
    ro, _ = reduce_overhead_warmed(fn, cfg, sizes, gen)
    reg = cg.GraphRegistry(lambda batch, **inputs: compiled(**inputs), demo_inputs(cfg), backend="cuda")
    compiled = reg.compile(fn, inductor=True)
    worst = 0.0
    with torch.inference_mode():
        reg.capture(plan, progress=False)
        for _ in range(3):
            for batch in (B.decode(1), B.decode(8), B.decode(64), B(64, 16), B(200, 40)):
                inputs = random_batch(cfg, batch, "cuda", gen)
                ro(**inputs)  # reduce-overhead keeps running between the registry's replays
                worst = max(worst, (reg.run(batch, **inputs).float() - model(batch, **inputs).float()).abs().max().item())
        torch.cuda.synchronize()
    print(f"ro-first{' (unprotected)' if args.unprotected else ''}: {len(reg)} graphs replayed after reduce-overhead, "
          f"max |registry - eager| {worst:.3g}")


if __name__ == "__main__":
    main()
