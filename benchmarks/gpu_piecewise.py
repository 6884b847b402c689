"""GPU benchmark of the `piecewise` strategy: per-step time and whole-plan start-up.

One process; the demo model (12 x 1024, bf16) with its attention kernel marked as
an eager break (the default splitting op), so `piecewise` and `breakable` cut it
at the same 12 places.

Per step, at batch 1, 8 and 64 (uniform decode), median µs:
  eager       the model run eagerly
  full        reg.run() with a full graph
  piecewise   reg.run() over the piecewise-compiled model (13 pieces, 12 splits)
  breakable   reg.run() with the breakable strategy (13 segments, 12 eager breaks)
  pw_inductor piecewise with Inductor-compiled pieces (--inductor)
  ro          torch.compile(mode="reduce-overhead", dynamic=True) of the same model, run last
The floor: one graph-to-eager-to-graph transition (timing.transition_floor_us), measured in the same
process, and what piecewise over Inductor costs over ro per split, held against it.

Start-up over the same 35 sizes (1, 2, 4, 8, 16, 24, ..., 256 tokens):
  piecewise   dynamo trace + split + capture of every size (reg.compile, reg.capture)
  ro          compile + warm-up (3 calls per size, which records each size's graph)

Before either start-up, dynamo itself is loaded by compiling a one-line function
(its first use imports and byte-compiles seconds of Python in a fresh process).

Memory: pool growth of the 35-size plan over the largest entry alone, for
piecewise and breakable (breaks hold pool-resident arguments without owning them).

Run: PYTHONPATH=. python3 benchmarks/gpu_piecewise.py [--inductor] [--skip-ro]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.demo_model import (
    DemoConfig,
    DemoDecoder,
    attention_kernel_into,
    demo_inputs,
    random_batch,
)
from cgregistry.plan import default_ladder

try:
    from benchmarks.timing import per_call_us, reduce_overhead_warmed, transition_floor_us
except ImportError:  # run as a script from benchmarks/
    from timing import per_call_us, reduce_overhead_warmed, transition_floor_us  # type: ignore[no-redef]

SIZES = (1, 8, 64)
PLAN_SIZES = sorted(default_ladder(256), reverse=True)  # 35 sizes


def reserved_growth(capture: object) -> int:
    """Bytes the caching allocator reserved while ``capture()`` ran (cache emptied first)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    capture()  # type: ignore[operator]
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() - before


def piecewise_registry(
    model: DemoDecoder, cfg: DemoConfig, sizes: list[int], inductor: bool = False
) -> tuple[cg.GraphRegistry, cg.PiecewiseModel, float, float]:
    reg = cg.GraphRegistry(lambda batch, **inputs: compiled(**inputs), demo_inputs(cfg), backend="cuda")
    compiled = reg.compile(lambda input_ids, req_idx, seq_lens: model(None, input_ids, req_idx, seq_lens), inductor=inductor)
    torch.cuda.synchronize()
    start = time.perf_counter()
    reg.capture([(B(n), "piecewise") for n in sizes], progress=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return reg, compiled, seconds, sum(e.capture_seconds for e in reg.entries())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--skip-ro", action="store_true", help="leave out torch.compile reduce-overhead")
    parser.add_argument("--inductor", action="store_true", help="also piecewise with Inductor-compiled pieces")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = DemoConfig.for_device("cuda")
    model = DemoDecoder(cfg, "cuda", seed=0, attention=cg.eager_break(attention_kernel_into))
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    # Both start-ups use dynamo: load it first (its first use imports and compiles seconds of
    # Python), so neither figure includes that; Inductor's own imports stay in reduce-overhead's.
    warm = torch.compile(lambda x: x * 2, backend="eager", dynamic=True)
    warm(torch.ones(3, device="cuda"))
    warm(torch.ones(5, device="cuda"))

    # ---- start-up of piecewise (a fresh trace); reduce-overhead's comes last
    piecewise, compiled, pw_seconds, _ = piecewise_registry(model, cfg, PLAN_SIZES)
    results["startup"] = {"sizes": len(PLAN_SIZES), "piecewise_s": pw_seconds, "traces": len(compiled.compiler.traces),
                          "pieces": compiled.compiler.pieces}
    if args.inductor:
        pw_inductor, _, seconds, _ = piecewise_registry(model, cfg, PLAN_SIZES, inductor=True)
        results["startup"]["piecewise_inductor_s"] = seconds  # type: ignore[index]
    gen = torch.Generator().manual_seed(0)

    # ---- per step
    full = cg.GraphRegistry(model, demo_inputs(cfg), backend="cuda")
    full.capture([(B.decode(n), "full") for n in sorted(SIZES, reverse=True)], progress=False)
    breakable = cg.GraphRegistry(model, demo_inputs(cfg), backend="cuda")
    breakable.capture([(B(n), "breakable") for n in sorted(SIZES, reverse=True)], progress=False)
    rows = []
    for n in SIZES:
        batch = B.decode(n)
        inputs = random_batch(cfg, batch, "cuda", gen)
        with torch.inference_mode():
            want = model(batch, **inputs).float()
            runs = {
                "eager": lambda: model(batch, **inputs),
                "full": lambda: full.run(batch, **inputs),
                "piecewise": lambda: piecewise.run(batch, **inputs),
                "breakable": lambda: breakable.run(batch, **inputs),
            }
            if args.inductor:
                runs["pw_inductor"] = lambda: pw_inductor.run(batch, **inputs)
            errors = {}
            for k, fn in runs.items():
                if k != "eager":
                    if os.environ.get("CGREGISTRY_BENCH_TRACE"):
                        print(f"checking {k} at batch {n}", flush=True)
                    errors[k] = (fn().float() - want).abs().max().item()
            assert piecewise.match(batch).strategy == "piecewise" and full.match(batch).strategy == "full"
            t = {k: per_call_us(fn, args.iters) for k, fn in runs.items()}
        rows.append({"batch": n, **{f"{k}_us": v for k, v in t.items()}, "piecewise_over_full": t["piecewise"] / t["full"],
                     "piecewise_over_breakable": t["piecewise"] / t["breakable"], "max_abs_err": max(errors.values()),
                     **{f"{k}_err": v for k, v in errors.items()}})
    results["steps"] = rows
    del full, breakable, piecewise
    if args.inductor:
        del pw_inductor
    gc.collect()

    # ---- memory: the whole plan against its largest entry alone
    memory = {}
    for strategy in ("breakable", "piecewise"):
        def registry() -> tuple[cg.GraphRegistry, object]:
            if strategy == "piecewise":
                reg = cg.GraphRegistry(lambda batch, **inputs: step(**inputs), demo_inputs(cfg), backend="cuda")
                step = reg.compile(lambda input_ids, req_idx, seq_lens: model(None, input_ids, req_idx, seq_lens))
                with torch.inference_mode():  # trace outside the measurement
                    step(**random_batch(cfg, B(4, 2), "cuda", gen))
                return reg, step
            return cg.GraphRegistry(model, demo_inputs(cfg), backend="cuda"), None

        one, keep_one = registry()
        largest = reserved_growth(lambda: one.capture([(B(PLAN_SIZES[0]), strategy)], progress=False))
        whole, keep_whole = registry()
        plan = reserved_growth(lambda: whole.capture([(B(n), strategy) for n in PLAN_SIZES], progress=False))
        memory[strategy] = {"largest_mib": largest / 2**20, "plan_mib": plan / 2**20, "ratio": plan / max(largest, 1)}
        del one, whole, keep_one, keep_whole
        gc.collect()
    results["memory"] = memory

    # ---- reduce-overhead last, as when this benchmark was written: its warm-up clears cuBLAS's workspaces,
    # which made a later registry replay fault until the cuda backend cleared them around its own captures
    # (benchmarks/gpu_compile.py --ro-first checks that order).
    ro = None
    if not args.skip_ro:
        ro, results["startup"]["ro_s"] = reduce_overhead_warmed(  # type: ignore[index]
            lambda input_ids, req_idx, seq_lens: model(None, input_ids, req_idx, seq_lens), cfg, PLAN_SIZES, gen
        )
        with torch.inference_mode():
            for row in rows:
                batch = B.decode(row["batch"])
                inputs = random_batch(cfg, batch, "cuda", gen)
                want = model(batch, **inputs).float()
                row["ro_err"] = (ro(**inputs).float() - want).abs().max().item()
                row["ro_us"] = per_call_us(lambda: ro(**inputs), args.iters)

    # The floor every split pays, measured in this process: what piecewise over Inductor costs over reduce-overhead,
    # per split, is held against it.
    splits = max(results["startup"]["pieces"] - 1, 1)  # type: ignore[index]
    results["transition_floor_us"] = floor = transition_floor_us(breaks=splits)

    s = results["startup"]
    print(f"\n{results['device']}, torch {results['torch']}; piecewise: {s['pieces']} pieces, {s['traces']} trace(s)")
    cols = ["eager", "full", "piecewise", "breakable"] + (["pw_inductor"] if args.inductor else []) + (["ro"] if ro is not None else [])
    print(f"{'batch':>5} " + " ".join(f"{c + ' us':>13}" for c in cols) + f" {'pw/full':>8} {'pw/brk':>7} {'max err':>8}")
    for r in rows:
        print(f"{r['batch']:>5} " + " ".join(f"{r[c + '_us']:13.1f}" for c in cols)
              + f" {r['piecewise_over_full']:8.3f} {r['piecewise_over_breakable']:7.3f} {max(r['max_abs_err'], r.get('ro_err', 0)):8.2g}")
    line = f"graph-to-eager-to-graph transition floor: {floor:.2f} us"
    if args.inductor and ro is not None:
        line += "; pw_inductor over ro per split: " + " / ".join(
            f"{(r['pw_inductor_us'] - r['ro_us']) / splits:.2f}" for r in rows) + f" us at batch {' / '.join(str(r['batch']) for r in rows)}"
    print(line)
    line = f"start-up over {s['sizes']} sizes: piecewise {s['piecewise_s']:.2f} s"
    if "piecewise_inductor_s" in s:
        line += f", piecewise with Inductor pieces {s['piecewise_inductor_s']:.2f} s"
    if "ro_s" in s:
        line += f", reduce-overhead {s['ro_s']:.2f} s, ratio {s['ro_s'] / s['piecewise_s']:.1f}x"
    print(line)
    for strategy, m in memory.items():
        print(f"memory {strategy}: plan {m['plan_mib']:.1f} MiB, largest alone {m['largest_mib']:.1f} MiB, ratio {m['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
